package kvindex

import (
	"math/bits"
	"slices"
)

// The device tree of one shard lives in an arena of dense uint32 block ids (kv-events-index.md
// §11.1 gives the logical shape; this is its storage). Id 0 is the root. Ids are grouped in
// chunks of chunkSize; per id the arena keeps only the block's tokens_hash (keys) and the
// external hash of the block's lowest-numbered holder (ext1) — 16 bytes. Everything else is
// kept per run.
//
// A run is a stretch of consecutive ids inside one chunk in which every block is the child of
// the previous one and all blocks have the same holder set. A chain stored by one worker
// therefore becomes one run: its parent links, holder set and bookkeeping cost nothing per block.
// Runs are split where holder sets diverge (a worker holds only part of a stretch) and at branch
// points: only the last block of a run may have children other than the next id, and those
// children are found through the shard's kids map. A run's first block is the child of
// run.parent; that link is "primary" (no kids entry) exactly when run.parent is the previous
// id of the same chunk.
//
// Ids not covered by any run are free. They are reused for new chains, preferring the id right
// after the parent (so a worker extending its chain extends its run), then chunks with freed
// space, then the arena's tail (one tail chunk for chains below the root, one for the rest).

const (
	chunkBits = 12
	chunkSize = 1 << chunkBits
	chunkMask = chunkSize - 1

	// firstChunkIDs is the initial id capacity of chunk 0 (it doubles up to chunkSize), so a
	// small index stays small.
	firstChunkIDs = 64
	// openFree is the number of free ids that puts a chunk (other than the last) on the list of
	// chunks new chains are allocated from.
	openFree = 64
	// minGap bounds how short a free range the allocator accepts for a chain that needs more
	// blocks, so chains are not shredded into tiny runs.
	minGap = 8

	rootID uint32 = 0
)

// run is one stretch of blocks (see above). holder encodes the holder set: noHolder (an empty
// placeholder kept for the blocks below it), a single slot number, or multiBit|i for a
// multi-holder set in shard.multis[i].
type run struct {
	off    uint16 // offset of the first block in its chunk
	n      uint16 // number of blocks, 1..chunkSize
	holder uint32
	parent uint32 // id of the first block's parent (rootID for a root child)
	kids   uint32 // kids-map children of the run's last block
	kid    uint32 // one of them (rootID when unknown): the usual continuation, found without hashing
	kidRI  uint16 // hint: kid's run index in its chunk, valid when that run starts at kid
	// mask0, mask1 hold word 0 (slots 0..63) of the holder set, for the lookup walk of small
	// shards (two halves keep the run at 28 bytes).
	mask0, mask1 uint32
}

func (r *run) mask() uint64 { return uint64(r.mask0) | uint64(r.mask1)<<32 }

func (r *run) setMask(m uint64) { r.mask0, r.mask1 = uint32(m), uint32(m>>32) }

// holderWord0 returns word 0 of a single-holder or empty holder set.
func holderWord0(h uint32) uint64 {
	if h < 64 {
		return 1 << h
	}
	return 0
}

// chunk holds chunkSize ids: their keys and first-holder external hashes (arrays grown as ids
// are used), and the runs covering them sorted by offset, indexed by a bitset of run starts with
// per-word prefix counts so the run of an id is found in constant time.
type chunk struct {
	keys   []uint64
	ext1   []uint64
	runs   []run
	starts [chunkSize / 64]startWord
	used   int  // ids covered by runs, plus the root in chunk 0
	open   bool // on shard.open
}

// startWord is one word of a chunk's run-start bitset (bit o%64: a run starts at offset o) with
// the number of run starts in the words below, side by side so a lookup reads one cache line.
type startWord struct {
	bits   uint64
	before uint16
}

// kidKey names a child through its parent id and its tokens_hash.
type kidKey struct {
	parent uint32
	key    uint64
}

// kidHash mixes a kidKey into the key of shard.kids. Distinct children colliding in 64 bits go
// to shard.kidsOver instead, so lookups stay exact.
func kidHash(parent uint32, key uint64) uint64 {
	return key ^ (uint64(parent)+1)*0x9e3779b97f4a7c15
}

// isKid reports whether block c (allocated) is the child of p with tokens_hash key.
func (sh *shard) isKid(c, p uint32, key uint64) bool {
	ci, ri := sh.locate(c)
	r := &sh.chunks[ci].runs[ri]
	return r.parent == p && blockID(ci, r.off) == c && sh.chunks[ci].keys[r.off] == key
}

// kidGet returns the kids-map child of p with tokens_hash key, or rootID.
func (sh *shard) kidGet(p uint32, key uint64) uint32 {
	if c := sh.kids[kidHash(p, key)]; c != rootID && sh.isKid(c, p, key) {
		return c
	}
	if len(sh.kidsOver) > 0 {
		return sh.kidsOver[kidKey{p, key}]
	}
	return rootID
}

// kidPut records child c of p with tokens_hash key (p has no child with that key).
func (sh *shard) kidPut(p uint32, key uint64, c uint32) {
	h := kidHash(p, key)
	if _, taken := sh.kids[h]; taken {
		sh.kidsOver[kidKey{p, key}] = c
		return
	}
	sh.kids[h] = c
}

// kidDel forgets child c of p with tokens_hash key.
func (sh *shard) kidDel(p uint32, key uint64, c uint32) {
	if h := kidHash(p, key); sh.kids[h] == c {
		delete(sh.kids, h)
		return
	}
	delete(sh.kidsOver, kidKey{p, key})
}

// forEachKid calls f for every kids-map entry.
func (sh *shard) forEachKid(f func(p uint32, key uint64, c uint32)) {
	for _, c := range sh.kids {
		ci, ri := sh.locate(c)
		r := &sh.chunks[ci].runs[ri]
		f(r.parent, sh.chunks[ci].keys[r.off], c)
	}
	for k, c := range sh.kidsOver {
		f(k.parent, k.key, c)
	}
}

func blockID(ci uint32, off uint16) uint32 { return ci<<chunkBits | uint32(off) }

// find returns the index of the run covering offset o, or -1 when o is free.
func (c *chunk) find(o uint16) int {
	sw := &c.starts[o>>6]
	i := int(sw.before) + bits.OnesCount64(sw.bits&(2<<(o&63)-1)) - 1
	if i < 0 || o >= c.runs[i].off+c.runs[i].n {
		return -1
	}
	return i
}

// markStart records (on) or forgets a run start at offset o.
func (c *chunk) markStart(o uint16, on bool) {
	w := o >> 6
	delta := uint16(1)
	if on {
		c.starts[w].bits |= 1 << (o & 63)
	} else {
		c.starts[w].bits &^= 1 << (o & 63)
		delta = ^uint16(0) // -1
	}
	for j := w + 1; j < chunkSize/64; j++ {
		c.starts[j].before += delta
	}
}

// insertRun inserts r at index i of c.runs, growing the slice by a quarter (not double) so run
// tables stay tight.
func (c *chunk) insertRun(i int, r run) {
	if len(c.runs) == cap(c.runs) {
		runs := make([]run, len(c.runs), len(c.runs)+max(4, len(c.runs)/4))
		copy(runs, c.runs)
		c.runs = runs
	}
	c.runs = slices.Insert(c.runs, i, r)
	c.markStart(r.off, true)
}

// deleteRun removes run i of c.
func (c *chunk) deleteRun(i int) {
	c.markStart(c.runs[i].off, false)
	c.runs = slices.Delete(c.runs, i, i+1)
	if cap(c.runs) > 8 && len(c.runs) < cap(c.runs)/2 {
		c.runs = slices.Clip(slices.Clone(c.runs))
	}
}

// locate returns the chunk and run index of block id, ri = -1 when the id is free (or the root).
func (sh *shard) locate(id uint32) (ci uint32, ri int) {
	ci = id >> chunkBits
	if int(ci) >= len(sh.chunks) {
		return ci, -1
	}
	return ci, sh.chunks[ci].find(uint16(id & chunkMask))
}

// primaryNext returns the index of the run in chunk c that starts right after run ri and whose
// first block is the child of run ri's last block, or -1.
func primaryNext(c *chunk, ci uint32, ri int) int {
	if ri+1 >= len(c.runs) {
		return -1
	}
	r, nr := &c.runs[ri], &c.runs[ri+1]
	end := r.off + r.n
	if nr.off == end && nr.parent == blockID(ci, end-1) {
		return ri + 1
	}
	return -1
}

// childOf returns x's child reached by tokens_hash key, or rootID when there is none.
func (sh *shard) childOf(x uint32, key uint64) uint32 {
	if x == rootID {
		return sh.kidGet(rootID, key)
	}
	ci, ri := sh.locate(x)
	c := sh.chunks[ci]
	r := &c.runs[ri]
	o := uint16(x & chunkMask)
	if o+1 < r.off+r.n {
		if c.keys[o+1] == key {
			return x + 1
		}
		return rootID // interior blocks have no other children
	}
	if nri := primaryNext(c, ci, ri); nri >= 0 && c.keys[o+1] == key {
		return x + 1
	}
	if r.kids > 0 {
		return sh.kidOf(r, x, key)
	}
	return rootID
}

// kidOf returns the kids-map child of block x (the last of run r, which has kids) with key.
func (sh *shard) kidOf(r *run, x uint32, key uint64) uint32 {
	if k := r.kid; k != rootID && sh.key(k) == key {
		return k
	}
	if r.kids == 1 && r.kid != rootID {
		return rootID
	}
	return sh.kidGet(x, key)
}

// kidRun returns the run of r's recorded kid when its tokens_hash is key (using the kidRI hint
// when it is still right), or ri = -1.
func (sh *shard) kidRun(r *run, key uint64) (ci uint32, ri int) {
	y := r.kid
	if y == rootID {
		return 0, -1
	}
	ci = y >> chunkBits
	c := sh.chunks[ci]
	o := uint16(y & chunkMask)
	if c.keys[o] != key {
		return 0, -1
	}
	if i := int(r.kidRI); i < len(c.runs) && c.runs[i].off == o {
		return ci, i
	}
	return ci, c.find(o)
}

// kidRunOf returns the run of the kids-map child of block last (the last block of run r) with
// tokens_hash key, or ri = -1 when there is none.
func (sh *shard) kidRunOf(r *run, last uint32, key uint64) (ci uint32, ri int) {
	if r.kids == 0 {
		return 0, -1
	}
	if ci, ri = sh.kidRun(r, key); ri < 0 && (r.kids > 1 || r.kid == rootID) {
		if y := sh.kidGet(last, key); y != rootID {
			ci, ri = sh.locate(y)
		}
	}
	return ci, ri
}

// hintKid points run ri's kidRI hint (chunk ci) at its kid's current run.
func (sh *shard) hintKid(ci uint32, ri int) {
	r := &sh.chunks[ci].runs[ri]
	if r.kid != rootID {
		_, kri := sh.locate(r.kid)
		r.kidRI = uint16(kri)
	}
}

// key returns block id's tokens_hash.
func (sh *shard) key(id uint32) uint64 { return sh.chunks[id>>chunkBits].keys[id&chunkMask] }

// parentOf returns the parent id of block x (covered by run ri of chunk ci).
func (sh *shard) parentOf(ci uint32, ri int, x uint32) uint32 {
	r := &sh.chunks[ci].runs[ri]
	if uint16(x&chunkMask) == r.off {
		return r.parent
	}
	return x - 1
}

// isPrimary reports whether the first block of run r (in chunk ci) is linked to its parent
// without a kids entry.
func isPrimary(ci uint32, r *run) bool {
	return r.off > 0 && r.parent != rootID && r.parent == blockID(ci, r.off-1)
}

// hasChildren reports whether the last block of run ri has any child.
func hasChildren(c *chunk, ci uint32, ri int) bool {
	return c.runs[ri].kids > 0 || primaryNext(c, ci, ri) >= 0
}

// ensureIDs grows the chunk's arrays (doubling, from firstChunkIDs) to cover offsets below end.
func (c *chunk) ensureIDs(end int) {
	if end <= len(c.keys) {
		return
	}
	n := max(len(c.keys), firstChunkIDs)
	for n < end {
		n *= 2
	}
	n = min(n, chunkSize)
	keys, ext1 := make([]uint64, n), make([]uint64, n)
	copy(keys, c.keys)
	copy(ext1, c.ext1)
	c.keys, c.ext1 = keys, ext1
}

// gapAt returns how many ids from offset o on are free (at most want); o must not be covered.
func (c *chunk) gapAt(o uint16, want int) int {
	if c.find(o) >= 0 {
		return 0
	}
	// The first run starting after o bounds the gap.
	i, _ := slices.BinarySearchFunc(c.runs, o, func(r run, o uint16) int { return int(r.off) - int(o) })
	limit := chunkSize
	if i < len(c.runs) {
		limit = int(c.runs[i].off)
	}
	return min(limit-int(o), want)
}

// firstGap returns the first free range of at least need ids (ci's root excluded), trimmed to
// want, or n = 0.
func (c *chunk) firstGap(ci uint32, need, want int) (o uint16, n int) {
	prev := 0
	if ci == 0 {
		prev = 1
	}
	for i := range c.runs {
		if g := int(c.runs[i].off) - prev; g >= need {
			return uint16(prev), min(g, want)
		}
		prev = int(c.runs[i].off + c.runs[i].n)
	}
	if g := chunkSize - prev; g >= need {
		return uint16(prev), min(g, want)
	}
	return 0, 0
}

// alloc reserves 1..want contiguous free ids inside one chunk for a new chain below parent and
// returns the first one. The caller covers them with a run at once (newRun).
func (sh *shard) alloc(parent uint32, want int) (uint32, int) {
	if parent != rootID && parent&chunkMask != chunkMask {
		ci := parent >> chunkBits
		c := sh.chunks[ci]
		if n := c.gapAt(uint16(parent&chunkMask)+1, want); n > 0 {
			c.ensureIDs(int(parent&chunkMask) + 1 + n)
			return parent + 1, n
		}
	}
	need := min(want, minGap)
	for len(sh.open) > 0 {
		ci := sh.open[len(sh.open)-1]
		c := sh.chunks[ci]
		if o, n := c.firstGap(ci, need, want); n > 0 {
			c.ensureIDs(int(o) + n)
			return blockID(ci, o), n
		}
		c.open = false
		sh.open = sh.open[:len(sh.open)-1]
	}
	// The arena's tail: new chains below the root (new prompts) and continuations below existing
	// blocks grow from separate tail chunks, so a continuation usually lands right after its
	// parent's last id and extends the parent's chain without a kids link.
	class := 0
	if parent != rootID {
		class = 1
	}
	ci := sh.tail[class]
	c := sh.chunks[ci]
	prev := 0
	if ci == 0 {
		prev = 1
	}
	if len(c.runs) > 0 {
		last := c.runs[len(c.runs)-1]
		prev = int(last.off + last.n)
	}
	if prev < chunkSize {
		n := min(chunkSize-prev, want)
		c.ensureIDs(prev + n)
		return blockID(ci, uint16(prev)), n
	}
	// A shard's ids are 32 bits: 2^32 blocks would need 64 GiB of keys alone, far beyond memory.
	ci = uint32(len(sh.chunks))
	sh.growIDSpace(ci)
	c = &chunk{}
	n := min(chunkSize, want)
	c.ensureIDs(n)
	sh.chunks = append(sh.chunks, c)
	sh.tail[class] = ci
	return blockID(ci, 0), n
}

// newRun covers ids [first, first+n) of one chunk with a run and returns its index.
func (sh *shard) newRun(first uint32, n int, holder, parent uint32) int {
	ci := first >> chunkBits
	c := sh.chunks[ci]
	r := run{off: uint16(first & chunkMask), n: uint16(n), holder: holder, parent: parent}
	r.setMask(holderWord0(holder))
	i := len(c.runs)
	if i > 0 && c.runs[i-1].off > r.off {
		i, _ = slices.BinarySearchFunc(c.runs, r.off, func(x run, o uint16) int { return int(x.off) - int(o) })
	}
	c.insertRun(i, r)
	c.used += n
	return i
}

// splitRun splits run ri of chunk ci after its first k blocks (0 < k < n); the second part
// becomes run ri+1 and keeps the kids of the last block.
func (sh *shard) splitRun(ci uint32, ri int, k uint16) {
	c := sh.chunks[ci]
	r := c.runs[ri]
	right := run{off: r.off + k, n: r.n - k, holder: r.holder, parent: blockID(ci, r.off+k-1), kids: r.kids, kid: r.kid, kidRI: r.kidRI, mask0: r.mask0, mask1: r.mask1}
	if isMulti(r.holder) {
		right.holder = sh.splitMulti(r.holder, int(k))
	}
	c.runs[ri].n = k
	c.runs[ri].kids, c.runs[ri].kid = 0, rootID
	c.insertRun(ri+1, right)
}

// isolate splits run ri of chunk ci so that the L blocks from offset o form one run, and returns
// that run's index.
func (sh *shard) isolate(ci uint32, ri int, o uint16, L int) int {
	c := sh.chunks[ci]
	if o > c.runs[ri].off {
		sh.splitRun(ci, ri, o-c.runs[ri].off)
		ri++
	}
	if uint16(L) < c.runs[ri].n {
		sh.splitRun(ci, ri, uint16(L))
	}
	return ri
}

// mergeLimit bounds the multi-holder external hashes a merge may copy; bigger runs stay split
// (they still match correctly, they only cost one more run entry).
const mergeLimit = 1 << 12

// tryMerge joins runs i and i+1 of chunk ci when the second continues the first's chain with
// the same holders and the first's last block has no other children. It reports whether it did.
func (sh *shard) tryMerge(ci uint32, i int) bool {
	c := sh.chunks[ci]
	if i < 0 || i+1 >= len(c.runs) {
		return false
	}
	a, b := &c.runs[i], &c.runs[i+1]
	if a.kids != 0 || b.off != a.off+a.n || b.parent != blockID(ci, b.off-1) || !sh.sameHolders(a.holder, b.holder) {
		return false
	}
	if isMulti(a.holder) {
		ma, mb := sh.multi(a.holder), sh.multi(b.holder)
		if len(ma.exts)+len(mb.exts) > mergeLimit {
			return false
		}
		if ma.stride == mb.stride {
			ma.exts = append(ma.exts[:len(ma.exts):len(ma.exts)], mb.exts...)
		} else {
			// Rows of different widths: lay both out at the wider one.
			st, w := max(ma.stride, mb.stride), ma.h-1
			exts := make([]uint64, int(a.n+b.n)*st)
			for i := 0; i < int(a.n); i++ {
				copy(exts[i*st:i*st+w], ma.exts[i*ma.stride:])
			}
			for i := 0; i < int(b.n); i++ {
				copy(exts[(int(a.n)+i)*st:(int(a.n)+i)*st+w], mb.exts[i*mb.stride:])
			}
			ma.exts, ma.stride = exts, st
		}
		sh.freeMulti(b.holder)
	}
	a.n += b.n
	a.kids, a.kid, a.kidRI = b.kids, b.kid, b.kidRI
	c.deleteRun(i + 1)
	return true
}

// mergeAround tries to merge run ri with its neighbours.
func (sh *shard) mergeAround(ci uint32, ri int) {
	sh.tryMerge(ci, ri)
	sh.tryMerge(ci, ri-1)
}

// makeRunEnd splits x's run after x so that x may get kids-map children; it returns x's run.
func (sh *shard) makeRunEnd(x uint32) (ci uint32, ri int) {
	ci, ri = sh.locate(x)
	r := &sh.chunks[ci].runs[ri]
	if o := uint16(x & chunkMask); o+1 < r.off+r.n {
		sh.splitRun(ci, ri, o+1-r.off)
	}
	return ci, ri
}

// linkChild records that the chain starting at id a (just covered by a run whose parent is p)
// hangs below p: nothing when a is p's next id (a primary link), else a kids entry.
func (sh *shard) linkChild(p, a uint32, key uint64) {
	if p != rootID && a == p+1 && a&chunkMask != 0 {
		return
	}
	sh.kidPut(p, key, a)
	if p != rootID {
		ci, ri := sh.makeRunEnd(p)
		r := &sh.chunks[ci].runs[ri]
		if r.kids++; r.kids == 1 {
			r.kid = a
		}
	}
}

// prune frees x, then its ancestors, while they hold no candidate and have no children (§11.3:
// an empty node with children stays as a placeholder, so its subtree matches nobody not on it).
func (sh *shard) prune(x uint32) {
	for x != rootID {
		ci, ri := sh.locate(x)
		c := sh.chunks[ci]
		r := &c.runs[ri]
		o := uint16(x & chunkMask)
		if r.holder != noHolder || o != r.off+r.n-1 || hasChildren(c, ci, ri) {
			return
		}
		p := x - 1
		if o == r.off {
			p = r.parent
			if !isPrimary(ci, r) {
				sh.kidDel(p, c.keys[o], x)
				if p != rootID {
					pci, pri := sh.locate(p)
					pr := &sh.chunks[pci].runs[pri]
					pr.kids--
					if pr.kid == x {
						pr.kid = rootID
					}
				}
			}
		}
		r.n--
		c.used--
		if r.n == 0 {
			c.deleteRun(ri)
		}
		if !c.open && ci != sh.tail[0] && ci != sh.tail[1] && chunkSize-c.used >= openFree {
			c.open = true
			sh.open = append(sh.open, ci)
		}
		x = p
	}
}
