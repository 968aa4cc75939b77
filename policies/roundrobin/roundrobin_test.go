package roundrobin_test

import (
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/roundrobin"
)

// noInputs is an InputSource that must never be asked: round-robin declares no group.
type noInputs struct{ t *testing.T }

func (s noInputs) Cache(int) policies.CacheInputs {
	s.t.Error("CACHE computed")
	return policies.CacheInputs{}
}
func (s noInputs) Load(int) policies.LoadInputs {
	s.t.Error("LOAD computed")
	return policies.LoadInputs{}
}
func (s noInputs) Routing(int) policies.RoutingInputs {
	s.t.Error("ROUTING computed")
	return policies.RoutingInputs{}
}

func newPolicy(t *testing.T, f policies.PolicyFactory, group string) *policies.WorkerSelectionPolicy {
	t.Helper()
	p, err := f(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: group})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// pick runs Select over workers shuffled with rng.
func pick(t *testing.T, p *policies.WorkerSelectionPolicy, rng *rand.Rand, workers ...policies.Worker) policies.Worker {
	t.Helper()
	ws := append([]policies.Worker(nil), workers...)
	rng.Shuffle(len(ws), func(i, j int) { ws[i], ws[j] = ws[j], ws[i] })
	res, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{Rand: rng}), ws, noInputs{t})
	if err != nil {
		t.Fatal(err)
	}
	return res.Worker
}

func w(id uint64, rank uint32) policies.Worker { return policies.Worker{WorkerID: id, DPRank: rank} }

func TestRoundRobinDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	t.Run("rotates in (worker_id, dp_rank) order whatever the candidate order", func(t *testing.T) {
		p := newPolicy(t, roundrobin.New(), "default")
		set := []policies.Worker{w(9, 0), w(3, 1), w(3, 0), w(5, 0)}
		want := []policies.Worker{w(3, 0), w(3, 1), w(5, 0), w(9, 0), w(3, 0), w(3, 1), w(5, 0), w(9, 0)}
		for i, exp := range want {
			if got := pick(t, p, rng, set...); got != exp {
				t.Fatalf("selection %d: got %v, want %v", i, got, exp)
			}
		}
	})
	t.Run("a worker that joins mid-round is visited in its key order", func(t *testing.T) {
		p := newPolicy(t, roundrobin.New(), "default")
		if got := pick(t, p, rng, w(1, 0), w(5, 0)); got != w(1, 0) {
			t.Fatalf("got %v", got)
		}
		if got := pick(t, p, rng, w(1, 0), w(3, 0), w(5, 0)); got != w(3, 0) {
			t.Fatalf("got %v, want the newcomer 3", got)
		}
		if got := pick(t, p, rng, w(1, 0), w(3, 0), w(5, 0)); got != w(5, 0) {
			t.Fatalf("got %v", got)
		}
	})
	t.Run("when the last picked worker leaves the rotation continues after its key", func(t *testing.T) {
		p := newPolicy(t, roundrobin.New(), "default")
		pick(t, p, rng, w(1, 0), w(2, 0), w(4, 0))
		if got := pick(t, p, rng, w(1, 0), w(2, 0), w(4, 0)); got != w(2, 0) {
			t.Fatalf("got %v", got)
		}
		if got := pick(t, p, rng, w(1, 0), w(4, 0)); got != w(4, 0) {
			t.Fatalf("got %v, want 4 after the departed 2", got)
		}
		if got := pick(t, p, rng, w(1, 0), w(4, 0)); got != w(1, 0) {
			t.Fatalf("got %v, want the wrap-around to 1", got)
		}
	})
	t.Run("a single candidate is always picked", func(t *testing.T) {
		p := newPolicy(t, roundrobin.New(), "default")
		for i := 0; i < 3; i++ {
			if got := pick(t, p, rng, w(7, 2)); got != w(7, 2) {
				t.Fatalf("got %v", got)
			}
		}
	})
}

func TestRoundRobinPartitionsRotateIndependently(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	f, err := roundrobin.Provider(policies.PolicyParameters{})
	if err != nil {
		t.Fatal(err)
	}
	a, b := newPolicy(t, f, "a"), newPolicy(t, f, "b")
	set := []policies.Worker{w(1, 0), w(2, 0), w(3, 0)}
	pick(t, a, rng, set...)
	pick(t, a, rng, set...)
	if got := pick(t, b, rng, set...); got != w(1, 0) {
		t.Fatalf("partition b started at %v, want 1: its counter must not see partition a's picks", got)
	}
	if got := pick(t, a, rng, set...); got != w(3, 0) {
		t.Fatalf("partition a continued at %v, want 3", got)
	}
}

func TestRoundRobinRequestsNoGroup(t *testing.T) {
	p := newPolicy(t, roundrobin.New(), "default")
	if got := p.RequiredInputs(); got != policies.InputsNone {
		t.Fatalf("RequiredInputs = %v", got)
	}
	// Select with a nil source works only because no group is declared.
	if _, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{}), []policies.Worker{w(1, 0)}, nil); err != nil {
		t.Fatal(err)
	}
}

func TestRoundRobinProviderRejectsUnknownParameters(t *testing.T) {
	raw, _ := policies.NewPolicyParameters([]byte(`{"start": 2}`))
	if _, err := roundrobin.Provider(raw); err == nil || !strings.Contains(err.Error(), `unknown field "start"`) || !strings.Contains(err.Error(), roundrobin.TypeName) {
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
	if err := reg.Register(roundrobin.TypeName, roundrobin.Provider); err != nil {
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
	if res.Type != roundrobin.TypeName || res.Builtin {
		t.Fatalf("the README example resolves to %+v", res)
	}
	return res
}
