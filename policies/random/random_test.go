package random_test

import (
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/random"
)

func newPolicy(t *testing.T) *policies.WorkerSelectionPolicy {
	t.Helper()
	f, err := random.Provider(policies.PolicyParameters{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := f(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestRandomPicksUniformlyWhateverTheCandidateOrder(t *testing.T) {
	p := newPolicy(t)
	rng := rand.New(rand.NewPCG(5, 6))
	ids := []uint64{10, 20, 30, 40}
	counts := map[uint64]int{}
	const n = 8000
	for i := 0; i < n; i++ {
		ws := make([]policies.Worker, len(ids))
		for j, id := range ids {
			ws[j] = policies.Worker{WorkerID: id}
		}
		rng.Shuffle(len(ws), func(a, b int) { ws[a], ws[b] = ws[b], ws[a] })
		res, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{Rand: rng}), ws, nil)
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
	raw, _ := policies.NewPolicyParameters([]byte(`{"seed": 1}`))
	if _, err := random.Provider(raw); err == nil || !strings.Contains(err.Error(), `unknown field "seed"`) || !strings.Contains(err.Error(), random.TypeName) {
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
	if err := reg.Register(random.TypeName, random.Provider); err != nil {
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
	if res.Type != random.TypeName || res.Builtin {
		t.Fatalf("the README example resolves to %+v", res)
	}
	return res
}
