package picker_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
)

// time0 is the fake clock's start.
var time0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// newService builds a service with deterministic randomness. KV events are off unless a mod turns
// them on (and sets an EventSource).
func newService(t testing.TB, mods ...func(*picker.Config)) *picker.Service {
	t.Helper()
	cfg := pickertest.Config(1, 42)
	for _, m := range mods {
		m(&cfg)
	}
	s, err := picker.New(cfg)
	if err != nil {
		t.Fatalf("picker.New: %v", err)
	}
	return s
}

func withEvents(f *pickertest.EventSource) func(*picker.Config) {
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

// lowestCost picks the minimum-cost row (first on ties).
var lowestCost = policytest.Picker{Fn: func(_ *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
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
