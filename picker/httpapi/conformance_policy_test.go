package httpapi_test

import (
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
	"github.com/kvepp/kvepp/policies/policytest"
)

// Conformance suite, selection-service.md §20 items 56-68 (pending-selection cache, errors and
// startup, selector and policies).

func TestAcceptance56PendingSelectionCache(t *testing.T) {
	// The cache's own rules are unit-tested in ledger.TestPendingCache; over HTTP: the TTL, the
	// latest-wins replacement and single use.
	e := newEnv(t, func(c *picker.Config) { c.SelectionCache.TTL = 10e9 })
	e.worker(1, `,"data_parallel_size":2`)
	e.ok(200, "POST", "/select", `{"selection_id":"p","model_name":"model","pinned_worker":{"worker_id":1,"dp_rank":0},`+prompt+`}`)
	e.ok(200, "POST", "/select", `{"selection_id":"p","model_name":"model","pinned_worker":{"worker_id":1,"dp_rank":1},`+prompt+`}`)
	r := obj(t, e.ok(201, "POST", "/reservations", `{"selection_id":"p","model_name":"model"}`))
	if r["dp_rank"] != 1.0 {
		t.Fatalf("latest select did not win: %v", r)
	}
	// /select_and_reserve neither reads nor consumes the cache.
	e.ok(200, "POST", "/select", `{"selection_id":"s","model_name":"model",`+prompt+`}`)
	e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"s","model_name":"model",`+prompt+`}`)
	e.ok(200, "DELETE", "/reservations/s", "")
	e.ok(201, "POST", "/reservations", `{"selection_id":"s","model_name":"model"}`)
	e.ok(200, "POST", "/select", `{"selection_id":"q","model_name":"model",`+prompt+`}`)
	e.clock.Advance(10e9)
	e.fails(404, "no pending selection q", "POST", "/reservations", `{"selection_id":"q","model_name":"model"}`)
}

func TestAcceptance57PolicyFilteredCandidatesAre503(t *testing.T) {
	var scored sync.Map
	reject := policytest.Filter{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (bool, error) { return false, nil }}
	score := policytest.Scorer{In: policies.InputsCache | policies.InputsLoad, Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
		scored.Store(c.Worker().WorkerID, true)
		return 0, nil
	}}
	e := newEnv(t, withFactory(func(cfg policies.RouterConfig, wt string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return policies.NewPolicyWithFilters(cfg, wt, []policies.WorkerFilter{reject}, []policies.WorkerScorer{score}, firstRow)
	}))
	e.worker(1, "")
	for _, route := range []string{"/select", "/select_and_reserve"} {
		msg := e.fails(503, "all eligible workers were rejected by policy filters", "POST", route, `{"model_name":"model",`+prompt+`}`)
		if msg != "all eligible workers were rejected by policy filters" {
			t.Errorf("message %q", msg)
		}
	}
	scored.Range(func(k, _ any) bool { t.Errorf("scorer ran for filtered worker %v", k); return true })
	e.wantLoad(1, 0, 0, 0, 0)
}

func TestAcceptance59StartupValidation(t *testing.T) {
	cfg := picker.DefaultConfig()
	cfg.Router.UseKVEvents = false
	cfg.Router.RouterTemperature = -1
	if _, err := picker.New(cfg); err == nil || !strings.HasPrefix(err.Error(), "invalid KV router configuration: ") {
		t.Fatalf("temperature -1: %v", err)
	}
	t.Run("replica sockets and recovery waiting", func(t *testing.T) {
		t.Skip("replica sockets arrive with ledger/replica; recovery submission is runner/selectservice TestRunRecoversTheIndexFromAPeer")
	})
}

func TestAcceptance60ReplicaEnvelope(t *testing.T) {
	t.Skip("replica sync arrives with ledger/replica (selection-service.md §15)")
}

func TestAcceptance61SoftmaxOrdersExtremeCosts(t *testing.T) {
	costs := []float64{-math.MaxFloat64 / 2, 0, math.MaxFloat64 / 2}
	probs := defaultcost.SoftmaxProbabilities(costs, 1, nil)
	for i, p := range probs {
		if math.IsNaN(p) || p < 0 || p > 1 {
			t.Fatalf("probability %d = %v", i, p)
		}
	}
	if !(probs[0] > probs[1] && probs[1] > probs[2]) {
		t.Fatalf("probabilities %v not ordered by cost", probs)
	}
	r := rand.New(rand.NewPCG(1, 2))
	counts := make([]int, 3)
	for i := 0; i < 2000; i++ {
		counts[defaultcost.PickSoftmax(r, costs, 1)]++
	}
	if counts[0] <= counts[1] || counts[0] <= counts[2] {
		t.Fatalf("lowest cost not most likely: %v", counts)
	}
}

func TestAcceptance62ZeroTemperatureTiesAreRandom(t *testing.T) {
	e := newEnv(t)
	for id := 1; id <= 3; id++ {
		e.worker(id, "")
	}
	seen := map[float64]int{}
	for i := 0; i < 150; i++ {
		seen[obj(t, e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`}`))["worker_id"].(float64)]++
	}
	if len(seen) != 3 {
		t.Fatalf("tied workers chosen %v, want all three", seen)
	}
}

func TestAcceptance63RequestOverridesChangeTheSelection(t *testing.T) {
	e := newEnv(t, kvEvents)
	e.worker(1, `,"kv_events_endpoint":"tcp://w1:1"`)
	e.worker(2, `,"kv_events_endpoint":"tcp://w2:1"`)
	e.ev.Store(t, 1, 0, kvindex.TierDevice, nil, local(32, 4)...)
	// Worker 1 holds the whole prompt but carries 100 prefill tokens: cost 33 - 8 + 8 = 33 vs 16.
	e.ok(201, "POST", "/reservations", `{"selection_id":"bg","model_name":"model","worker_id":1,"sequence_hashes":[],"isl_tokens":100,"effective_prefill_tokens":100}`)
	sel := func(override string) float64 {
		return obj(t, e.ok(200, "POST", "/select", `{"model_name":"model",`+tokJSON(32)+`,"router_config_override":`+override+`}`))["worker_id"].(float64)
	}
	if w := sel(`{}`); w != 2 {
		t.Fatalf("default choice %v, want 2", w)
	}
	if w := sel(`{"overlap_score_credit":10}`); w != 1 {
		t.Fatalf("with credit 10: %v, want 1", w)
	}
	sel(`{"overlap_score_weight":0}`) // deprecated field accepted (scale 0, credit 0: a tie)
	seen := map[float64]bool{}
	for i := 0; i < 60; i++ {
		seen[sel(`{"router_temperature":1000}`)] = true
	}
	if len(seen) != 2 {
		t.Fatalf("a high temperature never chose the dearer worker: %v", seen)
	}
	e.fails(422, "router_config_override.router_temperature", "POST", "/select", `{"model_name":"model",`+prompt+`,"router_config_override":{"router_temperature":-1}}`)
	e.fails(422, "shared_cache_multiplier", "POST", "/select", `{"model_name":"model",`+prompt+`,"router_config_override":{"shared_cache_multiplier":2}}`)
	e.fails(422, "overlap_score_credit", "POST", "/select", `{"model_name":"model",`+prompt+`,"router_config_override":{"overlap_score_credit":"x"}}`)
}

// capturing wraps the built-in factory and keeps the policy instances it builds.
type capturing struct {
	mu   sync.Mutex
	pols []*policies.WorkerSelectionPolicy
}

func (c *capturing) factory(cfg policies.RouterConfig, wt string, p policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
	pol, err := defaultcost.Builtin()(cfg, wt, p)
	c.mu.Lock()
	c.pols = append(c.pols, pol)
	c.mu.Unlock()
	return pol, err
}

func TestAcceptance64MinActivePrefillOnlyWithDecay(t *testing.T) {
	for _, decay := range []float64{0, 1} {
		c := &capturing{}
		e := newEnv(t, withFactory(c.factory), func(cfg *picker.Config) { cfg.Router.OverlapScoreCreditDecay = decay })
		e.worker(1, "")
		e.worker(2, "")
		for i := 0; i < 5; i++ {
			e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`}`)
		}
		n := c.pols[0].Stats().MinActivePrefillComputations
		if (decay == 0) != (n == 0) {
			t.Errorf("decay %v: %d minimum computations", decay, n)
		}
	}
}

func TestAcceptance65BuiltInThroughThePolicyInterfaces(t *testing.T) {
	direct := newEnv(t)
	viaAPI := newEnv(t, withFactory(defaultcost.Builtin()))
	for _, e := range []*env{direct, viaAPI} {
		for id := 1; id <= 4; id++ {
			e.worker(id, `,"data_parallel_size":2`)
		}
	}
	for i := 0; i < 40; i++ {
		body := f(`{"model_name":"model",%s,"router_config_override":{"router_temperature":%v}}`, tokJSON(4+i%9), float64(i%3)/2)
		a := obj(t, direct.ok(200, "POST", "/select_and_reserve", body))
		b := obj(t, viaAPI.ok(200, "POST", "/select_and_reserve", body))
		for _, k := range []string{"worker_id", "dp_rank", "effective_prefill_tokens", "potential_decode_blocks"} {
			if a[k] != b[k] {
				t.Fatalf("request %d: %s %v (direct) vs %v (policy interfaces)", i, k, a[k], b[k])
			}
		}
	}
}

func TestAcceptance66CustomPolicyInputs(t *testing.T) {
	type seen struct {
		cache [3]int
		min   int
	}
	var mu sync.Mutex
	got := map[uint64]seen{}
	pk := policytest.Picker{In: policies.InputsCache, Fn: func(ctx *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		for i, c := range v.Candidates() {
			ch := v.Cache(i)
			got[c.Worker().WorkerID] = seen{cache: [3]int{ch.DeviceOverlapBlocks(), ch.HostOverlapBlocks(), ch.DiskOverlapBlocks()}, min: ctx.MinActivePrefillTokens()}
		}
		return 0, nil
	}}
	dropThree := policytest.Filter{Fn: func(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
		return c.Worker().WorkerID != 3, nil
	}}
	e := newEnv(t, kvEvents, func(c *picker.Config) {
		c.Router.OverlapScoreCreditDecay = 1
		c.Router.HostCacheHitWeight = 0.5
		c.Policy = func(cfg policies.RouterConfig, wt string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
			return policies.NewPolicyWithFilters(cfg, wt, []policies.WorkerFilter{dropThree}, nil, pk)
		}
	})
	for id := 1; id <= 3; id++ {
		e.worker(id, f(`,"kv_events_endpoint":"tcp://w%d:1"`, id))
	}
	h := local(12, 4)
	e.ev.Store(t, 1, 0, kvindex.TierDevice, nil, h[:2]...)
	parent := h[1] + 1
	e.ev.Store(t, 1, 0, kvindex.TierHostPinned, &parent, h[2])
	e.ev.Store(t, 2, 0, kvindex.TierDisk, nil, h[:1]...)
	e.ok(201, "POST", "/reservations", `{"selection_id":"a","model_name":"model","worker_id":1,"sequence_hashes":[],"isl_tokens":200,"effective_prefill_tokens":200}`)
	e.ok(201, "POST", "/reservations", `{"selection_id":"b","model_name":"model","worker_id":2,"sequence_hashes":[],"isl_tokens":300,"effective_prefill_tokens":300}`)
	e.ok(200, "POST", "/select", `{"model_name":"model",`+tokJSON(12)+`}`)
	// Raw tier counts (never the weighted estimate); the idle worker 3 was filtered out, so the
	// minimum active prefill is recomputed over workers 1 and 2 (200), not 0.
	want := map[uint64]seen{1: {cache: [3]int{2, 1, 0}, min: 200}, 2: {cache: [3]int{0, 0, 1}, min: 200}}
	if len(got) != 2 || got[1] != want[1] || got[2] != want[2] {
		t.Fatalf("picker saw %+v, want %+v", got, want)
	}
}

// Items 48, 67 and 68 are in conformance_queue_test.go.
