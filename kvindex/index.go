package kvindex

import (
	"fmt"
	"math/bits"
	"sync"
)

// Config configures an Index.
type Config struct {
	// BlockSize is the partition's KV block size in tokens (bs). The index itself counts blocks;
	// callers convert to tokens with blocks × BlockSize (§11.5).
	BlockSize int
}

// Index is one partition's KV prefix index (kv-events-index.md §11, §12): a radix tree of device
// blocks keyed by local block hash plus one lower-tier store per tier (host_pinned, disk,
// external).
//
// Each candidate gets a dense slot number while it has entries (slots of removed candidates are
// reused); every tree node keeps a bitset of slots and the slots' external hashes, so a lookup is
// a bitset intersection per level with no maps on the single-child path.
//
// Removal semantics (§11.3): a node whose candidate set empties stops matching, and so does its
// whole subtree for every candidate not on it. The node object is kept as an empty placeholder
// only while entries remain below it, so a path of local hashes always names at most one node.
// Each candidate's entries therefore depend only on its own events, and results never depend on
// how different workers' events interleave (§11.5: every indexer variant gives identical results;
// §16: workers may be applied in parallel). The one visible consequence: a candidate that
// re-stores an emptied parent reconnects to its own blocks still cached below it, exactly as the
// engine's own prefix cache does.
//
// An Index is safe for concurrent use: lookups (FindMatches, ExternalHashes, Dump, Stats) share a
// read lock and run in parallel; Apply and RemoveWorker take the write lock. Callers apply the
// events of one worker in arrival order (§16).
type Index struct {
	mu        sync.RWMutex
	blockSize int
	root      *node

	slotOf    map[Candidate]uint32
	slots     []slotState // indexed by slot; a free slot has a nil lookup and no lower stores
	used      []uint64    // bitset of allocated slots
	nwords    int         // bitset words covering the highest allocated slot
	lowerBits []uint64    // bitset of slots with at least one lower-tier edge

	st   Stats   // counters; Candidates and the entry counts are maintained in place
	dups hashSet // duplicate detection for long stores (write lock held)

	// onDrop, when set, is called (write lock held) whenever a device entry leaves a candidate's
	// lookup table; approximate mode keeps its expiry bookkeeping in step through it.
	onDrop func(c Candidate, ext uint64)
}

// slotState is everything the index keeps for one candidate.
type slotState struct {
	cand   Candidate
	lookup map[uint64]*node // device tier: external hash → node (§11.1); exactly the nodes holding the slot
	lower  [numTiers - 1]*lowerStore
}

// New returns an empty index.
func New(cfg Config) *Index {
	return &Index{
		blockSize: cfg.BlockSize,
		root:      &node{},
		slotOf:    make(map[Candidate]uint32),
	}
}

// BlockSize returns the configured block size in tokens.
func (ix *Index) BlockSize() int { return ix.blockSize }

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
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.applyLocked(ev)
}

// applyLocked is Apply with the write lock held.
func (ix *Index) applyLocked(ev Event) error {
	c := ev.Candidate()
	if ev.Tier >= numTiers {
		ix.st.EventsInvalid++
		return fmt.Errorf("%v event %d: storage tier %d: %w", c, ev.EventID, uint8(ev.Tier), ErrInvalidEvent)
	}
	switch ev.Kind {
	case EventStored:
		if err := ix.checkStore(c, ev); err != nil {
			ix.st.StoresInvalidSequence++
			return err
		}
		var err error
		if ev.Tier == TierDevice {
			err = ix.storeDevice(c, ev)
		} else {
			err = ix.storeLower(c, ev)
		}
		if err != nil {
			ix.st.StoresParentNotFound++
			return err
		}
	case EventRemoved:
		missing := ix.remove(c, ev.Tier, ev.BlockHashes)
		if missing > 0 {
			ix.st.EventsApplied++
			ix.st.RemovalsBlockNotFound++
			ix.st.BlocksNotFound += uint64(missing)
			return fmt.Errorf("%v event %d: %d of %d removed %s block hashes unknown: %w",
				c, ev.EventID, missing, len(ev.BlockHashes), ev.Tier, ErrBlockNotFound)
		}
	case EventCleared:
		if s, ok := ix.slotOf[c]; ok {
			ix.clearSlot(s)
		}
	default:
		ix.st.EventsInvalid++
		return fmt.Errorf("%v event %d: kind %d: %w", c, ev.EventID, uint8(ev.Kind), ErrInvalidEvent)
	}
	ix.st.EventsApplied++
	return nil
}

// checkStore rejects a store whose blocks repeat a hash or repeat the parent hash (§11.2 step 3).
func (ix *Index) checkStore(c Candidate, ev Event) error {
	blocks := ev.Blocks
	if ev.HasParent {
		for _, b := range blocks {
			if b.BlockHash == ev.ParentHash {
				return fmt.Errorf("%v event %d: block hash %d equals its parent hash: %w",
					c, ev.EventID, b.BlockHash, ErrInvalidBlockSequence)
			}
		}
	}
	if len(blocks) <= 32 {
		for i := 1; i < len(blocks); i++ {
			for j := 0; j < i; j++ {
				if blocks[i].BlockHash == blocks[j].BlockHash {
					return fmt.Errorf("%v event %d: block hash %d appears twice in one store: %w",
						c, ev.EventID, blocks[i].BlockHash, ErrInvalidBlockSequence)
				}
			}
		}
		return nil
	}
	ix.dups.reset(len(blocks))
	for _, b := range blocks {
		if !ix.dups.add(b.BlockHash) {
			return fmt.Errorf("%v event %d: block hash %d appears twice in one store: %w",
				c, ev.EventID, b.BlockHash, ErrInvalidBlockSequence)
		}
	}
	return nil
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

// storeDevice applies a validated device-tier Stored event (§11.2).
func (ix *Index) storeDevice(c Candidate, ev Event) error {
	s, ok := ix.slotOf[c]
	parent := ix.root
	if ev.HasParent {
		var p *node
		if ok {
			p = ix.slots[s].lookup[ev.ParentHash]
		}
		if p == nil {
			return fmt.Errorf("%v event %d: parent block hash %d: %w", c, ev.EventID, ev.ParentHash, ErrParentBlockNotFound)
		}
		parent = p
	}
	if len(ev.Blocks) == 0 {
		return nil
	}
	if !ok {
		s = ix.allocSlot(c)
	}
	st := &ix.slots[s]
	if st.lookup == nil {
		st.lookup = make(map[uint64]*node, len(ev.Blocks))
	}
	for _, b := range ev.Blocks {
		n := parent.child(b.TokensHash)
		if n == nil {
			n = &node{key: b.TokensHash}
			parent.addChild(n)
		}
		ix.putEntry(st, s, n, b.BlockHash)
		parent = n
	}
	return nil
}

// putEntry records that slot s holds node n under external hash ext, keeping the lookup table a
// bijection between the slot's external hashes and the nodes holding the slot.
func (ix *Index) putEntry(st *slotState, s uint32, n *node, ext uint64) {
	m, moved := st.lookup[ext]
	moved = moved && m != n
	if n.has(s) {
		if old := n.ext[n.rank(s)]; old != ext {
			delete(st.lookup, old)
			n.setExt(s, ext)
			if ix.onDrop != nil {
				ix.onDrop(st.cand, old)
			}
		}
	} else {
		n.add(s, ext)
		ix.st.TierEntries[TierDevice]++
	}
	st.lookup[ext] = n
	if moved {
		// The engine reuses this id for another block: it no longer names the old one. (Done
		// after n gained the slot, so pruning m can never remove n.)
		ix.dropEntry(m, s)
	}
}

// dropEntry removes slot s from node n and prunes n if it is left empty (§11.3).
func (ix *Index) dropEntry(n *node, s uint32) {
	n.del(s)
	ix.st.TierEntries[TierDevice]--
	ix.prune(n)
}

// prune unlinks n, then its ancestors, while they hold no candidate and have no children. An
// empty node with children stays as a placeholder: it matches nobody, so its subtree does not
// match either for candidates not on it.
func (ix *Index) prune(n *node) {
	for n != ix.root && n.count() == 0 && n.child0 == nil {
		p := n.parent
		if p == nil {
			return
		}
		p.removeChild(n)
		n.parent = nil
		n = p
	}
}

// remove applies a Removed event for candidate c in tier t and returns the number of unknown hashes.
func (ix *Index) remove(c Candidate, t Tier, hashes []uint64) int {
	s, ok := ix.slotOf[c]
	if !ok {
		return len(hashes)
	}
	st := &ix.slots[s]
	missing := 0
	if t == TierDevice {
		for _, h := range hashes {
			if !ix.removeDevice(s, h) {
				missing++
			}
		}
	} else {
		ls := st.lower[t-1]
		for _, h := range hashes {
			if ls == nil || !ls.remove(h) {
				missing++
				continue
			}
			ix.st.TierEntries[t]--
		}
		if ls != nil && len(ls.rev) == 0 {
			ix.dropLower(s, t)
		}
	}
	ix.releaseIfEmpty(s)
	return missing
}

// removeDevice removes slot s's device entry with external hash h and reports whether it
// existed. The caller releases the slot when it may have emptied.
func (ix *Index) removeDevice(s uint32, h uint64) bool {
	st := &ix.slots[s]
	n, ok := st.lookup[h]
	if !ok {
		return false
	}
	delete(st.lookup, h)
	ix.dropEntry(n, s)
	if ix.onDrop != nil {
		ix.onDrop(st.cand, h)
	}
	return true
}

// clearSlot removes slot s from every tier and frees it (§11.4).
func (ix *Index) clearSlot(s uint32) {
	st := &ix.slots[s]
	for h, n := range st.lookup {
		ix.dropEntry(n, s)
		if ix.onDrop != nil {
			ix.onDrop(st.cand, h)
		}
	}
	st.lookup = nil
	for t := TierHostPinned; t < numTiers; t++ {
		ix.dropLower(s, t)
	}
	ix.releaseIfEmpty(s)
}

// RemoveWorker removes every rank of workerID from every tier (§11.4 remove_worker), as if each
// of its candidates had sent Cleared. Removing an unknown worker is a no-op.
func (ix *Index) RemoveWorker(workerID uint64) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.removeWorkerLocked(workerID)
}

func (ix *Index) removeWorkerLocked(workerID uint64) {
	for c, s := range ix.slotOf {
		if c.WorkerID == workerID {
			ix.clearSlot(s)
		}
	}
}

// allocSlot assigns the lowest free slot number to c.
func (ix *Index) allocSlot(c Candidate) uint32 {
	var s uint32
	for w := 0; ; w++ {
		if w == len(ix.used) {
			ix.used = append(ix.used, 0)
			ix.lowerBits = append(ix.lowerBits, 0)
		}
		if ^ix.used[w] != 0 {
			s = uint32(w*64 + bits.TrailingZeros64(^ix.used[w]))
			ix.used[w] |= 1 << (s & 63)
			break
		}
	}
	for int(s) >= len(ix.slots) {
		ix.slots = append(ix.slots, slotState{})
	}
	ix.slots[s] = slotState{cand: c}
	ix.slotOf[c] = s
	if int(s>>6)+1 > ix.nwords {
		ix.nwords = int(s>>6) + 1
	}
	ix.st.Candidates++
	return s
}

// releaseIfEmpty frees slot s when the candidate has no entry in any tier.
func (ix *Index) releaseIfEmpty(s uint32) {
	st := &ix.slots[s]
	if len(st.lookup) > 0 {
		return
	}
	for _, ls := range st.lower {
		if ls != nil {
			return
		}
	}
	if ix.used[s>>6]&(1<<(s&63)) == 0 {
		return
	}
	delete(ix.slotOf, st.cand)
	*st = slotState{}
	ix.used[s>>6] &^= 1 << (s & 63)
	ix.st.Candidates--
	for ix.nwords > 0 && ix.used[ix.nwords-1] == 0 {
		ix.nwords--
	}
	for len(ix.slots) > 0 && len(ix.slots) > ix.nwords*64 {
		ix.slots = ix.slots[:len(ix.slots)-1]
	}
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
// appended matches is unspecified. It does not allocate when dst has capacity for every match
// (and the partition has at most 512 candidates).
func (ix *Index) FindMatches(localHashes []uint64, dst []Match) []Match {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if ix.nwords <= 1 {
		return ix.findMatches1(localHashes, dst)
	}
	return ix.findMatchesN(localHashes, dst)
}

// findMatches1 is FindMatches for partitions whose slots all fit in one bitset word.
func (ix *Index) findMatches1(local []uint64, dst []Match) []Match {
	var lower uint64
	if len(ix.lowerBits) > 0 {
		lower = ix.lowerBits[0]
	}
	n := ix.root
	cur := ^uint64(0)
	var first uint64 // slots holding the first block: exactly those with Device ≥ 1
	d := 0
	for d < len(local) {
		c := n.child(local[d])
		if c == nil {
			break
		}
		next := cur & c.bits0
		if d == 0 {
			first = next
		} else if drop := cur &^ next; drop != 0 {
			dst = ix.emitWord(dst, 0, drop, n, d, local, lower)
		}
		cur = next
		if next == 0 {
			break
		}
		n = c
		d++
	}
	if d > 0 && cur != 0 {
		dst = ix.emitWord(dst, 0, cur, n, d, local, lower)
	}
	if rest := lower &^ first; rest != 0 {
		dst = ix.emitLowerOnly(dst, 0, rest, local)
	}
	return dst
}

// findMatchesN is FindMatches for partitions with more than 64 slots.
func (ix *Index) findMatchesN(local []uint64, dst []Match) []Match {
	nw := ix.nwords
	var stack [16]uint64
	var cur, first []uint64
	if nw <= len(stack)/2 {
		cur, first = stack[:nw], stack[nw:2*nw]
	} else {
		buf := make([]uint64, 2*nw)
		cur, first = buf[:nw], buf[nw:]
	}
	for w := range cur {
		cur[w] = ^uint64(0)
	}
	n := ix.root
	d := 0
	for d < len(local) {
		c := n.child(local[d])
		if c == nil {
			break
		}
		any := uint64(0)
		for w := 0; w < nw; w++ {
			next := cur[w] & c.word(w)
			if d == 0 {
				first[w] = next
			} else if drop := cur[w] &^ next; drop != 0 {
				dst = ix.emitWord(dst, w, drop, n, d, local, ix.lowerBits[w])
			}
			cur[w] = next
			any |= next
		}
		if any == 0 {
			break
		}
		n = c
		d++
	}
	for w := 0; w < nw; w++ {
		if d > 0 && cur[w] != 0 {
			dst = ix.emitWord(dst, w, cur[w], n, d, local, ix.lowerBits[w])
		}
		if rest := ix.lowerBits[w] &^ first[w]; rest != 0 {
			dst = ix.emitLowerOnly(dst, w, rest, local)
		}
	}
	return dst
}

// emitWord appends matches for the slots in bitset word w of set, which hold the device blocks
// up to depth d (node n) and no further.
func (ix *Index) emitWord(dst []Match, w int, set uint64, n *node, d int, local []uint64, lower uint64) []Match {
	for set != 0 {
		b := bits.TrailingZeros64(set)
		set &= set - 1
		s := uint32(w*64 + b)
		m := Match{Candidate: ix.slots[s].cand, Device: uint32(d)}
		if lower&(1<<b) != 0 {
			ext, _ := n.extOf(s)
			ix.extend(&m, s, ext, false, local, d)
		}
		dst = append(dst, m)
	}
	return dst
}

// emitLowerOnly appends matches for slots in word w of set that hold no device prefix but have
// lower-tier edges, walking those from the root.
func (ix *Index) emitLowerOnly(dst []Match, w int, set uint64, local []uint64) []Match {
	for set != 0 {
		b := bits.TrailingZeros64(set)
		set &= set - 1
		s := uint32(w*64 + b)
		m := Match{Candidate: ix.slots[s].cand}
		ix.extend(&m, s, 0, true, local, 0)
		if m.Blocks() > 0 {
			dst = append(dst, m)
		}
	}
	return dst
}

// extend fills m's lower-tier extensions (§12.2) for slot s, starting at cursor (or the root) at
// depth d.
func (ix *Index) extend(m *Match, s uint32, cursor uint64, root bool, local []uint64, d int) {
	st := &ix.slots[s]
	for t := TierHostPinned; t < numTiers; t++ {
		ls := st.lower[t-1]
		if ls == nil {
			continue
		}
		steps := uint32(0)
		for d < len(local) {
			x, ok := ls.edges[edgeKey{parent: cursor, tok: local[d], root: root}]
			if !ok {
				break
			}
			cursor, root = x, false
			d++
			steps++
		}
		switch t {
		case TierHostPinned:
			m.HostExt = steps
		case TierDisk:
			m.DiskExt = steps
		case TierExternal:
			m.ExternalExt = steps
		}
	}
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
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	s, ok := ix.slotOf[c]
	if !ok {
		return nil
	}
	var out []uint64
	cur := ix.root
	for d := 0; d < n; d++ {
		cur = cur.child(localHashes[d])
		if cur == nil {
			break
		}
		ext, ok := cur.extOf(s)
		if !ok {
			break
		}
		if out == nil {
			out = make([]uint64, 0, n)
		}
		out = append(out, ext)
	}
	return out
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

// Stats returns a snapshot of the counters.
func (ix *Index) Stats() Stats {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	s := ix.st
	s.Entries = s.TierEntries[TierDevice]
	return s
}
