// Package policies is kvepp's worker-selection policy API (selection-service.md §17,
// custom-routing-strategies.txt): the WorkerFilter, WorkerScorer and WorkerPicker interfaces a
// custom policy implements, the inputs they see, the policy errors, the provider/factory types the
// catalog registers, and the host contract itself, (*WorkerSelectionPolicy).Select, so every host
// (HTTP service, ext_proc EPP) runs filters, scorers and pickers identically.
//
// The package has no policy implementations and no dependencies beyond the standard library.
package policies

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"sync/atomic"
)

// WorkerFilter keeps or rejects one host-eligible candidate: a hard requirement
// (selection-service.md §17.1). Keep returns true to keep the candidate. An error fails the whole
// selection (HTTP 500).
type WorkerFilter interface {
	// RequiredWorkerInputs declares the groups Keep reads; it is called once when the policy is built.
	RequiredWorkerInputs() WorkerInputs
	// Keep decides for one candidate; c is valid only during the call.
	Keep(ctx *WorkerSelectionContext, c *WorkerCandidate) (bool, error)
}

// WorkerScorer assigns one finite cost to one remaining candidate; the host sums the scorers'
// costs in declaration order (lower is better by convention). A non-finite cost fails the
// selection with *NonFiniteCostError.
type WorkerScorer interface {
	// RequiredWorkerInputs declares the groups Score reads; it is called once when the policy is built.
	RequiredWorkerInputs() WorkerInputs
	// Score returns the candidate's cost contribution; c is valid only during the call.
	Score(ctx *WorkerSelectionContext, c *WorkerCandidate) (float64, error)
}

// WorkerPicker chooses one row of the scored candidates. A row outside [0, view.Len()) fails the
// selection with *InvalidPickerRowError.
type WorkerPicker interface {
	// RequiredWorkerInputs declares the groups Pick reads through the view (usually InputsNone); it
	// is called once when the policy is built.
	RequiredWorkerInputs() WorkerInputs
	// Pick returns a row index into view.Candidates(); view is valid only during the call.
	Pick(ctx *WorkerSelectionContext, view *WorkerInputView) (int, error)
}

// InputSource computes a candidate's optional groups on demand (host side). i is the index of the
// candidate in the workers slice passed to Select. Select calls each method at most once per
// candidate per Select, only for groups some component declared, and only for candidates still
// alive at the stage that needs them.
type InputSource interface {
	Cache(i int) CacheInputs
	Load(i int) LoadInputs
	Routing(i int) RoutingInputs
}

// Result is the outcome of Select.
type Result struct {
	// Row is the chosen candidate's index in the workers slice passed to Select.
	Row int
	// Worker is the chosen candidate.
	Worker Worker
	// Cost is the chosen candidate's summed scorer cost.
	Cost float64
	// PickerRow is the row the picker returned (index into Candidates).
	PickerRow int
	// Candidates are the filter survivors with their costs in picker-row order. The slice aliases
	// the policy's buffer: it is valid only until the policy's next Select.
	Candidates []ScoredWorkerCandidate
}

// Stats are a policy instance's cumulative counters.
type Stats struct {
	// Selections counts Select calls that reached the filter stage.
	Selections uint64
	// Filtered counts candidates rejected by filters.
	Filtered uint64
	// MinActivePrefillComputations counts how often the host computed MinActivePrefillTokens.
	MinActivePrefillComputations uint64
	// CacheComputed, LoadComputed and RoutingComputed count InputSource calls per group.
	CacheComputed, LoadComputed, RoutingComputed uint64
}

// WorkerSelectionPolicy is one policy instance: ordered filters, ordered scorers and a picker
// (selection-service.md §17.1). A factory creates one per partition; the host calls Select only
// from the partition's serialized context. Concurrent Select calls on one instance are refused
// with a *PolicyError rather than corrupting the reused buffers.
type WorkerSelectionPolicy struct {
	cfg        RouterConfig
	workerType string
	filters    []WorkerFilter
	scorers    []WorkerScorer
	picker     WorkerPicker

	filterMasks []WorkerInputs
	scorerMasks []WorkerInputs
	pickerMask  WorkerInputs
	scorerUnion WorkerInputs
	union       WorkerInputs

	busy atomic.Bool

	// Per-Select state; buffers are reused across calls (no allocation per candidate).
	workers []Worker
	src     InputSource
	have    []WorkerInputs
	cache   []CacheInputs
	load    []LoadInputs
	routing []RoutingInputs
	aliveA  []int32
	aliveB  []int32
	cur     []int32 // candidates alive at the current stage (indexes into workers)
	scored  []ScoredWorkerCandidate
	cand    WorkerCandidate
	view    WorkerInputView

	stage     stageID
	component int
	inFilter  bool
	minValid  bool
	minValue  int
	stats     Stats
}

// NewPolicy builds a policy without filters: scorers summed in order, then picker
// (upstream WorkerSelectionPolicy::new). cfg and workerType are recorded for the components'
// factory and exposed by Config and WorkerType. Errors: nil picker or nil scorer.
func NewPolicy(cfg RouterConfig, workerType string, scorers []WorkerScorer, picker WorkerPicker) (*WorkerSelectionPolicy, error) {
	return NewPolicyWithFilters(cfg, workerType, nil, scorers, picker)
}

// NewPolicyWithFilters builds a policy with filters run in declaration order before scoring
// (upstream WorkerSelectionPolicy::new_with_filters). Errors: nil picker, nil filter or nil
// scorer (naming its index). Every component's RequiredWorkerInputs is read once here.
func NewPolicyWithFilters(cfg RouterConfig, workerType string, filters []WorkerFilter, scorers []WorkerScorer, picker WorkerPicker) (*WorkerSelectionPolicy, error) {
	if isNil(picker) {
		return nil, errors.New("worker selection policy: picker must not be nil")
	}
	p := &WorkerSelectionPolicy{
		cfg:        cfg,
		workerType: workerType,
		filters:    append([]WorkerFilter(nil), filters...),
		scorers:    append([]WorkerScorer(nil), scorers...),
		picker:     picker,
	}
	for i, f := range p.filters {
		if isNil(f) {
			return nil, fmt.Errorf("worker selection policy: filter %d is nil", i)
		}
		m := f.RequiredWorkerInputs() & InputsAll
		p.filterMasks = append(p.filterMasks, m)
		p.union |= m
	}
	for i, s := range p.scorers {
		if isNil(s) {
			return nil, fmt.Errorf("worker selection policy: scorer %d is nil", i)
		}
		m := s.RequiredWorkerInputs() & InputsAll
		p.scorerMasks = append(p.scorerMasks, m)
		p.scorerUnion |= m
		p.union |= m
	}
	p.pickerMask = picker.RequiredWorkerInputs() & InputsAll
	p.union |= p.pickerMask
	return p, nil
}

// isNil reports whether an interface value is nil or holds a nil pointer, map, slice or func.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan, reflect.Interface:
		return rv.IsNil()
	}
	return false
}

// Config returns the router configuration the policy was built with.
func (p *WorkerSelectionPolicy) Config() RouterConfig { return p.cfg }

// WorkerType returns the worker type the policy was built for ("select" in kvepp).
func (p *WorkerSelectionPolicy) WorkerType() string { return p.workerType }

// RequiredInputs returns the union of the groups every component declared.
func (p *WorkerSelectionPolicy) RequiredInputs() WorkerInputs { return p.union }

// Stats returns the cumulative counters. Call it from the partition's serialized context.
func (p *WorkerSelectionPolicy) Stats() Stats { return p.stats }

// Select runs the policy over the eligible candidates (the host contract of
// selection-service.md §17.2):
//
//  1. Filters run in declaration order; each sees only candidates that passed every earlier
//     filter, and only the groups it declared. If none survive → ErrAllFiltered, without
//     computing any group only scorers or the picker need.
//  2. Scorers run in declaration order per candidate; contributions are summed. A non-finite
//     contribution or running total → *NonFiniteCostError{ScorerIndex, Row}.
//  3. The picker sees every survivor and its cost; a row outside range → *InvalidPickerRowError.
//  4. A component error or panic → *PolicyError (message kept). No error reserves anything.
//
// Groups are computed lazily through src at most once per candidate. Select allocates nothing per
// candidate once the policy's buffers have grown to len(workers). workers must be non-empty
// (else ErrNoCandidates); the host shuffles or orders it as it likes.
func (p *WorkerSelectionPolicy) Select(ctx *WorkerSelectionContext, workers []Worker, src InputSource) (res Result, err error) {
	if len(workers) == 0 {
		return Result{}, ErrNoCandidates
	}
	if ctx == nil {
		return Result{}, errors.New("worker selection policy: nil selection context")
	}
	if src == nil && p.union != InputsNone {
		return Result{}, errors.New("worker selection policy: nil input source for a policy that declares inputs")
	}
	if !p.busy.CompareAndSwap(false, true) {
		return Result{}, &PolicyError{msg: "worker selection policy instance called concurrently", Stage: StageInputs}
	}
	p.prepare(ctx, workers, src)
	defer func() {
		if r := recover(); r != nil {
			res = Result{}
			err = &PolicyError{
				msg:       fmt.Sprintf("worker selection policy %s %d panicked: %v", p.stage.name(), p.component, r),
				Stage:     p.stage.name(),
				Component: p.component,
				Panic:     r,
			}
		}
		p.finish(ctx)
	}()
	return p.run(ctx)
}

func (p *WorkerSelectionPolicy) prepare(ctx *WorkerSelectionContext, workers []Worker, src InputSource) {
	n := len(workers)
	p.workers, p.src = workers, src
	if cap(p.have) < n {
		c := n + n/4
		p.have = make([]WorkerInputs, n, c)
		p.cache = make([]CacheInputs, n, c)
		p.load = make([]LoadInputs, n, c)
		p.routing = make([]RoutingInputs, n, c)
		p.aliveA = make([]int32, n, c)
		p.aliveB = make([]int32, n, c)
		p.scored = make([]ScoredWorkerCandidate, 0, c)
	}
	p.have = p.have[:n]
	clear(p.have)
	p.cache, p.load, p.routing = p.cache[:n], p.load[:n], p.routing[:n]
	p.aliveA, p.aliveB = p.aliveA[:n], p.aliveB[:n]
	for i := range p.aliveA {
		p.aliveA[i] = int32(i)
	}
	p.cur = p.aliveA
	p.minValid = false
	p.stage, p.component = stageFilter, 0
	ctx.active = p
}

func (p *WorkerSelectionPolicy) finish(ctx *WorkerSelectionContext) {
	ctx.active = nil
	p.src = nil
	p.workers = nil
	p.view = WorkerInputView{}
	p.busy.Store(false)
}

// wrapComponentError turns any component error into a *PolicyError keeping its message.
func (p *WorkerSelectionPolicy) wrapComponentError(err error) error {
	return &PolicyError{msg: err.Error(), Stage: p.stage.name(), Component: p.component, cause: err}
}

func (p *WorkerSelectionPolicy) run(ctx *WorkerSelectionContext) (Result, error) {
	p.stats.Selections++
	// 1. Filters.
	p.inFilter = true
	next := p.aliveB
	for fi, f := range p.filters {
		p.stage, p.component = stageFilter, fi
		mask := p.filterMasks[fi]
		p.cand.mask = mask
		kept := next[:0]
		for _, i := range p.cur {
			p.loadCandidate(i, mask)
			keep, err := f.Keep(ctx, &p.cand)
			if err != nil {
				return Result{}, p.wrapComponentError(err)
			}
			if keep {
				kept = append(kept, i)
			}
		}
		p.stats.Filtered += uint64(len(p.cur) - len(kept))
		next, p.cur = p.cur[:cap(p.cur)], kept
		if len(p.cur) == 0 {
			p.inFilter = false
			return Result{}, ErrAllFiltered
		}
	}
	p.inFilter = false

	// 2. Scorers, candidate-major, summed in declaration order. Every group some scorer declares
	// is computed once per survivor up front; each scorer then sees only its own groups.
	p.stage = stageScorer
	// Locals instead of fields in the per-candidate loop (fewer loads; the compiler can keep them in
	// registers), and the rows written by index into a buffer sized once.
	cur := p.cur
	scored := p.scored[:len(cur)]
	workers, have := p.workers, p.have
	cacheCol, loadCol, routingCol := p.cache[:len(have)], p.load[:len(have)], p.routing[:len(have)]
	scorers, masks, union := p.scorers, p.scorerMasks[:len(p.scorers)], p.scorerUnion
	c := &p.cand
	for row, i := range cur {
		if union&^have[i] != 0 {
			p.compute(i, union)
		}
		c.worker = workers[i]
		total := 0.0
		for si, s := range scorers {
			p.component = si
			m := masks[si]
			c.mask = m
			if m&InputsCache != 0 {
				c.cache = cacheCol[i]
			}
			if m&InputsLoad != 0 {
				c.load = loadCol[i]
			}
			if m&InputsRouting != 0 {
				c.routing = routingCol[i]
			}
			v, err := s.Score(ctx, c)
			if err != nil {
				p.scored = scored[:row]
				return Result{}, p.wrapComponentError(err)
			}
			// total was finite, so total+v is non-finite iff v is or the sum overflows.
			total += v
			if total-total != 0 {
				bad := total
				if v-v != 0 {
					bad = v
				}
				p.scored = scored[:row]
				return Result{}, &NonFiniteCostError{ScorerIndex: si, Row: row, Worker: c.worker, Value: bad}
			}
		}
		scored[row] = ScoredWorkerCandidate{worker: c.worker, cost: total}
	}
	p.scored = scored

	// 3. Picker.
	p.stage, p.component = stagePicker, 0
	if p.pickerMask != InputsNone {
		for _, i := range p.cur {
			p.ensure(i, p.pickerMask)
		}
	}
	p.view = WorkerInputView{candidates: p.scored, rows: p.cur, cache: p.cache, load: p.load, routing: p.routing, mask: p.pickerMask}
	row, err := p.picker.Pick(ctx, &p.view)
	if err != nil {
		return Result{}, p.wrapComponentError(err)
	}
	if row < 0 || row >= len(p.scored) {
		return Result{}, &InvalidPickerRowError{Row: row, CandidateCount: len(p.scored)}
	}
	i := int(p.cur[row])
	return Result{Row: i, Worker: p.workers[i], Cost: p.scored[row].cost, PickerRow: row, Candidates: p.scored}, nil
}

// stageID is the internal, allocation-free form of Stage.
type stageID uint8

const (
	stageFilter stageID = iota
	stageScorer
	stagePicker
	stageInputs
)

func (s stageID) name() Stage {
	return [...]Stage{StageFilter, StageScorer, StagePicker, StageInputs}[s]
}

// ensure computes the groups in mask that candidate i does not have yet.
func (p *WorkerSelectionPolicy) ensure(i int32, mask WorkerInputs) {
	if mask&^p.have[i] != 0 {
		p.compute(i, mask)
	}
}

func (p *WorkerSelectionPolicy) compute(i int32, mask WorkerInputs) {
	need := mask &^ p.have[i]
	stage := p.stage
	p.stage = stageInputs
	if need&InputsCache != 0 {
		p.cache[i] = p.src.Cache(int(i))
		p.stats.CacheComputed++
	}
	if need&InputsLoad != 0 {
		p.load[i] = p.src.Load(int(i))
		p.stats.LoadComputed++
	}
	if need&InputsRouting != 0 {
		p.routing[i] = p.src.Routing(int(i))
		p.stats.RoutingComputed++
	}
	p.have[i] |= need
	p.stage = stage
}

// loadCandidate loads candidate i's identity and the groups in mask into the reused candidate
// (whose mask the caller has set), computing missing groups first.
func (p *WorkerSelectionPolicy) loadCandidate(i int32, mask WorkerInputs) {
	if mask&^p.have[i] != 0 {
		p.compute(i, mask)
	}
	c := &p.cand
	c.worker = p.workers[i]
	if mask&InputsCache != 0 {
		c.cache = p.cache[i]
	}
	if mask&InputsLoad != 0 {
		c.load = p.load[i]
	}
	if mask&InputsRouting != 0 {
		c.routing = p.routing[i]
	}
}

// minActivePrefill computes the minimum active prefill tokens over the current candidates,
// memoised once filtering is over.
func (p *WorkerSelectionPolicy) minActivePrefill() int {
	if !p.inFilter && p.minValid {
		return p.minValue
	}
	p.stats.MinActivePrefillComputations++
	m := math.MaxInt
	for _, i := range p.cur {
		p.ensure(i, InputsLoad)
		if v := p.load[i].prefill; v < m {
			m = v
		}
	}
	if m == math.MaxInt {
		m = 0
	}
	if !p.inFilter {
		p.minValid, p.minValue = true, m
	}
	return m
}
