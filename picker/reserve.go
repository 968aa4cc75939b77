package picker

import (
	"context"

	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/ledger"
)

// ReservationRequest is the body of POST /reservations (selection-service.md §10.1). With
// WorkerID nil it is the cached replay form: only ModelName, RoutingGroup and SelectionID are
// read. With WorkerID set it is the explicit form.
type ReservationRequest struct {
	ModelName    string // "" means "default"
	RoutingGroup string // "" means "default"
	// SelectionID is required: the pending-selection key and the booking id.
	SelectionID string
	// WorkerID selects the explicit form; DPRank defaults to 0.
	WorkerID *uint64
	// DPRank is the explicit form's global rank (nil = 0).
	DPRank *uint32
	// Prompt is the explicit form's prompt (§6; in hash form block_hashes is optional).
	Prompt Prompt
	// Override is the optional router_config_override (assume_kv_reuse, track_prefill_tokens).
	Override *RouterConfigOverride
	// ExpectedOutputTokens is optional booking metadata (tokens).
	ExpectedOutputTokens *uint32
	// EffectivePrefillTokens (tokens), when supplied, is the booked prefill and turns prefill
	// tracking on unless TrackPrefillTokens is false; it must not exceed isl_tokens.
	EffectivePrefillTokens *uint64
	// TrackPrefillTokens, when supplied, decides prefill tracking.
	TrackPrefillTokens *bool
}

// Reservation is the 201 body of POST /reservations (selection-service.md §10.1).
type Reservation struct {
	// SelectionID is the booking id.
	SelectionID string `json:"selection_id"`
	// ModelName is the partition model.
	ModelName string `json:"model_name"`
	// RoutingGroup is the partition group.
	RoutingGroup string `json:"routing_group"`
	// WorkerID is the booked worker.
	WorkerID uint64 `json:"worker_id"`
	// DPRank is the booked global rank.
	DPRank uint32 `json:"dp_rank"`
	// Endpoint is the endpoint serving the booked rank (WorkerRecord.RankEndpoint).
	Endpoint string `json:"endpoint"`
}

// Reserve books a reservation (selection-service.md §10.1) in one of two forms.
//
// Cached replay (WorkerID nil): the pending selection of (model, group, selection_id) is booked
// with exactly its cached inputs (every other request field is ignored). It is removed only
// after the booking lands and only if no newer /select replaced it; failures leave it for a
// retry, except a session-affinity conflict, which removes it. A cached session is bound like
// /select_and_reserve does (§12.1).
//
// Explicit (WorkerID set): any cached selection of the id in this partition is discarded first;
// the prompt is validated as in §6 with block_hashes optional in hash form; prefill tracking is
// TrackPrefillTokens if supplied, else on when EffectivePrefillTokens is supplied, else the
// override's or configured track_prefill_tokens; the booked prefill is EffectivePrefillTokens if
// supplied, else isl_tokens.
//
// In approximate mode the booking records its blocks when it has block hashes (token form or
// supplied block_hashes). Errors: KindUnprocessable "missing field `selection_id`" (and bad
// overrides); KindNotReady (shutdown, partition not ready); KindNotFound "no pending selection
// {id} for {model}:{group} (expired, already used, or never selected)", "schedulable worker W
// (dp_rank R) not found for {model}:{group}", "schedulable worker W not found for
// {model}:{group}"; KindBadRequest (prompt, "effective_prefill_tokens (E) must not exceed
// isl_tokens (I)", session affinity conflict, names and ids over their limits); KindConflict "selection {id} is already reserved
// or being reserved".
func (s *Service) Reserve(ctx context.Context, req ReservationRequest) (Reservation, error) {
	if s.shuttingDown.Load() {
		return Reservation{}, errShuttingDown()
	}
	if req.SelectionID == "" {
		return Reservation{}, Errorf(KindUnprocessable, "selection_id must not be empty")
	}
	key := PartitionKey{ModelName: req.ModelName, RoutingGroup: req.RoutingGroup}
	if key.ModelName == "" {
		key.ModelName = DefaultPartitionName
	}
	if key.RoutingGroup == "" {
		key.RoutingGroup = DefaultPartitionName
	}
	if err := validateRequestIDs(key, req.SelectionID, nil, false); err != nil {
		return Reservation{}, err
	}
	pk := ledger.PendingKey{ModelName: key.ModelName, RoutingGroup: key.RoutingGroup, SelectionID: req.SelectionID}
	if req.WorkerID != nil {
		return s.reserveExplicit(ctx, key, pk, &req)
	}
	return s.replay(ctx, key, pk)
}

// replay is the cached replay form of Reserve.
func (s *Service) replay(ctx context.Context, key PartitionKey, pk ledger.PendingKey) (Reservation, error) {
	now := s.now()
	ps, gen, ok := s.pending.Peek(pk, now)
	if !ok {
		return Reservation{}, Errorf(KindNotFound, "no pending selection %s for %s (expired, already used, or never selected)",
			excerpt.Of(pk.SelectionID), key)
	}
	if err := s.readiness(key); err != nil {
		return Reservation{}, err
	}
	p := s.partition(key)
	p.mu.Lock()
	defer p.mu.Unlock()
	v := p.view.Load()
	c := ps.Candidate
	w := v.worker(c.WorkerID)
	if w == nil || !w.hasRank(c.DPRank) {
		return Reservation{}, Errorf(KindNotFound, "schedulable worker %d (dp_rank %d) not found for %s", c.WorkerID, c.DPRank, key)
	}
	if err := s.ledger.Claim(pk.SelectionID); err != nil {
		return Reservation{}, ledgerError(err)
	}
	booked := false
	defer func() {
		if !booked {
			s.ledger.Unclaim(pk.SelectionID)
		}
	}()
	if err := ctx.Err(); err != nil {
		return Reservation{}, cancelled(err)
	}
	hold, err := s.acquire(p, ps.SessionID, v, now)
	if err != nil {
		return Reservation{}, err
	}
	defer hold.abort(now)
	prefill := uint64(0)
	if ps.TrackPrefillTokens {
		prefill = ps.EffectivePrefillTokens
	}
	b := ledger.Booking{
		ID:                   pk.SelectionID,
		Candidate:            c,
		SequenceHashes:       ps.SequenceHashes,
		PrefillTokens:        prefill,
		ExpectedOutputTokens: ps.ExpectedOutputTokens,
		Admitted:             now,
		Partition:            key.String(),
		Tag:                  hold.lease(),
	}
	if err := s.ledger.Book(b); err != nil {
		return Reservation{}, ledgerError(err)
	}
	booked = true
	s.publishAdmission(key, v.blockSize, &b, ps.TrackPrefillTokens, ps.LoraName)
	if !s.cfg.Router.UseKVEvents && ps.BlockHashes != nil {
		s.recordApproximate(v, toIndex(c), ps.BlockHashes)
	}
	if err := ctx.Err(); err != nil {
		s.freeBooking(pk.SelectionID)
		return Reservation{}, cancelled(err)
	}
	if err := s.commit(&hold, pk.SelectionID, WorkerRank(c), ps.SessionSteered, v, now); err != nil {
		s.freeBooking(pk.SelectionID)
		s.pending.Remove(pk, gen)
		return Reservation{}, err
	}
	s.pending.Remove(pk, gen)
	return Reservation{SelectionID: pk.SelectionID, ModelName: key.ModelName, RoutingGroup: key.RoutingGroup,
		WorkerID: c.WorkerID, DPRank: c.DPRank, Endpoint: w.endpointOf(c.DPRank)}, nil
}

// validateExplicitPrompt is §6.3 for an explicit reservation: block_hashes is optional in hash
// form (when given, its length must still match sequence_hashes).
func validateExplicitPrompt(pr *Prompt) error { return checkHashForm(pr, false) }

// reserveExplicit is the explicit form of Reserve.
func (s *Service) reserveExplicit(ctx context.Context, key PartitionKey, pk ledger.PendingKey, req *ReservationRequest) (Reservation, error) {
	s.pending.Discard(pk)
	if err := s.readiness(key); err != nil {
		return Reservation{}, err
	}
	eff, err := s.resolveOverride(req.Override)
	if err != nil {
		return Reservation{}, err
	}
	if err := validateExplicitPrompt(&req.Prompt); err != nil {
		return Reservation{}, err
	}
	p := s.partition(key)
	p.mu.Lock()
	defer p.mu.Unlock()
	v := p.view.Load()
	if len(v.workers) == 0 {
		return Reservation{}, s.notReady(key)
	}
	var np normPrompt
	if req.Prompt.HashForm {
		np = normPrompt{local: req.Prompt.BlockHashes, recordable: req.Prompt.BlockHashes != nil,
			seq: req.Prompt.SequenceHashes, isl: req.Prompt.ISLTokens}
	} else if np, err = normalizePrompt(&req.Prompt, v.blockSize, v.isEagle, eff.assumeReuse); err != nil {
		return Reservation{}, err
	}
	if e := req.EffectivePrefillTokens; e != nil && *e > np.isl {
		return Reservation{}, Errorf(KindBadRequest, "effective_prefill_tokens (%d) must not exceed isl_tokens (%d)", *e, np.isl)
	}
	wid := *req.WorkerID
	w := v.worker(wid)
	if w == nil {
		return Reservation{}, Errorf(KindNotFound, "schedulable worker %d not found for %s", wid, key)
	}
	rank := uint32(0)
	if req.DPRank != nil {
		rank = *req.DPRank
	}
	if !w.hasRank(rank) {
		return Reservation{}, Errorf(KindNotFound, "schedulable worker %d (dp_rank %d) not found for %s", wid, rank, key)
	}
	track := eff.track
	switch {
	case req.TrackPrefillTokens != nil:
		track = *req.TrackPrefillTokens
	case req.EffectivePrefillTokens != nil:
		track = true
	}
	prefill := uint64(0)
	if track {
		prefill = np.isl
		if req.EffectivePrefillTokens != nil {
			prefill = *req.EffectivePrefillTokens
		}
	}
	if err := s.ledger.Claim(pk.SelectionID); err != nil {
		return Reservation{}, ledgerError(err)
	}
	c := ledger.Candidate{WorkerID: wid, DPRank: rank}
	b := ledger.Booking{
		ID:                   pk.SelectionID,
		Candidate:            c,
		SequenceHashes:       np.seq,
		PrefillTokens:        prefill,
		ExpectedOutputTokens: clonePtr(req.ExpectedOutputTokens),
		Admitted:             s.now(),
		Partition:            key.String(),
	}
	if err := s.ledger.Book(b); err != nil {
		s.ledger.Unclaim(pk.SelectionID)
		return Reservation{}, ledgerError(err)
	}
	s.publishAdmission(key, v.blockSize, &b, track, req.Prompt.LoraName)
	if !s.cfg.Router.UseKVEvents && np.recordable {
		s.recordApproximate(v, toIndex(c), np.local)
	}
	if err := ctx.Err(); err != nil {
		s.freeBooking(pk.SelectionID)
		return Reservation{}, cancelled(err)
	}
	return Reservation{SelectionID: pk.SelectionID, ModelName: key.ModelName, RoutingGroup: key.RoutingGroup,
		WorkerID: wid, DPRank: rank, Endpoint: w.endpointOf(rank)}, nil
}
