package httpapi_test

import (
	"bytes"
	"encoding/json"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/httpapi"
)

// server starts the API over a real listener on a fresh core (KV events off, deterministic
// randomness).
func server(t *testing.T, mods ...func(*picker.Config)) (*httptest.Server, *picker.Service) {
	t.Helper()
	cfg := picker.DefaultConfig()
	cfg.Router.UseKVEvents = false
	seed := uint64(7)
	cfg.RandSource = func() rand.Source { seed++; return rand.NewPCG(seed, 1) }
	for _, m := range mods {
		m(&cfg)
	}
	core, err := picker.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(httpapi.New(core, httpapi.Options{}))
	t.Cleanup(srv.Close)
	return srv, core
}

// call sends a request (JSON content type when body is non-empty) and returns the status and the
// decoded JSON body.
func call(t *testing.T, srv *httptest.Server, method, path, body string) (int, any) {
	t.Helper()
	status, raw := callRaw(t, srv, method, path, body, "application/json")
	var v any
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &v); err != nil {
			t.Fatalf("%s %s: response %q is not JSON: %v", method, path, raw, err)
		}
	}
	return status, v
}

func callRaw(t *testing.T, srv *httptest.Server, method, path, body, contentType string) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, srv.URL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" && contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); len(raw) > 0 && ct != "application/json" {
		t.Errorf("%s %s: Content-Type %q", method, path, ct)
	}
	return resp.StatusCode, raw
}

// register posts the §20 fixture worker N.
func register(t *testing.T, srv *httptest.Server, id int, extra string) map[string]any {
	t.Helper()
	body := `{"worker_id":` + itoa(id) + `,"model_name":"model","endpoint":"http://worker-` + itoa(id) + `:8000","block_size":4` + extra + `}`
	st, v := call(t, srv, "POST", "/workers", body)
	if st != http.StatusCreated {
		t.Fatalf("POST /workers = %d %v", st, v)
	}
	return v.(map[string]any)
}

func itoa(v int) string { return strconv.Itoa(v) }

const prompt = `"token_ids":[1,2,3,4]`

func obj(t *testing.T, v any) map[string]any {
	t.Helper()
	m, ok := v.(map[string]any)
	if !ok {
		t.Fatalf("%v is not an object", v)
	}
	return m
}

func errMsg(t *testing.T, v any) string {
	t.Helper()
	m := obj(t, v)
	if len(m) != 1 {
		t.Errorf("error body %v has extra keys", m)
	}
	s, _ := m["error"].(string)
	return s
}

// loadsOf returns the single partition's rows of GET /loads.
func loadsOf(t *testing.T, srv *httptest.Server) []any {
	t.Helper()
	st, v := call(t, srv, "GET", "/loads?model_name=model", "")
	if st != http.StatusOK {
		t.Fatalf("GET /loads = %d", st)
	}
	arr := v.([]any)
	if len(arr) != 1 {
		t.Fatalf("loads %v", arr)
	}
	return obj(t, arr[0])["loads"].([]any)
}

func TestHealth(t *testing.T) {
	srv, _ := server(t)
	st, v := call(t, srv, "GET", "/health", "")
	if st != 200 || !cmp.Equal(v, map[string]any{"status": "ok"}) {
		t.Fatalf("GET /health = %d %v", st, v)
	}
}

func TestReadyAndSelectWithoutSchedulableWorker(t *testing.T) {
	srv, _ := server(t)
	st, v := call(t, srv, "GET", "/ready", "")
	if st != 503 || !cmp.Equal(v, map[string]any{"ready": false, "schedulable_workers": 0.0, "workers": []any{}}) {
		t.Fatalf("GET /ready = %d %v", st, v)
	}
	st, v = call(t, srv, "POST", "/select", `{"model_name":"model",`+prompt+`}`)
	if st != 503 || errMsg(t, v) != "no schedulable workers are available" {
		t.Fatalf("POST /select = %d %v", st, v)
	}
	register(t, srv, 1, "")
	st, v = call(t, srv, "GET", "/ready", "")
	m := obj(t, v)
	if st != 200 || m["ready"] != true || m["schedulable_workers"] != 1.0 || len(m["workers"].([]any)) != 1 {
		t.Fatalf("GET /ready after registering = %d %v", st, v)
	}
}

func TestRegisterWorker(t *testing.T) {
	srv, _ := server(t)
	got := register(t, srv, 1, `,"taints":["gpu"],"unknown_field":1`)
	want := map[string]any{
		"worker_id": 1.0, "model_name": "model", "routing_group": "default", "endpoint": "http://worker-1:8000",
		"block_size": 4.0, "taints": []any{"gpu"}, "lifecycle": "schedulable", "candidate": true,
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("record (-want +got):\n%s", diff)
	}
	t.Run("missing metadata is still 201 with reasons", func(t *testing.T) {
		st, v := call(t, srv, "POST", "/workers", `{"worker_id":2}`)
		m := obj(t, v)
		if st != 201 || m["lifecycle"] != "incomplete" ||
			!cmp.Equal(m["not_schedulable_reasons"], []any{"endpoint is required", "block_size must be greater than 0"}) {
			t.Fatalf("%d %v", st, v)
		}
	})
	t.Run("GET /workers lists the catalog with filters", func(t *testing.T) {
		register(t, srv, 3, `,"routing_group":"g"`)
		for _, tc := range []struct {
			query string
			ids   []any
		}{
			{"", []any{1.0, 2.0, 3.0}},
			{"?model_name=model", []any{1.0, 3.0}},
			{"?model_name=model&routing_group=g", []any{3.0}},
			{"?routing_group=none", []any{}},
		} {
			st, v := call(t, srv, "GET", "/workers"+tc.query, "")
			if st != 200 {
				t.Fatalf("GET /workers%s = %d", tc.query, st)
			}
			ids := []any{}
			for _, w := range v.([]any) {
				ids = append(ids, obj(t, w)["worker_id"])
			}
			if !cmp.Equal(tc.ids, ids) {
				t.Errorf("GET /workers%s ids %v, want %v", tc.query, ids, tc.ids)
			}
		}
	})
	t.Run("queueing requires max_num_batched_tokens", func(t *testing.T) {
		srv, _ := server(t, func(c *picker.Config) { th := 1.0; c.Router.QueueThreshold = &th })
		m := register(t, srv, 1, "")
		reasons, _ := m["not_schedulable_reasons"].([]any)
		if m["lifecycle"] != "incomplete" || len(reasons) != 1 || !strings.Contains(reasons[0].(string), "max_num_batched_tokens") {
			t.Fatalf("%v", m)
		}
		st, _ := call(t, srv, "POST", "/select", `{"model_name":"model",`+prompt+`}`)
		if st != 503 {
			t.Errorf("POST /select = %d, want 503", st)
		}
	})
}

func TestPatchAndDeleteWorker(t *testing.T) {
	srv, _ := server(t)
	st, v := call(t, srv, "POST", "/workers", `{"worker_id":1,"model_name":"model","block_size":4}`)
	if st != 201 || obj(t, v)["lifecycle"] != "incomplete" {
		t.Fatalf("%d %v", st, v)
	}
	st, v = call(t, srv, "PATCH", "/workers/1", `{"endpoint":"http://w:1"}`)
	if m := obj(t, v); st != 200 || m["lifecycle"] != "schedulable" || m["model_name"] != "model" {
		t.Fatalf("PATCH = %d %v", st, v)
	}
	st, v = call(t, srv, "PATCH", "/workers/7", `{}`)
	if st != 404 || errMsg(t, v) != "worker 7 not found" {
		t.Errorf("PATCH unknown = %d %v", st, v)
	}
	st, v = call(t, srv, "DELETE", "/workers/1", "")
	if m := obj(t, v); st != 200 || m["lifecycle"] != "unschedulable" || m["worker_id"] != 1.0 {
		t.Fatalf("DELETE = %d %v", st, v)
	}
	st, v = call(t, srv, "GET", "/workers", "")
	if st != 200 || len(v.([]any)) != 0 {
		t.Errorf("GET /workers after delete = %v", v)
	}
	st, v = call(t, srv, "DELETE", "/workers/1", "")
	if st != 404 || errMsg(t, v) != "worker 1 not found" {
		t.Errorf("second DELETE = %d %v", st, v)
	}
	for _, p := range []string{"/workers/abc", "/workers/-1", "/workers/18446744073709551616", "/workers/"} {
		st, v = call(t, srv, "DELETE", p, "")
		if st != 400 || errMsg(t, v) != "invalid worker_id" {
			t.Errorf("DELETE %s = %d %v", p, st, v)
		}
	}
}

func TestSelectResponse(t *testing.T) {
	srv, _ := server(t)
	register(t, srv, 1, "")
	st, v := call(t, srv, "POST", "/select", `{"selection_id":"s1","model_name":"model",`+prompt+`}`)
	if st != 200 {
		t.Fatalf("POST /select = %d %v", st, v)
	}
	want := map[string]any{
		"selection_id": "s1", "model_name": "model", "routing_group": "default", "worker_id": 1.0, "dp_rank": 0.0,
		"endpoint": "http://worker-1:8000", "block_size": 4.0, "effective_prefill_tokens": 4.0, "potential_decode_blocks": 1.0,
		"overlap": map[string]any{"longest_matched": 0.0, "gpu": 0.0, "dp": map[string]any{"0": 0.0}, "cpu": 0.0, "disk": 0.0},
	}
	if diff := cmp.Diff(want, v); diff != "" {
		t.Errorf("select response (-want +got):\n%s", diff)
	}
	if l := obj(t, loadsOf(t, srv)[0]); l["active_requests"] != 0.0 {
		t.Errorf("a select booked: %v", l)
	}
	t.Run("selection_id is omitted when absent", func(t *testing.T) {
		_, v := call(t, srv, "POST", "/select", `{"model_name":"model",`+prompt+`}`)
		if _, ok := obj(t, v)["selection_id"]; ok {
			t.Errorf("%v", v)
		}
	})
	t.Run("an advisory select adds worker_load", func(t *testing.T) {
		_, v := call(t, srv, "POST", "/select", `{"model_name":"model","advisory":true,`+prompt+`}`)
		if !cmp.Equal(obj(t, v)["worker_load"], map[string]any{"active_prefill_tokens": 0.0, "prefill_token_capacity": 1e7}) {
			t.Errorf("%v", v)
		}
	})
}

func TestSelectAndReserveFlow(t *testing.T) {
	srv, _ := server(t)
	register(t, srv, 1, "")
	body := `{"selection_id":"r1","model_name":"model",` + prompt + `}`
	st, v := call(t, srv, "POST", "/select_and_reserve", body)
	if st != 200 {
		t.Fatalf("POST /select_and_reserve = %d %v", st, v)
	}
	want := map[string]any{
		"selection_id": "r1", "sequence_hashes": []any{-3803038269031200164.0}, "isl_tokens": 4.0, "track_prefill_tokens": true,
		"model_name": "model", "routing_group": "default", "worker_id": 1.0, "dp_rank": 0.0,
		"endpoint": "http://worker-1:8000", "block_size": 4.0, "effective_prefill_tokens": 4.0, "potential_decode_blocks": 1.0,
		"overlap": map[string]any{"longest_matched": 0.0, "gpu": 0.0, "dp": map[string]any{"0": 0.0}, "cpu": 0.0, "disk": 0.0},
	}
	if diff := cmp.Diff(want, v); diff != "" {
		t.Errorf("reserve response (-want +got):\n%s", diff)
	}
	_, raw := callRaw(t, srv, "POST", "/select_and_reserve", `{"model_name":"model",`+prompt+`}`, "application/json")
	if !bytes.Contains(raw, []byte(`"sequence_hashes":[-3803038269031200164]`)) {
		t.Errorf("sequence hashes not emitted as exact int64: %s", raw)
	}
	for _, banned := range []string{"cached_tokens", "effective_overlap_blocks", "tenant_id"} {
		if bytes.Contains(raw, []byte(banned)) {
			t.Errorf("response contains %s: %s", banned, raw)
		}
	}
	var second map[string]any
	_ = json.Unmarshal(raw, &second)
	if id, _ := second["selection_id"].(string); len(id) != 36 {
		t.Errorf("generated selection_id %q", id)
	}
	if l := obj(t, loadsOf(t, srv)[0]); l["potential_prefill_tokens"] != 4.0 || l["active_requests"] != 2.0 {
		t.Errorf("loads after booking %v", l)
	}
	st, v = call(t, srv, "POST", "/select_and_reserve", body)
	if st != 409 || errMsg(t, v) != "selection r1 is already reserved or being reserved" {
		t.Errorf("duplicate id = %d %v", st, v)
	}
	for _, step := range []struct{ method, path string }{
		{"POST", "/reservations/r1/prefill_complete"},
		{"POST", "/reservations/r1/prefill_complete"},
		{"DELETE", "/reservations/r1"},
		{"DELETE", "/reservations/" + second["selection_id"].(string)},
	} {
		st, v := call(t, srv, step.method, step.path, "")
		if st != 200 || !cmp.Equal(v, map[string]any{"status": "ok"}) {
			t.Errorf("%s %s = %d %v", step.method, step.path, st, v)
		}
	}
	l := obj(t, loadsOf(t, srv)[0])
	if l["potential_prefill_tokens"] != 0.0 || l["potential_decode_blocks"] != 0.0 || l["active_requests"] != 0.0 {
		t.Errorf("loads after free %v", l)
	}
	st, v = call(t, srv, "DELETE", "/reservations/r1", "")
	if st != 404 || errMsg(t, v) != "reservation r1 not found" {
		t.Errorf("second free = %d %v", st, v)
	}
}

func TestSelectThenReserveThenFree(t *testing.T) {
	srv, _ := server(t)
	register(t, srv, 1, "")
	register(t, srv, 2, "")
	st, sel := call(t, srv, "POST", "/select", `{"model_name":"model",`+prompt+`}`)
	if st != 200 {
		t.Fatal(st, sel)
	}
	chosen := obj(t, sel)["worker_id"]
	st, res := call(t, srv, "POST", "/select_and_reserve",
		`{"selection_id":"x","model_name":"model","affinity_target":{"worker_id":`+jsonNum(chosen)+`},`+prompt+`}`)
	if st != 200 || obj(t, res)["worker_id"] != chosen {
		t.Fatalf("reserve on the selected worker = %d %v", st, res)
	}
	st, _ = call(t, srv, "POST", "/reservations/x/output_block", "")
	if st != 200 {
		t.Errorf("empty output_block body = %d", st)
	}
	st, v := call(t, srv, "POST", "/reservations/x/output_block", `{"decay_fraction":1.5}`)
	if st != 400 || errMsg(t, v) != "decay_fraction must be between 0.0 and 1.0" {
		t.Errorf("bad decay = %d %v", st, v)
	}
	if st, _ := call(t, srv, "DELETE", "/reservations/x", ""); st != 200 {
		t.Fatalf("free = %d", st)
	}
	for _, row := range loadsOf(t, srv) {
		l := obj(t, row)
		if l["potential_prefill_tokens"] != 0.0 || l["potential_decode_blocks"] != 0.0 || l["active_requests"] != 0.0 {
			t.Errorf("load not back to zero: %v", l)
		}
	}
}

func jsonNum(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestHashFormOverJSON(t *testing.T) {
	srv, _ := server(t)
	register(t, srv, 1, "")
	cases := []struct {
		name   string
		body   string
		status int
		msg    string
		seq    []any
	}{
		{name: "1 block hash and 2 sequence hashes is a bad request",
			body: `{"model_name":"model","block_hashes":[1],"sequence_hashes":[1,2],"isl_tokens":8}`, status: 400,
			msg: "block_hashes length 1 must match sequence_hashes length 2"},
		{name: "a missing isl_tokens is a bad request",
			body: `{"model_name":"model","block_hashes":[1],"sequence_hashes":[1]}`, status: 400, msg: "isl_tokens is required without token_ids"},
		{name: "isl_tokens 0 is a bad request",
			body: `{"model_name":"model","block_hashes":[],"sequence_hashes":[],"isl_tokens":0}`, status: 400, msg: "isl_tokens must be greater than 0"},
		{name: "no prompt at all is a bad request", body: `{"model_name":"model"}`, status: 400, msg: "block_hashes is required without token_ids"},
		{name: "empty token_ids is a bad request", body: `{"model_name":"model","token_ids":[]}`, status: 400, msg: "token_ids must not be empty"},
		{name: "hashes accept the whole [-2^63, 2^64-1] range and echo as int64",
			body:   `{"model_name":"model","block_hashes":[1,2,3],"sequence_hashes":[-9223372036854775808,18446744073709551615,9223372036854775808],"isl_tokens":12}`,
			status: 200, seq: []any{-9223372036854775808.0, -1.0, -9223372036854775808.0}},
		{name: "a hash above 2^64-1 is unprocessable",
			body: `{"model_name":"model","block_hashes":[18446744073709551616],"sequence_hashes":[1],"isl_tokens":4}`, status: 422},
		{name: "a fractional hash is unprocessable",
			body: `{"model_name":"model","block_hashes":[1.5],"sequence_hashes":[1],"isl_tokens":4}`, status: 422},
		{name: "a string hash is unprocessable",
			body: `{"model_name":"model","block_hashes":["1"],"sequence_hashes":[1],"isl_tokens":4}`, status: 422},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st, v := call(t, srv, "POST", "/select_and_reserve", tc.body)
			if st != tc.status {
				t.Fatalf("status %d %v, want %d", st, v, tc.status)
			}
			if tc.msg != "" && errMsg(t, v) != tc.msg {
				t.Errorf("message %q, want %q", errMsg(t, v), tc.msg)
			}
			if tc.seq != nil && !cmp.Equal(obj(t, v)["sequence_hashes"], tc.seq) {
				t.Errorf("sequence_hashes %v, want %v", obj(t, v)["sequence_hashes"], tc.seq)
			}
		})
	}
	t.Run("a large hash round-trips exactly in the raw JSON", func(t *testing.T) {
		_, raw := callRaw(t, srv, "POST", "/select_and_reserve",
			`{"model_name":"model","block_hashes":[5],"sequence_hashes":[18446744073709551615],"isl_tokens":4}`, "application/json")
		if !bytes.Contains(raw, []byte(`"sequence_hashes":[-1]`)) {
			t.Errorf("%s", raw)
		}
	})
}

func TestMMRoutingTokensReplaceTokenIDs(t *testing.T) {
	srv, _ := server(t)
	register(t, srv, 1, "")
	seqOf := func(body string) []any {
		t.Helper()
		st, v := call(t, srv, "POST", "/select_and_reserve", body)
		if st != 200 {
			t.Fatalf("%d %v", st, v)
		}
		m := obj(t, v)
		if m["isl_tokens"] != 8.0 {
			t.Errorf("isl %v", m["isl_tokens"])
		}
		return m["sequence_hashes"].([]any)
	}
	base := seqOf(`{"model_name":"model","token_ids":[9],"mm_routing_info":{"routing_token_ids":[1,2,3,4,5,6,7,8]}}`)
	plain := seqOf(`{"model_name":"model","token_ids":[1,2,3,4,5,6,7,8]}`)
	if !cmp.Equal(base, plain) {
		t.Errorf("routing tokens hashed %v, token_ids %v", base, plain)
	}
	withMM := seqOf(`{"model_name":"model","token_ids":[9],"mm_routing_info":{"routing_token_ids":[1,2,3,4,5,6,7,8],"block_mm_infos":[null,{"mm_objects":[{"mm_hash":42}]}]}}`)
	if cmp.Equal(base, withMM) || !cmp.Equal(base[0], withMM[0]) {
		t.Errorf("mm info must change only block 1: %v vs %v", base, withMM)
	}
}

func TestHTTPConventions(t *testing.T) {
	srv, core := server(t)
	register(t, srv, 1, "")
	cases := []struct {
		name, method, path, body, contentType string
		status                                int
		msg                                   string
	}{
		{"an unknown route is 404", "GET", "/nope", "", "", 404, "route not found"},
		{"a nested unknown route is 404", "GET", "/workers/1/extra", "", "", 404, "route not found"},
		{"a wrong method is 405", "GET", "/select", "", "", 405, "method not allowed"},
		{"PUT on /workers is 405", "PUT", "/workers", "{}", "application/json", 405, "method not allowed"},
		{"a body without Content-Type is 415", "POST", "/select", `{"model_name":"model"}`, "", 415, ""},
		{"a text/plain body is 415", "POST", "/workers", `{"worker_id":1}`, "text/plain", 415, ""},
		{"a charset parameter is accepted", "POST", "/workers", `{"worker_id":5}`, "application/json; charset=utf-8", 201, ""},
		{"malformed JSON is 400", "POST", "/select", `{"model_name":`, "application/json", 400, ""},
		{"trailing garbage is 400", "POST", "/workers", `{"worker_id":1} x`, "application/json", 400, ""},
		{"an empty body is 400", "POST", "/workers", ` `, "application/json", 400, ""},
		{"a missing worker_id is 422", "POST", "/workers", `{"endpoint":"x"}`, "application/json", 422, "missing field `worker_id`"},
		{"a wrong type is 422", "POST", "/workers", `{"worker_id":"one"}`, "application/json", 422, ""},
		{"a negative block_size is 422", "POST", "/workers", `{"worker_id":1,"block_size":-4}`, "application/json", 422, ""},
		{"a JSON array body is 422", "POST", "/select", `[]`, "application/json", 422, ""},
		{"a negative token id is 422", "POST", "/select", `{"token_ids":[-1]}`, "application/json", 422, ""},
		{"a bad override is 422", "POST", "/select", `{"model_name":"model","router_config_override":{"overlap_score_credit":-1},` + prompt + `}`, "application/json", 422,
			"router_config_override.overlap_score_credit must be a finite number >= 0, got -1"},
		{"a bad input_trigger is 422", "POST", "/select", `{"model_name":"model","session_context":{"session_id":"s","input_trigger":"x"},` + prompt + `}`, "application/json", 422, ""},
		{"a session_context without session_id is 422", "POST", "/select", `{"model_name":"model","session_context":{},` + prompt + `}`, "application/json", 422, "missing field `session_id` in session_context"},
		{"a pinned_worker without dp_rank is 422", "POST", "/select", `{"model_name":"model","pinned_worker":{"worker_id":1},` + prompt + `}`, "application/json", 422, "missing field `dp_rank` in pinned_worker"},
		{"a pinned worker outside allowed_worker_ids is 400", "POST", "/select", `{"model_name":"model","allowed_worker_ids":[2],"pinned_worker":{"worker_id":1,"dp_rank":0},` + prompt + `}`, "application/json", 400,
			"pinned worker 1 is not in allowed_worker_ids"},
		{"an empty allowed_worker_ids is 503", "POST", "/select", `{"model_name":"model","allowed_worker_ids":[],` + prompt + `}`, "application/json", 503, "no endpoints available to route work"},
		{"an unknown reservation is 404", "POST", "/reservations/zz/prefill_complete", "", "", 404, "reservation zz not found"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st, raw := callRaw(t, srv, tc.method, tc.path, tc.body, tc.contentType)
			if st != tc.status {
				t.Fatalf("status %d (%s), want %d", st, raw, tc.status)
			}
			if st >= 400 {
				var v map[string]any
				if err := json.Unmarshal(raw, &v); err != nil || v["error"] == nil || len(v) != 1 {
					t.Fatalf("error body %s is not {\"error\": ...}", raw)
				}
				if tc.msg != "" && v["error"] != tc.msg {
					t.Errorf("message %q, want %q", v["error"], tc.msg)
				}
			}
		})
	}
	t.Run("a body over 8 MiB is 413", func(t *testing.T) {
		big := `{"model_name":"model","token_ids":[` + strings.Repeat("1,", 4<<20) + `1]}`
		st, raw := callRaw(t, srv, "POST", "/select", big, "application/json")
		if st != 413 {
			t.Fatalf("status %d %.100s", st, raw)
		}
	})
	t.Run("a body just under 8 MiB is accepted", func(t *testing.T) {
		pad := strings.Repeat(" ", 8<<20-200)
		st, raw := callRaw(t, srv, "POST", "/select", `{"model_name":"model",`+prompt+pad+`}`, "application/json")
		if st != 200 {
			t.Fatalf("status %d %.100s", st, raw)
		}
	})
	t.Run("after shutdown selection and lifecycle calls are 503 but reads and deletes work", func(t *testing.T) {
		st, v := call(t, srv, "POST", "/select_and_reserve", `{"selection_id":"keep","model_name":"model",`+prompt+`}`)
		if st != 200 {
			t.Fatal(st, v)
		}
		core.BeginShutdown()
		for _, c := range []struct{ method, path, body string }{
			{"POST", "/select", `{"model_name":"model",` + prompt + `}`},
			{"POST", "/select_and_reserve", `{"model_name":"model",` + prompt + `}`},
			{"POST", "/workers", `{"worker_id":9}`},
			{"DELETE", "/reservations/keep", ""},
			{"POST", "/reservations/keep/prefill_complete", ""},
		} {
			st, v := call(t, srv, c.method, c.path, c.body)
			if st != 503 || errMsg(t, v) != "selection service is shutting down" {
				t.Errorf("%s %s = %d %v", c.method, c.path, st, v)
			}
		}
		for _, c := range []struct {
			method, path string
			want         int
		}{{"GET", "/workers", 200}, {"GET", "/loads", 200}, {"GET", "/health", 200}, {"GET", "/ready", 503}, {"DELETE", "/workers/1", 200}} {
			if st, _ := call(t, srv, c.method, c.path, ""); st != c.want {
				t.Errorf("%s %s = %d, want %d", c.method, c.path, st, c.want)
			}
		}
	})
}

func TestStatusOfMapsEveryKind(t *testing.T) {
	for kind, want := range map[picker.Kind]int{
		picker.KindBadRequest: 400, picker.KindUnprocessable: 422, picker.KindNotReady: 503, picker.KindNotFound: 404,
		picker.KindConflict: 409, picker.KindOverloaded: 429, picker.KindInternal: 500, picker.KindPolicy: 500,
	} {
		if got := httpapi.StatusOf(picker.Errorf(kind, "x")); got != want {
			t.Errorf("%s → %d, want %d", kind, got, want)
		}
	}
	if got := httpapi.StatusOf(io.EOF); got != 500 {
		t.Errorf("a plain error → %d, want 500", got)
	}
}

func TestLoadsEndpoint(t *testing.T) {
	srv, _ := server(t)
	st, v := call(t, srv, "GET", "/loads", "")
	if st != 200 || !cmp.Equal(v, []any{}) {
		t.Fatalf("empty loads %d %v", st, v)
	}
	register(t, srv, 1, "")
	st, v = call(t, srv, "GET", "/loads", "")
	want := []any{map[string]any{
		"model_name": "model", "routing_group": "default", "pending_count": 0.0, "pending_isl_tokens": 0.0,
		"loads": []any{map[string]any{"worker_id": 1.0, "dp_rank": 0.0, "potential_prefill_tokens": 0.0, "potential_decode_blocks": 0.0, "active_requests": 0.0}},
	}}
	if diff := cmp.Diff(want, v); st != 200 || diff != "" {
		t.Errorf("GET /loads = %d (-want +got):\n%s", st, diff)
	}
}
