package frontproxy_test

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/enginesim"
	"github.com/kvepp/kvepp/enginesim/frontproxy"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/runner"
)

// TestProxyWithKvepp puts the proxy between a client, the real kvepp (runner.Start, approximate
// mode) and two simulated vLLM workers: requests with the same token prompt are routed to one
// worker, stream back complete, and leave no booking behind.
func TestProxyWithKvepp(t *testing.T) {
	pool, err := enginesim.NewPool(2, enginesim.Config{TimeScale: 0.01, PrefillPerToken: time.Millisecond, DecodePerToken: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	cfg := runner.DefaultConfig()
	cfg.BindAddress = "127.0.0.1"
	cfg.GRPCPort, cfg.GRPCHealthPort, cfg.SelectionHTTPPort, cfg.MetricsPort = 0, 0, 0, 0
	cfg.SecureServing = false
	cfg.UseKVEvents = false
	cfg.TokenizerProtocol = runner.TokenizerProtocolNone
	cfg.DrainTimeout = 0
	cfg.LogLevel = "error"
	inst, err := runner.Start(context.Background(), runner.Options{Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Stop(context.Background())
	byAddr := map[string]int{}
	for i, w := range pool.Workers() {
		bs := uint32(16)
		rec := picker.WorkerRecord{WorkerID: uint64(i + 1), ModelName: enginesim.DefaultModel, Endpoint: w.Endpoint(), BlockSize: &bs}
		if _, err := inst.Service.UpsertWorker(context.Background(), rec, picker.SourceAPI); err != nil {
			t.Fatal(err)
		}
		byAddr[strings.TrimPrefix(w.Endpoint(), "http://")] = i
	}
	conn, err := frontproxy.Dial(inst.Addrs().GRPC, false)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	exchanges := make(chan frontproxy.Exchange, 8)
	p, err := frontproxy.New(frontproxy.Config{ExtProc: conn, Observe: func(ex frontproxy.Exchange) { exchanges <- ex }})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := frontproxy.Start("", p)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	prompt := make([]string, 200)
	for i := range prompt {
		prompt[i] = strconv.Itoa(1000 + i)
	}
	body := []byte(fmt.Sprintf(`{"model":%q,"prompt":[%s],"max_tokens":4,"stream":true}`, enginesim.DefaultModel, strings.Join(prompt, ",")))
	var workers []int
	for i := 0; i < 3; i++ {
		resp, got := post(t, srv.URL()+"/v1/completions", body, map[string]string{"X-Request-Id": fmt.Sprintf("k%d", i)})
		ex := <-exchanges
		if resp.StatusCode != http.StatusOK || !strings.HasSuffix(string(got), "data: [DONE]\n\n") {
			t.Fatalf("request %d: status %d body %q", i, resp.StatusCode, got)
		}
		w, ok := byAddr[ex.Served]
		if !ok || ex.Destination != ex.Served || ex.Decision <= 0 || ex.Err != nil {
			t.Fatalf("request %d: exchange %+v", i, ex)
		}
		if ex.WorkerID != strconv.Itoa(w+1) {
			t.Fatalf("request %d: x-dynamo-worker-instance-id %q for worker %d", i, ex.WorkerID, w+1)
		}
		workers = append(workers, w)
	}
	if workers[1] != workers[0] || workers[2] != workers[0] {
		t.Fatalf("the same prompt went to workers %v; kvepp's approximate index should keep it on one", workers)
	}
	if got := pool.Worker(workers[0]).Stats().Requests; got != 3 {
		t.Fatalf("worker %d completed %d requests, want 3", workers[0], got)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		busy := uint64(0)
		for _, pl := range inst.Service.Loads("", "") {
			for _, l := range pl.Loads {
				busy += l.ActiveRequests
			}
		}
		if busy == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d bookings still active after every response ended", busy)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
