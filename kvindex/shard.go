package kvindex

import (
	"fmt"
	"math/bits"
	"sync"
)

// shard is one part of an Index: the device tree (arena.go), the candidates' external-hash
// lookups (extindex.go) and their lower-tier stores, for the workers assigned to it. Everything
// in it is guarded by mu; lookups take the read lock, event application the write lock.
type shard struct {
	mu           sync.RWMutex
	interleaving // lookups during long writes (interleave.go)

	chunks     []*chunk
	tail       [2]uint32 // the tail chunks new root chains and new continuations grow from
	open       []uint32  // chunks (not a tail) with at least openFree free ids
	multis     []multi
	freeMultis []uint32
	kids       map[uint64]uint32 // kidHash → child, for children other than the next id (root children always)
	kidsOver   map[kidKey]uint32 // children whose kidHash another child already has
	idBits     uint8             // width of a block id in a lookup entry, a step of ladder
	ladder     []uint8

	slotOf    map[Candidate]uint32
	slots     []slotState // indexed by slot; a free slot has an empty lookup and no lower stores
	cands     []Candidate // slots[s].cand, packed for the lookup walk (whole words of slots)
	used      []uint64    // bitset of allocated slots
	lowerBits []uint64    // bitset of slots with a lower-tier store
	nwords    int         // bitset words covering the highest allocated slot
	// dead is the bitset of cleared slots whose entries are still being removed (interleave.go);
	// lookups ignore them. ndead counts them (0: dead need not be read).
	dead    []uint64
	ndead   int
	workers map[uint64]int

	// lowerRoot lists, per tokens_hash, the slots with a lower-tier edge (ROOT, tokens_hash) in
	// any tier (the candidates a query can match from the root in lower tiers only); lowerRefs
	// counts those edges per (tokens_hash, slot).
	lowerRoot map[uint64][]uint32
	lowerRefs map[rootRef]uint8

	st   Stats
	dups hashSet
	ids  []uint32 // scratch: block ids of a removal or clear
	exts []uint64 // scratch: external hashes of a stretch being stored

	// unassign, when set, is called (write lock held) when a worker's last candidate leaves the
	// shard, so the Index can assign it afresh.
	unassign func(workerID uint64)
	// onDrop, when set, is called (write lock held) whenever a device entry leaves a candidate's
	// lookup; approximate mode keeps its expiry bookkeeping in step through it.
	onDrop func(c Candidate, ext uint64)
}

// slotState is everything a shard keeps for one candidate besides its tree entries.
type slotState struct {
	cand  Candidate
	ext   extIndex
	lower [numTiers - 1]*lowerStore
}

func (st *slotState) hasLower() bool {
	return st.lower[0] != nil || st.lower[1] != nil || st.lower[2] != nil
}

// syncLower updates slot s's bit in lowerBits after its lower stores changed.
func (sh *shard) syncLower(s uint32) {
	if sh.slots[s].hasLower() {
		sh.lowerBits[s>>6] |= 1 << (s & 63)
	} else {
		sh.lowerBits[s>>6] &^= 1 << (s & 63)
	}
}

type rootRef struct {
	tok  uint64
	slot uint32
}

func newShard(ladder []uint8) *shard {
	sh := &shard{
		idBits:    ladder[0],
		ladder:    ladder,
		chunks:    []*chunk{{used: 1}},
		kids:      make(map[uint64]uint32),
		kidsOver:  make(map[kidKey]uint32),
		slotOf:    make(map[Candidate]uint32),
		workers:   make(map[uint64]int),
		lowerRoot: make(map[uint64][]uint32),
		lowerRefs: make(map[rootRef]uint8),
	}
	sh.idle = sync.NewCond(&sh.mu)
	return sh
}

// apply applies one event with the write lock held (see Index.Apply).
func (sh *shard) apply(ev Event) error {
	c := ev.Candidate()
	if ev.Tier >= numTiers {
		sh.st.EventsInvalid++
		return fmt.Errorf("%v event %d: storage tier %d: %w", c, ev.EventID, uint8(ev.Tier), ErrInvalidEvent)
	}
	switch ev.Kind {
	case EventStored:
		if err := sh.checkStore(c, ev); err != nil {
			sh.st.StoresInvalidSequence++
			return err
		}
		var err error
		if ev.Tier == TierDevice {
			err = sh.storeDevice(c, ev)
		} else {
			err = sh.storeLower(c, ev)
		}
		if err != nil {
			sh.st.StoresParentNotFound++
			return err
		}
	case EventRemoved:
		if missing := sh.remove(c, ev.Tier, ev.BlockHashes); missing > 0 {
			sh.st.EventsApplied++
			sh.st.RemovalsBlockNotFound++
			sh.st.BlocksNotFound += uint64(missing)
			return fmt.Errorf("%v event %d: %d of %d removed %s block hashes unknown: %w",
				c, ev.EventID, missing, len(ev.BlockHashes), ev.Tier, ErrBlockNotFound)
		}
	case EventCleared:
		sh.st.EventsApplied++ // counted first: the clear is complete for lookups before its entries are gone
		if s, ok := sh.slotOf[c]; ok {
			sh.clear(s)
		}
		return nil
	default:
		sh.st.EventsInvalid++
		return fmt.Errorf("%v event %d: kind %d: %w", c, ev.EventID, uint8(ev.Kind), ErrInvalidEvent)
	}
	sh.st.EventsApplied++
	return nil
}

// yieldBlocks is how many blocks a write handles between yield points (interleave.go).
const yieldBlocks = 16

// checkStore rejects a store whose blocks repeat a hash or repeat the parent hash (§11.2 step 3).
func (sh *shard) checkStore(c Candidate, ev Event) error {
	blocks := ev.Blocks
	if ev.HasParent {
		for _, b := range blocks {
			if b.BlockHash == ev.ParentHash {
				return fmt.Errorf("%v event %d: block hash %d equals its parent hash: %w",
					c, ev.EventID, b.BlockHash, ErrInvalidBlockSequence)
			}
		}
	}
	if len(blocks) <= 8 {
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
	sh.dups.reset(len(blocks))
	for _, b := range blocks {
		if !sh.dups.add(b.BlockHash) {
			return fmt.Errorf("%v event %d: block hash %d appears twice in one store: %w",
				c, ev.EventID, b.BlockHash, ErrInvalidBlockSequence)
		}
	}
	return nil
}

// storeDevice applies a validated device-tier Stored event (§11.2): it walks from the parent
// along existing children, adding the candidate to stretches it does not hold yet (one holder
// insertion per stretch of a run, not per block), and creates the rest as new chains.
func (sh *shard) storeDevice(c Candidate, ev Event) error {
	s, ok := sh.slotOf[c]
	cur := rootID
	if ev.HasParent {
		found := false
		if ok {
			_, _, cur, found = sh.extFind(s, ev.ParentHash)
		}
		if !found {
			return fmt.Errorf("%v event %d: parent block hash %d: %w", c, ev.EventID, ev.ParentHash, ErrParentBlockNotFound)
		}
	}
	if len(ev.Blocks) == 0 {
		return nil
	}
	if !ok {
		s = sh.allocSlot(c)
	}
	blocks := ev.Blocks
	for i := 0; i < len(blocks); {
		if i > 0 {
			sh.yield() // the blocks so far are stored: a shorter event's state
		}
		x := sh.childOf(cur, blocks[i].TokensHash)
		if x == rootID {
			var m int
			cur, m = sh.storeChain(s, cur, blocks[i:])
			i += m
			continue
		}
		ci, ri := sh.locate(x)
		ch := sh.chunks[ci]
		r := &ch.runs[ri]
		o := uint16(x & chunkMask)
		if col, held := sh.extColumn(ch, r, s); held {
			// Already held: only the external hashes may change. Along the run (same holders)
			// each next block is the next id; a changed hash is rebound, which may drop the
			// candidate elsewhere and reshape runs, so the child is then looked up afresh.
			end := r.off + r.n
			for walked := 1; ; walked++ {
				cur = blockID(ci, o)
				if h := blocks[i].BlockHash; col.at(o) != h {
					sh.rebind(s, cur, h)
					i++
					break
				}
				if i++; i == len(blocks) || o+1 >= end || ch.keys[o+1] != blocks[i].TokensHash || walked == yieldBlocks {
					break
				}
				o++
			}
			continue
		}
		L := 1
		for end := r.off + r.n; i+L < len(blocks) && o+uint16(L) < end && ch.keys[o+uint16(L)] == blocks[i+L].TokensHash; L++ {
		}
		sh.exts = sh.exts[:0]
		for _, b := range blocks[i : i+L] {
			sh.exts = append(sh.exts, b.BlockHash)
		}
		ri = sh.isolate(ci, ri, o, L)
		sh.addHolder(ci, ri, s, sh.exts)
		sh.mergeAround(ci, ri)
		sh.st.TierEntries[TierDevice] += uint64(L)
		// The candidate holds none of these blocks yet, so binding their hashes can only drop
		// it from blocks outside the stretch, which keeps the stretch intact.
		for j := 0; j < L; j++ {
			if j%yieldBlocks == yieldBlocks-1 {
				sh.yield() // the candidate holds the stretch; its lookup entries follow
			}
			sh.bind(s, x+uint32(j), blocks[i+j].BlockHash)
		}
		cur = x + uint32(L-1)
		i += L
	}
	return nil
}

// storeChain creates new blocks below p for a prefix of blocks (as many as fit one free range),
// held by slot s, and returns the last new block and how many it created.
func (sh *shard) storeChain(s, p uint32, blocks []StoredBlock) (uint32, int) {
	a, m := sh.alloc(p, len(blocks))
	ci, o := a>>chunkBits, int(a&chunkMask)
	c := sh.chunks[ci]
	for j := 0; j < m; j++ {
		c.keys[o+j] = blocks[j].TokensHash
		c.ext1[o+j] = blocks[j].BlockHash
	}
	sh.linkChild(p, a, blocks[0].TokensHash)
	ri := sh.newRun(a, m, s, p)
	if a == p+1 && a&chunkMask != 0 {
		sh.tryMerge(ci, ri-1)
	} else if p != rootID {
		pci, pri := sh.locate(p)
		sh.hintKid(pci, pri)
	}
	sh.st.TierEntries[TierDevice] += uint64(m)
	for j := 0; j < m; j++ {
		if j%yieldBlocks == yieldBlocks-1 {
			sh.yield() // the candidate holds the new blocks; their lookup entries follow
		}
		sh.bind(s, a+uint32(j), blocks[j].BlockHash)
	}
	return a + uint32(m-1), m
}

// bind points slot s's lookup entry for ext at block x, which s now holds with that external
// hash. If ext named another block for s, s leaves that block: the engine reuses the id for a
// new block, so it no longer names the old one (§11.2 step 2 overwrites the mapping).
func (sh *shard) bind(s, x uint32, ext uint64) {
	h := extHash(ext)
	if b, i, y, ok := sh.extFindHash(s, ext, h); ok {
		b.setID(i, x|window(h, b.base, sh.idBits)<<sh.idBits)
		sh.dropHolder(s, y)
		return
	}
	sh.extInsertHash(s, h, x)
}

// rebind gives slot s, which holds block x, the external hash ext on it.
func (sh *shard) rebind(s, x uint32, ext uint64) {
	old, _ := sh.extOf(x, s)
	if old == ext {
		return
	}
	if b, i, _, ok := sh.extFind(s, old); ok {
		sh.extDelete(s, b, i)
	}
	sh.setExt(x, s, ext)
	if sh.onDrop != nil {
		sh.onDrop(sh.slots[s].cand, old)
	}
	sh.bind(s, x, ext)
}

// dropHolder removes slot s from block y (its lookup entry is already gone or re-pointed) and
// prunes y if it is left empty (§11.3).
func (sh *shard) dropHolder(s, y uint32) {
	ci, ri := sh.locate(y)
	ri = sh.isolate(ci, ri, uint16(y&chunkMask), 1)
	sh.removeHolder(ci, ri, s)
	sh.st.TierEntries[TierDevice]--
	if sh.chunks[ci].runs[ri].holder == noHolder {
		sh.prune(y)
		return
	}
	sh.mergeAround(ci, ri)
}

// dropHolderIDs removes slot s from the blocks ids (sorted in place), one holder removal per
// stretch of consecutive blocks of a run, and prunes what is left empty.
func (sh *shard) dropHolderIDs(s uint32, ids []uint32) {
	sortBlockIDs(ids)
	for i := 0; i < len(ids); {
		x := ids[i]
		ci, ri := sh.locate(x)
		r := &sh.chunks[ci].runs[ri]
		o := uint16(x & chunkMask)
		L := 1
		for end := r.off + r.n; i+L < len(ids) && ids[i+L] == x+uint32(L) && o+uint16(L) < end; L++ {
		}
		ri = sh.isolate(ci, ri, o, L)
		sh.removeHolder(ci, ri, s)
		sh.st.TierEntries[TierDevice] -= uint64(L)
		if sh.chunks[ci].runs[ri].holder == noHolder {
			sh.prune(x + uint32(L-1))
		} else {
			sh.mergeAround(ci, ri)
		}
		i += L
		sh.yield()
	}
}

// remove applies a Removed event for candidate c in tier t and returns the number of unknown hashes.
func (sh *shard) remove(c Candidate, t Tier, hashes []uint64) int {
	s, ok := sh.slotOf[c]
	if !ok {
		return len(hashes)
	}
	missing := 0
	if t == TierDevice {
		// The ids buffer is this removal's until it ends: other writes may run at its yields.
		ids := sh.ids[:0]
		sh.ids = nil
		for j, h := range hashes {
			if j%yieldBlocks == yieldBlocks-1 {
				sh.yield() // lookups see the tree as before the removal
			}
			b, i, x, ok := sh.extFind(s, h)
			if !ok {
				missing++
				continue
			}
			sh.extDelete(s, b, i)
			ids = append(ids, x)
			if sh.onDrop != nil {
				sh.onDrop(c, h)
			}
		}
		sh.dropHolderIDs(s, ids)
		sh.ids = ids[:0]
	} else {
		for j, h := range hashes {
			if j%yieldBlocks == yieldBlocks-1 {
				sh.yield()
			}
			if !sh.removeLower(s, t, h) {
				missing++
			}
		}
	}
	sh.releaseIfEmpty(s)
	return missing
}

// removeOne removes slot s's device entry with external hash ext and reports whether it existed.
// The caller releases the slot when it may have emptied.
func (sh *shard) removeOne(s uint32, ext uint64) bool {
	b, i, x, ok := sh.extFind(s, ext)
	if !ok {
		return false
	}
	sh.extDelete(s, b, i)
	sh.dropHolder(s, x)
	if sh.onDrop != nil {
		sh.onDrop(sh.slots[s].cand, ext)
	}
	return true
}

// clearSlot removes slot s from every tier and frees it (§11.4).
func (sh *shard) clearSlot(s uint32) {
	st := &sh.slots[s]
	ids := sh.ids[:0]
	sh.forEachExtEntry(s, func(id uint32) { ids = append(ids, id) })
	if sh.onDrop != nil {
		for _, id := range ids {
			ext, _ := sh.extOf(id, s)
			sh.onDrop(st.cand, ext)
		}
	}
	st.ext = extIndex{}
	sh.dropHolderIDs(s, ids)
	sh.ids = ids[:0]
	for t := TierHostPinned; t < numTiers; t++ {
		sh.dropLower(s, t)
	}
	sh.releaseIfEmpty(s)
}

// removeWorker clears every candidate of workerID (§11.4 remove_worker).
func (sh *shard) removeWorker(workerID uint64) {
	if sh.workers[workerID] == 0 {
		return
	}
	var cs []Candidate
	for c := range sh.slotOf {
		if c.WorkerID == workerID {
			cs = append(cs, c)
		}
	}
	if !sh.interleave {
		for _, c := range cs {
			sh.clearSlot(sh.slotOf[c])
		}
		return
	}
	// Every rank leaves at once; their entries are buried afterwards.
	dead := make([]deadSlot, len(cs))
	for i, c := range cs {
		dead[i] = sh.kill(sh.slotOf[c])
	}
	for _, d := range dead {
		sh.bury(d)
	}
}

// allocSlot assigns the lowest free slot number to c.
func (sh *shard) allocSlot(c Candidate) uint32 {
	var s uint32
	for w := 0; ; w++ {
		if w == len(sh.used) {
			sh.used = append(sh.used, 0)
		}
		if ^sh.used[w] != 0 {
			s = uint32(w*64 + bits.TrailingZeros64(^sh.used[w]))
			sh.used[w] |= 1 << (s & 63)
			break
		}
	}
	for int(s) >= len(sh.slots) {
		sh.slots = append(sh.slots, slotState{})
	}
	for len(sh.cands) < len(sh.used)*64 {
		sh.cands = append(sh.cands, Candidate{})
	}
	for len(sh.lowerBits) < len(sh.used) {
		sh.lowerBits = append(sh.lowerBits, 0)
	}
	sh.slots[s] = slotState{cand: c}
	sh.cands[s] = c
	sh.slotOf[c] = s
	sh.nwords = max(sh.nwords, int(s>>6)+1)
	sh.workers[c.WorkerID]++
	sh.st.Candidates++
	return s
}

// releaseIfEmpty frees slot s when the candidate has no entry in any tier.
func (sh *shard) releaseIfEmpty(s uint32) {
	st := &sh.slots[s]
	if st.ext.count > 0 || st.hasLower() || sh.used[s>>6]&(1<<(s&63)) == 0 || sh.isDead(s) {
		return
	}
	c := st.cand
	delete(sh.slotOf, c)
	sh.st.Candidates--
	sh.freeSlot(s)
	sh.leaveWorker(c.WorkerID)
}

// freeSlot returns slot s, left without entries, to the free slots.
func (sh *shard) freeSlot(s uint32) {
	sh.slots[s] = slotState{}
	sh.cands[s] = Candidate{}
	sh.used[s>>6] &^= 1 << (s & 63)
	for sh.nwords > 0 && sh.used[sh.nwords-1] == 0 {
		sh.nwords--
	}
	for len(sh.slots) > sh.nwords*64 {
		sh.slots = sh.slots[:len(sh.slots)-1]
	}
}

// leaveWorker records that a candidate of workerID left the shard; after its last one the
// worker's assignment is dropped.
func (sh *shard) leaveWorker(workerID uint64) {
	if sh.workers[workerID]--; sh.workers[workerID] == 0 {
		delete(sh.workers, workerID)
		if sh.unassign != nil {
			sh.unassign(workerID)
		}
	}
}

// stats returns the shard's counters with Entries filled in.
func (sh *shard) stats() Stats {
	s := sh.st
	s.TierEntries[TierDevice] -= sh.pendingDevice // entries of completed clears not yet removed
	s.Entries = s.TierEntries[TierDevice]
	return s
}
