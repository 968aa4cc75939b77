// Package policytest provides utilities for testing worker-selection policies, in the way
// net/http/httptest serves HTTP handlers: a fake host input source with explicit per-worker
// CACHE, LOAD and ROUTING inputs, a candidate shuffler, and a helper that runs a policy's Select
// through the real host contract (policies.WorkerSelectionPolicy.Select, selection-service.md
// §17.2) over shuffled candidates, so a policy's decisions are shown not to depend on the order
// the host lists its workers in.
//
//	p := policytest.NewPolicy(t, leastbusy.Provider, `{"min_device_overlap_blocks": 1}`)
//	res, err := policytest.Select(p, policies.ContextParams{ISLTokens: 64, BlockSize: 16}, rng,
//		policytest.Source{{Worker: policytest.W(1, 0), Device: 4}, {Worker: policytest.W(2, 0), Requests: 3}})
package policytest

import (
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/policies"
)

// Candidate is one worker with the inputs a host would compute for it (selection-service.md
// §17.1). Zero fields are zero inputs; the routing multiplier is absent unless HasMultiplier.
type Candidate struct {
	// Worker is the (worker, dp_rank) pair.
	Worker policies.Worker

	// CACHE group, in blocks: device overlap, host and disk extension beyond the device prefix,
	// and blocks shared beyond the device prefix.
	Device, Host, Disk, SharedBeyondDevice int

	// LOAD group: active prefill tokens, decode cost in blocks, and live bookings (requests),
	// with kvepp's engine extension.
	Prefill, DecodeCost, Requests int
	Engine                        policies.EngineLoad

	// ROUTING group: the preferred-taint multiplier and whether the worker has one.
	Multiplier    float64
	HasMultiplier bool
}

// W returns the worker (id, rank): shorthand for candidate tables.
func W(id uint64, rank uint32) policies.Worker { return policies.Worker{WorkerID: id, DPRank: rank} }

// Source is a policies.InputSource over candidates in the order of the workers slice passed to
// Select (row i answers for workers[i]; see Workers). Inputs are computed on demand from the
// candidate's fields, as a host computes them lazily.
type Source []Candidate

// Cache returns candidate i's CACHE group.
func (s Source) Cache(i int) policies.CacheInputs {
	c := &s[i]
	return policies.NewCacheInputs(c.Device, c.Host, c.Disk, c.SharedBeyondDevice)
}

// Load returns candidate i's LOAD group.
func (s Source) Load(i int) policies.LoadInputs {
	c := &s[i]
	return policies.NewLoadInputs(c.Prefill, c.DecodeCost, c.Requests).WithEngine(c.Engine)
}

// Routing returns candidate i's ROUTING group.
func (s Source) Routing(i int) policies.RoutingInputs {
	return policies.NewRoutingInputs(s[i].Multiplier, s[i].HasMultiplier)
}

// Workers returns the candidates' workers in row order: the workers slice to pass to Select with
// s as its source.
func (s Source) Workers() []policies.Worker {
	ws := make([]policies.Worker, len(s))
	for i := range s {
		ws[i] = s[i].Worker
	}
	return ws
}

// Shuffled returns a copy of s permuted by one rng.Shuffle call (see Shuffle).
func (s Source) Shuffled(rng *rand.Rand) Source { return Shuffle(rng, s) }

// Shuffle returns a copy of s permuted by one rng.Shuffle call; s itself is not modified.
func Shuffle[T any](rng *rand.Rand, s []T) []T {
	out := append([]T(nil), s...)
	rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}

// Select runs p.Select over src shuffled with rng (see Shuffled), with a selection context built
// from params whose Rand is set to rng, exactly as a host would call it. It returns Select's
// result and error; Result.Row indexes the shuffled order, so compare Result.Worker.
func Select(p *policies.WorkerSelectionPolicy, params policies.ContextParams, rng *rand.Rand, src Source) (policies.Result, error) {
	s := src.Shuffled(rng)
	params.Rand = rng
	return p.Select(policies.NewWorkerSelectionContext(params), s.Workers(), s)
}

// BenchSelect is the measured loop of a policy benchmark: b.N calls of p.Select over src in its
// order, with ctx, allocations reported and the timer reset first (setup and any warm-up the
// caller did are not counted). src is converted to an InputSource once, outside the loop: a
// slice-to-interface conversion allocates.
func BenchSelect(b *testing.B, p *policies.WorkerSelectionPolicy, ctx *policies.WorkerSelectionContext, src Source) {
	b.Helper()
	ws := src.Workers()
	var in policies.InputSource = src
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := p.Select(ctx, ws, in); err != nil {
			b.Fatal(err)
		}
	}
}

// NoInputs returns an InputSource for policies that declare no input group: computing any group
// fails t, naming the group.
func NoInputs(t testing.TB) policies.InputSource { return noInputs{t} }

type noInputs struct{ t testing.TB }

func (s noInputs) Cache(int) policies.CacheInputs {
	s.t.Error("CACHE computed")
	return policies.CacheInputs{}
}

func (s noInputs) Load(int) policies.LoadInputs {
	s.t.Error("LOAD computed")
	return policies.LoadInputs{}
}

func (s noInputs) Routing(int) policies.RoutingInputs {
	s.t.Error("ROUTING computed")
	return policies.RoutingInputs{}
}

// Params returns raw as policy parameters (policies.NewPolicyParameters: "" is the empty
// mapping), failing t when raw is not a JSON mapping.
func Params(t testing.TB, raw string) policies.PolicyParameters {
	t.Helper()
	p, err := policies.NewPolicyParameters([]byte(raw))
	if err != nil {
		t.Fatalf("policytest: parameters %s: %v", raw, err)
	}
	return p
}

// WantRejected fails t unless provider rejects the raw JSON parameters (see Params) with an error
// whose message contains want and names the policy type typeName.
func WantRejected(t testing.TB, provider policies.Provider, typeName, raw, want string) {
	t.Helper()
	_, err := provider(Params(t, raw))
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), typeName) {
		t.Fatalf("%s parameters %s: err = %v, want it to name %q and the type", typeName, raw, err, want)
	}
}

// NewPolicy builds the policy of partition m/default from provider with the raw JSON parameters
// (see Params), the default router configuration and worker type "select". It fails t when the
// parameters or the factory are rejected.
func NewPolicy(t testing.TB, provider policies.Provider, raw string) *policies.WorkerSelectionPolicy {
	t.Helper()
	f, err := provider(Params(t, raw))
	if err != nil {
		t.Fatalf("policytest: provider rejected %s: %v", raw, err)
	}
	return Partition(t, f, "default")
}

// Partition builds the policy of partition m/group from factory with the default router
// configuration and worker type "select", failing t when the factory returns an error. Two
// partitions built from one factory have independent state.
func Partition(t testing.TB, factory policies.PolicyFactory, group string) *policies.WorkerSelectionPolicy {
	t.Helper()
	p, err := factory(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: group})
	if err != nil {
		t.Fatalf("policytest: factory for partition m/%s: %v", group, err)
	}
	return p
}

// Filter is a policies.WorkerFilter built from a function (like http.HandlerFunc): it declares
// the input groups In and keeps a candidate when Fn says so.
type Filter struct {
	In policies.WorkerInputs
	Fn func(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error)
}

// RequiredWorkerInputs returns f.In.
func (f Filter) RequiredWorkerInputs() policies.WorkerInputs { return f.In }

// Keep returns f.Fn(ctx, c).
func (f Filter) Keep(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
	return f.Fn(ctx, c)
}

// Scorer is a policies.WorkerScorer built from a function: it declares the input groups In and
// scores a candidate with Fn.
type Scorer struct {
	In policies.WorkerInputs
	Fn func(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error)
}

// RequiredWorkerInputs returns s.In.
func (s Scorer) RequiredWorkerInputs() policies.WorkerInputs { return s.In }

// Score returns s.Fn(ctx, c).
func (s Scorer) Score(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	return s.Fn(ctx, c)
}

// Picker is a policies.WorkerPicker built from a function: it declares the input groups In and
// picks a row of the view with Fn.
type Picker struct {
	In policies.WorkerInputs
	Fn func(ctx *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error)
}

// RequiredWorkerInputs returns p.In.
func (p Picker) RequiredWorkerInputs() policies.WorkerInputs { return p.In }

// Pick returns p.Fn(ctx, v).
func (p Picker) Pick(ctx *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
	return p.Fn(ctx, v)
}
