package leastactiverequests_test

import (
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/leastactiverequests"
)

// row is one candidate's explicit inputs.
type row struct {
	id       uint64
	requests int
	prefill  int
}

// source is an InputSource over rows in the order given to Select.
type source []row

func (s source) Cache(int) policies.CacheInputs { return policies.NewCacheInputs(64, 0, 0, 0) }
func (s source) Load(i int) policies.LoadInputs {
	return policies.NewLoadInputs(s[i].prefill, 0, s[i].requests)
}
func (s source) Routing(int) policies.RoutingInputs { return policies.NewRoutingInputs(0.5, true) }

func newPolicy(t *testing.T) *policies.WorkerSelectionPolicy {
	t.Helper()
	f, err := leastactiverequests.Provider(policies.PolicyParameters{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := f(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func pick(t *testing.T, p *policies.WorkerSelectionPolicy, rows []row, rng *rand.Rand) uint64 {
	t.Helper()
	s := append(source(nil), rows...)
	rng.Shuffle(len(s), func(i, j int) { s[i], s[j] = s[j], s[i] })
	ws := make([]policies.Worker, len(s))
	for i, r := range s {
		ws[i] = policies.Worker{WorkerID: r.id}
	}
	res, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 64, BlockSize: 16, Rand: rng}), ws, s)
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
			if got := pick(t, p, []row{{1, 3, 0}, {2, 1, 90000}, {3, 2, 0}}, rng); got != 2 {
				t.Fatalf("got %d", got)
			}
		}
	})
	t.Run("ties on active requests are broken uniformly at random", func(t *testing.T) {
		p := newPolicy(t)
		counts := map[uint64]int{}
		const n = 2000
		for i := 0; i < n; i++ {
			counts[pick(t, p, []row{{1, 0, 0}, {2, 0, 500}, {3, 4, 0}}, rng)]++
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
	pick(t, p, []row{{1, 0, 0}, {2, 1, 0}}, rand.New(rand.NewPCG(1, 1)))
	if st := p.Stats(); st.CacheComputed != 0 || st.RoutingComputed != 0 || st.LoadComputed != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestLeastActiveRequestsProviderRejectsUnknownParameters(t *testing.T) {
	raw, _ := policies.NewPolicyParameters([]byte(`{"weight": 1}`))
	if _, err := leastactiverequests.Provider(raw); err == nil || !strings.Contains(err.Error(), `unknown field "weight"`) || !strings.Contains(err.Error(), leastactiverequests.TypeName) {
		t.Fatalf("err = %v", err)
	}
}

func TestTheREADMEExampleSelectsThePolicy(t *testing.T) {
	res := resolveREADME(t)
	if _, err := res.Factory(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"}); err != nil {
		t.Fatal(err)
	}
}

// resolveREADME resolves the README's YAML example through a registry holding this type.
func resolveREADME(t *testing.T) *catalog.Resolution {
	t.Helper()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, example, ok := strings.Cut(string(readme), "```yaml\n")
	if !ok {
		t.Fatal("README.md has no yaml example")
	}
	example, _, _ = strings.Cut(example, "```")
	reg := catalog.NewRegistry()
	if err := reg.Register(leastactiverequests.TypeName, leastactiverequests.Provider); err != nil {
		t.Fatal(err)
	}
	cfg, err := catalog.ParseConfig([]byte(example))
	if err != nil {
		t.Fatal(err)
	}
	res, err := catalog.Resolve(reg, cfg, "")
	if err != nil {
		t.Fatal(err)
	}
	if res.Type != leastactiverequests.TypeName || res.Builtin {
		t.Fatalf("the README example resolves to %+v", res)
	}
	return res
}
