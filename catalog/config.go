package catalog

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"regexp"
	"sort"
	"strings"

	yamlv3 "go.yaml.in/yaml/v3"
	"sigs.k8s.io/yaml"

	"github.com/kvepp/kvepp/picker/queue"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
)

// Config is the policy configuration file (DYN_ROUTER_POLICY_CONFIG, selection-service.md §18).
// Every top-level key is optional; unknown keys anywhere are rejected. The policy-class keys
// (§18.2) are parsed into typed form and validated by ParseConfig; QueueProfiles turns them into
// the queue's profiles.
type Config struct {
	// WorkerSelection is the §18.1 worker_selection section; nil when absent.
	WorkerSelection *WorkerSelection `json:"worker_selection,omitempty"`
	// DefaultPolicyFamily is the family used when the policy-class header is missing or unknown.
	DefaultPolicyFamily string `json:"default_policy_family,omitempty"`
	// UncachedISLBuckets are the uncached-ISL bucket floors (tokens).
	UncachedISLBuckets []ISLBucket `json:"uncached_isl_buckets,omitempty"`
	// PolicyClasses are the root profile's policy classes.
	PolicyClasses []PolicyClass `json:"policy_classes,omitempty"`
	// Models maps a model name to a profile that replaces the root profile for that model.
	Models map[string]Profile `json:"models,omitempty"`
}

// WorkerSelection is the §18.1 section.
type WorkerSelection struct {
	// Default is the instance to use; "" or "default" selects the built-in policy.
	Default string `json:"default,omitempty"`
	// Instances are the configured policy instances.
	Instances []Instance `json:"instances,omitempty"`
}

// Instance is one configured policy instance.
type Instance struct {
	// Name identifies the instance (^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$, unique, not "default").
	Name string `json:"name"`
	// Type is a registered provider type name.
	Type string `json:"type"`
	// Parameters is the instance's parameter mapping as JSON (absent or null = {}).
	Parameters json.RawMessage `json:"parameters,omitempty"`
}

// Profile is a per-model policy-class profile (§18.2 `models.<name>`).
type Profile struct {
	DefaultPolicyFamily string        `json:"default_policy_family,omitempty"` // as Config.DefaultPolicyFamily
	UncachedISLBuckets  []ISLBucket   `json:"uncached_isl_buckets,omitempty"`  // as Config.UncachedISLBuckets
	PolicyClasses       []PolicyClass `json:"policy_classes,omitempty"`        // as Config.PolicyClasses
}

// ISLBucket is one uncached-ISL bucket: requests whose uncached ISL is ≥ MinTokens (tokens) and
// below the next floor fall into Bucket.
type ISLBucket struct {
	MinTokens int64  `json:"min_tokens"` // floor in uncached tokens (first 0, strictly increasing)
	Bucket    string `json:"bucket"`     // bucket name, matched by PolicyClass.CacheBucket
}

// PolicyClass is one queueing class (§18.2). Pointer fields are nil when unset.
type PolicyClass struct {
	Name         string `json:"name"`                    // unique class name (identifier rule)
	PolicyFamily string `json:"policy_family,omitempty"` // family of a matrix class ("" for an explicit class)
	CacheBucket  string `json:"cache_bucket,omitempty"`  // bucket of a matrix class ("" for an explicit class)
	// Quantum is the deficit-round-robin quantum in tokens (required, ≥ 1).
	Quantum *int64 `json:"quantum,omitempty"`
	// QueuePolicy is fcfs, lcfs or wspt (default router_queue_policy).
	QueuePolicy string `json:"queue_policy,omitempty"`
	// PrefillBusyThreshold is an absolute busy threshold in tokens.
	PrefillBusyThreshold *float64 `json:"prefill_busy_threshold,omitempty"`
	// PrefillBusyThresholdFrac is a busy threshold as a multiple of max_num_batched_tokens.
	PrefillBusyThresholdFrac *float64 `json:"prefill_busy_threshold_frac,omitempty"`
	// BusyWorkerRatio is the busy-rank fraction in (0, 1] that makes the pool busy.
	BusyWorkerRatio *float64 `json:"busy_worker_ratio,omitempty"`
	// RequestQueueLimitPerWorker limits queued requests per schedulable endpoint.
	RequestQueueLimitPerWorker *int64 `json:"request_queue_limit_per_worker,omitempty"`
	// RawISLTokenQueueLimitPerWorker limits queued raw ISL tokens per schedulable endpoint.
	RawISLTokenQueueLimitPerWorker *int64 `json:"raw_isl_token_queue_limit_per_worker,omitempty"`
	// CachedTokenQueueLimitPerWorker limits queued cached tokens per schedulable endpoint.
	CachedTokenQueueLimitPerWorker *int64 `json:"cached_token_queue_limit_per_worker,omitempty"`
}

// nameRule is the identifier rule for instance (and class) names (§18.1).
var nameRule = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$`)

// ValidName reports whether name satisfies ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$.
func ValidName(name string) bool { return nameRule.MatchString(name) }

// ParseConfig parses and validates the YAML (or JSON) policy configuration. Errors: YAML syntax,
// duplicate keys, unknown keys, wrong types, every §18.1 worker_selection rule (see
// (*WorkerSelection).Validate) and every §18.2 policy-class rule (see QueueProfiles). Empty
// input is an empty configuration.
func ParseConfig(data []byte) (*Config, error) {
	var c Config
	if err := yaml.UnmarshalStrict(data, &c); err != nil {
		// Only the conversion's own refusal of a non-finite number is re-explained: another
		// error (an unknown key, a wrong type) is the real one even when the document also
		// holds a .nan somewhere it is legal (a string field takes it as text).
		if strings.Contains(err.Error(), "unsupported value") {
			if nf := nonFinite(data); nf != nil {
				return nil, fmt.Errorf("policy config: %w", nf)
			}
		}
		return nil, fmt.Errorf("policy config: %w", err)
	}
	if c.WorkerSelection != nil {
		if err := c.WorkerSelection.Validate(); err != nil {
			return nil, fmt.Errorf("policy config: %w", err)
		}
	}
	if _, err := c.QueueProfiles(); err != nil {
		return nil, fmt.Errorf("policy config: %w", err)
	}
	return &c, nil
}

// nonFinite returns an error naming the first YAML float that is not finite (.nan, .inf, -.inf)
// in data, with its key path and line, or nil when there is none (or data does not parse). The
// YAML-to-JSON conversion ParseConfig decodes through refuses such a value with only "json:
// unsupported value: NaN", which names neither the key nor the instance; this is called on that
// failure to say which one it was.
func nonFinite(data []byte) error {
	var root yamlv3.Node
	if yamlv3.Unmarshal(data, &root) != nil {
		return nil
	}
	var walk func(n *yamlv3.Node, path string) error
	walk = func(n *yamlv3.Node, path string) error {
		switch n.Kind {
		case yamlv3.DocumentNode:
			for _, c := range n.Content {
				if err := walk(c, path); err != nil {
					return err
				}
			}
		case yamlv3.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				key := n.Content[i].Value
				if path != "" {
					key = path + "." + key
				}
				if err := walk(n.Content[i+1], key); err != nil {
					return err
				}
			}
		case yamlv3.SequenceNode:
			for i, c := range n.Content {
				if err := walk(c, fmt.Sprintf("%s[%d]", path, i)); err != nil {
					return err
				}
			}
		case yamlv3.ScalarNode:
			var f float64
			if n.ShortTag() == "!!float" && n.Decode(&f) == nil && (math.IsNaN(f) || math.IsInf(f, 0)) {
				return fmt.Errorf("%s (line %d) is %s: numbers must be finite", path, n.Line, n.Value)
			}
		}
		return nil
	}
	return walk(&root, "")
}

// LoadConfigFile reads and parses the policy configuration at path (DYN_ROUTER_POLICY_CONFIG).
// Errors name the path.
func LoadConfigFile(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("policy config %s: %w", path, err)
	}
	c, err := ParseConfig(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// Validate checks the §18.1 rules: every instance has a valid, unique name other than "default"
// and a non-empty type; parameters are a mapping; default names a configured instance or is
// "default" (or empty). Errors name the offending instance by index and name.
func (w *WorkerSelection) Validate() error {
	seen := map[string]int{}
	for i, in := range w.Instances {
		where := fmt.Sprintf("worker_selection.instances[%d]", i)
		switch {
		case in.Name == DefaultName:
			return fmt.Errorf("%s: instance name %q is reserved for the built-in policy", where, in.Name)
		case !ValidName(in.Name):
			return fmt.Errorf("%s: instance name %q must match %s", where, in.Name, nameRule)
		}
		where = fmt.Sprintf("%s (%q)", where, in.Name)
		if j, dup := seen[in.Name]; dup {
			return fmt.Errorf("%s: duplicate instance name %q (also worker_selection.instances[%d])", where, in.Name, j)
		}
		seen[in.Name] = i
		if strings.TrimSpace(in.Type) == "" {
			return fmt.Errorf("%s: type is required", where)
		}
		if _, err := policies.NewPolicyParameters(in.Parameters); err != nil {
			return fmt.Errorf("%s: parameters must be a mapping, got %s", where, shortJSON(in.Parameters))
		}
	}
	if d := w.Default; d != "" && d != DefaultName {
		if _, ok := seen[d]; !ok {
			return fmt.Errorf("worker_selection.default %q does not name a configured instance (configured: %s)", d, w.names())
		}
	}
	return nil
}

func (w *WorkerSelection) names() string {
	if w == nil || len(w.Instances) == 0 {
		return "none"
	}
	names := make([]string, 0, len(w.Instances))
	for _, in := range w.Instances {
		names = append(names, in.Name)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

func shortJSON(raw json.RawMessage) string {
	s := string(bytes.TrimSpace(raw))
	if len(s) > 40 {
		s = s[:40] + "…"
	}
	return s
}

// OverrideEnv is the environment variable whose value Resolve takes as its override argument.
const OverrideEnv = "DYN_ROUTER_WORKER_SELECTION_POLICY"

// Resolution is the worker-selection policy to use, produced once at startup by Resolve.
type Resolution struct {
	// Name is the selected instance name, or "default" for the built-in policy.
	Name string
	// Type is the selected instance's type (dynamo-default-cost-fn for the built-in policy).
	Type string
	// Builtin is true when the built-in policy is selected (per-request overrides apply to it).
	Builtin bool
	// Source says what selected it: "DYN_ROUTER_WORKER_SELECTION_POLICY", "worker_selection.default"
	// or "built-in default".
	Source string
	// Factory builds one policy instance per partition (call it with worker type "select").
	Factory policies.PolicyFactory
	// Instances holds the factory of every configured instance by name; every provider ran once.
	Instances map[string]policies.PolicyFactory
}

// Resolve runs the provider of every configured instance once (validating every type and every
// parameter set, so any mistake stops startup) and selects the policy to use (§18.1):
// override (the DYN_ROUTER_WORKER_SELECTION_POLICY value, trimmed; empty = unset) wins over
// worker_selection.default; "default" or nothing selects the built-in policy. cfg may be nil (no
// configuration file) and reg nil (Builtins()). Errors name the instance, its type and the
// provider's message, or the unknown override value.
func Resolve(reg *Registry, cfg *Config, override string) (*Resolution, error) {
	if reg == nil {
		reg = Builtins()
	}
	var ws *WorkerSelection
	if cfg != nil && cfg.WorkerSelection != nil {
		ws = cfg.WorkerSelection
		if err := ws.Validate(); err != nil {
			return nil, fmt.Errorf("policy config: %w", err)
		}
	}
	res := &Resolution{Instances: map[string]policies.PolicyFactory{}}
	types := map[string]string{}
	if ws != nil {
		for i, in := range ws.Instances {
			where := fmt.Sprintf("worker_selection.instances[%d] (name %q, type %q)", i, in.Name, in.Type)
			provider, ok := reg.Lookup(in.Type)
			if !ok {
				return nil, fmt.Errorf("policy config: %s: unknown policy type %q (registered: %s)", where, in.Type, strings.Join(reg.Types(), ", "))
			}
			params, err := policies.NewPolicyParameters(in.Parameters)
			if err != nil {
				return nil, fmt.Errorf("policy config: %s: %w", where, err)
			}
			factory, err := callProvider(provider, params)
			if err != nil {
				return nil, fmt.Errorf("policy config: %s: %w", where, err)
			}
			if factory == nil {
				return nil, fmt.Errorf("policy config: %s: provider returned no factory", where)
			}
			res.Instances[in.Name] = factory
			types[in.Name] = in.Type
		}
	}

	name, source := DefaultName, "built-in default"
	if ws != nil && ws.Default != "" {
		name, source = ws.Default, "worker_selection.default"
	}
	if o := strings.TrimSpace(override); o != "" {
		if o != DefaultName {
			if _, ok := res.Instances[o]; !ok {
				return nil, fmt.Errorf("%s=%q does not name a configured worker_selection instance (configured: %s)", OverrideEnv, o, ws.names())
			}
		}
		name, source = o, OverrideEnv
	}
	res.Name, res.Source = name, source
	if name == DefaultName {
		res.Builtin, res.Type, res.Factory = true, defaultcost.TypeName, defaultcost.Builtin()
	} else {
		res.Type, res.Factory = types[name], res.Instances[name]
	}
	return res, nil
}

// SourceHostDefault is Resolution.Source when nothing selected a policy and ResolveWithDefault
// used the host's default type.
const SourceHostDefault = "host default"

// ResolveWithDefault is Resolve for a host whose own default policy is not the built-in one: when
// neither override nor worker_selection.default selects anything, it builds an instance of
// defaultType (registered in reg) with no parameters, named after the type, instead of the
// built-in policy. Selecting "default" explicitly still gives the built-in policy. With
// defaultType "" or not registered it is Resolve. The EPP uses it to run predicted-ttft out of the
// box, while `epp select-service` keeps the documented built-in default (selection-service.md
// §18.1). Errors: as Resolve, and the default type's provider error.
func ResolveWithDefault(reg *Registry, cfg *Config, override, defaultType string) (*Resolution, error) {
	return ResolveWithDefaultParams(reg, cfg, override, defaultType, nil)
}

// ResolveWithDefaultParams is ResolveWithDefault with the parameters (a JSON mapping, nil = none)
// the host's default type is built with when it is the one that runs; a policy file or an
// override that selects an instance is not affected. Errors: as ResolveWithDefault's, and
// parameters that are not a mapping or that the type refuses.
func ResolveWithDefaultParams(reg *Registry, cfg *Config, override, defaultType string, defaultParams []byte) (*Resolution, error) {
	res, err := Resolve(reg, cfg, override)
	if err != nil || res.Source != "built-in default" || defaultType == "" {
		return res, err
	}
	if reg == nil {
		reg = Builtins()
	}
	provider, ok := reg.Lookup(defaultType)
	if !ok {
		return res, nil
	}
	params, err := policies.NewPolicyParameters(defaultParams)
	if err != nil {
		return nil, fmt.Errorf("default policy type %q: %w", defaultType, err)
	}
	factory, err := callProvider(provider, params)
	if err != nil {
		return nil, fmt.Errorf("default policy type %q: %w", defaultType, err)
	}
	if factory == nil {
		return nil, fmt.Errorf("default policy type %q: provider returned no factory", defaultType)
	}
	res.Name, res.Type, res.Builtin, res.Source, res.Factory = defaultType, defaultType, false, SourceHostDefault, factory
	return res, nil
}

// callProvider runs a provider, turning a panic into an error so bad input never crashes startup.
func callProvider(p policies.Provider, params policies.PolicyParameters) (f policies.PolicyFactory, err error) {
	defer func() {
		if r := recover(); r != nil {
			f, err = nil, fmt.Errorf("provider panicked: %v", r)
		}
	}()
	return p(params)
}

// QueueProfiles validates the policy-class keys (selection-service.md §18.2, §13.4) and returns
// the queue profiles: the root profile (when any of default_policy_family, uncached_isl_buckets,
// policy_classes is present) and one profile per models entry, each replacing the root for its
// model. It returns nil, nil when the file defines no profile (queueing then depends on
// router_queue_threshold alone).
//
// Rules, each error naming the offending key (prefixed `models["<name>"]:` inside a model
// profile): class names, policy families, cache buckets and default_policy_family follow the
// identifier rule ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$; class names are unique; quantum is required
// and ≥ 1; queue_policy is fcfs, lcfs or wspt (unset = router_queue_policy); the busy thresholds
// are finite ≥ 0; busy_worker_ratio is in (0, 1]; the three per-worker limits are ≥ 0; a class
// sets both policy_family and cache_bucket (a matrix class) or neither (an explicit class);
// cache_bucket names one of uncached_isl_buckets; bucket names are unique; floors start at 0 and
// strictly increase; every family has exactly one class per bucket; an explicit class is not named
// like a family; default_policy_family names a family; a model name is not empty. A class that
// sets neither busy threshold uses prefill_busy_threshold_frac 16.0.
func (c *Config) QueueProfiles() (*queue.Profiles, error) {
	ps := &queue.Profiles{}
	root := Profile{DefaultPolicyFamily: c.DefaultPolicyFamily, UncachedISLBuckets: c.UncachedISLBuckets, PolicyClasses: c.PolicyClasses}
	if root.DefaultPolicyFamily != "" || root.UncachedISLBuckets != nil || root.PolicyClasses != nil {
		p, err := root.profile()
		if err != nil {
			return nil, err
		}
		ps.Root = p
	}
	names := make([]string, 0, len(c.Models))
	for name := range c.Models {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if name == "" {
			return nil, fmt.Errorf("models: a model name must not be empty")
		}
		p, err := c.Models[name].profile()
		if err != nil {
			return nil, fmt.Errorf("models[%q]: %w", name, err)
		}
		if ps.Models == nil {
			ps.Models = make(map[string]*queue.Profile, len(c.Models))
		}
		ps.Models[name] = p
	}
	if !ps.Configured() {
		return nil, nil
	}
	return ps, nil
}

// profile validates one profile's keys and builds its queue profile.
func (pr Profile) profile() (*queue.Profile, error) {
	if f := pr.DefaultPolicyFamily; f != "" && !ValidName(f) {
		return nil, fmt.Errorf("default_policy_family %q must match %s", f, nameRule)
	}
	spec := queue.ProfileSpec{DefaultFamily: pr.DefaultPolicyFamily}
	for i, b := range pr.UncachedISLBuckets {
		where := fmt.Sprintf("uncached_isl_buckets[%d]", i)
		if !ValidName(b.Bucket) {
			return nil, fmt.Errorf("%s.bucket %q must match %s", where, b.Bucket, nameRule)
		}
		if b.MinTokens < 0 {
			return nil, fmt.Errorf("%s.min_tokens must be >= 0, got %d", where, b.MinTokens)
		}
		spec.Buckets = append(spec.Buckets, queue.Bucket{Name: b.Bucket, MinTokens: uint64(b.MinTokens)})
	}
	for i, pc := range pr.PolicyClasses {
		where := fmt.Sprintf("policy_classes[%d] (%q)", i, pc.Name)
		if !ValidName(pc.Name) {
			return nil, fmt.Errorf("policy_classes[%d].name %q must match %s", i, pc.Name, nameRule)
		}
		if pc.PolicyFamily != "" && !ValidName(pc.PolicyFamily) {
			return nil, fmt.Errorf("%s.policy_family %q must match %s", where, pc.PolicyFamily, nameRule)
		}
		if pc.CacheBucket != "" && !ValidName(pc.CacheBucket) {
			return nil, fmt.Errorf("%s.cache_bucket %q must match %s", where, pc.CacheBucket, nameRule)
		}
		if pc.Quantum == nil {
			return nil, fmt.Errorf("%s.quantum is required (an integer >= 1)", where)
		}
		if *pc.Quantum < 1 {
			return nil, fmt.Errorf("%s.quantum must be an integer >= 1, got %d", where, *pc.Quantum)
		}
		pol, err := queue.ParsePolicy(pc.QueuePolicy)
		if err != nil {
			return nil, fmt.Errorf("%s.queue_policy: %w", where, err)
		}
		cl := queue.Class{
			Name: pc.Name, Family: pc.PolicyFamily, Bucket: pc.CacheBucket, Policy: pol, Quantum: uint64(*pc.Quantum),
			BusyThreshold: pc.PrefillBusyThreshold, BusyThresholdFrac: pc.PrefillBusyThresholdFrac, BusyWorkerRatio: pc.BusyWorkerRatio,
		}
		for _, l := range []struct {
			key string
			in  *int64
			out **uint64
		}{
			{"request_queue_limit_per_worker", pc.RequestQueueLimitPerWorker, &cl.RequestLimitPerWorker},
			{"raw_isl_token_queue_limit_per_worker", pc.RawISLTokenQueueLimitPerWorker, &cl.RawISLTokenLimitPerWorker},
			{"cached_token_queue_limit_per_worker", pc.CachedTokenQueueLimitPerWorker, &cl.CachedTokenLimitPerWorker},
		} {
			if l.in == nil {
				continue
			}
			if *l.in < 0 {
				return nil, fmt.Errorf("%s.%s must be >= 0, got %d", where, l.key, *l.in)
			}
			v := uint64(*l.in)
			*l.out = &v
		}
		spec.Classes = append(spec.Classes, cl)
	}
	return queue.NewProfile(spec)
}
