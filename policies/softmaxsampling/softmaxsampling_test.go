package softmaxsampling_test

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog/catalogtest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/leastbusy"
	"github.com/kvepp/kvepp/policies/policytest"
	"github.com/kvepp/kvepp/policies/softmaxsampling"
)

// row is one candidate: without prefill tracking the built-in cost is its decode cost (blocks).
func row(id uint64, decodeCost, requests int) policytest.Candidate {
	return policytest.Candidate{Worker: policytest.W(id, 0), DecodeCost: decodeCost, Requests: requests}
}

func newPolicy(t *testing.T, raw string) *policies.WorkerSelectionPolicy {
	t.Helper()
	return policytest.NewPolicy(t, softmaxsampling.Provider, raw)
}

// frequencies runs n selections over shuffled rows (override: the per-request temperature, nil
// for none) and returns each worker's share.
func frequencies(t *testing.T, p *policies.WorkerSelectionPolicy, rows policytest.Source, override *float64, n int) map[uint64]float64 {
	t.Helper()
	rng := rand.New(rand.NewPCG(11, 12))
	counts := map[uint64]float64{}
	for i := 0; i < n; i++ {
		res, err := policytest.Select(p, policies.ContextParams{ISLTokens: 64, BlockSize: 16, RouterTemperatureOverride: override}, rng, rows)
		if err != nil {
			t.Fatal(err)
		}
		counts[res.Worker.WorkerID]++
	}
	for id := range counts {
		counts[id] /= float64(n)
	}
	return counts
}

func expectShares(t *testing.T, got map[uint64]float64, want map[uint64]float64) {
	t.Helper()
	for id, w := range want {
		if math.Abs(got[id]-w) > 0.015 {
			t.Fatalf("worker %d share %.4f, want %.4f (all: %v)", id, got[id], w, got)
		}
	}
}

func ptr(v float64) *float64 { return &v }

var costs102030 = policytest.Source{row(1, 10, 0), row(2, 20, 0), row(3, 30, 0)}

func TestSoftmaxSamplingDecisions(t *testing.T) {
	const n = 20000
	t.Run("at temperature 1 costs 10/20/30 are sampled 0.5065/0.3072/0.1863 as in §9.4", func(t *testing.T) {
		expectShares(t, frequencies(t, newPolicy(t, `{"temperature": 1}`), costs102030, nil, n),
			map[uint64]float64{1: 0.5065, 2: 0.3072, 3: 0.1863})
	})
	t.Run("the default temperature is 1", func(t *testing.T) {
		expectShares(t, frequencies(t, newPolicy(t, `{}`), costs102030, nil, n),
			map[uint64]float64{1: 0.5065, 2: 0.3072, 3: 0.1863})
	})
	t.Run("at temperature 0.5 costs 10/20/30 are sampled 0.6652/0.2447/0.0900", func(t *testing.T) {
		expectShares(t, frequencies(t, newPolicy(t, `{"temperature": 0.5}`), costs102030, nil, n),
			map[uint64]float64{1: 0.6652, 2: 0.2447, 3: 0.0900})
	})
	t.Run("the normalisation makes the shares independent of the cost scale", func(t *testing.T) {
		expectShares(t, frequencies(t, newPolicy(t, `{"temperature": 1}`), policytest.Source{row(1, 1000, 0), row(2, 2000, 0), row(3, 3000, 0)}, nil, n),
			map[uint64]float64{1: 0.5065, 2: 0.3072, 3: 0.1863})
	})
	t.Run("equal costs are sampled uniformly", func(t *testing.T) {
		expectShares(t, frequencies(t, newPolicy(t, `{"temperature": 0.1}`), policytest.Source{row(1, 7, 0), row(2, 7, 0), row(3, 7, 0), row(4, 7, 0)}, nil, n),
			map[uint64]float64{1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25})
	})
	t.Run("a per-request temperature override wins over the parameter", func(t *testing.T) {
		expectShares(t, frequencies(t, newPolicy(t, `{"temperature": 1}`), costs102030, ptr(0.5), n),
			map[uint64]float64{1: 0.6652, 2: 0.2447, 3: 0.0900})
	})
	t.Run("a per-request temperature of 0 picks the minimum cost, ties at random", func(t *testing.T) {
		got := frequencies(t, newPolicy(t, `{"temperature": 1}`), policytest.Source{row(1, 10, 0), row(2, 10, 0), row(3, 11, 0)}, ptr(0), 4000)
		expectShares(t, got, map[uint64]float64{1: 0.5, 2: 0.5, 3: 0})
	})
	t.Run("Go callers can sample over their own scorers", func(t *testing.T) {
		p, err := softmaxsampling.NewPolicy(policies.DefaultRouterConfig(), "select", 1, leastbusy.ActiveRequestsScorer{})
		if err != nil {
			t.Fatal(err)
		}
		if got := p.RequiredInputs(); got != policies.InputsLoad {
			t.Fatalf("RequiredInputs = %v", got)
		}
		// Active requests 1/2/3 normalise like costs 10/20/30.
		expectShares(t, frequencies(t, p, policytest.Source{row(1, 900, 1), row(2, 0, 2), row(3, 0, 3)}, nil, n),
			map[uint64]float64{1: 0.5065, 2: 0.3072, 3: 0.1863})
	})
}

func TestSoftmaxSamplingRequestsTheBuiltinCostGroups(t *testing.T) {
	p := newPolicy(t, `{}`)
	if got := p.RequiredInputs(); got != policies.InputsAll {
		t.Fatalf("RequiredInputs = %v (the built-in cost reads CACHE, LOAD and ROUTING)", got)
	}
	if got := (&softmaxsampling.Picker{}).RequiredWorkerInputs(); got != policies.InputsNone {
		t.Fatalf("picker declares %v", got)
	}
}

func TestSoftmaxSamplingValidation(t *testing.T) {
	for _, tc := range []struct {
		name, raw, want string
	}{
		{"an unknown parameter is rejected by name", `{"temp": 1}`, `unknown field "temp"`},
		{"a zero temperature is rejected by name", `{"temperature": 0}`, "temperature must be a finite number > 0"},
		{"a negative temperature is rejected by name", `{"temperature": -2}`, "temperature must be a finite number > 0"},
		{"a temperature overflowing to infinity is rejected by name", `{"temperature": 1e400}`, "temperature"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			policytest.WantRejected(t, softmaxsampling.Provider, softmaxsampling.TypeName, tc.raw, tc.want)
		})
	}
	t.Run("NewPolicy rejects a NaN temperature by name", func(t *testing.T) {
		if _, err := softmaxsampling.NewPolicy(policies.DefaultRouterConfig(), "select", math.NaN(), leastbusy.ActiveRequestsScorer{}); err == nil || !strings.Contains(err.Error(), "temperature") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("NewPolicy requires a scorer", func(t *testing.T) {
		if _, err := softmaxsampling.NewPolicy(policies.DefaultRouterConfig(), "select", 1); err == nil || !strings.Contains(err.Error(), "scorer") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("an invalid router configuration fails the factory naming the setting", func(t *testing.T) {
		f, _ := softmaxsampling.Provider(policies.PolicyParameters{})
		cfg := policies.DefaultRouterConfig()
		cfg.PrefillLoadScale = math.Inf(1)
		if _, err := f(cfg, "select", policies.PartitionID{}); err == nil || !strings.Contains(err.Error(), "prefill_load_scale") {
			t.Fatalf("err = %v", err)
		}
	})
}

func TestTheREADMEExampleSelectsThePolicy(t *testing.T) {
	policytest.Partition(t, catalogtest.ResolveREADME(t, softmaxsampling.TypeName, softmaxsampling.Provider).Factory, "default")
}
