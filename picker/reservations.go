package picker

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/ledger"
)

// PrefillComplete removes a live booking's prefill tokens; its blocks remain as decode load
// (selection-service.md §10.2), then admits what the freed prefill capacity allows from the
// booking's partition queue (§13.3). The call is taken as observed at the service's now: unless
// the booking was reserved with PrefillUnobserved, the first completion trains the worker rank's
// measured prefill rate. Idempotent on a live booking. Works during shutdown so
// in-flight requests keep accounting exactly. Errors: KindNotFound "reservation {id} not found" (unknown,
// claimed but not booked, or freed).
func (s *Service) PrefillComplete(ctx context.Context, selectionID string) error {
	_ = ctx
	if err := s.ledger.PrefillCompleteAt(selectionID, s.now()); err != nil {
		return ledgerError(err)
	}
	if s.queued.Load() > 0 || s.cfg.SlotPublisher != nil {
		if b, ok := s.ledger.Lookup(selectionID); ok {
			s.publishLifecycle(ledger.SlotPrefillComplete, &b) // repeats re-publish (§10.2)
			s.kickName(b.Partition)                            // freed prefill capacity admits queued requests (§13.3)
		}
	}
	return nil
}

// OutputBlock adds one output block with a fresh random hash to a live booking and, when
// decayFraction is non-nil, sets the booking's decay_fraction (selection-service.md §10.2, §10.3).
// Errors: KindBadRequest "decay_fraction must be between 0.0 and 1.0" (NaN included; checked
// before the lookup); KindNotFound "reservation {id} not found".
func (s *Service) OutputBlock(ctx context.Context, selectionID string, decayFraction *float64) error {
	_ = ctx
	if d := decayFraction; d != nil && !(*d >= 0 && *d <= 1) {
		return Errorf(KindBadRequest, "decay_fraction must be between 0.0 and 1.0")
	}
	if err := s.ledger.OutputBlock(selectionID, decayFraction, rand.Uint64()); err != nil {
		return ledgerError(err)
	}
	return nil
}

// Free releases a live booking exactly once, with its session-affinity lease
// (selection-service.md §10.2 DELETE, §12.1), then admits what the freed capacity allows from
// the booking's partition queue (§13.3). Works during shutdown. Errors: KindNotFound "reservation {id} not found" (unknown, claimed but not booked,
// or already freed).
func (s *Service) Free(ctx context.Context, selectionID string) error {
	_ = ctx
	b, err := s.ledger.Free(selectionID)
	if err != nil {
		return ledgerError(err)
	}
	s.publishLifecycle(ledger.SlotFree, &b)
	s.releaseLeases([]ledger.Booking{b}, true)
	s.kickName(b.Partition) // freed capacity admits queued requests (§13.3)
	return nil
}

// ExpireStale force-releases every booking admitted more than ActiveRequestExpirySecs before now
// (the expiry guard of selection-service.md §10.5; local state only, nothing is published; their
// session-affinity leases are released) and
// drops approximate-index entries whose TTL passed (kv-events-index.md §15.1). It returns the
// number of bookings released. Released capacity admits queued requests (§13.3). Run calls it
// every 60 s.
func (s *Service) ExpireStale(now time.Time) int {
	limit := time.Duration(s.cfg.Router.ActiveRequestExpirySecs * float64(time.Second))
	expired := s.ledger.ExpireAdmittedBefore(now.Add(-limit))
	s.releaseLeases(expired, false)
	s.kickPartitionsOf(expired) // expiry frees capacity for queued requests (§13.3)
	if len(expired) > 0 {
		s.log.Warn().Int("bookings", len(expired)).Int64("expiry_ms", limit.Milliseconds()).Msg("expired stale bookings")
	}
	for _, p := range s.partitionsSnapshot() {
		if ix := p.view.Load().index; ix != nil && ix.approx != nil {
			ix.approx.ExpireBefore(now)
		}
	}
	return len(expired)
}

// recordApproximate records a booked decision into the approximate index (kv-events-index.md
// §15.1). Caller holds the partition mutex.
func (s *Service) recordApproximate(v *partView, c kvindex.Candidate, local []uint64) {
	if v.index == nil || v.index.approx == nil || len(local) == 0 {
		return
	}
	if err := v.index.approx.RecordBooking(c, local, s.now()); err != nil {
		s.log.Debug().Err(err).Uint64("worker_id", c.WorkerID).Uint32("dp_rank", c.DPRank).
			Msg("approximate index did not record the booking")
	}
}

// PotentialLoad is one rank's load row of GET /loads (selection-service.md §14.1): with no
// incoming request potential_prefill_tokens = active prefill tokens and potential_decode_blocks
// = active blocks.
type PotentialLoad struct {
	// WorkerID is the worker.
	WorkerID uint64 `json:"worker_id"`
	// DPRank is the global rank.
	DPRank uint32 `json:"dp_rank"`
	// PotentialPrefillTokens is active prefill (+ this prompt's effective prefill on /potential_loads).
	PotentialPrefillTokens uint64 `json:"potential_prefill_tokens"`
	// PotentialDecodeBlocks is active blocks (+ this prompt's new blocks on /potential_loads).
	PotentialDecodeBlocks uint64 `json:"potential_decode_blocks"`
	// ActiveRequests is the live bookings on the rank.
	ActiveRequests uint64 `json:"active_requests"`
}

// PartitionLoads is one partition's entry of GET /loads (selection-service.md §14.1): a row per
// rank of every schedulable worker sorted by (worker_id, dp_rank), plus the queue backlog.
type PartitionLoads struct {
	// ModelName is the partition model.
	ModelName string `json:"model_name"`
	// RoutingGroup is the partition group.
	RoutingGroup string `json:"routing_group"`
	// Loads has one row per schedulable rank.
	Loads []PotentialLoad `json:"loads"`
	// PendingCount is the queue backlog (requests).
	PendingCount uint64 `json:"pending_count"`
	// PendingISLTokens is the queue backlog in input tokens.
	PendingISLTokens uint64 `json:"pending_isl_tokens"`
}

// Loads returns the current load of every partition matching the optional model and group
// filters, sorted by (model_name, routing_group). Works during shutdown.
func (s *Service) Loads(model, group string) []PartitionLoads {
	out := []PartitionLoads{}
	for _, p := range s.partitionsSnapshot() {
		if (model != "" && p.key.ModelName != model) || (group != "" && p.key.RoutingGroup != group) {
			continue
		}
		v := p.view.Load()
		cs := make([]ledger.Candidate, len(v.cands))
		for i, c := range v.cands {
			cs[i] = toLedger(c)
		}
		lds := s.ledger.Loads(cs, nil)
		pl := PartitionLoads{ModelName: p.key.ModelName, RoutingGroup: p.key.RoutingGroup, Loads: make([]PotentialLoad, len(cs)),
			PendingCount: p.pendingCount.Load(), PendingISLTokens: p.pendingISL.Load()}
		for i, c := range v.cands {
			pl.Loads[i] = PotentialLoad{
				WorkerID: c.WorkerID, DPRank: c.DPRank,
				PotentialPrefillTokens: lds[i].ActivePrefillTokens,
				PotentialDecodeBlocks:  lds[i].ActiveBlocks,
				ActiveRequests:         lds[i].ActiveRequests,
			}
		}
		out = append(out, pl)
	}
	return out
}

// LoadOnlyPick chooses, without a prompt and without booking, the schedulable rank with the
// fewest active requests, ties uniformly at random (epp.md §5.7), among the partitions of model
// ("" = every partition) and, when allowedSet, the workers in allowed (an empty list allows
// none). The result carries the partition, worker, rank, endpoint and block size only.
// Errors: KindNotReady "selection service is shutting down", "no schedulable workers are
// available", "no endpoints available to route work".
func (s *Service) LoadOnlyPick(ctx context.Context, model string, allowed []uint64, allowedSet bool) (Selection, error) {
	if s.shuttingDown.Load() {
		return Selection{}, errShuttingDown()
	}
	if err := ctx.Err(); err != nil {
		return Selection{}, cancelled(err)
	}
	if s.schedulable.Load() <= 0 {
		return Selection{}, Errorf(KindNotReady, "no schedulable workers are available")
	}
	var allow map[uint64]struct{}
	if allowedSet {
		allow = make(map[uint64]struct{}, len(allowed))
		for _, id := range allowed {
			allow[id] = struct{}{}
		}
	}
	var (
		best     Selection
		bestReqs uint64
		ties     int
	)
	withheld := s.withheldLoad()
	s.rngMu.Lock()
	defer s.rngMu.Unlock()
	for _, p := range s.partitionsSnapshot() {
		if model != "" && p.key.ModelName != model {
			continue
		}
		v := p.view.Load()
		for i, c := range v.cands {
			w := v.workers[v.owner[i]]
			if withheld.has(w.id) {
				continue
			}
			if allow != nil {
				if _, ok := allow[w.id]; !ok {
					continue
				}
			}
			reqs := s.ledger.Load(toLedger(c)).ActiveRequests
			switch {
			case ties == 0 || reqs < bestReqs:
				ties, bestReqs = 1, reqs
			case reqs == bestReqs:
				ties++
				if s.rng.IntN(ties) != 0 {
					continue
				}
			default:
				continue
			}
			best = Selection{
				ModelName: p.key.ModelName, RoutingGroup: p.key.RoutingGroup, WorkerID: c.WorkerID,
				DPRank: c.DPRank, Endpoint: w.endpointOf(c.DPRank), BlockSize: v.blockSize,
			}
		}
	}
	if ties == 0 {
		return Selection{}, Errorf(KindNotReady, "no endpoints available to route work")
	}
	return best, nil
}

// kickPartitionsOf wakes the queue of each partition that released bookings name, once each, when
// any request is queued (§13.3).
func (s *Service) kickPartitionsOf(released []ledger.Booking) {
	if s.queued.Load() == 0 {
		return
	}
	kicked := map[string]bool{}
	for i := range released {
		if name := released[i].Partition; !kicked[name] {
			kicked[name] = true
			s.kickName(name)
		}
	}
}
