package picker

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/picker/queue"
	"github.com/kvepp/kvepp/policies/defaultcost"
)

// Queue admission (selection-service.md §13). Each partition with a queueing class owns a
// queue.Queue driven from the partition's serialized context (p.mu): admission decides between
// immediate selection and parking; lifecycle events (prefill_complete, free, expiry, catalog
// updates) and the periodic recheck run dispatch, which pops heads by deficit round robin while
// the pool is not busy for their class and selects (and books) each popped request right there,
// so the next pop sees the fresh load. A parked caller blocks on its waiter's done channel or its
// context, never polling.

// QueueRejection is the "details" object of a 429 queue rejection (selection-service.md §13.6),
// carried in Error.Details: the policy class, the limit reached ("requests", "raw_isl_tokens" or
// "cached_tokens"), the class's usage before the request and the effective limit (requests or
// tokens).
type QueueRejection struct {
	// PolicyClass is the class whose limit was reached.
	PolicyClass string `json:"policy_class"`
	// LimitKind is "requests", "raw_isl_tokens" or "cached_tokens".
	LimitKind string `json:"limit_kind"`
	// Current is the class's queued usage before the request.
	Current uint64 `json:"current"`
	// Limit is the per-worker limit times the schedulable endpoints (saturating).
	Limit uint64 `json:"limit"`
}

// QueuedRequest describes one request waiting in a partition queue (observability; §13).
type QueuedRequest struct {
	// SelectionID is the request's selection_id ("" for a query-only select without one).
	SelectionID string
	// Reserve is true for SelectAndReserve, false for a query-only Select.
	Reserve bool
	// PolicyClass is the class the request was admitted to.
	PolicyClass string
	// StrictPriority is the strict tier (larger first).
	StrictPriority uint32
	// PolicyScore is the §13.2 policy_score (higher first within a tier).
	PolicyScore float64
	// RawISLTokens is the request's input length (tokens).
	RawISLTokens uint64
	// CachedTokens is the enqueue-time cached tokens (pinned worker, else best eligible; tokens).
	CachedTokens uint64
	// SchedulingCostTokens is max(1, raw − cached), the WSPT denominator and DRR charge.
	SchedulingCostTokens uint64
	// Since is when the request was enqueued (the service clock).
	Since time.Time
}

// waiter is one request parked in its partition's queue. Everything but done is written under
// p.mu; the dispatcher fills the result fields and closes done before releasing p.mu.
type waiter struct {
	ctx     context.Context
	req     SelectRequest
	pr      prepared
	reserve bool
	entry   *queue.Entry[*waiter]
	since   time.Time
	// look is the enqueue-time prompt lookup (its own copy of the matches), reused at dequeue
	// unless the overlap refresh applies.
	look lookup

	done   chan struct{}
	sel    Selection
	booked bool
	err    error
}

// admitLocked is queue admission (§13.1) for a non-advisory Select (reserve false) or a
// SelectAndReserve (reserve true) in p, whose queue is non-nil. It resolves the policy class
// (§13.4; the header's explicit class directly, else the family and the uncached-ISL bucket from
// the index), and selects immediately unless the class can queue and already has a backlog or
// the pool is busy for it. Otherwise the request is enqueued subject to the class limits (429
// with QueueRejection details), or rejected with 429 when DoNotQueue is set, or 503 while
// shutting down, and the returned waiter is non-nil: the caller releases p.mu and awaits it.
// Caller holds p.mu.
func (s *Service) admitLocked(ctx context.Context, p *partition, req *SelectRequest, pr *prepared, reserve bool) (w *waiter, sel Selection, booked bool, err error) {
	v := p.view.Load()
	if len(v.workers) == 0 {
		return nil, Selection{}, false, s.notReady(pr.key)
	}
	lk, err := s.lookupLocked(p, v, req, pr)
	if err != nil {
		return nil, Selection{}, false, err
	}
	prof := p.profile
	class, direct := prof.Direct(req.PolicyClass)
	var snap queue.Snapshot
	if !direct {
		snap = s.queueSnapshot(v, req, pr, &lk)
		class = prof.Resolve(req.PolicyClass, snap.Uncached())
	}
	cl := prof.Class(class)
	if !cl.Queues() || (!p.q.HasBacklog(class) && !s.poolBusy(p, v, cl, req, pr)) {
		if reserve {
			sel, booked, err = s.reserveLocked(ctx, p, req, pr, &lk, false)
		} else {
			sel, err = s.selectOnlyLocked(p, req, pr, &lk)
		}
		return nil, sel, booked, err
	}
	if req.DoNotQueue {
		return nil, Selection{}, false, Errorf(KindOverloaded,
			"router policy class %q would queue the request and do_not_queue is set", cl.Name)
	}
	if s.shuttingDown.Load() {
		return nil, Selection{}, false, errShuttingDown()
	}
	if direct {
		snap = s.queueSnapshot(v, req, pr, &lk)
	}
	now := s.now()
	w = &waiter{
		ctx: ctx, req: *req, pr: *pr, reserve: reserve, since: now,
		look: lookup{np: lk.np, matches: slices.Clone(lk.matches), bs: lk.bs, eagle: lk.eagle},
		done: make(chan struct{}),
	}
	e, err := p.q.Enqueue(class, len(v.workers), snap, req.PriorityJump, req.StrictPriority, now, w)
	if err != nil {
		return nil, Selection{}, false, queueError(err)
	}
	w.entry = e
	s.queued.Add(1)
	s.syncPending(p)
	s.dispatchLocked(p) // the backlog's head may be dispatchable even though this class waited
	return w, Selection{}, false, nil
}

// queueError maps an Enqueue error to the 429 of §13.6.
func queueError(err error) error {
	var rej *queue.Rejection
	if errors.As(err, &rej) {
		return &Error{Kind: KindOverloaded, Message: rej.Error(), Err: err, Details: QueueRejection{
			PolicyClass: rej.Class, LimitKind: rej.Kind.String(), Current: rej.Current, Limit: rej.Limit,
		}}
	}
	return &Error{Kind: KindInternal, Message: err.Error(), Err: err}
}

// queueSnapshot is the request's queue accounting (§13.2): its raw ISL and its cached tokens
// (§9.1 cached_tokens, with the configured tier weights) on the pinned rank, else the best over
// the eligible ranks of view v.
func (s *Service) queueSnapshot(v *partView, req *SelectRequest, pr *prepared, lk *lookup) queue.Snapshot {
	params := defaultcost.Params{HostCacheHitWeight: s.cfg.Router.HostCacheHitWeight, DiskCacheHitWeight: s.cfg.Router.DiskCacheHitWeight}
	best := 0
	pin := req.PinnedWorker
	for _, m := range lk.matches {
		pos, ok := v.pos[m.Candidate]
		if !ok {
			continue
		}
		if pin != nil {
			if m.Candidate.WorkerID != pin.WorkerID || m.Candidate.DPRank != pin.DPRank {
				continue
			}
		} else if !eligible(v.workers[v.owner[pos]], pr, req) {
			continue
		}
		best = max(best, defaultcost.CachedTokens(params, int(m.Device), int(m.HostExt), int(m.DiskExt+m.ExternalExt), int(v.blockSize)))
	}
	return queue.NewSnapshot(lk.np.isl, uint64(best))
}

// poolBusy reports whether the pool of req's eligible ranks in view v is busy for class cl
// (§13.1): the pinned rank alone when pinned, else every rank of the workers that pass
// allowed_worker_ids and the required taints. Ranks use their worker's max_num_batched_tokens
// (DefaultPrefillTokenCapacity when unknown). Caller holds p.mu (the scratch is p's).
func (s *Service) poolBusy(p *partition, v *partView, cl *queue.Class, req *SelectRequest, pr *prepared) bool {
	if pin := req.PinnedWorker; pin != nil {
		w := v.worker(pin.WorkerID)
		if w == nil || !w.hasRank(pin.DPRank) || !eligible(w, pr, req) {
			return false // selection reports the unusable pin
		}
		ld := s.ledger.Load(ledger.Candidate{WorkerID: pin.WorkerID, DPRank: pin.DPRank})
		return cl.RankBusy(ld.ActivePrefillTokens, capacity(w))
	}
	sc := &p.sc
	sc.busyCands, sc.busyCaps = sc.busyCands[:0], sc.busyCaps[:0]
	for _, w := range v.workers {
		if !eligible(w, pr, req) {
			continue
		}
		for i := uint32(0); i < w.size; i++ {
			sc.busyCands = append(sc.busyCands, toLedger(v.cands[w.firstCand+int32(i)]))
			sc.busyCaps = append(sc.busyCaps, capacity(w))
		}
	}
	sc.busyLoads = s.ledger.Loads(sc.busyCands, sc.busyLoads[:0])
	busy := 0
	for i, ld := range sc.busyLoads {
		if cl.RankBusy(ld.ActivePrefillTokens, sc.busyCaps[i]) {
			busy++
		}
	}
	return cl.PoolBusy(busy, len(sc.busyLoads))
}

// capacity is a worker's max_num_batched_tokens, or DefaultPrefillTokenCapacity when unknown.
func capacity(w *schedWorker) uint64 {
	if w.maxBatch != nil {
		return *w.maxBatch
	}
	return DefaultPrefillTokenCapacity
}

// dispatchLocked admits queued requests of p while some class head's pool is not busy (§13.3,
// §13.5): each popped request is selected (and booked) at once, so the next pop sees its load.
// While shutting down it fails every queued request with 503 instead. Caller holds p.mu.
func (s *Service) dispatchLocked(p *partition) {
	if p.q == nil || p.q.Len() == 0 {
		return
	}
	if s.shuttingDown.Load() {
		s.failQueuedLocked(p, errShuttingDown())
		return
	}
	v := p.view.Load()
	dispatchable := func(class int, head *queue.Entry[*waiter]) bool {
		w := head.Value
		return !s.poolBusy(p, v, p.profile.Class(class), &w.req, &w.pr)
	}
	for {
		e := p.q.PopNext(dispatchable)
		if e == nil {
			return
		}
		s.queued.Add(-1)
		s.syncPending(p)
		s.runQueued(p, e.Value)
	}
}

// runQueued selects (and books) a dequeued request and hands the result to its waiter. A request
// that waited at least OverlapRefreshAfterSecs (when > 0) gets a fresh index lookup; otherwise
// its enqueue-time overlap is reused (§13.3). Caller holds p.mu.
func (s *Service) runQueued(p *partition, w *waiter) {
	defer close(w.done)
	if err := w.ctx.Err(); err != nil {
		w.err = cancelled(err)
		return
	}
	lk := &w.look
	if ra := s.refreshAfter(); ra > 0 && s.now().Sub(w.since) >= ra {
		lk = nil
	}
	if w.reserve {
		w.sel, w.booked, w.err = s.reserveLocked(w.ctx, p, &w.req, &w.pr, lk, true)
	} else {
		w.sel, w.err = s.selectOnlyLocked(p, &w.req, &w.pr, lk)
	}
}

// refreshAfter is DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS as a duration (0 = disabled).
func (s *Service) refreshAfter() time.Duration {
	return time.Duration(s.cfg.Router.OverlapRefreshAfterSecs * float64(time.Second))
}

// await blocks until w is dispatched or ctx is done. A caller that goes away while queued is
// removed from the queue; one whose request was already dispatched gets its booking freed
// (§7.3 step 8, §13.3). booked reports whether the waiter's booking landed (the caller's claim
// became it), even when it was freed again.
func (s *Service) await(ctx context.Context, p *partition, w *waiter) (Selection, bool, error) {
	select {
	case <-w.done:
		return w.sel, w.booked, w.err
	case <-ctx.Done():
	}
	p.mu.Lock()
	if p.q.Remove(w.entry) {
		s.queued.Add(-1)
		s.syncPending(p)
		s.dispatchLocked(p) // the departed head may have blocked its class
		p.mu.Unlock()
		return Selection{}, false, cancelled(ctx.Err())
	}
	p.mu.Unlock()
	<-w.done // closed under p.mu by whoever dequeued it
	if w.err == nil && w.sel.Booked && s.freeBooking(w.req.SelectionID) {
		s.kick(p)
	}
	return Selection{}, w.booked, cancelled(ctx.Err())
}

// failQueuedLocked fails every queued request of p with err (shutdown). Caller holds p.mu.
func (s *Service) failQueuedLocked(p *partition, err error) {
	if p.q == nil || p.q.Len() == 0 {
		return
	}
	for _, e := range p.q.Drain() {
		w := e.Value
		w.err = err
		close(w.done)
		s.queued.Add(-1)
	}
	s.syncPending(p)
}

// syncPending mirrors p's queue totals into its atomics (GET /loads pending_count and
// pending_isl_tokens). Caller holds p.mu.
func (s *Service) syncPending(p *partition) {
	t := p.q.Total()
	p.pendingCount.Store(t.Requests)
	p.pendingISL.Store(t.RawISLTokens)
}

// kick runs dispatch in p when it has queued requests.
func (s *Service) kick(p *partition) {
	if p == nil || p.q == nil || p.pendingCount.Load() == 0 {
		return
	}
	p.mu.Lock()
	s.dispatchLocked(p)
	p.mu.Unlock()
}

// kickName runs dispatch in the partition named name (PartitionKey.String(), a booking's
// Partition) when anything is queued anywhere.
func (s *Service) kickName(name string) {
	if s.queued.Load() == 0 {
		return
	}
	s.mu.RLock()
	p := s.byName[name]
	s.mu.RUnlock()
	s.kick(p)
}

// RecheckQueues runs queue dispatch in every partition with queued requests: the periodic
// recheck of selection-service.md §13.3 that Run performs every QueueRecheckInterval.
func (s *Service) RecheckQueues() {
	if s.queued.Load() == 0 {
		return
	}
	for _, p := range s.partitionsSnapshot() {
		s.kick(p)
	}
}

// QueuedRequests returns the requests waiting in partition key's queue, class by class in the
// profile's order and in dispatch order within each class (empty when nothing waits or the
// partition has no queue).
func (s *Service) QueuedRequests(key PartitionKey) []QueuedRequest {
	p := s.partition(key)
	if p == nil || p.q == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []QueuedRequest
	for c := 0; c < p.profile.NumClasses(); c++ {
		for _, e := range p.q.Entries(c) {
			w, sn := e.Value, e.Snapshot()
			out = append(out, QueuedRequest{
				SelectionID: w.req.SelectionID, Reserve: w.reserve, PolicyClass: p.profile.Class(c).Name,
				StrictPriority: e.StrictPriority(), PolicyScore: e.PolicyScore(),
				RawISLTokens: sn.RawISLTokens, CachedTokens: sn.CachedTokens, SchedulingCostTokens: sn.Cost(),
				Since: w.since,
			})
		}
	}
	return out
}
