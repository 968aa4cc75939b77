package httpapi_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/httpapi"
	"github.com/kvepp/kvepp/picker/pickertest"
)

// drainingServer serves a fresh core through a handler whose Options.Draining reads the returned
// flag, as the EPP runner wires its SIGTERM drain state.
func drainingServer(t *testing.T) (*httptest.Server, *picker.Service, *atomic.Bool) {
	t.Helper()
	core, err := picker.New(pickertest.Config(11, 3))
	if err != nil {
		t.Fatal(err)
	}
	var draining atomic.Bool
	srv := httptest.NewServer(httpapi.New(core, httpapi.Options{Draining: draining.Load}))
	t.Cleanup(srv.Close)
	return srv, core, &draining
}

func TestDrainingSidePort(t *testing.T) {
	srv, core, draining := drainingServer(t)
	register(t, srv, 1, "")
	register(t, srv, 2, "")
	if st, v := call(t, srv, "POST", "/select_and_reserve", `{"selection_id":"live","model_name":"model",`+prompt+`}`); st != 200 {
		t.Fatalf("booking before the drain = %d %v", st, v)
	}
	draining.Store(true)

	t.Run("GET /ready answers 503 with ready false while draining", func(t *testing.T) {
		st, v := call(t, srv, "GET", "/ready", "")
		if st != 503 || obj(t, v)["ready"] != false || obj(t, v)["schedulable_workers"] != 2.0 {
			t.Fatalf("/ready while draining = %d %v", st, v)
		}
	})
	t.Run("selecting and mutating calls answer 503 selection service is shutting down", func(t *testing.T) {
		for _, c := range []struct{ method, path, body string }{
			{"POST", "/select", `{"model_name":"model",` + prompt + `}`},
			{"POST", "/select_and_reserve", `{"model_name":"model",` + prompt + `}`},
			{"POST", "/reservations", `{"selection_id":"e","model_name":"model","worker_id":1,` + prompt + `}`},
			{"POST", "/potential_loads", `{"model_name":"model",` + prompt + `}`},
			{"POST", "/overlap_scores", `{"model_name":"model",` + prompt + `}`},
			{"POST", "/workers", `{"worker_id":3,"model_name":"model","endpoint":"http://w3","block_size":4}`},
			{"PATCH", "/workers/1", `{"total_kv_blocks":5}`},
			{"POST", "/reservations/live/prefill_complete", ""},
			{"POST", "/reservations/live/output_block", `{}`},
			{"DELETE", "/reservations/live", ""},
		} {
			st, v := call(t, srv, c.method, c.path, c.body)
			if st != 503 || errMsg(t, v) != "selection service is shutting down" {
				t.Errorf("%s %s while draining = %d %v, want 503", c.method, c.path, st, v)
			}
		}
	})
	t.Run("reads and worker deletion keep working", func(t *testing.T) {
		for _, c := range []struct{ method, path string }{
			{"GET", "/workers"}, {"GET", "/loads"}, {"GET", "/health"}, {"HEAD", "/health"}, {"GET", "/dump"}, {"DELETE", "/workers/2"},
		} {
			if st, raw := callRaw(t, srv, c.method, c.path, "", ""); st != 200 {
				t.Errorf("%s %s while draining = %d %s, want 200", c.method, c.path, st, raw)
			}
		}
	})
	t.Run("the core itself keeps routing in process for ext_proc", func(t *testing.T) {
		if core.ShuttingDown() {
			t.Fatal("draining the side port shut the core down")
		}
		sel, err := core.SelectAndReserve(t.Context(), picker.SelectRequest{ModelName: "model", SelectionID: "inproc",
			Prompt: picker.Prompt{TokenIDs: []uint32{1, 2, 3, 4}}})
		if err != nil || sel.WorkerID != 1 {
			t.Fatalf("in-process booking while draining = %+v, %v", sel, err)
		}
		if err := core.Free(t.Context(), "inproc"); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("the flag is read per request", func(t *testing.T) {
		draining.Store(false)
		if st, v := call(t, srv, "GET", "/ready", ""); st != 200 {
			t.Fatalf("/ready after the drain flag cleared = %d %v", st, v)
		}
		if st, v := call(t, srv, "DELETE", "/reservations/live", ""); st != 200 {
			t.Fatalf("free after the drain flag cleared = %d %v", st, v)
		}
	})
}

func TestRequestValidation(t *testing.T) {
	srv, _ := server(t)
	register(t, srv, 1, "")
	cases := []struct {
		name   string
		method string
		path   string
		body   string
		status int
		msg    string // exact error message; "" = success
	}{
		{name: "a malformed escape in the workers filter is 400", method: "GET", path: "/workers?model_name=%ZZ", status: 400, msg: "invalid query string"},
		{name: "a malformed escape in the loads filter is 400", method: "GET", path: "/loads?routing_group=%G1", status: 400, msg: "invalid query string"},
		{name: "a well-formed escape in the workers filter is applied", method: "GET", path: "/workers?model_name=mod%65l", status: 200},
		{name: "an empty selection_id on /select is 422", method: "POST", path: "/select",
			body: `{"selection_id":"","model_name":"model",` + prompt + `}`, status: 422, msg: "selection_id must not be empty"},
		{name: "an empty selection_id on /select_and_reserve is 422 rather than a generated id", method: "POST", path: "/select_and_reserve",
			body: `{"selection_id":"","model_name":"model",` + prompt + `}`, status: 422, msg: "selection_id must not be empty"},
		{name: "a null selection_id is absent", method: "POST", path: "/select", body: `{"selection_id":null,"model_name":"model",` + prompt + `}`, status: 200},
		{name: "a wrong body shape names the body, not a Go type", method: "POST", path: "/select", body: `[1]`, status: 422,
			msg: "request body: expected an object, got JSON array"},
		{name: "a bad token id names token_ids and its JSON type", method: "POST", path: "/select", body: `{"token_ids":[-1]}`, status: 422,
			msg: "token_ids[0]: expected an integer in [0, 4294967295], got JSON number -1"},
		{name: "a string for token_ids names token_ids and its JSON type", method: "POST", path: "/select", body: `{"token_ids":"1 2"}`, status: 422,
			msg: `token_ids: expected an array of integers in [0, 4294967295], got JSON string "1 2"`},
		{name: "a bad block hash names block_hashes", method: "POST", path: "/select", body: `{"block_hashes":[1.5]}`, status: 422,
			msg: "block_hashes[0]: expected an integer hash in [-2^63, 2^64-1], got JSON number 1.5"},
		{name: "a nested multimodal hash names its JSON path", method: "POST", path: "/select",
			body: `{"token_ids":[1],"block_mm_infos":[{"mm_objects":[{"mm_hash":"x"}]}]}`, status: 422,
			msg: `block_mm_infos.mm_objects.mm_hash: expected an integer hash in [-2^63, 2^64-1], got JSON string "x"`},
		{name: "a non-object override names router_config_override", method: "POST", path: "/select",
			body: `{"model_name":"model","router_config_override":5,` + prompt + `}`, status: 422, msg: "router_config_override: expected an object, got JSON number"},
		{name: "a wrongly typed override field names its path", method: "POST", path: "/select",
			body: `{"model_name":"model","router_config_override":{"overlap_score_credit":"x"},` + prompt + `}`, status: 422,
			msg: "router_config_override.overlap_score_credit: expected a number, got JSON string"},
		{name: "a non-object session_context names it", method: "POST", path: "/select", body: `{"session_context":5}`, status: 422,
			msg: "session_context: expected an object, got JSON number"},
		{name: "a negative allowed worker id names allowed_worker_ids", method: "POST", path: "/select", body: `{"allowed_worker_ids":[-1]}`, status: 422,
			msg: "allowed_worker_ids[0]: expected an integer in [0, 18446744073709551615], got JSON number -1"},
		{name: "a negative block_size names block_size without the embedded record", method: "POST", path: "/workers",
			body: `{"worker_id":1,"block_size":-4}`, status: 422, msg: "block_size: expected an integer in [0, 4294967295], got JSON number -4"},
		{name: "a string of taints names taints", method: "POST", path: "/workers", body: `{"worker_id":1,"taints":"gpu"}`, status: 422,
			msg: "taints: expected an array of strings, got JSON string"},
		{name: "a list of event endpoints names kv_events_endpoints", method: "POST", path: "/workers",
			body: `{"worker_id":1,"kv_events_endpoints":["tcp://w:1"]}`, status: 422, msg: "kv_events_endpoints: expected an object of strings, got JSON array"},
		{name: "a wrongly typed isl_tokens names isl_tokens", method: "POST", path: "/potential_loads", body: `{"isl_tokens":-1}`, status: 422,
			msg: "isl_tokens: expected an integer in [0, 18446744073709551615], got JSON number -1"},
		{name: "a wrongly typed decay_fraction names decay_fraction", method: "POST", path: "/reservations/x/output_block",
			body: `{"decay_fraction":"x"}`, status: 422, msg: "decay_fraction: expected a number, got JSON string"},
		{name: "HEAD is served on GET /health", method: "HEAD", path: "/health", status: 200},
		{name: "HEAD is served on GET /workers", method: "HEAD", path: "/workers", status: 200},
		{name: "HEAD on a POST-only route is 405", method: "HEAD", path: "/select", status: 405},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st, raw := callRaw(t, srv, tc.method, tc.path, tc.body, "application/json")
			if st != tc.status {
				t.Fatalf("%s %s = %d %s, want %d", tc.method, tc.path, st, raw, tc.status)
			}
			if tc.method == "HEAD" {
				if len(raw) != 0 {
					t.Fatalf("HEAD returned a body %q", raw)
				}
				return
			}
			if tc.msg == "" {
				return
			}
			var body struct{ Error string }
			if err := json.Unmarshal(raw, &body); err != nil {
				t.Fatal(err)
			}
			if body.Error != tc.msg {
				t.Fatalf("error %q, want %q", body.Error, tc.msg)
			}
			for _, leak := range []string{"httpapi.", "picker.", "promptBody", "WorkerRecord", "uint32", "uint64", "float64", "[]string", "map["} {
				if strings.Contains(body.Error, leak) {
					t.Fatalf("error %q exposes the Go name %q", body.Error, leak)
				}
			}
		})
	}
	t.Run("a 405 lists the allowed methods", func(t *testing.T) {
		req, _ := http.NewRequest("PUT", srv.URL+"/workers", nil)
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 405 || resp.Header.Get("Allow") != "GET, HEAD, POST" {
			t.Fatalf("PUT /workers = %d, Allow %q", resp.StatusCode, resp.Header.Get("Allow"))
		}
	})
}

func TestWorkerRecordValidationOverHTTP(t *testing.T) {
	cases := []struct {
		name    string
		extra   string
		reasons []any
		taints  []any
	}{
		{name: "duplicated taints are stored once, sorted", extra: `,"endpoint":"http://w:1","taints":["b","a","a"]`, taints: []any{"a", "b"}},
		{name: "a unix socket endpoint keeps the worker incomplete", extra: `,"endpoint":"unix:///tmp/sock"`,
			reasons: []any{`endpoint "unix:///tmp/sock" is invalid: scheme "unix" is not http or https`}},
		{name: "an endpoint with spaces keeps the worker incomplete", extra: `,"endpoint":" http://10.0.0.10:80 "`,
			reasons: []any{`endpoint " http://10.0.0.10:80 " is invalid: it has leading or trailing whitespace`}},
		{name: "an out-of-range port keeps the worker incomplete", extra: `,"endpoint":"http://10.0.0.9:99999"`,
			reasons: []any{`endpoint "http://10.0.0.9:99999" is invalid: port 99999 is out of range 1..65535`}},
		{name: "an endpoint without scheme keeps the worker incomplete", extra: `,"endpoint":"x:1"`,
			reasons: []any{`endpoint "x:1" is invalid: missing scheme (want http://host[:port] or https://host[:port])`}},
		{name: "http://localhost is schedulable", extra: `,"endpoint":"http://localhost"`},
		{name: "a non-numeric kv_events_endpoints key keeps the worker incomplete", extra: `,"endpoint":"http://w:1","kv_events_endpoints":{"abc":"tcp://w:5557"}`,
			reasons: []any{`kv_events_endpoints key "abc" is not a dp_rank (want a decimal integer in 0..4294967295)`}},
		{name: "a kv_events_endpoints key past 2^32-1 keeps the worker incomplete", extra: `,"endpoint":"http://w:1","kv_events_endpoints":{"4294967296":"tcp://w:5557"}`,
			reasons: []any{`kv_events_endpoints key "4294967296" is not a dp_rank (want a decimal integer in 0..4294967295)`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			srv, _ := server(t)
			st, v := call(t, srv, "POST", "/workers", `{"worker_id":1,"model_name":"model","block_size":4`+tc.extra+`}`)
			if st != 201 {
				t.Fatalf("POST /workers = %d %v, want 201", st, v)
			}
			rec := obj(t, v)
			wantLife := "schedulable"
			if tc.reasons != nil {
				wantLife = "incomplete"
			}
			if rec["lifecycle"] != wantLife {
				t.Errorf("lifecycle %v, want %s", rec["lifecycle"], wantLife)
			}
			got, _ := rec["not_schedulable_reasons"].([]any)
			if diff := cmp.Diff(tc.reasons, got); diff != "" {
				t.Errorf("reasons (-want +got):\n%s", diff)
			}
			if tc.taints != nil {
				if diff := cmp.Diff(tc.taints, rec["taints"]); diff != "" {
					t.Errorf("taints (-want +got):\n%s", diff)
				}
			}
			if wantLife == "incomplete" {
				if st, v := call(t, srv, "POST", "/select", `{"model_name":"model",`+prompt+`}`); st != 503 {
					t.Errorf("a select with only an incomplete worker = %d %v, want 503", st, v)
				}
			}
		})
	}
}

// TestLargestBookingsAddUpExactly books the largest isl_tokens the API accepts
// (picker.MaxISLTokens) beside a one-token booking: /loads adds and subtracts them exactly. (Sums
// that would overflow can no longer be booked over the API; the ledger's own tests cover its
// saturation.)
func TestLargestBookingsAddUpExactly(t *testing.T) {
	srv, _ := server(t)
	register(t, srv, 1, "")
	book := func(id, isl string) {
		t.Helper()
		body := `{"selection_id":"` + id + `","model_name":"model","worker_id":1,"sequence_hashes":[],"isl_tokens":` + isl + `,"effective_prefill_tokens":` + isl + `}`
		if st, v := call(t, srv, "POST", "/reservations", body); st != 201 {
			t.Fatalf("POST /reservations %s = %d %v", id, st, v)
		}
	}
	loads := func() (prefill uint64, requests uint64) {
		t.Helper()
		st, raw := callRaw(t, srv, "GET", "/loads", "", "")
		if st != 200 {
			t.Fatalf("GET /loads = %d %s", st, raw)
		}
		var out []struct {
			Loads []struct {
				PotentialPrefillTokens uint64 `json:"potential_prefill_tokens"`
				ActiveRequests         uint64 `json:"active_requests"`
			} `json:"loads"`
		}
		if err := json.Unmarshal(raw, &out); err != nil || len(out) != 1 || len(out[0].Loads) != 1 {
			t.Fatalf("GET /loads body %s: %v", raw, err)
		}
		return out[0].Loads[0].PotentialPrefillTokens, out[0].Loads[0].ActiveRequests
	}
	book("huge", "16777216")
	book("one", "1")
	if p, n := loads(); p != 1<<24+1 || n != 2 {
		t.Fatalf("after 2^24 + 1 tokens: potential_prefill_tokens %d, active_requests %d; want 2^24+1 and 2", p, n)
	}
	if st, v := call(t, srv, "DELETE", "/reservations/huge", ""); st != 200 {
		t.Fatal(st, v)
	}
	if p, n := loads(); p != 1 || n != 1 {
		t.Fatalf("after freeing the huge booking: potential_prefill_tokens %d, active_requests %d; want 1 and 1", p, n)
	}
	if st, v := call(t, srv, "DELETE", "/reservations/one", ""); st != 200 {
		t.Fatal(st, v)
	}
	if p, n := loads(); p != 0 || n != 0 {
		t.Fatalf("after freeing everything: potential_prefill_tokens %d, active_requests %d; want 0", p, n)
	}
}

// TestReadyFollowsTheProcessAndCandidacy: GET /ready is 503 while Options.Ready says the process
// is not ready (an EPP still recovering its index), and counts only candidates: a worker withheld
// from picks (a pod that is not Ready) shows "candidate": false and makes nothing ready.
func TestReadyFollowsTheProcessAndCandidacy(t *testing.T) {
	core, err := picker.New(pickertest.Config(11, 3))
	if err != nil {
		t.Fatal(err)
	}
	var ready atomic.Bool
	srv := httptest.NewServer(httpapi.New(core, httpapi.Options{Ready: ready.Load}))
	t.Cleanup(srv.Close)
	register(t, srv, 1, "")
	if st, v := call(t, srv, "GET", "/ready", ""); st != 503 || obj(t, v)["ready"] != false || obj(t, v)["schedulable_workers"] != 1.0 {
		t.Fatalf("/ready before the process is ready = %d %v", st, v)
	}
	ready.Store(true)
	if st, v := call(t, srv, "GET", "/ready", ""); st != 200 || obj(t, v)["ready"] != true {
		t.Fatalf("/ready = %d %v", st, v)
	}
	core.SetCandidate(1, false)
	st, v := call(t, srv, "GET", "/ready", "")
	workers := obj(t, v)["workers"].([]any)
	if st != 503 || obj(t, v)["schedulable_workers"] != 0.0 || workers[0].(map[string]any)["candidate"] != false ||
		workers[0].(map[string]any)["lifecycle"] != "schedulable" {
		t.Fatalf("/ready with the only worker withheld = %d %v", st, v)
	}
	if _, v := call(t, srv, "GET", "/workers", ""); v.([]any)[0].(map[string]any)["candidate"] != false {
		t.Fatalf("/workers = %v", v)
	}
}

// TestPatchWorkerIdentityFields: PATCH /workers/{id} may repeat the worker's own model_name,
// routing_group and worker_id (a no-op, as a client that sends the whole record does); a
// different value is a 400 naming the field, never silently ignored.
func TestPatchWorkerIdentityFields(t *testing.T) {
	srv, _ := server(t)
	register(t, srv, 1, "")
	for _, tc := range []struct {
		name, body string
		status     int
		msg        string
	}{
		{"its own model_name and routing_group are accepted", `{"model_name":"model","routing_group":"default","total_kv_blocks":7}`, 200, ""},
		{"an empty routing_group means default", `{"routing_group":"","total_kv_blocks":8}`, 200, ""},
		{"its own worker_id is accepted", `{"worker_id":1,"total_kv_blocks":9}`, 200, ""},
		{"another model_name is a 400", `{"model_name":"other"}`, 400, "PATCH cannot change model_name"},
		{"another routing_group is a 400", `{"routing_group":"g2"}`, 400, "PATCH cannot change routing_group"},
		{"another worker_id is a 400", `{"worker_id":99}`, 400, "worker_id 99 in the body does not match worker_id 1 in the path"},
		{"a model_name that is not a string is a 422", `{"model_name":5}`, 422, "model_name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, v := call(t, srv, "PATCH", "/workers/1", tc.body)
			if st != tc.status || (tc.msg != "" && !strings.Contains(obj(t, v)["error"].(string), tc.msg)) {
				t.Fatalf("PATCH %s = %d %v, want %d %q", tc.body, st, v, tc.status, tc.msg)
			}
		})
	}
	if _, v := call(t, srv, "GET", "/workers", ""); v.([]any)[0].(map[string]any)["total_kv_blocks"] != 9.0 {
		t.Fatalf("the accepted PATCHes were not applied: %v", v)
	}
}
