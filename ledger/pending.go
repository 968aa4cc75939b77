package ledger

import (
	"fmt"
	"sync"
	"time"
)

// Defaults of the pending-selection cache (selection-service.md §11, §19.1).
const (
	// DefaultPendingTTL is how long a pending selection stays replayable (--selection-cache-ttl-secs 120).
	DefaultPendingTTL = 120 * time.Second
	// DefaultPendingMaxEntries caps the number of pending selections (--selection-cache-max-entries).
	DefaultPendingMaxEntries = 4096
	// DefaultPendingMaxBytes caps the summed entry sizes in bytes (--selection-cache-max-bytes, 256 MiB).
	DefaultPendingMaxBytes = 256 << 20
)

// PendingKey identifies one pending selection: (model_name, routing_group, selection_id)
// (selection-service.md §11 "Key"). A replay under another model or group is a different key.
type PendingKey struct {
	// ModelName and RoutingGroup name the partition ("default" when a request omits them).
	ModelName string
	// RoutingGroup is the partition group ("default" when a request omits it).
	RoutingGroup string
	// SelectionID is the client-chosen selection id.
	SelectionID string
}

// PendingSelection is what a POST /select with a selection_id captures for a later cached replay
// (selection-service.md §11 "Value"): the booking inputs, used as-is by POST /reservations.
//
// The cache keeps the slices it is given (SequenceHashes, BlockHashes): callers must treat them
// as read-only after Put and on the values returned by Peek.
type PendingSelection struct {
	// Candidate is the chosen (worker, dp_rank).
	Candidate Candidate
	// SequenceHashes are the tracked hashes to book (one per full block).
	SequenceHashes []uint64
	// ISLTokens is the normalised input length in tokens.
	ISLTokens uint64
	// EffectivePrefillTokens is the prefill (tokens) booked when TrackPrefillTokens is true.
	EffectivePrefillTokens uint64
	// ExpectedOutputTokens is optional booking metadata (tokens).
	ExpectedOutputTokens *uint32
	// TrackPrefillTokens is the select's prefill-tracking decision.
	TrackPrefillTokens bool
	// LoraName is the request's LoRA adapter name ("" when none).
	LoraName string
	// BlockHashes are the local block hashes to record into an approximate index when the replay
	// books; nil when the prompt had none (a hash-only prompt without block_hashes).
	BlockHashes []uint64
	// SessionID is the session the select carried ("" when none); a replay binds it (§12.1).
	SessionID string
	// SessionSteered reports that a live session binding steered the select to Candidate.
	SessionSteered bool
}

// PendingEntrySize is the §11 accounting size of one entry in bytes:
// 8 × len(sequence_hashes) + len(selection_id) + len(model_name) + len(routing_group) + len(lora_name).
func PendingEntrySize(key PendingKey, sel *PendingSelection) int64 {
	return 8*int64(len(sel.SequenceHashes)) + int64(len(key.SelectionID)) + int64(len(key.ModelName)) +
		int64(len(key.RoutingGroup)) + int64(len(sel.LoraName))
}

// PendingConfig bounds a PendingCache. Zero fields take the defaults; negative values are invalid.
type PendingConfig struct {
	// TTL is the lifetime of an entry from its (latest) insertion.
	TTL time.Duration
	// MaxEntries caps the number of live entries.
	MaxEntries int
	// MaxBytes caps Σ PendingEntrySize over live entries, in bytes.
	MaxBytes int64
}

// Validate reports the first invalid field of c (negative values), naming it.
func (c PendingConfig) Validate() error {
	switch {
	case c.TTL < 0:
		return fmt.Errorf("selection_cache_ttl must be > 0, got %v", c.TTL)
	case c.MaxEntries < 0:
		return fmt.Errorf("selection_cache_max_entries must be >= 1, got %d", c.MaxEntries)
	case c.MaxBytes < 0:
		return fmt.Errorf("selection_cache_max_bytes must be >= 1, got %d", c.MaxBytes)
	}
	return nil
}

func (c PendingConfig) withDefaults() PendingConfig {
	if c.TTL <= 0 {
		c.TTL = DefaultPendingTTL
	}
	if c.MaxEntries <= 0 {
		c.MaxEntries = DefaultPendingMaxEntries
	}
	if c.MaxBytes <= 0 {
		c.MaxBytes = DefaultPendingMaxBytes
	}
	return c
}

// pendingEntry is one cached selection, linked into the insertion-order list.
type pendingEntry struct {
	key        PendingKey
	sel        PendingSelection
	gen        uint64
	inserted   time.Time
	size       int64
	prev, next *pendingEntry
}

// PendingCache is the pending-selection cache of selection-service.md §11: a bounded map from
// PendingKey to the latest PendingSelection, with a TTL, an entry cap and a byte budget, evicting
// oldest-first. Replays consume entries with Peek → (book) → Remove(key, generation), so a newer
// select for the same key that lands in between is never removed by the older replay.
//
// It is a pure structure: time is passed in, nothing runs in the background; expired entries are
// dropped lazily (Peek) and on every Put. The insertion-order index is an intrusive list holding
// exactly the live entries, so it never outgrows them. Safe for concurrent use.
type PendingCache struct {
	mu         sync.Mutex
	cfg        PendingConfig
	entries    map[PendingKey]*pendingEntry
	head, tail *pendingEntry // oldest … newest
	bytes      int64
	nextGen    uint64
}

// NewPendingCache returns an empty cache bounded by cfg (zero fields = the §11 defaults: 120 s,
// 4096 entries, 256 MiB).
func NewPendingCache(cfg PendingConfig) *PendingCache {
	return &PendingCache{cfg: cfg.withDefaults(), entries: make(map[PendingKey]*pendingEntry)}
}

// Config returns the effective bounds (defaults applied).
func (c *PendingCache) Config() PendingConfig { return c.cfg }

// Put stores sel under key at time now, replacing any entry of the same key (latest wins; the
// replacement gets a new generation and a fresh TTL). It first sweeps expired entries from the
// oldest, then evicts oldest-first while over the entry cap or the byte budget. An entry larger
// than the whole budget evicts itself: it is not stored and evicts nothing else (the entry it
// replaced is gone either way). It returns the entry's generation and whether it is stored.
func (c *PendingCache) Put(key PendingKey, sel PendingSelection, now time.Time) (generation uint64, stored bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if old := c.entries[key]; old != nil {
		c.unlink(old)
	}
	c.sweepLocked(now)
	c.nextGen++
	e := &pendingEntry{key: key, sel: sel, gen: c.nextGen, inserted: now, size: PendingEntrySize(key, &sel)}
	if e.size > c.cfg.MaxBytes {
		// Oldest-first eviction would drain every other entry and then this one: skip straight
		// to the end state for this entry and leave the others alone.
		return e.gen, false
	}
	c.entries[key] = e
	c.bytes += e.size
	e.prev = c.tail
	if c.tail != nil {
		c.tail.next = e
	} else {
		c.head = e
	}
	c.tail = e
	for len(c.entries) > c.cfg.MaxEntries || c.bytes > c.cfg.MaxBytes {
		c.unlink(c.head)
	}
	_, stored = c.entries[key]
	return e.gen, stored
}

// Peek returns the live entry of key and its generation without consuming it. An entry whose
// TTL has passed at now is treated as missing (and dropped).
func (c *PendingCache) Peek(key PendingKey, now time.Time) (PendingSelection, uint64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[key]
	if e == nil {
		return PendingSelection{}, 0, false
	}
	if c.expired(e, now) {
		c.unlink(e)
		return PendingSelection{}, 0, false
	}
	return e.sel, e.gen, true
}

// Remove consumes key's entry only if its generation is still generation (a newer select that
// replaced it in the meantime is kept). It reports whether an entry was removed.
func (c *PendingCache) Remove(key PendingKey, generation uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[key]
	if e == nil || e.gen != generation {
		return false
	}
	c.unlink(e)
	return true
}

// Discard drops key's entry whatever its generation (an explicit reservation discards the cached
// selection of its selection_id, §10.1). It reports whether an entry was dropped.
func (c *PendingCache) Discard(key PendingKey) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[key]
	if e == nil {
		return false
	}
	c.unlink(e)
	return true
}

// Sweep drops every entry expired at now and returns how many it dropped.
func (c *PendingCache) Sweep(now time.Time) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sweepLocked(now)
}

// Len returns the number of stored entries (expired ones not yet swept included).
func (c *PendingCache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.entries)
}

// Bytes returns Σ PendingEntrySize over the stored entries.
func (c *PendingCache) Bytes() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.bytes
}

func (c *PendingCache) expired(e *pendingEntry, now time.Time) bool {
	return !now.Before(e.inserted.Add(c.cfg.TTL))
}

// sweepLocked drops expired entries from the oldest; it stops at the first live one (entries are
// in insertion order, so with a non-decreasing clock every later entry is live too).
func (c *PendingCache) sweepLocked(now time.Time) int {
	n := 0
	for c.head != nil && c.expired(c.head, now) {
		c.unlink(c.head)
		n++
	}
	return n
}

// unlink removes e from the map, the order list and the byte count.
func (c *PendingCache) unlink(e *pendingEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		c.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		c.tail = e.prev
	}
	e.prev, e.next = nil, nil
	delete(c.entries, e.key)
	c.bytes -= e.size
}
