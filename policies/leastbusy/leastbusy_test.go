package leastbusy_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog/catalogtest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/leastbusy"
	"github.com/kvepp/kvepp/policies/policytest"
)

// row is one candidate: its id, device overlap (blocks) and active requests.
func row(id uint64, device, requests int) policytest.Candidate {
	return policytest.Candidate{Worker: policytest.W(id, 0), Device: device, Requests: requests}
}

func newPolicy(t *testing.T, raw string) *policies.WorkerSelectionPolicy {
	t.Helper()
	return policytest.NewPolicy(t, leastbusy.Provider, raw)
}

// pick runs Select over rows shuffled with seed and returns the chosen worker id.
func pick(p *policies.WorkerSelectionPolicy, rows policytest.Source, seed uint64) (uint64, error) {
	res, err := policytest.Select(p, policies.ContextParams{ISLTokens: 64, BlockSize: 16}, rand.New(rand.NewPCG(seed, 7)), rows)
	return res.Worker.WorkerID, err
}

func TestLeastBusyDecisions(t *testing.T) {
	for _, tc := range []struct {
		name string
		raw  string
		rows policytest.Source
		want uint64
	}{
		{"the least busy worker wins when every worker passes the filter", `{"min_device_overlap_blocks": 0}`,
			policytest.Source{row(1, 0, 5), row(2, 0, 1), row(3, 9, 3)}, 2},
		{"a worker below the device-overlap minimum is rejected even when it is the least busy", `{"min_device_overlap_blocks": 2}`,
			policytest.Source{row(1, 4, 5), row(2, 1, 0), row(3, 2, 3)}, 3},
		{"a fractional minimum keeps only workers with at least that many blocks", `{"min_device_overlap_blocks": 1.5}`,
			policytest.Source{row(1, 1, 0), row(2, 2, 9)}, 2},
		{"the cost is the active-request count, not the overlap", `{"min_device_overlap_blocks": 0}`,
			policytest.Source{row(1, 32, 2), row(2, 0, 1)}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPolicy(t, tc.raw)
			for seed := uint64(0); seed < 20; seed++ {
				got, err := pick(p, tc.rows, seed)
				if err != nil || got != tc.want {
					t.Fatalf("seed %d: got worker %d, %v; want %d", seed, got, err, tc.want)
				}
			}
		})
	}

	t.Run("every worker below the minimum fails with ErrAllFiltered", func(t *testing.T) {
		p := newPolicy(t, `{"min_device_overlap_blocks": 3}`)
		if _, err := pick(p, policytest.Source{row(1, 2, 0), row(2, 0, 0)}, 1); !errors.Is(err, policies.ErrAllFiltered) {
			t.Fatalf("err = %v", err)
		}
	})

	t.Run("exact cost ties are broken at random among the tied workers only", func(t *testing.T) {
		p := newPolicy(t, `{"min_device_overlap_blocks": 0}`)
		rows := policytest.Source{row(1, 0, 2), row(2, 0, 2), row(3, 0, 2), row(4, 0, 3)}
		counts := map[uint64]int{}
		const n = 3000
		for seed := uint64(0); seed < n; seed++ {
			got, err := pick(p, rows, seed)
			if err != nil {
				t.Fatal(err)
			}
			counts[got]++
		}
		if counts[4] != 0 {
			t.Fatalf("the busier worker was picked %d times", counts[4])
		}
		for _, id := range []uint64{1, 2, 3} {
			if c := counts[id]; c < n/3-150 || c > n/3+150 {
				t.Fatalf("tied worker %d picked %d of %d times: %v", id, c, n, counts)
			}
		}
	})
}

func TestLeastBusyRequestsOnlyCacheAndLoad(t *testing.T) {
	p := newPolicy(t, `{"min_device_overlap_blocks": 1}`)
	if got := p.RequiredInputs(); got != policies.InputsCache|policies.InputsLoad {
		t.Fatalf("RequiredInputs = %v", got)
	}
	if _, err := pick(p, policytest.Source{row(1, 0, 0), row(2, 1, 0), row(3, 5, 1)}, 3); err != nil {
		t.Fatal(err)
	}
	st := p.Stats()
	// The filtered-out worker 1 never has its LOAD group computed; ROUTING is never computed.
	if st.CacheComputed != 3 || st.LoadComputed != 2 || st.RoutingComputed != 0 {
		t.Fatalf("stats = %+v", st)
	}
}

func TestLeastBusyProviderValidation(t *testing.T) {
	for _, tc := range []struct {
		name, raw, want string
	}{
		{"a missing min_device_overlap_blocks is rejected as required", `{}`, "min_device_overlap_blocks is required"},
		{"an unknown parameter is rejected by name", `{"min_device_overlap_blocks": 0, "min_overlap": 1}`, `unknown field "min_overlap"`},
		{"a negative minimum is rejected by name", `{"min_device_overlap_blocks": -1}`, "min_device_overlap_blocks must be a finite non-negative number"},
		{"a minimum that overflows to infinity is rejected by name", `{"min_device_overlap_blocks": 1e999}`, "min_device_overlap_blocks"},
		{"a non-numeric minimum is rejected by name", `{"min_device_overlap_blocks": "two"}`, "min_device_overlap_blocks"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			policytest.WantRejected(t, leastbusy.Provider, leastbusy.TypeName, tc.raw, tc.want)
		})
	}
	for _, v := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		t.Run(fmt.Sprintf("a non-finite minimum (%v) given in Go is rejected by name", v), func(t *testing.T) {
			if err := (leastbusy.Parameters{MinDeviceOverlapBlocks: &v}).Validate(); err == nil || !strings.Contains(err.Error(), "min_device_overlap_blocks") {
				t.Fatalf("err = %v", err)
			}
		})
	}
}

func TestLeastBusyComponentsFailWithoutTheirGroup(t *testing.T) {
	ctx := policies.NewWorkerSelectionContext(policies.ContextParams{})
	bare := policies.NewWorkerCandidate(policies.Worker{WorkerID: 1}, policies.InputsNone, policies.CacheInputs{}, policies.LoadInputs{}, policies.RoutingInputs{})
	if _, err := (&leastbusy.MinimumDeviceOverlapFilter{}).Keep(ctx, bare); err == nil || err.Error() != "cache input unavailable" {
		t.Fatalf("filter err = %v", err)
	}
	if _, err := (leastbusy.ActiveRequestsScorer{}).Score(ctx, bare); err == nil || err.Error() != "load input unavailable" {
		t.Fatalf("scorer err = %v", err)
	}
	view, _ := policies.NewWorkerInputView(nil, policies.InputsNone, nil, nil, nil)
	if _, err := (leastbusy.LowestCostPicker{}).Pick(ctx, view); err == nil || err.Error() != "no eligible worker" {
		t.Fatalf("picker err = %v", err)
	}
}

func TestTheREADMEExampleSelectsThePolicy(t *testing.T) {
	res := catalogtest.ResolveREADME(t, leastbusy.TypeName, leastbusy.Provider)
	p := policytest.Partition(t, res.Factory, "default")
	if got, err := pick(p, policytest.Source{row(1, 0, 4), row(2, 0, 0)}, 1); err != nil || got != 2 {
		t.Fatalf("got %d, %v", got, err)
	}
}
