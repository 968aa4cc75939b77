package policies_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
)

// A stacked policy in the shape of the reference examples: a CACHE filter, three scorers over
// LOAD, CACHE and ROUTING, and a lowest-cost picker with random tie-break.

type minOverlapFilter struct{ min int }

func (minOverlapFilter) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsCache }
func (f minOverlapFilter) Keep(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
	cache := c.Cache()
	if cache == nil {
		return false, policies.Failed("cache input unavailable")
	}
	return cache.DeviceOverlapBlocks() >= f.min, nil
}

type activeRequestsScorer struct{}

func (activeRequestsScorer) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsLoad }
func (activeRequestsScorer) Score(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	return float64(c.Load().ActiveRequests()) + float64(c.Load().DecodeCostBlocks()), nil
}

type overlapScorer struct{}

func (overlapScorer) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsCache }
func (overlapScorer) Score(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	cache := c.Cache()
	return float64(ctx.RequestBlocks()-cache.DeviceOverlapBlocks()) - 0.5*float64(cache.HostOverlapBlocks()), nil
}

type taintScorer struct{}

func (taintScorer) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsRouting }
func (taintScorer) Score(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	if m, ok := c.Routing().PreferredTaintMultiplier(); ok {
		return 10 * m, nil
	}
	return 10, nil
}

type randomTiePicker struct{}

func (randomTiePicker) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }
func (randomTiePicker) Pick(ctx *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
	best, ties := -1, 0
	bestCost := math.Inf(1)
	for i, c := range v.Candidates() {
		switch {
		case c.Cost() < bestCost:
			best, bestCost, ties = i, c.Cost(), 1
		case c.Cost() == bestCost:
			ties++
			if ctx.Rand().IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best, nil
}

func stackedPolicy(tb testing.TB, n int) (*policies.WorkerSelectionPolicy, *policies.WorkerSelectionContext, []policies.Worker, policies.InputSource) {
	tb.Helper()
	p, err := policies.NewPolicyWithFilters(policies.DefaultRouterConfig(), "select",
		[]policies.WorkerFilter{minOverlapFilter{min: 1}},
		[]policies.WorkerScorer{activeRequestsScorer{}, overlapScorer{}, taintScorer{}},
		randomTiePicker{})
	if err != nil {
		tb.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(uint64(n), 1))
	src := make(policytest.Source, n)
	for i := range src {
		src[i] = policytest.Candidate{Worker: policytest.W(uint64(i/2), uint32(i%2)),
			Device: rng.IntN(64), Host: rng.IntN(8), Disk: rng.IntN(8), // ~1/64 filtered
			Prefill: rng.IntN(4096), DecodeCost: rng.IntN(2000), Requests: rng.IntN(32),
			Multiplier: math.Exp(-math.Tanh(rng.Float64() - 0.5)), HasMultiplier: rng.IntN(2) == 0}
	}
	ws := src.Workers()
	ctx := policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 2048, BlockSize: 16, TracksPrefillTokens: true,
		Rand: rand.New(rand.NewPCG(1, 1))})
	// Warm up the policy's buffers.
	if _, err := p.Select(ctx, ws, src); err != nil {
		tb.Fatal(err)
	}
	return p, ctx, ws, src
}

// BenchmarkSelect runs the stacked policy (1 filter, 3 scorers, 1 picker) over N candidates.
// Goals: ≤ 50 µs at 1024, ≤ 500 µs at 10000, 0 allocs/op.
func BenchmarkSelect(b *testing.B) {
	for _, n := range []int{2, 32, 1024, 10000} {
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			p, ctx, ws, src := stackedPolicy(b, n)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := p.Select(ctx, ws, src); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/candidate")
		})
	}
}
