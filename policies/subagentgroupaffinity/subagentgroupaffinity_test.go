package subagentgroupaffinity_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog/catalogtest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
	"github.com/kvepp/kvepp/policies/subagentgroupaffinity"
)

// costs maps worker id → built-in cost: without prefill tracking the cost is the decode cost.
type costs map[uint64]int

// harness is one partition's policy and a random source.
type harness struct {
	t   *testing.T
	p   *policies.WorkerSelectionPolicy
	rng *rand.Rand
}

func newHarness(t *testing.T, raw string) *harness {
	t.Helper()
	return &harness{t: t, p: policytest.NewPolicy(t, subagentgroupaffinity.Provider, raw), rng: rand.New(rand.NewPCG(1, 2))}
}

// sess builds a session context; parent may be "".
func sess(id, parent string) *policies.SessionContext {
	return policies.NewSessionContext(policies.SessionParams{SessionID: id, ParentSessionID: parent})
}

// pick selects among the workers of c (shuffled) for a request with session s (nil for none).
func (h *harness) pick(s *policies.SessionContext, c costs) uint64 {
	h.t.Helper()
	return pickWith(h.t, h.p, h.rng, s, c)
}

// pickWith selects among the workers of c (shuffled with rng) for a 64-token request (block size
// 16) with session s.
func pickWith(t *testing.T, p *policies.WorkerSelectionPolicy, rng *rand.Rand, s *policies.SessionContext, c costs) uint64 {
	t.Helper()
	var src policytest.Source
	for id, cost := range c {
		src = append(src, policytest.Candidate{Worker: policytest.W(id, 0), DecodeCost: cost})
	}
	res, err := policytest.Select(p, policies.ContextParams{ISLTokens: 64, BlockSize: 16, Session: s}, rng, src)
	if err != nil {
		t.Fatal(err)
	}
	return res.Worker.WorkerID
}

func (h *harness) expect(s *policies.SessionContext, c costs, want uint64) {
	h.t.Helper()
	if got := h.pick(s, c); got != want {
		h.t.Fatalf("got worker %d, want %d (costs %v)", got, want, c)
	}
}

func TestSubagentGroupAffinityDecisions(t *testing.T) {
	t.Run("a new group goes to the lowest built-in cost", func(t *testing.T) {
		h := newHarness(t, `{}`)
		h.expect(sess("child-1", "parent"), costs{1: 50, 2: 10, 3: 30}, 2)
	})
	t.Run("a sibling subagent joins its group's worker while within the discount", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 20}`)
		h.expect(sess("child-1", "parent"), costs{1: 50, 2: 10}, 2)
		h.expect(sess("child-2", "parent"), costs{1: 15, 2: 30}, 2) // 30 − 20 = 10 < 15
	})
	t.Run("the parent's own turn joins the group its subagents formed", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 20}`)
		h.expect(sess("child-1", "parent"), costs{1: 50, 2: 10}, 2)
		h.expect(sess("parent", ""), costs{1: 15, 2: 30}, 2)
	})
	t.Run("a group moves when another worker is cheaper by more than the discount, and stays moved", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 20}`)
		h.expect(sess("child-1", "parent"), costs{1: 50, 2: 10}, 2)
		h.expect(sess("child-2", "parent"), costs{1: 5, 2: 30}, 1)  // 30 − 20 = 10 > 5
		h.expect(sess("child-3", "parent"), costs{1: 25, 2: 10}, 1) // now bound to 1: 25 − 20 = 5 < 10
	})
	t.Run("a request without a session gets the plain built-in ranking and binds nothing", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 20}`)
		h.expect(nil, costs{1: 50, 2: 10}, 2)
		h.expect(sess("child-1", "parent"), costs{1: 10, 2: 15}, 1)
	})
	t.Run("another group is not attracted by this group's worker", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 20}`)
		h.expect(sess("a-1", "A"), costs{1: 50, 2: 10}, 2)
		h.expect(sess("b-1", "B"), costs{1: 15, 2: 30}, 1)
		h.expect(sess("a-2", "A"), costs{1: 15, 2: 30}, 2)
	})
	t.Run("a group whose worker is not a candidate is re-placed by cost and rebound", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 20}`)
		h.expect(sess("child-1", "parent"), costs{1: 50, 2: 10, 3: 40}, 2)
		h.expect(sess("child-2", "parent"), costs{1: 30, 3: 40}, 1)
		h.expect(sess("child-3", "parent"), costs{1: 30, 2: 20, 3: 40}, 1) // 30 − 20 = 10 < 20
	})
	t.Run("a single host-constrained candidate is picked without rebinding the group", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 20}`)
		h.expect(sess("child-1", "parent"), costs{1: 50, 2: 10}, 2)
		h.expect(sess("child-2", "parent"), costs{1: 0}, 1)
		h.expect(sess("child-3", "parent"), costs{1: 15, 2: 30}, 2)
	})
	t.Run("a zero discount is the plain built-in ranking", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 0}`)
		h.expect(sess("child-1", "parent"), costs{1: 50, 2: 10}, 2)
		h.expect(sess("child-2", "parent"), costs{1: 29, 2: 30}, 1)
	})
	t.Run("a group id longer than MaxGroupIDBytes is never bound", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 20}`)
		long := strings.Repeat("p", subagentgroupaffinity.MaxGroupIDBytes+1)
		h.expect(sess("child-1", long), costs{1: 50, 2: 10}, 2)
		h.expect(sess("child-2", long), costs{1: 15, 2: 30}, 1)
	})
	t.Run("exact ties after the discount are broken at random", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 10}`)
		counts := map[uint64]int{}
		for i := 0; i < 400; i++ {
			// A fresh group each time: bound to 2 first, then 1: 20 vs 30 − 10 = 20 on the tie.
			g := fmt.Sprintf("parent-%d", i)
			h.expect(sess("c1", g), costs{1: 50, 2: 10}, 2)
			counts[h.pick(sess("c2", g), costs{1: 20, 2: 30})]++
		}
		if counts[1] < 150 || counts[2] < 150 {
			t.Fatalf("counts %v", counts)
		}
	})
}

func TestSubagentGroupAffinityStateIsBounded(t *testing.T) {
	t.Run("the least recently used group is evicted when max_groups is reached", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 20, "max_groups": 2}`)
		h.expect(sess("a", "A"), costs{1: 50, 2: 10}, 2) // A → 2
		h.expect(sess("b", "B"), costs{1: 10, 2: 50}, 1) // B → 1
		h.expect(sess("a", "A"), costs{1: 50, 2: 10}, 2) // A used again: B is now least recent
		h.expect(sess("c", "C"), costs{1: 50, 2: 10}, 2) // C → 2 evicts B
		h.expect(sess("b", "B"), costs{1: 15, 2: 10}, 2) // B forgot worker 1
		h.expect(sess("c", "C"), costs{1: 15, 2: 30}, 2) // C is still bound; rebinding B evicted A
		h.expect(sess("a", "A"), costs{1: 15, 2: 30}, 1) // A forgot worker 2
	})
	t.Run("a table of one binding keeps only the latest group", func(t *testing.T) {
		h := newHarness(t, `{"group_cost_discount": 20, "max_groups": 1}`)
		h.expect(sess("a", "A"), costs{1: 50, 2: 10}, 2)
		h.expect(sess("b", "B"), costs{1: 10, 2: 50}, 1)
		h.expect(sess("a", "A"), costs{1: 15, 2: 30}, 1) // A was evicted
		h.expect(sess("a", "A"), costs{1: 30, 2: 15}, 1) // and rebound to 1
	})
	t.Run("many groups never hold more than max_groups bindings", func(t *testing.T) {
		p := subagentgroupaffinity.NewPicker(5, 64)
		pol, err := policies.NewPolicy(policies.DefaultRouterConfig(), "select", nil, p)
		if err != nil {
			t.Fatal(err)
		}
		rng := rand.New(rand.NewPCG(3, 3))
		for i := 0; i < 1000; i++ {
			pickWith(t, pol, rng, sess("c", fmt.Sprintf("g%d", i)), costs{1: 0, 2: 0, 3: 0})
		}
		if p.Groups() != 64 {
			t.Fatalf("Groups() = %d, want 64", p.Groups())
		}
		// The most recent groups are still bound: each sticks to its worker under a zero-cost tie.
		for i := 990; i < 1000; i++ {
			g := fmt.Sprintf("g%d", i)
			first := pickWith(t, pol, rng, sess("c", g), costs{1: 0, 2: 0, 3: 0})
			for j := 0; j < 5; j++ {
				if got := pickWith(t, pol, rng, sess("c", g), costs{1: 0, 2: 0, 3: 0}); got != first {
					t.Fatalf("group %s moved from %d to %d on a tie", g, first, got)
				}
			}
		}
	})
}

func TestSubagentGroupAffinityPartitionsHaveIndependentTables(t *testing.T) {
	f, err := subagentgroupaffinity.Provider(policies.PolicyParameters{})
	if err != nil {
		t.Fatal(err)
	}
	a, b := policytest.Partition(t, f, "a"), policytest.Partition(t, f, "b")
	rng := rand.New(rand.NewPCG(1, 1))
	if got := pickWith(t, a, rng, sess("c1", "P"), costs{1: 100, 2: 10}); got != 2 {
		t.Fatalf("got %d", got)
	}
	if got := pickWith(t, b, rng, sess("c2", "P"), costs{1: 10, 2: 30}); got != 1 {
		t.Fatalf("partition b followed partition a's binding: got %d", got)
	}
	if got := pickWith(t, a, rng, sess("c3", "P"), costs{1: 10, 2: 30}); got != 2 {
		t.Fatalf("partition a lost its binding: got %d", got)
	}
}

func TestSubagentGroupAffinityRequestsTheBuiltinCostGroups(t *testing.T) {
	h := newHarness(t, `{}`)
	if got := h.p.RequiredInputs(); got != policies.InputsAll {
		t.Fatalf("RequiredInputs = %v (the built-in cost reads CACHE, LOAD and ROUTING)", got)
	}
	if got := subagentgroupaffinity.NewPicker(1, 1).RequiredWorkerInputs(); got != policies.InputsNone {
		t.Fatalf("picker declares %v", got)
	}
}

func TestSubagentGroupAffinityProviderValidation(t *testing.T) {
	for _, tc := range []struct {
		name, raw, want string
	}{
		{"an unknown parameter is rejected by name", `{"group_idle_ttl_secs": 300}`, `unknown field "group_idle_ttl_secs"`},
		{"a negative discount is rejected by name", `{"group_cost_discount": -1}`, "group_cost_discount must be a finite number ≥ 0"},
		{"a discount overflowing to infinity is rejected by name", `{"group_cost_discount": 1e400}`, "group_cost_discount"},
		{"a zero max_groups is rejected by name", `{"max_groups": 0}`, "max_groups must be an integer ≥ 1"},
		{"a fractional max_groups is rejected by name", `{"max_groups": 1.5}`, "max_groups"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			policytest.WantRejected(t, subagentgroupaffinity.Provider, subagentgroupaffinity.TypeName, tc.raw, tc.want)
		})
	}
	t.Run("a NaN discount given in Go is rejected by name", func(t *testing.T) {
		nan := math.NaN()
		if _, err := (subagentgroupaffinity.Parameters{GroupCostDiscount: &nan}).Settings(); err == nil || !strings.Contains(err.Error(), "group_cost_discount") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("omitted parameters take the defaults", func(t *testing.T) {
		s, err := subagentgroupaffinity.Parameters{}.Settings()
		if err != nil || s != (subagentgroupaffinity.Settings{GroupCostDiscount: 32, MaxGroups: 4096}) {
			t.Fatalf("%+v, %v", s, err)
		}
	})
}

func TestTheREADMEExampleSelectsThePolicy(t *testing.T) {
	policytest.Partition(t, catalogtest.ResolveREADME(t, subagentgroupaffinity.TypeName, subagentgroupaffinity.Provider).Factory, "default")
}
