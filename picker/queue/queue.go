package queue

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// Snapshot is a queued request's accounting, taken once at enqueue (selection-service.md §13.2,
// §13.5): its raw input length and its cached tokens, both in tokens, with CachedTokens ≤
// RawISLTokens. Build it with NewSnapshot.
type Snapshot struct {
	// RawISLTokens is the request's input length (tokens).
	RawISLTokens uint64
	// CachedTokens is the pinned worker's cached tokens, or the best over the eligible workers,
	// clamped to RawISLTokens.
	CachedTokens uint64
}

// NewSnapshot returns the snapshot of a request of raw tokens with cached tokens cached
// (clamped to raw).
func NewSnapshot(raw, cached uint64) Snapshot {
	return Snapshot{RawISLTokens: raw, CachedTokens: min(cached, raw)}
}

// Uncached returns raw − cached tokens (the classifier's uncached_isl, §13.4).
func (s Snapshot) Uncached() uint64 { return s.RawISLTokens - min(s.CachedTokens, s.RawISLTokens) }

// Cost returns scheduling_cost_tokens = max(1, raw − cached) (§13.2): the WSPT denominator and
// the DRR charge.
func (s Snapshot) Cost() uint64 { return max(1, s.Uncached()) }

// Score returns the policy_score of §13.2 (higher is dispatched first): FCFS
// priority_jump − arrival_offset, LCFS priority_jump + arrival_offset, WSPT
// (1 + priority_jump) / cost. priority_jump below 0 (or NaN) counts as 0; arrival_offset is
// seconds since the queue's epoch at enqueue, clamped to ≥ 0; cost is scheduling_cost_tokens
// (0 counts as 1). PolicyUnset scores as FCFS. The result is never NaN.
func Score(p Policy, priorityJump, arrivalOffsetSecs float64, cost uint64) float64 {
	if !(priorityJump > 0) {
		priorityJump = 0
	}
	switch {
	case !(arrivalOffsetSecs > 0):
		arrivalOffsetSecs = 0
	case math.IsInf(arrivalOffsetSecs, 1):
		arrivalOffsetSecs = math.MaxFloat64
	}
	switch p {
	case LCFS:
		return priorityJump + arrivalOffsetSecs
	case WSPT:
		return (1 + priorityJump) / float64(max(1, cost))
	}
	return priorityJump - arrivalOffsetSecs
}

// LimitKind names a per-class queue limit (selection-service.md §13.5, §13.6).
type LimitKind uint8

// The limits, in the order they are checked.
const (
	LimitRequests LimitKind = iota
	LimitRawISLTokens
	LimitCachedTokens
)

// String returns the §13.6 limit_kind: "requests", "raw_isl_tokens" or "cached_tokens".
func (k LimitKind) String() string {
	switch k {
	case LimitRequests:
		return "requests"
	case LimitRawISLTokens:
		return "raw_isl_tokens"
	case LimitCachedTokens:
		return "cached_tokens"
	}
	return fmt.Sprintf("limit_kind(%d)", uint8(k))
}

// Rejection is the error Enqueue returns when a class limit is reached (selection-service.md
// §13.6). Current is the class's usage before this request; Limit is the per-worker limit times
// the schedulable endpoints (saturating); both in requests or tokens per Kind.
type Rejection struct {
	// Class is the policy class name.
	Class string
	// Kind is the limit that was reached.
	Kind LimitKind
	// Current is the usage before the rejected request.
	Current uint64
	// Limit is the effective limit.
	Limit uint64
}

// Error returns `router policy class "X" queue <kind> limit reached (current=C, limit=L)`.
func (r *Rejection) Error() string {
	return fmt.Sprintf("router policy class %q queue %s limit reached (current=%d, limit=%d)", r.Class, r.Kind, r.Current, r.Limit)
}

// Stats are a class's queued totals: requests, raw ISL tokens and cached tokens.
type Stats struct {
	// Requests is the number of queued requests.
	Requests uint64
	// RawISLTokens is the sum of their raw input lengths (tokens, saturating).
	RawISLTokens uint64
	// CachedTokens is the sum of their cached tokens (tokens, saturating).
	CachedTokens uint64
}

func (s *Stats) add(sn Snapshot) {
	s.Requests++
	s.RawISLTokens = satAdd(s.RawISLTokens, sn.RawISLTokens)
	s.CachedTokens = satAdd(s.CachedTokens, sn.CachedTokens)
}

func (s *Stats) sub(sn Snapshot) {
	s.Requests = satSub(s.Requests, 1)
	s.RawISLTokens = satSub(s.RawISLTokens, sn.RawISLTokens)
	s.CachedTokens = satSub(s.CachedTokens, sn.CachedTokens)
}

// Entry is one queued request carrying the caller's Value. Its scheduling key is fixed at
// enqueue. An Entry stays valid after it leaves the queue (Queued then reports false).
type Entry[T any] struct {
	// Value is the caller's payload.
	Value T

	class  int
	strict uint32
	score  float64
	seq    uint64
	snap   Snapshot
	offset float64
	pos    int // heap index; -1 once the entry left the queue
}

// Class returns the entry's class index.
func (e *Entry[T]) Class() int { return e.class }

// Snapshot returns the entry's enqueue-time accounting.
func (e *Entry[T]) Snapshot() Snapshot { return e.snap }

// StrictPriority returns the entry's strict tier (larger first).
func (e *Entry[T]) StrictPriority() uint32 { return e.strict }

// PolicyScore returns the entry's §13.2 policy_score (higher first within a tier).
func (e *Entry[T]) PolicyScore() float64 { return e.score }

// ArrivalOffset returns the seconds since the queue's epoch at enqueue.
func (e *Entry[T]) ArrivalOffset() float64 { return e.offset }

// Seq returns the entry's enqueue sequence number (earlier first on equal keys).
func (e *Entry[T]) Seq() uint64 { return e.seq }

// Queued reports whether the entry is still in its queue.
func (e *Entry[T]) Queued() bool { return e.pos >= 0 }

// before reports whether a is dispatched before b within a class: higher strict_priority, then
// higher policy_score, then earlier enqueue.
func before[T any](a, b *Entry[T]) bool {
	if a.strict != b.strict {
		return a.strict > b.strict
	}
	if a.score != b.score {
		return a.score > b.score
	}
	return a.seq < b.seq
}

// class is one policy class's backlog: a binary heap ordered by before, its stats and its DRR
// deficit (tokens).
type class[T any] struct {
	cfg     *Class
	heap    []*Entry[T]
	stats   Stats
	deficit uint64
}

func (c *class[T]) push(e *Entry[T]) {
	e.pos = len(c.heap)
	c.heap = append(c.heap, e)
	c.up(e.pos)
}

func (c *class[T]) remove(i int) *Entry[T] {
	e := c.heap[i]
	last := len(c.heap) - 1
	if i != last {
		c.swap(i, last)
	}
	c.heap[last] = nil
	c.heap = c.heap[:last]
	if i != last {
		if !c.down(i) {
			c.up(i)
		}
	}
	e.pos = -1
	return e
}

func (c *class[T]) swap(i, j int) {
	c.heap[i], c.heap[j] = c.heap[j], c.heap[i]
	c.heap[i].pos, c.heap[j].pos = i, j
}

func (c *class[T]) up(i int) {
	for i > 0 {
		parent := (i - 1) / 2
		if !before(c.heap[i], c.heap[parent]) {
			return
		}
		c.swap(i, parent)
		i = parent
	}
}

func (c *class[T]) down(i int) bool {
	start, n := i, len(c.heap)
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		best := l
		if r := l + 1; r < n && before(c.heap[r], c.heap[l]) {
			best = r
		}
		if !before(c.heap[best], c.heap[i]) {
			break
		}
		c.swap(i, best)
		i = best
	}
	return i > start
}

// Queue is one partition's policy-class queue (selection-service.md §13): one heap per class of
// its profile, per-class limits checked at enqueue, and deficit round robin across classes at
// dispatch. Not safe for concurrent use: the owner serializes calls.
type Queue[T any] struct {
	profile *Profile
	epoch   time.Time
	classes []class[T]
	n       int
	seq     uint64
	cursor  int
	carry   int // class that keeps the cursor after a pop (weighted burst); -1 = none
	cand    []int64
}

// New returns an empty queue over profile's classes (resolve class policies first with
// Profile.WithDefaultPolicy; PolicyUnset classes score as FCFS). epoch is the time arrival
// offsets are measured from.
func New[T any](profile *Profile, epoch time.Time) *Queue[T] {
	q := &Queue[T]{profile: profile, epoch: epoch, carry: -1}
	q.classes = make([]class[T], profile.NumClasses())
	for i := range q.classes {
		q.classes[i].cfg = profile.Class(i)
	}
	q.cand = make([]int64, len(q.classes))
	return q
}

// Profile returns the queue's profile.
func (q *Queue[T]) Profile() *Profile { return q.profile }

// Len returns the number of queued entries.
func (q *Queue[T]) Len() int { return q.n }

// HasBacklog reports whether class has queued entries (false for an unknown class).
func (q *Queue[T]) HasBacklog(class int) bool {
	return class >= 0 && class < len(q.classes) && len(q.classes[class].heap) > 0
}

// Stats returns class's queued totals (zero for an unknown class).
func (q *Queue[T]) Stats(class int) Stats {
	if class < 0 || class >= len(q.classes) {
		return Stats{}
	}
	return q.classes[class].stats
}

// Total returns the queued totals over every class.
func (q *Queue[T]) Total() Stats {
	var t Stats
	for i := range q.classes {
		s := q.classes[i].stats
		t.Requests = satAdd(t.Requests, s.Requests)
		t.RawISLTokens = satAdd(t.RawISLTokens, s.RawISLTokens)
		t.CachedTokens = satAdd(t.CachedTokens, s.CachedTokens)
	}
	return t
}

// Deficit returns class's DRR deficit in tokens (observability and tests).
func (q *Queue[T]) Deficit(class int) uint64 {
	if class < 0 || class >= len(q.classes) {
		return 0
	}
	return q.classes[class].deficit
}

// Entries returns class's queued entries in dispatch order (a copy; nil for an unknown class).
func (q *Queue[T]) Entries(class int) []*Entry[T] {
	if class < 0 || class >= len(q.classes) {
		return nil
	}
	out := append([]*Entry[T](nil), q.classes[class].heap...)
	sortEntries(out)
	return out
}

func sortEntries[T any](es []*Entry[T]) {
	slices.SortFunc(es, func(a, b *Entry[T]) int {
		switch {
		case before(a, b):
			return -1
		case before(b, a):
			return 1
		}
		return 0
	})
}

// Enqueue adds v to class (selection-service.md §13.2, §13.5). The class limits, each the
// per-worker limit times endpoints (the partition's schedulable endpoints; saturating), are
// checked against the class's usage before adding, in the order requests, raw ISL tokens,
// cached tokens: usage ≥ limit rejects, so the request that crosses a limit is accepted and the
// next one is rejected; a zero limit or zero endpoints rejects every enqueue. The entry's key is
// (strictPriority, Score(class policy, priorityJump, now − epoch, snap.Cost()), enqueue order).
// Errors: *Rejection; an error naming the class for an unknown class index.
func (q *Queue[T]) Enqueue(class, endpoints int, snap Snapshot, priorityJump float64, strictPriority uint32, now time.Time, v T) (*Entry[T], error) {
	if class < 0 || class >= len(q.classes) {
		return nil, fmt.Errorf("queue: class index %d out of range [0, %d)", class, len(q.classes))
	}
	c := &q.classes[class]
	snap = NewSnapshot(snap.RawISLTokens, snap.CachedTokens)
	eps := uint64(max(endpoints, 0))
	for _, l := range []struct {
		kind    LimitKind
		perWork *uint64
		current uint64
	}{
		{LimitRequests, c.cfg.RequestLimitPerWorker, c.stats.Requests},
		{LimitRawISLTokens, c.cfg.RawISLTokenLimitPerWorker, c.stats.RawISLTokens},
		{LimitCachedTokens, c.cfg.CachedTokenLimitPerWorker, c.stats.CachedTokens},
	} {
		if l.perWork == nil {
			continue
		}
		if limit := satMul(*l.perWork, eps); l.current >= limit {
			return nil, &Rejection{Class: c.cfg.Name, Kind: l.kind, Current: l.current, Limit: limit}
		}
	}
	offset := max(0, now.Sub(q.epoch).Seconds())
	e := &Entry[T]{
		Value:  v,
		class:  class,
		strict: strictPriority,
		score:  Score(c.cfg.Policy, priorityJump, offset, snap.Cost()),
		seq:    q.seq,
		snap:   snap,
		offset: offset,
	}
	q.seq++
	c.push(e)
	c.stats.add(snap)
	q.n++
	return e, nil
}

// Remove takes e out of the queue (a caller that went away) and reports whether it was queued.
// An emptied class's deficit resets to 0.
func (q *Queue[T]) Remove(e *Entry[T]) bool {
	if e == nil || e.pos < 0 || e.class < 0 || e.class >= len(q.classes) {
		return false
	}
	c := &q.classes[e.class]
	if e.pos >= len(c.heap) || c.heap[e.pos] != e {
		return false
	}
	c.remove(e.pos)
	c.stats.sub(e.snap)
	q.n--
	if len(c.heap) == 0 {
		c.deficit = 0
	}
	return true
}

// Drain removes and returns every queued entry (class by class, each in dispatch order) and
// resets every deficit and the cursor.
func (q *Queue[T]) Drain() []*Entry[T] {
	out := make([]*Entry[T], 0, q.n)
	for i := range q.classes {
		c := &q.classes[i]
		es := append([]*Entry[T](nil), c.heap...)
		sortEntries(es)
		for _, e := range es {
			e.pos = -1
		}
		out = append(out, es...)
		clear(c.heap)
		c.heap = c.heap[:0]
		c.stats = Stats{}
		c.deficit = 0
	}
	q.n, q.cursor, q.carry = 0, 0, -1
	return out
}

// PopNext removes and returns the next entry to dispatch by deficit round robin across classes
// (selection-service.md §13.5), or nil when no class head is dispatchable. dispatchable(class,
// head) reports whether a class's head may be admitted now (for example, whether the pool is not
// busy for it); it is called at most once per class per call.
//
// A class that kept the cursor after its last pop (it can afford its next head: a weighted
// burst) is tried first. Then, starting at the cursor, each class with a dispatchable head pops
// it if its cost (scheduling_cost_tokens) fits the class deficit; otherwise the class earns its
// quantum and pops if now affordable. If a full pass pops nothing, every dispatchable class
// earns quantum × r, r being the fewest whole rounds any dispatchable head needs, and the first
// affordable class from the cursor pops. Blocked classes keep their credit and earn none; a
// fully blocked ring earns nothing. After a pop the cost is subtracted and the cursor moves past
// the class; an emptied class resets its deficit. Deficits saturate.
func (q *Queue[T]) PopNext(dispatchable func(class int, head *Entry[T]) bool) *Entry[T] {
	if q.n == 0 {
		q.carry = -1
		return nil
	}
	nc := len(q.classes)
	const unknown, blocked = -2, -1
	for i := range q.cand {
		q.cand[i] = unknown
	}
	// cost returns class i's head cost if it is dispatchable, else blocked (asking once).
	cost := func(i int) int64 {
		if q.cand[i] != unknown {
			return q.cand[i]
		}
		c := &q.classes[i]
		q.cand[i] = blocked
		if len(c.heap) > 0 && dispatchable(i, c.heap[0]) {
			q.cand[i] = int64(min(c.heap[0].snap.Cost(), math.MaxInt64))
		}
		if len(c.heap) == 0 {
			c.deficit = 0
		}
		return q.cand[i]
	}
	if k := q.carry; k >= 0 && k < nc {
		q.carry = -1
		if h := cost(k); h >= 0 && uint64(h) <= q.classes[k].deficit {
			return q.pop(k)
		}
	}
	q.carry = -1
	for off := 0; off < nc; off++ {
		i := (q.cursor + off) % nc
		h := cost(i)
		if h < 0 {
			continue
		}
		c := &q.classes[i]
		if uint64(h) <= c.deficit {
			return q.pop(i)
		}
		c.deficit = satAdd(c.deficit, c.cfg.Quantum)
		if uint64(h) <= c.deficit {
			return q.pop(i)
		}
	}
	// Fast-forward the fewest whole rounds any dispatchable head needs.
	rounds := uint64(math.MaxUint64)
	for i := 0; i < nc; i++ {
		h := q.cand[i]
		if h < 0 {
			continue
		}
		c := &q.classes[i]
		missing := uint64(h) - c.deficit // h > deficit after the pass
		quantum := max(c.cfg.Quantum, 1)
		rounds = min(rounds, missing/quantum+boolU64(missing%quantum != 0))
	}
	if rounds == math.MaxUint64 {
		return nil // every head is blocked: nothing is credited
	}
	for i := 0; i < nc; i++ {
		if q.cand[i] >= 0 {
			c := &q.classes[i]
			c.deficit = satAdd(c.deficit, satMul(c.cfg.Quantum, rounds))
		}
	}
	for off := 0; off < nc; off++ {
		i := (q.cursor + off) % nc
		if h := q.cand[i]; h >= 0 && uint64(h) <= q.classes[i].deficit {
			return q.pop(i)
		}
	}
	return nil
}

// pop removes class i's head, charges its cost and moves the cursor.
func (q *Queue[T]) pop(i int) *Entry[T] {
	q.cursor = (i + 1) % len(q.classes)
	c := &q.classes[i]
	e := c.remove(0)
	c.deficit = satSub(c.deficit, e.snap.Cost())
	c.stats.sub(e.snap)
	q.n--
	if len(c.heap) == 0 {
		c.deficit = 0
	} else if c.deficit > 0 {
		q.carry = i
	}
	return e
}

func boolU64(b bool) uint64 {
	if b {
		return 1
	}
	return 0
}

func satAdd(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return math.MaxUint64
}

func satSub(a, b uint64) uint64 {
	if a < b {
		return 0
	}
	return a - b
}

func satMul(a, b uint64) uint64 {
	if a == 0 || b == 0 {
		return 0
	}
	if a > math.MaxUint64/b {
		return math.MaxUint64
	}
	return a * b
}
