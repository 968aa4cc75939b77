package stackedloadcache_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/stackedloadcache"
)

// row is one candidate's explicit inputs.
type row struct {
	id       uint64
	device   int // blocks
	requests int
}

// source is an InputSource over rows in the order given to Select.
type source []row

func (s source) Cache(i int) policies.CacheInputs {
	return policies.NewCacheInputs(s[i].device, 3, 3, 0)
}
func (s source) Load(i int) policies.LoadInputs {
	return policies.NewLoadInputs(100, 50, s[i].requests)
}
func (s source) Routing(int) policies.RoutingInputs { return policies.NewRoutingInputs(2, true) }

func (s source) workers() []policies.Worker {
	ws := make([]policies.Worker, len(s))
	for i, r := range s {
		ws[i] = policies.Worker{WorkerID: r.id}
	}
	return ws
}

func newPolicy(t testing.TB, raw string) *policies.WorkerSelectionPolicy {
	t.Helper()
	params, err := policies.NewPolicyParameters([]byte(raw))
	if err != nil {
		t.Fatal(err)
	}
	f, err := stackedloadcache.Provider(params)
	if err != nil {
		t.Fatal(err)
	}
	p, err := f(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// pick shuffles rows, runs Select for a request of islTokens (block size 16) and returns the
// chosen worker id and its cost.
func pick(t *testing.T, p *policies.WorkerSelectionPolicy, rows []row, islTokens int, rng *rand.Rand) (uint64, float64) {
	t.Helper()
	s := append(source(nil), rows...)
	rng.Shuffle(len(s), func(i, j int) { s[i], s[j] = s[j], s[i] })
	res, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: islTokens, BlockSize: 16, Rand: rng}), s.workers(), s)
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
		rows     []row
		isl      int
		want     uint64
		wantCost float64
	}{
		// isl 160 → 10 request blocks.
		{"with default weights the sum of active requests and uncached blocks decides", `{}`,
			[]row{{1, 8, 3}, {2, 0, 0}, {3, 4, 1}}, 160, 1, 3 + 2},
		{"a heavy load weight prefers the idle worker despite its cold cache", `{"active_requests_weight": 10}`,
			[]row{{1, 8, 3}, {2, 0, 0}}, 160, 2, 10},
		{"a heavy cache weight prefers the warm worker despite its load", `{"uncached_blocks_weight": 5}`,
			[]row{{1, 10, 6}, {2, 2, 0}}, 160, 1, 6},
		{"an overlap beyond the request counts as zero uncached blocks, never negative", `{"active_requests_weight": 1, "uncached_blocks_weight": 1}`,
			[]row{{1, 40, 2}, {2, 9, 0}}, 160, 2, 1},
		{"a zero load weight ranks by uncached blocks only", `{"active_requests_weight": 0}`,
			[]row{{1, 7, 50}, {2, 6, 0}}, 160, 1, 3},
		{"a zero cache weight ranks by active requests only", `{"uncached_blocks_weight": 0}`,
			[]row{{1, 10, 2}, {2, 0, 1}}, 160, 2, 1},
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
			got, _ := pick(t, p, []row{{1, 10, 2}, {2, 8, 0}, {3, 0, 0}}, 160, rng) // costs 2, 2, 10
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
			pick(t, p, []row{{1, 0, 0}, {2, 1, 1}}, 32, rand.New(rand.NewPCG(1, 1)))
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
			params, _ := policies.NewPolicyParameters([]byte(tc.raw))
			_, err := stackedloadcache.Provider(params)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), stackedloadcache.TypeName) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
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
	res := resolveREADME(t)
	p, err := res.Factory(policies.DefaultRouterConfig(), "select", policies.PartitionID{})
	if err != nil {
		t.Fatal(err)
	}
	// 10 request blocks: worker 1 costs 2×1 + 0.5×0 = 2, worker 2 costs 0 + 0.5×10 = 5.
	if got, cost := pick(t, p, []row{{1, 10, 1}, {2, 0, 0}}, 160, rand.New(rand.NewPCG(1, 1))); got != 1 || cost != 2 {
		t.Fatalf("got %d cost %v", got, cost)
	}
}

// BenchmarkStackedLoadCache runs the stacked policy (two scorers + lowest-cost picker) through
// the host's Select over N candidates: `go test -bench StackedLoadCache -benchmem ./policies/stackedloadcache`.
func BenchmarkStackedLoadCache(b *testing.B) {
	for _, n := range []int{2, 32, 1024, 10000} {
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			gen := rand.New(rand.NewPCG(1, 2))
			s := make(source, n)
			for i := range s {
				s[i] = row{id: uint64(i), device: gen.IntN(64), requests: gen.IntN(16)}
			}
			ws := s.workers()
			var src policies.InputSource = s // convert once: a slice-to-interface conversion allocates
			p := newPolicy(b, `{"active_requests_weight": 2, "uncached_blocks_weight": 1}`)
			ctx := policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 1024, BlockSize: 16, Rand: rand.New(rand.NewPCG(3, 4))})
			if _, err := p.Select(ctx, ws, src); err != nil { // grow the policy's buffers once
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := p.Select(ctx, ws, src); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/candidate")
		})
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
	if err := reg.Register(stackedloadcache.TypeName, stackedloadcache.Provider); err != nil {
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
	if res.Type != stackedloadcache.TypeName || res.Builtin {
		t.Fatalf("the README example resolves to %+v", res)
	}
	return res
}
