package custompolicy_test

import (
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/examples/custompolicy"
	"github.com/kvepp/kvepp/policies"
)

// row is one candidate's explicit inputs.
type row struct {
	w          policies.Worker
	device     int     // blocks
	decodeCost int     // blocks
	requests   int     // live bookings
	multiplier float64 // preferred-taint multiplier; 0 = none
}

// source is an InputSource over rows in the order given to Select.
type source []row

func (s source) Cache(i int) policies.CacheInputs {
	return policies.NewCacheInputs(s[i].device, 0, 0, 0)
}
func (s source) Load(i int) policies.LoadInputs {
	return policies.NewLoadInputs(0, s[i].decodeCost, s[i].requests)
}
func (s source) Routing(i int) policies.RoutingInputs {
	return policies.NewRoutingInputs(s[i].multiplier, s[i].multiplier != 0)
}

func newPolicy(t *testing.T, raw string) *policies.WorkerSelectionPolicy {
	t.Helper()
	params, err := policies.NewPolicyParameters([]byte(raw))
	if err != nil {
		t.Fatal(err)
	}
	f, err := custompolicy.Provider(params)
	if err != nil {
		t.Fatal(err)
	}
	p, err := f(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// pick shuffles rows, runs Select and returns the chosen worker and its cost.
func pick(p *policies.WorkerSelectionPolicy, rows []row, rng *rand.Rand) (policies.Worker, float64, error) {
	s := append(source(nil), rows...)
	rng.Shuffle(len(s), func(i, j int) { s[i], s[j] = s[j], s[i] })
	ws := make([]policies.Worker, len(s))
	for i, r := range s {
		ws[i] = r.w
	}
	res, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 64, BlockSize: 16, Rand: rng}), ws, s)
	return res.Worker, res.Cost, err
}

func w(id uint64, rank uint32) policies.Worker { return policies.Worker{WorkerID: id, DPRank: rank} }

func TestAcmeLeastKVDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		name     string
		raw      string
		rows     []row
		want     policies.Worker
		wantCost float64
	}{
		{"the smallest decode footprint wins", `{"max_active_requests": 8}`,
			[]row{{w: w(1, 0), decodeCost: 90}, {w: w(2, 0), decodeCost: 40}}, w(2, 0), 40},
		{"device overlap is credited against the footprint", `{"max_active_requests": 8, "device_overlap_credit": 2}`,
			[]row{{w: w(1, 0), decodeCost: 90, device: 30}, {w: w(2, 0), decodeCost: 40}}, w(1, 0), 30},
		{"the credit never makes a cost negative", `{"max_active_requests": 8, "device_overlap_credit": 10}`,
			[]row{{w: w(1, 0), decodeCost: 20, device: 30}, {w: w(2, 0), decodeCost: 20, device: 2}}, w(1, 0), 0},
		{"a preferred-taint multiplier scales the cost", `{"max_active_requests": 8}`,
			[]row{{w: w(1, 0), decodeCost: 60, multiplier: 0.5}, {w: w(2, 0), decodeCost: 40}}, w(1, 0), 30},
		{"a worker at the active-request cap is filtered out even when cheapest", `{"max_active_requests": 2}`,
			[]row{{w: w(1, 0), decodeCost: 1, requests: 2}, {w: w(2, 0), decodeCost: 40, requests: 1}}, w(2, 0), 40},
		{"equal costs go to the lowest worker id, then the lowest dp_rank", `{"max_active_requests": 8}`,
			[]row{{w: w(7, 1), decodeCost: 5}, {w: w(7, 0), decodeCost: 5}, {w: w(9, 0), decodeCost: 5}}, w(7, 0), 5},
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
		if _, _, err := pick(p, []row{{w: w(1, 0), requests: 1}, {w: w(2, 0), requests: 3}}, rng); !errors.Is(err, policies.ErrAllFiltered) {
			t.Fatalf("err = %v", err)
		}
	})
}

func TestAcmeLeastKVRequestsTheGroupsItReads(t *testing.T) {
	p := newPolicy(t, `{"max_active_requests": 1}`)
	if got := p.RequiredInputs(); got != policies.InputsAll {
		t.Fatalf("RequiredInputs = %v", got)
	}
	if _, _, err := pick(p, []row{{w: w(1, 0), requests: 1}, {w: w(2, 0)}}, rand.New(rand.NewPCG(1, 1))); err != nil {
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
			params, _ := policies.NewPolicyParameters([]byte(tc.raw))
			_, err := custompolicy.Provider(params)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), custompolicy.TypeName) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
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
