package leastactiverequests_test

import (
	"math/rand/v2"
	"testing"

	"github.com/kvepp/kvepp/catalog/catalogtest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/leastactiverequests"
	"github.com/kvepp/kvepp/policies/policytest"
)

// row is one candidate: its id, active requests and active prefill tokens. Its CACHE and ROUTING
// groups (64 device blocks, multiplier 0.5) are set so that reading them would show.
func row(id uint64, requests, prefill int) policytest.Candidate {
	return policytest.Candidate{Worker: policytest.W(id, 0), Requests: requests, Prefill: prefill,
		Device: 64, Multiplier: 0.5, HasMultiplier: true}
}

func newPolicy(t *testing.T) *policies.WorkerSelectionPolicy {
	t.Helper()
	return policytest.NewPolicy(t, leastactiverequests.Provider, "")
}

// pick runs Select over rows shuffled with rng for a 64-token request (block size 16).
func pick(t *testing.T, p *policies.WorkerSelectionPolicy, rows policytest.Source, rng *rand.Rand) uint64 {
	t.Helper()
	res, err := policytest.Select(p, policies.ContextParams{ISLTokens: 64, BlockSize: 16}, rng, rows)
	if err != nil {
		t.Fatal(err)
	}
	return res.Worker.WorkerID
}

func TestLeastActiveRequestsDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	t.Run("the worker with the fewest active requests wins regardless of its prefill load", func(t *testing.T) {
		p := newPolicy(t)
		for i := 0; i < 20; i++ {
			if got := pick(t, p, policytest.Source{row(1, 3, 0), row(2, 1, 90000), row(3, 2, 0)}, rng); got != 2 {
				t.Fatalf("got %d", got)
			}
		}
	})
	t.Run("ties on active requests are broken uniformly at random", func(t *testing.T) {
		p := newPolicy(t)
		counts := map[uint64]int{}
		const n = 2000
		for i := 0; i < n; i++ {
			counts[pick(t, p, policytest.Source{row(1, 0, 0), row(2, 0, 500), row(3, 4, 0)}, rng)]++
		}
		if counts[3] != 0 || counts[1] < n/2-120 || counts[1] > n/2+120 {
			t.Fatalf("counts %v", counts)
		}
	})
}

func TestLeastActiveRequestsRequestsOnlyLoad(t *testing.T) {
	p := newPolicy(t)
	if got := p.RequiredInputs(); got != policies.InputsLoad {
		t.Fatalf("RequiredInputs = %v", got)
	}
	pick(t, p, policytest.Source{row(1, 0, 0), row(2, 1, 0)}, rand.New(rand.NewPCG(1, 1)))
	if st := p.Stats(); st.CacheComputed != 0 || st.RoutingComputed != 0 || st.LoadComputed != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestLeastActiveRequestsProviderRejectsUnknownParameters(t *testing.T) {
	policytest.WantRejected(t, leastactiverequests.Provider, leastactiverequests.TypeName, `{"weight": 1}`, `unknown field "weight"`)
}

func TestTheREADMEExampleSelectsThePolicy(t *testing.T) {
	policytest.Partition(t, catalogtest.ResolveREADME(t, leastactiverequests.TypeName, leastactiverequests.Provider).Factory, "default")
}
