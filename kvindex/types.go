package kvindex

import (
	"errors"
	"fmt"
)

// Candidate is one (worker, dp_rank) pair, upstream's WorkerWithDpRank (kv-events-index.md terms
// table). Every index entry, match and lookup table belongs to one candidate.
type Candidate struct {
	WorkerID uint64
	DPRank   uint32
}

// String renders the candidate as "worker 7 dp_rank 3" for errors and logs.
func (c Candidate) String() string {
	return fmt.Sprintf("worker %d dp_rank %d", c.WorkerID, c.DPRank)
}

// Tier is a KV storage tier (kv-events-index.md §8.1, §12). The device tier is the radix tree of
// §11; the other three are lower-tier stores of §12.1.
type Tier uint8

// The four storage tiers, in lookup order (§12.2: device, then host, disk, external).
const (
	TierDevice Tier = iota
	TierHostPinned
	TierDisk
	TierExternal
)

// numTiers is the number of valid Tier values.
const numTiers = 4

var tierNames = [numTiers]string{"device", "host_pinned", "disk", "external"}

// String returns the /dump JSON name of the tier (§10): "device", "host_pinned", "disk" or
// "external"; an out-of-range value renders as "tier(N)".
func (t Tier) String() string {
	if int(t) < numTiers {
		return tierNames[t]
	}
	return fmt.Sprintf("tier(%d)", uint8(t))
}

// ParseTier parses a /dump storage_tier name (§10). The empty string is the default, device. An
// unknown name returns an error naming it.
func ParseTier(s string) (Tier, error) {
	if s == "" {
		return TierDevice, nil
	}
	for i, n := range tierNames {
		if s == n {
			return Tier(i), nil
		}
	}
	return 0, fmt.Errorf("unknown storage_tier %q (want device, host_pinned, disk or external)", s)
}

// MarshalText encodes the tier as its §10 name; an out-of-range tier is an error.
func (t Tier) MarshalText() ([]byte, error) {
	if int(t) >= numTiers {
		return nil, fmt.Errorf("invalid storage tier %d", uint8(t))
	}
	return []byte(tierNames[t]), nil
}

// UnmarshalText decodes a §10 tier name (see ParseTier).
func (t *Tier) UnmarshalText(b []byte) error {
	v, err := ParseTier(string(b))
	if err != nil {
		return err
	}
	*t = v
	return nil
}

// StoredBlock is one block of a Stored event (§10): BlockHash is the engine's external id for the
// block (opaque, per worker); TokensHash is the local block hash (§1) the tree is keyed by.
type StoredBlock struct {
	BlockHash  uint64
	TokensHash uint64
}

// EventKind selects the variant of an Event (§10 `data`).
type EventKind uint8

// The three event variants of §10.
const (
	EventStored EventKind = iota + 1
	EventRemoved
	EventCleared
)

// String returns "stored", "removed" or "cleared" (the §10 JSON tags).
func (k EventKind) String() string {
	switch k {
	case EventStored:
		return "stored"
	case EventRemoved:
		return "removed"
	case EventCleared:
		return "cleared"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Event is one index update for one candidate and tier (kv-events-index.md §10, the internal
// RouterEvent). Stored uses HasParent/ParentHash (parent external hash; absent = the root) and
// Blocks (in chain order, each the child of the previous); Removed uses BlockHashes (external
// hashes); Cleared uses neither and applies to every tier. EventID is the ZMQ sequence number or a
// dump counter; the index does not interpret it.
type Event struct {
	WorkerID uint64
	DPRank   uint32
	Tier     Tier
	EventID  uint64

	Kind EventKind

	HasParent  bool
	ParentHash uint64
	Blocks     []StoredBlock

	BlockHashes []uint64
}

// Candidate returns the (worker, dp_rank) the event belongs to.
func (ev Event) Candidate() Candidate {
	return Candidate{WorkerID: ev.WorkerID, DPRank: ev.DPRank}
}

// Errors returned (wrapped, with the offending values) by Index.Apply; test with errors.Is.
var (
	// ErrParentBlockNotFound: a Stored event's parent hash is not known for the candidate
	// (§11.2 step 1, §12.1); the whole store was skipped.
	ErrParentBlockNotFound = errors.New("parent block not found")
	// ErrInvalidBlockSequence: a Stored event has a block hash equal to its parent's, or the same
	// block hash twice (§11.2 step 3, §9); the whole store was skipped.
	ErrInvalidBlockSequence = errors.New("invalid block sequence")
	// ErrBlockNotFound: a Removed event named block hashes not known for the candidate (§11.3).
	// Non-fatal: the other hashes of the event were removed.
	ErrBlockNotFound = errors.New("block not found")
	// ErrInvalidEvent: the event's kind or tier is out of range; nothing was applied.
	ErrInvalidEvent = errors.New("invalid event")
)
