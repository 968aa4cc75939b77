package roundrobin_test

import (
	"math/rand/v2"
	"testing"

	"github.com/kvepp/kvepp/catalog/catalogtest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
	"github.com/kvepp/kvepp/policies/roundrobin"
)

// pick runs Select over workers shuffled with rng; round-robin declares no input group, so the
// source fails the test if any group is computed.
func pick(t *testing.T, p *policies.WorkerSelectionPolicy, rng *rand.Rand, workers ...policies.Worker) policies.Worker {
	t.Helper()
	ws := policytest.Shuffle(rng, workers)
	res, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{Rand: rng}), ws, policytest.NoInputs(t))
	if err != nil {
		t.Fatal(err)
	}
	return res.Worker
}

var w = policytest.W

func TestRoundRobinDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	t.Run("rotates in (worker_id, dp_rank) order whatever the candidate order", func(t *testing.T) {
		p := policytest.Partition(t, roundrobin.New(), "default")
		set := []policies.Worker{w(9, 0), w(3, 1), w(3, 0), w(5, 0)}
		want := []policies.Worker{w(3, 0), w(3, 1), w(5, 0), w(9, 0), w(3, 0), w(3, 1), w(5, 0), w(9, 0)}
		for i, exp := range want {
			if got := pick(t, p, rng, set...); got != exp {
				t.Fatalf("selection %d: got %v, want %v", i, got, exp)
			}
		}
	})
	t.Run("a worker that joins mid-round is visited in its key order", func(t *testing.T) {
		p := policytest.Partition(t, roundrobin.New(), "default")
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
		p := policytest.Partition(t, roundrobin.New(), "default")
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
		p := policytest.Partition(t, roundrobin.New(), "default")
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
	a, b := policytest.Partition(t, f, "a"), policytest.Partition(t, f, "b")
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
	p := policytest.Partition(t, roundrobin.New(), "default")
	if got := p.RequiredInputs(); got != policies.InputsNone {
		t.Fatalf("RequiredInputs = %v", got)
	}
	// Select with a nil source works only because no group is declared.
	if _, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{}), []policies.Worker{w(1, 0)}, nil); err != nil {
		t.Fatal(err)
	}
}

func TestRoundRobinProviderRejectsUnknownParameters(t *testing.T) {
	policytest.WantRejected(t, roundrobin.Provider, roundrobin.TypeName, `{"start": 2}`, `unknown field "start"`)
}

func TestTheREADMEExampleSelectsThePolicy(t *testing.T) {
	policytest.Partition(t, catalogtest.ResolveREADME(t, roundrobin.TypeName, roundrobin.Provider).Factory, "default")
}
