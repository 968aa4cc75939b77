package picker_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/policies"
)

// time0 is the fake clock's start.
var time0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// fakeEvents is a KVEventSource that records attaches and detaches and lets tests apply events
// to the index a worker was attached to.
type fakeEvents struct {
	mu       sync.Mutex
	specs    map[uint64]picker.WorkerEventSpec
	indexes  map[uint64]*kvindex.Index
	attaches []picker.WorkerEventSpec
	detaches []uint64
	// fail, when set, makes AttachWorker return its error for that spec.
	fail func(spec picker.WorkerEventSpec) error
}

func newFakeEvents() *fakeEvents {
	return &fakeEvents{specs: map[uint64]picker.WorkerEventSpec{}, indexes: map[uint64]*kvindex.Index{}}
}

func (f *fakeEvents) AttachWorker(spec picker.WorkerEventSpec, idx *kvindex.Index) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.attaches = append(f.attaches, spec)
	if f.fail != nil {
		if err := f.fail(spec); err != nil {
			return err
		}
	}
	// Like kvevents.Manager: a re-attach clears the ranks whose endpoint (or hashing, or index)
	// changed and the ranks that left the range.
	if old, ok := f.specs[spec.WorkerID]; ok {
		oldIdx := f.indexes[spec.WorkerID]
		for r := old.DPStartRank; r-old.DPStartRank < old.DPSize; r++ {
			inRange := r >= spec.DPStartRank && r-spec.DPStartRank < spec.DPSize
			same := inRange && old.Endpoints[r] == spec.Endpoints[r] && old.ReplayEndpoint == spec.ReplayEndpoint &&
				old.BlockSize == spec.BlockSize && old.IsEagle == spec.IsEagle && oldIdx == idx
			if !same {
				_ = oldIdx.Apply(kvindex.Event{WorkerID: spec.WorkerID, DPRank: r, Kind: kvindex.EventCleared})
			}
		}
	}
	f.specs[spec.WorkerID] = spec
	f.indexes[spec.WorkerID] = idx
	return nil
}

func (f *fakeEvents) DetachWorker(workerID uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.detaches = append(f.detaches, workerID)
	delete(f.specs, workerID)
	delete(f.indexes, workerID)
}

func (f *fakeEvents) attached(workerID uint64) (picker.WorkerEventSpec, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.specs[workerID]
	return s, ok
}

// store applies a device-tier Stored event of local hashes for (worker, rank) to the index the
// worker is attached to; external ids are the local hashes + 1.
func (f *fakeEvents) store(t *testing.T, workerID uint64, rank uint32, tier kvindex.Tier, parent *uint64, local ...uint64) {
	t.Helper()
	f.mu.Lock()
	idx := f.indexes[workerID]
	f.mu.Unlock()
	if idx == nil {
		t.Fatalf("worker %d is not attached", workerID)
	}
	ev := kvindex.Event{WorkerID: workerID, DPRank: rank, Tier: tier, Kind: kvindex.EventStored}
	if parent != nil {
		ev.HasParent, ev.ParentHash = true, *parent
	}
	for _, h := range local {
		ev.Blocks = append(ev.Blocks, kvindex.StoredBlock{BlockHash: h + 1, TokensHash: h})
	}
	if err := idx.Apply(ev); err != nil {
		t.Fatalf("apply stored event: %v", err)
	}
}

// newService builds a service with deterministic randomness. KV events are off unless a mod turns
// them on (and sets an EventSource).
func newService(t testing.TB, mods ...func(*picker.Config)) *picker.Service {
	t.Helper()
	cfg := picker.DefaultConfig()
	cfg.Router.UseKVEvents = false
	seed := uint64(1)
	var mu sync.Mutex
	cfg.RandSource = func() rand.Source {
		mu.Lock()
		defer mu.Unlock()
		seed++
		return rand.NewPCG(seed, 42)
	}
	for _, m := range mods {
		m(&cfg)
	}
	s, err := picker.New(cfg)
	if err != nil {
		t.Fatalf("picker.New: %v", err)
	}
	return s
}

func withEvents(f *fakeEvents) func(*picker.Config) {
	return func(c *picker.Config) {
		c.Router.UseKVEvents = true
		c.EventSource = f
	}
}

func u32(v uint32) *uint32   { return &v }
func u64(v uint64) *uint64   { return &v }
func f64(v float64) *float64 { return &v }
func boolp(v bool) *bool     { return &v }
func strp(v string) *string  { return &v }
func ctxb() context.Context  { return context.Background() }
func tokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(i + 1)
	}
	return out
}

// worker is the §20 fixture record: model "model", endpoint http://worker-N:8000, block size 4.
func worker(id uint64, mods ...func(*picker.WorkerRecord)) picker.WorkerRecord {
	r := picker.WorkerRecord{
		WorkerID:  id,
		ModelName: "model",
		Endpoint:  "http://worker-" + itoa(id) + ":8000",
		BlockSize: u32(4),
	}
	for _, m := range mods {
		m(&r)
	}
	return r
}

func itoa(v uint64) string {
	if v == 0 {
		return "0"
	}
	var b []byte
	for v > 0 {
		b = append([]byte{byte('0' + v%10)}, b...)
		v /= 10
	}
	return string(b)
}

func mustUpsert(t testing.TB, s *picker.Service, rec picker.WorkerRecord) picker.WorkerState {
	t.Helper()
	st, err := s.UpsertWorker(ctxb(), rec, picker.SourceAPI)
	if err != nil {
		t.Fatalf("upsert worker %d: %v", rec.WorkerID, err)
	}
	return st
}

// tokenReq is a token-form request on partition model:default.
func tokenReq(toks []uint32, mods ...func(*picker.SelectRequest)) picker.SelectRequest {
	r := picker.SelectRequest{ModelName: "model", Prompt: picker.Prompt{TokenIDs: toks}}
	for _, m := range mods {
		m(&r)
	}
	return r
}

// wantKind asserts err is a picker error of kind with message msg ("" = any message).
func wantKind(t *testing.T, err error, kind picker.Kind, msg string) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want %s %q", kind, msg)
	}
	var pe *picker.Error
	if !errors.As(err, &pe) {
		t.Fatalf("error %v (%T) is not a *picker.Error", err, err)
	}
	if pe.Kind != kind || (msg != "" && pe.Message != msg) {
		t.Fatalf("got %s %q, want %s %q", pe.Kind, pe.Message, kind, msg)
	}
}

// loadOf returns the load row of (worker, rank) in partition model:group.
func loadOf(t *testing.T, s *picker.Service, model, group string, w uint64, r uint32) picker.PotentialLoad {
	t.Helper()
	for _, pl := range s.Loads(model, group) {
		for _, l := range pl.Loads {
			if l.WorkerID == w && l.DPRank == r {
				return l
			}
		}
	}
	t.Fatalf("no load row for worker %d dp_rank %d in %s:%s", w, r, model, group)
	return picker.PotentialLoad{}
}

// Policy components built from functions, for custom-policy tests.
type funcFilter struct {
	in   policies.WorkerInputs
	keep func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (bool, error)
}

func (f funcFilter) RequiredWorkerInputs() policies.WorkerInputs { return f.in }
func (f funcFilter) Keep(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
	return f.keep(ctx, c)
}

type funcScorer struct {
	in    policies.WorkerInputs
	score func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (float64, error)
}

func (f funcScorer) RequiredWorkerInputs() policies.WorkerInputs { return f.in }
func (f funcScorer) Score(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	return f.score(ctx, c)
}

type funcPicker struct {
	in   policies.WorkerInputs
	pick func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error)
}

func (f funcPicker) RequiredWorkerInputs() policies.WorkerInputs { return f.in }
func (f funcPicker) Pick(ctx *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
	return f.pick(ctx, v)
}

// lowestCost picks the minimum-cost row (first on ties).
var lowestCost = funcPicker{pick: func(_ *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
	best := 0
	for i, c := range v.Candidates() {
		if c.Cost() < v.Candidates()[best].Cost() {
			best = i
		}
	}
	return best, nil
}}

// withPolicy installs a factory building filters/scorers/picker for every partition.
func withPolicy(filters []policies.WorkerFilter, scorers []policies.WorkerScorer, pk policies.WorkerPicker) func(*picker.Config) {
	return func(c *picker.Config) {
		c.Policy = func(cfg policies.RouterConfig, wt string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
			return policies.NewPolicyWithFilters(cfg, wt, filters, scorers, pk)
		}
	}
}
