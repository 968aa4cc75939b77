package picker

import (
	"errors"
	"time"

	"github.com/kvepp/kvepp/ledger"
)

// affinityLease is the Tag of a booking that holds a session-affinity lease (§12.1): every
// release path of the ledger returns it, so the lease goes back exactly when the booking goes.
type affinityLease struct {
	p       *partition
	session string
}

// sessionID is the session that drives the affinity table: session_context.session_id, else the
// legacy session_id (the HTTP layer maps it to a context); "" when absent.
func sessionID(req *SelectRequest) string {
	if req.Session == nil {
		return ""
	}
	return req.Session.SessionID
}

// affinityOn reports whether session affinity is enabled (a TTL is configured).
func (s *Service) affinityOn() bool { return s.cfg.SessionAffinityTTL > 0 }

// checkSession validates a session id for the affinity table: 400 "session affinity ID must not
// exceed 256 bytes" when affinity is on and the id is longer (§12.1).
func (s *Service) checkSession(id string) error {
	if !s.affinityOn() || id == "" {
		return nil
	}
	if err := ledger.CheckSessionID(id); err != nil {
		return &Error{Kind: KindBadRequest, Message: ledger.ErrSessionIDTooLong.Error(), Err: err}
	}
	return nil
}

// validTarget reports whether a binding's target is still schedulable in view v: the worker is in
// the view and, for a ranked binding, the rank is in its range.
func validTarget(v *partView) func(ledger.AffinityTarget) bool {
	return func(t ledger.AffinityTarget) bool {
		w := v.worker(t.WorkerID)
		return w != nil && (!t.HasRank || w.hasRank(t.DPRank))
	}
}

// exactTarget converts a binding to the §8 step 6 exact target.
func exactTarget(t ledger.AffinityTarget) *AffinityTarget {
	at := &AffinityTarget{WorkerID: t.WorkerID}
	if t.HasRank {
		r := t.DPRank
		at.DPRank = &r
	}
	return at
}

// affinityError maps the affinity table's errors to picker errors (400 for both).
func affinityError(err error) error {
	switch {
	case errors.Is(err, ledger.ErrSessionIDTooLong):
		return &Error{Kind: KindBadRequest, Message: ledger.ErrSessionIDTooLong.Error(), Err: err}
	case errors.Is(err, ledger.ErrAffinityConflict):
		return &Error{Kind: KindBadRequest, Message: err.Error(), Err: err}
	}
	return &Error{Kind: KindInternal, Message: err.Error(), Err: err}
}

// sessionHold is one booking request's affinity state inside its partition's serialized context.
type sessionHold struct {
	p      *partition
	hold   ledger.AffinityHold
	active bool // the hold must end with commit or abort
}

// acquire takes the session hold of a booking in p before it selects (§12.1); with affinity off,
// no session, or a full table it is inactive. Caller holds p.mu.
func (s *Service) acquire(p *partition, session string, v *partView, now time.Time) (sessionHold, error) {
	if p.affinity == nil || session == "" {
		return sessionHold{}, nil
	}
	h, err := p.affinity.Acquire(session, now, validTarget(v))
	if err != nil {
		return sessionHold{}, affinityError(err)
	}
	return sessionHold{p: p, hold: h, active: h.Kind != ledger.HoldUnpinned}, nil
}

// lease is the booking Tag of an active hold (nil otherwise).
func (h *sessionHold) lease() any {
	if !h.active {
		return nil
	}
	return &affinityLease{p: h.p, session: h.hold.SessionID}
}

// abort ends the hold of a booking that never landed.
func (h *sessionHold) abort(now time.Time) {
	if h.active {
		h.p.affinity.Abort(h.hold, now)
		h.active = false
	}
}

// commit binds or leases the session for the landed booking id on c (§12.1). A hard-mode
// conflict returns a 400 error; the caller frees the booking.
func (s *Service) commit(h *sessionHold, id string, c WorkerRank, steered bool, v *partView, now time.Time) error {
	if !h.active {
		return nil
	}
	h.active = false
	u, changed, err := h.p.affinity.Commit(h.hold, id, ledger.AffinityTarget{WorkerID: c.WorkerID, DPRank: c.DPRank, HasRank: true},
		steered, now, validTarget(v))
	if err != nil {
		return affinityError(err)
	}
	if changed && s.cfg.AffinityPublisher != nil {
		s.cfg.AffinityPublisher.PublishAffinity(h.p.key, u)
	}
	return nil
}

// releaseLeases gives back the affinity leases of released bookings; publish is false for expiry
// (which never publishes anything, §10.5).
func (s *Service) releaseLeases(bs []ledger.Booking, publish bool) {
	now := time.Time{}
	for i := range bs {
		l, ok := bs[i].Tag.(*affinityLease)
		if !ok || l.p.affinity == nil {
			continue
		}
		if now.IsZero() {
			now = s.now()
		}
		u, released := l.p.affinity.Release(l.session, bs[i].ID, now)
		if released && publish && s.cfg.AffinityPublisher != nil {
			s.cfg.AffinityPublisher.PublishAffinity(l.p.key, u)
		}
	}
}

// freeBooking releases the live booking id (and its lease) and reports whether it was live.
func (s *Service) freeBooking(id string) bool {
	b, err := s.ledger.Free(id)
	if err != nil {
		return false
	}
	s.publishLifecycle(ledger.SlotFree, &b) // its admission was published when it landed
	s.releaseLeases([]ledger.Booking{b}, true)
	return true
}

// SweepReservations is the reservation-index sweep of §10.5, run every expiry period: affinity
// leases whose reservation no longer exists as the booking that took them (released out of band)
// are dropped. In-flight claims hold no lease and are never touched. It returns the number of
// leases released.
func (s *Service) SweepReservations(now time.Time) int {
	n := 0
	for _, p := range s.partitionsSnapshot() {
		if p.affinity == nil {
			continue
		}
		n += p.affinity.SweepLeases(func(session, id string) bool {
			b, ok := s.ledger.Lookup(id)
			if !ok {
				return false
			}
			l, ok := b.Tag.(*affinityLease)
			return ok && l.p == p && l.session == session
		}, now)
	}
	return n
}

// ReapAffinity drops idle session bindings past their deadline in every partition (the §12.1
// reaper, run every min(TTL, 30 s)) and returns how many it dropped.
func (s *Service) ReapAffinity(now time.Time) int {
	n := 0
	for _, p := range s.partitionsSnapshot() {
		if p.affinity != nil {
			n += p.affinity.Reap(now)
		}
	}
	return n
}

// SessionBinding returns the live binding of session in partition key with its lease count (for
// inspection and tests); ok is false when affinity is off or the session is not bound.
func (s *Service) SessionBinding(key PartitionKey, session string) (target WorkerRank, hasRank bool, leases int, ok bool) {
	p := s.partition(key)
	if p == nil || p.affinity == nil {
		return WorkerRank{}, false, 0, false
	}
	t, n, ok := p.affinity.Binding(session, s.now())
	return WorkerRank{WorkerID: t.WorkerID, DPRank: t.DPRank}, t.HasRank, n, ok
}

// ApplyRemoteAffinity applies a session binding received from a replica (§12.1 apply rules,
// the replica-sync seam): updates for an unknown partition, a worker that is not schedulable in
// that partition, a rank outside its range, or with affinity off are dropped. It reports whether
// the binding changed the local table.
func (s *Service) ApplyRemoteAffinity(key PartitionKey, u ledger.AffinityUpdate) bool {
	p := s.partition(key)
	if p == nil || p.affinity == nil || !validTarget(p.view.Load())(u.Target) {
		return false
	}
	return p.affinity.ApplyRemote(u, s.now())
}
