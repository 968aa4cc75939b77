package custompolicy_test

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/examples/custompolicy"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
)

func newPolicy(t *testing.T, raw string) *policies.WorkerSelectionPolicy {
	t.Helper()
	return policytest.NewPolicy(t, custompolicy.Provider, raw)
}

// pick shuffles rows, runs Select and returns the chosen worker and its cost.
func pick(p *policies.WorkerSelectionPolicy, rows policytest.Source, rng *rand.Rand) (policies.Worker, float64, error) {
	res, err := policytest.Select(p, policies.ContextParams{ISLTokens: 64, BlockSize: 16}, rng, rows)
	return res.Worker, res.Cost, err
}

var w = policytest.W

func TestAcmeLeastKVDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		name     string
		raw      string
		rows     policytest.Source
		want     policies.Worker
		wantCost float64
	}{
		{"the smallest decode footprint wins", `{"max_active_requests": 8}`,
			policytest.Source{{Worker: w(1, 0), DecodeCost: 90}, {Worker: w(2, 0), DecodeCost: 40}}, w(2, 0), 40},
		{"device overlap is credited against the footprint", `{"max_active_requests": 8, "device_overlap_credit": 2}`,
			policytest.Source{{Worker: w(1, 0), DecodeCost: 90, Device: 30}, {Worker: w(2, 0), DecodeCost: 40}}, w(1, 0), 30},
		{"the credit never makes a cost negative", `{"max_active_requests": 8, "device_overlap_credit": 10}`,
			policytest.Source{{Worker: w(1, 0), DecodeCost: 20, Device: 30}, {Worker: w(2, 0), DecodeCost: 20, Device: 2}}, w(1, 0), 0},
		{"a preferred-taint multiplier scales the cost", `{"max_active_requests": 8}`,
			policytest.Source{{Worker: w(1, 0), DecodeCost: 60, Multiplier: 0.5, HasMultiplier: true}, {Worker: w(2, 0), DecodeCost: 40}}, w(1, 0), 30},
		{"a worker at the active-request cap is filtered out even when cheapest", `{"max_active_requests": 2}`,
			policytest.Source{{Worker: w(1, 0), DecodeCost: 1, Requests: 2}, {Worker: w(2, 0), DecodeCost: 40, Requests: 1}}, w(2, 0), 40},
		{"equal costs go to the lowest worker id, then the lowest dp_rank", `{"max_active_requests": 8}`,
			policytest.Source{{Worker: w(7, 1), DecodeCost: 5}, {Worker: w(7, 0), DecodeCost: 5}, {Worker: w(9, 0), DecodeCost: 5}}, w(7, 0), 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPolicy(t, tc.raw)
			for i := 0; i < 20; i++ {
				got, cost, err := pick(p, tc.rows, rng)
				if err != nil || got != tc.want || cost != tc.wantCost {
					t.Fatalf("got %v cost %v (%v), want %v cost %v", got, cost, err, tc.want, tc.wantCost)
				}
			}
		})
	}
	t.Run("every worker at the cap fails with ErrAllFiltered", func(t *testing.T) {
		p := newPolicy(t, `{"max_active_requests": 1}`)
		if _, _, err := pick(p, policytest.Source{{Worker: w(1, 0), Requests: 1}, {Worker: w(2, 0), Requests: 3}}, rng); !errors.Is(err, policies.ErrAllFiltered) {
			t.Fatalf("err = %v", err)
		}
	})
}

func TestAcmeLeastKVRequestsTheGroupsItReads(t *testing.T) {
	p := newPolicy(t, `{"max_active_requests": 1}`)
	if got := p.RequiredInputs(); got != policies.InputsAll {
		t.Fatalf("RequiredInputs = %v", got)
	}
	if _, _, err := pick(p, policytest.Source{{Worker: w(1, 0), Requests: 1}, {Worker: w(2, 0)}}, rand.New(rand.NewPCG(1, 1))); err != nil {
		t.Fatal(err)
	}
	// Worker 1 is filtered on LOAD, so its CACHE and ROUTING groups are never computed.
	if st := p.Stats(); st.LoadComputed != 2 || st.CacheComputed != 1 || st.RoutingComputed != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestAcmeLeastKVProviderValidation(t *testing.T) {
	for _, tc := range []struct {
		name, raw, want string
	}{
		{"a missing max_active_requests is rejected as required", `{}`, "max_active_requests is required"},
		{"an unknown parameter is rejected by name", `{"max_active_requests": 1, "cap": 2}`, `unknown field "cap"`},
		{"a zero cap is rejected by name", `{"max_active_requests": 0}`, "max_active_requests must be an integer ≥ 1"},
		{"a negative credit is rejected by name", `{"max_active_requests": 1, "device_overlap_credit": -1}`, "device_overlap_credit must be a finite number ≥ 0"},
		{"a credit overflowing to infinity is rejected by name", `{"max_active_requests": 1, "device_overlap_credit": 1e400}`, "device_overlap_credit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			policytest.WantRejected(t, custompolicy.Provider, custompolicy.TypeName, tc.raw, tc.want)
		})
	}
}

func TestAcmeLeastKVComponentsFailWithoutTheirGroups(t *testing.T) {
	ctx := policies.NewWorkerSelectionContext(policies.ContextParams{})
	bare := policies.NewWorkerCandidate(w(1, 0), policies.InputsNone, policies.CacheInputs{}, policies.LoadInputs{}, policies.RoutingInputs{})
	if _, err := (&custompolicy.MaxActiveRequestsFilter{Max: 1}).Keep(ctx, bare); err == nil {
		t.Fatal("filter accepted a candidate without LOAD")
	}
	if _, err := (&custompolicy.KVFootprintScorer{}).Score(ctx, bare); err == nil {
		t.Fatal("scorer accepted a candidate without CACHE and LOAD")
	}
}

func TestRegisterAddsTheTypeOnceNextToTheStandardCatalog(t *testing.T) {
	reg := catalog.Builtins()
	if err := custompolicy.Register(reg); err != nil {
		t.Fatal(err)
	}
	if _, ok := reg.Lookup(custompolicy.TypeName); !ok {
		t.Fatalf("%s not registered: %v", custompolicy.TypeName, reg.Types())
	}
	if err := custompolicy.Register(reg); !errors.Is(err, catalog.ErrDuplicateType) {
		t.Fatalf("second Register: %v", err)
	}
}
