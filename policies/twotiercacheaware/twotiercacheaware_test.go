package twotiercacheaware_test

import (
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/twotiercacheaware"
)

// row is one candidate's explicit inputs.
type row struct {
	id       uint64
	device   int // blocks
	requests int
	prefill  int // tokens
}

// source is an InputSource over rows in the order given to Select.
type source []row

func (s source) Cache(i int) policies.CacheInputs {
	return policies.NewCacheInputs(s[i].device, 0, 0, 0)
}
func (s source) Load(i int) policies.LoadInputs {
	return policies.NewLoadInputs(s[i].prefill, 0, s[i].requests)
}
func (s source) Routing(int) policies.RoutingInputs { return policies.RoutingInputs{} }

func newPolicy(t *testing.T, raw string) *policies.WorkerSelectionPolicy {
	t.Helper()
	params, err := policies.NewPolicyParameters([]byte(raw))
	if err != nil {
		t.Fatal(err)
	}
	f, err := twotiercacheaware.Provider(params)
	if err != nil {
		t.Fatal(err)
	}
	p, err := f(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// pick shuffles rows and runs Select for a request of isl tokens (block size 16).
func pick(t *testing.T, p *policies.WorkerSelectionPolicy, rows []row, isl int, rng *rand.Rand) uint64 {
	t.Helper()
	s := append(source(nil), rows...)
	rng.Shuffle(len(s), func(i, j int) { s[i], s[j] = s[j], s[i] })
	ws := make([]policies.Worker, len(s))
	for i, r := range s {
		ws[i] = policies.Worker{WorkerID: r.id}
	}
	res, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: isl, BlockSize: 16, Rand: rng}), ws, s)
	if err != nil {
		t.Fatal(err)
	}
	return res.Worker.WorkerID
}

func TestTwoTierCacheAwareDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		name string
		raw  string
		rows []row
		isl  int // 160 tokens = 10 blocks
		want uint64
	}{
		{"while balanced the largest overlap above the cache threshold wins even when busier", `{}`,
			[]row{{1, 8, 5, 0}, {2, 2, 0, 0}}, 160, 1},
		{"while balanced an overlap ratio equal to the threshold is not enough and the shortest queue wins", `{}`,
			[]row{{1, 5, 3, 0}, {2, 0, 1, 0}}, 160, 2},
		{"while balanced equal best overlaps go to the fewer active requests", `{}`,
			[]row{{1, 8, 4, 0}, {2, 8, 2, 0}, {3, 0, 0, 0}}, 160, 2},
		{"while balanced equal overlaps and requests go to the fewer active prefill tokens", `{}`,
			[]row{{1, 8, 2, 900}, {2, 8, 2, 100}}, 160, 2},
		{"once max−min exceeds the absolute threshold and the relative one, the shortest queue wins over a full overlap", `{}`,
			[]row{{1, 10, 40, 0}, {2, 0, 0, 0}, {3, 0, 1, 0}}, 160, 2},
		{"a spread exactly at the absolute threshold is still balanced", `{}`,
			[]row{{1, 10, 32, 0}, {2, 0, 0, 0}}, 160, 1},
		{"a spread above the absolute threshold is balanced while max ≤ rel × min", `{"balance_abs_threshold": 10, "balance_rel_threshold": 3}`,
			[]row{{1, 10, 40, 0}, {2, 0, 20, 0}}, 160, 1},
		{"a spread above both thresholds is imbalanced with custom thresholds", `{"balance_abs_threshold": 10, "balance_rel_threshold": 1.5}`,
			[]row{{1, 10, 40, 0}, {2, 0, 20, 0}}, 160, 2},
		{"while imbalanced equal queues go to the fewer active prefill tokens", `{}`,
			[]row{{1, 10, 0, 500}, {2, 0, 0, 100}, {3, 10, 50, 0}}, 160, 2},
		{"a lower cache threshold lets a smaller overlap win", `{"cache_threshold": 0.2}`,
			[]row{{1, 3, 6, 0}, {2, 0, 0, 0}}, 160, 1},
		{"with a zero cache threshold no overlap at all falls back to the shortest queue", `{"cache_threshold": 0}`,
			[]row{{1, 0, 6, 0}, {2, 0, 1, 0}}, 160, 2},
		{"a request without a full block has no overlap ratio and goes to the shortest queue", `{}`,
			[]row{{1, 4, 6, 0}, {2, 0, 1, 0}}, 0, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPolicy(t, tc.raw)
			for i := 0; i < 20; i++ {
				if got := pick(t, p, tc.rows, tc.isl, rng); got != tc.want {
					t.Fatalf("got worker %d, want %d", got, tc.want)
				}
			}
		})
	}
	t.Run("exact ties are broken at random among the tied workers", func(t *testing.T) {
		p := newPolicy(t, `{}`)
		counts := map[uint64]int{}
		for i := 0; i < 1000; i++ {
			counts[pick(t, p, []row{{1, 9, 1, 0}, {2, 9, 1, 0}, {3, 9, 2, 0}}, 160, rng)]++
		}
		if counts[3] != 0 || counts[1] < 400 || counts[2] < 400 {
			t.Fatalf("counts %v", counts)
		}
	})
}

func TestTwoTierImbalanceRule(t *testing.T) {
	th := twotiercacheaware.Thresholds{BalanceAbsThreshold: 32, BalanceRelThreshold: 1.0001}
	for _, tc := range []struct {
		name     string
		min, max int
		want     bool
	}{
		{"a spread of 33 from an idle worker is imbalanced", 0, 33, true},
		{"a spread of 32 is balanced", 0, 32, false},
		{"a large spread on busy workers is imbalanced when max exceeds rel × min", 100, 200, true},
		{"equal loads are balanced", 50, 50, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := th.Imbalanced(tc.min, tc.max); got != tc.want {
				t.Fatalf("Imbalanced(%d, %d) = %v", tc.min, tc.max, got)
			}
		})
	}
}

func TestTwoTierRequestsOnlyCacheAndLoad(t *testing.T) {
	p := newPolicy(t, `{}`)
	if got := p.RequiredInputs(); got != policies.InputsCache|policies.InputsLoad {
		t.Fatalf("RequiredInputs = %v", got)
	}
	pick(t, p, []row{{1, 1, 1, 0}, {2, 2, 2, 0}}, 160, rand.New(rand.NewPCG(1, 1)))
	if st := p.Stats(); st.RoutingComputed != 0 || st.CacheComputed != 2 || st.LoadComputed != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestTwoTierProviderValidation(t *testing.T) {
	for _, tc := range []struct {
		name, raw, want string
	}{
		{"an unknown parameter is rejected by name", `{"eviction_interval": 60}`, `unknown field "eviction_interval"`},
		{"a cache threshold above 1 is rejected by name", `{"cache_threshold": 1.5}`, "cache_threshold must be a number in [0, 1]"},
		{"a negative cache threshold is rejected by name", `{"cache_threshold": -0.1}`, "cache_threshold must be a number in [0, 1]"},
		{"a negative absolute threshold is rejected by name", `{"balance_abs_threshold": -1}`, "balance_abs_threshold must be an integer ≥ 0"},
		{"a fractional absolute threshold is rejected by name", `{"balance_abs_threshold": 2.5}`, "balance_abs_threshold"},
		{"a negative relative threshold is rejected by name", `{"balance_rel_threshold": -1}`, "balance_rel_threshold must be a finite number ≥ 0"},
		{"a relative threshold overflowing to infinity is rejected by name", `{"balance_rel_threshold": 1e400}`, "balance_rel_threshold"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			params, _ := policies.NewPolicyParameters([]byte(tc.raw))
			_, err := twotiercacheaware.Provider(params)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), twotiercacheaware.TypeName) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
	t.Run("NaN thresholds given in Go are rejected by name", func(t *testing.T) {
		nan := math.NaN()
		for _, p := range []twotiercacheaware.Parameters{{CacheThreshold: &nan}, {BalanceRelThreshold: &nan}} {
			if _, err := p.Thresholds(); err == nil || !strings.Contains(err.Error(), "threshold") {
				t.Fatalf("err = %v", err)
			}
		}
	})
	t.Run("omitted parameters take the SGLang defaults", func(t *testing.T) {
		th, err := twotiercacheaware.Parameters{}.Thresholds()
		if err != nil || th != (twotiercacheaware.Thresholds{CacheThreshold: 0.5, BalanceAbsThreshold: 32, BalanceRelThreshold: 1.0001}) {
			t.Fatalf("%+v, %v", th, err)
		}
	})
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
	if err := reg.Register(twotiercacheaware.TypeName, twotiercacheaware.Provider); err != nil {
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
	if res.Type != twotiercacheaware.TypeName || res.Builtin {
		t.Fatalf("the README example resolves to %+v", res)
	}
	return res
}
