package defaultcost_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
	"github.com/kvepp/kvepp/policies/policytest"
)

func defaults() defaultcost.Params {
	return policies.DefaultRouterConfig()
}

func near(a, b, tol float64) bool { return math.Abs(a-b) <= tol }

// §9.7: bs 16, isl 512; A holds 8 device + 4 host blocks with 1024 active prefill tokens and
// decode cost 132; B holds nothing, no prefill, decode cost 82.
var (
	workedA = defaultcost.Inputs{ISLTokens: 512, BlockSize: 16, TrackPrefillTokens: true, DeviceBlocks: 8, HostExtBlocks: 4,
		ActivePrefillTokens: 1024, DecodeCostBlocks: 132, ActiveRequests: 3}
	workedB = defaultcost.Inputs{ISLTokens: 512, BlockSize: 16, TrackPrefillTokens: true, DecodeCostBlocks: 82, ActiveRequests: 1}
)

func TestCachedAndEffectivePrefillTokens(t *testing.T) {
	p := defaults()
	p.HostCacheHitWeight, p.DiskCacheHitWeight = 0.5, 0.25
	cases := []struct {
		name string
		got  int
		want int
	}{
		{"device 2, host 3, disk 4 + external 5 at weights 0.5/0.25 and bs 16 is 92 tokens", defaultcost.CachedTokens(p, 2, 3, 4+5, 16), 92},
		{"the worked example's A caches round(11 × 16) = 176 tokens", defaultcost.CachedTokens(defaults(), 8, 4, 0, 16), 176},
		{"nothing cached is zero tokens", defaultcost.CachedTokens(p, 0, 0, 0, 16), 0},
		{"negative tier counts clamp to zero tokens", defaultcost.CachedTokens(p, -5, 0, 0, 16), 0},
		{"isl 100 with 40 cached leaves 60", defaultcost.EffectivePrefillTokens(100, 40), 60},
		{"isl 100 with 120 cached leaves 0", defaultcost.EffectivePrefillTokens(100, 120), 0},
		{"the worked example's A leaves 512 − 176 = 336", defaultcost.EffectivePrefillTokens(512, 176), 336},
		{"the worked example's B leaves the whole 512", defaultcost.EffectivePrefillTokens(512, 0), 512},
		{"request blocks are ceil(isl/bs)", defaultcost.RequestBlocks(513, 16), 33},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.got != tc.want {
				t.Fatalf("got %d, want %d", tc.got, tc.want)
			}
		})
	}
	t.Run("the weighted estimate does not apply overlap_score_credit", func(t *testing.T) {
		q := p
		q.OverlapScoreCredit = 0
		if defaultcost.WeightedCachedBlocks(q, 2, 3, 9) != 5.75 {
			t.Fatal(defaultcost.WeightedCachedBlocks(q, 2, 3, 9))
		}
	})
}

func TestCost(t *testing.T) {
	decayed := defaults()
	decayed.OverlapScoreCreditDecay = 1
	a := workedA
	a.MinActivePrefillTokens = 0
	noTrack := workedA
	noTrack.TrackPrefillTokens = false
	withReq := defaults()
	withReq.DecodeActiveRequestWeight = 2
	tainted := workedB
	tainted.TaintMultiplier, tainted.HasTaintMultiplier = defaultcost.PreferredTaintMultiplier(0.5), true
	cases := []struct {
		name string
		p    defaultcost.Params
		in   defaultcost.Inputs
		want float64
	}{
		{"the worked example's A costs 85 + 132 = 217", defaults(), workedA, 217},
		{"the worked example's B costs 32 + 82 = 114", defaults(), workedB, 114},
		{"with credit decay 1 A's credit decays to 5.667 and it costs 222.33", decayed, a, 96 - (8.0/3 + 3) + 132},
		{"with decay enabled a candidate at the minimum keeps its full credit", decayed, workedB, 114},
		{"without prefill tracking only decode load counts", defaults(), noTrack, 132},
		{"the active-request weight adds weight × requests", withReq, workedB, 114 + 2},
		{"a preferred-taint multiplier scales the cost", defaults(), tainted, 114 * math.Exp(-math.Tanh(0.5))},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := defaultcost.Cost(tc.p, tc.in); !near(got, tc.want, 1e-9) {
				t.Fatalf("cost %.6f, want %.6f", got, tc.want)
			}
		})
	}
	t.Run("the decay variant of A rounds to 222.33", func(t *testing.T) {
		if got := defaultcost.Cost(decayed, a); math.Round(got*100)/100 != 222.33 {
			t.Fatalf("cost %v", got)
		}
		if d := defaultcost.CreditDecay(decayed, a); !near(d, 1.0/3, 1e-12) {
			t.Fatalf("decay %v, want 1/3", d)
		}
	})
	t.Run("a credit larger than the prefill clamps the prefill term at zero", func(t *testing.T) {
		in := defaultcost.Inputs{ISLTokens: 64, BlockSize: 16, TrackPrefillTokens: true, DeviceBlocks: 4, HostExtBlocks: 100, DecodeCostBlocks: 7}
		if got := defaultcost.Cost(defaults(), in); got != 7 {
			t.Fatalf("cost %v", got)
		}
	})
}

func TestPreferredTaintMultiplier(t *testing.T) {
	for _, tc := range []struct {
		name string
		s    float64
		want float64
	}{
		{"a preferred-taint weight sum of 0.5 gives 0.6299", 0.5, 0.6299},
		{"a weight sum of −0.5 gives 1.5874", -0.5, 1.5874},
		{"no matching preferred taint gives 1", 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := defaultcost.PreferredTaintMultiplier(tc.s); !near(got, tc.want, 5e-5) {
				t.Fatalf("got %v", got)
			}
		})
	}
	t.Run("the multiplier stays inside (1/e, e) for huge sums", func(t *testing.T) {
		lo, hi := defaultcost.PreferredTaintMultiplier(1e9), defaultcost.PreferredTaintMultiplier(-1e9)
		if !near(lo, 1/math.E, 1e-12) || !near(hi, math.E, 1e-12) {
			t.Fatalf("%v %v", lo, hi)
		}
	})
}

// frequencies draws n picks and returns the observed frequency of each index.
func frequencies(n int, costs []float64, pick func(*rand.Rand) int) []float64 {
	r := rand.New(rand.NewPCG(42, 43))
	counts := make([]float64, len(costs))
	for i := 0; i < n; i++ {
		counts[pick(r)]++
	}
	for i := range counts {
		counts[i] /= float64(n)
	}
	return counts
}

func TestSoftmax(t *testing.T) {
	cases := []struct {
		name  string
		costs []float64
		temp  float64
		want  []float64
	}{
		{"costs 10/20/30 at T = 1 give 0.5065/0.3072/0.1863", []float64{10, 20, 30}, 1, []float64{0.5065, 0.3072, 0.1863}},
		{"costs 10/20/30 at T = 0.5 give 0.6652/0.2447/0.0900", []float64{10, 20, 30}, 0.5, []float64{0.6652, 0.2447, 0.0900}},
		{"the distribution depends on normalised costs only", []float64{1010, 1020, 1030}, 1, []float64{0.5065, 0.3072, 0.1863}},
		{"equal costs are uniform", []float64{4, 4, 4, 4}, 1, []float64{0.25, 0.25, 0.25, 0.25}},
		{"extreme finite costs whose range overflows are rescaled, lowest most likely",
			[]float64{math.MaxFloat64, -math.MaxFloat64, 0}, 1, []float64{0.3679 / 1.9744, 1 / 1.9744, 0.6065 / 1.9744}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			probs := defaultcost.SoftmaxProbabilities(tc.costs, tc.temp, nil)
			for i := range tc.want {
				if math.IsNaN(probs[i]) || !near(probs[i], tc.want[i], 5e-5) {
					t.Fatalf("probabilities %v, want %v", probs, tc.want)
				}
			}
			freq := frequencies(200000, tc.costs, func(r *rand.Rand) int { return defaultcost.PickSoftmax(r, tc.costs, tc.temp) })
			for i := range tc.want {
				// σ ≤ 0.0012 at 200k draws; 0.006 is five sigma.
				if !near(freq[i], tc.want[i], 0.006) {
					t.Fatalf("sampled frequencies %v, want %v", freq, tc.want)
				}
			}
		})
	}
	t.Run("extreme finite costs never produce NaN and the lowest is sampled most often", func(t *testing.T) {
		for _, costs := range [][]float64{
			{math.MaxFloat64, -math.MaxFloat64},
			{1e308, 1.5e308, -1e308, 1},
			{math.SmallestNonzeroFloat64, 0, 2 * math.SmallestNonzeroFloat64},
			{0, math.MaxFloat64},
		} {
			probs := defaultcost.SoftmaxProbabilities(costs, 1, nil)
			lowest := 0
			for i, c := range costs {
				if math.IsNaN(probs[i]) {
					t.Fatalf("NaN probability for %v: %v", costs, probs)
				}
				if c < costs[lowest] {
					lowest = i
				}
			}
			freq := frequencies(20000, costs, func(r *rand.Rand) int { return defaultcost.PickSoftmax(r, costs, 1) })
			for i := range freq {
				if i != lowest && freq[i] >= freq[lowest] {
					t.Fatalf("costs %v: frequencies %v, lowest %d not most likely", costs, freq, lowest)
				}
			}
		}
	})
	t.Run("a temperature that underflows range × T falls back to the minimum", func(t *testing.T) {
		costs := []float64{2e-300, 1e-300, 3e-300}
		if got := defaultcost.PickSoftmax(rand.New(rand.NewPCG(1, 1)), costs, 5e-324); got != 1 {
			t.Fatalf("picked %d", got)
		}
	})
	t.Run("non-finite costs fall back to the minimum instead of sampling NaN weights", func(t *testing.T) {
		costs := []float64{math.NaN(), 5, math.Inf(1), 2}
		if got := defaultcost.PickSoftmax(nil, costs, 1); got != 3 {
			t.Fatalf("picked %d", got)
		}
	})
	t.Run("an empty cost vector picks -1", func(t *testing.T) {
		if defaultcost.PickSoftmax(nil, nil, 1) != -1 || defaultcost.PickMin(nil, nil) != -1 || defaultcost.Pick(nil, nil, 0) != -1 {
			t.Fatal("want -1")
		}
	})
}

func TestPickMin(t *testing.T) {
	t.Run("the minimum wins without ties", func(t *testing.T) {
		if got := defaultcost.PickMin(nil, []float64{5, 2, 9}); got != 1 {
			t.Fatalf("picked %d", got)
		}
	})
	t.Run("exact ties are broken uniformly at random", func(t *testing.T) {
		costs := []float64{5, 3, 3, 7, 3}
		freq := frequencies(60000, costs, func(r *rand.Rand) int { return defaultcost.PickMin(r, costs) })
		for i, f := range freq {
			want := 0.0
			if costs[i] == 3 {
				want = 1.0 / 3
			}
			if !near(f, want, 0.01) {
				t.Fatalf("frequencies %v", freq)
			}
		}
	})
	t.Run("NaN costs are never chosen", func(t *testing.T) {
		if got := defaultcost.PickMin(nil, []float64{math.NaN(), 4, math.NaN()}); got != 1 {
			t.Fatalf("picked %d", got)
		}
	})
	t.Run("temperature zero dispatches to the minimum", func(t *testing.T) {
		if got := defaultcost.Pick(nil, []float64{5, 2, 9}, 0); got != 1 {
			t.Fatalf("picked %d", got)
		}
	})
}

// --- through the policy interfaces --------------------------------------------------------------

var worked = policytest.Source{
	{Worker: policies.Worker{WorkerID: 1}, Device: 8, Host: 4, Prefill: 1024, DecodeCost: 132},
	{Worker: policies.Worker{WorkerID: 2}, DecodeCost: 82},
}

func ctxWith(r *rand.Rand, mod func(*policies.ContextParams)) *policies.WorkerSelectionContext {
	p := policies.ContextParams{ISLTokens: 512, BlockSize: 16, TracksPrefillTokens: true, Rand: r}
	if mod != nil {
		mod(&p)
	}
	return policies.NewWorkerSelectionContext(p)
}

func costsByWorker(res policies.Result) map[uint64]float64 {
	m := map[uint64]float64{}
	for _, c := range res.Candidates {
		m[c.Worker().WorkerID] = c.Cost()
	}
	return m
}

func TestBuiltinPolicy(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	t.Run("the worked example scores 217 and 114 and picks B", func(t *testing.T) {
		p, err := defaultcost.Builtin()(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})
		if err != nil {
			t.Fatal(err)
		}
		for trial := 0; trial < 10; trial++ {
			s := worked.Shuffled(r)
			res, err := p.Select(ctxWith(r, nil), s.Workers(), s)
			if err != nil {
				t.Fatal(err)
			}
			costs := costsByWorker(res)
			if res.Worker.WorkerID != 2 || costs[1] != 217 || costs[2] != 114 || res.Cost != 114 {
				t.Fatalf("result %+v costs %v", res.Worker, costs)
			}
		}
	})
	t.Run("with credit decay A costs 222.33 and the minimum is taken over candidates", func(t *testing.T) {
		cfg := policies.DefaultRouterConfig()
		cfg.OverlapScoreCreditDecay = 1
		p, _ := defaultcost.Builtin()(cfg, "select", policies.PartitionID{})
		res, err := p.Select(ctxWith(r, nil), worked.Workers(), worked)
		if err != nil {
			t.Fatal(err)
		}
		if got := costsByWorker(res)[1]; !near(got, 222.3333333, 1e-6) {
			t.Fatalf("A cost %v", got)
		}
		if p.Stats().MinActivePrefillComputations != 1 {
			t.Fatalf("stats %+v", p.Stats())
		}
	})
	t.Run("the minimum active prefill is not computed when decay is disabled", func(t *testing.T) {
		p, _ := defaultcost.Builtin()(policies.DefaultRouterConfig(), "select", policies.PartitionID{})
		if _, err := p.Select(ctxWith(r, nil), worked.Workers(), worked); err != nil {
			t.Fatal(err)
		}
		if p.Stats().MinActivePrefillComputations != 0 {
			t.Fatalf("stats %+v", p.Stats())
		}
	})
	t.Run("the minimum active prefill is recomputed over filter survivors", func(t *testing.T) {
		cfg := policies.DefaultRouterConfig()
		cfg.OverlapScoreCreditDecay = 1
		s := policytest.Source{
			{Worker: policies.Worker{WorkerID: 1}, Prefill: 0, DecodeCost: 500}, // the global minimum, filtered out
			{Worker: policies.Worker{WorkerID: 2}, Device: 8, Host: 4, Prefill: 512, DecodeCost: 132},
			{Worker: policies.Worker{WorkerID: 3}, Prefill: 1024, DecodeCost: 82},
		}
		sc := defaultcost.NewScorer(cfg)
		p, err := policies.NewPolicyWithFilters(cfg, "select", []policies.WorkerFilter{dropWorker(1)}, []policies.WorkerScorer{sc}, defaultcost.NewPicker(0))
		if err != nil {
			t.Fatal(err)
		}
		res, err := p.Select(ctxWith(r, nil), s.Workers(), s)
		if err != nil {
			t.Fatal(err)
		}
		// Over survivors the minimum is 512, so worker 2 keeps its full credit: (512+512)/16 − 11 + 132.
		if got := costsByWorker(res)[2]; got != 64-11+132 {
			t.Fatalf("worker 2 cost %v; minimum not recomputed over survivors", got)
		}
	})
	t.Run("a preferred-taint multiplier from the routing group scales the cost", func(t *testing.T) {
		s := policytest.Source{
			{Worker: policies.Worker{WorkerID: 1}, DecodeCost: 82, Multiplier: defaultcost.PreferredTaintMultiplier(0.5), HasMultiplier: true},
			{Worker: policies.Worker{WorkerID: 2}, DecodeCost: 82},
		}
		p, _ := defaultcost.Builtin()(policies.DefaultRouterConfig(), "select", policies.PartitionID{})
		res, err := p.Select(ctxWith(r, nil), s.Workers(), s)
		if err != nil {
			t.Fatal(err)
		}
		if c := costsByWorker(res); !near(c[1], 114*0.6299, 0.01) || c[2] != 114 || res.Worker.WorkerID != 1 {
			t.Fatalf("costs %v chosen %v", c, res.Worker)
		}
	})
	t.Run("zero-temperature ties are broken randomly over many trials", func(t *testing.T) {
		s := policytest.Source{}
		for i := 1; i <= 5; i++ {
			s = append(s, policytest.Candidate{Worker: policies.Worker{WorkerID: uint64(i)}, DecodeCost: 10})
		}
		p, _ := defaultcost.Builtin()(policies.DefaultRouterConfig(), "select", policies.PartitionID{})
		seen := map[uint64]int{}
		for trial := 0; trial < 2000; trial++ {
			sh := s.Shuffled(r)
			res, err := p.Select(ctxWith(r, nil), sh.Workers(), sh)
			if err != nil {
				t.Fatal(err)
			}
			seen[res.Worker.WorkerID]++
		}
		for i := uint64(1); i <= 5; i++ {
			if seen[i] < 300 { // expected 400 each
				t.Fatalf("tie choices %v", seen)
			}
		}
	})
	t.Run("a scorer given no cache or load group fails with a policy error", func(t *testing.T) {
		c := policies.NewWorkerCandidate(policies.Worker{}, policies.InputsNone, policies.CacheInputs{}, policies.LoadInputs{}, policies.RoutingInputs{})
		_, err := defaultcost.NewScorer(defaults()).Score(ctxWith(r, nil), c)
		var pe *policies.PolicyError
		if !errors.As(err, &pe) {
			t.Fatalf("err = %v", err)
		}
	})
}

type dropWorker uint64

func (dropWorker) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }
func (d dropWorker) Keep(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
	return c.Worker().WorkerID != uint64(d), nil
}

// overrideScenario: A caches 30 of 32 blocks but carries more decode load; B caches nothing.
var overrideScenario = policytest.Source{
	{Worker: policies.Worker{WorkerID: 1}, Device: 30, DecodeCost: 32}, // 32 − 30 + 32 = 34
	{Worker: policies.Worker{WorkerID: 2}, DecodeCost: 10},             // 32 + 10 = 42
}

func TestPerRequestOverrides(t *testing.T) {
	zero := 0.0
	hot := 1e6
	cases := []struct {
		name    string
		mod     func(*policies.ContextParams)
		builtin uint64 // expected choice of the built-in policy (0 = either over trials)
	}{
		{"without overrides A wins on cache credit", nil, 1},
		{"an overlap_score_credit override of 0 removes A's credit and B wins", func(p *policies.ContextParams) { p.OverlapScoreCreditOverride = &zero }, 2},
		{"a prefill_load_scale override of 0 leaves decode load only and B wins", func(p *policies.ContextParams) { p.PrefillLoadScaleOverride = &zero }, 2},
		{"a huge router_temperature override makes both candidates likely", func(p *policies.ContextParams) { p.RouterTemperatureOverride = &hot }, 0},
	}
	builtin, _ := defaultcost.Builtin()(policies.DefaultRouterConfig(), "select", policies.PartitionID{})
	factory, err := defaultcost.Provider(policies.PolicyParameters{})
	if err != nil {
		t.Fatal(err)
	}
	configured, _ := factory(policies.DefaultRouterConfig(), "select", policies.PartitionID{})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(5, 5))
			seen := map[uint64]int{}
			for trial := 0; trial < 400; trial++ {
				res, err := builtin.Select(ctxWith(r, tc.mod), overrideScenario.Workers(), overrideScenario)
				if err != nil {
					t.Fatal(err)
				}
				seen[res.Worker.WorkerID]++
				res, err = configured.Select(ctxWith(r, tc.mod), overrideScenario.Workers(), overrideScenario)
				if err != nil {
					t.Fatal(err)
				}
				if res.Worker.WorkerID != 1 {
					t.Fatalf("a configured instance applied a per-request override (chose %v)", res.Worker)
				}
			}
			if tc.builtin != 0 && seen[tc.builtin] != 400 {
				t.Fatalf("choices %v, want always %d", seen, tc.builtin)
			}
			if tc.builtin == 0 && (seen[1] < 150 || seen[2] < 150) {
				t.Fatalf("choices %v, want both often", seen)
			}
		})
	}
}

func TestPolicyMatchesDirectFunctions(t *testing.T) {
	for _, temp := range []float64{0, 0.7} {
		t.Run(fmt.Sprintf("the built-in policy through the interfaces selects exactly like the direct functions at T=%v", temp), func(t *testing.T) {
			gen := rand.New(rand.NewPCG(9, 10))
			cfg := policies.DefaultRouterConfig()
			cfg.RouterTemperature = temp
			cfg.OverlapScoreCreditDecay = 0.5
			cfg.DecodeActiveRequestWeight = 0.25
			p, _ := defaultcost.Builtin()(cfg, "select", policies.PartitionID{})
			params := cfg
			for trial := 0; trial < 300; trial++ {
				n := 1 + gen.IntN(40)
				s := make(policytest.Source, n)
				minPrefill := math.MaxInt
				for i := range s {
					s[i] = policytest.Candidate{Worker: policies.Worker{WorkerID: uint64(i)}, Device: gen.IntN(40), Host: gen.IntN(10),
						Prefill: gen.IntN(4000), DecodeCost: gen.IntN(300), Requests: gen.IntN(20),
						Multiplier: 0.5 + gen.Float64(), HasMultiplier: gen.IntN(2) == 0}
					minPrefill = min(minPrefill, s[i].Prefill)
				}
				direct := make([]float64, n)
				for i, c := range s {
					direct[i] = defaultcost.Cost(params, defaultcost.Inputs{ISLTokens: 512, BlockSize: 16, TrackPrefillTokens: true,
						DeviceBlocks: c.Device, HostExtBlocks: c.Host, ActivePrefillTokens: c.Prefill, MinActivePrefillTokens: minPrefill,
						DecodeCostBlocks: c.DecodeCost, ActiveRequests: c.Requests, TaintMultiplier: c.Multiplier, HasTaintMultiplier: c.HasMultiplier})
				}
				seed := gen.Uint64()
				want := defaultcost.Pick(rand.New(rand.NewPCG(seed, 0)), direct, temp)
				res, err := p.Select(ctxWith(rand.New(rand.NewPCG(seed, 0)), nil), s.Workers(), s)
				if err != nil {
					t.Fatal(err)
				}
				if res.Row != want || res.Cost != direct[want] {
					t.Fatalf("trial %d: policy chose row %d (cost %v), direct row %d (cost %v)", trial, res.Row, res.Cost, want, direct[want])
				}
			}
		})
	}
}

func TestProvider(t *testing.T) {
	t.Run("omitted parameters inherit the router configuration and set ones override it", func(t *testing.T) {
		f, err := defaultcost.Provider(policytest.Params(t, `{"overlap_score_credit": 0.5, "host_cache_hit_weight": 0}`))
		if err != nil {
			t.Fatal(err)
		}
		cfg := policies.DefaultRouterConfig()
		cfg.PrefillLoadScale = 2
		p, err := f(cfg, "select", policies.PartitionID{})
		if err != nil {
			t.Fatal(err)
		}
		if p.Config() != cfg || p.RequiredInputs() != policies.InputsAll {
			t.Fatalf("config %+v inputs %v", p.Config(), p.RequiredInputs())
		}
		// A under credit 0.5, host weight 0, scale 2: 2 × max(0, 96 − 4) + 132 = 316.
		res, err := p.Select(ctxWith(rand.New(rand.NewPCG(1, 1)), nil), worked.Workers(), worked)
		if err != nil {
			t.Fatal(err)
		}
		if got := costsByWorker(res)[1]; got != 316 {
			t.Fatalf("A cost %v", got)
		}
	})
	for _, tc := range []struct {
		name, raw, want string
	}{
		{"an unknown parameter is rejected by name", `{"overlap_score_credit": 1, "overlap_credit": 2}`, `unknown field "overlap_credit"`},
		{"a negative parameter is rejected by name", `{"router_temperature": -1}`, "router_temperature must be a finite number ≥ 0"},
		{"a non-numeric parameter is rejected by name", `{"prefill_load_scale": "high"}`, "prefill_load_scale"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			policytest.WantRejected(t, defaultcost.Provider, defaultcost.TypeName, tc.raw, tc.want)
		})
	}
	t.Run("every documented parameter is accepted", func(t *testing.T) {
		_, err := defaultcost.Provider(policytest.Params(t, `{"overlap_score_credit":1,"prefill_load_scale":1,"router_temperature":0.5,
			"overlap_score_credit_decay":1,"decode_active_request_weight":0.1,"host_cache_hit_weight":0.7,
			"disk_cache_hit_weight":0.2,"shared_cache_multiplier":0.5}`))
		if err != nil {
			t.Fatal(err)
		}
	})
	t.Run("an invalid inherited router configuration fails the factory by name", func(t *testing.T) {
		f, _ := defaultcost.Provider(policies.PolicyParameters{})
		cfg := policies.DefaultRouterConfig()
		cfg.RouterTemperature = -1
		if _, err := f(cfg, "select", policies.PartitionID{}); err == nil || !strings.Contains(err.Error(), "router_temperature") {
			t.Fatalf("err = %v", err)
		}
	})
}

// BenchmarkBuiltinSelect runs the built-in policy over N candidates.
func BenchmarkBuiltinSelect(b *testing.B) {
	for _, decay := range []float64{0, 1} {
		for _, n := range []int{2, 32, 1024, 10000} {
			b.Run(fmt.Sprintf("decay=%g/N=%d", decay, n), func(b *testing.B) {
				gen := rand.New(rand.NewPCG(1, 2))
				s := make(policytest.Source, n)
				for i := range s {
					s[i] = policytest.Candidate{Worker: policies.Worker{WorkerID: uint64(i)}, Device: gen.IntN(32), Prefill: gen.IntN(4096), DecodeCost: gen.IntN(300)}
				}
				cfg := policies.DefaultRouterConfig()
				cfg.OverlapScoreCreditDecay = decay
				p, _ := defaultcost.Builtin()(cfg, "select", policies.PartitionID{})
				ctx := ctxWith(rand.New(rand.NewPCG(1, 1)), nil)
				policytest.BenchSelect(b, p, ctx, s)
			})
		}
	}
}
