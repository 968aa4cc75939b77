package extproc_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/picker"
)

// fakePicker is a Picker that books the first allowed worker of the requested partition and records
// every call. It flags protocol violations: double frees, frees or prefill completions of unknown
// bookings, prefill completion after free.
type fakePicker struct {
	mu      sync.Mutex
	models  []string
	workers map[string][]picker.WorkerState

	// selectErr, when set, is returned by SelectAndReserve (no booking).
	selectErr error
	// loadErr, when set, is returned by LoadOnlyPick.
	loadErr error
	// selectHook, when set, runs inside SelectAndReserve before booking (may block).
	selectHook func(ctx context.Context, req picker.SelectRequest)
	// bookDespiteCancel books even when ctx is done (a pick that lands after the stream closed).
	bookDespiteCancel bool
	// noRecord keeps only the live-booking set (benchmarks).
	noRecord bool

	selects    []picker.SelectRequest
	loadOnly   []loadCall
	events     []string
	live       map[string]bool
	freed      map[string]int
	violations []string
}

type loadCall struct {
	model      string
	allowed    []uint64
	allowedSet bool
}

var (
	_ extproc.Picker = (*fakePicker)(nil)
	// The production selection core satisfies the interface extproc consumes.
	_ extproc.Picker = (*picker.Service)(nil)
)

func worker(id uint64, model, endpoint string) picker.WorkerState {
	return picker.WorkerState{WorkerRecord: picker.WorkerRecord{WorkerID: id, ModelName: model, Endpoint: endpoint}, Lifecycle: picker.LifecycleSchedulable}
}

// newFakePicker serves model "m" on workers 1 (10.0.0.1:8000), 2 (10.0.0.2:8000) and 3 ([fd00::3]:8000).
func newFakePicker() *fakePicker {
	return &fakePicker{
		models: []string{"m"},
		workers: map[string][]picker.WorkerState{"m": {
			worker(1, "m", "http://10.0.0.1:8000"),
			worker(2, "m", "http://10.0.0.2:8000"),
			worker(3, "m", "http://[fd00::3]:8000"),
		}},
		live: map[string]bool{}, freed: map[string]int{},
	}
}

func (f *fakePicker) candidates(model string, allowed []uint64, allowedSet bool) []picker.WorkerState {
	var ws []picker.WorkerState
	if model == "" {
		for _, m := range f.models {
			ws = append(ws, f.workers[m]...)
		}
	} else {
		ws = f.workers[model]
	}
	if !allowedSet {
		return ws
	}
	var out []picker.WorkerState
	for _, w := range ws {
		for _, a := range allowed {
			if a == w.WorkerID {
				out = append(out, w)
			}
		}
	}
	return out
}

func (f *fakePicker) SelectAndReserve(ctx context.Context, req picker.SelectRequest) (picker.Selection, error) {
	if f.selectHook != nil {
		f.selectHook(ctx, req)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.noRecord {
		f.selects = append(f.selects, req)
	}
	if f.selectErr != nil {
		return picker.Selection{}, f.selectErr
	}
	if err := ctx.Err(); err != nil && !f.bookDespiteCancel {
		return picker.Selection{}, &picker.Error{Kind: picker.KindInternal, Message: "cancelled", Err: err}
	}
	ws := f.candidates(req.ModelName, req.AllowedWorkerIDs, req.AllowedSet)
	if len(ws) == 0 {
		return picker.Selection{}, picker.Errorf(picker.KindNotReady, "no ready worker for model %q", req.ModelName)
	}
	if f.live[req.SelectionID] || f.freed[req.SelectionID] > 0 {
		f.violations = append(f.violations, "selection id reused: "+req.SelectionID)
	}
	f.live[req.SelectionID] = true
	f.record("select " + req.SelectionID)
	sel := picker.Selection{SelectionID: req.SelectionID, ModelName: req.ModelName, WorkerID: ws[0].WorkerID,
		Endpoint: ws[0].Endpoint, Booked: true, Overlap: picker.Overlap{LongestMatched: 32}}
	for _, w := range ws[1:] {
		if len(sel.Fallbacks) == req.Fallbacks {
			break
		}
		sel.Fallbacks = append(sel.Fallbacks, picker.Fallback{WorkerID: w.WorkerID, Endpoint: w.Endpoint})
	}
	return sel, nil
}

// record appends an event unless noRecord is set. f.mu is held.
func (f *fakePicker) record(e string) {
	if !f.noRecord {
		f.events = append(f.events, e)
	}
}

func (f *fakePicker) PrefillComplete(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record("prefill " + id)
	if !f.live[id] {
		f.violations = append(f.violations, "prefill_complete of a booking that is not live: "+id)
		return picker.Errorf(picker.KindNotFound, "reservation %q not found", id)
	}
	return nil
}

func (f *fakePicker) Free(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record("free " + id)
	if !f.noRecord {
		f.freed[id]++
	}
	if !f.live[id] {
		f.violations = append(f.violations, "free of a booking that is not live: "+id)
		return picker.Errorf(picker.KindNotFound, "reservation %q not found", id)
	}
	delete(f.live, id)
	return nil
}

// Reserve books an explicit reservation on a worker of the partition (the served-endpoint move).
func (f *fakePicker) Reserve(_ context.Context, req picker.ReservationRequest) (picker.Reservation, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(fmt.Sprintf("reserve %s worker %d", req.SelectionID, *req.WorkerID))
	for _, w := range f.workers[req.ModelName] {
		if w.WorkerID == *req.WorkerID {
			if f.live[req.SelectionID] {
				f.violations = append(f.violations, "selection id reused: "+req.SelectionID)
			}
			f.live[req.SelectionID] = true
			return picker.Reservation{SelectionID: req.SelectionID, ModelName: req.ModelName, WorkerID: w.WorkerID, Endpoint: w.Endpoint}, nil
		}
	}
	return picker.Reservation{}, picker.Errorf(picker.KindNotFound, "schedulable worker %d not found", *req.WorkerID)
}

func (f *fakePicker) LoadOnlyPick(_ context.Context, model string, allowed []uint64, allowedSet bool) (picker.Selection, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.noRecord {
		f.loadOnly = append(f.loadOnly, loadCall{model, append([]uint64(nil), allowed...), allowedSet})
	}
	if f.loadErr != nil {
		return picker.Selection{}, f.loadErr
	}
	ws := f.candidates(model, allowed, allowedSet)
	if len(ws) == 0 {
		return picker.Selection{}, picker.Errorf(picker.KindNotReady, "no ready worker for model %q", model)
	}
	return picker.Selection{ModelName: model, WorkerID: ws[0].WorkerID, Endpoint: ws[0].Endpoint}, nil
}

func (f *fakePicker) HasModel(model string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, m := range f.models {
		if m == model {
			return true
		}
	}
	return false
}

func (f *fakePicker) Models() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.models...)
}

// Workers lists partition (model, group)'s workers as *picker.Service does: model "" is every
// model, group "" every group, a record without routing_group is in picker.DefaultPartitionName.
func (f *fakePicker) Workers(model, group string) []picker.WorkerState {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []picker.WorkerState
	for _, w := range f.candidates(model, nil, false) {
		rg := w.RoutingGroup
		if rg == "" {
			rg = picker.DefaultPartitionName
		}
		if group == "" || rg == group {
			out = append(out, w)
		}
	}
	return out
}

// snapshot returns copies of the recorded calls.
func (f *fakePicker) snapshot() (selects []picker.SelectRequest, loads []loadCall, events, violations []string, live int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append(selects, f.selects...), append(loads, f.loadOnly...), append(events, f.events...),
		append(violations, f.violations...), len(f.live)
}

// waitSettled waits until no booking is live, then checks that no violation was recorded and that
// every booking was freed exactly once with no prefill after its free.
func (f *fakePicker) waitSettled(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, _, _, _, live := f.snapshot()
		if live == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d bookings still live after 5s (leak)", live)
		}
		time.Sleep(time.Millisecond)
	}
	_, _, events, violations, _ := f.snapshot()
	if len(violations) > 0 {
		t.Fatalf("picker protocol violations: %v", violations)
	}
	freedAt := map[string]int{}
	for i, e := range events {
		op, id, _ := strings.Cut(e, " ")
		switch op {
		case "free":
			if _, dup := freedAt[id]; dup {
				t.Fatalf("booking %s freed twice", id)
			}
			freedAt[id] = i
		case "prefill":
			if _, after := freedAt[id]; after {
				t.Fatalf("prefill_complete of %s after its free: %v", id, events)
			}
		}
	}
	for _, e := range events {
		if op, id, _ := strings.Cut(e, " "); op == "select" {
			if _, ok := freedAt[id]; !ok {
				t.Fatalf("booking %s never freed: %v", id, events)
			}
		}
	}
}

// count returns how many events have the given op ("select", "prefill", "free").
func (f *fakePicker) count(op string) int {
	_, _, events, _, _ := f.snapshot()
	n := 0
	for _, e := range events {
		if strings.HasPrefix(e, op+" ") {
			n++
		}
	}
	return n
}

// fakeTokenizers returns fakeTokenizer for every model and records the calls.
type fakeTokenizers struct {
	mu    sync.Mutex
	calls []tokCall
	// err, when set, is returned by every Tokenize call; empty makes them return no tokens.
	err   error
	empty bool
}

type tokCall struct {
	model, kind string
	body        string
}

var _ extproc.Tokenizers = (*fakeTokenizers)(nil)

func (f *fakeTokenizers) ForModel(model string) (extproc.RequestTokenizer, error) {
	return fakeTokenizer{f: f, model: model}, nil
}

func (f *fakeTokenizers) snapshot() []tokCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]tokCall(nil), f.calls...)
}

type fakeTokenizer struct {
	f     *fakeTokenizers
	model string
}

func (t fakeTokenizer) tokenize(kind string, body []byte) ([]uint32, error) {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	t.f.calls = append(t.f.calls, tokCall{t.model, kind, string(body)})
	if t.f.err != nil {
		return nil, t.f.err
	}
	if t.f.empty {
		return nil, nil
	}
	n := min(len(body)/4+1, 4096)
	toks := make([]uint32, n)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	return toks, nil
}

func (t fakeTokenizer) TokenizeChat(body []byte) ([]uint32, error) { return t.tokenize("chat", body) }
func (t fakeTokenizer) TokenizeCompletion(body []byte) ([]uint32, error) {
	return t.tokenize("completion", body)
}
func (t fakeTokenizer) TokenizeResponses(body []byte) ([]uint32, error) {
	return t.tokenize("responses", body)
}

// harness is a Server on loopback with fakes and an emulator client.
type harness struct {
	srv    *extproc.Server
	pk     *fakePicker
	tok    *fakeTokenizers
	client *extproctest.Client
}

func newHarness(t testing.TB, mutate func(*extproc.Config)) *harness {
	t.Helper()
	h := &harness{pk: newFakePicker(), tok: &fakeTokenizers{}}
	cfg := extproc.Config{Picker: h.pk, Tokenizers: h.tok}
	if mutate != nil {
		mutate(&cfg)
	}
	srv, err := extproc.NewServer(cfg)
	if err != nil {
		t.Fatalf("NewServer: %v", err)
	}
	h.srv = srv
	conn := extproctest.Serve(t, srv.Register, srv.GRPCServerOptions()...)
	h.client = extproctest.NewClient(conn)
	return h
}

func (h *harness) do(t *testing.T, req extproctest.Request) *extproctest.Exchange {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ex, err := h.client.Do(ctx, req)
	if err != nil {
		t.Fatalf("Do: %v", err)
	}
	return ex
}

// chatBody returns a valid chat body of exactly n bytes (n ≥ 80).
func chatBody(n int) []byte {
	head := `{"model":"m","messages":[{"role":"user","content":"`
	tail := `"}]}`
	pad := n - len(head) - len(tail)
	if pad < 0 {
		panic(fmt.Sprintf("chatBody(%d) too small", n))
	}
	return []byte(head + strings.Repeat("a", pad) + tail)
}

// okResponse is a small successful streaming response.
func okResponse() *extproctest.Response {
	return &extproctest.Response{ContentType: "text/event-stream", Chunks: [][]byte{
		[]byte("data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n"),
		[]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n"),
	}}
}
