package httpapi_test

import (
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/httpapi"
	"github.com/kvepp/kvepp/picker/pickertest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
)

// The conformance harness: a real picker.Service (real kvindex, ledger and policies) behind the
// real HTTP handler on a loopback listener. KV events are off unless a test installs a
// pickertest.EventSource (kvEvents), which records the partition index each worker is attached
// to so the test can inject KV events straight into it.

// testTime0 is the fake clock's start.
var testTime0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

// env is one conformance fixture.
type env struct {
	t     *testing.T
	srv   *httptest.Server
	core  *picker.Service
	ev    *pickertest.EventSource
	clock *pickertest.Clock
}

// newEnv serves a fresh core: KV events off, deterministic randomness, a fake clock.
func newEnv(t *testing.T, mods ...func(*picker.Config)) *env {
	t.Helper()
	e := &env{t: t, clock: pickertest.NewClock(testTime0)}
	cfg := pickertest.Config(11, 3)
	cfg.Now = e.clock.Now
	for _, m := range mods {
		m(&cfg)
	}
	if src, ok := cfg.EventSource.(*pickertest.EventSource); ok && cfg.Router.UseKVEvents {
		e.ev = src
	}
	core, err := picker.New(cfg)
	if err != nil {
		t.Fatalf("picker.New: %v", err)
	}
	e.core = core
	e.srv = httptest.NewServer(httpapi.New(core, httpapi.Options{}))
	t.Cleanup(e.srv.Close)
	return e
}

// kvEvents turns KV events on with a fresh pickertest.EventSource.
func kvEvents(c *picker.Config) {
	c.Router.UseKVEvents = true
	c.EventSource = pickertest.NewEventSource()
}

// attached reports whether worker id has a KV-event listener.
func (e *env) attached(id uint64) bool {
	_, ok := e.ev.Attached(id)
	return ok
}

func affinityTTL(d time.Duration) func(*picker.Config) {
	return func(c *picker.Config) { c.SessionAffinityTTL = d }
}

// withFactory installs a custom policy factory.
func withFactory(f policies.PolicyFactory) func(*picker.Config) {
	return func(c *picker.Config) { c.Policy = f }
}

// do sends a request with a JSON body (when non-empty) and returns the status and decoded body.
func (e *env) do(method, path, body string) (int, any) {
	e.t.Helper()
	return call(e.t, e.srv, method, path, body)
}

// raw sends a request and returns the status and the raw body.
func (e *env) raw(method, path, body string) (int, []byte) {
	e.t.Helper()
	return callRaw(e.t, e.srv, method, path, body, "application/json")
}

// ok sends a request and fails the test unless the status is want; it returns the body.
func (e *env) ok(want int, method, path, body string) any {
	e.t.Helper()
	st, v := e.do(method, path, body)
	if st != want {
		e.t.Fatalf("%s %s %s = %d %v, want %d", method, path, body, st, v, want)
	}
	return v
}

// fails asserts an error response of status with a message containing frag.
func (e *env) fails(status int, frag, method, path, body string) string {
	e.t.Helper()
	st, v := e.do(method, path, body)
	if st != status {
		e.t.Fatalf("%s %s %s = %d %v, want %d", method, path, body, st, v, status)
	}
	msg := errMsg(e.t, v)
	if !strings.Contains(msg, frag) {
		e.t.Fatalf("%s %s: error %q does not contain %q", method, path, msg, frag)
	}
	return msg
}

// worker registers the §20 fixture worker id with extra JSON fields and returns its record.
func (e *env) worker(id int, extra string) map[string]any {
	e.t.Helper()
	return register(e.t, e.srv, id, extra)
}

// load returns the /loads row of (worker, rank) in model:group ("" group = default).
func (e *env) load(model, group string, w, r int) map[string]any {
	e.t.Helper()
	if group == "" {
		group = "default"
	}
	v := e.ok(200, "GET", "/loads?model_name="+model+"&routing_group="+group, "")
	for _, p := range v.([]any) {
		for _, row := range obj(e.t, p)["loads"].([]any) {
			m := obj(e.t, row)
			if m["worker_id"] == float64(w) && m["dp_rank"] == float64(r) {
				return m
			}
		}
	}
	e.t.Fatalf("no /loads row for worker %d dp_rank %d in %s:%s", w, r, model, group)
	return nil
}

// wantLoad asserts (prefill tokens, decode blocks, active requests) of one rank.
func (e *env) wantLoad(w, r int, prefill, blocks, requests float64) {
	e.t.Helper()
	l := e.load("model", "", w, r)
	if l["potential_prefill_tokens"] != prefill || l["potential_decode_blocks"] != blocks || l["active_requests"] != requests {
		e.t.Fatalf("load of worker %d dp_rank %d = %v, want prefill %v blocks %v requests %v", w, r, l, prefill, blocks, requests)
	}
}

// totalRequests sums active_requests over every partition.
func (e *env) totalRequests() float64 {
	e.t.Helper()
	n := 0.0
	for _, p := range e.ok(200, "GET", "/loads", "").([]any) {
		for _, row := range obj(e.t, p)["loads"].([]any) {
			n += obj(e.t, row)["active_requests"].(float64)
		}
	}
	return n
}

// toks returns the token ids 1..n.
func toks(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(i + 1)
	}
	return out
}

// tokJSON is the JSON fragment "token_ids":[1,…,n].
func tokJSON(n int) string {
	parts := make([]string, n)
	for i := range parts {
		parts[i] = strconv.Itoa(i + 1)
	}
	return `"token_ids":[` + strings.Join(parts, ",") + `]`
}

// local returns the unsalted local block hashes of tokens 1..n at block size bs.
func local(n, bs int) []uint64 { return kvindex.BlockHashes(toks(n), bs, kvindex.BaseSeed) }

// js marshals v to JSON.
func js(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(b)
}

func f(format string, args ...any) string { return fmt.Sprintf(format, args...) }

// keys returns a map's keys (for exact-shape checks).
func keys(m map[string]any) map[string]bool {
	out := map[string]bool{}
	for k := range m {
		out[k] = true
	}
	return out
}

func set(ks ...string) map[string]bool {
	out := map[string]bool{}
	for _, k := range ks {
		out[k] = true
	}
	return out
}

// firstRow picks row 0.
var firstRow = policytest.Picker{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) { return 0, nil }}

// zeroScore scores every candidate 0.
var zeroScore = policytest.Scorer{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (float64, error) { return 0, nil }}

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }
