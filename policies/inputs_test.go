package policies_test

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/policies"
)

func TestWorkerInputs(t *testing.T) {
	cases := []struct {
		name string
		in   policies.WorkerInputs
		want string
	}{
		{"none renders as NONE", policies.InputsNone, "NONE"},
		{"groups combine with | and render in CACHE, LOAD, ROUTING order", policies.InputsRouting | policies.InputsCache, "CACHE|ROUTING"},
		{"all groups render together", policies.InputsAll, "CACHE|LOAD|ROUTING"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.in.String(); got != tc.want {
				t.Fatalf("String() = %q, want %q", got, tc.want)
			}
		})
	}
	t.Run("Has requires every group", func(t *testing.T) {
		m := policies.InputsCache | policies.InputsLoad
		if !m.Has(policies.InputsCache) || !m.Has(policies.InputsCache|policies.InputsLoad) || m.Has(policies.InputsRouting|policies.InputsCache) {
			t.Fatal("Has is wrong")
		}
	})
}

func TestCandidateAccessors(t *testing.T) {
	w := policies.Worker{WorkerID: 7, DPRank: 3}
	c := policies.NewWorkerCandidate(w, policies.InputsCache|policies.InputsLoad,
		policies.NewCacheInputs(2, 3, 4, 0), policies.NewLoadInputs(100, 40, 5), policies.NewRoutingInputs(0.5, true))
	t.Run("declared groups expose the raw values", func(t *testing.T) {
		if c.Worker() != w || c.Cache().DeviceOverlapBlocks() != 2 || c.Cache().HostOverlapBlocks() != 3 ||
			c.Cache().DiskOverlapBlocks() != 4 || c.Cache().SharedBeyondDeviceBlocks() != 0 ||
			c.Load().ActivePrefillTokens() != 100 || c.Load().DecodeCostBlocks() != 40 || c.Load().ActiveRequests() != 5 {
			t.Fatal("accessor mismatch")
		}
	})
	t.Run("an undeclared group reads as nil", func(t *testing.T) {
		if c.Routing() != nil {
			t.Fatal("routing should be nil")
		}
	})
	t.Run("an absent taint multiplier reads as not present", func(t *testing.T) {
		r := policies.NewRoutingInputs(0.7, false)
		if m, ok := r.PreferredTaintMultiplier(); ok || m != 0 {
			t.Fatalf("got %v %v", m, ok)
		}
		r = policies.NewRoutingInputs(0.7, true)
		if m, ok := r.PreferredTaintMultiplier(); !ok || m != 0.7 {
			t.Fatalf("got %v %v", m, ok)
		}
	})
	t.Run("worker renders with worker id and dp_rank", func(t *testing.T) {
		if w.String() != "worker 7 dp_rank 3" {
			t.Fatal(w.String())
		}
	})
}

func TestWorkerInputView(t *testing.T) {
	rows := []policies.ScoredWorkerCandidate{
		policies.NewScoredWorkerCandidate(policies.Worker{WorkerID: 1}, 3),
		policies.NewScoredWorkerCandidate(policies.Worker{WorkerID: 2}, 1),
	}
	t.Run("columns of declared groups must be index-aligned", func(t *testing.T) {
		_, err := policies.NewWorkerInputView(rows, policies.InputsLoad, nil, []policies.LoadInputs{{}}, nil)
		if err == nil || !strings.Contains(err.Error(), "load column has 1 rows, want 2") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("undeclared columns are ignored and read as nil", func(t *testing.T) {
		v, err := policies.NewWorkerInputView(rows, policies.InputsCache,
			[]policies.CacheInputs{policies.NewCacheInputs(1, 0, 0, 0), policies.NewCacheInputs(9, 0, 0, 0)}, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if v.Len() != 2 || v.Cache(1).DeviceOverlapBlocks() != 9 || v.Load(0) != nil || v.Routing(0) != nil || v.Cache(2) != nil {
			t.Fatal("view mismatch")
		}
		if v.Candidates()[1].Cost() != 1 || v.Candidates()[1].Worker().WorkerID != 2 {
			t.Fatal("rows mismatch")
		}
	})
}

func TestSelectionContext(t *testing.T) {
	eot := uint32(256)
	temp := 0.7
	credit := 0.5
	sess := policies.NewSessionContext(policies.SessionParams{
		SessionID: "s1", ParentSessionID: "p1", SessionFinal: true, KVHints: policies.NewKVHints(true),
		InputTrigger: policies.InputTriggerToolResult, AgentHeaders: map[string][]string{"x-agent": {"a", "b"}},
	})
	ctx := policies.NewWorkerSelectionContext(policies.ContextParams{
		ISLTokens: 33, BlockSize: 16, TracksPrefillTokens: true, Session: sess, ExpectedOutputTokens: &eot,
		PriorityJump: -2, StrictPriority: 4, RouterTemperatureOverride: &temp, OverlapScoreCreditOverride: &credit,
	})
	t.Run("request blocks are ceil(isl/bs)", func(t *testing.T) {
		if ctx.RequestBlocks() != 3 || ctx.BlockSize() != 16 || ctx.ISLTokens() != 33 || !ctx.TracksPrefillTokens() {
			t.Fatal("size accessors")
		}
	})
	t.Run("request blocks are zero for a zero block size instead of dividing by zero", func(t *testing.T) {
		if policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 10}).RequestBlocks() != 0 {
			t.Fatal("want 0")
		}
	})
	t.Run("optional values report presence", func(t *testing.T) {
		if v, ok := ctx.ExpectedOutputTokens(); !ok || v != 256 {
			t.Fatal("expected output tokens")
		}
		if v, ok := ctx.RouterTemperatureOverride(); !ok || v != 0.7 {
			t.Fatal("temperature")
		}
		if v, ok := ctx.OverlapScoreCreditOverride(); !ok || v != 0.5 {
			t.Fatal("credit")
		}
		if _, ok := ctx.PrefillLoadScaleOverride(); ok {
			t.Fatal("scale should be absent")
		}
		empty := policies.NewWorkerSelectionContext(policies.ContextParams{})
		if _, ok := empty.ExpectedOutputTokens(); ok {
			t.Fatal("absent expected output tokens reported present")
		}
		if empty.SessionContext() != nil {
			t.Fatal("absent session should be nil")
		}
	})
	t.Run("priorities are passed through raw", func(t *testing.T) {
		if ctx.PriorityJump() != -2 || ctx.StrictPriority() != 4 {
			t.Fatal("priorities")
		}
	})
	t.Run("the session context exposes every field", func(t *testing.T) {
		s := ctx.SessionContext()
		if s.SessionID() != "s1" || s.ParentSessionID() != "p1" || !s.SessionFinal() || !s.KVHints().EvictSession() ||
			s.InputTrigger() != policies.InputTriggerToolResult || s.AgentHeaders()["x-agent"][1] != "b" {
			t.Fatal("session accessors")
		}
	})
	t.Run("a legacy session id maps to a context with only the id", func(t *testing.T) {
		s := policies.NewSessionContext(policies.SessionParams{SessionID: "legacy"})
		if s.SessionID() != "legacy" || s.ParentSessionID() != "" || s.SessionFinal() || s.KVHints() != nil ||
			s.KVHints().EvictSession() || s.InputTrigger() != policies.InputTriggerNone || s.AgentHeaders() != nil {
			t.Fatal("legacy mapping")
		}
	})
	t.Run("Rand is never nil and a supplied source is used", func(t *testing.T) {
		if policies.NewWorkerSelectionContext(policies.ContextParams{}).Rand() == nil {
			t.Fatal("nil Rand")
		}
		r := rand.New(rand.NewPCG(1, 1))
		if policies.NewWorkerSelectionContext(policies.ContextParams{Rand: r}).Rand() != r {
			t.Fatal("supplied Rand not used")
		}
	})
	t.Run("Reset replaces every value", func(t *testing.T) {
		c := policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 64, BlockSize: 16})
		c.Reset(policies.ContextParams{ISLTokens: 1, BlockSize: 16})
		if c.RequestBlocks() != 1 {
			t.Fatal("Reset kept old values")
		}
	})
}

func TestInputTrigger(t *testing.T) {
	for _, tc := range []struct {
		wire string
		want policies.InputTrigger
	}{{"", policies.InputTriggerNone}, {"user_message", policies.InputTriggerUserMessage}, {"tool_result", policies.InputTriggerToolResult}, {"other", policies.InputTriggerOther}} {
		t.Run("wire value "+tc.wire+" parses and renders back", func(t *testing.T) {
			got, err := policies.ParseInputTrigger(tc.wire)
			if err != nil || got != tc.want || got.String() != tc.wire {
				t.Fatalf("got %v %v", got, err)
			}
		})
	}
	t.Run("an unknown wire value is an error naming it", func(t *testing.T) {
		if _, err := policies.ParseInputTrigger("assistant"); err == nil || !strings.Contains(err.Error(), `"assistant"`) {
			t.Fatalf("err = %v", err)
		}
	})
}

func TestRouterConfig(t *testing.T) {
	t.Run("the defaults are the documented ones and valid", func(t *testing.T) {
		c := policies.DefaultRouterConfig()
		if c.OverlapScoreCredit != 1 || c.PrefillLoadScale != 1 || c.HostCacheHitWeight != 0.75 || c.DiskCacheHitWeight != 0.25 ||
			c.RouterTemperature != 0 || c.OverlapScoreCreditDecay != 0 || c.DecodeActiveRequestWeight != 0 || c.SharedCacheMultiplier != 0 {
			t.Fatalf("%+v", c)
		}
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
	})
	for _, tc := range []struct {
		name  string
		mut   func(*policies.RouterConfig)
		field string
	}{
		{"a negative temperature is rejected by name", func(c *policies.RouterConfig) { c.RouterTemperature = -1 }, "router_temperature"},
		{"a NaN credit is rejected by name", func(c *policies.RouterConfig) { c.OverlapScoreCredit = math.NaN() }, "overlap_score_credit"},
		{"an infinite disk weight is rejected by name", func(c *policies.RouterConfig) { c.DiskCacheHitWeight = math.Inf(1) }, "disk_cache_hit_weight"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := policies.DefaultRouterConfig()
			tc.mut(&c)
			if err := c.Validate(); err == nil || !strings.HasPrefix(err.Error(), tc.field+" ") {
				t.Fatalf("err = %v", err)
			}
		})
	}
	t.Run("a partition renders as model:group", func(t *testing.T) {
		if (policies.PartitionID{ModelName: "m", RoutingGroup: "g"}).String() != "m:g" {
			t.Fatal("partition string")
		}
	})
}

func TestPolicyParameters(t *testing.T) {
	type params struct {
		MinBlocks *float64 `json:"min_device_overlap_blocks"`
		Name      string   `json:"name"`
	}
	t.Run("empty input and null are the empty mapping", func(t *testing.T) {
		for _, raw := range []string{"", "  ", "null"} {
			p, err := policies.NewPolicyParameters([]byte(raw))
			if err != nil || string(p.Raw()) != "{}" {
				t.Fatalf("%q: %v %s", raw, err, p.Raw())
			}
			var v params
			if err := p.Decode(&v); err != nil || v.MinBlocks != nil {
				t.Fatalf("%q: decode %v", raw, err)
			}
		}
	})
	t.Run("anything but a mapping is rejected", func(t *testing.T) {
		for _, raw := range []string{"[1]", "3", `"x"`, "{", "{} {}"} {
			if _, err := policies.NewPolicyParameters([]byte(raw)); err == nil || !strings.Contains(err.Error(), "must be a mapping") {
				t.Fatalf("%q: err = %v", raw, err)
			}
		}
	})
	t.Run("decoding is strict: an unknown field is an error naming it", func(t *testing.T) {
		p, _ := policies.NewPolicyParameters([]byte(`{"min_device_overlap_blocks": 2, "typo": 1}`))
		var v params
		if err := p.Decode(&v); err == nil || !strings.Contains(err.Error(), `"typo"`) {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("a type mismatch is an error naming the field", func(t *testing.T) {
		p, _ := policies.NewPolicyParameters([]byte(`{"min_device_overlap_blocks": "two"}`))
		var v params
		if err := p.Decode(&v); err == nil || !strings.Contains(err.Error(), "min_device_overlap_blocks") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("known fields decode", func(t *testing.T) {
		p, _ := policies.NewPolicyParameters([]byte(`{"min_device_overlap_blocks": 2.5, "name": "x"}`))
		var v params
		if err := p.Decode(&v); err != nil || *v.MinBlocks != 2.5 || v.Name != "x" {
			t.Fatalf("%+v %v", v, err)
		}
	})
	t.Run("the zero value decodes as the empty mapping", func(t *testing.T) {
		var v params
		if err := (policies.PolicyParameters{}).Decode(&v); err != nil {
			t.Fatal(err)
		}
	})
}
