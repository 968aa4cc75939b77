package catalog_test

import (
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/picker/queue"
)

// classYAML is a valid root profile: families interactive and batch over buckets warm (0) and
// cold (2048), plus the explicit class latency; and a model profile for llama.
const classYAML = `
default_policy_family: batch
uncached_isl_buckets:
  - {min_tokens: 0, bucket: warm}
  - {min_tokens: 2048, bucket: cold}
policy_classes:
  - {name: i-warm, policy_family: interactive, cache_bucket: warm, quantum: 4, queue_policy: wspt}
  - {name: i-cold, policy_family: interactive, cache_bucket: cold, quantum: 2}
  - {name: b-warm, policy_family: batch, cache_bucket: warm, quantum: 1, prefill_busy_threshold: 100}
  - {name: b-cold, policy_family: batch, cache_bucket: cold, quantum: 1, busy_worker_ratio: 0.5}
  - {name: latency, quantum: 8, prefill_busy_threshold: 0, request_queue_limit_per_worker: 0,
     raw_isl_token_queue_limit_per_worker: 4096, cached_token_queue_limit_per_worker: 2048}
models:
  llama:
    default_policy_family: only
    uncached_isl_buckets: [{min_tokens: 0, bucket: all}]
    policy_classes: [{name: only-all, policy_family: only, cache_bucket: all, quantum: 1, queue_policy: lcfs}]
`

func TestQueueProfiles(t *testing.T) {
	t.Run("a valid file yields the root and model profiles", func(t *testing.T) {
		c, err := catalog.ParseConfig([]byte(classYAML))
		if err != nil {
			t.Fatal(err)
		}
		ps, err := c.QueueProfiles()
		if err != nil {
			t.Fatal(err)
		}
		root := ps.Root
		if root.NumClasses() != 5 || ps.For("llama") == root || ps.For("mistral") != root {
			t.Fatalf("profiles %+v", ps)
		}
		if got := root.Class(root.Resolve("interactive", 10)); got.Name != "i-warm" || got.Policy != queue.WSPT || got.Quantum != 4 {
			t.Fatalf("interactive warm = %+v", got)
		}
		if got := root.Class(root.Resolve("", 4000)).Name; got != "b-cold" {
			t.Fatalf("default family cold = %s", got)
		}
		lat := root.Class(root.Resolve("latency", 0))
		if lat.Name != "latency" || *lat.BusyThreshold != 0 || *lat.RequestLimitPerWorker != 0 ||
			*lat.RawISLTokenLimitPerWorker != 4096 || *lat.CachedTokenLimitPerWorker != 2048 || lat.BusyThresholdFrac != nil {
			t.Fatalf("latency = %+v", lat)
		}
		if c := root.Class(0); *c.BusyThresholdFrac != 16 {
			t.Fatalf("a class without thresholds must use fraction 16, got %+v", c)
		}
		if m := ps.For("llama"); m.NumClasses() != 1 || m.Class(0).Policy != queue.LCFS {
			t.Fatalf("llama = %+v", m.Class(0))
		}
	})
	t.Run("a file without policy classes has no profiles", func(t *testing.T) {
		c, err := catalog.ParseConfig([]byte("worker_selection: {default: default}\n"))
		if err != nil {
			t.Fatal(err)
		}
		if ps, err := c.QueueProfiles(); ps != nil || err != nil {
			t.Fatalf("%v %v", ps, err)
		}
	})
	t.Run("a file with only model profiles has no root profile", func(t *testing.T) {
		c, err := catalog.ParseConfig([]byte(`models: {m: {default_policy_family: f, uncached_isl_buckets: [{min_tokens: 0, bucket: b}], policy_classes: [{name: c, policy_family: f, cache_bucket: b, quantum: 1}]}}`))
		if err != nil {
			t.Fatal(err)
		}
		ps, _ := c.QueueProfiles()
		if ps.Root != nil || ps.For("m") == nil || ps.For("other") != nil {
			t.Fatalf("%+v", ps)
		}
	})

	// base is a one-class root profile; each case replaces the class or the bucket list.
	base := func(class, buckets string) string {
		if buckets == "" {
			buckets = "[{min_tokens: 0, bucket: all}]"
		}
		return "default_policy_family: f\nuncached_isl_buckets: " + buckets + "\npolicy_classes:\n  - " + class + "\n"
	}
	ok := "{name: c, policy_family: f, cache_bucket: all, quantum: 1}"
	cases := []struct {
		name, yaml, want string
	}{
		{"a class name breaking the identifier rule", base("{name: 'bad name', policy_family: f, cache_bucket: all, quantum: 1}", ""),
			`policy_classes[0].name "bad name" must match`},
		{"a family breaking the identifier rule", base("{name: c, policy_family: -f, cache_bucket: all, quantum: 1}", ""),
			`policy_classes[0] ("c").policy_family "-f" must match`},
		{"a bucket breaking the identifier rule", base(ok, "[{min_tokens: 0, bucket: 'a/b'}]"), `uncached_isl_buckets[0].bucket "a/b" must match`},
		{"a default family breaking the identifier rule", strings.Replace(base(ok, ""), "default_policy_family: f", "default_policy_family: '.f'", 1),
			`default_policy_family ".f" must match`},
		{"a missing quantum", base("{name: c, policy_family: f, cache_bucket: all}", ""), `policy_classes[0] ("c").quantum is required`},
		{"a zero quantum", base("{name: c, policy_family: f, cache_bucket: all, quantum: 0}", ""), `policy_classes[0] ("c").quantum must be an integer >= 1, got 0`},
		{"a fractional quantum", base("{name: c, policy_family: f, cache_bucket: all, quantum: 1.5}", ""), "quantum"},
		{"an unknown queue policy", base("{name: c, policy_family: f, cache_bucket: all, quantum: 1, queue_policy: fifo}", ""),
			`policy_classes[0] ("c").queue_policy: queue policy "fifo" must be fcfs, lcfs or wspt`},
		{"a negative request limit", base("{name: c, policy_family: f, cache_bucket: all, quantum: 1, request_queue_limit_per_worker: -1}", ""),
			`request_queue_limit_per_worker must be >= 0, got -1`},
		{"a negative busy threshold", base("{name: c, policy_family: f, cache_bucket: all, quantum: 1, prefill_busy_threshold: -2}", ""),
			`policy_classes[0] ("c").prefill_busy_threshold must be a finite number >= 0`},
		{"a busy_worker_ratio above one", base("{name: c, policy_family: f, cache_bucket: all, quantum: 1, busy_worker_ratio: 16}", ""),
			`policy_classes[0] ("c").busy_worker_ratio must be in (0, 1]`},
		{"a class with only policy_family", base("{name: c, policy_family: f, quantum: 1}", ""), "must set both policy_family and cache_bucket"},
		{"a class with only cache_bucket", base("{name: c, cache_bucket: all, quantum: 1}", ""), "must set both policy_family and cache_bucket"},
		{"a negative floor", base(ok, "[{min_tokens: -1, bucket: all}]"), "uncached_isl_buckets[0].min_tokens must be >= 0, got -1"},
		{"floors that do not start at 0", base(ok, "[{min_tokens: 1, bucket: all}]"), "uncached_isl_buckets[0].min_tokens must be 0"},
		{"floors that do not strictly increase", base(ok, "[{min_tokens: 0, bucket: all}, {min_tokens: 0, bucket: b}]"),
			"uncached_isl_buckets[1].min_tokens 0 must be greater than the previous floor 0"},
		{"a family missing a bucket", base(ok, "[{min_tokens: 0, bucket: all}, {min_tokens: 9, bucket: b}]"), `policy family "f" has no class for bucket "b"`},
		{"duplicate class names", base(ok+"\n  - {name: c, quantum: 1}", ""), `duplicate class name "c"`},
		{"two classes for one family and bucket", base(ok+"\n  - {name: d, policy_family: f, cache_bucket: all, quantum: 1}", ""),
			`family "f" already has class "c" for bucket "all"`},
		{"an unknown cache bucket", base("{name: c, policy_family: f, cache_bucket: nope, quantum: 1}", ""), `cache_bucket "nope" is not one of uncached_isl_buckets`},
		{"a default family that names no family", strings.Replace(base(ok, ""), "default_policy_family: f", "default_policy_family: g", 1),
			`default_policy_family "g" does not name a policy family`},
		{"only explicit classes", "default_policy_family: f\nuncached_isl_buckets: [{min_tokens: 0, bucket: all}]\npolicy_classes: [{name: x, quantum: 1}]\n",
			`default_policy_family "f" does not name a policy family`},
		{"policy classes without buckets", "default_policy_family: f\npolicy_classes: [" + ok + "]\n", "uncached_isl_buckets must not be empty"},
		{"buckets without policy classes", "default_policy_family: f\nuncached_isl_buckets: [{min_tokens: 0, bucket: all}]\n", "policy_classes must not be empty"},
		{"an invalid model profile names the model", "models: {llama: {default_policy_family: f, uncached_isl_buckets: [{min_tokens: 0, bucket: all}], policy_classes: [{name: c, quantum: 0, policy_family: f, cache_bucket: all}]}}\n",
			`models["llama"]: policy_classes[0] ("c").quantum must be an integer >= 1`},
		{"an empty model name", "models: {'': {default_policy_family: f}}\n", "a model name must not be empty"},
		{"an unknown key inside a model profile", "models: {m: {default_policy_family: f, policies: []}}\n", `unknown field "policies"`},
	}
	for _, tc := range cases {
		t.Run("rejects "+tc.name, func(t *testing.T) {
			_, err := catalog.ParseConfig([]byte(tc.yaml))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to contain %q", err, tc.want)
			}
		})
	}
}
