package httpapi_test

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/httpapi"
	"github.com/kvepp/kvepp/policies"
)

// The conformance harness: a real picker.Service (real kvindex, ledger and policies) behind the
// real HTTP handler on a loopback listener. KV events are off unless a test installs fakeSource,
// which records the partition index each worker is attached to so the test can inject KV events
// straight into it.

// testTime0 is the fake clock's start.
var testTime0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

// fakeClock is a settable clock for expiry and TTL tests.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	return c.now
}

// fakeSource is a picker.KVEventSource that behaves like kvevents.Manager towards the index (a
// re-attach clears ranks whose endpoint changed or that left the range) without sockets.
type fakeSource struct {
	mu    sync.Mutex
	specs map[uint64]picker.WorkerEventSpec
	idx   map[uint64]*kvindex.Index
	fail  func(picker.WorkerEventSpec) error
}

func newFakeSource() *fakeSource {
	return &fakeSource{specs: map[uint64]picker.WorkerEventSpec{}, idx: map[uint64]*kvindex.Index{}}
}

func (f *fakeSource) AttachWorker(spec picker.WorkerEventSpec, idx *kvindex.Index) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		if err := f.fail(spec); err != nil {
			return err
		}
	}
	if old, ok := f.specs[spec.WorkerID]; ok {
		oldIdx := f.idx[spec.WorkerID]
		for r := old.DPStartRank; r-old.DPStartRank < old.DPSize; r++ {
			inRange := r >= spec.DPStartRank && r-spec.DPStartRank < spec.DPSize
			if !inRange || old.Endpoints[r] != spec.Endpoints[r] || oldIdx != idx || old.BlockSize != spec.BlockSize {
				_ = oldIdx.Apply(kvindex.Event{WorkerID: spec.WorkerID, DPRank: r, Kind: kvindex.EventCleared})
			}
		}
	}
	f.specs[spec.WorkerID] = spec
	f.idx[spec.WorkerID] = idx
	return nil
}

func (f *fakeSource) DetachWorker(id uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.specs, id)
	delete(f.idx, id)
}

// lose forgets worker id's listener behind the catalog's back (a listener lost to a failed or
// cancelled update).
func (f *fakeSource) lose(id uint64) { f.DetachWorker(id) }

func (f *fakeSource) attached(id uint64) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.specs[id]
	return ok
}

// store injects a Stored event of local hashes (external ids = local + 1) into the index worker
// id is attached to; parent, when non-nil, is the parent's external hash.
func (f *fakeSource) store(t testing.TB, id uint64, rank uint32, tier kvindex.Tier, parent *uint64, local ...uint64) {
	t.Helper()
	f.mu.Lock()
	idx := f.idx[id]
	f.mu.Unlock()
	if idx == nil {
		t.Fatalf("worker %d is not attached", id)
	}
	ev := kvindex.Event{WorkerID: id, DPRank: rank, Tier: tier, Kind: kvindex.EventStored}
	if parent != nil {
		ev.HasParent, ev.ParentHash = true, *parent
	}
	for _, h := range local {
		ev.Blocks = append(ev.Blocks, kvindex.StoredBlock{BlockHash: h + 1, TokensHash: h})
	}
	if err := idx.Apply(ev); err != nil {
		t.Fatalf("inject stored event: %v", err)
	}
}

// env is one conformance fixture.
type env struct {
	t     *testing.T
	srv   *httptest.Server
	core  *picker.Service
	ev    *fakeSource
	clock *fakeClock
}

// newEnv serves a fresh core: KV events off, deterministic randomness, a fake clock.
func newEnv(t *testing.T, mods ...func(*picker.Config)) *env {
	t.Helper()
	e := &env{t: t, clock: &fakeClock{now: testTime0}}
	cfg := picker.DefaultConfig()
	cfg.Router.UseKVEvents = false
	cfg.Now = e.clock.Now
	var seedMu sync.Mutex
	seed := uint64(11)
	cfg.RandSource = func() rand.Source {
		seedMu.Lock()
		defer seedMu.Unlock()
		seed++
		return rand.NewPCG(seed, 3)
	}
	for _, m := range mods {
		m(&cfg)
	}
	if src, ok := cfg.EventSource.(*fakeSource); ok && cfg.Router.UseKVEvents {
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

// kvEvents turns KV events on with a fresh fakeSource.
func kvEvents(c *picker.Config) {
	c.Router.UseKVEvents = true
	c.EventSource = newFakeSource()
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

// funcScorer / funcPicker / funcFilter build custom policies from closures.
type funcScorer struct {
	in    policies.WorkerInputs
	score func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (float64, error)
}

func (s funcScorer) RequiredWorkerInputs() policies.WorkerInputs { return s.in }
func (s funcScorer) Score(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	return s.score(ctx, c)
}

type funcPicker struct {
	in   policies.WorkerInputs
	pick func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error)
}

func (p funcPicker) RequiredWorkerInputs() policies.WorkerInputs { return p.in }
func (p funcPicker) Pick(ctx *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
	return p.pick(ctx, v)
}

type funcFilter struct {
	in   policies.WorkerInputs
	keep func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (bool, error)
}

func (f funcFilter) RequiredWorkerInputs() policies.WorkerInputs { return f.in }
func (f funcFilter) Keep(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
	return f.keep(ctx, c)
}

// firstRow picks row 0.
var firstRow = funcPicker{pick: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) { return 0, nil }}

// zeroScore scores every candidate 0.
var zeroScore = funcScorer{score: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (float64, error) { return 0, nil }}

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }
