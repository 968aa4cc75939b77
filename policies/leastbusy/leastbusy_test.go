package leastbusy_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/leastbusy"
)

// row is one candidate's explicit inputs.
type row struct {
	id       uint64
	device   int
	requests int
}

// source is an InputSource over rows in the order given to Select.
type source []row

func (s source) Cache(i int) policies.CacheInputs {
	return policies.NewCacheInputs(s[i].device, 0, 0, 0)
}
func (s source) Load(i int) policies.LoadInputs     { return policies.NewLoadInputs(0, 0, s[i].requests) }
func (s source) Routing(int) policies.RoutingInputs { return policies.RoutingInputs{} }
func (s source) workers() (ws []policies.Worker) {
	for _, r := range s {
		ws = append(ws, policies.Worker{WorkerID: r.id})
	}
	return ws
}

func params(t *testing.T, raw string) policies.PolicyParameters {
	t.Helper()
	p, err := policies.NewPolicyParameters([]byte(raw))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func newPolicy(t *testing.T, raw string) *policies.WorkerSelectionPolicy {
	t.Helper()
	f, err := leastbusy.Provider(params(t, raw))
	if err != nil {
		t.Fatal(err)
	}
	p, err := f(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// pick runs Select over rows shuffled with seed and returns the chosen worker id.
func pick(p *policies.WorkerSelectionPolicy, rows []row, seed uint64) (uint64, error) {
	rng := rand.New(rand.NewPCG(seed, 7))
	s := append(source(nil), rows...)
	rng.Shuffle(len(s), func(i, j int) { s[i], s[j] = s[j], s[i] })
	ctx := policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 64, BlockSize: 16, Rand: rng})
	res, err := p.Select(ctx, s.workers(), s)
	return res.Worker.WorkerID, err
}

func TestLeastBusyDecisions(t *testing.T) {
	for _, tc := range []struct {
		name string
		raw  string
		rows []row
		want uint64
	}{
		{"the least busy worker wins when every worker passes the filter", `{"min_device_overlap_blocks": 0}`,
			[]row{{1, 0, 5}, {2, 0, 1}, {3, 9, 3}}, 2},
		{"a worker below the device-overlap minimum is rejected even when it is the least busy", `{"min_device_overlap_blocks": 2}`,
			[]row{{1, 4, 5}, {2, 1, 0}, {3, 2, 3}}, 3},
		{"a fractional minimum keeps only workers with at least that many blocks", `{"min_device_overlap_blocks": 1.5}`,
			[]row{{1, 1, 0}, {2, 2, 9}}, 2},
		{"the cost is the active-request count, not the overlap", `{"min_device_overlap_blocks": 0}`,
			[]row{{1, 32, 2}, {2, 0, 1}}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPolicy(t, tc.raw)
			for seed := uint64(0); seed < 20; seed++ {
				got, err := pick(p, tc.rows, seed)
				if err != nil || got != tc.want {
					t.Fatalf("seed %d: got worker %d, %v; want %d", seed, got, err, tc.want)
				}
			}
		})
	}

	t.Run("every worker below the minimum fails with ErrAllFiltered", func(t *testing.T) {
		p := newPolicy(t, `{"min_device_overlap_blocks": 3}`)
		if _, err := pick(p, []row{{1, 2, 0}, {2, 0, 0}}, 1); !errors.Is(err, policies.ErrAllFiltered) {
			t.Fatalf("err = %v", err)
		}
	})

	t.Run("exact cost ties are broken at random among the tied workers only", func(t *testing.T) {
		p := newPolicy(t, `{"min_device_overlap_blocks": 0}`)
		rows := []row{{1, 0, 2}, {2, 0, 2}, {3, 0, 2}, {4, 0, 3}}
		counts := map[uint64]int{}
		const n = 3000
		for seed := uint64(0); seed < n; seed++ {
			got, err := pick(p, rows, seed)
			if err != nil {
				t.Fatal(err)
			}
			counts[got]++
		}
		if counts[4] != 0 {
			t.Fatalf("the busier worker was picked %d times", counts[4])
		}
		for _, id := range []uint64{1, 2, 3} {
			if c := counts[id]; c < n/3-150 || c > n/3+150 {
				t.Fatalf("tied worker %d picked %d of %d times: %v", id, c, n, counts)
			}
		}
	})
}

func TestLeastBusyRequestsOnlyCacheAndLoad(t *testing.T) {
	p := newPolicy(t, `{"min_device_overlap_blocks": 1}`)
	if got := p.RequiredInputs(); got != policies.InputsCache|policies.InputsLoad {
		t.Fatalf("RequiredInputs = %v", got)
	}
	if _, err := pick(p, []row{{1, 0, 0}, {2, 1, 0}, {3, 5, 1}}, 3); err != nil {
		t.Fatal(err)
	}
	st := p.Stats()
	// The filtered-out worker 1 never has its LOAD group computed; ROUTING is never computed.
	if st.CacheComputed != 3 || st.LoadComputed != 2 || st.RoutingComputed != 0 {
		t.Fatalf("stats = %+v", st)
	}
}

func TestLeastBusyProviderValidation(t *testing.T) {
	for _, tc := range []struct {
		name, raw, want string
	}{
		{"a missing min_device_overlap_blocks is rejected as required", `{}`, "min_device_overlap_blocks is required"},
		{"an unknown parameter is rejected by name", `{"min_device_overlap_blocks": 0, "min_overlap": 1}`, `unknown field "min_overlap"`},
		{"a negative minimum is rejected by name", `{"min_device_overlap_blocks": -1}`, "min_device_overlap_blocks must be a finite non-negative number"},
		{"a minimum that overflows to infinity is rejected by name", `{"min_device_overlap_blocks": 1e999}`, "min_device_overlap_blocks"},
		{"a non-numeric minimum is rejected by name", `{"min_device_overlap_blocks": "two"}`, "min_device_overlap_blocks"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := leastbusy.Provider(params(t, tc.raw))
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), leastbusy.TypeName) {
				t.Fatalf("err = %v, want it to name %q and the type", err, tc.want)
			}
		})
	}
	for _, v := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		t.Run(fmt.Sprintf("a non-finite minimum (%v) given in Go is rejected by name", v), func(t *testing.T) {
			if err := (leastbusy.Parameters{MinDeviceOverlapBlocks: &v}).Validate(); err == nil || !strings.Contains(err.Error(), "min_device_overlap_blocks") {
				t.Fatalf("err = %v", err)
			}
		})
	}
}

func TestLeastBusyComponentsFailWithoutTheirGroup(t *testing.T) {
	ctx := policies.NewWorkerSelectionContext(policies.ContextParams{})
	bare := policies.NewWorkerCandidate(policies.Worker{WorkerID: 1}, policies.InputsNone, policies.CacheInputs{}, policies.LoadInputs{}, policies.RoutingInputs{})
	if _, err := (&leastbusy.MinimumDeviceOverlapFilter{}).Keep(ctx, bare); err == nil || err.Error() != "cache input unavailable" {
		t.Fatalf("filter err = %v", err)
	}
	if _, err := (leastbusy.ActiveRequestsScorer{}).Score(ctx, bare); err == nil || err.Error() != "load input unavailable" {
		t.Fatalf("scorer err = %v", err)
	}
	view, _ := policies.NewWorkerInputView(nil, policies.InputsNone, nil, nil, nil)
	if _, err := (leastbusy.LowestCostPicker{}).Pick(ctx, view); err == nil || err.Error() != "no eligible worker" {
		t.Fatalf("picker err = %v", err)
	}
}

func TestTheREADMEExampleSelectsThePolicy(t *testing.T) {
	res := resolveREADME(t)
	p, err := res.Factory(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := pick(p, []row{{1, 0, 4}, {2, 0, 0}}, 1); err != nil || got != 2 {
		t.Fatalf("got %d, %v", got, err)
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
	if err := reg.Register(leastbusy.TypeName, leastbusy.Provider); err != nil {
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
	if res.Type != leastbusy.TypeName || res.Builtin {
		t.Fatalf("the README example resolves to %+v", res)
	}
	return res
}
