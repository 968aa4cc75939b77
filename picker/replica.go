package picker

import (
	"github.com/kvepp/kvepp/ledger"
)

// SlotPublisher receives the booking lifecycle events a replica shares with its peers
// (selection-service.md §15.2, §15.4): every admission (/select_and_reserve, cached replay,
// explicit reservation, ext_proc bookings), every prefill completion and every free made through
// this Service — on its own bookings and on mirrored ones alike, so a lifecycle call sent to any
// replica reaches the replica that admitted the booking. Output blocks, expiry and worker removal
// publish nothing. blockSize is the partition's block size in tokens. Called with the partition's
// selection mutex held or not: implementations must not block and must treat ev.SequenceHashes as
// read-only.
type SlotPublisher interface {
	// PublishSlot hands one event of partition key to the replica transport.
	PublishSlot(key PartitionKey, blockSize uint32, ev ledger.SlotEvent)
}

// RemoteOutcome is what ApplyRemoteSlot did with a replicated event: applied, or the reason it
// was dropped (selection-service.md §15.4 receive path).
type RemoteOutcome uint8

const (
	// RemoteApplied: the event changed the ledger.
	RemoteApplied RemoteOutcome = iota
	// RemoteUnknownPartition: no partition (model_name, routing_group) here.
	RemoteUnknownPartition
	// RemoteBlockSizeMismatch: the envelope's block_size differs from the partition's.
	RemoteBlockSizeMismatch
	// RemoteUnknownWorker: the worker is not schedulable in that partition here.
	RemoteUnknownWorker
	// RemoteUnknownRank: the dp_rank is outside the worker's range here.
	RemoteUnknownRank
	// RemoteUnknownReservation: a prefill completion or free for an id that is not live here on
	// that partition and worker (never seen, already freed, expired, or dropped earlier).
	RemoteUnknownReservation
	// RemoteConflict: an admission whose id is live here as this replica's own booking (or as a
	// mirror in another partition); ids must be globally unique.
	RemoteConflict
	// RemoteInvalid: an event that cannot be applied (unknown kind, empty id, zero origin).
	RemoteInvalid
	// NumRemoteOutcomes is the number of outcomes.
	NumRemoteOutcomes
)

// String returns the outcome's metric label.
func (o RemoteOutcome) String() string {
	switch o {
	case RemoteApplied:
		return "applied"
	case RemoteUnknownPartition:
		return "unknown_partition"
	case RemoteBlockSizeMismatch:
		return "block_size_mismatch"
	case RemoteUnknownWorker:
		return "unknown_worker"
	case RemoteUnknownRank:
		return "unknown_rank"
	case RemoteUnknownReservation:
		return "unknown_reservation"
	case RemoteConflict:
		return "conflict"
	case RemoteInvalid:
		return "invalid"
	}
	return "unknown"
}

// HasPartition reports whether partition key exists here (the replica receive path drops events
// of unknown partitions before queueing them, §15.4).
func (s *Service) HasPartition(key PartitionKey) bool { return s.partition(key) != nil }

// ApplyRemoteSlot applies a booking event received from another replica (selection-service.md
// §15.4 receive path). It drops, in this order, events of an unknown partition, of a block size
// (tokens) other than the partition's, on a worker that is not schedulable in that partition, or
// on a rank outside the worker's range. Then:
//   - an admission is mirrored into the ledger (ledger.Ledger.Mirror: replacing an earlier mirror
//     of the id or a local claim; never a live local booking) with admission time now, prefill
//     tokens = the prefill hint when prefill is tracked (len(SequenceHashes) × blockSize without a
//     hint; 0 when untracked), so /loads and the cost function count it and lifecycle calls for
//     the id work here;
//   - a prefill completion or free acts on the live booking of the id (mirror or this replica's
//     own) when it is in that partition on that worker and rank; a free gives back the booking's
//     session-affinity lease and lets queued requests use the capacity.
//
// Nothing is published: events received are never re-sent. ev.Origin must be the sender's router_id
// (the transport drops this replica's own events before calling). The ledger takes ownership of
// ev.SequenceHashes.
func (s *Service) ApplyRemoteSlot(key PartitionKey, blockSize uint32, ev ledger.SlotEvent) RemoteOutcome {
	p := s.partition(key)
	if p == nil {
		return RemoteUnknownPartition
	}
	v := p.view.Load()
	if v.blockSize != blockSize {
		return RemoteBlockSizeMismatch
	}
	w := v.worker(ev.Candidate.WorkerID)
	if w == nil {
		return RemoteUnknownWorker
	}
	if !w.hasRank(ev.Candidate.DPRank) {
		return RemoteUnknownRank
	}
	if ev.ID == "" || ev.Origin == 0 {
		return RemoteInvalid
	}
	// A peer's booking is bounded like a local one (MaxISLTokens): a prefill hint or a prompt
	// beyond it would pin the worker's load at an impossible value until expiry.
	if (ev.PrefillTokens != nil && *ev.PrefillTokens > MaxISLTokens) ||
		uint64(len(ev.SequenceHashes))*uint64(blockSize) > MaxISLTokens+uint64(blockSize) {
		return RemoteInvalid
	}
	name := key.String()
	switch ev.Kind {
	case ledger.SlotAdmission:
		prefill := uint64(0)
		if ev.TrackPrefillTokens {
			if ev.PrefillTokens != nil {
				prefill = *ev.PrefillTokens
			} else {
				prefill = uint64(len(ev.SequenceHashes)) * uint64(blockSize)
			}
		}
		replaced, ok, err := s.ledger.Mirror(ledger.Booking{
			ID: ev.ID, Candidate: ev.Candidate, SequenceHashes: ev.SequenceHashes, PrefillTokens: prefill,
			ExpectedOutputTokens: ev.ExpectedOutputTokens, Admitted: s.now(), Partition: name, Origin: ev.Origin,
		})
		if err != nil {
			return RemoteConflict
		}
		if ok {
			s.releaseLeases([]ledger.Booking{replaced}, false)
		}
		return RemoteApplied
	case ledger.SlotPrefillComplete, ledger.SlotFree:
		b, ok := s.ledger.Lookup(ev.ID)
		if !ok || b.Partition != name || b.Candidate != ev.Candidate {
			return RemoteUnknownReservation
		}
		if ev.Kind == ledger.SlotPrefillComplete {
			if s.ledger.PrefillCompleteAttempt(ev.ID, b.Attempt) != nil {
				return RemoteUnknownReservation
			}
		} else {
			freed, err := s.ledger.FreeAttempt(ev.ID, b.Attempt)
			if err != nil {
				return RemoteUnknownReservation
			}
			// A booking of this replica freed through a peer gives back its lease, and the lease
			// release is published like any other (§12.1); a mirror holds no lease.
			s.releaseLeases([]ledger.Booking{freed}, true)
		}
		s.kickName(name) // released prefill or capacity admits queued requests (§13.3)
		return RemoteApplied
	}
	return RemoteInvalid
}

// publishAdmission shares a booking that just landed in partition key (block size bs tokens) with
// the replicas; track says whether the booking's prefill tokens are tracked. No-op without a
// SlotPublisher.
func (s *Service) publishAdmission(key PartitionKey, bs uint32, b *ledger.Booking, track bool, lora string) {
	pub := s.cfg.SlotPublisher
	if pub == nil {
		return
	}
	ev := ledger.SlotEvent{
		Kind: ledger.SlotAdmission, ID: b.ID, Candidate: b.Candidate, SequenceHashes: b.SequenceHashes,
		TrackPrefillTokens: track, ExpectedOutputTokens: b.ExpectedOutputTokens,
	}
	if track {
		prefill := b.PrefillTokens
		ev.PrefillTokens = &prefill
	}
	if lora != "" {
		ev.LoraName = &lora
	}
	pub.PublishSlot(key, bs, ev)
}

// publishLifecycle shares a prefill completion or free of booking b (this replica's or a mirror)
// with the replicas. No-op without a SlotPublisher or when b's partition is gone.
func (s *Service) publishLifecycle(kind ledger.SlotEventKind, b *ledger.Booking) {
	pub := s.cfg.SlotPublisher
	if pub == nil {
		return
	}
	s.mu.RLock()
	p := s.byName[b.Partition]
	s.mu.RUnlock()
	if p == nil {
		return
	}
	pub.PublishSlot(p.key, p.view.Load().blockSize, ledger.SlotEvent{Kind: kind, ID: b.ID, Candidate: b.Candidate})
}

// Booking returns a snapshot of the live booking id, this replica's own (Origin 0) or mirrored
// from a peer (for inspection and tests; SequenceHashes is read-only). A merely claimed id is not
// found.
func (s *Service) Booking(id string) (ledger.Booking, bool) { return s.ledger.Lookup(id) }

// ReservationCounts returns the number of live bookings (mirrors included) and of claims that
// have not become bookings.
func (s *Service) ReservationCounts() (bookings, claims int) { return s.ledger.Len() }

// ForgetReplica releases every booking mirrored from the replica with router_id origin, which
// has left (its peer was deregistered: it drained and ended, or died), and returns how many
// (selection-service.md §15: without it those bookings would count as load until the expiry
// sweep, up to DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS + 60 s). Mirrors hold no lease; released
// capacity admits queued requests (§13.3).
func (s *Service) ForgetReplica(origin uint64) int {
	released := s.ledger.ReleaseMirrorsOf(origin)
	s.releaseLeases(released, false)
	s.kickPartitionsOf(released)
	return len(released)
}
