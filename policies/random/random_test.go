package random_test

import (
	"math/rand/v2"
	"testing"

	"github.com/kvepp/kvepp/catalog/catalogtest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
	"github.com/kvepp/kvepp/policies/random"
)

func newPolicy(t *testing.T) *policies.WorkerSelectionPolicy {
	t.Helper()
	return policytest.NewPolicy(t, random.Provider, "")
}

func TestRandomPicksUniformlyWhateverTheCandidateOrder(t *testing.T) {
	p := newPolicy(t)
	rng := rand.New(rand.NewPCG(5, 6))
	ids := []uint64{10, 20, 30, 40}
	ws := make([]policies.Worker, len(ids))
	for j, id := range ids {
		ws[j] = policies.Worker{WorkerID: id}
	}
	counts := map[uint64]int{}
	const n = 8000
	for i := 0; i < n; i++ {
		res, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{Rand: rng}), policytest.Shuffle(rng, ws), nil)
		if err != nil {
			t.Fatal(err)
		}
		counts[res.Worker.WorkerID]++
	}
	for _, id := range ids {
		if c := counts[id]; c < n/4-250 || c > n/4+250 {
			t.Fatalf("worker %d picked %d of %d times: %v", id, c, n, counts)
		}
	}
}

func TestRandomIsReproducibleFromTheContextRand(t *testing.T) {
	p := newPolicy(t)
	ws := []policies.Worker{{WorkerID: 1}, {WorkerID: 2}, {WorkerID: 3}, {WorkerID: 4}, {WorkerID: 5}}
	run := func() (out []uint64) {
		rng := rand.New(rand.NewPCG(9, 9))
		for i := 0; i < 20; i++ {
			res, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{Rand: rng}), ws, nil)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, res.Worker.WorkerID)
		}
		return out
	}
	a, b := run(), run()
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("same seed gave %v then %v", a, b)
		}
	}
}

func TestRandomRequestsNoGroup(t *testing.T) {
	if got := newPolicy(t).RequiredInputs(); got != policies.InputsNone {
		t.Fatalf("RequiredInputs = %v", got)
	}
}

func TestRandomProviderRejectsUnknownParameters(t *testing.T) {
	policytest.WantRejected(t, random.Provider, random.TypeName, `{"seed": 1}`, `unknown field "seed"`)
}

func TestTheREADMEExampleSelectsThePolicy(t *testing.T) {
	policytest.Partition(t, catalogtest.ResolveREADME(t, random.TypeName, random.Provider).Factory, "default")
}
