package kvindex

import (
	"fmt"
	"math/bits"
	"slices"
)

// checkInvariants checks every shard (checkShard) and the worker assignment: each worker with
// candidates lives in exactly one shard, the one it is assigned to; every assignment names a
// shard holding the worker; the per-shard assignment counts and the open-shard prefix agree.
func checkInvariants(ix *Index) error {
	where := map[uint64]int{}
	for k, sh := range ix.shards {
		sh.mu.RLock()
		err := checkShard(sh)
		for w := range sh.workers {
			if prev, dup := where[w]; dup {
				err = fmt.Errorf("worker %d has candidates in shards %d and %d", w, prev, k)
			}
			where[w] = k
		}
		sh.mu.RUnlock()
		if err != nil {
			return fmt.Errorf("shard %d: %w", k, err)
		}
		if k >= int(ix.opened.Load()) && len(sh.workers) > 0 {
			return fmt.Errorf("shard %d beyond the %d open shards has workers", k, ix.opened.Load())
		}
	}
	counts := make([]int32, len(ix.shards))
	var err error
	ix.assign.Range(func(key, v any) bool {
		w, k := key.(uint64), v.(int32)
		counts[k]++
		if got, ok := where[w]; !ok || got != int(k) {
			err = fmt.Errorf("worker %d assigned to shard %d, has candidates in %d (%v)", w, k, got, ok)
		}
		return err == nil
	})
	if err != nil {
		return err
	}
	for w, k := range where {
		if v, ok := ix.assign.Load(w); !ok || v.(int32) != int32(k) {
			return fmt.Errorf("worker %d in shard %d is not assigned to it", w, k)
		}
	}
	for k := range counts {
		if got := ix.assigned[k].Load(); got != counts[k] {
			return fmt.Errorf("shard %d: assignment count %d, assignments %d", k, got, counts[k])
		}
	}
	return nil
}

// checkShard recounts one shard's structure and compares it with its counters:
//   - chunks: runs sorted, disjoint, inside the chunk, used counts;
//   - runs: holder sets well formed (multi: ascending nonzero words, h = popcount ≥ 2, one
//     external hash per block and extra holder), placeholders only above children;
//   - links: every run start is linked to an allocated parent exactly once (primary when it is
//     the parent's next id, else a kids entry), kids counts match, kids only below run ends,
//     child keys of a node distinct, every block reaches the root;
//   - lookups: a bijection between each slot's entries and the blocks holding the slot, every
//     entry in the bucket its hash selects, with its fingerprint and split window;
//   - slots, workers, lower stores and their root index, and every entry counter;
//   - no clear or paused write left behind (dead slots, pending entries, busy workers).
func checkShard(sh *shard) error {
	if sh.ndead != 0 || sh.pendingDevice != 0 || len(sh.busy) != 0 || sh.idleWaiters != 0 {
		return fmt.Errorf("at rest: %d dead slots, %d pending entries, busy %v, %d waiting writes", sh.ndead, sh.pendingDevice, sh.busy, sh.idleWaiters)
	}
	for _, w := range sh.dead {
		if w != 0 {
			return fmt.Errorf("dead slots %x at rest", sh.dead)
		}
	}
	pairs := make([]int, len(sh.slots))
	type runRef struct {
		ci uint32
		ri int
	}
	starts := map[uint32]runRef{}
	kidsMap := map[kidKey]uint32{}
	var dupKid error
	sh.forEachKid(func(p uint32, key uint64, c uint32) {
		if _, dup := kidsMap[kidKey{p, key}]; dup && dupKid == nil {
			dupKid = fmt.Errorf("two kids entries for %d below %d", key, p)
		}
		kidsMap[kidKey{p, key}] = c
	})
	if dupKid != nil {
		return dupKid
	}
	for k, over := range sh.kidsOver {
		if sh.kids[kidHash(k.parent, k.key)] == over {
			return fmt.Errorf("kids entry %v is in both maps", k)
		}
	}
	for ci, c := range sh.chunks {
		used := 0
		prevEnd := 0
		if ci == 0 {
			used, prevEnd = 1, 1
		}
		for ri, r := range c.runs {
			if r.n == 0 || int(r.off) < prevEnd || int(r.off+r.n) > chunkSize || int(r.off+r.n) > len(c.keys) {
				return fmt.Errorf("chunk %d run %d [%d,+%d) overlaps, is empty or leaves the chunk", ci, ri, r.off, r.n)
			}
			prevEnd = int(r.off + r.n)
			used += int(r.n)
			starts[blockID(uint32(ci), r.off)] = runRef{uint32(ci), ri}
			h := sh.holderCount(r.holder)
			switch {
			case r.holder == noHolder:
				if r.mask() != 0 {
					return fmt.Errorf("placeholder run %d has a cached word 0", blockID(uint32(ci), r.off))
				}
				if !hasChildren(c, uint32(ci), ri) {
					return fmt.Errorf("placeholder run at %d has no children", blockID(uint32(ci), r.off))
				}
			case !isMulti(r.holder):
				if err := sh.checkSlotUsed(r.holder); err != nil {
					return err
				}
				if r.mask() != holderWord0(r.holder) {
					return fmt.Errorf("run %d: cached word 0 %x for holder %d", blockID(uint32(ci), r.off), r.mask(), r.holder)
				}
			default:
				m := sh.multi(r.holder)
				ones := 0
				for j, w := range m.words {
					if w == 0 || (j > 0 && m.widx[j-1] >= m.widx[j]) {
						return fmt.Errorf("multi of run %d: zero or unordered word", blockID(uint32(ci), r.off))
					}
					ones += bits.OnesCount64(w)
				}
				if w0, _ := m.word(0, 0); w0 != r.mask() {
					return fmt.Errorf("run %d: cached word 0 %x, word 0 %x", blockID(uint32(ci), r.off), r.mask(), w0)
				}
				if ones != m.h || m.h < 2 || m.stride < m.h-1 || len(m.exts) != int(r.n)*m.stride || len(m.widx) != len(m.words) {
					return fmt.Errorf("multi of run %d: h %d, %d bits, stride %d, %d exts for %d blocks", blockID(uint32(ci), r.off), m.h, ones, m.stride, len(m.exts), r.n)
				}
			}
			var err error
			sh.forEachHolder(r.holder, func(s uint32) {
				if e := sh.checkSlotUsed(s); e != nil && err == nil {
					err = e
				}
				if int(s) < len(pairs) {
					pairs[s] += int(r.n)
				}
			})
			if err != nil {
				return err
			}
			_ = h
		}
		if used != c.used {
			return fmt.Errorf("chunk %d used %d, recount %d", ci, c.used, used)
		}
		var starts [chunkSize / 64]uint64
		for _, r := range c.runs {
			starts[r.off>>6] |= 1 << (r.off & 63)
		}
		n := uint16(0)
		for w := range starts {
			if starts[w] != c.starts[w].bits || c.starts[w].before != n {
				return fmt.Errorf("chunk %d: run-start index wrong at word %d", ci, w)
			}
			n += uint16(bits.OnesCount64(starts[w]))
		}
		for ri, r := range c.runs {
			for _, o := range []uint16{r.off, r.off + r.n - 1} {
				if got := c.find(o); got != ri {
					return fmt.Errorf("chunk %d: find(%d) = %d, want %d", ci, o, got, ri)
				}
			}
			if r.kid != rootID {
				last := blockID(uint32(ci), r.off+r.n-1)
				if r.kids == 0 || kidsMap[kidKey{last, sh.key(r.kid)}] != r.kid {
					return fmt.Errorf("run ending at %d names kid %d, which is not its child", last, r.kid)
				}
			}
		}
		if c.open != slices.Contains(sh.open, uint32(ci)) {
			return fmt.Errorf("chunk %d open flag %v disagrees with the open list", ci, c.open)
		}
	}
	// Links.
	kidCount := map[uint32]uint32{}
	for k, child := range kidsMap {
		ref, ok := starts[child]
		if !ok {
			return fmt.Errorf("kids entry %v → %d is not a run start", k, child)
		}
		r := &sh.chunks[ref.ci].runs[ref.ri]
		if r.parent != k.parent || sh.chunks[ref.ci].keys[r.off] != k.key || isPrimary(ref.ci, r) {
			return fmt.Errorf("kids entry %v → %d: run parent %d key %d primary %v", k, child, r.parent, sh.chunks[ref.ci].keys[r.off], isPrimary(ref.ci, r))
		}
		if k.parent != rootID {
			kidCount[k.parent]++
		}
	}
	for start, ref := range starts {
		c := sh.chunks[ref.ci]
		r := &c.runs[ref.ri]
		if r.parent == start {
			return fmt.Errorf("run %d is its own parent", start)
		}
		if isPrimary(ref.ci, r) {
			if ref.ri == 0 || c.runs[ref.ri-1].off+c.runs[ref.ri-1].n != r.off {
				return fmt.Errorf("run %d claims a primary parent %d that is not allocated", start, r.parent)
			}
			if _, dup := kidsMap[kidKey{r.parent, c.keys[r.off]}]; dup {
				return fmt.Errorf("run %d is the next id of %d and also has a kids entry", start, r.parent)
			}
		} else if kidsMap[kidKey{r.parent, c.keys[r.off]}] != start {
			return fmt.Errorf("run %d with parent %d has no kids entry", start, r.parent)
		}
		if r.parent != rootID {
			pci, pri := sh.locate(r.parent)
			if pri < 0 {
				return fmt.Errorf("run %d has a free parent %d", start, r.parent)
			}
			pr := &sh.chunks[pci].runs[pri]
			if !isPrimary(ref.ci, r) && r.parent != blockID(pci, pr.off+pr.n-1) {
				return fmt.Errorf("kids child %d hangs below %d, which is not the end of its run", start, r.parent)
			}
		}
		last := blockID(ref.ci, r.off+r.n-1)
		if r.kids != kidCount[last] {
			return fmt.Errorf("run ending at %d counts %d kids, the map has %d", last, r.kids, kidCount[last])
		}
		if nri := primaryNext(c, ref.ci, ref.ri); nri >= 0 {
			if _, dup := kidsMap[kidKey{last, c.keys[r.off+r.n]}]; dup {
				return fmt.Errorf("block %d has two children with key %d", last, c.keys[r.off+r.n])
			}
		}
	}
	for p := range kidCount {
		if _, ri := sh.locate(p); ri < 0 {
			return fmt.Errorf("kids entries below free block %d", p)
		}
	}
	reach := map[uint32]bool{}
	for start := range starts {
		var path []uint32
		for x := start; x != rootID; {
			ci, ri := sh.locate(x)
			if ri < 0 {
				return fmt.Errorf("block %d on the path of run %d to the root is free", x, start)
			}
			r := &sh.chunks[ci].runs[ri]
			s0 := blockID(ci, r.off)
			if reach[s0] {
				break
			}
			if path = append(path, s0); len(path) > len(starts) {
				return fmt.Errorf("run %d does not reach the root", start)
			}
			x = r.parent
		}
		for _, x := range path {
			reach[x] = true
		}
	}
	// Lookups and slots.
	var device uint64
	for c, s := range sh.slotOf {
		if int(s) >= len(sh.slots) || sh.slots[s].cand != c {
			return fmt.Errorf("slotOf[%v]=%d inconsistent", c, s)
		}
		if err := sh.checkSlotUsed(s); err != nil {
			return err
		}
		st := &sh.slots[s]
		if st.ext.count != pairs[s] {
			return fmt.Errorf("%v: %d lookup entries, holds %d blocks", c, st.ext.count, pairs[s])
		}
		if st.ext.count == 0 && !st.hasLower() {
			return fmt.Errorf("%v holds slot %d with no entries", c, s)
		}
		if sh.cands[s] != c || st.hasLower() != (sh.lowerBits[s>>6]&(1<<(s&63)) != 0) {
			return fmt.Errorf("%v: packed candidate %v, lower bit disagrees with stores %v", c, sh.cands[s], st.hasLower())
		}
		if err := sh.checkExtIndex(s); err != nil {
			return fmt.Errorf("%v: %w", c, err)
		}
		device += uint64(st.ext.count)
	}
	if device != sh.st.TierEntries[TierDevice] {
		return fmt.Errorf("device entries counter %d, recount %d", sh.st.TierEntries[TierDevice], device)
	}
	used, workers := 0, map[uint64]int{}
	for w, v := range sh.used {
		used += bits.OnesCount64(v)
		if v != 0 && w >= sh.nwords {
			return fmt.Errorf("used word %d beyond nwords %d", w, sh.nwords)
		}
	}
	for c := range sh.slotOf {
		workers[c.WorkerID]++
	}
	if used != len(sh.slotOf) || used != sh.st.Candidates {
		return fmt.Errorf("used slots %d, slotOf %d, Candidates %d", used, len(sh.slotOf), sh.st.Candidates)
	}
	if len(workers) != len(sh.workers) {
		return fmt.Errorf("workers map %v, recount %v", sh.workers, workers)
	}
	for w, n := range workers {
		if sh.workers[w] != n {
			return fmt.Errorf("workers map %v, recount %v", sh.workers, workers)
		}
	}
	return checkLower(sh)
}

func (sh *shard) checkSlotUsed(s uint32) error {
	if int(s>>6) >= len(sh.used) || sh.used[s>>6]&(1<<(s&63)) == 0 {
		return fmt.Errorf("slot %d is not allocated", s)
	}
	return nil
}

// checkExtIndex checks slot s's lookup: directory spans, bucket placement, fingerprints, split
// windows, and that every entry names a block the slot holds and is found again by its hash.
func (sh *shard) checkExtIndex(s uint32) error {
	x := &sh.slots[s].ext
	if x.dir == nil {
		if x.count != 0 {
			return fmt.Errorf("%d entries without a directory", x.count)
		}
		return nil
	}
	if len(x.dir) != 1<<x.gd {
		return fmt.Errorf("directory of %d slots at depth %d", len(x.dir), x.gd)
	}
	mask := uint32(1)<<sh.idBits - 1
	n := 0
	seen := map[uint32]bool{}
	for i := 0; i < len(x.dir); {
		b := x.dir[i]
		if b.depth > x.gd || b.base > b.depth {
			return fmt.Errorf("bucket depth %d base %d, directory depth %d", b.depth, b.base, x.gd)
		}
		span := 1 << (x.gd - b.depth)
		if i%span != 0 {
			return fmt.Errorf("bucket of depth %d at misaligned directory slot %d", b.depth, i)
		}
		for j := i; j < i+span; j++ {
			if x.dir[j] != b {
				return fmt.Errorf("directory slots %d..%d do not all point to one bucket", i, i+span-1)
			}
		}
		for j := 0; j < extParts; j++ {
			if b.bound(j) > b.bound(j+1) {
				return fmt.Errorf("bucket partitions out of order: %v", b.p)
			}
		}
		if b.size() > extBucketMax || b.p[0] != 0 || b.size() > b.cap() || len(b.data)%extGroupWords != 0 {
			return fmt.Errorf("bucket of %d entries, %d words, first bound %d", b.size(), len(b.data), b.p[0])
		}
		for k := 0; k < b.size(); k++ {
			idw := b.id(k)
			id := idw & mask
			if seen[id] {
				return fmt.Errorf("block %d has two entries", id)
			}
			seen[id] = true
			ext, ok := sh.extOf(id, s)
			if !ok {
				return fmt.Errorf("entry for block %d, which the slot does not hold", id)
			}
			h := extHash(ext)
			if x.dir[x.slot(h)] != b {
				return fmt.Errorf("external hash %d sits in the wrong bucket", ext)
			}
			if k < b.bound(extPart(h)) || k >= b.bound(extPart(h)+1) {
				return fmt.Errorf("external hash %d sits in the wrong partition", ext)
			}
			if b.fp(k) != uint8(h>>extFPShift) {
				return fmt.Errorf("external hash %d has a wrong fingerprint", ext)
			}
			if sh.idBits < 32 && idw>>sh.idBits != window(h, b.base, sh.idBits) {
				return fmt.Errorf("external hash %d has a wrong split window", ext)
			}
			if _, _, got, ok := sh.extFind(s, ext); !ok || got != id {
				return fmt.Errorf("external hash %d is not found again (%v, %d, want %d)", ext, ok, got, id)
			}
		}
		for k := b.size(); k < b.cap(); k++ {
			if b.fp(k) != 0 || b.id(k) != 0 {
				return fmt.Errorf("unused entry %d is not zero", k)
			}
		}
		n += b.size()
		i += span
	}
	if n != x.count {
		return fmt.Errorf("count %d, buckets hold %d", x.count, n)
	}
	return nil
}

// checkLower checks the lower-tier stores: inverse maps, entry counters, and the root index.
func checkLower(sh *shard) error {
	var lower [numTiers]uint64
	refs := map[rootRef]uint8{}
	for c, s := range sh.slotOf {
		for t, ls := range sh.slots[s].lower {
			if ls == nil {
				continue
			}
			if len(ls.rev) == 0 || len(ls.rev) != len(ls.edges) {
				return fmt.Errorf("%v tier %d: %d edges, %d reverse entries", c, t+1, len(ls.edges), len(ls.rev))
			}
			for k, x := range ls.edges {
				if ls.rev[x] != k {
					return fmt.Errorf("%v tier %d: reverse map disagrees for %d", c, t+1, x)
				}
				if k.root {
					refs[rootRef{k.tok, s}]++
				}
			}
			lower[t+1] += uint64(len(ls.rev))
		}
	}
	for t := TierHostPinned; t < numTiers; t++ {
		if lower[t] != sh.st.TierEntries[t] {
			return fmt.Errorf("%s entries counter %d, recount %d", t, sh.st.TierEntries[t], lower[t])
		}
	}
	if len(refs) != len(sh.lowerRefs) {
		return fmt.Errorf("root refs %v, recount %v", sh.lowerRefs, refs)
	}
	n := 0
	for r, k := range refs {
		if sh.lowerRefs[r] != k {
			return fmt.Errorf("root refs %v, recount %v", sh.lowerRefs, refs)
		}
		if _, ok := slices.BinarySearch(sh.lowerRoot[r.tok], r.slot); !ok {
			return fmt.Errorf("slot %d with a root edge %d is missing from the root index", r.slot, r.tok)
		}
	}
	for tok, l := range sh.lowerRoot {
		if len(l) == 0 || !slices.IsSorted(l) {
			return fmt.Errorf("root index for %d: %v", tok, l)
		}
		n += len(l)
	}
	if n != len(refs) {
		return fmt.Errorf("root index lists %d slots, %d (token, slot) refs", n, len(refs))
	}
	return nil
}

// blockCount returns the number of allocated blocks of all shards.
func blockCount(ix *Index) int {
	n := 0
	for _, sh := range ix.shards {
		sh.mu.RLock()
		for _, c := range sh.chunks {
			for _, r := range c.runs {
				n += int(r.n)
			}
		}
		sh.mu.RUnlock()
	}
	return n
}

// childKeys returns the tokens_hash keys of the children of the node at path (local hashes from
// the root) over all shards, ascending and without repeats.
func childKeys(ix *Index, path []uint64) []uint64 {
	var keys []uint64
	for _, sh := range ix.shards {
		sh.mu.RLock()
		x := rootID
		ok := true
		for _, k := range path {
			if x = sh.childOf(x, k); x == rootID {
				ok = false
				break
			}
		}
		if ok {
			ref := dumpRef{ri: -1, id: x}
			if x != rootID {
				_, ri := sh.locate(x)
				ref.ri = int32(ri)
			}
			for _, c := range sh.appendChildren(nil, ref, sh.sortedKids()) {
				keys = append(keys, c.key)
			}
		}
		sh.mu.RUnlock()
	}
	slices.Sort(keys)
	return slices.Compact(keys)
}
