package ledger

import "fmt"

// Mirror installs b as a booking mirrored from another replica's admission
// (selection-service.md §15.4: mirrored admissions are inserted into the reservation index,
// replacing a stale or claimed row of the same partition). b.Origin must be the sending
// replica's non-zero router_id. If b.ID is
//   - unused, b is booked;
//   - claimed by a local request still selecting, the claim becomes the mirror (that request's
//     own Book then fails with ErrConflict, as a duplicate id does on one replica);
//   - live as an earlier mirror (Origin ≠ 0) in the same b.Partition, that mirror is released
//     and returned as replaced (ok true) and b takes its place;
//   - live as a booking of this process, or as a mirror in another partition: ErrConflict and
//     nothing changes.
//
// Errors: ErrInvalid for an empty id or a zero Origin; ErrConflict as above.
func (l *Ledger) Mirror(b Booking) (replaced Booking, ok bool, err error) {
	if b.ID == "" {
		return Booking{}, false, fmt.Errorf("mirror: selection_id must not be empty: %w", ErrInvalid)
	}
	if b.Origin == 0 {
		return Booking{}, false, fmt.Errorf("mirror %s: origin router_id must not be 0: %w", b.ID, ErrInvalid)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	cur, found := l.ids[b.ID]
	claimed := found && cur == claimedSlot
	if found && !claimed {
		old := l.slots[cur].b
		if old.Origin == 0 || old.Partition != b.Partition {
			return Booking{}, false, conflict(b.ID)
		}
		replaced, ok = l.release(cur), true
	}
	l.bookLocked(b, claimed)
	return replaced, ok, nil
}

// SlotEventKind is what a replicated booking event does (selection-service.md §15.2 `data`).
type SlotEventKind uint8

const (
	// SlotAdmission is an admission ("AddRequest"): a booking was made.
	SlotAdmission SlotEventKind = iota + 1
	// SlotPrefillComplete is "MarkPrefillCompleted": the booking's prefill tokens were released.
	SlotPrefillComplete
	// SlotFree is "Free": the booking was released.
	SlotFree
)

// String returns the wire name of the event kind (AddRequest, MarkPrefillCompleted, Free).
func (k SlotEventKind) String() string {
	switch k {
	case SlotAdmission:
		return "AddRequest"
	case SlotPrefillComplete:
		return "MarkPrefillCompleted"
	case SlotFree:
		return "Free"
	}
	return fmt.Sprintf("SlotEventKind(%d)", uint8(k))
}

// SlotEvent is one booking lifecycle event as replicated between selector replicas
// (selection-service.md §15.2 `event`, without the partition envelope, which the caller owns).
// Output blocks and expiry are never replicated (§15.4).
type SlotEvent struct {
	// Kind is what happened.
	Kind SlotEventKind
	// ID is the booking's selection_id (request_id on the wire).
	ID string
	// Candidate is the booked (worker, dp_rank).
	Candidate Candidate
	// Origin is the sending replica's router_id (random, non-zero, chosen at startup).
	Origin uint64
	// LoraName is the request's LoRA adapter, nil when none.
	LoraName *string

	// SequenceHashes are the admission's tracked sequence hashes (token_sequence); admission only.
	SequenceHashes []uint64
	// TrackPrefillTokens reports whether the admission books prefill tokens; admission only.
	TrackPrefillTokens bool
	// PrefillTokens is prefill_load_hint.initial_effective_prefill_tokens (tokens), nil without a
	// hint; admission only.
	PrefillTokens *uint64
	// ExpectedOutputTokens is optional booking metadata (tokens); admission only.
	ExpectedOutputTokens *uint32
}

// ReleaseMirrorsOf releases every live booking mirrored from the replica whose router_id is
// origin (a replica that left: its requests ended with it or were drained, and the Free events it
// published while leaving may never arrive) and returns them. Local bookings (Origin 0) and
// claims are untouched; origin 0 releases nothing. O(live bookings).
func (l *Ledger) ReleaseMirrorsOf(origin uint64) []Booking {
	if origin == 0 {
		return nil
	}
	return l.releaseWhere(func(b *Booking) bool { return b.Origin == origin })
}
