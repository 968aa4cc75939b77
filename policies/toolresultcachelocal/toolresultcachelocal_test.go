package toolresultcachelocal_test

import (
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog/catalogtest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
	"github.com/kvepp/kvepp/policies/toolresultcachelocal"
)

func newPolicy(t *testing.T) *policies.WorkerSelectionPolicy {
	t.Helper()
	return policytest.NewPolicy(t, toolresultcachelocal.Provider, "")
}

func session(trigger policies.InputTrigger) *policies.SessionContext {
	return policies.NewSessionContext(policies.SessionParams{SessionID: "s1", InputTrigger: trigger})
}

// pick shuffles rows and runs Select for a 512-token request (block size 16) with prefill
// tracking and the given session; it returns the chosen worker id and its built-in cost.
func pick(t *testing.T, p *policies.WorkerSelectionPolicy, rows policytest.Source, sess *policies.SessionContext, rng *rand.Rand) (uint64, float64) {
	t.Helper()
	res, err := policytest.Select(p, policies.ContextParams{ISLTokens: 512, BlockSize: 16, TracksPrefillTokens: true, Session: sess}, rng, rows)
	if err != nil {
		t.Fatal(err)
	}
	return res.Worker.WorkerID, res.Cost
}

// The §9.7 worked example: A (8 device + 4 host blocks, 1024 active prefill tokens, decode cost
// 132) costs 217; B (nothing cached, decode cost 82) costs 114.
var (
	workedA = policytest.Candidate{Worker: policytest.W(1, 0), Device: 8, Host: 4, Prefill: 1024, DecodeCost: 132}
	workedB = policytest.Candidate{Worker: policytest.W(2, 0), DecodeCost: 82}
)

func TestToolResultCacheLocalDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		name     string
		sess     *policies.SessionContext
		rows     policytest.Source
		want     uint64
		wantCost float64
	}{
		{"a tool-result turn goes to the largest device overlap even at a higher built-in cost",
			session(policies.InputTriggerToolResult), policytest.Source{workedA, workedB}, 1, 217},
		{"a user-message turn goes to the lowest built-in cost",
			session(policies.InputTriggerUserMessage), policytest.Source{workedA, workedB}, 2, 114},
		{"a turn with another trigger goes to the lowest built-in cost",
			session(policies.InputTriggerOther), policytest.Source{workedA, workedB}, 2, 114},
		{"a session without a trigger goes to the lowest built-in cost",
			session(policies.InputTriggerNone), policytest.Source{workedA, workedB}, 2, 114},
		{"a request without a session goes to the lowest built-in cost",
			nil, policytest.Source{workedA, workedB}, 2, 114},
		{"on a tool-result turn equal device overlaps go to the lower built-in cost",
			session(policies.InputTriggerToolResult),
			policytest.Source{{Worker: policytest.W(1, 0), Device: 4, DecodeCost: 90}, {Worker: policytest.W(2, 0), Device: 4, DecodeCost: 60}, {Worker: policytest.W(3, 0), Device: 1, DecodeCost: 10}}, 2, 28 + 60},
		{"on a tool-result turn host and disk overlap do not count as device overlap",
			session(policies.InputTriggerToolResult),
			policytest.Source{{Worker: policytest.W(1, 0), Host: 30, Disk: 2, DecodeCost: 40}, {Worker: policytest.W(2, 0), Device: 1, DecodeCost: 40}}, 2, 31 + 40},
		{"a tool-result turn with nothing cached anywhere goes to the lowest built-in cost",
			session(policies.InputTriggerToolResult),
			policytest.Source{{Worker: policytest.W(1, 0), Prefill: 320, DecodeCost: 10}, {Worker: policytest.W(2, 0), DecodeCost: 20}}, 2, 32 + 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPolicy(t)
			for i := 0; i < 20; i++ {
				got, cost := pick(t, p, tc.rows, tc.sess, rng)
				if got != tc.want || cost != tc.wantCost {
					t.Fatalf("got worker %d cost %v, want %d cost %v", got, cost, tc.want, tc.wantCost)
				}
			}
		})
	}
	t.Run("a tool-result turn breaks equal overlap and equal cost at random", func(t *testing.T) {
		p := newPolicy(t)
		rows := policytest.Source{{Worker: policytest.W(1, 0), Device: 3, DecodeCost: 5}, {Worker: policytest.W(2, 0), Device: 3, DecodeCost: 5}, {Worker: policytest.W(3, 0), Device: 2, DecodeCost: 0}}
		counts := map[uint64]int{}
		for i := 0; i < 1000; i++ {
			got, _ := pick(t, p, rows, session(policies.InputTriggerToolResult), rng)
			counts[got]++
		}
		if counts[3] != 0 || counts[1] < 400 || counts[2] < 400 {
			t.Fatalf("counts %v", counts)
		}
	})
}

func TestToolResultCacheLocalRequestsTheBuiltinCostGroups(t *testing.T) {
	p := newPolicy(t)
	// The built-in cost reads CACHE, LOAD and ROUTING; the picker adds only CACHE.
	if got := p.RequiredInputs(); got != policies.InputsAll {
		t.Fatalf("RequiredInputs = %v", got)
	}
	if got := (toolresultcachelocal.Picker{}).RequiredWorkerInputs(); got != policies.InputsCache {
		t.Fatalf("picker declares %v", got)
	}
	pick(t, p, policytest.Source{workedA, workedB}, session(policies.InputTriggerToolResult), rand.New(rand.NewPCG(1, 1)))
	if st := p.Stats(); st.CacheComputed != 2 || st.LoadComputed != 2 || st.RoutingComputed != 2 {
		t.Fatalf("each group must be computed once per candidate: %+v", st)
	}
}

func TestToolResultCacheLocalConfiguration(t *testing.T) {
	t.Run("an unknown parameter is rejected by name", func(t *testing.T) {
		policytest.WantRejected(t, toolresultcachelocal.Provider, toolresultcachelocal.TypeName, `{"trigger": "tool_result"}`, `unknown field "trigger"`)
	})
	t.Run("an invalid router configuration fails the factory naming the setting", func(t *testing.T) {
		cfg := policies.DefaultRouterConfig()
		cfg.HostCacheHitWeight = -1
		if _, err := toolresultcachelocal.New()(cfg, "select", policies.PartitionID{}); err == nil || !strings.Contains(err.Error(), "host_cache_hit_weight") {
			t.Fatalf("err = %v", err)
		}
	})
}

func TestTheREADMEExampleSelectsThePolicy(t *testing.T) {
	policytest.Partition(t, catalogtest.ResolveREADME(t, toolresultcachelocal.TypeName, toolresultcachelocal.Provider).Factory, "default")
}
