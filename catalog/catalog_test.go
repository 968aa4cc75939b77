package catalog_test

import (
	"errors"
	"github.com/google/go-cmp/cmp"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
)

// leastBusy is the reference document's example policy: a minimum-device-overlap filter, an
// active-requests scorer and a lowest-cost picker, with strictly decoded parameters.
type leastBusyParams struct {
	MinDeviceOverlapBlocks *float64 `json:"min_device_overlap_blocks"`
}

type minOverlap struct{ min float64 }

func (minOverlap) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsCache }
func (f minOverlap) Keep(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
	return float64(c.Cache().DeviceOverlapBlocks()) >= f.min, nil
}

type activeRequests struct{}

func (activeRequests) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsLoad }
func (activeRequests) Score(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	return float64(c.Load().ActiveRequests()), nil
}

type lowest struct{}

func (lowest) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }
func (lowest) Pick(_ *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
	best := 0
	for i, c := range v.Candidates() {
		if c.Cost() < v.Candidates()[best].Cost() {
			best = i
		}
	}
	return best, nil
}

func leastBusyProvider(calls *int) policies.Provider {
	return func(params policies.PolicyParameters) (policies.PolicyFactory, error) {
		*calls++
		var p leastBusyParams
		if err := params.Decode(&p); err != nil {
			return nil, err
		}
		if p.MinDeviceOverlapBlocks == nil || *p.MinDeviceOverlapBlocks < 0 {
			return nil, errors.New("min_device_overlap_blocks must be a finite non-negative number")
		}
		min := *p.MinDeviceOverlapBlocks
		return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
			return policies.NewPolicyWithFilters(cfg, workerType, []policies.WorkerFilter{minOverlap{min}},
				[]policies.WorkerScorer{activeRequests{}}, lowest{})
		}, nil
	}
}

func TestRegistry(t *testing.T) {
	noop := func(policies.PolicyParameters) (policies.PolicyFactory, error) { return nil, nil }
	t.Run("a new registry always holds the built-in cost type", func(t *testing.T) {
		r := catalog.NewRegistry()
		if _, ok := r.Lookup(defaultcost.TypeName); !ok {
			t.Fatal("built-in type missing")
		}
		if got := r.Types(); len(got) != 1 || got[0] != "dynamo-default-cost-fn" {
			t.Fatalf("types %v", got)
		}
	})
	cases := []struct {
		name     string
		typeName string
		provider policies.Provider
		want     error
	}{
		{"an empty type name is rejected", "", noop, catalog.ErrEmptyTypeName},
		{"a whitespace type name is rejected", "  ", noop, catalog.ErrEmptyTypeName},
		{"the reserved name default is rejected", "default", noop, catalog.ErrReservedTypeName},
		{"a nil provider is rejected", "least-busy", nil, catalog.ErrNilProvider},
		{"the built-in type name is a duplicate", "dynamo-default-cost-fn", noop, catalog.ErrDuplicateType},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := catalog.NewRegistry().Register(tc.typeName, tc.provider)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), `"`+tc.typeName+`"`) {
				t.Fatalf("err = %v", err)
			}
		})
	}
	t.Run("registering the same custom type twice is a duplicate", func(t *testing.T) {
		r := catalog.NewRegistry()
		if err := r.Register("least-busy", noop); err != nil {
			t.Fatal(err)
		}
		if err := r.Register("least-busy", noop); !errors.Is(err, catalog.ErrDuplicateType) {
			t.Fatalf("err = %v", err)
		}
		if got := r.Types(); len(got) != 2 || got[0] != "dynamo-default-cost-fn" || got[1] != "least-busy" {
			t.Fatalf("types %v", got)
		}
	})
	t.Run("Builtins registers every compiled-in type into a fresh registry each time", func(t *testing.T) {
		a, b := catalog.Builtins(), catalog.Builtins()
		if _, ok := a.Lookup(defaultcost.TypeName); !ok {
			t.Fatal("built-in missing")
		}
		if err := a.Register("x", noop); err != nil {
			t.Fatal(err)
		}
		if _, ok := b.Lookup("x"); ok {
			t.Fatal("registries share state")
		}
		if err := catalog.Register(catalog.NewRegistry()); err != nil {
			t.Fatalf("Register into a new registry: %v", err)
		}
	})
	t.Run("Builtins holds the whole compiled-in catalog of issues 5 and 12", func(t *testing.T) {
		want := []string{"dynamo-default-cost-fn", "least-active-requests", "least-busy", "predicted-ttft", "random",
			"round-robin", "softmax-sampling", "stacked-load-cache", "subagent-group-affinity",
			"tool-result-cache-local", "two-tier-cache-aware"}
		if diff := cmp.Diff(want, catalog.Builtins().Types()); diff != "" {
			t.Fatalf("Builtins().Types() mismatch (-want +got):\n%s", diff)
		}
	})
}

const referenceYAML = `
worker_selection:
  default: least-busy
  instances:
    - name: least-busy
      type: least-busy
      parameters:
        min_device_overlap_blocks: 0
`

func TestParseConfig(t *testing.T) {
	t.Run("the reference document's example parses", func(t *testing.T) {
		c, err := catalog.ParseConfig([]byte(referenceYAML))
		if err != nil {
			t.Fatal(err)
		}
		ws := c.WorkerSelection
		if ws.Default != "least-busy" || len(ws.Instances) != 1 || ws.Instances[0].Type != "least-busy" ||
			string(ws.Instances[0].Parameters) != `{"min_device_overlap_blocks":0}` {
			t.Fatalf("%+v", ws)
		}
	})
	t.Run("the spec's one-line flow example parses", func(t *testing.T) {
		_, err := catalog.ParseConfig([]byte(`worker_selection: {default: least-busy, instances: [{name: least-busy, type: least-busy, parameters: {min_device_overlap_blocks: 0}}]}`))
		if err != nil {
			t.Fatal(err)
		}
	})
	t.Run("an empty file is an empty configuration", func(t *testing.T) {
		c, err := catalog.ParseConfig(nil)
		if err != nil || c.WorkerSelection != nil || c.PolicyClasses != nil {
			t.Fatalf("%+v %v", c, err)
		}
	})
	t.Run("omitted or null parameters are accepted", func(t *testing.T) {
		c, err := catalog.ParseConfig([]byte("worker_selection:\n  instances:\n    - {name: a, type: t}\n    - {name: b, type: t, parameters: null}\n"))
		if err != nil || len(c.WorkerSelection.Instances) != 2 {
			t.Fatalf("%v", err)
		}
	})
	t.Run("the policy-class keys parse into typed structs", func(t *testing.T) {
		c, err := catalog.ParseConfig([]byte(`
default_policy_family: interactive
uncached_isl_buckets:
  - {min_tokens: 0, bucket: small}
  - {min_tokens: 4096, bucket: large}
policy_classes:
  - name: latency
    policy_family: interactive
    cache_bucket: small
    quantum: 3
    queue_policy: wspt
    prefill_busy_threshold: 0
    prefill_busy_threshold_frac: 1.5
    busy_worker_ratio: 0.5
    request_queue_limit_per_worker: 0
    raw_isl_token_queue_limit_per_worker: 100000
    cached_token_queue_limit_per_worker: 5000
  - {name: latency-large, policy_family: interactive, cache_bucket: large, quantum: 1}
  - {name: batch, quantum: 1}
models:
  llama:
    default_policy_family: batch
    uncached_isl_buckets: [{min_tokens: 0, bucket: all}]
    policy_classes: [{name: only, policy_family: batch, cache_bucket: all, quantum: 1}]
`))
		if err != nil {
			t.Fatal(err)
		}
		pc := c.PolicyClasses[0]
		if c.DefaultPolicyFamily != "interactive" || len(c.UncachedISLBuckets) != 2 || c.UncachedISLBuckets[1].MinTokens != 4096 ||
			pc.Name != "latency" || *pc.Quantum != 3 || pc.QueuePolicy != "wspt" || *pc.PrefillBusyThreshold != 0 ||
			*pc.PrefillBusyThresholdFrac != 1.5 || *pc.BusyWorkerRatio != 0.5 || *pc.RequestQueueLimitPerWorker != 0 ||
			*pc.RawISLTokenQueueLimitPerWorker != 100000 || *pc.CachedTokenQueueLimitPerWorker != 5000 ||
			c.PolicyClasses[2].PrefillBusyThreshold != nil || c.Models["llama"].PolicyClasses[0].Name != "only" {
			t.Fatalf("%+v", c)
		}
	})
	long := strings.Repeat("a", 64)
	errCases := []struct {
		name, yaml, want string
	}{
		{"an unknown top-level key is rejected", "worker_selection: {}\nrouting: x\n", `unknown field "routing"`},
		{"an unknown worker_selection key is rejected", "worker_selection: {defaults: x}\n", `unknown field "defaults"`},
		{"an unknown instance key is rejected", "worker_selection: {instances: [{name: a, type: t, params: {}}]}\n", `unknown field "params"`},
		{"an unknown policy-class key is rejected", "policy_classes: [{name: a, quantum: 1, quantums: 2}]\n", `unknown field "quantums"`},
		{"a duplicate key is rejected", "worker_selection: {default: a}\nworker_selection: {default: b}\n", "worker_selection"},
		{"a top-level list is rejected", "- a\n- b\n", "cannot unmarshal"},
		{"malformed YAML is rejected", "worker_selection: [\n", "yaml"},
		{"a missing instance name is rejected", "worker_selection: {instances: [{type: t}]}\n", `instance name "" must match`},
		{"an instance name starting with a dash is rejected", "worker_selection: {instances: [{name: -x, type: t}]}\n", `instance name "-x" must match`},
		{"an instance name with a space is rejected", "worker_selection: {instances: [{name: 'a b', type: t}]}\n", `instance name "a b" must match`},
		{"an instance name longer than 64 characters is rejected", "worker_selection: {instances: [{name: " + long + "b, type: t}]}\n", "must match"},
		{"the instance name default is reserved", "worker_selection: {instances: [{name: default, type: t}]}\n", `"default" is reserved`},
		{"duplicate instance names are rejected", "worker_selection: {instances: [{name: a, type: t}, {name: a, type: u}]}\n", `duplicate instance name "a"`},
		{"a missing type is rejected", "worker_selection: {instances: [{name: a}]}\n", "type is required"},
		{"list parameters are rejected", "worker_selection: {instances: [{name: a, type: t, parameters: [1, 2]}]}\n", "parameters must be a mapping"},
		{"scalar parameters are rejected", "worker_selection: {instances: [{name: a, type: t, parameters: 3}]}\n", "parameters must be a mapping"},
		{"a NaN parameter is named with its line", "worker_selection:\n  instances:\n    - name: p\n      type: predicted-ttft\n      parameters: {delay_weight: 1, sticky_weight: .nan}\n",
			"worker_selection.instances[0].parameters.sticky_weight (line 5) is .nan: numbers must be finite"},
		{"an infinite policy-class value is named", "policy_classes: [{name: a, quantum: 1, prefill_busy_threshold_frac: -.Inf}]\n",
			"policy_classes[0].prefill_busy_threshold_frac (line 1) is -.Inf: numbers must be finite"},
		{"an unknown field is named even where a string field holds .nan", "worker_selection: {instances: [{name: .nan, type: t, bogus: 1}]}\n", `unknown field "bogus"`},
		{"a default naming no instance is rejected", "worker_selection: {default: b, instances: [{name: a, type: t}]}\n", `worker_selection.default "b" does not name a configured instance (configured: a)`},
	}
	for _, tc := range errCases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := catalog.ParseConfig([]byte(tc.yaml))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to contain %q", err, tc.want)
			}
		})
	}
	t.Run("a 64-character name with dots, dashes and underscores is valid", func(t *testing.T) {
		if !catalog.ValidName(long) || !catalog.ValidName("A1.b_c-d") || catalog.ValidName(long+"a") {
			t.Fatal("name rule")
		}
	})
	t.Run("default: default selects the built-in without naming an instance", func(t *testing.T) {
		if _, err := catalog.ParseConfig([]byte("worker_selection: {default: default}\n")); err != nil {
			t.Fatal(err)
		}
	})
}

func TestLoadConfigFile(t *testing.T) {
	dir := t.TempDir()
	t.Run("a file on disk parses", func(t *testing.T) {
		path := filepath.Join(dir, "worker-selection.yaml")
		if err := os.WriteFile(path, []byte(referenceYAML), 0o600); err != nil {
			t.Fatal(err)
		}
		if c, err := catalog.LoadConfigFile(path); err != nil || c.WorkerSelection.Default != "least-busy" {
			t.Fatalf("%v", err)
		}
	})
	t.Run("errors name the file", func(t *testing.T) {
		missing := filepath.Join(dir, "missing.yaml")
		if _, err := catalog.LoadConfigFile(missing); err == nil || !strings.Contains(err.Error(), missing) {
			t.Fatalf("err = %v", err)
		}
		bad := filepath.Join(dir, "bad.yaml")
		_ = os.WriteFile(bad, []byte("nope: 1\n"), 0o600)
		if _, err := catalog.LoadConfigFile(bad); err == nil || !strings.Contains(err.Error(), bad) {
			t.Fatalf("err = %v", err)
		}
	})
}

const twoInstances = `
worker_selection:
  default: fast
  instances:
    - name: fast
      type: dynamo-default-cost-fn
      parameters: {router_temperature: 0}
    - name: busy
      type: least-busy
      parameters: {min_device_overlap_blocks: 1}
`

func mustParse(t *testing.T, y string) *catalog.Config {
	t.Helper()
	c, err := catalog.ParseConfig([]byte(y))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestResolve(t *testing.T) {
	var calls int
	reg := catalog.NewRegistry()
	if err := reg.Register("least-busy", leastBusyProvider(&calls)); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name        string
		cfg         *catalog.Config
		override    string
		wantName    string
		wantType    string
		wantBuiltin bool
		wantSource  string
	}{
		{"no configuration selects the built-in policy", nil, "", "default", "dynamo-default-cost-fn", true, "built-in default"},
		{"a configuration without a default selects the built-in policy", mustParse(t, "worker_selection: {instances: [{name: a, type: least-busy, parameters: {min_device_overlap_blocks: 0}}]}"), "", "default", "dynamo-default-cost-fn", true, "built-in default"},
		{"worker_selection.default selects its instance", mustParse(t, twoInstances), "", "fast", "dynamo-default-cost-fn", false, "worker_selection.default"},
		{"the override wins over worker_selection.default", mustParse(t, twoInstances), "busy", "busy", "least-busy", false, "DYN_ROUTER_WORKER_SELECTION_POLICY"},
		{"the override default selects the built-in policy over the file's default", mustParse(t, twoInstances), "default", "default", "dynamo-default-cost-fn", true, "DYN_ROUTER_WORKER_SELECTION_POLICY"},
		{"the override default works without a configuration file", nil, " default ", "default", "dynamo-default-cost-fn", true, "DYN_ROUTER_WORKER_SELECTION_POLICY"},
		{"a blank override counts as unset", mustParse(t, twoInstances), "  ", "fast", "dynamo-default-cost-fn", false, "worker_selection.default"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			res, err := catalog.Resolve(reg, tc.cfg, tc.override)
			if err != nil {
				t.Fatal(err)
			}
			if res.Name != tc.wantName || res.Type != tc.wantType || res.Builtin != tc.wantBuiltin || res.Source != tc.wantSource || res.Factory == nil {
				t.Fatalf("%+v", res)
			}
			p, err := res.Factory(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})
			if err != nil || p.WorkerType() != "select" {
				t.Fatalf("factory: %v", err)
			}
		})
	}
	t.Run("every provider runs exactly once at resolution, selected or not", func(t *testing.T) {
		calls = 0
		res, err := catalog.Resolve(reg, mustParse(t, twoInstances), "")
		if err != nil {
			t.Fatal(err)
		}
		if calls != 1 || len(res.Instances) != 2 || res.Instances["busy"] == nil {
			t.Fatalf("least-busy provider ran %d times; instances %v", calls, res.Instances)
		}
		for i := 0; i < 3; i++ {
			if _, err := res.Instances["busy"](policies.DefaultRouterConfig(), "select", policies.PartitionID{}); err != nil {
				t.Fatal(err)
			}
		}
		if calls != 1 {
			t.Fatalf("factories re-ran the provider (%d calls)", calls)
		}
	})
	errCases := []struct {
		name     string
		yaml     string
		override string
		want     []string
	}{
		{"an unknown override names the value and the configured instances", twoInstances, "slow",
			[]string{`DYN_ROUTER_WORKER_SELECTION_POLICY="slow"`, "configured: busy, fast"}},
		{"an override naming an instance without a configuration file fails", "", "fast",
			[]string{`DYN_ROUTER_WORKER_SELECTION_POLICY="fast"`, "configured: none"}},
		{"an unknown type names the instance, the type and the registered types", "worker_selection: {instances: [{name: a, type: least-bussy}]}",
			"", []string{`worker_selection.instances[0] (name "a", type "least-bussy")`, `unknown policy type "least-bussy"`, "registered: dynamo-default-cost-fn, least-busy"}},
		{"invalid built-in parameters name the instance and the parameter", "worker_selection: {instances: [{name: a, type: dynamo-default-cost-fn, parameters: {router_temperature: -1}}]}",
			"", []string{`(name "a", type "dynamo-default-cost-fn")`, "router_temperature must be a finite number ≥ 0"}},
		{"an unknown built-in parameter is rejected by name", "worker_selection: {instances: [{name: a, type: dynamo-default-cost-fn, parameters: {temperature: 1}}]}",
			"", []string{`unknown field "temperature"`}},
		{"a bad parameter of an unselected instance still stops startup", "worker_selection: {default: a, instances: [{name: a, type: dynamo-default-cost-fn}, {name: b, type: least-busy, parameters: {min_device_overlap_blocks: -1}}]}",
			"default", []string{`(name "b", type "least-busy")`, "min_device_overlap_blocks"}},
	}
	for _, tc := range errCases {
		t.Run(tc.name, func(t *testing.T) {
			var cfg *catalog.Config
			if tc.yaml != "" {
				cfg = mustParse(t, tc.yaml)
			}
			_, err := catalog.Resolve(reg, cfg, tc.override)
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Fatalf("err = %v, want it to contain %q", err, w)
				}
			}
		})
	}
	t.Run("a panicking provider is reported as an error", func(t *testing.T) {
		r := catalog.NewRegistry()
		_ = r.Register("boom", func(policies.PolicyParameters) (policies.PolicyFactory, error) { panic("bad") })
		_, err := catalog.Resolve(r, mustParse(t, "worker_selection: {instances: [{name: a, type: boom}]}"), "")
		if err == nil || !strings.Contains(err.Error(), "provider panicked: bad") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("a nil registry resolves against the built-ins", func(t *testing.T) {
		res, err := catalog.Resolve(nil, mustParse(t, "worker_selection: {default: x, instances: [{name: x, type: dynamo-default-cost-fn}]}"), "")
		if err != nil || res.Name != "x" {
			t.Fatalf("%+v %v", res, err)
		}
	})
	t.Run("a resolved custom instance selects through its own components", func(t *testing.T) {
		res, err := catalog.Resolve(reg, mustParse(t, twoInstances), "busy")
		if err != nil {
			t.Fatal(err)
		}
		p, _ := res.Factory(policies.DefaultRouterConfig(), "select", policies.PartitionID{})
		ws := []policies.Worker{{WorkerID: 1}, {WorkerID: 2}, {WorkerID: 3}}
		src := fixedSource{device: []int{0, 2, 5}, requests: []int{0, 4, 1}}
		ctx := policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 64, BlockSize: 16, Rand: rand.New(rand.NewPCG(1, 1))})
		got, err := p.Select(ctx, ws, src)
		// Worker 1 fails min_device_overlap_blocks 1; of the rest worker 3 has fewer active requests.
		if err != nil || got.Worker.WorkerID != 3 {
			t.Fatalf("%+v %v", got, err)
		}
	})
}

type fixedSource struct{ device, requests []int }

func (s fixedSource) Cache(i int) policies.CacheInputs {
	return policies.NewCacheInputs(s.device[i], 0, 0, 0)
}
func (s fixedSource) Load(i int) policies.LoadInputs {
	return policies.NewLoadInputs(0, 0, s.requests[i])
}
func (s fixedSource) Routing(i int) policies.RoutingInputs { return policies.RoutingInputs{} }

func TestResolveWithDefault(t *testing.T) {
	reg := catalog.Builtins()
	t.Run("nothing selected: the host's default type, named after it", func(t *testing.T) {
		res, err := catalog.ResolveWithDefault(reg, nil, "", "round-robin")
		if err != nil {
			t.Fatal(err)
		}
		if res.Name != "round-robin" || res.Type != "round-robin" || res.Builtin || res.Source != catalog.SourceHostDefault || res.Factory == nil {
			t.Fatalf("%+v", res)
		}
	})
	t.Run("an explicit default still selects the built-in policy", func(t *testing.T) {
		for _, c := range []struct {
			cfg      *catalog.Config
			override string
		}{{nil, "default"}, {mustParse(t, "worker_selection: {default: default}"), ""}} {
			res, err := catalog.ResolveWithDefault(reg, c.cfg, c.override, "round-robin")
			if err != nil {
				t.Fatal(err)
			}
			if !res.Builtin || res.Type != "dynamo-default-cost-fn" {
				t.Fatalf("%+v", res)
			}
		}
	})
	t.Run("a configured default instance wins", func(t *testing.T) {
		res, err := catalog.ResolveWithDefault(reg, mustParse(t, twoInstances), "", "round-robin")
		if err != nil {
			t.Fatal(err)
		}
		if res.Name != "fast" {
			t.Fatalf("%+v", res)
		}
	})
	t.Run("an unregistered default type falls back to the built-in policy", func(t *testing.T) {
		res, err := catalog.ResolveWithDefault(catalog.NewRegistry(), nil, "", "round-robin")
		if err != nil || !res.Builtin {
			t.Fatalf("%+v, %v", res, err)
		}
	})
}
