package kvindex

import (
	"math/bits"
	"sync"
	"sync/atomic"
)

// Defaults of Config.
const (
	// DefaultShards is the default Config.Shards.
	DefaultShards = 8
	// DefaultShardWorkers is the default Config.ShardWorkers.
	DefaultShardWorkers = 64
	// MaxShards bounds Config.Shards.
	MaxShards = 64
)

// Config configures an Index.
type Config struct {
	// BlockSize is the partition's KV block size in tokens (bs). The index itself counts blocks;
	// callers convert to tokens with blocks × BlockSize (§11.5).
	BlockSize int
	// Shards is the most shards the index splits its workers over (kv-events-index.md §16:
	// different workers' events apply in parallel); <= 0 means DefaultShards, 1 means one lock
	// for everything; at most MaxShards.
	Shards int
	// ShardWorkers is how many workers a shard takes before the next shard is opened; once all
	// Shards are open, a new worker goes to the shard with the fewest workers. A lookup walks
	// every open shard, so small pools stay in one shard. <= 0 means DefaultShardWorkers.
	ShardWorkers int

	idLadder []uint8 // test hook: id widths of the shards' lookups (default idLadder)
}

// Index is one partition's KV prefix index (kv-events-index.md §11, §12): a radix tree of device
// blocks keyed by local block hash plus one lower-tier store per tier (host_pinned, disk,
// external).
//
// Representation (arena.go, holders.go, extindex.go): blocks are dense ids in chunked arrays
// holding 16 bytes per block (tokens_hash and one external hash); chains of blocks with the same
// holders are runs, whose parent links and holder sets are stored once; further holders' external
// hashes are 8 bytes per (block, candidate) pair; each candidate's external-hash lookup is about
// 6 bytes per entry. A pair therefore costs about 22 bytes when every block has its own worker and
// less when workers share blocks.
//
// Removal semantics (§11.3): a node whose candidate set empties stops matching, and so does its
// whole subtree for every candidate not on it. The node is kept as an empty placeholder only while
// entries remain below it, so a path of local hashes always names at most one node. Each
// candidate's entries therefore depend only on its own events, and results never depend on how
// different workers' events interleave or which shard a worker is in (§11.5: every indexer variant
// gives identical results; §16: workers may be applied in parallel). The one visible consequence:
// a candidate that re-stores an emptied parent reconnects to its own blocks still cached below it,
// exactly as the engine's own prefix cache does.
//
// Concurrency: workers are spread over up to Config.Shards shards, each with its own RWMutex
// and tree (all ranks of a worker share a shard). Apply, RemoveWorker and Restore lock only the
// shards of the workers they touch, so listeners of workers in different shards apply in
// parallel; FindMatches, ExternalHashes and Stats read-lock one shard at a time and run in
// parallel with each other; Dump read-locks the open shards together. Callers apply the events of
// one worker in arrival order (§16). A long write lets waiting lookups in every few
// microseconds, so a lookup may see a Stored or Removed event partly applied (as if it had been
// split into shorter events) but never a Cleared or RemoveWorker partly applied; a worker's
// writes never interleave with each other (interleave.go).
type Index struct {
	blockSize int
	shards    []*shard
	fill      int32
	opened    atomic.Int32 // shards[:opened] may hold workers

	assignMu sync.Mutex
	assign   sync.Map // worker id → shard index (int32), while the worker has candidates
	assigned []atomic.Int32
}

// New returns an empty index.
func New(cfg Config) *Index {
	n := cfg.Shards
	if n <= 0 {
		n = DefaultShards
	}
	n = min(n, MaxShards)
	fill := cfg.ShardWorkers
	if fill <= 0 {
		fill = DefaultShardWorkers
	}
	ladder := cfg.idLadder
	if ladder == nil {
		ladder = idLadder
	}
	ix := &Index{blockSize: cfg.BlockSize, shards: make([]*shard, n), fill: int32(fill), assigned: make([]atomic.Int32, n)}
	for i := range ix.shards {
		sh := newShard(ladder)
		sh.interleave = true
		k := int32(i)
		sh.unassign = func(w uint64) {
			if ix.assign.CompareAndDelete(w, k) {
				ix.assigned[k].Add(-1)
			}
		}
		ix.shards[i] = sh
	}
	ix.opened.Store(1)
	return ix
}

// BlockSize returns the configured block size in tokens.
func (ix *Index) BlockSize() int { return ix.blockSize }

// shardIndex returns the shard of workerID, assigning one (fill-first, then least loaded) when
// create is set; -1 when the worker has none.
func (ix *Index) shardIndex(workerID uint64, create bool) int32 {
	if v, ok := ix.assign.Load(workerID); ok {
		return v.(int32)
	}
	if !create {
		return -1
	}
	ix.assignMu.Lock()
	defer ix.assignMu.Unlock()
	if v, ok := ix.assign.Load(workerID); ok {
		return v.(int32)
	}
	k := int32(-1)
	open := ix.opened.Load()
	for i := int32(0); i < open; i++ {
		if ix.assigned[i].Load() < ix.fill {
			k = i
			break
		}
	}
	if k < 0 && int(open) < len(ix.shards) {
		k = open
		ix.opened.Store(open + 1)
	}
	if k < 0 {
		k = 0
		for i := int32(1); i < open; i++ {
			if ix.assigned[i].Load() < ix.assigned[k].Load() {
				k = i
			}
		}
	}
	ix.assign.Store(workerID, k)
	ix.assigned[k].Add(1)
	return k
}

// lockWorker write-locks and returns the shard of workerID (assigning one when create is set),
// or nil when the worker has none, once no other write of the worker is paused there
// (interleave.go). The assignment is checked again under the lock: it changes only when the
// worker's last candidate leaves its shard, which needs that shard's lock.
func (ix *Index) lockWorker(workerID uint64, create bool) *shard {
	for {
		k := ix.shardIndex(workerID, create)
		if k < 0 {
			return nil
		}
		sh := ix.shards[k]
		sh.mu.Lock()
		for sh.waitIdle(workerID) {
		}
		if v, ok := ix.assign.Load(workerID); ok && v.(int32) == k {
			sh.beginWrite(workerID)
			return sh
		}
		sh.mu.Unlock()
	}
}

// unlockWorker ends the write on sh and releases it, first dropping the assignment of a worker
// left without candidates (an event that stored nothing must not pin a worker to a shard).
func (ix *Index) unlockWorker(sh *shard, workerID uint64) {
	if sh.workers[workerID] == 0 {
		sh.unassign(workerID)
	}
	sh.endWrite()
	sh.mu.Unlock()
}

// Apply applies one event (kv-events-index.md §11.2-§11.4, §12.1):
//
//   - Stored: the parent (HasParent false = the root) must be known for the candidate in that tier
//     (device tier: its device lookup; lower tiers: any tier), otherwise the whole store is skipped
//     and the error wraps ErrParentBlockNotFound. A block hash equal to the parent hash or repeated
//     inside the store skips the whole store with ErrInvalidBlockSequence. Otherwise each block
//     becomes the child of the previous one; a candidate re-storing a known external hash at a
//     different position moves it there (each external hash names one block per candidate).
//   - Removed: each known hash is removed; a device node whose candidate set empties stops
//     matching together with its subtree (see Index). Unknown hashes are non-fatal: the rest is
//     applied and the error wraps ErrBlockNotFound, naming how many were missing.
//   - Cleared: removes the candidate from every tier.
//
// An event with an out-of-range kind or tier returns ErrInvalidEvent. Every outcome is counted in
// Stats.
func (ix *Index) Apply(ev Event) error {
	sh := ix.lockWorker(ev.WorkerID, true)
	defer ix.unlockWorker(sh, ev.WorkerID)
	return sh.apply(ev)
}

// RemoveWorker removes every rank of workerID from every tier (§11.4 remove_worker), as if each
// of its candidates had sent Cleared. Removing an unknown worker is a no-op.
func (ix *Index) RemoveWorker(workerID uint64) {
	sh := ix.lockWorker(workerID, false)
	if sh == nil {
		return
	}
	defer ix.unlockWorker(sh, workerID)
	sh.removeWorker(workerID)
}

// Match is one candidate's tiered overlap with a query, in blocks (§11.5, §12.2): Device
// consecutive device blocks from the root, then HostExt host_pinned blocks beyond the device
// prefix, DiskExt disk blocks beyond that, ExternalExt external-tier blocks beyond that.
// Cumulative tokens (§12.3): gpu = Device×bs, cpu = gpu + HostExt×bs,
// disk = cpu + (DiskExt + ExternalExt)×bs.
type Match struct {
	Candidate                             Candidate
	Device, HostExt, DiskExt, ExternalExt uint32
}

// Blocks returns the candidate's total matched blocks over all tiers.
func (m Match) Blocks() uint32 { return m.Device + m.HostExt + m.DiskExt + m.ExternalExt }

// CumulativeTokens returns the match's cumulative tiered overlap in tokens for a partition of
// blockSize tokens per block (kv-events-index.md §12.3, Mooncake tier semantics):
// gpu = Device×bs, cpu = gpu + HostExt×bs, disk = cpu + (DiskExt + ExternalExt)×bs, so
// gpu ≤ cpu ≤ disk always holds and the external tier folds into disk. A blockSize <= 0 yields
// zeros.
func (m Match) CumulativeTokens(blockSize int) (gpu, cpu, disk uint64) {
	if blockSize <= 0 {
		return 0, 0, 0
	}
	bs := uint64(blockSize)
	gpu = uint64(m.Device) * bs
	cpu = gpu + uint64(m.HostExt)*bs
	disk = cpu + (uint64(m.DiskExt)+uint64(m.ExternalExt))*bs
	return gpu, cpu, disk
}

// FindMatches appends to dst one Match for every candidate that matched at least one block of
// localHashes (local block hashes, §1) in any tier, and returns the extended slice. It walks with
// early_exit = false (§11.5): a candidate's Device count is the number of consecutive blocks from
// the root it holds; lower tiers extend it as in §12.2; candidates present only in lower tiers
// start from the root. No Match reports more blocks than len(localHashes). The order of the
// appended matches is unspecified. Its cost grows with the matched depth and the number of
// candidates holding the matched blocks (plus a word per 64 candidates of each shard at a change
// of holder set), not with the pool size. It does not allocate when dst has capacity for every
// match (and no shard has more than 512 candidates).
func (ix *Index) FindMatches(localHashes []uint64, dst []Match) []Match {
	// Shards being written are walked last, so a lookup waits for the longest write in
	// progress rather than for each in turn.
	var busy uint64
	for i, sh := range ix.shards[:ix.opened.Load()] {
		if !sh.tryRLock() {
			busy |= 1 << i
			continue
		}
		dst = sh.findMatches(localHashes, dst)
		sh.mu.RUnlock()
	}
	for ; busy != 0; busy &= busy - 1 {
		sh := ix.shards[bits.TrailingZeros64(busy)]
		sh.rlock()
		dst = sh.findMatches(localHashes, dst)
		sh.mu.RUnlock()
	}
	return dst
}

// ExternalHashes returns c's external (engine) block hashes along localHashes for the first n
// device blocks it holds consecutively from the root (for kv_hint): at most min(n, len(localHashes))
// values, fewer when c's device prefix is shorter; nil when c holds none or n <= 0.
func (ix *Index) ExternalHashes(c Candidate, localHashes []uint64, n int) []uint64 {
	if n > len(localHashes) {
		n = len(localHashes)
	}
	if n <= 0 {
		return nil
	}
	k := ix.shardIndex(c.WorkerID, false)
	if k < 0 {
		return nil
	}
	sh := ix.shards[k]
	sh.rlock()
	defer sh.mu.RUnlock()
	s, ok := sh.slotOf[c]
	if !ok {
		return nil
	}
	return sh.externalHashes(s, localHashes, n)
}

// Stats are the index's counters, ready to export as metrics. Entry counts are gauges; the other
// fields are monotonic counters since New.
type Stats struct {
	// Candidates is the number of (worker, dp_rank) pairs with at least one entry in any tier.
	Candidates int
	// Entries is the number of device (node, candidate) pairs, including pairs below a node the
	// candidate is no longer on (which cannot match until it re-stores that node); equals
	// TierEntries[TierDevice].
	Entries uint64
	// TierEntries counts entries per tier: device (node, candidate) pairs and lower-tier edges.
	TierEntries [numTiers]uint64
	// EventsApplied counts events applied (including removals with some unknown hashes).
	EventsApplied uint64
	// EventsInvalid counts events rejected for an out-of-range kind or tier.
	EventsInvalid uint64
	// StoresParentNotFound counts stores skipped for an unknown parent (ErrParentBlockNotFound).
	StoresParentNotFound uint64
	// StoresInvalidSequence counts stores skipped for a repeated block hash (ErrInvalidBlockSequence).
	StoresInvalidSequence uint64
	// RemovalsBlockNotFound counts removal events with at least one unknown hash (ErrBlockNotFound).
	RemovalsBlockNotFound uint64
	// BlocksNotFound counts the unknown hashes of those removals.
	BlocksNotFound uint64
}

func (s *Stats) add(o Stats) {
	s.Candidates += o.Candidates
	s.Entries += o.Entries
	for t := range s.TierEntries {
		s.TierEntries[t] += o.TierEntries[t]
	}
	s.EventsApplied += o.EventsApplied
	s.EventsInvalid += o.EventsInvalid
	s.StoresParentNotFound += o.StoresParentNotFound
	s.StoresInvalidSequence += o.StoresInvalidSequence
	s.RemovalsBlockNotFound += o.RemovalsBlockNotFound
	s.BlocksNotFound += o.BlocksNotFound
}

// Stats returns a snapshot of the counters (summed over the shards, each read under its lock).
func (ix *Index) Stats() Stats {
	var s Stats
	for _, sh := range ix.shards {
		sh.rlock()
		s.add(sh.stats())
		sh.mu.RUnlock()
	}
	return s
}

// hashSet is a reusable open-addressing set of u64 keys for duplicate detection in long stores.
// Slots are valid only when their stamp equals the current generation, so reset is O(1) unless
// the table must grow.
type hashSet struct {
	keys  []uint64
	stamp []uint32
	gen   uint32
	shift uint8 // 64 − log2(table size)
}

// reset empties the set and sizes it for n keys (load factor ≤ 1/2).
func (h *hashSet) reset(n int) {
	size := 16
	for size < 2*n {
		size *= 2
	}
	if len(h.keys) < size {
		h.keys, h.stamp, h.gen = make([]uint64, size), make([]uint32, size), 0
	}
	h.shift = uint8(64 - bits.TrailingZeros(uint(size)))
	h.gen++
	if h.gen == 0 {
		clear(h.stamp)
		h.gen = 1
	}
}

// add inserts k and reports false when it was already present.
func (h *hashSet) add(k uint64) bool {
	mask := uint64(1)<<(64-h.shift) - 1
	for i := (k * 0x9e3779b97f4a7c15) >> h.shift; ; i = (i + 1) & mask {
		if h.stamp[i] != h.gen {
			h.stamp[i], h.keys[i] = h.gen, k
			return true
		}
		if h.keys[i] == k {
			return false
		}
	}
}
