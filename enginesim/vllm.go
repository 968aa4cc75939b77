package enginesim

import (
	"slices"
	"sync/atomic"
	"time"
)

// vllmReq is one request in the vLLM engine model. The scheduler fields are guarded by the
// worker's mutex; emitted, done, canceled and poke connect the engine to the request's handler.
type vllmReq struct {
	id        string
	path      string
	tokens    []uint32 // prompt
	hashes    []uint64 // engine hashes of the prompt's full blocks
	maxTokens int
	arrival   time.Duration // simulated time since the engine started
	arrivalAt time.Time     // wall clock, for the record

	numTokens   int // prompt + generated tokens
	computed    int // tokens whose KV is computed
	generated   int // output tokens sampled
	pinned      []*cacheBlock
	anon        int  // anonymous blocks held
	noCache     bool // the prefix cache was reset while the request ran: store nothing more
	scheduled   bool // scheduled at least once
	firstSched  time.Duration
	firstToken  time.Duration
	lastToken   time.Duration
	cached      int // prefix-hit tokens at the first scheduling
	preemptions int
	finished    bool // folded into the stats

	emitted  atomic.Int64 // output tokens available to the handler
	done     atomic.Bool  // rec is final
	canceled atomic.Bool  // the handler went away
	poke     chan struct{}
	rec      RequestRecord
}

func newVLLMReq(g *genRequest, hashes []uint64, arrival time.Duration) *vllmReq {
	return &vllmReq{
		id: g.id, path: g.path, tokens: g.tokens, hashes: hashes, maxTokens: g.maxTokens,
		arrival: arrival, arrivalAt: g.arrival, numTokens: len(g.tokens), poke: make(chan struct{}, 1),
	}
}

// heldBlocks is the number of KV blocks the request holds.
func (r *vllmReq) heldBlocks() int { return len(r.pinned) + r.anon }

// wake tells the handler that something changed.
func (r *vllmReq) wake() {
	select {
	case r.poke <- struct{}{}:
	default:
	}
}

// stepItem is one request's share of a step: n tokens starting at computed position from.
type stepItem struct {
	r    *vllmReq
	n    int
	from int
}

// plannedStep is what one step computes and how long it takes.
type plannedStep struct {
	items   []stepItem
	work    StepWork
	dur     time.Duration
	removed []uint64 // blocks evicted to make room, in eviction order
}

// vllmScheduler is the vLLM V1 scheduler model: a waiting queue and a running list sharing one
// token budget per step, a fixed pool of KV blocks with prefix caching on the free blocks, and
// recompute preemption. It is a pure state machine (no goroutines, no clock); the worker's engine
// loop (vllmloop.go) plans a step, waits for its duration and applies it. Not safe for concurrent
// use.
type vllmScheduler struct {
	prof       StepProfile
	bs         int
	budget     int // max_num_batched_tokens
	maxRunning int // max_num_seqs
	cache      *prefixCache

	waiting []*vllmReq // FIFO; preempted requests go back to the front
	running []*vllmReq // in admission order

	peak        int
	steps       uint64
	preemptions uint64
	busy        time.Duration // simulated time spent in steps
}

func newVLLMScheduler(prof StepProfile, bs, budget, maxRunning int, cache *prefixCache) *vllmScheduler {
	return &vllmScheduler{prof: prof, bs: bs, budget: budget, maxRunning: maxRunning, cache: cache}
}

// blocksFor is the number of blocks n tokens occupy.
func (s *vllmScheduler) blocksFor(n int) int { return (n + s.bs - 1) / s.bs }

// idle reports whether there is nothing to schedule.
func (s *vllmScheduler) idle() bool { return len(s.waiting) == 0 && len(s.running) == 0 }

// enqueue adds a new request at the back of the waiting queue.
func (s *vllmScheduler) enqueue(r *vllmReq) { s.waiting = append(s.waiting, r) }

// release frees every block r holds: cached blocks back to the free list last block first (so a
// prompt's tail is evicted before its head, as vLLM's free-block queue orders them), anonymous
// blocks back to the unused pool.
func (s *vllmScheduler) release(r *vllmReq) {
	s.cache.release(r.pinned)
	s.cache.releaseAnon(r.anon)
	r.pinned, r.anon = r.pinned[:0], 0
}

// preempt evicts r from the running list by recompute preemption (vLLM V1): its blocks are
// freed (its cached prompt blocks stay cached, so it may hit them again), its progress is lost,
// and it goes back to the front of the waiting queue. Tokens it already emitted stay emitted; on
// resumption it recomputes its prompt and the tokens it generated.
func (s *vllmScheduler) preempt(r *vllmReq) {
	s.release(r)
	r.computed = 0
	r.preemptions++
	s.preemptions++
	s.running = slices.DeleteFunc(s.running, func(x *vllmReq) bool { return x == r })
	s.waiting = slices.Insert(s.waiting, 0, r)
}

// dropCanceled removes canceled requests from both queues, frees their blocks and returns them.
func (s *vllmScheduler) dropCanceled(out []*vllmReq) []*vllmReq {
	drop := func(r *vllmReq) bool {
		if !r.canceled.Load() {
			return false
		}
		s.release(r)
		out = append(out, r)
		return true
	}
	s.running = slices.DeleteFunc(s.running, drop)
	s.waiting = slices.DeleteFunc(s.waiting, drop)
	return out
}

// plan chooses the next step at simulated time now, the way vLLM V1's scheduler does:
//
//  1. Running requests in admission order get their tokens first: one per decoding request and
//     the next chunk (up to the remaining budget) of a request still in prefill. Requests are
//     admitted behind every running request, and a prefill that leaves budget over finishes in
//     that step, so the decoding requests come before any prefill: decode first.
//  2. A request that needs a new block when none is free preempts the last running request
//     (recompute), repeatedly; if that is the request itself it is not scheduled.
//  3. Unless a preemption happened, waiting requests that arrived by now are admitted in order
//     while budget and running slots remain: the cached prefix is looked up now (at most ⌊(n−1)/bs⌋ blocks, so at
//     least the last token is computed), and the request takes the next chunk of its uncached
//     tokens if its blocks fit; the first one that does not fit stops admission.
//
// A step with nothing to do has no items.
func (s *vllmScheduler) plan(now time.Duration) plannedStep {
	var st plannedStep
	budget := s.budget
	preempted := false
	for i := 0; i < len(s.running) && budget > 0; i++ {
		r := s.running[i]
		n := min(r.numTokens-r.computed, budget)
		need := s.blocksFor(r.computed+n) - r.heldBlocks()
		self := false
		for need > s.cache.freeBlocks() {
			victim := s.running[len(s.running)-1] // never one scheduled already: those come before r
			s.preempt(victim)
			preempted = true
			if self = victim == r; self {
				break
			}
		}
		if self {
			break // r itself was preempted: it was the last running request
		}
		st.removed = s.cache.allocAnon(need, st.removed)
		r.anon += need
		st.items = append(st.items, stepItem{r: r, n: n, from: r.computed})
		budget -= n
	}
	for !preempted && budget > 0 && len(s.waiting) > 0 && len(s.running) < s.maxRunning {
		r := s.waiting[0]
		if r.arrival > now {
			break // arrives after this step starts (the engine loop is catching up)
		}
		maxHit := 0
		if len(r.tokens) > 0 && !r.noCache {
			maxHit = min((r.numTokens-1)/s.bs, len(r.hashes))
		}
		hit, unpinned := s.cache.lookup(r.hashes, maxHit)
		from := hit * s.bs
		n := min(r.numTokens-from, budget)
		need := s.blocksFor(from+n) - hit
		if need > s.cache.freeBlocks()-unpinned {
			break
		}
		r.pinned = s.cache.pinPrefix(r.hashes, hit, r.pinned[:0])
		st.removed = s.cache.allocAnon(need, st.removed)
		r.anon = need
		r.computed = from
		if !r.scheduled {
			r.scheduled, r.firstSched, r.cached = true, now, from
		}
		s.waiting = s.waiting[1:]
		s.running = append(s.running, r)
		st.items = append(st.items, stepItem{r: r, n: n, from: from})
		budget -= n
	}
	s.peak = max(s.peak, len(s.running))
	for _, it := range st.items {
		if it.n == 1 && it.r.generated > 0 && it.from == it.r.numTokens-1 {
			st.work.DecodeRequests++
			st.work.DecodeContextTokens += it.from + 1
		} else {
			st.work.addChunk(it.n, it.from)
		}
	}
	if len(st.items) > 0 {
		st.dur = s.prof.StepTime(st.work)
	}
	return st
}

// stepResult is what applying a step changed.
type stepResult struct {
	stored   []storedRun  // prompt blocks newly cached, per request, in order
	finished []*vllmReq   // requests that sampled their last token
	tokens   []sampledTok // requests that sampled a token (finished ones included)
}

// sampledTok is one output token a step produced: gap is the time since the request's previous
// token (0 for its first).
type sampledTok struct {
	r   *vllmReq
	gap time.Duration
}

// storedRun is one request's newly cached blocks hashes[start:end].
type storedRun struct {
	r          *vllmReq
	start, end int
}

// apply completes st at simulated time end: every item's tokens are computed, full prompt blocks
// are cached (a copy cached meanwhile by another request is shared), and a request whose computed
// tokens reach its sequence length samples one output token, finishing at its max_tokens.
func (s *vllmScheduler) apply(st *plannedStep, end time.Duration) stepResult {
	var res stepResult
	s.steps++
	s.busy += st.dur
	for _, it := range st.items {
		r := it.r
		r.computed += it.n
		if !r.noCache {
			full := min(r.computed, len(r.tokens)) / s.bs
			start := len(r.pinned)
			for k := start; k < min(full, len(r.hashes)); k++ {
				r.pinned = append(r.pinned, s.cache.storeAnon(r.hashes[k]))
				r.anon--
			}
			if n := len(r.pinned); n > start {
				res.stored = append(res.stored, storedRun{r: r, start: start, end: n})
			}
		}
		if r.computed < r.numTokens {
			continue // prefill continues next step
		}
		r.generated++
		r.numTokens++
		tok := sampledTok{r: r}
		if r.generated == 1 {
			r.firstToken = end
		} else {
			tok.gap = end - r.lastToken
		}
		r.lastToken = end
		res.tokens = append(res.tokens, tok)
		if r.generated >= r.maxTokens {
			s.release(r)
			s.running = slices.DeleteFunc(s.running, func(x *vllmReq) bool { return x == r })
			res.finished = append(res.finished, r)
		}
	}
	return res
}

// reset drops the whole prefix cache (AllBlocksCleared): blocks running requests hold stay
// allocated until those requests release them, and those requests cache nothing more (their
// later blocks would chain to blocks a router was just told are gone).
func (s *vllmScheduler) reset() {
	s.cache.clear()
	for _, r := range s.running {
		r.noCache = true
	}
}
