package predictedttft_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvepp/kvepp/catalog/catalogtest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
	"github.com/kvepp/kvepp/policies/predictedttft"
)

// bs is the block size of every test; a 10,000 tokens/s worker prefills one block in 1.6 ms.
const bs = 16

// worker is a candidate with a measured prefill rate of 10,000 tokens/s (no pool rate), prefill
// queued tokens and cached device blocks.
func worker(id uint64, queued, cached int) policytest.Candidate {
	return policytest.Candidate{Worker: policytest.W(id, 0), Prefill: queued, Device: cached,
		Engine: policies.EngineLoad{PrefillTokensPerSecond: 10000, PrefillRateSamples: 50}}
}

func params() predictedttft.Params {
	return predictedttft.DefaultParams(policies.DefaultRouterConfig())
}

func ctx(isl int) *policies.WorkerSelectionContext {
	return policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: isl, BlockSize: bs})
}

func ttft(p predictedttft.Params, isl int, c policytest.Candidate) float64 {
	src := policytest.Source{c}
	cache, load := src.Cache(0), src.Load(0)
	return p.TTFT(ctx(isl), &cache, &load)
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

func TestPredictedTTFT(t *testing.T) {
	p := params()
	t.Run("queued prefill plus the uncached tokens at the measured rate", func(t *testing.T) {
		// 2,000 queued + (1,600 − 64 × 16 = 576 uncached) tokens at 10,000 tokens/s.
		if got := ttft(p, 1600, worker(1, 2000, 64)); !near(got, 0.2576) {
			t.Fatalf("ttft %v, want 0.2576 s", got)
		}
	})
	t.Run("without a measurement the pool's rate, else prefill_tokens_per_second, is used", func(t *testing.T) {
		c := policytest.Candidate{Worker: policytest.W(1, 0), Prefill: 1000}
		if got := ttft(p, 1000, c); !near(got, 2000.0/predictedttft.DefaultPrefillTokensPerSecond) {
			t.Fatalf("assumed-rate ttft %v", got)
		}
		c.Engine.PoolPrefillTokensPerSecond = 4000
		if got := ttft(p, 1000, c); !near(got, 0.5) {
			t.Fatalf("pool-rate ttft %v, want 0.5 s", got)
		}
	})
	t.Run("a worker's own rate is blended with the pool's by sample count", func(t *testing.T) {
		c := worker(1, 0, 0)
		c.Engine.PoolPrefillTokensPerSecond, c.Engine.PrefillRateSamples = 20000, 32
		// (10,000 × 32 + 20,000 × 32) / 64 = 15,000 tokens/s.
		if got := ttft(p, 1500, c); !near(got, 0.1) {
			t.Fatalf("ttft %v, want 0.1 s at the blended 15,000 tokens/s", got)
		}
	})
	t.Run("KV overflow waits as long as prefilling the missing blocks would take", func(t *testing.T) {
		c := worker(1, 0, 0)
		c.Engine.TotalKVBlocks, c.Engine.ActiveBlocks, c.DecodeCost = 100, 95, 105
		// The request needs 10 new blocks: 5 do not fit, 80 tokens at 10,000 tokens/s.
		if got := ttft(p, 160, c); !near(got, 0.016+0.008) {
			t.Fatalf("ttft %v, want 24 ms", got)
		}
	})
	t.Run("KV overflow counts cached prompt blocks no live booking holds: running pins them", func(t *testing.T) {
		// 10 full blocks, all cached on the device but held by no live booking (decode cost =
		// 95 active + 10): the engine must pin them, so 5 do not fit even though nothing is
		// prefilled. Output blocks of running responses are part of the 95 active blocks.
		c := worker(1, 0, 10)
		c.Engine.TotalKVBlocks, c.Engine.ActiveBlocks, c.DecodeCost = 100, 95, 105
		if got := ttft(p, 160, c); !near(got, 0.008) {
			t.Fatalf("ttft %v, want the 5 blocks' wait (8 ms) and no prefill", got)
		}
	})
	t.Run("a prefix live bookings are computing counts as cached", func(t *testing.T) {
		c := worker(1, 0, 2)
		// 20 full blocks; decode cost = 30 active + 5 not held → 15 held: the live prefix.
		c.Engine.ActiveBlocks, c.DecodeCost = 30, 35
		if got := ttft(p, 320, c); !near(got, 80.0/10000) {
			t.Fatalf("ttft %v, want the 5 unheld blocks only (8 ms)", got)
		}
	})
}

func pick(t *testing.T, pol *policies.WorkerSelectionPolicy, isl int, rng *rand.Rand, src policytest.Source) uint64 {
	t.Helper()
	res, err := policytest.Select(pol, policies.ContextParams{ISLTokens: isl, BlockSize: bs}, rng, src)
	if err != nil {
		t.Fatal(err)
	}
	return res.Worker.WorkerID
}

// withArrivals sets the pool's booking rate on every candidate.
func withArrivals(src policytest.Source, perSecond float64) policytest.Source {
	out := append(policytest.Source(nil), src...)
	for i := range out {
		out[i].Engine.PoolArrivalsPerSecond, out[i].Engine.PoolCandidates = perSecond, len(out)
	}
	return out
}

func TestPredictedTTFTDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	pol := policytest.NewPolicy(t, predictedttft.Provider, "")
	t.Run("a cold request goes to the worker with the least queued prefill", func(t *testing.T) {
		src := policytest.Source{worker(1, 9000, 0), worker(2, 1000, 0), worker(3, 5000, 0)}
		for i := 0; i < 20; i++ {
			if got := pick(t, pol, 4000, rng, src); got != 2 {
				t.Fatalf("got worker %d", got)
			}
		}
	})
	// A returning conversation: 16,000 tokens, 15,000 of them cached on worker 1 behind 20,000
	// queued tokens (2.1 s); worker 2 is idle but must prefill everything (1.6 s).
	conversation := policytest.Source{worker(1, 20000, 15000/bs), worker(2, 0, 0)}
	t.Run("on a quiet pool it moves to the faster first token", func(t *testing.T) {
		if got := pick(t, pol, 16000, rng, withArrivals(conversation, 0)); got != 2 {
			t.Fatalf("got worker %d, want the idle worker 2", got)
		}
	})
	t.Run("under traffic the delay its recompute imposes on later arrivals keeps it", func(t *testing.T) {
		// 1 request/s per worker: worker 2 would spend 1.6 s on this request while 1.6 more
		// requests arrive, each delayed 1.6 s (2.56 s), far more than the 0.5 s it saves.
		if got := pick(t, pol, 16000, rng, withArrivals(conversation, 2)); got != 1 {
			t.Fatalf("got worker %d, want worker 1, which holds the history", got)
		}
	})
	// A conversation of 5,000 tokens, 4,000 of them cached on worker 1 behind 10,000 queued
	// tokens (1.1 s); worker 2 is idle but must prefill all 5,000 (0.5 s). One request/s per
	// worker.
	home, idle := worker(1, 10000, 4000/bs), worker(2, 0, 0)
	t.Run("the recompute is charged over the pool's typical backlog, not the idle worker's", func(t *testing.T) {
		// Three more workers each 2.5 s behind: the median predicted TTFT is 2.5 s. Worker 2's
		// 0.5 s of recompute delays the arrivals of that horizon (0.5 + 0.5 × 2.5 = 1.75 s),
		// more than the 0.25 s worker 1's own 0.1 s of prefill costs them (1.1 + 0.25 = 1.35 s).
		// Charged over worker 2's own 0.5 s it would look cheaper (0.75 s) and leave the cache.
		busy := func(id uint64) policytest.Candidate { return worker(id, 20000, 0) }
		src := withArrivals(policytest.Source{home, idle, busy(3), busy(4), busy(5)}, 5)
		for i := 0; i < 20; i++ {
			if got := pick(t, pol, 5000, rng, src); got != 1 {
				t.Fatalf("got worker %d, want worker 1, which holds the history", got)
			}
		}
	})
	t.Run("one overloaded worker does not raise the horizon", func(t *testing.T) {
		// A third worker 20 s behind is the maximum, not the median (1.1 s): worker 2 costs
		// 0.5 + 0.5 × 1.1 = 1.05 s, worker 1 1.1 + 0.1 × 1.1 = 1.21 s. A mean horizon (7.4 s)
		// would keep the request on worker 1 however hot the third worker got.
		src := withArrivals(policytest.Source{home, idle, worker(3, 200000, 0)}, 3)
		for i := 0; i < 20; i++ {
			if got := pick(t, pol, 5000, rng, src); got != 2 {
				t.Fatalf("got worker %d, want the idle worker 2", got)
			}
		}
	})
	// The same conversation on engines whose total_kv_blocks is known: 1,000 blocks of prompt,
	// 937 cached on worker 1, whose live bookings hold booked1 blocks of its 100,000.
	withKV := func(booked1 int) policytest.Source {
		home, idle := worker(1, 20000, 15000/bs), worker(2, 0, 0)
		home.Engine.TotalKVBlocks, idle.Engine.TotalKVBlocks = 100000, 100000
		home.Engine.ActiveBlocks, home.DecodeCost = booked1, booked1+1000-15000/bs
		idle.DecodeCost = 1000
		return withArrivals(policytest.Source{home, idle}, 0)
	}
	for _, tc := range []struct {
		name          string
		booked        int    // blocks worker 1's live bookings hold
		want          uint64 // the default's choice
		params        string // other parameters …
		wantWithParam uint64 // … and their choice
	}{
		// Worker 1's KV is 10 % booked: staying costs 0.5 s more predicted TTFT, moving makes the
		// pool redo 14,992 tokens, charged 20 × 1.5 s. The previous default (no sticky charge)
		// moved it, as it still does with sticky_weight 0.
		{"a roomy worker keeps the conversation whose history it holds", 10000, 1, `{"sticky_weight": 0}`, 2},
		// 25,063 of 100,000 blocks held after placement (> 20 %): no sticky charge, and the faster
		// first token wins as before; with a looser fraction worker 1 is roomy again.
		{"a worker whose KV is booked beyond sticky_kv_fraction does not hold it", 25000, 2, `{"sticky_kv_fraction": 0.3}`, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for i := 0; i < 20; i++ {
				if got := pick(t, pol, 16000, rng, withKV(tc.booked)); got != tc.want {
					t.Fatalf("got worker %d, want worker %d", got, tc.want)
				}
			}
			other := policytest.NewPolicy(t, predictedttft.Provider, tc.params)
			if got := pick(t, other, 16000, rng, withKV(tc.booked)); got != tc.wantWithParam {
				t.Fatalf("with %s got worker %d, want worker %d", tc.params, got, tc.wantWithParam)
			}
		})
	}
	t.Run("the sticky charge is measured against the best roomy worker", func(t *testing.T) {
		// Worker 1 holds the whole history but is 30 % booked; worker 3 is roomy and holds
		// 8,000 tokens of it behind 10,000 queued (1.8 s); worker 2 is idle (1.6 s). Worker 2
		// redoes 8,000 tokens worker 3 has cached (20 × 0.8 s), so worker 3 wins.
		src := withKV(30000)
		third := worker(3, 10000, 8000/bs)
		third.Engine.TotalKVBlocks, third.Engine.ActiveBlocks, third.DecodeCost = 100000, 5000, 5000+1000-8000/bs
		src = withArrivals(append(src, third), 0)
		for i := 0; i < 20; i++ {
			if got := pick(t, pol, 16000, rng, src); got != 3 {
				t.Fatalf("got worker %d, want worker 3", got)
			}
		}
	})
	t.Run("without total_kv_blocks no worker counts as roomy", func(t *testing.T) {
		src := withKV(10000)
		for i := range src {
			src[i].Engine.TotalKVBlocks = 0
		}
		if got := pick(t, pol, 16000, rng, src); got != 2 {
			t.Fatalf("got worker %d, want the idle worker 2", got)
		}
	})
	t.Run("recompute_weight charges the prefill the pool redoes", func(t *testing.T) {
		sticky := policytest.NewPolicy(t, predictedttft.Provider, `{"recompute_weight": 2}`)
		if got := pick(t, sticky, 16000, rng, withArrivals(conversation, 0)); got != 1 {
			t.Fatalf("got worker %d, want worker 1", got)
		}
	})
	t.Run("near ties go to the lighter decode load", func(t *testing.T) {
		// Worker 2 caches the shared first 32 blocks (512 tokens ahead) but decodes 40 requests
		// (4,000 blocks after placing this one); worker 1 is fresh with 2 (300 blocks).
		a, b := worker(1, 0, 0), worker(2, 0, 32)
		a.DecodeCost, b.DecodeCost = 300, 4000
		for i := 0; i < 20; i++ {
			if got := pick(t, pol, 4000, rng, policytest.Source{a, b}); got != 1 {
				t.Fatalf("got worker %d, want the lighter worker 1", got)
			}
		}
		tight := policytest.NewPolicy(t, predictedttft.Provider, `{"near_tie_tokens": 0}`)
		if got := pick(t, tight, 4000, rng, policytest.Source{a, b}); got != 2 {
			t.Fatalf("with near_tie_tokens 0 got worker %d, want the cached worker 2", got)
		}
	})
	t.Run("a near tie with equal decode load goes to the lower cost", func(t *testing.T) {
		// The same prompt again: worker 1 holds it (live or cached), worker 2 does not; placing it
		// on either leaves the same decode load, so the cache wins.
		a, b := worker(1, 0, 250), worker(2, 0, 0)
		a.DecodeCost, b.DecodeCost = 250, 250
		for i := 0; i < 20; i++ {
			if got := pick(t, pol, 4000, rng, policytest.Source{a, b}); got != 1 {
				t.Fatalf("got worker %d, want worker 1 which caches the prompt", got)
			}
		}
	})
	t.Run("exact ties are broken uniformly at random", func(t *testing.T) {
		counts := map[uint64]int{}
		const n = 3000
		for i := 0; i < n; i++ {
			counts[pick(t, pol, 4000, rng, policytest.Source{worker(1, 0, 0), worker(2, 0, 0), worker(3, 0, 0)})]++
		}
		for id := uint64(1); id <= 3; id++ {
			if c := counts[id]; c < n/3-150 || c > n/3+150 {
				t.Fatalf("counts %v", counts)
			}
		}
	})
	t.Run("the reported cost is the predicted TTFT in seconds", func(t *testing.T) {
		res, err := policytest.Select(pol, policies.ContextParams{ISLTokens: 2000, BlockSize: bs}, rng, policytest.Source{worker(1, 3000, 0)})
		if err != nil {
			t.Fatal(err)
		}
		if !near(res.Cost, 0.5) {
			t.Fatalf("cost %v, want 0.5 s", res.Cost)
		}
	})
}

func TestPredictedTTFTParameters(t *testing.T) {
	for _, tc := range []struct{ raw, want string }{
		{`{"prefill_tokens_per_second": 0}`, "prefill_tokens_per_second"},
		{`{"delay_weight": -1}`, "delay_weight"},
		{`{"recompute_weight": -0.5}`, "recompute_weight"},
		{`{"kv_pressure_weight": -2}`, "kv_pressure_weight"},
		{`{"near_tie_tokens": -1}`, "near_tie_tokens"},
		{`{"min_recompute_weight": 1}`, "min_recompute_weight"},
		{`{"sticky_weight": -1}`, "sticky_weight"},
		{`{"sticky_kv_fraction": -0.1}`, "sticky_kv_fraction"},
		{`{"sticky_kv_fraction": 1.5}`, "sticky_kv_fraction"},
	} {
		policytest.WantRejected(t, predictedttft.Provider, predictedttft.TypeName, tc.raw, tc.want)
	}
	pol := policytest.NewPolicy(t, predictedttft.Provider, `{"delay_weight": 0, "recompute_weight": 1.5, "near_tie_tokens": 64, "kv_pressure_weight": 0, "prefill_tokens_per_second": 5000, "sticky_weight": 10, "sticky_kv_fraction": 0.5}`)
	if got := pol.RequiredInputs(); got != policies.InputsCache|policies.InputsLoad {
		t.Fatalf("required inputs %v, want CACHE|LOAD", got)
	}
}

func TestPredictedTTFTREADMEExampleSelectsThePolicy(t *testing.T) {
	res := catalogtest.ResolveREADME(t, predictedttft.TypeName, predictedttft.Provider)
	policytest.Partition(t, res.Factory, "default")
}
