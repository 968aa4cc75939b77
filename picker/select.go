package picker

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"

	"github.com/google/uuid"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/policies"
)

// tierMatch is one candidate's tiered overlap in blocks (kv-events-index.md §12.2); disk
// includes the external extension (selection-service.md §9.1).
type tierMatch struct {
	device, host, disk uint32
}

// selScratch holds a partition's reusable selection buffers (guarded by partition.mu).
type selScratch struct {
	matches []kvindex.Match
	tiers   []tierMatch // by view candidate position
	rows    []int32     // eligible view positions
	workers []policies.Worker
	loads   []ledger.Load
	adds    []int
	loaded  []bool
	ctx     policies.WorkerSelectionContext
	src     inputSource
	// busyCands, busyCaps and busyLoads are queue admission's pool-busy scratch (§13.1).
	busyCands []ledger.Candidate
	busyCaps  []uint64
	busyLoads []ledger.Load
}

// effective are the per-request settings after router_config_override (§9.5, §9.6).
type effective struct {
	track       bool
	assumeReuse bool
	temperature *float64
	credit      *float64
	scale       *float64
}

// resolveOverride validates router_config_override (422 on a bad value, §9.5) and applies it,
// including the deprecated overlap_score_weight mapping of §9.6.
func (s *Service) resolveOverride(o *RouterConfigOverride) (effective, error) {
	e := effective{track: s.cfg.Router.TrackPrefillTokens, assumeReuse: s.cfg.Router.AssumeKVReuse}
	if o == nil {
		return e, nil
	}
	for _, f := range []struct {
		name string
		v    *float64
	}{
		{"overlap_score_credit", o.OverlapScoreCredit},
		{"prefill_load_scale", o.PrefillLoadScale},
		{"overlap_score_weight", o.OverlapScoreWeight},
		{"router_temperature", o.RouterTemperature},
	} {
		if f.v != nil && (math.IsNaN(*f.v) || !finiteNonNeg(*f.v)) {
			return e, Errorf(KindUnprocessable, "router_config_override.%s must be a finite number >= 0, got %v", f.name, *f.v)
		}
	}
	if m := o.SharedCacheMultiplier; m != nil && !(*m >= 0 && *m <= 1) {
		return e, Errorf(KindUnprocessable, "router_config_override.shared_cache_multiplier must be between 0 and 1, got %v", *m)
	}
	e.credit, e.scale, e.temperature = o.OverlapScoreCredit, o.PrefillLoadScale, o.RouterTemperature
	if w := o.OverlapScoreWeight; w != nil {
		s.warnDeprecatedWeight()
		e.scale = w
		if *w == 0 {
			zero := 0.0
			e.credit = &zero
		}
	}
	if o.AssumeKVReuse != nil {
		e.assumeReuse = *o.AssumeKVReuse
	}
	if o.TrackPrefillTokens != nil {
		e.track = *o.TrackPrefillTokens
	}
	return e, nil
}

func (s *Service) warnDeprecatedWeight() {
	if s.deprecatedWarned.CompareAndSwap(false, true) {
		s.log.Warn().Msg("router_config_override.overlap_score_weight is deprecated; use prefill_load_scale and overlap_score_credit")
	}
}

// sessionContext converts the request's session to the policy view; an unknown input_trigger is
// a 422 (§12.2).
func sessionContext(sc *SessionContext) (*policies.SessionContext, error) {
	if sc == nil {
		return nil, nil
	}
	trig, err := policies.ParseInputTrigger(sc.InputTrigger)
	if err != nil {
		return nil, &Error{Kind: KindUnprocessable, Message: "session_context." + err.Error(), Err: err}
	}
	p := policies.SessionParams{
		SessionID: sc.SessionID, ParentSessionID: sc.ParentSessionID, SessionFinal: sc.SessionFinal,
		InputTrigger: trig, AgentHeaders: sc.AgentHeaders,
	}
	if sc.KVHints != nil {
		p.KVHints = policies.NewKVHints(sc.KVHints.EvictSession)
	}
	return policies.NewSessionContext(p), nil
}

// prepared is a validated request ready to run in its partition.
type prepared struct {
	key     PartitionKey
	p       *partition
	eff     effective
	session *policies.SessionContext
	// allowed is the allowed_worker_ids set when AllowedSet.
	allowed map[uint64]struct{}
	// withheld are the registered workers that are not candidates (SetCandidate).
	withheld withheldSet
	// sessionID drives the affinity table ("" = none).
	sessionID string
}

// prepare validates the request and resolves its partition: shutdown (503), names and ids (400,
// ValidateName, MaxIDBytes), override and session validation (422), hash-form validation (400),
// readiness (503 with the §7.2 messages).
func (s *Service) prepare(req *SelectRequest) (prepared, error) {
	if s.shuttingDown.Load() {
		return prepared{}, errShuttingDown()
	}
	var pr prepared
	pr.key = PartitionKey{ModelName: req.ModelName, RoutingGroup: req.RoutingGroup}
	if pr.key.ModelName == "" {
		pr.key.ModelName = DefaultPartitionName
	}
	if pr.key.RoutingGroup == "" {
		pr.key.RoutingGroup = DefaultPartitionName
	}
	if err := validateRequestIDs(pr.key, req.SelectionID, req.Session, s.affinityOn()); err != nil {
		return pr, err
	}
	var err error
	if pr.eff, err = s.resolveOverride(req.Override); err != nil {
		return pr, err
	}
	if pr.session, err = sessionContext(req.Session); err != nil {
		return pr, err
	}
	if err := validateHashForm(&req.Prompt); err != nil {
		return pr, err
	}
	pr.sessionID = sessionID(req)
	if err := s.checkSession(pr.sessionID); err != nil {
		return pr, err
	}
	if err := s.readiness(pr.key); err != nil {
		return pr, err
	}
	pr.p = s.partition(pr.key)
	pr.withheld = s.withheldLoad()
	if req.AllowedSet {
		pr.allowed = make(map[uint64]struct{}, len(req.AllowedWorkerIDs))
		for _, id := range req.AllowedWorkerIDs {
			pr.allowed[id] = struct{}{}
		}
	}
	return pr, nil
}

// readiness returns the §7.2 step 1 error for a partition without a schedulable worker.
func (s *Service) readiness(key PartitionKey) error {
	if s.schedulable.Load() <= 0 {
		return Errorf(KindNotReady, "no schedulable workers are available")
	}
	p := s.partition(key)
	if p == nil || len(p.view.Load().workers) == 0 {
		return s.errNoPartitionWorkers(key)
	}
	return nil
}

// notReady is the readiness error of a partition whose view turned out empty: readiness's
// message, or the partition form when a worker became schedulable elsewhere meanwhile (never nil).
func (s *Service) notReady(key PartitionKey) error {
	if err := s.readiness(key); err != nil {
		return err
	}
	return s.errNoPartitionWorkers(key)
}

// choice is the outcome of selection inside a partition.
type choice struct {
	view    *partView
	pos     int32 // chosen view candidate position
	cost    float64
	np      normPrompt
	ept     uint64
	load    ledger.Load // pre-admission load of the chosen rank
	add     int         // additional blocks on the chosen rank
	overlap Overlap
	fall    []Fallback
}

// Select chooses a worker without booking (selection-service.md §7.2). A non-advisory select
// with queueing on is a query-only admission through the partition queue (§13): it may wait
// while the pool is busy for its policy class (or the class has a backlog) and may be rejected
// with 429 (KindOverloaded, Details = QueueRejection); an advisory select never waits and adds
// WorkerLoad. A live session binding steers the selection (§12.1) but none is created or leased.
// With a SelectionID the booking inputs are written to the pending-selection cache (§11),
// replacing any entry of the same (model, group, id). It never records into an approximate
// index and never attaches a kv_hint. Errors: KindNotReady (shutdown, also for a waiting select;
// no schedulable worker, no candidate, all filtered), KindBadRequest (prompt, pinned worker not
// allowed, session id too long), KindUnprocessable (override, session), KindOverloaded (queue
// limit, do_not_queue), KindPolicy (policy failure), KindInternal (ctx done).
func (s *Service) Select(ctx context.Context, req SelectRequest) (Selection, error) {
	pr, err := s.prepare(&req)
	if err != nil {
		return Selection{}, err
	}
	p := pr.p
	p.mu.Lock()
	if err := ctx.Err(); err != nil {
		p.mu.Unlock()
		return Selection{}, cancelled(err)
	}
	if p.q != nil && !req.Advisory {
		w, sel, _, err := s.admitLocked(ctx, p, &req, &pr, false)
		p.mu.Unlock()
		if w == nil {
			return sel, err
		}
		sel, _, err = s.await(ctx, p, w)
		return sel, err
	}
	sel, err := s.selectOnlyLocked(p, &req, &pr, nil)
	p.mu.Unlock()
	return sel, err
}

// selectOnlyLocked is the query-only selection of Select in p: the session binding steers, the
// pending-selection cache is written when SelectionID is set, and advisory selects get their
// WorkerLoad. lk, when non-nil, is a prompt lookup to reuse (§13.3). Caller holds p.mu.
func (s *Service) selectOnlyLocked(p *partition, req *SelectRequest, pr *prepared, lk *lookup) (Selection, error) {
	now := s.now()
	target, steered := req.AffinityTarget, false
	if p.affinity != nil && pr.sessionID != "" && target == nil && req.PinnedWorker == nil {
		bound, ok, err := p.affinity.Lookup(pr.sessionID, now, validTarget(p.view.Load()))
		if err != nil {
			return Selection{}, affinityError(err)
		}
		if ok {
			target, steered = exactTarget(bound), true
		}
	}
	ch, err := s.selectLocked(p, req, pr, target, lk)
	if err != nil {
		return Selection{}, err
	}
	if req.SelectionID != "" {
		ps := ledger.PendingSelection{
			Candidate:              toLedger(ch.view.cands[ch.pos]),
			SequenceHashes:         ch.np.seq,
			ISLTokens:              ch.np.isl,
			EffectivePrefillTokens: ch.ept,
			ExpectedOutputTokens:   clonePtr(req.ExpectedOutputTokens),
			TrackPrefillTokens:     pr.eff.track,
			LoraName:               req.Prompt.LoraName,
			SessionID:              pr.sessionID,
			SessionSteered:         steered,
		}
		if ch.np.recordable {
			ps.BlockHashes = ch.np.local
		}
		s.pending.Put(ledger.PendingKey{ModelName: pr.key.ModelName, RoutingGroup: pr.key.RoutingGroup, SelectionID: req.SelectionID}, ps, now)
	}
	sel := s.selection(req, pr, &ch)
	if req.Advisory {
		sel.WorkerLoad = s.workerLoad(&ch)
	}
	return sel, nil
}

// SelectAndReserve selects a worker and books the request on it atomically
// (selection-service.md §7.3). The selection_id (a UUIDv4 when empty) is claimed process-wide
// before selecting; selection and booking run in the partition's serialized context. With
// queueing on the request always goes through queue admission (§13): it waits while the pool is
// busy for its policy class (or the class has a backlog) until a lifecycle event or the periodic
// recheck admits it; a request that waited is re-validated after booking (a worker drained
// meanwhile frees the booking and fails with 500 "selected worker {id} is no longer
// schedulable"). The booking holds the tracked sequence hashes and, when prefill tracking is on,
// effective_prefill_tokens of prefill. With session affinity on, the session hold is taken before
// selecting (a live binding steers unless affinity_target or pinned_worker is given) and the
// binding is committed after booking (§12.1). In approximate mode the request's blocks are
// recorded for the chosen rank; with an event-driven index a kv_hint is attached when §7.7
// allows. The pending-selection cache is neither read nor written. Nothing stays booked or
// claimed when the call fails, including when ctx is cancelled while waiting or after booking.
// Errors: as Select, plus KindConflict "selection {id} is already reserved or being reserved",
// KindBadRequest "session affinity conflict: …" (the booking is freed and the stale binding
// dropped) and KindInternal "selected worker {id} is no longer schedulable".
func (s *Service) SelectAndReserve(ctx context.Context, req SelectRequest) (Selection, error) {
	pr, err := s.prepare(&req)
	if err != nil {
		return Selection{}, err
	}
	if req.SelectionID == "" {
		req.SelectionID = uuid.NewString()
	}
	if err := s.ledger.Claim(req.SelectionID); err != nil {
		return Selection{}, ledgerError(err)
	}
	booked := false
	defer func() {
		if !booked {
			s.ledger.Unclaim(req.SelectionID)
		}
	}()
	p := pr.p
	p.mu.Lock()
	if err := ctx.Err(); err != nil {
		p.mu.Unlock()
		return Selection{}, cancelled(err)
	}
	if p.q != nil {
		w, sel, bk, err := s.admitLocked(ctx, p, &req, &pr, true)
		p.mu.Unlock()
		if w == nil {
			booked = bk
			return sel, err
		}
		sel, booked, err = s.await(ctx, p, w)
		return sel, err
	}
	sel, bk, err := s.reserveLocked(ctx, p, &req, &pr, nil, false)
	booked = bk
	p.mu.Unlock()
	return sel, err
}

// reserveLocked selects and books req in p (the body of SelectAndReserve). lk, when non-nil, is
// a prompt lookup to reuse; queued marks a request that waited in the queue, whose worker is
// re-validated against the catalog after booking (§7.3 step 5). booked reports whether the
// ledger booking landed (even if it was freed again): the caller's claim became the booking.
// Caller holds p.mu.
func (s *Service) reserveLocked(ctx context.Context, p *partition, req *SelectRequest, pr *prepared, lk *lookup, queued bool) (sel Selection, booked bool, err error) {
	now := s.now()
	hold, err := s.acquire(p, pr.sessionID, p.view.Load(), now)
	if err != nil {
		return Selection{}, false, err
	}
	defer hold.abort(now) // no-op once committed
	target, steered := req.AffinityTarget, false
	if target == nil && req.PinnedWorker == nil && hold.active && hold.hold.Kind == ledger.HoldBound {
		target, steered = exactTarget(hold.hold.Target), true
	}
	ch, err := s.selectLocked(p, req, pr, target, lk)
	if err != nil {
		return Selection{}, false, err
	}
	prefill := uint64(0)
	if pr.eff.track {
		prefill = ch.ept
	}
	c := ch.view.cands[ch.pos]
	b := ledger.Booking{
		ID:                   req.SelectionID,
		Candidate:            toLedger(c),
		SequenceHashes:       ch.np.seq,
		PrefillTokens:        prefill,
		ExpectedOutputTokens: req.ExpectedOutputTokens,
		Admitted:             now,
		Partition:            pr.key.String(),
		Tag:                  hold.lease(),
		Unobserved:           req.PrefillUnobserved,
	}
	if err := s.ledger.Book(b); err != nil {
		return Selection{}, false, ledgerError(err)
	}
	s.publishAdmission(pr.key, ch.view.blockSize, &b, pr.eff.track, req.Prompt.LoraName)
	if req.PrefillUnobserved && prefill > 0 {
		s.schedulePrefillRelease(req.SelectionID, ch.np.isl)
	}
	if queued && !s.stillSchedulable(c.WorkerID, pr.key) {
		// The worker was drained while this request waited (§7.3 step 5).
		s.freeBooking(req.SelectionID)
		return Selection{}, true, Errorf(KindInternal, "selected worker %d is no longer schedulable", c.WorkerID)
	}
	if !s.cfg.Router.UseKVEvents && ch.np.recordable {
		s.recordApproximate(ch.view, c, ch.np.local)
	}
	if err := ctx.Err(); err != nil {
		// The caller went away after the booking landed: release it (§7.3 step 8, §10.6).
		s.freeBooking(req.SelectionID)
		return Selection{}, true, cancelled(err)
	}
	if err := s.commit(&hold, req.SelectionID, WorkerRank(c), steered, ch.view, now); err != nil {
		s.freeBooking(req.SelectionID)
		return Selection{}, true, err
	}
	sel = s.selection(req, pr, &ch)
	sel.Booked = true
	// The ledger owns the booked slice; the caller gets its own copy.
	sel.SequenceHashes = append(make([]uint64, 0, len(ch.np.seq)), ch.np.seq...)
	sel.ISLTokens = ch.np.isl
	sel.TrackPrefillTokens = pr.eff.track
	sel.KVHint = s.kvHint(p, &ch, req.SelectionID)
	return sel, true, nil
}

// stillSchedulable reports whether the catalog still holds workerID as schedulable in key (the
// dequeue-time re-validation of §7.3 step 5: a DELETE marks the worker draining before its
// partition view drops it).
func (s *Service) stillSchedulable(workerID uint64, key PartitionKey) bool {
	s.mu.RLock()
	e := s.workers[workerID]
	s.mu.RUnlock()
	return e != nil && e.key == key && e.state.Lifecycle == LifecycleSchedulable
}

func cancelled(err error) error {
	return &Error{Kind: KindInternal, Message: "selection cancelled: " + err.Error(), Err: err}
}

// ledgerError maps ledger sentinels to picker kinds, keeping the ledger's exact message.
func ledgerError(err error) error {
	switch {
	case errors.Is(err, ledger.ErrConflict):
		return &Error{Kind: KindConflict, Message: err.Error(), Err: err}
	case errors.Is(err, ledger.ErrNotFound):
		return &Error{Kind: KindNotFound, Message: err.Error(), Err: err}
	case errors.Is(err, ledger.ErrInvalid):
		return &Error{Kind: KindBadRequest, Message: err.Error(), Err: err}
	}
	return &Error{Kind: KindInternal, Message: err.Error(), Err: err}
}

// lookup is a request's normalised prompt and its index matches, made against a view of block
// size bs and eagle hashing eagle. Queue admission makes one and selection reuses it; a queued
// request keeps its enqueue-time lookup until the overlap refresh (§13.3).
type lookup struct {
	np      normPrompt
	matches []kvindex.Match
	bs      uint32
	eagle   bool
}

// lookupLocked normalises req's prompt for view v and matches it against v's index (the matches
// live in p.sc.matches until the next lookup). Errors: the §6.3 prompt errors. Caller holds p.mu.
func (s *Service) lookupLocked(p *partition, v *partView, req *SelectRequest, pr *prepared) (lookup, error) {
	np, err := normalizePrompt(&req.Prompt, v.blockSize, v.isEagle, pr.eff.assumeReuse)
	if err != nil {
		return lookup{}, err
	}
	lk := lookup{np: np, bs: v.blockSize, eagle: v.isEagle}
	if len(np.local) > 0 && v.index != nil {
		if v.index.approx != nil {
			v.index.approx.ExpireBefore(s.now()) // exact TTL at lookup time (§15.1)
		}
		p.sc.matches = v.index.lookup.FindMatches(np.local, p.sc.matches[:0])
		lk.matches = p.sc.matches
	}
	return lk, nil
}

// selectLocked runs normalisation, eligibility (§8) and the policy (§9, §17) in partition p.
// target is the §8 step 6 exact target (affinity_target or the session binding; nil = none). lk,
// when non-nil and made with the view's hashing parameters, supplies the prompt and its matches
// instead of a fresh lookup. Caller holds p.mu.
func (s *Service) selectLocked(p *partition, req *SelectRequest, pr *prepared, target *AffinityTarget, lk *lookup) (choice, error) {
	v := p.view.Load()
	if len(v.workers) == 0 {
		return choice{}, s.notReady(pr.key)
	}
	if lk == nil || lk.bs != v.blockSize || lk.eagle != v.isEagle {
		fresh, err := s.lookupLocked(p, v, req, pr)
		if err != nil {
			return choice{}, err
		}
		lk = &fresh
	}
	np := lk.np
	sc := &p.sc
	n := len(v.cands)

	// Tiered overlap of every candidate of the partition (§7.5, §9.1).
	if cap(sc.tiers) < n {
		sc.tiers = make([]tierMatch, n)
		sc.loads = make([]ledger.Load, n)
		sc.adds = make([]int, n)
		sc.loaded = make([]bool, n)
	}
	sc.tiers = sc.tiers[:n]
	clear(sc.tiers)
	sc.loaded = sc.loaded[:n]
	clear(sc.loaded)
	sc.loads, sc.adds = sc.loads[:n], sc.adds[:n]
	for _, m := range lk.matches {
		if i, ok := v.pos[m.Candidate]; ok {
			sc.tiers[i] = tierMatch{device: m.Device, host: m.HostExt, disk: m.DiskExt + m.ExternalExt}
		}
	}

	// Eligibility, §8 steps 1-3.
	rows := sc.rows[:0]
	for _, w := range v.workers {
		if !eligible(w, pr, req) {
			continue
		}
		for r := int32(0); r < int32(w.size); r++ {
			rows = append(rows, w.firstCand+r)
		}
	}
	sc.rows = rows

	pol := p.policy
	pinned := false
	// Step 4: pinned worker.
	if pw := req.PinnedWorker; pw != nil {
		if pr.allowed != nil {
			if _, ok := pr.allowed[pw.WorkerID]; !ok {
				return choice{}, Errorf(KindBadRequest, "pinned worker %d is not in allowed_worker_ids", pw.WorkerID)
			}
		}
		w := v.worker(pw.WorkerID)
		if w == nil || pw.DPRank < w.start || pw.DPRank-w.start >= w.size || !eligible(w, pr, req) {
			return choice{}, Errorf(KindNotReady, "no endpoints available to route work")
		}
		sc.rows = append(sc.rows[:0], w.firstCand+int32(pw.DPRank-w.start))
		pol, pinned = p.builtin, true
	}
	// Step 5.
	if len(sc.rows) == 0 {
		return choice{}, Errorf(KindNotReady, "no endpoints available to route work")
	}
	// Step 6: exact target (affinity_target, else the session binding).
	if t := target; t != nil && !pinned {
		narrowed := sc.rows[len(sc.rows):]
		for _, i := range sc.rows {
			c := v.cands[i]
			if c.WorkerID == t.WorkerID && (t.DPRank == nil || *t.DPRank == c.DPRank) {
				narrowed = append(narrowed, i)
			}
		}
		if len(narrowed) > 0 {
			sc.rows = append(sc.rows[:0], narrowed...)
			pol = p.builtin
		}
	}

	// Step 7: the policy pipeline.
	sc.workers = sc.workers[:0]
	for _, i := range sc.rows {
		c := v.cands[i]
		sc.workers = append(sc.workers, policies.Worker{WorkerID: c.WorkerID, DPRank: c.DPRank})
	}
	sc.src = inputSource{s: s, v: v, sc: sc, seq: np.seq, preferred: req.RoutingConstraints.PreferredTaints, pinned: pinned}
	if pol.RequiredInputs().Has(policies.InputsLoad) {
		name := pr.key.String()
		sc.src.poolRate, sc.src.arrivals = s.ledger.PartitionPrefillRate(name), s.ledger.PartitionArrivalRate(name)
	}
	sc.ctx.Reset(policies.ContextParams{
		ISLTokens:                  clampInt(np.isl),
		BlockSize:                  int(v.blockSize),
		TracksPrefillTokens:        pr.eff.track,
		Session:                    pr.session,
		ExpectedOutputTokens:       req.ExpectedOutputTokens,
		PriorityJump:               req.PriorityJump,
		StrictPriority:             req.StrictPriority,
		RouterTemperatureOverride:  pr.eff.temperature,
		OverlapScoreCreditOverride: pr.eff.credit,
		PrefillLoadScaleOverride:   pr.eff.scale,
		Rand:                       p.rng,
	})
	res, err := pol.Select(&sc.ctx, sc.workers, &sc.src)
	if err != nil {
		return choice{}, policyError(err)
	}
	if res.Row < 0 || res.Row >= len(sc.rows) {
		return choice{}, &Error{Kind: KindPolicy, Message: fmt.Sprintf("policy returned row %d but there are %d candidates", res.Row, len(sc.rows))}
	}
	pos := sc.rows[res.Row]
	ch := choice{view: v, pos: pos, cost: res.Cost, np: np}
	ch.load, ch.add = sc.src.loadAt(pos)
	ch.ept = s.effectivePrefill(np.isl, sc.tiers[pos], v.blockSize)
	ch.overlap = overlapSummary(v, v.workers[v.owner[pos]], sc.tiers)
	if req.Fallbacks > 0 {
		ch.fall = fallbacks(v, res, req.Fallbacks)
	}
	sc.src = inputSource{}
	return ch, nil
}

// overlapSummary is the §7.5 summary over every rank of w, in tokens.
func overlapSummary(v *partView, w *schedWorker, tiers []tierMatch) Overlap {
	bs := uint64(v.blockSize)
	o := Overlap{DP: make(map[string]uint64, w.size)}
	for r := uint32(0); r < w.size; r++ {
		t := tiers[w.firstCand+int32(r)]
		dev := uint64(t.device)
		host := dev + uint64(t.host)
		dsk := host + uint64(t.disk)
		o.GPU, o.CPU, o.Disk = max(o.GPU, dev*bs), max(o.CPU, host*bs), max(o.Disk, dsk*bs)
		o.DP[strconv.FormatUint(uint64(w.start+r), 10)] = dev * bs
	}
	o.LongestMatched = max(o.GPU, o.CPU, o.Disk)
	return o
}

// eligible applies §8 steps 2-3 (allowed_worker_ids, required taints) to one worker, and drops
// workers that are registered but not candidates (epp.md §10.2).
func eligible(w *schedWorker, pr *prepared, req *SelectRequest) bool {
	if pr.withheld.has(w.id) {
		return false
	}
	if pr.allowed != nil {
		if _, ok := pr.allowed[w.id]; !ok {
			return false
		}
	}
	for _, t := range req.RoutingConstraints.RequiredTaints {
		if !w.hasTaint(t) {
			return false
		}
	}
	return true
}

// policyError maps the policy host's errors to picker errors (§2.1, §17.2).
func policyError(err error) error {
	switch {
	case errors.Is(err, policies.ErrAllFiltered):
		return &Error{Kind: KindNotReady, Message: policies.ErrAllFiltered.Error(), Err: err}
	case errors.Is(err, policies.ErrNoCandidates):
		return &Error{Kind: KindNotReady, Message: policies.ErrNoCandidates.Error(), Err: err}
	}
	return &Error{Kind: KindPolicy, Message: err.Error(), Err: err}
}

// fallbacks returns up to n next-lowest-cost candidates on distinct workers other than the chosen
// one, in cost order (ties by worker_id, dp_rank), from the policy's scored rows (epp.md §5.9).
func fallbacks(v *partView, res policies.Result, n int) []Fallback {
	type row struct {
		w    policies.Worker
		cost float64
	}
	rows := make([]row, 0, len(res.Candidates))
	for _, c := range res.Candidates {
		if c.Worker().WorkerID != res.Worker.WorkerID {
			rows = append(rows, row{c.Worker(), c.Cost()})
		}
	}
	sortRows := func(a, b row) int {
		switch {
		case a.cost < b.cost:
			return -1
		case a.cost > b.cost:
			return 1
		case a.w.WorkerID != b.w.WorkerID:
			if a.w.WorkerID < b.w.WorkerID {
				return -1
			}
			return 1
		case a.w.DPRank < b.w.DPRank:
			return -1
		case a.w.DPRank > b.w.DPRank:
			return 1
		}
		return 0
	}
	slices.SortFunc(rows, sortRows)
	var out []Fallback
	seen := map[uint64]bool{}
	for _, r := range rows {
		if len(out) == n {
			break
		}
		if seen[r.w.WorkerID] {
			continue
		}
		seen[r.w.WorkerID] = true
		w := v.worker(r.w.WorkerID)
		if w == nil {
			continue
		}
		out = append(out, Fallback{WorkerID: r.w.WorkerID, DPRank: r.w.DPRank, Endpoint: w.endpointOf(r.w.DPRank)})
	}
	return out
}

// selection builds the response fields shared by both routes (§7.4, §7.5, §10.4).
func (s *Service) selection(req *SelectRequest, pr *prepared, ch *choice) Selection {
	v := ch.view
	c := v.cands[ch.pos]
	w := v.workers[v.owner[ch.pos]]
	bs := uint64(v.blockSize)
	sel := Selection{
		SelectionID:            req.SelectionID,
		ModelName:              pr.key.ModelName,
		RoutingGroup:           pr.key.RoutingGroup,
		WorkerID:               c.WorkerID,
		DPRank:                 c.DPRank,
		Endpoint:               w.endpointOf(c.DPRank),
		BlockSize:              v.blockSize,
		EffectivePrefillTokens: ch.ept,
		Cost:                   ch.cost,
		Fallbacks:              ch.fall,
	}
	sel.Overlap = ch.overlap

	// potential_decode_blocks = decode_cost_blocks + trailing partial block (§10.4).
	// A trusted hash-form prompt may carry more sequence hashes than ceil(isl/bs) (no tail then)
	// or an isl near 2^64 (saturate rather than wrap).
	pdb := satAdd(ch.load.ActiveBlocks, uint64(ch.add))
	if bs > 0 {
		reqBlocks := ch.np.isl / bs
		if ch.np.isl%bs != 0 {
			reqBlocks++
		}
		if n := uint64(len(ch.np.seq)); reqBlocks > n {
			pdb = satAdd(pdb, reqBlocks-n)
		}
	}
	sel.PotentialDecodeBlocks = pdb
	if th := s.cfg.Router.ConditionalDisaggDecodeBusyThreshold; th != nil && w.totalKV != nil {
		busy := float64(sel.PotentialDecodeBlocks) > *th*float64(*w.totalKV)
		sel.DecodeBusy = &busy
	}
	return sel
}

// workerLoad is the advisory projection of the chosen rank (§7.6).
func (s *Service) workerLoad(ch *choice) *WorkerLoad {
	w := ch.view.workers[ch.view.owner[ch.pos]]
	wl := &WorkerLoad{
		ActivePrefillTokens:  ch.load.ActivePrefillTokens,
		PrefillTokenCapacity: DefaultPrefillTokenCapacity,
		TotalKVBlocks:        clonePtr(w.totalKV),
	}
	if w.maxBatch != nil {
		wl.PrefillTokenCapacity = *w.maxBatch
	}
	if th := s.cfg.Router.ConditionalDisaggPrefillBusyThreshold; th != nil {
		busy := float64(wl.ActivePrefillTokens) > *th*float64(wl.PrefillTokenCapacity)
		wl.PrefillBusy = &busy
	}
	return wl
}

// satAdd is a + b saturating at the largest uint64.
func satAdd(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return math.MaxUint64
}

func clampInt(v uint64) int {
	if v > math.MaxInt {
		return math.MaxInt
	}
	return int(v)
}

// inputSource computes the policy input groups of the eligible candidates on demand (§17.3).
type inputSource struct {
	s         *Service
	v         *partView
	sc        *selScratch
	seq       []uint64
	preferred map[string]float32
	pinned    bool
	poolRate  float64 // the partition's pooled prefill rate, tokens/s (0 = not measured)
	arrivals  float64 // the partition's booking rate, per second (0 = not measured)
}

var _ policies.InputSource = (*inputSource)(nil)

// Cache returns the raw tier counts of candidate row i (blocks).
func (src *inputSource) Cache(i int) policies.CacheInputs {
	t := src.sc.tiers[src.sc.rows[i]]
	return policies.NewCacheInputs(int(t.device), int(t.host), int(t.disk), 0)
}

// Load returns the ledger load of candidate row i with decode_cost_blocks (§10.4) and kvepp's
// engine extension (measured prefill rate, pending prefills, KV capacity).
func (src *inputSource) Load(i int) policies.LoadInputs {
	pos := src.sc.rows[i]
	ld, add := src.loadAt(pos)
	in := policies.NewLoadInputs(clampInt(ld.ActivePrefillTokens), clampInt(ld.ActiveBlocks)+add, clampInt(ld.ActiveRequests))
	e := policies.EngineLoad{
		PrefillRequests:            clampInt(ld.PrefillRequests),
		PrefillTokensPerSecond:     ld.PrefillTokensPerSecond,
		PrefillRateSamples:         ld.PrefillRateSamples,
		PoolPrefillTokensPerSecond: src.poolRate,
		PoolArrivalsPerSecond:      src.arrivals,
		PoolCandidates:             len(src.sc.rows),
		ActiveBlocks:               clampInt(ld.ActiveBlocks),
	}
	if kv := src.v.workers[src.v.owner[pos]].totalKV; kv != nil {
		e.TotalKVBlocks = clampInt(*kv)
	}
	return in.WithEngine(e)
}

// Routing returns the preferred-taint multiplier exp(−tanh(S)) of candidate row i (§9.3).
func (src *inputSource) Routing(i int) policies.RoutingInputs {
	if len(src.preferred) == 0 || src.pinned {
		return policies.NewRoutingInputs(0, false)
	}
	w := src.v.workers[src.v.owner[src.sc.rows[i]]]
	sum := 0.0
	for t, wt := range src.preferred {
		if w.hasTaint(t) {
			sum += float64(wt)
		}
	}
	return policies.NewRoutingInputs(math.Exp(-math.Tanh(sum)), true)
}

// loadAt returns (and memoises for this selection) the load and additional blocks of view
// position pos.
func (src *inputSource) loadAt(pos int32) (ledger.Load, int) {
	sc := src.sc
	if !sc.loaded[pos] {
		sc.loads[pos], sc.adds[pos] = src.s.ledger.LoadAndAdditional(toLedger(src.v.cands[pos]), src.seq)
		sc.loaded[pos] = true
	}
	return sc.loads[pos], sc.adds[pos]
}
