package queue_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/picker/queue"
)

// twoByTwo is a profile with families interactive and batch over buckets small (0) and large
// (4096), plus the explicit class latency.
func twoByTwo(t *testing.T) *queue.Profile {
	t.Helper()
	p, err := queue.NewProfile(queue.ProfileSpec{
		DefaultFamily: "batch",
		Buckets:       []queue.Bucket{{Name: "small", MinTokens: 0}, {Name: "large", MinTokens: 4096}},
		Classes: []queue.Class{
			{Name: "i-small", Family: "interactive", Bucket: "small", Quantum: 1},
			{Name: "i-large", Family: "interactive", Bucket: "large", Quantum: 1},
			{Name: "b-small", Family: "batch", Bucket: "small", Quantum: 1, Policy: queue.WSPT},
			{Name: "b-large", Family: "batch", Bucket: "large", Quantum: 1},
			{Name: "latency", Quantum: 1, BusyThreshold: f64(0)},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestProfileResolve(t *testing.T) {
	p := twoByTwo(t)
	cases := []struct {
		name      string
		requested string
		uncached  uint64
		want      string
	}{
		{"a family with a small uncached ISL lands in its small bucket", "interactive", 10, "i-small"},
		{"the bucket is the highest floor at or below the uncached ISL", "interactive", 4096, "i-large"},
		{"just below a floor stays in the lower bucket", "interactive", 4095, "i-small"},
		{"an explicit class name selects it directly", "latency", 1 << 40, "latency"},
		{"a missing header uses the default family", "", 5000, "b-large"},
		{"an unknown name uses the default family", "gold", 0, "b-small"},
		{"an ordinary matrix class name uses the default family", "i-small", 0, "b-small"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := p.Class(p.Resolve(tc.requested, tc.uncached)).Name; got != tc.want {
				t.Fatalf("Resolve(%q, %d) = %s, want %s", tc.requested, tc.uncached, got, tc.want)
			}
		})
	}
	t.Run("only explicit classes resolve without cache state", func(t *testing.T) {
		if i, ok := p.Direct("latency"); !ok || p.Class(i).Name != "latency" {
			t.Fatal("explicit class not direct")
		}
		for _, name := range []string{"", "interactive", "i-small", "nope"} {
			if _, ok := p.Direct(name); ok {
				t.Fatalf("%q resolved directly", name)
			}
		}
	})
	t.Run("a class that sets neither threshold busies at 16 times max_num_batched_tokens", func(t *testing.T) {
		c := p.Class(0)
		if !c.Queues() || c.BusyThreshold != nil || *c.BusyThresholdFrac != queue.DefaultBusyThresholdFrac {
			t.Fatalf("%+v", c)
		}
		if lat := p.Class(4); lat.BusyThresholdFrac != nil {
			t.Fatalf("a class with an absolute threshold got a fraction: %+v", lat)
		}
	})
	t.Run("unset queue policies inherit router_queue_policy", func(t *testing.T) {
		r := p.WithDefaultPolicy(queue.LCFS)
		if r.Class(0).Policy != queue.LCFS || r.Class(2).Policy != queue.WSPT || p.Class(0).Policy != queue.PolicyUnset {
			t.Fatal("WithDefaultPolicy")
		}
		if p.WithDefaultPolicy(queue.PolicyUnset).Class(0).Policy != queue.FCFS {
			t.Fatal("an unset router policy must mean fcfs")
		}
	})
}

func TestSyntheticAndProfiles(t *testing.T) {
	t.Run("the synthetic profile is one default class from router_queue_threshold", func(t *testing.T) {
		p := queue.Synthetic(f64(0.5), queue.WSPT)
		if p.NumClasses() != 1 || !p.Synthetic() || p.Class(0).Name != "default" || *p.Class(0).BusyThresholdFrac != 0.5 ||
			p.Class(0).Policy != queue.WSPT || p.Class(0).Quantum != 1 {
			t.Fatalf("%+v", p.Class(0))
		}
		if i, ok := p.Direct("anything"); !ok || i != 0 || p.Resolve("x", 99) != 0 {
			t.Fatal("the synthetic class must always resolve")
		}
	})
	t.Run("without router_queue_threshold the synthetic class never queues", func(t *testing.T) {
		if p := queue.Synthetic(nil, queue.FCFS); p.AnyQueues() || p.Class(0).Queues() {
			t.Fatal("queues without a threshold")
		}
	})
	t.Run("a model profile replaces the root profile and other models use the root", func(t *testing.T) {
		root, model := twoByTwo(t), queue.Synthetic(f64(1), queue.FCFS)
		ps := &queue.Profiles{Root: root, Models: map[string]*queue.Profile{"llama": model}}
		if ps.For("llama") != model || ps.For("other") != root || !ps.Configured() {
			t.Fatal("For")
		}
		var none *queue.Profiles
		if none.For("x") != nil || none.Configured() || (&queue.Profiles{}).Configured() {
			t.Fatal("empty profiles")
		}
	})
}

func TestClassBusyRules(t *testing.T) {
	cases := []struct {
		name   string
		class  queue.Class
		active uint64
		maxBT  uint64
		want   bool
	}{
		{"above the absolute threshold is busy", queue.Class{BusyThreshold: f64(100)}, 101, 1 << 30, true},
		{"at the absolute threshold is not busy", queue.Class{BusyThreshold: f64(100)}, 100, 1, false},
		{"above the fraction of max_num_batched_tokens is busy", queue.Class{BusyThresholdFrac: f64(0.5)}, 513, 1024, true},
		{"at the fraction is not busy", queue.Class{BusyThresholdFrac: f64(0.5)}, 512, 1024, false},
		{"either threshold suffices", queue.Class{BusyThreshold: f64(1000), BusyThresholdFrac: f64(0.1)}, 200, 1024, true},
		{"a zero threshold makes any prefill busy", queue.Class{BusyThresholdFrac: f64(0)}, 1, 1024, true},
		{"no threshold is never busy", queue.Class{}, 1 << 60, 1, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.class.RankBusy(tc.active, tc.maxBT); got != tc.want {
				t.Fatalf("RankBusy = %v", got)
			}
		})
	}
	pool := []struct {
		name           string
		ratio          *float64
		busy, eligible int
		want           bool
	}{
		{"by default every eligible rank must be busy", nil, 127, 128, false},
		{"every rank busy is a busy pool", nil, 128, 128, true},
		{"a ratio trips once its share is reached", f64(0.95), 122, 128, true},
		{"a ratio does not trip below its share", f64(0.95), 121, 128, false},
		{"a high ratio keeps small pools on the all-busy rule", f64(0.95), 1, 2, false},
		{"an empty pool is never busy", nil, 0, 0, false},
		{"an empty pool is never busy with a ratio", f64(0.5), 0, 0, false},
	}
	for _, tc := range pool {
		t.Run(tc.name, func(t *testing.T) {
			c := queue.Class{BusyThreshold: f64(0), BusyWorkerRatio: tc.ratio}
			if got := c.PoolBusy(tc.busy, tc.eligible); got != tc.want {
				t.Fatalf("PoolBusy(%d, %d) = %v", tc.busy, tc.eligible, got)
			}
		})
	}
}

func TestNewProfileValidation(t *testing.T) {
	bucket := []queue.Bucket{{Name: "all"}}
	cls := func(mods ...func(*queue.Class)) []queue.Class {
		c := queue.Class{Name: "a", Family: "f", Bucket: "all", Quantum: 1}
		for _, m := range mods {
			m(&c)
		}
		return []queue.Class{c}
	}
	cases := []struct {
		name string
		spec queue.ProfileSpec
		want string
	}{
		{"no classes", queue.ProfileSpec{DefaultFamily: "f", Buckets: bucket}, "policy_classes must not be empty"},
		{"no buckets", queue.ProfileSpec{DefaultFamily: "f", Classes: cls()}, "uncached_isl_buckets must not be empty"},
		{"a first floor above zero", queue.ProfileSpec{DefaultFamily: "f", Buckets: []queue.Bucket{{Name: "all", MinTokens: 5}}, Classes: cls()},
			"uncached_isl_buckets[0].min_tokens must be 0"},
		{"floors that do not strictly increase", queue.ProfileSpec{DefaultFamily: "f",
			Buckets: []queue.Bucket{{Name: "all"}, {Name: "b", MinTokens: 10}, {Name: "c", MinTokens: 10}}, Classes: cls()},
			"uncached_isl_buckets[2].min_tokens 10 must be greater than the previous floor 10"},
		{"a duplicate bucket", queue.ProfileSpec{DefaultFamily: "f", Buckets: []queue.Bucket{{Name: "all"}, {Name: "all", MinTokens: 1}}, Classes: cls()},
			`duplicate bucket "all"`},
		{"a zero quantum", queue.ProfileSpec{DefaultFamily: "f", Buckets: bucket, Classes: cls(func(c *queue.Class) { c.Quantum = 0 })},
			`policy_classes[0] ("a").quantum must be an integer >= 1`},
		{"a negative threshold", queue.ProfileSpec{DefaultFamily: "f", Buckets: bucket, Classes: cls(func(c *queue.Class) { c.BusyThreshold = f64(-1) })},
			"prefill_busy_threshold must be a finite number >= 0"},
		{"a ratio above one", queue.ProfileSpec{DefaultFamily: "f", Buckets: bucket, Classes: cls(func(c *queue.Class) { c.BusyWorkerRatio = f64(16) })},
			"busy_worker_ratio must be in (0, 1]"},
		{"a zero ratio", queue.ProfileSpec{DefaultFamily: "f", Buckets: bucket, Classes: cls(func(c *queue.Class) { c.BusyWorkerRatio = f64(0) })},
			"busy_worker_ratio must be in (0, 1]"},
		{"a family without a bucket", queue.ProfileSpec{DefaultFamily: "f", Buckets: bucket, Classes: cls(func(c *queue.Class) { c.Bucket = "" })},
			"must set both policy_family and cache_bucket"},
		{"an unknown bucket", queue.ProfileSpec{DefaultFamily: "f", Buckets: bucket, Classes: cls(func(c *queue.Class) { c.Bucket = "huge" })},
			`cache_bucket "huge" is not one of uncached_isl_buckets`},
		{"duplicate class names", queue.ProfileSpec{DefaultFamily: "f", Buckets: bucket,
			Classes: append(cls(), queue.Class{Name: "a", Quantum: 1})}, `duplicate class name "a"`},
		{"two classes for one family and bucket", queue.ProfileSpec{DefaultFamily: "f", Buckets: bucket,
			Classes: append(cls(), queue.Class{Name: "b", Family: "f", Bucket: "all", Quantum: 1})}, `family "f" already has class "a" for bucket "all"`},
		{"a family missing a bucket", queue.ProfileSpec{DefaultFamily: "f", Buckets: []queue.Bucket{{Name: "all"}, {Name: "big", MinTokens: 9}}, Classes: cls()},
			`policy family "f" has no class for bucket "big"`},
		{"an explicit class named like a family", queue.ProfileSpec{DefaultFamily: "f", Buckets: bucket,
			Classes: append(cls(), queue.Class{Name: "f", Quantum: 1})}, `explicit class name collides with policy family "f"`},
		{"a default family that names no family", queue.ProfileSpec{DefaultFamily: "g", Buckets: bucket, Classes: cls()},
			`default_policy_family "g" does not name a policy family`},
		{"no default family", queue.ProfileSpec{Buckets: bucket, Classes: cls()}, "default_policy_family is required"},
		{"an unnamed class", queue.ProfileSpec{DefaultFamily: "f", Buckets: bucket, Classes: cls(func(c *queue.Class) { c.Name = "" })},
			"policy_classes[0].name must not be empty"},
	}
	for _, tc := range cases {
		t.Run("rejects "+tc.name, func(t *testing.T) {
			_, err := queue.NewProfile(tc.spec)
			if err == nil || !errors.Is(err, queue.ErrInvalidProfile) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestParsePolicy(t *testing.T) {
	for in, want := range map[string]queue.Policy{"": queue.PolicyUnset, "fcfs": queue.FCFS, "lcfs": queue.LCFS, "wspt": queue.WSPT} {
		if got, err := queue.ParsePolicy(in); err != nil || got != want || got.String() != in {
			t.Fatalf("ParsePolicy(%q) = %v, %v", in, got, err)
		}
	}
	if _, err := queue.ParsePolicy("FIFO"); err == nil || !strings.Contains(err.Error(), `"FIFO"`) {
		t.Fatalf("err = %v", err)
	}
}
