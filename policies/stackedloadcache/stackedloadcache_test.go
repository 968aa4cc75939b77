package stackedloadcache_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog/catalogtest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
	"github.com/kvepp/kvepp/policies/stackedloadcache"
)

// row is one candidate: its id, device overlap (blocks) and active requests. The other inputs
// are the same on every candidate (3 host and 3 disk blocks, 100 prefill tokens, decode cost 50,
// taint multiplier 2), so they must not sway the decision.
func row(id uint64, device, requests int) policytest.Candidate {
	return policytest.Candidate{Worker: policytest.W(id, 0), Device: device, Host: 3, Disk: 3,
		Prefill: 100, DecodeCost: 50, Requests: requests, Multiplier: 2, HasMultiplier: true}
}

func newPolicy(t testing.TB, raw string) *policies.WorkerSelectionPolicy {
	t.Helper()
	return policytest.NewPolicy(t, stackedloadcache.Provider, raw)
}

// pick shuffles rows, runs Select for a request of islTokens (block size 16) and returns the
// chosen worker id and its cost.
func pick(t *testing.T, p *policies.WorkerSelectionPolicy, rows policytest.Source, islTokens int, rng *rand.Rand) (uint64, float64) {
	t.Helper()
	res, err := policytest.Select(p, policies.ContextParams{ISLTokens: islTokens, BlockSize: 16}, rng, rows)
	if err != nil {
		t.Fatal(err)
	}
	return res.Worker.WorkerID, res.Cost
}

func TestStackedLoadCacheDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		name     string
		raw      string
		rows     policytest.Source
		isl      int
		want     uint64
		wantCost float64
	}{
		// isl 160 → 10 request blocks.
		{"with default weights the sum of active requests and uncached blocks decides", `{}`,
			policytest.Source{row(1, 8, 3), row(2, 0, 0), row(3, 4, 1)}, 160, 1, 3 + 2},
		{"a heavy load weight prefers the idle worker despite its cold cache", `{"active_requests_weight": 10}`,
			policytest.Source{row(1, 8, 3), row(2, 0, 0)}, 160, 2, 10},
		{"a heavy cache weight prefers the warm worker despite its load", `{"uncached_blocks_weight": 5}`,
			policytest.Source{row(1, 10, 6), row(2, 2, 0)}, 160, 1, 6},
		{"an overlap beyond the request counts as zero uncached blocks, never negative", `{"active_requests_weight": 1, "uncached_blocks_weight": 1}`,
			policytest.Source{row(1, 40, 2), row(2, 9, 0)}, 160, 2, 1},
		{"a zero load weight ranks by uncached blocks only", `{"active_requests_weight": 0}`,
			policytest.Source{row(1, 7, 50), row(2, 6, 0)}, 160, 1, 3},
		{"a zero cache weight ranks by active requests only", `{"uncached_blocks_weight": 0}`,
			policytest.Source{row(1, 10, 2), row(2, 0, 1)}, 160, 2, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPolicy(t, tc.raw)
			for i := 0; i < 20; i++ {
				got, cost := pick(t, p, tc.rows, tc.isl, rng)
				if got != tc.want || cost != tc.wantCost {
					t.Fatalf("got worker %d cost %v, want %d cost %v", got, cost, tc.want, tc.wantCost)
				}
			}
		})
	}
	t.Run("equal total costs are broken at random between the tied workers", func(t *testing.T) {
		p := newPolicy(t, `{}`)
		counts := map[uint64]int{}
		for i := 0; i < 1000; i++ {
			got, _ := pick(t, p, policytest.Source{row(1, 10, 2), row(2, 8, 0), row(3, 0, 0)}, 160, rng) // costs 2, 2, 10
			counts[got]++
		}
		if counts[3] != 0 || counts[1] < 400 || counts[2] < 400 {
			t.Fatalf("counts %v", counts)
		}
	})
}

func TestStackedLoadCacheRequestsOnlyTheGroupsOfItsWeightedScorers(t *testing.T) {
	for _, tc := range []struct {
		name string
		raw  string
		want policies.WorkerInputs
	}{
		{"both weights set read CACHE and LOAD", `{}`, policies.InputsCache | policies.InputsLoad},
		{"a zero cache weight reads only LOAD", `{"uncached_blocks_weight": 0}`, policies.InputsLoad},
		{"a zero load weight reads only CACHE", `{"active_requests_weight": 0}`, policies.InputsCache},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPolicy(t, tc.raw)
			if got := p.RequiredInputs(); got != tc.want {
				t.Fatalf("RequiredInputs = %v, want %v", got, tc.want)
			}
			pick(t, p, policytest.Source{row(1, 0, 0), row(2, 1, 1)}, 32, rand.New(rand.NewPCG(1, 1)))
			st := p.Stats()
			if st.RoutingComputed != 0 || (st.CacheComputed != 0) != tc.want.Has(policies.InputsCache) || (st.LoadComputed != 0) != tc.want.Has(policies.InputsLoad) {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

func TestStackedLoadCacheProviderValidation(t *testing.T) {
	for _, tc := range []struct {
		name, raw, want string
	}{
		{"an unknown parameter is rejected by name", `{"load_weight": 1}`, `unknown field "load_weight"`},
		{"a negative load weight is rejected by name", `{"active_requests_weight": -0.5}`, "active_requests_weight must be a finite non-negative number"},
		{"a negative cache weight is rejected by name", `{"uncached_blocks_weight": -1}`, "uncached_blocks_weight must be a finite non-negative number"},
		{"a weight overflowing to infinity is rejected by name", `{"uncached_blocks_weight": 1e400}`, "uncached_blocks_weight"},
		{"both weights zero are rejected", `{"active_requests_weight": 0, "uncached_blocks_weight": 0}`, "must not both be 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			policytest.WantRejected(t, stackedloadcache.Provider, stackedloadcache.TypeName, tc.raw, tc.want)
		})
	}
	t.Run("a NaN weight given in Go is rejected by name", func(t *testing.T) {
		nan := math.NaN()
		if _, err := (stackedloadcache.Parameters{ActiveRequestsWeight: &nan}).Weights(); err == nil || !strings.Contains(err.Error(), "active_requests_weight") {
			t.Fatalf("err = %v", err)
		}
	})
}

func TestTheREADMEExampleSelectsThePolicy(t *testing.T) {
	res := catalogtest.ResolveREADME(t, stackedloadcache.TypeName, stackedloadcache.Provider)
	p, err := res.Factory(policies.DefaultRouterConfig(), "select", policies.PartitionID{})
	if err != nil {
		t.Fatal(err)
	}
	// 10 request blocks: worker 1 costs 2×1 + 0.5×0 = 2, worker 2 costs 0 + 0.5×10 = 5.
	if got, cost := pick(t, p, policytest.Source{row(1, 10, 1), row(2, 0, 0)}, 160, rand.New(rand.NewPCG(1, 1))); got != 1 || cost != 2 {
		t.Fatalf("got %d cost %v", got, cost)
	}
}

// BenchmarkStackedLoadCache runs the stacked policy (two scorers + lowest-cost picker) through
// the host's Select over N candidates: `go test -bench StackedLoadCache -benchmem ./policies/stackedloadcache`.
func BenchmarkStackedLoadCache(b *testing.B) {
	for _, n := range []int{2, 32, 1024, 10000} {
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			gen := rand.New(rand.NewPCG(1, 2))
			s := make(policytest.Source, n)
			for i := range s {
				s[i] = row(uint64(i), gen.IntN(64), gen.IntN(16))
			}
			p := newPolicy(b, `{"active_requests_weight": 2, "uncached_blocks_weight": 1}`)
			ctx := policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 1024, BlockSize: 16, Rand: rand.New(rand.NewPCG(3, 4))})
			if _, err := p.Select(ctx, s.Workers(), s); err != nil { // grow the policy's buffers once
				b.Fatal(err)
			}
			policytest.BenchSelect(b, p, ctx, s)
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/candidate")
		})
	}
}
