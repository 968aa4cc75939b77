// Package queue is the pure policy-class queue of the selection service (selection-service.md
// §13): policy classes with their busy rules and per-class limits (§13.1, §13.5), the
// family × uncached-ISL-bucket classifier of policy profiles (§13.4, §18.2), per-class ordering
// by (strict_priority, policy_score, enqueue order) (§13.2), and deficit round robin across
// classes (§13.5).
//
// Everything here is a plain data structure: no goroutines, no clocks (callers pass `now`), no
// locks. The selection core drives one Queue per partition from that partition's serialized
// context.
package queue

import (
	"errors"
	"fmt"
	"math"
	"sort"
)

// Policy is a class's ordering policy (selection-service.md §13.2; DYN_ROUTER_QUEUE_POLICY and
// the YAML queue_policy key).
type Policy uint8

// Ordering policies. PolicyUnset marks a class without queue_policy: it inherits
// router_queue_policy when the profile is resolved (Profile.WithDefaultPolicy).
const (
	PolicyUnset Policy = iota
	// FCFS scores priority_jump − arrival_offset: earlier arrivals first (the default).
	FCFS
	// LCFS scores priority_jump + arrival_offset: later arrivals first.
	LCFS
	// WSPT scores (1 + priority_jump) / scheduling_cost_tokens: cheapest work first.
	WSPT
)

// String returns "fcfs", "lcfs", "wspt", or "" for PolicyUnset.
func (p Policy) String() string {
	switch p {
	case FCFS:
		return "fcfs"
	case LCFS:
		return "lcfs"
	case WSPT:
		return "wspt"
	}
	return ""
}

// ParsePolicy parses a queue policy name: "fcfs", "lcfs" or "wspt"; "" is PolicyUnset. Any other
// value is an error naming it.
func ParsePolicy(s string) (Policy, error) {
	switch s {
	case "":
		return PolicyUnset, nil
	case "fcfs":
		return FCFS, nil
	case "lcfs":
		return LCFS, nil
	case "wspt":
		return WSPT, nil
	}
	return PolicyUnset, fmt.Errorf("queue policy %q must be fcfs, lcfs or wspt", s)
}

// DefaultBusyThresholdFrac is the prefill_busy_threshold_frac (a multiple of
// max_num_batched_tokens) of a configured class that sets neither busy threshold
// (selection-service.md §13.1).
const DefaultBusyThresholdFrac = 16.0

// SyntheticClassName is the name of the single class of the synthetic profile built from
// router_queue_threshold and router_queue_policy (selection-service.md §13.4).
const SyntheticClassName = "default"

// Class is one policy class (selection-service.md §13.1, §13.5, §18.2). Nil pointers are unset
// settings. A matrix class has both Family and Bucket; an explicit class has neither.
type Class struct {
	// Name is the class name (unique in its profile); it appears in 429 bodies.
	Name string
	// Family is the policy family of a matrix class ("" for an explicit class).
	Family string
	// Bucket is the uncached-ISL bucket of a matrix class ("" for an explicit class).
	Bucket string
	// Policy orders the class's backlog (PolicyUnset until the profile is resolved).
	Policy Policy
	// Quantum is the deficit-round-robin credit per round in tokens (≥ 1).
	Quantum uint64
	// BusyThreshold is prefill_busy_threshold: a rank is busy when its active prefill tokens
	// exceed it (tokens, finite ≥ 0).
	BusyThreshold *float64
	// BusyThresholdFrac is prefill_busy_threshold_frac: a rank is busy when its active prefill
	// tokens exceed this multiple of its max_num_batched_tokens (finite ≥ 0).
	BusyThresholdFrac *float64
	// BusyWorkerRatio ρ ∈ (0, 1] makes the pool busy once at least ρ × eligible ranks are busy;
	// nil = every eligible rank must be busy.
	BusyWorkerRatio *float64
	// RequestLimitPerWorker caps queued requests per schedulable endpoint.
	RequestLimitPerWorker *uint64
	// RawISLTokenLimitPerWorker caps queued raw ISL tokens per schedulable endpoint.
	RawISLTokenLimitPerWorker *uint64
	// CachedTokenLimitPerWorker caps queued cached tokens per schedulable endpoint.
	CachedTokenLimitPerWorker *uint64
}

// Queues reports whether the class can queue at all: it has a busy threshold (absolute or
// fraction). A synthetic class without router_queue_threshold never queues.
func (c *Class) Queues() bool { return c.BusyThreshold != nil || c.BusyThresholdFrac != nil }

// RankBusy reports whether a rank with activePrefillTokens of booked prefill (tokens) is busy
// for the class: above the absolute threshold, or above the fraction × maxBatchedTokens
// (selection-service.md §13.1). Without thresholds nothing is busy.
func (c *Class) RankBusy(activePrefillTokens, maxBatchedTokens uint64) bool {
	active := float64(activePrefillTokens)
	if t := c.BusyThreshold; t != nil && active > *t {
		return true
	}
	if f := c.BusyThresholdFrac; f != nil && active > *f*float64(maxBatchedTokens) {
		return true
	}
	return false
}

// PoolBusy reports whether a pool with busy of its eligible ranks busy is busy for the class:
// every eligible rank busy, or with BusyWorkerRatio ρ at least ρ × eligible busy
// (selection-service.md §13.1). An empty pool is never busy (the request then fails selection
// with "no endpoints available to route work" instead of waiting forever).
func (c *Class) PoolBusy(busy, eligible int) bool {
	if eligible <= 0 {
		return false
	}
	if r := c.BusyWorkerRatio; r != nil {
		return float64(busy) >= *r*float64(eligible)
	}
	return busy >= eligible
}

// validate checks one class's settings; where names it for errors.
func (c *Class) validate(where string) error {
	if c.Quantum < 1 {
		return fmt.Errorf("%s.quantum must be an integer >= 1, got %d", where, c.Quantum)
	}
	for _, f := range []struct {
		name string
		v    *float64
	}{{"prefill_busy_threshold", c.BusyThreshold}, {"prefill_busy_threshold_frac", c.BusyThresholdFrac}} {
		if f.v != nil && !(*f.v >= 0 && !math.IsInf(*f.v, 1)) {
			return fmt.Errorf("%s.%s must be a finite number >= 0, got %v", where, f.name, *f.v)
		}
	}
	if r := c.BusyWorkerRatio; r != nil && !(*r > 0 && *r <= 1) {
		return fmt.Errorf("%s.busy_worker_ratio must be in (0, 1], got %v", where, *r)
	}
	if c.Policy > WSPT {
		return fmt.Errorf("%s.queue_policy %d is not a queue policy", where, c.Policy)
	}
	return nil
}

// Bucket is one uncached-ISL bucket: requests whose uncached ISL is at least MinTokens (tokens)
// and below the next bucket's floor fall into it (selection-service.md §13.4, §18.2).
type Bucket struct {
	// Name is the bucket name that matrix classes reference as cache_bucket.
	Name string
	// MinTokens is the floor in uncached tokens (the first floor is 0; floors strictly increase).
	MinTokens uint64
}

// ProfileSpec is a configured policy profile before validation: the three §18.2 profile keys.
type ProfileSpec struct {
	// DefaultFamily is default_policy_family (must name a family of a matrix class).
	DefaultFamily string
	// Buckets are uncached_isl_buckets in order.
	Buckets []Bucket
	// Classes are policy_classes in order (class indexes follow this order).
	Classes []Class
}

// Profile is a validated policy profile: its classes and the classifier that maps a requested
// family (the x-dynamo-meta-policy-class header) and a request's uncached ISL to one class
// (selection-service.md §13.4). Immutable; safe for concurrent use.
type Profile struct {
	classes   []Class
	synthetic bool
	// defaultFamily indexes families; families and explicit map names to family and class
	// indexes; floors are the bucket floors; table maps family*len(floors)+bucket to a class.
	defaultFamily int
	families      map[string]int
	explicit      map[string]int
	floors        []uint64
	table         []int
}

// ErrInvalidProfile is wrapped by every NewProfile error.
var ErrInvalidProfile = errors.New("invalid policy profile")

// NewProfile validates spec and builds its classifier (selection-service.md §13.4, §18.2). A
// class that sets neither busy threshold gets BusyThresholdFrac = DefaultBusyThresholdFrac.
// Errors wrap ErrInvalidProfile and name the offending key relative to the profile
// (policy_classes[i] ("name").quantum, uncached_isl_buckets[i].min_tokens,
// default_policy_family …): no classes or no buckets; a bad quantum, threshold, ratio or policy;
// a class with only one of policy_family / cache_bucket; an unknown cache_bucket; duplicate class
// or bucket names; a first floor other than 0 or floors not strictly increasing; an explicit class
// named like a family; two classes for one (family, bucket) or a family missing a bucket; a
// default_policy_family that names no family.
func NewProfile(spec ProfileSpec) (*Profile, error) {
	bad := func(format string, args ...any) (*Profile, error) {
		return nil, fmt.Errorf("%w: %s", ErrInvalidProfile, fmt.Sprintf(format, args...))
	}
	if len(spec.Classes) == 0 {
		return bad("policy_classes must not be empty")
	}
	if len(spec.Buckets) == 0 {
		return bad("uncached_isl_buckets must not be empty")
	}
	p := &Profile{families: map[string]int{}, explicit: map[string]int{}}
	bucketIdx := make(map[string]int, len(spec.Buckets))
	for i, b := range spec.Buckets {
		where := fmt.Sprintf("uncached_isl_buckets[%d]", i)
		switch {
		case b.Name == "":
			return bad("%s.bucket must not be empty", where)
		case i == 0 && b.MinTokens != 0:
			return bad("%s.min_tokens must be 0 (the first floor), got %d", where, b.MinTokens)
		case i > 0 && b.MinTokens <= spec.Buckets[i-1].MinTokens:
			return bad("%s.min_tokens %d must be greater than the previous floor %d", where, b.MinTokens, spec.Buckets[i-1].MinTokens)
		}
		if j, dup := bucketIdx[b.Name]; dup {
			return bad("%s: duplicate bucket %q (also uncached_isl_buckets[%d])", where, b.Name, j)
		}
		bucketIdx[b.Name] = i
		p.floors = append(p.floors, b.MinTokens)
	}
	names := make(map[string]int, len(spec.Classes))
	var familyOrder []string
	for i := range spec.Classes {
		c := spec.Classes[i]
		where := fmt.Sprintf("policy_classes[%d] (%q)", i, c.Name)
		if c.Name == "" {
			return bad("policy_classes[%d].name must not be empty", i)
		}
		if j, dup := names[c.Name]; dup {
			return bad("%s: duplicate class name %q (also policy_classes[%d])", where, c.Name, j)
		}
		names[c.Name] = i
		if err := c.validate(where); err != nil {
			return bad("%v", err)
		}
		switch {
		case c.Family == "" && c.Bucket == "":
		case c.Family == "" || c.Bucket == "":
			return bad("%s must set both policy_family and cache_bucket (a matrix class) or neither (an explicit class)", where)
		default:
			if _, ok := bucketIdx[c.Bucket]; !ok {
				return bad("%s.cache_bucket %q is not one of uncached_isl_buckets", where, c.Bucket)
			}
			if _, ok := p.families[c.Family]; !ok {
				p.families[c.Family] = len(familyOrder)
				familyOrder = append(familyOrder, c.Family)
			}
		}
		if !c.Queues() {
			frac := DefaultBusyThresholdFrac
			c.BusyThresholdFrac = &frac
		}
		p.classes = append(p.classes, c)
	}
	nb := len(p.floors)
	p.table = make([]int, len(familyOrder)*nb)
	for i := range p.table {
		p.table[i] = -1
	}
	for i, c := range p.classes {
		if c.Family == "" {
			if _, clash := p.families[c.Name]; clash {
				return bad("policy_classes[%d] (%q): explicit class name collides with policy family %q", i, c.Name, c.Name)
			}
			p.explicit[c.Name] = i
			continue
		}
		slot := p.families[c.Family]*nb + bucketIdx[c.Bucket]
		if prev := p.table[slot]; prev >= 0 {
			return bad("policy_classes[%d] (%q): family %q already has class %q for bucket %q", i, c.Name, c.Family, p.classes[prev].Name, c.Bucket)
		}
		p.table[slot] = i
	}
	for fi, fam := range familyOrder {
		for bi, b := range spec.Buckets {
			if p.table[fi*nb+bi] < 0 {
				return bad("policy family %q has no class for bucket %q (every family needs exactly one class per bucket)", fam, b.Name)
			}
		}
	}
	if spec.DefaultFamily == "" {
		return bad("default_policy_family is required")
	}
	fi, ok := p.families[spec.DefaultFamily]
	if !ok {
		known := append([]string(nil), familyOrder...)
		sort.Strings(known)
		return bad("default_policy_family %q does not name a policy family (families: %v)", spec.DefaultFamily, known)
	}
	p.defaultFamily = fi
	return p, nil
}

// Synthetic returns the single-class profile used when no configured profile applies
// (selection-service.md §13.4): class "default" with prefill_busy_threshold_frac =
// threshold (router_queue_threshold; nil = the class never queues), the given policy, quantum 1
// and no limits.
func Synthetic(threshold *float64, policy Policy) *Profile {
	c := Class{Name: SyntheticClassName, Policy: policy, Quantum: 1}
	if threshold != nil {
		t := *threshold
		c.BusyThresholdFrac = &t
	}
	return &Profile{classes: []Class{c}, synthetic: true}
}

// WithDefaultPolicy returns a copy of p whose classes without a queue_policy use def
// (router_queue_policy; PolicyUnset means FCFS).
func (p *Profile) WithDefaultPolicy(def Policy) *Profile {
	if def == PolicyUnset {
		def = FCFS
	}
	cp := *p
	cp.classes = append([]Class(nil), p.classes...)
	for i := range cp.classes {
		if cp.classes[i].Policy == PolicyUnset {
			cp.classes[i].Policy = def
		}
	}
	return &cp
}

// NumClasses returns the number of classes (class indexes are 0..NumClasses()-1).
func (p *Profile) NumClasses() int { return len(p.classes) }

// Class returns class i (read-only). It panics on an index outside 0..NumClasses()-1.
func (p *Profile) Class(i int) *Class { return &p.classes[i] }

// AnyQueues reports whether some class of the profile can queue (Class.Queues).
func (p *Profile) AnyQueues() bool {
	for i := range p.classes {
		if p.classes[i].Queues() {
			return true
		}
	}
	return false
}

// Synthetic reports whether p is the synthetic single-class profile.
func (p *Profile) Synthetic() bool { return p.synthetic }

// Direct resolves a class without the request's cache state: the synthetic profile's only class,
// or the explicit class the requested name (the trimmed header) names. ok is false when the
// request needs Resolve (a family, an unknown name, or none).
func (p *Profile) Direct(requested string) (class int, ok bool) {
	if p.synthetic {
		return 0, true
	}
	if requested == "" {
		return 0, false
	}
	i, ok := p.explicit[requested]
	return i, ok
}

// Resolve maps a requested name and the request's uncached ISL (tokens: raw ISL − best cached
// tokens over the eligible workers) to a class (selection-service.md §13.4): an explicit class
// name selects it directly; a recognized family selects that family, anything else (missing,
// empty, unknown or a matrix class's own name) the default family; the bucket is the one with the
// highest floor ≤ uncached.
func (p *Profile) Resolve(requested string, uncached uint64) int {
	if i, ok := p.Direct(requested); ok {
		return i
	}
	fi, ok := p.families[requested]
	if !ok {
		fi = p.defaultFamily
	}
	bi := sort.Search(len(p.floors), func(i int) bool { return p.floors[i] > uncached }) - 1
	if bi < 0 {
		bi = 0
	}
	return p.table[fi*len(p.floors)+bi]
}

// Profiles are the configured profiles of a policy file (selection-service.md §18.2): the root
// profile and per-model profiles, each replacing the root entirely for its model.
type Profiles struct {
	// Root is the root profile (nil when the file defines none).
	Root *Profile
	// Models maps a model_name to its profile.
	Models map[string]*Profile
}

// Configured reports whether any profile is configured (which enables queueing, §13.1).
func (ps *Profiles) Configured() bool { return ps != nil && (ps.Root != nil || len(ps.Models) > 0) }

// For returns the profile of model: the exact model profile, else the root profile, else nil
// (the caller then uses Synthetic) (selection-service.md §13.4).
func (ps *Profiles) For(model string) *Profile {
	if ps == nil {
		return nil
	}
	if p, ok := ps.Models[model]; ok && p != nil {
		return p
	}
	return ps.Root
}
