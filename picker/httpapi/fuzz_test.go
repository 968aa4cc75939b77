package httpapi_test

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/httpapi"
)

// Fuzz targets for the request decoding of every POST (and the PATCH) route: whatever the body,
// the handler must not panic, must answer a documented status with a JSON body, and must never
// answer 5xx except the documented ones (503 not ready / no endpoints; 500 only for a
// non-finite cost, §17.2). Seed corpora live in testdata/fuzz/<FuzzName>/.

// fuzzHandler is a handler over a core with two workers (one with two ranks), a live booking
// "live", a pending selection "pend" and session affinity on.
func fuzzHandler(f *testing.F) http.Handler {
	f.Helper()
	cfg := picker.DefaultConfig()
	cfg.Router.UseKVEvents = false
	cfg.SessionAffinityTTL = time.Minute
	cfg.RandSource = func() rand.Source { return rand.NewPCG(1, 2) }
	core, err := picker.New(cfg)
	if err != nil {
		f.Fatal(err)
	}
	h := httpapi.New(core, httpapi.Options{})
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/workers", `{"worker_id":1,"model_name":"model","endpoint":"http://w1","block_size":4,"data_parallel_size":2}`},
		{"POST", "/workers", `{"worker_id":2,"model_name":"model","endpoint":"http://w2","block_size":4,"taints":["gpu"]}`},
		{"POST", "/select_and_reserve", `{"selection_id":"live","model_name":"model","token_ids":[1,2,3,4,5,6,7,8]}`},
		{"POST", "/select", `{"selection_id":"pend","model_name":"model","token_ids":[1,2,3,4]}`},
	} {
		if st, body := serve(h, c.method, c.path, []byte(c.body)); st >= 300 {
			f.Fatalf("fixture %s %s = %d %s", c.method, c.path, st, body)
		}
	}
	return h
}

func serve(h http.Handler, method, path string, body []byte) (int, []byte) {
	req := httptest.NewRequest(method, path, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec.Code, rec.Body.Bytes()
}

var documentedStatus = map[int]bool{200: true, 201: true, 400: true, 404: true, 409: true, 413: true, 415: true, 422: true, 503: true}

// checkResponse asserts the §2 response contract for one fuzzed call.
func checkResponse(t *testing.T, method, path string, body []byte, st int, resp []byte) {
	t.Helper()
	var v any
	if err := json.Unmarshal(resp, &v); err != nil {
		t.Fatalf("%s %s %q: response %q is not JSON: %v", method, path, body, resp, err)
	}
	if st >= 300 {
		m, ok := v.(map[string]any)
		msg, _ := m["error"].(string)
		if !ok || msg == "" {
			t.Fatalf("%s %s %q: error body %s has no error message", method, path, body, resp)
		}
		if st == 500 && strings.Contains(msg, "non-finite") {
			return // documented: a non-finite cost is a policy failure (§17.2)
		}
	}
	if !documentedStatus[st] {
		t.Fatalf("%s %s %q: undocumented status %d %s", method, path, body, st, resp)
	}
}

func fuzzBody(f *testing.F, method, path string) {
	h := fuzzHandler(f)
	f.Fuzz(func(t *testing.T, body []byte) {
		st, resp := serve(h, method, path, body)
		checkResponse(t, method, path, body, st, resp)
	})
}

func fuzzIDAndBody(f *testing.F, method string, path func(id string) string) {
	h := fuzzHandler(f)
	f.Fuzz(func(t *testing.T, id string, body []byte) {
		if id == "" {
			id = "x"
		}
		p := path(url.PathEscape(id))
		st, resp := serve(h, method, p, body)
		checkResponse(t, method, p, body, st, resp)
	})
}

func FuzzPostWorkers(f *testing.F)      { fuzzBody(f, "POST", "/workers") }
func FuzzSelect(f *testing.F)           { fuzzBody(f, "POST", "/select") }
func FuzzSelectAndReserve(f *testing.F) { fuzzBody(f, "POST", "/select_and_reserve") }
func FuzzReservations(f *testing.F)     { fuzzBody(f, "POST", "/reservations") }
func FuzzPotentialLoads(f *testing.F)   { fuzzBody(f, "POST", "/potential_loads") }
func FuzzOverlapScores(f *testing.F)    { fuzzBody(f, "POST", "/overlap_scores") }
func FuzzRegisterPeer(f *testing.F)     { fuzzBody(f, "POST", "/replica_sync/register_peer") }
func FuzzDeregisterPeer(f *testing.F)   { fuzzBody(f, "POST", "/replica_sync/deregister_peer") }
func FuzzPatchWorker(f *testing.F) {
	fuzzIDAndBody(f, "PATCH", func(id string) string { return "/workers/" + id })
}
func FuzzPrefillComplete(f *testing.F) {
	fuzzIDAndBody(f, "POST", func(id string) string { return "/reservations/" + id + "/prefill_complete" })
}
func FuzzOutputBlock(f *testing.F) {
	fuzzIDAndBody(f, "POST", func(id string) string { return "/reservations/" + id + "/output_block" })
}
func FuzzDeleteReservation(f *testing.F) {
	fuzzIDAndBody(f, "DELETE", func(id string) string { return "/reservations/" + id })
}
