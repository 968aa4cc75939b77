package twotiercacheaware_test

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog/catalogtest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
	"github.com/kvepp/kvepp/policies/twotiercacheaware"
)

// row is one candidate: its id, device overlap (blocks), active requests and active prefill
// tokens.
func row(id uint64, device, requests, prefill int) policytest.Candidate {
	return policytest.Candidate{Worker: policytest.W(id, 0), Device: device, Requests: requests, Prefill: prefill}
}

func newPolicy(t *testing.T, raw string) *policies.WorkerSelectionPolicy {
	t.Helper()
	return policytest.NewPolicy(t, twotiercacheaware.Provider, raw)
}

// pick shuffles rows and runs Select for a request of isl tokens (block size 16).
func pick(t *testing.T, p *policies.WorkerSelectionPolicy, rows policytest.Source, isl int, rng *rand.Rand) uint64 {
	t.Helper()
	res, err := policytest.Select(p, policies.ContextParams{ISLTokens: isl, BlockSize: 16}, rng, rows)
	if err != nil {
		t.Fatal(err)
	}
	return res.Worker.WorkerID
}

func TestTwoTierCacheAwareDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		name string
		raw  string
		rows policytest.Source
		isl  int // 160 tokens = 10 blocks
		want uint64
	}{
		{"while balanced the largest overlap above the cache threshold wins even when busier", `{}`,
			policytest.Source{row(1, 8, 5, 0), row(2, 2, 0, 0)}, 160, 1},
		{"while balanced an overlap ratio equal to the threshold is not enough and the shortest queue wins", `{}`,
			policytest.Source{row(1, 5, 3, 0), row(2, 0, 1, 0)}, 160, 2},
		{"while balanced equal best overlaps go to the fewer active requests", `{}`,
			policytest.Source{row(1, 8, 4, 0), row(2, 8, 2, 0), row(3, 0, 0, 0)}, 160, 2},
		{"while balanced equal overlaps and requests go to the fewer active prefill tokens", `{}`,
			policytest.Source{row(1, 8, 2, 900), row(2, 8, 2, 100)}, 160, 2},
		{"once max−min exceeds the absolute threshold and the relative one, the shortest queue wins over a full overlap", `{}`,
			policytest.Source{row(1, 10, 40, 0), row(2, 0, 0, 0), row(3, 0, 1, 0)}, 160, 2},
		{"a spread exactly at the absolute threshold is still balanced", `{}`,
			policytest.Source{row(1, 10, 32, 0), row(2, 0, 0, 0)}, 160, 1},
		{"a spread above the absolute threshold is balanced while max ≤ rel × min", `{"balance_abs_threshold": 10, "balance_rel_threshold": 3}`,
			policytest.Source{row(1, 10, 40, 0), row(2, 0, 20, 0)}, 160, 1},
		{"a spread above both thresholds is imbalanced with custom thresholds", `{"balance_abs_threshold": 10, "balance_rel_threshold": 1.5}`,
			policytest.Source{row(1, 10, 40, 0), row(2, 0, 20, 0)}, 160, 2},
		{"while imbalanced equal queues go to the fewer active prefill tokens", `{}`,
			policytest.Source{row(1, 10, 0, 500), row(2, 0, 0, 100), row(3, 10, 50, 0)}, 160, 2},
		{"a lower cache threshold lets a smaller overlap win", `{"cache_threshold": 0.2}`,
			policytest.Source{row(1, 3, 6, 0), row(2, 0, 0, 0)}, 160, 1},
		{"with a zero cache threshold no overlap at all falls back to the shortest queue", `{"cache_threshold": 0}`,
			policytest.Source{row(1, 0, 6, 0), row(2, 0, 1, 0)}, 160, 2},
		{"a request without a full block has no overlap ratio and goes to the shortest queue", `{}`,
			policytest.Source{row(1, 4, 6, 0), row(2, 0, 1, 0)}, 0, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPolicy(t, tc.raw)
			for i := 0; i < 20; i++ {
				if got := pick(t, p, tc.rows, tc.isl, rng); got != tc.want {
					t.Fatalf("got worker %d, want %d", got, tc.want)
				}
			}
		})
	}
	t.Run("exact ties are broken at random among the tied workers", func(t *testing.T) {
		p := newPolicy(t, `{}`)
		counts := map[uint64]int{}
		for i := 0; i < 1000; i++ {
			counts[pick(t, p, policytest.Source{row(1, 9, 1, 0), row(2, 9, 1, 0), row(3, 9, 2, 0)}, 160, rng)]++
		}
		if counts[3] != 0 || counts[1] < 400 || counts[2] < 400 {
			t.Fatalf("counts %v", counts)
		}
	})
}

func TestTwoTierImbalanceRule(t *testing.T) {
	th := twotiercacheaware.Thresholds{BalanceAbsThreshold: 32, BalanceRelThreshold: 1.0001}
	for _, tc := range []struct {
		name     string
		min, max int
		want     bool
	}{
		{"a spread of 33 from an idle worker is imbalanced", 0, 33, true},
		{"a spread of 32 is balanced", 0, 32, false},
		{"a large spread on busy workers is imbalanced when max exceeds rel × min", 100, 200, true},
		{"equal loads are balanced", 50, 50, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := th.Imbalanced(tc.min, tc.max); got != tc.want {
				t.Fatalf("Imbalanced(%d, %d) = %v", tc.min, tc.max, got)
			}
		})
	}
}

func TestTwoTierRequestsOnlyCacheAndLoad(t *testing.T) {
	p := newPolicy(t, `{}`)
	if got := p.RequiredInputs(); got != policies.InputsCache|policies.InputsLoad {
		t.Fatalf("RequiredInputs = %v", got)
	}
	pick(t, p, policytest.Source{row(1, 1, 1, 0), row(2, 2, 2, 0)}, 160, rand.New(rand.NewPCG(1, 1)))
	if st := p.Stats(); st.RoutingComputed != 0 || st.CacheComputed != 2 || st.LoadComputed != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestTwoTierProviderValidation(t *testing.T) {
	for _, tc := range []struct {
		name, raw, want string
	}{
		{"an unknown parameter is rejected by name", `{"eviction_interval": 60}`, `unknown field "eviction_interval"`},
		{"a cache threshold above 1 is rejected by name", `{"cache_threshold": 1.5}`, "cache_threshold must be a number in [0, 1]"},
		{"a negative cache threshold is rejected by name", `{"cache_threshold": -0.1}`, "cache_threshold must be a number in [0, 1]"},
		{"a negative absolute threshold is rejected by name", `{"balance_abs_threshold": -1}`, "balance_abs_threshold must be an integer ≥ 0"},
		{"a fractional absolute threshold is rejected by name", `{"balance_abs_threshold": 2.5}`, "balance_abs_threshold"},
		{"a negative relative threshold is rejected by name", `{"balance_rel_threshold": -1}`, "balance_rel_threshold must be a finite number ≥ 0"},
		{"a relative threshold overflowing to infinity is rejected by name", `{"balance_rel_threshold": 1e400}`, "balance_rel_threshold"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			policytest.WantRejected(t, twotiercacheaware.Provider, twotiercacheaware.TypeName, tc.raw, tc.want)
		})
	}
	t.Run("NaN thresholds given in Go are rejected by name", func(t *testing.T) {
		nan := math.NaN()
		for _, p := range []twotiercacheaware.Parameters{{CacheThreshold: &nan}, {BalanceRelThreshold: &nan}} {
			if _, err := p.Thresholds(); err == nil || !strings.Contains(err.Error(), "threshold") {
				t.Fatalf("err = %v", err)
			}
		}
	})
	t.Run("omitted parameters take the SGLang defaults", func(t *testing.T) {
		th, err := twotiercacheaware.Parameters{}.Thresholds()
		if err != nil || th != (twotiercacheaware.Thresholds{CacheThreshold: 0.5, BalanceAbsThreshold: 32, BalanceRelThreshold: 1.0001}) {
			t.Fatalf("%+v, %v", th, err)
		}
	})
}

func TestTheREADMEExampleSelectsThePolicy(t *testing.T) {
	policytest.Partition(t, catalogtest.ResolveREADME(t, twotiercacheaware.TypeName, twotiercacheaware.Provider).Factory, "default")
}
