package kvindex

import (
	"container/heap"
	"fmt"
	"time"
)

// Approximate-mode defaults (kv-events-index.md §15.1).
const (
	// DefaultApproxTTL is router_ttl_secs: an entry expires 120 s after its last insertion.
	DefaultApproxTTL = 120 * time.Second
	// DefaultMaxTreeSize is max_tree_size: 2^20 (node, candidate) entries.
	DefaultMaxTreeSize = 1 << 20
	// DefaultPruneTargetRatio is prune_target_ratio: pruning stops at 0.8 × max_tree_size.
	DefaultPruneTargetRatio = 0.8
)

// ApproxPolicy selects how approximate mode bounds each candidate (§15.1).
type ApproxPolicy uint8

const (
	// ApproxTTL (router_approximate_cache_policy = ttl, the default): entries expire TTL after
	// their last insertion; the whole index is pruned when it exceeds MaxTreeSize.
	ApproxTTL ApproxPolicy = iota
	// ApproxLRU: additionally, each candidate holds at most its worker's capacity in blocks
	// (SetWorkerCapacity, the worker's total_kv_blocks); inserting beyond it evicts the
	// candidate's least-recently-inserted blocks. TTL and the size cap remain as fallbacks.
	ApproxLRU
)

// ApproxConfig configures an Approx index. Zero values take the §15.1 defaults.
type ApproxConfig struct {
	// BlockSize is the partition's block size in tokens.
	BlockSize int
	// TTL is the lifetime of an entry after its last insertion; <= 0 means DefaultApproxTTL.
	TTL time.Duration
	// MaxTreeSize is the entry count above which the index is pruned; <= 0 means
	// DefaultMaxTreeSize.
	MaxTreeSize int
	// PruneTargetRatio is the fraction of MaxTreeSize pruning stops at; outside (0, 1] means
	// DefaultPruneTargetRatio.
	PruneTargetRatio float64
	// Policy selects TTL (default) or LRU bounding.
	Policy ApproxPolicy
}

// Approx is an approximate-mode prefix index (kv-events-index.md §15.1, and the predicted side
// index of §15.2): it learns from the router's own booked decisions instead of KV events.
// RecordBooking inserts a request's blocks for the chosen candidate with the sequence-hash chain
// as external ids; entries expire TTL after their last insertion (ExpireBefore), and the index is
// pruned when it grows beyond MaxTreeSize (earliest expiry first, ties deepest first). Expired,
// pruned and evicted entries are removed exactly as if the candidate had sent Removed.
//
// Time is always passed in; Approx has no clock. It is safe for concurrent use, with the same
// locking as Index. Queries have the Index semantics; lower tiers are always empty.
type Approx struct {
	ix  *Index // one shard, sh, whose mutex guards everything below
	sh  *shard
	cfg ApproxConfig

	per      map[Candidate]*approxCand
	byExpiry expiryHeap
	capacity map[uint64]int // worker id → blocks per candidate (LRU policy)
	scratch  []uint64
	blocks   []StoredBlock
	st       ApproxStats
}

// approxCand is one candidate's entries, keyed by external hash, in an insertion-recency list.
type approxCand struct {
	entries    map[uint64]*approxEntry
	head, tail *approxEntry // head = most recently inserted
}

// approxEntry is one (node, candidate) entry's bookkeeping.
type approxEntry struct {
	c          Candidate
	ext        uint64
	expiry     int64  // Unix nanoseconds
	depth      uint32 // blocks from the root (1 = first block), for pruning ties
	heapIdx    int
	prev, next *approxEntry
}

// ApproxStats are an Approx index's counters: the Index counters (where each recorded booking
// and each restored event counts as an applied event) plus removals by cause.
type ApproxStats struct {
	Stats
	// Bookings counts RecordBooking calls that inserted blocks.
	Bookings uint64
	// Expired counts entries removed by ExpireBefore.
	Expired uint64
	// Pruned counts entries removed because the index exceeded MaxTreeSize.
	Pruned uint64
	// Evicted counts entries removed by the LRU per-candidate capacity.
	Evicted uint64
}

// NewApprox returns an empty approximate-mode index.
func NewApprox(cfg ApproxConfig) *Approx {
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultApproxTTL
	}
	if cfg.MaxTreeSize <= 0 {
		cfg.MaxTreeSize = DefaultMaxTreeSize
	}
	if !(cfg.PruneTargetRatio > 0 && cfg.PruneTargetRatio <= 1) {
		cfg.PruneTargetRatio = DefaultPruneTargetRatio
	}
	ix := New(Config{BlockSize: cfg.BlockSize, Shards: 1})
	a := &Approx{
		ix:       ix,
		sh:       ix.shards[0],
		cfg:      cfg,
		per:      make(map[Candidate]*approxCand),
		capacity: make(map[uint64]int),
	}
	a.sh.onDrop = a.forget
	a.sh.interleave = false // the expiry bookkeeping follows every entry change under the lock
	return a
}

// Config returns the effective configuration (defaults filled in).
func (a *Approx) Config() ApproxConfig { return a.cfg }

// BlockSize returns the configured block size in tokens.
func (a *Approx) BlockSize() int { return a.ix.blockSize }

// RecordBooking records a booked routing decision (§15.1): the request's localHashes (its local
// block hashes, or a hash-form request's block_hashes) are inserted from the root for candidate
// c with the sequence-hash chain of localHashes as external ids, every entry's expiry set to
// now + TTL (re-insertion refreshes it). Then the LRU capacity and the size cap are enforced. An
// empty localHashes records nothing. The only error is ErrInvalidBlockSequence for a
// sequence-hash collision inside the request (nothing is recorded then).
func (a *Approx) RecordBooking(c Candidate, localHashes []uint64, now time.Time) error {
	if len(localHashes) == 0 {
		return nil
	}
	a.sh.mu.Lock()
	defer a.sh.mu.Unlock()
	a.scratch = AppendSequenceHashes(a.scratch[:0], localHashes)
	a.blocks = a.blocks[:0]
	for i, h := range localHashes {
		a.blocks = append(a.blocks, StoredBlock{BlockHash: a.scratch[i], TokensHash: h})
	}
	ev := Event{WorkerID: c.WorkerID, DPRank: c.DPRank, Kind: EventStored, Blocks: a.blocks}
	if err := a.sh.apply(ev); err != nil {
		return fmt.Errorf("record booking: %w", err)
	}
	a.st.Bookings++
	expiry := now.Add(a.cfg.TTL).UnixNano()
	// Deepest first, so that within one booking the blocks nearest the root count as the most
	// recently inserted and LRU eviction trims sequences from their tails.
	for i := len(a.blocks) - 1; i >= 0; i-- {
		a.touch(c, a.blocks[i].BlockHash, uint32(i+1), expiry)
	}
	a.enforceCapacity(c)
	a.enforceSize()
	return nil
}

// touch creates or refreshes the bookkeeping of entry (c, ext) and marks it most recently inserted.
func (a *Approx) touch(c Candidate, ext uint64, depth uint32, expiry int64) {
	pc := a.per[c]
	if pc == nil {
		pc = &approxCand{entries: make(map[uint64]*approxEntry)}
		a.per[c] = pc
	}
	e := pc.entries[ext]
	if e == nil {
		e = &approxEntry{c: c, ext: ext, expiry: expiry, depth: depth}
		pc.entries[ext] = e
		heap.Push(&a.byExpiry, e)
	} else {
		e.expiry, e.depth = expiry, depth
		heap.Fix(&a.byExpiry, e.heapIdx)
		pc.unlink(e)
	}
	pc.pushFront(e)
}

// forget is the Index's onDrop hook: the entry (c, ext) left the index.
func (a *Approx) forget(c Candidate, ext uint64) {
	pc := a.per[c]
	if pc == nil {
		return
	}
	e := pc.entries[ext]
	if e == nil {
		return
	}
	delete(pc.entries, ext)
	pc.unlink(e)
	heap.Remove(&a.byExpiry, e.heapIdx)
	if len(pc.entries) == 0 {
		delete(a.per, c)
	}
}

// evict removes entry e from the index as if its candidate had sent Removed.
func (a *Approx) evict(e *approxEntry) {
	s, ok := a.sh.slotOf[e.c]
	if ok && a.sh.removeOne(s, e.ext) {
		a.sh.releaseIfEmpty(s)
		return
	}
	a.forget(e.c, e.ext) // bookkeeping without an index entry: drop it alone
}

// enforceCapacity applies the LRU per-candidate capacity to c.
func (a *Approx) enforceCapacity(c Candidate) {
	if a.cfg.Policy != ApproxLRU {
		return
	}
	limit := a.capacity[c.WorkerID]
	if limit <= 0 {
		return
	}
	for pc := a.per[c]; pc != nil && len(pc.entries) > limit; pc = a.per[c] {
		a.evict(pc.tail)
		a.st.Evicted++
	}
}

// enforceSize prunes to PruneTargetRatio × MaxTreeSize once the index exceeds MaxTreeSize.
func (a *Approx) enforceSize() {
	if a.sh.st.TierEntries[TierDevice] <= uint64(a.cfg.MaxTreeSize) {
		return
	}
	target := uint64(a.cfg.PruneTargetRatio * float64(a.cfg.MaxTreeSize))
	for a.sh.st.TierEntries[TierDevice] > target && len(a.byExpiry) > 0 {
		a.evict(a.byExpiry[0])
		a.st.Pruned++
	}
}

// ExpireBefore removes every entry whose expiry is at or before now (inserted at least TTL
// before now and not refreshed since) and returns how many were removed.
func (a *Approx) ExpireBefore(now time.Time) int {
	a.sh.mu.Lock()
	defer a.sh.mu.Unlock()
	t := now.UnixNano()
	n := 0
	for len(a.byExpiry) > 0 && a.byExpiry[0].expiry <= t {
		a.evict(a.byExpiry[0])
		n++
	}
	a.st.Expired += uint64(n)
	return n
}

// SetWorkerCapacity sets the LRU per-candidate capacity, in blocks, of every rank of workerID
// (the worker's total_kv_blocks); blocks <= 0 removes the limit. Candidates already above the new
// capacity are trimmed at once. Without the LRU policy the capacity is recorded but unused.
func (a *Approx) SetWorkerCapacity(workerID uint64, blocks int) {
	a.sh.mu.Lock()
	defer a.sh.mu.Unlock()
	if blocks <= 0 {
		delete(a.capacity, workerID)
		return
	}
	a.capacity[workerID] = blocks
	for c := range a.per {
		if c.WorkerID == workerID {
			a.enforceCapacity(c)
		}
	}
}

// Clear removes one candidate's entries, as a Cleared event would (§11.4); other ranks of the
// same worker keep theirs.
func (a *Approx) Clear(c Candidate) {
	a.sh.mu.Lock()
	defer a.sh.mu.Unlock()
	if s, ok := a.sh.slotOf[c]; ok {
		a.sh.clearSlot(s)
	}
}

// RemoveWorker removes every rank of workerID (see Index.RemoveWorker) and its capacity.
func (a *Approx) RemoveWorker(workerID uint64) {
	a.sh.mu.Lock()
	defer a.sh.mu.Unlock()
	a.sh.removeWorker(workerID)
	delete(a.capacity, workerID)
}

// FindMatches is Index.FindMatches over the recorded bookings (Device only).
func (a *Approx) FindMatches(localHashes []uint64, dst []Match) []Match {
	return a.ix.FindMatches(localHashes, dst)
}

// ExternalHashes is Index.ExternalHashes; the ids are sequence hashes.
func (a *Approx) ExternalHashes(c Candidate, localHashes []uint64, n int) []uint64 {
	n = min(n, len(localHashes))
	if n <= 0 {
		return nil
	}
	a.sh.mu.RLock()
	defer a.sh.mu.RUnlock()
	s, ok := a.sh.slotOf[c]
	if !ok {
		return nil
	}
	return a.sh.externalHashes(s, localHashes, n)
}

// Dump is Index.Dump of the recorded entries (§14.1).
func (a *Approx) Dump() []DumpEvent { return a.ix.Dump() }

// Restore applies dumped events (§14.2) and gives every entry they store the expiry now + TTL.
// Removed and Cleared events are applied too. The error reports failed events as in
// Index.Restore.
func (a *Approx) Restore(events []RouterEvent, now time.Time) error {
	a.sh.mu.Lock()
	defer a.sh.mu.Unlock()
	expiry := now.Add(a.cfg.TTL).UnixNano()
	var first error
	failed := 0
	for _, re := range events {
		ev := Event(re)
		if err := a.sh.apply(ev); err != nil {
			failed++
			if first == nil {
				first = err
			}
			continue
		}
		if ev.Kind != EventStored || ev.Tier != TierDevice {
			continue
		}
		c := ev.Candidate()
		depth := uint32(0)
		if ev.HasParent {
			if pe := a.per[c].entry(ev.ParentHash); pe != nil {
				depth = pe.depth
			}
		}
		for _, b := range ev.Blocks {
			depth++
			a.touch(c, b.BlockHash, depth, expiry)
		}
		a.enforceCapacity(c)
	}
	a.enforceSize()
	if first != nil {
		return fmt.Errorf("restore: %d of %d events failed, first: %w", failed, len(events), first)
	}
	return nil
}

// Stats returns the counters.
func (a *Approx) Stats() ApproxStats {
	a.sh.mu.RLock()
	defer a.sh.mu.RUnlock()
	s := a.st
	s.Stats = a.sh.stats()
	return s
}

func (pc *approxCand) entry(ext uint64) *approxEntry {
	if pc == nil {
		return nil
	}
	return pc.entries[ext]
}

func (pc *approxCand) unlink(e *approxEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else if pc.head == e {
		pc.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else if pc.tail == e {
		pc.tail = e.prev
	}
	e.prev, e.next = nil, nil
}

func (pc *approxCand) pushFront(e *approxEntry) {
	e.prev, e.next = nil, pc.head
	if pc.head != nil {
		pc.head.prev = e
	}
	pc.head = e
	if pc.tail == nil {
		pc.tail = e
	}
}

// expiryHeap orders entries by expiry, then deepest first, then candidate and external hash (so
// pruning is deterministic).
type expiryHeap []*approxEntry

// Len is heap.Interface: the number of entries.
func (h expiryHeap) Len() int { return len(h) }

// Less is heap.Interface: entry i expires before j (ties: deeper, then candidate, then hash).
func (h expiryHeap) Less(i, j int) bool {
	a, b := h[i], h[j]
	if a.expiry != b.expiry {
		return a.expiry < b.expiry
	}
	if a.depth != b.depth {
		return a.depth > b.depth
	}
	if c := cmpCandidate(a.c, b.c); c != 0 {
		return c < 0
	}
	return a.ext < b.ext
}

// Swap is heap.Interface; it keeps each entry's heapIdx in step.
func (h expiryHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIdx = i
	h[j].heapIdx = j
}

// Push is heap.Interface: appends an *approxEntry.
func (h *expiryHeap) Push(x any) {
	e := x.(*approxEntry)
	e.heapIdx = len(*h)
	*h = append(*h, e)
}

// Pop is heap.Interface: removes and returns the last entry, marking it out of the heap.
func (h *expiryHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	e.heapIdx = -1
	return e
}
