package toolresultcachelocal_test

import (
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/toolresultcachelocal"
)

// row is one candidate's explicit inputs (blocks and tokens as named).
type row struct {
	id                  uint64
	device, host, disk  int
	prefill, decodeCost int
	activeRequests      int
}

// source is an InputSource over rows in the order given to Select.
type source []row

func (s source) Cache(i int) policies.CacheInputs {
	return policies.NewCacheInputs(s[i].device, s[i].host, s[i].disk, 0)
}
func (s source) Load(i int) policies.LoadInputs {
	return policies.NewLoadInputs(s[i].prefill, s[i].decodeCost, s[i].activeRequests)
}
func (s source) Routing(int) policies.RoutingInputs { return policies.RoutingInputs{} }

func newPolicy(t *testing.T) *policies.WorkerSelectionPolicy {
	t.Helper()
	f, err := toolresultcachelocal.Provider(policies.PolicyParameters{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := f(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func session(trigger policies.InputTrigger) *policies.SessionContext {
	return policies.NewSessionContext(policies.SessionParams{SessionID: "s1", InputTrigger: trigger})
}

// pick shuffles rows and runs Select for a 512-token request (block size 16) with prefill
// tracking and the given session; it returns the chosen worker id and its built-in cost.
func pick(t *testing.T, p *policies.WorkerSelectionPolicy, rows []row, sess *policies.SessionContext, rng *rand.Rand) (uint64, float64) {
	t.Helper()
	s := append(source(nil), rows...)
	rng.Shuffle(len(s), func(i, j int) { s[i], s[j] = s[j], s[i] })
	ws := make([]policies.Worker, len(s))
	for i, r := range s {
		ws[i] = policies.Worker{WorkerID: r.id}
	}
	ctx := policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 512, BlockSize: 16, TracksPrefillTokens: true, Session: sess, Rand: rng})
	res, err := p.Select(ctx, ws, s)
	if err != nil {
		t.Fatal(err)
	}
	return res.Worker.WorkerID, res.Cost
}

// The §9.7 worked example: A (8 device + 4 host blocks, 1024 active prefill tokens, decode cost
// 132) costs 217; B (nothing cached, decode cost 82) costs 114.
var (
	workedA = row{id: 1, device: 8, host: 4, prefill: 1024, decodeCost: 132}
	workedB = row{id: 2, decodeCost: 82}
)

func TestToolResultCacheLocalDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		name     string
		sess     *policies.SessionContext
		rows     []row
		want     uint64
		wantCost float64
	}{
		{"a tool-result turn goes to the largest device overlap even at a higher built-in cost",
			session(policies.InputTriggerToolResult), []row{workedA, workedB}, 1, 217},
		{"a user-message turn goes to the lowest built-in cost",
			session(policies.InputTriggerUserMessage), []row{workedA, workedB}, 2, 114},
		{"a turn with another trigger goes to the lowest built-in cost",
			session(policies.InputTriggerOther), []row{workedA, workedB}, 2, 114},
		{"a session without a trigger goes to the lowest built-in cost",
			session(policies.InputTriggerNone), []row{workedA, workedB}, 2, 114},
		{"a request without a session goes to the lowest built-in cost",
			nil, []row{workedA, workedB}, 2, 114},
		{"on a tool-result turn equal device overlaps go to the lower built-in cost",
			session(policies.InputTriggerToolResult),
			[]row{{id: 1, device: 4, decodeCost: 90}, {id: 2, device: 4, decodeCost: 60}, {id: 3, device: 1, decodeCost: 10}}, 2, 28 + 60},
		{"on a tool-result turn host and disk overlap do not count as device overlap",
			session(policies.InputTriggerToolResult),
			[]row{{id: 1, host: 30, disk: 2, decodeCost: 40}, {id: 2, device: 1, decodeCost: 40}}, 2, 31 + 40},
		{"a tool-result turn with nothing cached anywhere goes to the lowest built-in cost",
			session(policies.InputTriggerToolResult),
			[]row{{id: 1, prefill: 320, decodeCost: 10}, {id: 2, decodeCost: 20}}, 2, 32 + 20},
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
		rows := []row{{id: 1, device: 3, decodeCost: 5}, {id: 2, device: 3, decodeCost: 5}, {id: 3, device: 2, decodeCost: 0}}
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
	pick(t, p, []row{workedA, workedB}, session(policies.InputTriggerToolResult), rand.New(rand.NewPCG(1, 1)))
	if st := p.Stats(); st.CacheComputed != 2 || st.LoadComputed != 2 || st.RoutingComputed != 2 {
		t.Fatalf("each group must be computed once per candidate: %+v", st)
	}
}

func TestToolResultCacheLocalConfiguration(t *testing.T) {
	t.Run("an unknown parameter is rejected by name", func(t *testing.T) {
		raw, _ := policies.NewPolicyParameters([]byte(`{"trigger": "tool_result"}`))
		if _, err := toolresultcachelocal.Provider(raw); err == nil || !strings.Contains(err.Error(), `unknown field "trigger"`) || !strings.Contains(err.Error(), toolresultcachelocal.TypeName) {
			t.Fatalf("err = %v", err)
		}
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
	if err := reg.Register(toolresultcachelocal.TypeName, toolresultcachelocal.Provider); err != nil {
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
	if res.Type != toolresultcachelocal.TypeName || res.Builtin {
		t.Fatalf("the README example resolves to %+v", res)
	}
	return res
}
