package policies_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
)

// --- test components --------------------------------------------------------------------------

// fixture is an InputSource over explicit per-candidate values that counts what it computes.
type fixture struct {
	workers                   []policies.Worker
	device, prefill, requests []int
	mult                      []float64
	cacheCalls, loadCalls     []int
	routingCalls              []int
}

func newFixture(n int) *fixture {
	f := &fixture{
		device: make([]int, n), prefill: make([]int, n), requests: make([]int, n), mult: make([]float64, n),
		cacheCalls: make([]int, n), loadCalls: make([]int, n), routingCalls: make([]int, n),
	}
	for i := 0; i < n; i++ {
		f.workers = append(f.workers, policies.Worker{WorkerID: uint64(i + 1), DPRank: uint32(i % 2)})
		f.mult[i] = 1
	}
	return f
}

func (f *fixture) Cache(i int) policies.CacheInputs {
	f.cacheCalls[i]++
	return policies.NewCacheInputs(f.device[i], 1, 2, 0)
}

func (f *fixture) Load(i int) policies.LoadInputs {
	f.loadCalls[i]++
	return policies.NewLoadInputs(f.prefill[i], 10*i, f.requests[i])
}

func (f *fixture) Routing(i int) policies.RoutingInputs {
	f.routingCalls[i]++
	return policies.NewRoutingInputs(f.mult[i], true)
}

func sum(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}

// shuffled returns the fixture's workers in a random order together with a source that maps the
// shuffled index back to the fixture's values.
type permSource struct {
	f    *fixture
	perm []int
}

func (s permSource) Cache(i int) policies.CacheInputs     { return s.f.Cache(s.perm[i]) }
func (s permSource) Load(i int) policies.LoadInputs       { return s.f.Load(s.perm[i]) }
func (s permSource) Routing(i int) policies.RoutingInputs { return s.f.Routing(s.perm[i]) }

func shuffled(f *fixture, rng *rand.Rand) ([]policies.Worker, permSource) {
	perm := rng.Perm(len(f.workers))
	ws := make([]policies.Worker, len(perm))
	for i, p := range perm {
		ws[i] = f.workers[p]
	}
	return ws, permSource{f: f, perm: perm}
}

// lowestCost picks the lowest cost (first on ties).
var lowestCost = policytest.Picker{Fn: func(_ *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
	best := -1
	for i, c := range v.Candidates() {
		if best < 0 || c.Cost() < v.Candidates()[best].Cost() {
			best = i
		}
	}
	return best, nil
}}

func byID(id uint64) func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (float64, error) {
	return func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
		return float64(c.Worker().WorkerID), nil
	}
}

func mustPolicy(t testing.TB, filters []policies.WorkerFilter, scorers []policies.WorkerScorer, picker policies.WorkerPicker) *policies.WorkerSelectionPolicy {
	t.Helper()
	p, err := policies.NewPolicyWithFilters(policies.DefaultRouterConfig(), "select", filters, scorers, picker)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func newCtx() *policies.WorkerSelectionContext {
	return policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 100, BlockSize: 16, TracksPrefillTokens: true,
		Rand: rand.New(rand.NewPCG(1, 2))})
}

// --- host rules -------------------------------------------------------------------------------

func TestFiltersRunInOrderOverSurvivors(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for trial := 0; trial < 20; trial++ {
		f := newFixture(10)
		ws, src := shuffled(f, rng)
		var log []string
		evenOnly := policytest.Filter{Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
			log = append(log, fmt.Sprintf("f0:%d", c.Worker().WorkerID))
			return c.Worker().WorkerID%2 == 0, nil
		}}
		aboveFour := policytest.Filter{Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
			if c.Worker().WorkerID%2 != 0 {
				t.Fatalf("filter 1 saw worker %d rejected by filter 0", c.Worker().WorkerID)
			}
			log = append(log, fmt.Sprintf("f1:%d", c.Worker().WorkerID))
			return c.Worker().WorkerID > 4, nil
		}}
		p := mustPolicy(t, []policies.WorkerFilter{evenOnly, aboveFour},
			[]policies.WorkerScorer{policytest.Scorer{Fn: byID(0)}}, lowestCost)
		res, err := p.Select(newCtx(), ws, src)
		if err != nil {
			t.Fatal(err)
		}
		t.Run(fmt.Sprintf("trial %d: every filter-0 call precedes every filter-1 call and survivors of both are scored", trial), func(t *testing.T) {
			seen1 := false
			for _, e := range log {
				if strings.HasPrefix(e, "f1") {
					seen1 = true
				} else if seen1 {
					t.Fatalf("filter 0 ran after filter 1: %v", log)
				}
			}
			if len(log) != 10+5 {
				t.Fatalf("filter calls %v", log)
			}
			if res.Worker.WorkerID != 6 || ws[res.Row] != res.Worker || len(res.Candidates) != 3 {
				t.Fatalf("result %+v", res)
			}
		})
	}
}

func TestAllFiltered(t *testing.T) {
	t.Run("filters that reject everyone fail with the filtered error and compute no scorer inputs", func(t *testing.T) {
		f := newFixture(5)
		rejectAll := policytest.Filter{In: policies.InputsCache, Fn: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (bool, error) {
			return false, nil
		}}
		scorer := policytest.Scorer{In: policies.InputsLoad | policies.InputsRouting, Fn: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (float64, error) {
			t.Fatal("scorer called")
			return 0, nil
		}}
		p := mustPolicy(t, []policies.WorkerFilter{rejectAll}, []policies.WorkerScorer{scorer},
			policytest.Picker{In: policies.InputsLoad, Fn: lowestCost.Fn})
		_, err := p.Select(newCtx(), f.workers, f)
		if !errors.Is(err, policies.ErrAllFiltered) || err.Error() != "all eligible workers were rejected by policy filters" {
			t.Fatalf("err = %v", err)
		}
		if sum(f.loadCalls) != 0 || sum(f.routingCalls) != 0 || sum(f.cacheCalls) != 5 {
			t.Fatalf("computed cache %d load %d routing %d", sum(f.cacheCalls), sum(f.loadCalls), sum(f.routingCalls))
		}
	})
	t.Run("groups a later filter needs are not computed for candidates an earlier filter rejected", func(t *testing.T) {
		f := newFixture(6)
		first := policytest.Filter{Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
			return c.Worker().WorkerID <= 2, nil
		}}
		second := policytest.Filter{In: policies.InputsLoad, Fn: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (bool, error) {
			return true, nil
		}}
		p := mustPolicy(t, []policies.WorkerFilter{first, second}, nil, lowestCost)
		if _, err := p.Select(newCtx(), f.workers, f); err != nil {
			t.Fatal(err)
		}
		if sum(f.loadCalls) != 2 || f.loadCalls[0] != 1 || f.loadCalls[1] != 1 {
			t.Fatalf("load computed %v", f.loadCalls)
		}
	})
	t.Run("no candidates at all is its own error", func(t *testing.T) {
		p := mustPolicy(t, nil, nil, lowestCost)
		if _, err := p.Select(newCtx(), nil, newFixture(0)); !errors.Is(err, policies.ErrNoCandidates) {
			t.Fatalf("err = %v", err)
		}
	})
}

func TestComponentsSeeOnlyDeclaredGroups(t *testing.T) {
	type seen struct{ cache, load, routing bool }
	record := func(c *policies.WorkerCandidate) seen {
		return seen{c.Cache() != nil, c.Load() != nil, c.Routing() != nil}
	}
	var filterSaw, scorer0Saw, scorer1Saw seen
	var pickerSaw seen
	f := newFixture(4)
	f.device = []int{5, 6, 7, 8}
	p := mustPolicy(t,
		[]policies.WorkerFilter{policytest.Filter{In: policies.InputsCache, Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
			filterSaw = record(c)
			return true, nil
		}}},
		[]policies.WorkerScorer{
			policytest.Scorer{In: policies.InputsLoad, Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
				scorer0Saw = record(c)
				return 0, nil
			}},
			policytest.Scorer{In: policies.InputsNone, Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
				scorer1Saw = record(c)
				return 0, nil
			}},
		},
		policytest.Picker{In: policies.InputsRouting | policies.InputsCache, Fn: func(_ *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
			pickerSaw = seen{v.Cache(0) != nil, v.Load(0) != nil, v.Routing(0) != nil}
			for row, c := range v.Candidates() {
				if got, want := v.Cache(row).DeviceOverlapBlocks(), f.device[c.Worker().WorkerID-1]; got != want {
					t.Errorf("picker row %d: device %d, want %d (columns must be index-aligned)", row, got, want)
				}
			}
			if v.Cache(-1) != nil || v.Cache(v.Len()) != nil {
				t.Error("out-of-range rows must read as nil")
			}
			return 0, nil
		}})
	rng := rand.New(rand.NewPCG(5, 6))
	ws, src := shuffled(f, rng)
	if _, err := p.Select(newCtx(), ws, src); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name      string
		got, want seen
	}{
		{"a CACHE filter sees only the cache group", filterSaw, seen{cache: true}},
		{"a LOAD scorer sees only the load group", scorer0Saw, seen{load: true}},
		{"a scorer declaring NONE sees no group although others were computed", scorer1Saw, seen{}},
		{"a CACHE|ROUTING picker sees only those columns", pickerSaw, seen{cache: true, routing: true}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.got != tc.want {
				t.Fatalf("saw %+v, want %+v", tc.got, tc.want)
			}
		})
	}
	t.Run("each group is computed at most once per candidate", func(t *testing.T) {
		for i := range f.workers {
			if f.cacheCalls[i] != 1 || f.loadCalls[i] != 1 || f.routingCalls[i] != 1 {
				t.Fatalf("candidate %d: cache %d load %d routing %d", i, f.cacheCalls[i], f.loadCalls[i], f.routingCalls[i])
			}
		}
	})
}

func TestMutatedInputsDoNotLeak(t *testing.T) {
	t.Run("a component overwriting its group copy does not change what the next component sees", func(t *testing.T) {
		f := newFixture(3)
		f.device = []int{4, 4, 4}
		vandal := policytest.Scorer{In: policies.InputsCache, Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
			*c.Cache() = policies.NewCacheInputs(999, 0, 0, 0)
			return 0, nil
		}}
		reader := policytest.Scorer{In: policies.InputsCache, Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
			if d := c.Cache().DeviceOverlapBlocks(); d != 4 {
				t.Fatalf("second scorer saw device %d", d)
			}
			return 0, nil
		}}
		p := mustPolicy(t, nil, []policies.WorkerScorer{vandal, reader}, lowestCost)
		if _, err := p.Select(newCtx(), f.workers, f); err != nil {
			t.Fatal(err)
		}
	})
}

func TestScoring(t *testing.T) {
	t.Run("scorer costs are summed per candidate in declaration order", func(t *testing.T) {
		f := newFixture(4)
		var order []int
		mk := func(idx int, weight float64) policies.WorkerScorer {
			return policytest.Scorer{Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
				order = append(order, idx)
				return weight * float64(c.Worker().WorkerID), nil
			}}
		}
		var costs map[uint64]float64
		picker := policytest.Picker{Fn: func(_ *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
			costs = map[uint64]float64{}
			for _, c := range v.Candidates() {
				costs[c.Worker().WorkerID] = c.Cost()
			}
			return 0, nil
		}}
		p := mustPolicy(t, nil, []policies.WorkerScorer{mk(0, 1), mk(1, 10), mk(2, 100)}, picker)
		ws, src := shuffled(f, rand.New(rand.NewPCG(1, 1)))
		res, err := p.Select(newCtx(), ws, src)
		if err != nil {
			t.Fatal(err)
		}
		for id, c := range costs {
			if c != 111*float64(id) {
				t.Fatalf("worker %d cost %v, want %v", id, c, 111*float64(id))
			}
		}
		for i := 0; i < len(order); i += 3 {
			if order[i] != 0 || order[i+1] != 1 || order[i+2] != 2 {
				t.Fatalf("scorer call order %v", order)
			}
		}
		if res.Cost != 111*float64(ws[res.Row].WorkerID) {
			t.Fatalf("result cost %v for %v", res.Cost, ws[res.Row])
		}
	})
	t.Run("no scorers give every candidate cost zero", func(t *testing.T) {
		f := newFixture(3)
		p := mustPolicy(t, nil, nil, policytest.Picker{Fn: func(_ *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
			for _, c := range v.Candidates() {
				if c.Cost() != 0 {
					t.Fatalf("cost %v", c.Cost())
				}
			}
			return 2, nil
		}})
		res, err := p.Select(newCtx(), f.workers, f)
		if err != nil || res.Row != 2 {
			t.Fatalf("res %+v err %v", res, err)
		}
	})
	nonFinite := []struct {
		name        string
		contrib     [2]float64
		wantScorer  int
		wantNonFin  bool
		targetWorke uint64
	}{
		{"a NaN contribution names the scorer and row", [2]float64{0, math.NaN()}, 1, true, 3},
		{"a +Inf contribution names the scorer and row", [2]float64{math.Inf(1), 0}, 0, true, 3},
		{"a -Inf contribution is rejected too", [2]float64{math.Inf(-1), 0}, 0, true, 3},
		{"finite contributions whose running total overflows are rejected at the overflowing scorer", [2]float64{math.MaxFloat64, math.MaxFloat64}, 1, true, 3},
	}
	for _, tc := range nonFinite {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(5)
			mk := func(k int) policies.WorkerScorer {
				return policytest.Scorer{Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
					if c.Worker().WorkerID == tc.targetWorke {
						return tc.contrib[k], nil
					}
					return 1, nil
				}}
			}
			picked := false
			p := mustPolicy(t, nil, []policies.WorkerScorer{mk(0), mk(1)}, policytest.Picker{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) {
				picked = true
				return 0, nil
			}})
			ws, src := shuffled(f, rand.New(rand.NewPCG(9, 9)))
			_, err := p.Select(newCtx(), ws, src)
			var nf *policies.NonFiniteCostError
			if !errors.As(err, &nf) {
				t.Fatalf("err = %v", err)
			}
			if nf.ScorerIndex != tc.wantScorer || ws[nf.Row].WorkerID != tc.targetWorke || nf.Worker.WorkerID != tc.targetWorke {
				t.Fatalf("error %+v; row %d is %v", nf, nf.Row, ws[nf.Row])
			}
			if picked {
				t.Fatal("picker ran after a non-finite cost")
			}
		})
	}
}

func TestPickerRowValidation(t *testing.T) {
	for _, row := range []int{-1, 3, 100} {
		t.Run(fmt.Sprintf("picker row %d out of three candidates is an invalid-row error", row), func(t *testing.T) {
			f := newFixture(3)
			p := mustPolicy(t, nil, nil, policytest.Picker{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) {
				return row, nil
			}})
			_, err := p.Select(newCtx(), f.workers, f)
			var ir *policies.InvalidPickerRowError
			if !errors.As(err, &ir) || ir.Row != row || ir.CandidateCount != 3 {
				t.Fatalf("err = %v", err)
			}
		})
	}
	t.Run("the picker row indexes survivors and the result maps it back to the caller's slice", func(t *testing.T) {
		rng := rand.New(rand.NewPCG(11, 12))
		for trial := 0; trial < 50; trial++ {
			f := newFixture(8)
			ws, src := shuffled(f, rng)
			dropOdd := policytest.Filter{Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
				return c.Worker().WorkerID%2 == 0, nil
			}}
			p := mustPolicy(t, []policies.WorkerFilter{dropOdd}, []policies.WorkerScorer{policytest.Scorer{Fn: byID(0)}}, lowestCost)
			res, err := p.Select(newCtx(), ws, src)
			if err != nil {
				t.Fatal(err)
			}
			if res.Worker.WorkerID != 2 || ws[res.Row].WorkerID != 2 || res.Candidates[res.PickerRow].Worker().WorkerID != 2 {
				t.Fatalf("trial %d: %+v", trial, res)
			}
		}
	})
}

func TestComponentErrors(t *testing.T) {
	sentinel := errors.New("backend said no")
	cases := []struct {
		name    string
		filter  error
		scorer  error
		picker  error
		msg     string
		stage   policies.Stage
		isCause error
	}{
		{name: "a Failed error from a filter keeps its message", filter: policies.Failed("cache input unavailable"), msg: "cache input unavailable", stage: policies.StageFilter},
		{name: "a plain error from a scorer becomes a policy error wrapping it", scorer: sentinel, msg: "backend said no", stage: policies.StageScorer, isCause: sentinel},
		{name: "a Failed error from the picker keeps its message", picker: policies.Failed("no eligible worker"), msg: "no eligible worker", stage: policies.StagePicker},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(3)
			p := mustPolicy(t,
				[]policies.WorkerFilter{policytest.Filter{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (bool, error) {
					return true, tc.filter
				}}},
				[]policies.WorkerScorer{policytest.Scorer{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (float64, error) {
					return 1, tc.scorer
				}}},
				policytest.Picker{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) { return 0, tc.picker }})
			_, err := p.Select(newCtx(), f.workers, f)
			var pe *policies.PolicyError
			if !errors.As(err, &pe) || err.Error() != tc.msg || pe.Stage != tc.stage {
				t.Fatalf("err = %#v", err)
			}
			if tc.isCause != nil && !errors.Is(err, tc.isCause) {
				t.Fatal("the original error is not reachable through errors.Is")
			}
		})
	}
}

func TestPanicsAreRecovered(t *testing.T) {
	boom := func() { panic("boom") }
	cases := []struct {
		name  string
		where policies.Stage
	}{
		{"a panicking filter becomes a policy error", policies.StageFilter},
		{"a panicking scorer becomes a policy error", policies.StageScorer},
		{"a panicking picker becomes a policy error", policies.StagePicker},
		{"a panicking input source is reported as the inputs stage", policies.StageInputs},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(3)
			var src policies.InputSource = f
			if tc.where == policies.StageInputs {
				src = panicSource{}
			}
			p := mustPolicy(t,
				[]policies.WorkerFilter{policytest.Filter{In: policies.InputsCache, Fn: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (bool, error) {
					if tc.where == policies.StageFilter {
						boom()
					}
					return true, nil
				}}},
				[]policies.WorkerScorer{policytest.Scorer{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (float64, error) {
					if tc.where == policies.StageScorer {
						boom()
					}
					return 1, nil
				}}},
				policytest.Picker{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) {
					if tc.where == policies.StagePicker {
						boom()
					}
					return 0, nil
				}})
			ctx := newCtx()
			_, err := p.Select(ctx, f.workers, src)
			var pe *policies.PolicyError
			if !errors.As(err, &pe) || pe.Panic != "boom" || pe.Stage != tc.where || !strings.Contains(err.Error(), "panicked: boom") {
				t.Fatalf("err = %#v", err)
			}
			if ctx.MinActivePrefillTokens() != 0 {
				t.Fatal("context still bound to the policy after Select returned")
			}
			if tc.where != policies.StageInputs {
				// The instance stays usable after a recovered panic.
				if _, err := p.Select(newCtx(), f.workers, f); err == nil || !strings.Contains(err.Error(), "panicked") {
					t.Fatalf("second Select: %v", err)
				}
			}
		})
	}
}

type panicSource struct{}

func (panicSource) Cache(int) policies.CacheInputs     { panic("boom") }
func (panicSource) Load(int) policies.LoadInputs       { panic("boom") }
func (panicSource) Routing(int) policies.RoutingInputs { panic("boom") }

func TestReentrantSelectIsRefused(t *testing.T) {
	t.Run("a component calling Select on its own policy gets a policy error", func(t *testing.T) {
		f := newFixture(2)
		var p *policies.WorkerSelectionPolicy
		var inner error
		p = mustPolicy(t, nil, []policies.WorkerScorer{policytest.Scorer{Fn: func(ctx *policies.WorkerSelectionContext, _ *policies.WorkerCandidate) (float64, error) {
			_, inner = p.Select(newCtx(), f.workers, f)
			return 0, nil
		}}}, lowestCost)
		if _, err := p.Select(newCtx(), f.workers, f); err != nil {
			t.Fatal(err)
		}
		var pe *policies.PolicyError
		if !errors.As(inner, &pe) || !strings.Contains(inner.Error(), "concurrently") {
			t.Fatalf("inner Select: %v", inner)
		}
	})
}

func TestMinActivePrefillTokens(t *testing.T) {
	t.Run("scorers see the minimum over filter survivors, computed once per selection", func(t *testing.T) {
		f := newFixture(4)
		f.prefill = []int{5, 50, 70, 90} // worker 1 has the minimum but is filtered out
		dropFirst := policytest.Filter{Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
			return c.Worker().WorkerID != 1, nil
		}}
		var seen []int
		scorer := policytest.Scorer{In: policies.InputsLoad, Fn: func(ctx *policies.WorkerSelectionContext, _ *policies.WorkerCandidate) (float64, error) {
			seen = append(seen, ctx.MinActivePrefillTokens())
			return 0, nil
		}}
		var pickerSaw int
		picker := policytest.Picker{Fn: func(ctx *policies.WorkerSelectionContext, _ *policies.WorkerInputView) (int, error) {
			pickerSaw = ctx.MinActivePrefillTokens()
			return 0, nil
		}}
		p := mustPolicy(t, []policies.WorkerFilter{dropFirst}, []policies.WorkerScorer{scorer}, picker)
		ws, src := shuffled(f, rand.New(rand.NewPCG(2, 3)))
		if _, err := p.Select(newCtx(), ws, src); err != nil {
			t.Fatal(err)
		}
		for _, v := range append(seen, pickerSaw) {
			if v != 50 {
				t.Fatalf("min active prefill %v, want 50 everywhere", seen)
			}
		}
		if st := p.Stats(); st.MinActivePrefillComputations != 1 || st.LoadComputed != 3 {
			t.Fatalf("stats %+v", st)
		}
		if f.loadCalls[0] != 0 {
			t.Fatal("load computed for the filtered-out candidate")
		}
	})
	t.Run("it is not computed when no component asks for it", func(t *testing.T) {
		f := newFixture(4)
		p := mustPolicy(t, nil, []policies.WorkerScorer{policytest.Scorer{Fn: byID(0)}}, lowestCost)
		if _, err := p.Select(newCtx(), f.workers, f); err != nil {
			t.Fatal(err)
		}
		if st := p.Stats(); st.MinActivePrefillComputations != 0 || st.LoadComputed != 0 {
			t.Fatalf("stats %+v", st)
		}
	})
	t.Run("from a filter it is the minimum over candidates alive before that filter", func(t *testing.T) {
		f := newFixture(3)
		f.prefill = []int{1, 20, 30}
		dropFirst := policytest.Filter{Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
			return c.Worker().WorkerID != 1, nil
		}}
		var seen []int
		second := policytest.Filter{Fn: func(ctx *policies.WorkerSelectionContext, _ *policies.WorkerCandidate) (bool, error) {
			seen = append(seen, ctx.MinActivePrefillTokens())
			return true, nil
		}}
		p := mustPolicy(t, []policies.WorkerFilter{dropFirst, second}, nil, lowestCost)
		if _, err := p.Select(newCtx(), f.workers, f); err != nil {
			t.Fatal(err)
		}
		if len(seen) != 2 || seen[0] != 20 || seen[1] != 20 {
			t.Fatalf("seen %v", seen)
		}
	})
	t.Run("outside Select it is zero", func(t *testing.T) {
		if v := newCtx().MinActivePrefillTokens(); v != 0 {
			t.Fatalf("got %d", v)
		}
	})
}

func TestNewPolicyValidation(t *testing.T) {
	var nilPicker *pickerPtr
	cases := []struct {
		name    string
		filters []policies.WorkerFilter
		scorers []policies.WorkerScorer
		picker  policies.WorkerPicker
		want    string
	}{
		{"a nil picker is rejected", nil, nil, nil, "picker must not be nil"},
		{"a typed nil picker is rejected", nil, nil, nilPicker, "picker must not be nil"},
		{"a nil scorer is rejected by index", nil, []policies.WorkerScorer{policytest.Scorer{Fn: byID(0)}, nil}, lowestCost, "scorer 1 is nil"},
		{"a nil filter is rejected by index", []policies.WorkerFilter{nil}, nil, lowestCost, "filter 0 is nil"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := policies.NewPolicyWithFilters(policies.DefaultRouterConfig(), "select", tc.filters, tc.scorers, tc.picker)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v", err)
			}
		})
	}
	t.Run("the policy records its config, worker type and the union of declared inputs", func(t *testing.T) {
		cfg := policies.DefaultRouterConfig()
		cfg.RouterTemperature = 0.5
		p, err := policies.NewPolicy(cfg, "select", []policies.WorkerScorer{policytest.Scorer{In: policies.InputsLoad, Fn: byID(0)}},
			policytest.Picker{In: policies.InputsCache, Fn: lowestCost.Fn})
		if err != nil {
			t.Fatal(err)
		}
		if p.Config() != cfg || p.WorkerType() != "select" || p.RequiredInputs() != policies.InputsCache|policies.InputsLoad {
			t.Fatalf("%+v %q %v", p.Config(), p.WorkerType(), p.RequiredInputs())
		}
	})
}

type pickerPtr struct{}

func (*pickerPtr) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }
func (*pickerPtr) Pick(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) {
	return 0, nil
}

func TestSelectDoesNotAllocatePerCandidate(t *testing.T) {
	for _, n := range []int{32, 1024} {
		t.Run(fmt.Sprintf("a warmed-up stacked policy over %d candidates allocates nothing", n), func(t *testing.T) {
			p, ctx, ws, src := stackedPolicy(t, n)
			allocs := testing.AllocsPerRun(20, func() {
				if _, err := p.Select(ctx, ws, src); err != nil {
					t.Fatal(err)
				}
			})
			if allocs != 0 {
				t.Fatalf("%v allocations per Select", allocs)
			}
		})
	}
}
