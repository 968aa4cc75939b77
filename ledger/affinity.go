package ledger

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"time"
)

// Bounds of a session-affinity table (selection-service.md §12.1).
const (
	// DefaultAffinityMaxEntries caps one partition's table; when full, new sessions route unpinned.
	DefaultAffinityMaxEntries = 65536
	// MaxSessionIDBytes is the longest accepted session id, in bytes.
	MaxSessionIDBytes = 256
	// MaxAffinityTTL is the largest --session-affinity-ttl-secs (one year).
	MaxAffinityTTL = 31_536_000 * time.Second
	// MaxAffinityReapInterval caps the reaper period: it runs every min(TTL, 30 s).
	MaxAffinityReapInterval = 30 * time.Second
)

// Session-affinity errors; test with errors.Is.
var (
	// ErrSessionIDTooLong: the session id exceeds MaxSessionIDBytes (HTTP 400).
	ErrSessionIDTooLong = errors.New("session affinity ID must not exceed 256 bytes")
	// ErrAffinityConflict: a hard-mode conflict — the dispatch differs from the live binding.
	ErrAffinityConflict = errors.New("session affinity conflict")
)

// AffinityTarget is what a session is bound to: a worker and, when HasRank, one dp_rank. Local
// commits always carry a rank; replicated bindings may be worker-only.
type AffinityTarget struct {
	// WorkerID is the bound worker.
	WorkerID uint64
	// DPRank is the bound global dp_rank; meaningful only when HasRank.
	DPRank uint32
	// HasRank is false for a worker-only binding (any rank of the worker).
	HasRank bool
}

// String renders "worker W dp_rank R" or "worker W".
func (t AffinityTarget) String() string {
	if t.HasRank {
		return fmt.Sprintf("worker %d dp_rank %d", t.WorkerID, t.DPRank)
	}
	return fmt.Sprintf("worker %d", t.WorkerID)
}

// AffinityVersion orders binding versions by (Sequence, WriterID) (§12.1 replication).
type AffinityVersion struct {
	// Sequence starts at wall-clock nanoseconds and is bumped past every observed sequence.
	Sequence uint64
	// WriterID is the writing replica's id (breaks Sequence ties).
	WriterID uint64
}

// Less reports whether v orders before w.
func (v AffinityVersion) Less(w AffinityVersion) bool {
	return v.Sequence < w.Sequence || (v.Sequence == w.Sequence && v.WriterID < w.WriterID)
}

// AffinityUpdate is a binding as replicated between selector replicas (§12.1, §15.3 without the
// partition fields, which the caller owns): published on each commit and each lease release, and
// applied on receipt with ApplyRemote.
type AffinityUpdate struct {
	// SessionID is the bound session (at most MaxSessionIDBytes bytes).
	SessionID string
	// Target is the binding.
	Target AffinityTarget
	// Version orders concurrent writes of the same session.
	Version AffinityVersion
}

// HoldKind says what Acquire found for a session.
type HoldKind uint8

const (
	// HoldUnpinned: the table is full; route without affinity and commit nothing.
	HoldUnpinned HoldKind = iota
	// HoldInitializing: no live binding; this request chooses and its commit binds the session.
	HoldInitializing
	// HoldBound: a live, schedulable binding; steer to Target (the hold owns one lease).
	HoldBound
)

// AffinityHold is a request's claim on a session, from Acquire to Commit or Abort.
type AffinityHold struct {
	// SessionID is the session held.
	SessionID string
	// Kind is what Acquire found.
	Kind HoldKind
	// Target is the binding to steer to (HoldBound only).
	Target AffinityTarget

	entry  *affinityEntry // the entry this hold refers to (nil for HoldUnpinned)
	joined bool           // an Initializing hold that joined another request's initialization
}

// AffinityConfig configures an AffinityTable.
type AffinityConfig struct {
	// TTL is the idle lifetime of a binding after its last lease is released (1 s … 1 year).
	TTL time.Duration
	// MaxEntries caps the table (0 = DefaultAffinityMaxEntries).
	MaxEntries int
	// WriterID identifies this process in binding versions (0 is allowed; pick a random non-zero id).
	WriterID uint64
}

// affinityEntry is one session's state.
type affinityEntry struct {
	id           string
	initializing bool
	target       AffinityTarget
	version      AffinityVersion
	// holders are the reservations holding a lease (reservation id → struct{}); pending counts
	// Bound holds acquired but not yet committed or aborted. Leases = len(holders) + pending.
	holders map[string]struct{}
	pending int
	// idleDeadline is set when the last lease is released; the entry is then in the idle list.
	idleDeadline time.Time
	idle         bool
	prev, next   *affinityEntry // idle list links
}

func (e *affinityEntry) leases() int { return len(e.holders) + e.pending }

// AffinityTable is one partition's session-affinity table in hard mode (selection-service.md
// §12.1): session id → Initializing (one request is choosing) or Bound{target, leases, idle
// deadline, version}. A request that books takes a lease; the idle TTL starts when the last lease
// is released; idle bindings past their deadline expire lazily and via Reap.
//
// It is a pure structure: time is passed in and whether a target is still schedulable is asked
// through a callback. Safe for concurrent use; the picker additionally runs Acquire → select →
// book → Commit inside the partition's serialized context, so an Initializing entry is never seen
// by another request of the same partition there.
type AffinityTable struct {
	mu       sync.Mutex
	cfg      AffinityConfig
	entries  map[string]*affinityEntry
	idleHead *affinityEntry // oldest idle deadline first
	idleTail *affinityEntry
	lastSeq  uint64
}

// NewAffinityTable returns an empty table. cfg.TTL must be positive (the caller validates the
// 1 s … 31,536,000 s range at startup).
func NewAffinityTable(cfg AffinityConfig) *AffinityTable {
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = DefaultAffinityMaxEntries
	}
	return &AffinityTable{cfg: cfg, entries: make(map[string]*affinityEntry)}
}

// ReapInterval is how often Reap should run: min(TTL, 30 s).
func (t *AffinityTable) ReapInterval() time.Duration {
	return min(t.cfg.TTL, MaxAffinityReapInterval)
}

// CheckSessionID returns ErrSessionIDTooLong (wrapped, naming the length) for an id over
// MaxSessionIDBytes.
func CheckSessionID(id string) error {
	if len(id) > MaxSessionIDBytes {
		return fmt.Errorf("session id of %d bytes: %w", len(id), ErrSessionIDTooLong)
	}
	return nil
}

// Lookup returns the live binding of id for a query-only select, which steers to it but never
// creates or leases one (§12.1). A binding whose target valid rejects is not returned (a booking
// would re-initialize it). Errors: ErrSessionIDTooLong.
func (t *AffinityTable) Lookup(id string, now time.Time, valid func(AffinityTarget) bool) (AffinityTarget, bool, error) {
	if err := CheckSessionID(id); err != nil {
		return AffinityTarget{}, false, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.liveEntry(id, now)
	if e == nil || e.initializing || (valid != nil && !valid(e.target)) {
		return AffinityTarget{}, false, nil
	}
	return e.target, true, nil
}

// Acquire takes the session hold of a booking request before it selects (§12.1):
//   - vacant or expired → the entry becomes Initializing and the hold is HoldInitializing (when
//     the table is full the hold is HoldUnpinned: route unpinned, not an error);
//   - Initializing (another request is choosing) → this hold joins it (HoldInitializing);
//   - Bound and valid(target) → one lease is taken and the hold is HoldBound with the target;
//   - Bound but the target is no longer schedulable → the binding is invalidated and
//     re-initialized by this hold.
//
// Every hold other than HoldUnpinned must end with Commit or Abort. Errors: ErrSessionIDTooLong.
func (t *AffinityTable) Acquire(id string, now time.Time, valid func(AffinityTarget) bool) (AffinityHold, error) {
	if err := CheckSessionID(id); err != nil {
		return AffinityHold{}, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	h := AffinityHold{SessionID: id}
	e := t.liveEntry(id, now)
	switch {
	case e == nil:
		if len(t.entries) >= t.cfg.MaxEntries {
			t.reapLocked(now)
		}
		if len(t.entries) >= t.cfg.MaxEntries {
			h.Kind = HoldUnpinned
			return h, nil
		}
		e = &affinityEntry{id: id, initializing: true}
		t.entries[id] = e
		h.Kind, h.entry = HoldInitializing, e
	case e.initializing:
		h.Kind, h.entry, h.joined = HoldInitializing, e, true
	case valid != nil && !valid(e.target):
		t.unidle(e)
		e.initializing = true
		e.holders = nil
		e.pending = 0
		h.Kind, h.entry = HoldInitializing, e
	default:
		t.unidle(e)
		e.pending++
		h.Kind, h.entry, h.Target = HoldBound, e, e.target
	}
	return h, nil
}

// Commit ends a hold after the booking reservationID landed on dispatched (a target with a rank),
// giving the reservation its lease (§12.1). steered reports that the request was steered by the
// hold's binding (no affinity_target or pinned_worker overrode it), which lets a worker-only
// binding accept a dispatch to any of its ranks.
//
//   - An Initializing hold binds the session to dispatched with one lease and a new version.
//   - A Bound hold (or a joined hold that finds a binding) matches when the worker is the same and
//     either the binding's rank is the same or the binding is worker-only and steered; the lease
//     is kept. If the bound worker departed (valid rejects it) the session is re-bound to
//     dispatched instead.
//   - Otherwise it is a hard-mode conflict: ErrAffinityConflict (wrapped, naming both targets)
//     and the stale binding is dropped so the next request re-initializes — except for a joined
//     hold, whose mismatch leaves the binding committed by the initializer in place. The caller
//     frees the booking.
//
// It returns the binding to publish to replicas (ok false when nothing changed, e.g. unpinned).
func (t *AffinityTable) Commit(h AffinityHold, reservationID string, dispatched AffinityTarget, steered bool,
	now time.Time, valid func(AffinityTarget) bool) (AffinityUpdate, bool, error) {
	if h.Kind == HoldUnpinned || h.entry == nil {
		return AffinityUpdate{}, false, nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[h.SessionID]
	if h.Kind == HoldBound && e == h.entry && !e.initializing {
		e.pending--
	}
	if e != nil && !e.initializing && t.expiredLocked(e, now) {
		t.removeLocked(e)
		e = nil
	}
	switch {
	case e == nil:
		// The entry went away meanwhile (dropped by a conflict, reaped): bind afresh if there is room.
		if len(t.entries) >= t.cfg.MaxEntries {
			return AffinityUpdate{}, false, nil
		}
		e = &affinityEntry{id: h.SessionID}
		t.entries[h.SessionID] = e
		t.bindLocked(e, dispatched, reservationID, now)
	case e.initializing:
		t.bindLocked(e, dispatched, reservationID, now)
	case matches(e.target, dispatched, steered && h.Kind == HoldBound):
		t.unidle(e)
		t.addHolder(e, reservationID)
		return AffinityUpdate{SessionID: e.id, Target: e.target, Version: e.version}, true, nil
	case valid != nil && !valid(e.target):
		// The bound worker departed after the hold: re-bind to where the request went.
		t.unidle(e)
		t.bindLocked(e, dispatched, reservationID, now)
	default:
		bound := e.target
		if !h.joined {
			t.removeLocked(e)
		} else if e.leases() == 0 {
			t.setIdle(e, now)
		}
		return AffinityUpdate{}, false, fmt.Errorf("%w: session %q is bound to %v but the request was dispatched to %v",
			ErrAffinityConflict, h.SessionID, bound, dispatched)
	}
	return AffinityUpdate{SessionID: e.id, Target: e.target, Version: e.version}, true, nil
}

// matches reports whether a dispatch is consistent with a binding in hard mode.
func matches(bound, dispatched AffinityTarget, steeredByBinding bool) bool {
	if bound.WorkerID != dispatched.WorkerID {
		return false
	}
	if bound.HasRank {
		return dispatched.HasRank && dispatched.DPRank == bound.DPRank
	}
	return steeredByBinding || !dispatched.HasRank
}

// Abort ends a hold whose booking never landed: an Initializing entry created by the hold is
// removed (the next request initializes again); a Bound hold gives back its lease.
func (t *AffinityTable) Abort(h AffinityHold, now time.Time) {
	if h.Kind == HoldUnpinned || h.entry == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[h.SessionID]
	if e != h.entry {
		return
	}
	switch {
	case e.initializing && !h.joined:
		t.removeLocked(e)
	case h.Kind == HoldBound && !e.initializing:
		e.pending--
		if e.leases() == 0 {
			t.setIdle(e, now)
		}
	}
}

// Release gives back reservationID's lease on session id (free, expiry or reservation sweep).
// When the last lease goes the idle TTL starts: idle_deadline = now + TTL. It returns the binding
// to publish and whether a lease was released.
func (t *AffinityTable) Release(id, reservationID string, now time.Time) (AffinityUpdate, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[id]
	if e == nil || e.initializing {
		return AffinityUpdate{}, false
	}
	if _, ok := e.holders[reservationID]; !ok {
		return AffinityUpdate{}, false
	}
	delete(e.holders, reservationID)
	if e.leases() == 0 {
		t.setIdle(e, now)
	}
	return AffinityUpdate{SessionID: e.id, Target: e.target, Version: e.version}, true
}

// SweepLeases releases every lease whose reservation live reports gone (the reservation-index
// sweep of §10.5) and returns how many it released.
func (t *AffinityTable) SweepLeases(live func(sessionID, reservationID string) bool, now time.Time) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, e := range t.entries {
		if e.initializing {
			continue
		}
		had := len(e.holders)
		for r := range e.holders {
			if !live(e.id, r) {
				delete(e.holders, r)
				n++
			}
		}
		if had > 0 && e.leases() == 0 {
			t.setIdle(e, now)
		}
	}
	return n
}

// Reap drops every idle binding whose deadline passed at now and returns how many it dropped.
// Run it every ReapInterval.
func (t *AffinityTable) Reap(now time.Time) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.reapLocked(now)
}

// ApplyRemote applies a binding received from another replica (§12.1 apply rules) at now:
// vacant → insert (0 leases, deadline now+TTL); expired → replace; same target and version ≥
// local → refresh the deadline; different target and version > local → replace; local entry
// Initializing → ignore; otherwise ignore. Updates written by this table's own WriterID are
// dropped; the caller drops unknown partitions and workers. It reports whether the table changed.
func (t *AffinityTable) ApplyRemote(u AffinityUpdate, now time.Time) bool {
	if u.Version.WriterID == t.cfg.WriterID || CheckSessionID(u.SessionID) != nil {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lastSeq = max(t.lastSeq, u.Version.Sequence)
	e := t.liveEntry(u.SessionID, now)
	switch {
	case e == nil:
		if len(t.entries) >= t.cfg.MaxEntries {
			t.reapLocked(now)
			if len(t.entries) >= t.cfg.MaxEntries {
				return false
			}
		}
		e = &affinityEntry{id: u.SessionID, target: u.Target, version: u.Version}
		t.entries[u.SessionID] = e
		t.setIdle(e, now)
		return true
	case e.initializing:
		return false
	case e.target == u.Target && !u.Version.Less(e.version):
		e.version = u.Version
		if e.leases() == 0 {
			t.setIdle(e, now)
		}
		return true
	case e.target != u.Target && e.version.Less(u.Version):
		e.target, e.version = u.Target, u.Version
		if e.leases() == 0 {
			t.setIdle(e, now)
		}
		return true
	}
	return false
}

// Len returns the number of entries (Initializing and Bound, expired ones not yet reaped included).
func (t *AffinityTable) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.entries)
}

// Binding returns id's live binding and its lease count (for inspection and tests).
func (t *AffinityTable) Binding(id string, now time.Time) (target AffinityTarget, leases int, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.liveEntry(id, now)
	if e == nil || e.initializing {
		return AffinityTarget{}, 0, false
	}
	return e.target, e.leases(), true
}

// bindLocked makes e Bound to target with reservationID's lease and a new local version.
func (t *AffinityTable) bindLocked(e *affinityEntry, target AffinityTarget, reservationID string, now time.Time) {
	t.unidle(e)
	e.initializing = false
	e.target = target
	e.holders = nil
	e.pending = 0
	t.addHolder(e, reservationID)
	seq := uint64(max(now.UnixNano(), 0))
	if seq <= t.lastSeq {
		// Saturates: a peer's sequence of 2^64-1 must not make ours wrap to 0, a version older
		// than every other replica's.
		seq = t.lastSeq + min(1, math.MaxUint64-t.lastSeq)
	}
	t.lastSeq = seq
	e.version = AffinityVersion{Sequence: seq, WriterID: t.cfg.WriterID}
}

func (t *AffinityTable) addHolder(e *affinityEntry, reservationID string) {
	if e.holders == nil {
		e.holders = make(map[string]struct{}, 1)
	}
	e.holders[reservationID] = struct{}{}
}

// liveEntry returns id's entry, dropping it first when it expired at now.
func (t *AffinityTable) liveEntry(id string, now time.Time) *affinityEntry {
	e := t.entries[id]
	if e != nil && t.expiredLocked(e, now) {
		t.removeLocked(e)
		return nil
	}
	return e
}

func (t *AffinityTable) expiredLocked(e *affinityEntry, now time.Time) bool {
	return e.idle && now.After(e.idleDeadline)
}

func (t *AffinityTable) reapLocked(now time.Time) int {
	n := 0
	for t.idleHead != nil && now.After(t.idleHead.idleDeadline) {
		t.removeLocked(t.idleHead)
		n++
	}
	return n
}

func (t *AffinityTable) removeLocked(e *affinityEntry) {
	t.unidle(e)
	if t.entries[e.id] == e {
		delete(t.entries, e.id)
	}
}

// setIdle (re)starts e's idle TTL: deadline now+TTL, moved to the back of the idle list.
func (t *AffinityTable) setIdle(e *affinityEntry, now time.Time) {
	t.unidle(e)
	e.idle = true
	e.idleDeadline = now.Add(t.cfg.TTL)
	e.prev = t.idleTail
	if t.idleTail != nil {
		t.idleTail.next = e
	} else {
		t.idleHead = e
	}
	t.idleTail = e
}

// unidle removes e from the idle list (it holds a lease again, or is being removed).
func (t *AffinityTable) unidle(e *affinityEntry) {
	if !e.idle {
		return
	}
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		t.idleHead = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		t.idleTail = e.prev
	}
	e.prev, e.next, e.idle = nil, nil, false
}
