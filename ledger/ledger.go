// Package ledger is kvepp's active-load accounting core: reservations (bookings) keyed by
// selection_id and, per candidate (worker, dp_rank), the active prefill tokens, active requests and
// active blocks that the cost function reads (selection-service.md §10.3–§10.6).
//
// The ledger is a pure data structure: it owns no goroutines, sockets or clocks (admission times
// and expiry cut-offs are passed in), and it is safe for concurrent use. Every mutation is O(the
// blocks it touches); Load is O(1): per candidate the ledger keeps a refcounted table of distinct
// live sequence hashes and an exactly maintained fixed-point weighted sum.
package ledger

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"sync"
	"time"

	"github.com/kvepp/kvepp/internal/excerpt"
)

// Candidate is one (worker, dp_rank) pair. It has the same shape as kvindex.Candidate and converts
// to it directly.
type Candidate struct {
	WorkerID uint64 // worker_id
	DPRank   uint32 // global data-parallel rank
}

// String renders the candidate as "worker W dp_rank R" for error messages.
func (c Candidate) String() string { return fmt.Sprintf("worker %d dp_rank %d", c.WorkerID, c.DPRank) }

// Booking is one live reservation (selection-service.md §10.3 "booking inputs").
//
// The first eight fields are the caller's inputs to Book. The ledger takes ownership of
// SequenceHashes: the caller must not modify the slice after Book, and slices returned by
// Lookup, Free, FreeWorker and ExpireAdmittedBefore must be treated as read-only.
// The remaining fields are filled in by the ledger on Lookup and on release and are ignored by Book.
type Booking struct {
	// ID is the selection_id; never empty.
	ID string
	// Candidate is the booked (worker, dp_rank).
	Candidate Candidate
	// SequenceHashes are the request's tracking hashes for its full blocks (§6.4). The booking holds
	// them as active blocks unless Config.TrackActiveBlocks is false. Sequence hashes are chained,
	// so they never repeat within a request; a hash-form caller that repeats one gets it counted once
	// but weighted as shared (1.0) while both holdings are live.
	SequenceHashes []uint64
	// PrefillTokens is the booked prefill load in tokens (0 when prefill is not tracked).
	PrefillTokens uint64
	// ExpectedOutputTokens is optional booking metadata (tokens).
	ExpectedOutputTokens *uint32
	// Admitted is the admission time; the expiry guard (§10.5) measures age from it.
	Admitted time.Time
	// Partition is an opaque owner key (e.g. "model:group") returned unchanged to the caller.
	Partition string
	// Tag is opaque caller data kept with the booking and returned unchanged on Lookup and on
	// every release (Free, FreeAttempt, FreeWorker, ExpireAdmittedBefore); the picker keeps the
	// booking's session-affinity lease there so every release path can give it back.
	Tag any
	// Origin is the router_id of the replica whose admission this booking mirrors
	// (selection-service.md §15.4); 0 for a booking this process made. Book keeps it as given;
	// Mirror requires it non-zero.
	Origin uint64
	// Unobserved marks a booking whose caller cannot see the engine's first token (a response
	// that is not streamed): its prefill completion is released on an estimate and never trains
	// the candidate's prefill rate (PrefillCompleteAt).
	Unobserved bool

	// Attempt is a process-unique, increasing number the ledger assigns to each successful Book.
	// FreeAttempt uses it to act only on the exact booking a caller resolved (§10.6).
	Attempt uint64
	// PrefillCompleted reports whether PrefillComplete has removed the booking's prefill tokens.
	PrefillCompleted bool
	// OutputBlocks counts the OutputBlock calls applied to the booking.
	OutputBlocks uint32
	// DecayFraction is the booking's last decay_fraction (§10.3), 1.0 if never set.
	DecayFraction float64
	// AheadPrefillTokens is the candidate's active prefill tokens just before this booking
	// landed: the prefill work queued ahead of it (tokens).
	AheadPrefillTokens uint64
}

// Load is the current load of one candidate (selection-service.md §10.3).
type Load struct {
	// ActivePrefillTokens is Σ booked prefill tokens of live bookings not yet prefill-complete,
	// saturating at math.MaxUint64 (the ledger keeps the exact sum, so frees bring it back down).
	ActivePrefillTokens uint64
	// ActiveBlocks is round(Σ weight) over the distinct live block hashes on the candidate.
	ActiveBlocks uint64
	// ActiveRequests is the number of live bookings on the candidate.
	ActiveRequests uint64
	// PrefillRequests is the number of live bookings with prefill tokens whose prefill is not
	// complete yet (queued or prefilling on the engine).
	PrefillRequests uint64
	// PrefillTokensPerSecond is the candidate's measured prefill rate (PrefillCompleteAt), 0
	// until enough completions were observed.
	PrefillTokensPerSecond float64
	// PrefillRateSamples is the number of observed completions behind PrefillTokensPerSecond.
	PrefillRateSamples int
}

// Config configures a Ledger.
type Config struct {
	// TrackActiveBlocks is router_track_active_blocks (DYN_ROUTER_TRACK_ACTIVE_BLOCKS, default true
	// in the service). When false, bookings hold no blocks and every ActiveBlocks is 0. Note that the
	// zero Config disables block tracking.
	TrackActiveBlocks bool
	// MaxPrefillTokensPerSecond, when > 0, is the fastest prefill (tokens/s) an observed completion
	// may imply and still train the prefill rates (Load.PrefillTokensPerSecond,
	// PartitionPrefillRate): a faster one — a 24k-token prompt "prefilled" in a millisecond — is
	// not a prefill but an answer that skipped it (an in-stream error, a cached or short-circuit
	// reply, a proxy sending headers and an empty chunk early) and is ignored. 0 accepts every
	// sample. The picker sets picker.PrefillRateCeilingFactor × its assumed prefill rate.
	MaxPrefillTokensPerSecond float64
}

// Errors returned by the ledger; test with errors.Is. Returned errors wrap them and name the
// offending selection_id (e.g. "reservation abc not found"), quoting at most its first 100 bytes
// followed by "…" (an id is client input and error bodies must stay bounded).
var (
	// ErrNotFound: the id is not a live booking (unknown, only claimed, or already released).
	ErrNotFound = errors.New("reservation not found")
	// ErrConflict: the id is already claimed or live.
	ErrConflict = errors.New("selection is already reserved or being reserved")
	// ErrInvalid: malformed input (empty selection_id, decay_fraction outside [0, 1] or NaN).
	ErrInvalid = errors.New("invalid ledger input")
)

// idError carries the spec's message for an id while unwrapping to a sentinel error.
type idError struct {
	msg      string
	sentinel error
}

// Error returns the spec message naming the id.
func (e *idError) Error() string { return e.msg }

// Unwrap returns the sentinel (ErrNotFound or ErrConflict).
func (e *idError) Unwrap() error { return e.sentinel }

func notFound(id string) error {
	return &idError{msg: fmt.Sprintf("reservation %s not found", excerpt.Of(id)), sentinel: ErrNotFound}
}

func conflict(id string) error {
	return &idError{msg: fmt.Sprintf("selection %s is already reserved or being reserved", excerpt.Of(id)), sentinel: ErrConflict}
}

// weightOne is weight 1.0 in the ledger's fixed-point block weights (units of 2^-32 block).
const weightOne = 1 << 32

// claimedSlot marks an id that is claimed but not booked.
const claimedSlot = -1

// slot is the ledger's state of one live booking. Slots are recycled through a free list; a slot's
// index identifies the booking inside the per-candidate block tables (blockRef.xor).
type slot struct {
	b       Booking
	rank    *rankState
	outputs []uint64 // output block hashes held (OutputBlock; only when tracking blocks)
	private uint64   // counted output blocks (GrowOutputBlocks; only when tracking blocks)
	excl    uint64   // held hashes for which this booking is the sole holder
	q       uint64   // (1 − decay_fraction) in units of 2^-32
	prev    int32    // neighbours in rank's booking list, -1 terminates
	next    int32
	live    bool
}

// wideSum is an exact unsigned 128-bit accumulator (hi·2^64 + lo). Every booking adds and later
// subtracts exactly what it added, so the sum never drifts and returns to 0 when the last booking
// goes, however large (up to 2^64−1 tokens each) the individual values were; readers saturate it
// at the largest uint64 (selection-service.md §10.3: loads never wrap).
type wideSum struct{ hi, lo uint64 }

// add adds v exactly.
func (w *wideSum) add(v uint64) {
	var c uint64
	w.lo, c = bits.Add64(w.lo, v, 0)
	w.hi += c
}

// sub subtracts v exactly; callers only subtract what they added before.
func (w *wideSum) sub(v uint64) {
	var b uint64
	w.lo, b = bits.Sub64(w.lo, v, 0)
	w.hi -= b
}

// saturated returns the sum, or math.MaxUint64 when it does not fit in 64 bits.
func (w wideSum) saturated() uint64 {
	if w.hi != 0 {
		return math.MaxUint64
	}
	return w.lo
}

// rankState is the load of one candidate.
type rankState struct {
	c        Candidate
	prefill  wideSum // exact Σ booked prefill tokens of bookings not yet prefill-complete
	requests uint64
	pending  uint64 // live bookings with prefill tokens, not prefill-complete
	rate     prefillRate
	blocks   blockTable
	deficit  uint64 // Σ over bookings of (excl + private) × q: how far the weighted sum is below the distinct count
	private  uint64 // Σ over bookings of private: counted output blocks, each distinct and exclusive
	head     int32  // first booking in this rank's list, -1 when none
}

func (r *rankState) load() Load {
	return Load{
		ActivePrefillTokens:    r.prefill.saturated(),
		ActiveBlocks:           r.activeBlocks(),
		ActiveRequests:         r.requests,
		PrefillRequests:        r.pending,
		PrefillTokensPerSecond: r.rate.tokensPerSecond(),
		PrefillRateSamples:     r.rate.samples,
	}
}

// activeBlocks is round(distinct − Σ (1−decay)·exclusive), half away from zero, in exact
// fixed-point arithmetic (no drift however many updates happened).
func (r *rankState) activeBlocks() uint64 {
	w := (uint64(r.blocks.n)+r.private)*weightOne - r.deficit
	return (w + weightOne/2) >> 32
}

// Ledger tracks reservations and per-candidate load. The zero value is not usable; call New.
// All methods are safe for concurrent use.
type Ledger struct {
	mu          sync.RWMutex
	track       bool
	maxRate     float64          // Config.MaxPrefillTokensPerSecond
	ids         map[string]int32 // selection_id → slot index, or claimedSlot
	slots       []*slot
	freeSlots   []int32
	ranks       map[Candidate]*rankState
	workers     map[uint64][]*rankState
	partRates   map[string]*prefillRate // pooled prefill rate per Booking.Partition
	arrivals    map[string]*arrivalRate // booking arrival rate per Booking.Partition
	nextAttempt uint64
	claims      int
	live        int
}

// New returns an empty ledger.
func New(cfg Config) *Ledger {
	return &Ledger{
		track:     cfg.TrackActiveBlocks,
		maxRate:   cfg.MaxPrefillTokensPerSecond,
		ids:       make(map[string]int32),
		ranks:     make(map[Candidate]*rankState),
		workers:   make(map[uint64][]*rankState),
		partRates: make(map[string]*prefillRate),
		arrivals:  make(map[string]*arrivalRate),
	}
}

// Claim reserves id before selection (selection-service.md §7.3 step 2, §10.6). A claimed id is
// invisible to lifecycle calls (ErrNotFound) but blocks another Claim and any Book by a caller
// that did not claim it. Errors: ErrInvalid for an empty id, ErrConflict if id is claimed or live.
func (l *Ledger) Claim(id string) error {
	if id == "" {
		return fmt.Errorf("claim: selection_id must not be empty: %w", ErrInvalid)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.ids[id]; ok {
		return conflict(id)
	}
	l.ids[id] = claimedSlot
	l.claims++
	return nil
}

// Unclaim drops a claim that never became a booking (cancellation, failed selection). It does
// nothing if id is not claimed; in particular it never touches a live booking.
func (l *Ledger) Unclaim(id string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if s, ok := l.ids[id]; ok && s == claimedSlot {
		delete(l.ids, id)
		l.claims--
	}
}

// Book installs b as a live booking on b.Candidate (selection-service.md §10.3). The id must be
// claimed by the caller (the claim becomes the booking) or unused. The booking adds one active
// request, b.PrefillTokens active prefill tokens and, when tracking blocks, holds each of
// b.SequenceHashes. Errors: ErrInvalid for an empty id, ErrConflict if b.ID is already live.
func (l *Ledger) Book(b Booking) error {
	if b.ID == "" {
		return fmt.Errorf("book: selection_id must not be empty: %w", ErrInvalid)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	cur, ok := l.ids[b.ID]
	if ok && cur != claimedSlot {
		return conflict(b.ID)
	}
	l.bookLocked(b, ok)
	return nil
}

// bookLocked installs b; claimed reports that b.ID is currently claimed (the claim becomes the
// booking). Caller holds l.mu for writing and has checked that b.ID is not live.
func (l *Ledger) bookLocked(b Booking, claimed bool) {
	if claimed {
		l.claims--
	}
	idx := l.allocSlot()
	s := l.slots[idx]
	r := l.rankFor(b.Candidate)

	l.nextAttempt++
	b.Attempt = l.nextAttempt
	b.PrefillCompleted = false
	b.OutputBlocks = 0
	b.DecayFraction = 1
	b.AheadPrefillTokens = r.prefill.saturated()
	s.b = b
	s.rank = r
	s.excl = 0
	s.private = 0
	s.q = 0
	s.live = true
	s.outputs = s.outputs[:0]

	s.prev = -1
	s.next = r.head
	if r.head >= 0 {
		l.slots[r.head].prev = idx
	}
	r.head = idx

	r.requests++
	r.prefill.add(b.PrefillTokens)
	ar := l.arrivals[b.Partition]
	if ar == nil {
		ar = &arrivalRate{}
		l.arrivals[b.Partition] = ar
	}
	ar.observe(b.Admitted)
	if b.PrefillTokens > 0 {
		r.pending++
	}
	if l.track {
		for _, h := range b.SequenceHashes {
			l.hold(r, s, idx, h)
		}
	}
	l.ids[b.ID] = idx
	l.live++
}

// PrefillComplete removes the booking's prefill tokens from its candidate; its blocks remain as
// decode load (§10.2). Idempotent on a live booking. Errors: ErrNotFound for an unknown, merely
// claimed or released id.
func (l *Ledger) PrefillComplete(id string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.liveSlot(id)
	if s == nil {
		return notFound(id)
	}
	l.completePrefill(s)
	return nil
}

// completePrefill removes the booking's prefill tokens from its candidate once. Caller holds
// l.mu for writing.
func (l *Ledger) completePrefill(s *slot) (first bool) {
	if s.b.PrefillCompleted {
		return false
	}
	s.b.PrefillCompleted = true
	s.rank.prefill.sub(s.b.PrefillTokens)
	if s.b.PrefillTokens > 0 {
		s.rank.pending--
	}
	return true
}

// OutputBlock applies one output block to a live booking (§10.3): when tracking blocks it holds
// hash — a fresh random 64-bit hash chosen by the caller — for this booking only, then, if decay
// is non-nil, sets the booking's decay_fraction to *decay (later calls overwrite), which weights
// every block this booking holds exclusively. Errors: ErrInvalid if *decay is NaN or outside
// [0, 1] (checked first, nothing changes), ErrNotFound for an id that is not a live booking.
func (l *Ledger) OutputBlock(id string, decay *float64, hash uint64) error {
	var q uint64
	if decay != nil {
		d := *decay
		if !(d >= 0 && d <= 1) {
			return fmt.Errorf("output_block %s: decay_fraction must be between 0.0 and 1.0, got %v: %w", excerpt.Of(id), d, ErrInvalid)
		}
		q = uint64(math.Round((1 - d) * weightOne))
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	idx, ok := l.ids[id]
	if !ok || idx == claimedSlot {
		return notFound(id)
	}
	s := l.slots[idx]
	r := s.rank
	s.b.OutputBlocks++
	if l.track {
		s.outputs = append(s.outputs, hash)
		l.hold(r, s, idx, hash)
	}
	if decay != nil {
		r.deficit -= (s.excl + s.private) * s.q
		s.q = q
		r.deficit += (s.excl + s.private) * s.q
		s.b.DecayFraction = *decay
	}
	return nil
}

// Free releases a live booking exactly once and returns it (§10.2 DELETE). A second call, or a
// call for a merely claimed id, returns ErrNotFound.
func (l *Ledger) Free(id string) (Booking, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	idx, ok := l.ids[id]
	if !ok || idx == claimedSlot {
		return Booking{}, notFound(id)
	}
	return l.release(idx), nil
}

// FreeAttempt is Free restricted to the booking with the given Attempt: if id is live under a
// different attempt (the id was reused after the booking the caller resolved was released) it
// returns ErrNotFound and leaves the newer booking untouched (§10.6).
func (l *Ledger) FreeAttempt(id string, attempt uint64) (Booking, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	idx, ok := l.ids[id]
	if !ok || idx == claimedSlot || l.slots[idx].b.Attempt != attempt {
		return Booking{}, notFound(id)
	}
	return l.release(idx), nil
}

// Lookup returns a snapshot of the live booking id. A merely claimed id is not found.
func (l *Ledger) Lookup(id string) (Booking, bool) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	s := l.liveSlot(id)
	if s == nil {
		return Booking{}, false
	}
	return s.b, true
}

// Load returns c's current load (zero for a candidate with no live bookings). O(1).
func (l *Ledger) Load(c Candidate) Load {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if r := l.ranks[c]; r != nil {
		return r.load()
	}
	return Load{}
}

// Loads appends to dst the load of every candidate in cs (index-aligned) under one lock
// acquisition, and returns the extended slice. It does not allocate when dst has capacity.
func (l *Ledger) Loads(cs []Candidate, dst []Load) []Load {
	l.mu.RLock()
	defer l.mu.RUnlock()
	for _, c := range cs {
		if r := l.ranks[c]; r != nil {
			dst = append(dst, r.load())
		} else {
			dst = append(dst, Load{})
		}
	}
	return dst
}

// AdditionalBlocks returns how many of hashes (a request's tracking hashes) are not live on c
// (§10.4 additional_blocks): prefix blocks already held by live bookings are not counted again.
// Every occurrence counts, so duplicated hashes each count. With TrackActiveBlocks false nothing
// is live and the result is len(hashes).
func (l *Ledger) AdditionalBlocks(c Candidate, hashes []uint64) int {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.additional(c, hashes)
}

// LoadAndAdditional returns Load(c) and AdditionalBlocks(c, hashes) from one consistent snapshot,
// so decode_cost_blocks = ActiveBlocks + additional (§10.4).
func (l *Ledger) LoadAndAdditional(c Candidate, hashes []uint64) (Load, int) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	var ld Load
	if r := l.ranks[c]; r != nil {
		ld = r.load()
	}
	return ld, l.additional(c, hashes)
}

func (l *Ledger) additional(c Candidate, hashes []uint64) int {
	r := l.ranks[c]
	if r == nil || r.blocks.n == 0 {
		return len(hashes)
	}
	n := 0
	for _, h := range hashes {
		if !r.blocks.contains(h) {
			n++
		}
	}
	return n
}

// FreeWorker releases every live booking on any dp_rank of workerID (worker deleted or drained,
// acceptance 41) and forgets the worker's per-rank state. Claims are untouched. The released
// bookings are returned in no particular order.
func (l *Ledger) FreeWorker(workerID uint64) []Booking {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []Booking
	for _, r := range l.workers[workerID] {
		for r.head >= 0 {
			out = append(out, l.release(r.head))
		}
		delete(l.ranks, r.c)
	}
	delete(l.workers, workerID)
	return out
}

// ExpireAdmittedBefore force-releases every live booking admitted strictly before t (the expiry
// guard of §10.5: the caller passes now − DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS). It removes local
// state only; publishing nothing is the caller's concern. Claims are never expired. O(live
// bookings).
func (l *Ledger) ExpireAdmittedBefore(t time.Time) []Booking {
	return l.releaseWhere(func(b *Booking) bool { return b.Admitted.Before(t) })
}

// releaseWhere releases every live booking for which match is true and returns them. O(live
// bookings); claims are never released.
func (l *Ledger) releaseWhere(match func(*Booking) bool) []Booking {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []Booking
	for i, s := range l.slots {
		if s.live && match(&s.b) {
			out = append(out, l.release(int32(i)))
		}
	}
	return out
}

// Len returns the number of live bookings and of claims that have not become bookings.
func (l *Ledger) Len() (bookings, claims int) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.live, l.claims
}

// liveSlot returns the live slot of id or nil. Caller holds l.mu.
func (l *Ledger) liveSlot(id string) *slot {
	idx, ok := l.ids[id]
	if !ok || idx == claimedSlot {
		return nil
	}
	return l.slots[idx]
}

func (l *Ledger) allocSlot() int32 {
	if n := len(l.freeSlots); n > 0 {
		idx := l.freeSlots[n-1]
		l.freeSlots = l.freeSlots[:n-1]
		return idx
	}
	l.slots = append(l.slots, &slot{})
	return int32(len(l.slots) - 1)
}

func (l *Ledger) rankFor(c Candidate) *rankState {
	r := l.ranks[c]
	if r == nil {
		r = &rankState{c: c, head: -1}
		l.ranks[c] = r
		l.workers[c.WorkerID] = append(l.workers[c.WorkerID], r)
	}
	return r
}

// release removes the live booking in slot idx from every structure and returns its snapshot.
// Caller holds l.mu for writing.
func (l *Ledger) release(idx int32) Booking {
	s := l.slots[idx]
	r := s.rank
	if l.track {
		for _, h := range s.b.SequenceHashes {
			l.unhold(r, s, idx, h)
		}
		for _, h := range s.outputs {
			l.unhold(r, s, idx, h)
		}
		r.private -= s.private
		r.deficit -= s.private * s.q
	}
	// After every unhold s.excl is 0, so its share of the deficit is gone too.
	r.requests--
	l.completePrefill(s)
	if s.prev >= 0 {
		l.slots[s.prev].next = s.next
	} else {
		r.head = s.next
	}
	if s.next >= 0 {
		l.slots[s.next].prev = s.prev
	}
	b := s.b
	delete(l.ids, b.ID)
	l.live--
	*s = slot{outputs: s.outputs[:0]}
	l.freeSlots = append(l.freeSlots, idx)
	return b
}

// hold adds one holding of hash h by the booking in slot idx on rank r, maintaining the exclusive
// counts and the weighted-sum deficit (§10.3).
func (l *Ledger) hold(r *rankState, s *slot, idx int32, h uint64) {
	i, existed := r.blocks.slotFor(h)
	ref := &r.blocks.vals[i]
	if !existed {
		*ref = blockRef{count: 1, xor: uint32(idx)}
		s.excl++
		r.deficit += s.q
		return
	}
	if ref.count == 1 { // the sole holder stops being exclusive
		prev := l.slots[ref.xor]
		prev.excl--
		r.deficit -= prev.q
	}
	ref.count++
	ref.xor ^= uint32(idx)
}

// unhold removes one holding of hash h by the booking in slot idx.
func (l *Ledger) unhold(r *rankState, s *slot, idx int32, h uint64) {
	if r.blocks.n == 0 {
		return
	}
	i, ok := r.blocks.find(h)
	if !ok {
		return // cannot happen: every holding was added by hold
	}
	ref := &r.blocks.vals[i]
	if ref.count == 1 {
		s.excl--
		r.deficit -= s.q
		r.blocks.deleteAt(i)
		return
	}
	ref.count--
	ref.xor ^= uint32(idx)
	if ref.count == 1 { // the remaining holder becomes exclusive
		other := l.slots[ref.xor]
		other.excl++
		r.deficit += other.q
	}
}
