// Package subagentgroupaffinity is the `subagent-group-affinity` worker-selection policy
// (selection-service.md §12.2, §17): the subagents of one parent session replay the parent's
// prompt prefix, so they — and the parent itself — should land on the same worker. The group of
// a request is its session_context.parent_session_id, or its own session_id when it has no
// parent (the parent's own turns belong to the group its subagents form).
//
// Candidates are ranked by the built-in cost (defaultcost.Scorer, §9.2, with the partition's
// router configuration). The picker remembers, per group, the worker the group last went to and
// subtracts group_cost_discount from that worker's cost, so the group stays together unless
// another worker is cheaper by more than the discount; then the group moves and its binding
// follows. Requests without a session, and groups not (or no longer) bound, get the plain
// built-in ranking. Exact ties are broken uniformly at random with ctx.Rand().
//
// State is policy-local: one bounded table per policy instance, i.e. per partition (§17.2 rule
// 9). It holds at most max_groups bindings and evicts the least recently used one when full (no
// TTL). Group ids longer than MaxGroupIDBytes are never bound, so the table's memory is bounded by
// max_groups × (MaxGroupIDBytes + about 80 bytes of bookkeeping): ≈ 1.3 MiB per partition at the
// default 4096 groups.
package subagentgroupaffinity

import (
	"cmp"
	"fmt"
	"math"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
	"github.com/kvepp/kvepp/policies/leastbusy"
)

// TypeName is the registered policy type (selection-service.md §17.4).
const TypeName = "subagent-group-affinity"

// Defaults and bounds of the parameters.
const (
	// DefaultMaxGroups is the default number of group bindings kept per partition.
	DefaultMaxGroups = 4096
	// DefaultGroupCostDiscount is the default discount, in cost units (≈ KV blocks of work).
	DefaultGroupCostDiscount = 32.0
	// MaxGroupIDBytes is the longest group id that is bound; longer ids get the plain ranking.
	MaxGroupIDBytes = 256
)

// GroupID returns the request's group: the parent session id, else the session id, else "" (no
// session context, or ids longer than MaxGroupIDBytes: no group).
func GroupID(ctx *policies.WorkerSelectionContext) string {
	s := ctx.SessionContext()
	if s == nil {
		return ""
	}
	id := s.ParentSessionID()
	if id == "" {
		id = s.SessionID()
	}
	if len(id) > MaxGroupIDBytes {
		return ""
	}
	return id
}

// Picker is the group-affinity picker (see the package comment). It declares no group: it reads
// the summed costs and the rows' worker identities. Not safe for concurrent use; the host calls it
// from the partition's serialized context.
type Picker struct {
	discount float64
	groups   groupTable
}

var _ policies.WorkerPicker = (*Picker)(nil)

// NewPicker returns a picker with an empty table of at most maxGroups bindings (values < 1 mean
// 1) that discounts the bound worker's cost by discount (finite, ≥ 0, cost units). The zero
// Picker has no discount and the default bound.
func NewPicker(discount float64, maxGroups int) *Picker {
	return &Picker{discount: discount, groups: groupTable{limit: max(maxGroups, 1)}}
}

// RequiredWorkerInputs declares no group.
func (p *Picker) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }

// Groups returns the number of group bindings held (≤ max_groups).
func (p *Picker) Groups() int { return len(p.groups.slots) }

// Pick returns the row with the lowest cost after the group discount, and binds the request's
// group to the chosen worker — unless the view has a single row: a choice the host constrained
// (allowed_worker_ids, required taints, a single schedulable worker) says nothing about where the
// group should go, so the binding is left as is.
// It fails with "no eligible worker" on an empty view.
func (p *Picker) Pick(ctx *policies.WorkerSelectionContext, view *policies.WorkerInputView) (int, error) {
	rows := view.Candidates()
	if len(rows) == 0 {
		return 0, policies.Failed("no eligible worker")
	}
	group := GroupID(ctx)
	bound, isBound := policies.Worker{}, false
	if group != "" {
		bound, isBound = p.groups.get(group)
	}
	cost := func(row int) float64 {
		c := rows[row].Cost()
		if isBound && rows[row].Worker() == bound {
			c -= p.discount
		}
		return c
	}
	best := leastbusy.BestRow(ctx, len(rows), func(a, b int) int { return cmp.Compare(cost(a), cost(b)) })
	if group != "" && len(rows) > 1 {
		p.groups.put(group, rows[best].Worker())
	}
	return best, nil
}

// groupTable is a bounded LRU map from group id to worker. Slots live in one slice linked into a
// recency list by index, so a full table reuses the least recently used slot without allocating.
type groupTable struct {
	limit      int
	index      map[string]int32
	slots      []groupSlot
	head, tail int32 // most and least recently used slot; valid when slots is non-empty
}

type groupSlot struct {
	id         string
	worker     policies.Worker
	prev, next int32 // neighbours in the recency list, -1 at the ends
}

// get returns the worker bound to id, without changing its recency.
func (g *groupTable) get(id string) (policies.Worker, bool) {
	i, ok := g.index[id]
	if !ok {
		return policies.Worker{}, false
	}
	return g.slots[i].worker, true
}

// put binds id to w and marks it most recently used, evicting the least recently used binding
// when the table is full.
func (g *groupTable) put(id string, w policies.Worker) {
	if i, ok := g.index[id]; ok {
		g.slots[i].worker = w
		g.unlink(i)
		g.pushFront(i)
		return
	}
	if g.index == nil {
		g.index = make(map[string]int32)
	}
	limit := g.limit
	if limit <= 0 { // zero Picker: the default bound
		limit = DefaultMaxGroups
	}
	var i int32
	if len(g.slots) < limit {
		g.slots = append(g.slots, groupSlot{})
		i = int32(len(g.slots) - 1)
	} else {
		i = g.tail
		delete(g.index, g.slots[i].id)
		g.unlink(i)
	}
	g.slots[i].id, g.slots[i].worker = id, w
	g.index[id] = i
	g.pushFront(i)
}

// unlink removes slot i from the recency list.
func (g *groupTable) unlink(i int32) {
	s := &g.slots[i]
	if s.prev >= 0 {
		g.slots[s.prev].next = s.next
	} else {
		g.head = s.next
	}
	if s.next >= 0 {
		g.slots[s.next].prev = s.prev
	} else {
		g.tail = s.prev
	}
}

// pushFront links slot i (already in index, not in the list) as the most recently used.
func (g *groupTable) pushFront(i int32) {
	s := &g.slots[i]
	s.prev, s.next = -1, -1
	if len(g.index) == 1 { // i is the only binding: the list was empty

		g.head, g.tail = i, i
		return
	}
	s.next = g.head
	g.slots[g.head].prev = i
	g.head = i
}

// Parameters are the YAML parameters of a subagent-group-affinity instance; both optional.
type Parameters struct {
	// GroupCostDiscount is group_cost_discount: subtracted from the cost of the group's worker
	// (cost units, ≈ KV blocks of work); finite, ≥ 0, default 32.
	GroupCostDiscount *float64 `json:"group_cost_discount,omitempty"`
	// MaxGroups is max_groups: bindings kept per partition (LRU eviction); integer ≥ 1, default
	// 4096.
	MaxGroups *int `json:"max_groups,omitempty"`
}

// Settings are validated parameters.
type Settings struct {
	GroupCostDiscount float64 // cost units
	MaxGroups         int     // bindings per partition
}

// Settings applies the defaults and validates; errors name the parameter.
func (p Parameters) Settings() (Settings, error) {
	s := Settings{GroupCostDiscount: DefaultGroupCostDiscount, MaxGroups: DefaultMaxGroups}
	if v := p.GroupCostDiscount; v != nil {
		if math.IsNaN(*v) || math.IsInf(*v, 0) || *v < 0 {
			return Settings{}, fmt.Errorf("%s: parameter group_cost_discount must be a finite number ≥ 0, got %v", TypeName, *v)
		}
		s.GroupCostDiscount = *v
	}
	if v := p.MaxGroups; v != nil {
		if *v < 1 {
			return Settings{}, fmt.Errorf("%s: parameter max_groups must be an integer ≥ 1, got %d", TypeName, *v)
		}
		s.MaxGroups = *v
	}
	return s, nil
}

// New returns the factory building, per partition, defaultcost.Scorer (parameters from the router
// configuration, which must be valid: errors name the setting) and a fresh Picker, so every
// partition has its own group table.
func New(s Settings) policies.PolicyFactory {
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		params := cfg
		if err := params.Validate(); err != nil {
			return nil, fmt.Errorf("%s: %w", TypeName, err)
		}
		return policies.NewPolicy(cfg, workerType,
			[]policies.WorkerScorer{defaultcost.NewScorer(params)},
			NewPicker(s.GroupCostDiscount, s.MaxGroups))
	}
}

// Provider is the policies.Provider of type subagent-group-affinity: strict decoding (unknown
// fields are errors), validation (Parameters.Settings), then New. Errors name the type and
// parameter.
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var p Parameters
	if err := params.Decode(&p); err != nil {
		return nil, fmt.Errorf("%s: %w", TypeName, err)
	}
	s, err := p.Settings()
	if err != nil {
		return nil, err
	}
	return New(s), nil
}
