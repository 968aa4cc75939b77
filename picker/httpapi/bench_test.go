package httpapi_test

import (
	"bytes"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/httpapi"
	"github.com/kvepp/kvepp/picker/pickertest"
)

// BenchmarkHTTPSelectAndReservePaced measures POST /select_and_reserve over a real loopback HTTP
// listener at a paced (open-loop) 2,000 requests/s: request i is sent at start + i × 500 µs
// whatever the latency of the earlier ones, and each booking is freed right after its response.
// The partition has 32 workers (block size 16) with KV events on, 16 of them holding device
// prefixes of the 512-token prompt (2..32 blocks). It reports the select_and_reserve latency
// percentiles p50-µs and p99-µs and the achieved req/s; b.N is the number of requests, so
// -benchtime 10000x paces for 5 s:
//
//	go test -run '^$' -bench HTTPSelectAndReservePaced -benchtime 10000x ./picker/httpapi/
func BenchmarkHTTPSelectAndReservePaced(b *testing.B) {
	const rate = 2000
	src := pickertest.NewEventSource()
	cfg := picker.DefaultConfig()
	cfg.EventSource = src
	cfg.RandSource = func() rand.Source { return rand.NewPCG(1, 2) }
	core, err := picker.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	srv := httptest.NewServer(httpapi.New(core, httpapi.Options{}))
	defer srv.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 512, MaxIdleConnsPerHost: 512}}
	post := func(method, path string, body []byte) (int, []byte) {
		req, _ := http.NewRequest(method, srv.URL+path, bytes.NewReader(body))
		if body != nil {
			req.Header.Set("Content-Type", "application/json")
		}
		resp, err := client.Do(req)
		if err != nil {
			return 0, []byte(err.Error())
		}
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, out
	}
	hs := kvindex.BlockHashes(toks(512), 16, kvindex.BaseSeed)
	for id := 1; id <= 32; id++ {
		st, out := post("POST", "/workers", []byte(f(`{"worker_id":%d,"model_name":"model","endpoint":"http://w%d:8000","block_size":16,"kv_events_endpoint":"tcp://w%d:1"}`, id, id, id)))
		if st != 201 {
			b.Fatalf("register: %d %s", st, out)
		}
		if id <= 16 {
			src.Store(b, uint64(id), 0, kvindex.TierDevice, nil, hs[:2*id]...)
		}
	}
	bodyHead := []byte(`{"model_name":"model",` + tokJSON(512) + `,"selection_id":"`)
	lat := make([]time.Duration, b.N)
	failed := make([]string, 0)
	var mu sync.Mutex
	var wg sync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < b.N; i++ {
		if d := time.Until(start.Add(time.Duration(i) * time.Second / rate)); d > 0 {
			time.Sleep(d)
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			id := "b" + strconv.Itoa(i)
			body := append(append(slices.Clip(bodyHead), id...), `"}`...)
			t0 := time.Now()
			st, out := post("POST", "/select_and_reserve", body)
			lat[i] = time.Since(t0)
			if st != 200 {
				mu.Lock()
				failed = append(failed, string(out))
				mu.Unlock()
				return
			}
			post("DELETE", "/reservations/"+id, nil)
		}(i)
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	if len(failed) > 0 {
		b.Fatalf("%d requests failed, first: %s", len(failed), failed[0])
	}
	slices.Sort(lat)
	pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))]) / float64(time.Microsecond) }
	b.ReportMetric(pct(0.50), "p50-µs")
	b.ReportMetric(pct(0.99), "p99-µs")
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "req/s")
}
