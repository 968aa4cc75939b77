package kvindex

import "math/bits"

// extIndex is one candidate's device lookup, external hash → block id (§11.1 `lookup`). It
// stores no hashes: an entry is the block id plus an 8-bit fingerprint, and a candidate entry is
// confirmed by reading the candidate's external hash off the block (shard.extOf). The lookup is a
// bijection with the candidate's device entries, so the tree holds each external hash exactly
// once.
//
// Layout: extendible hashing. The top gd bits of the mixed hash pick a directory slot; each slot
// points to a bucket of at most extBucketMax entries stored densely (no empty slots, no
// tombstones: a deletion moves another entry into the hole), so memory follows the entry count
// with no load-factor sawtooth. Inside a bucket, entries are kept in extParts contiguous
// partitions by two more hash bits, so a lookup scans a quarter of the bucket. A full bucket splits in two on the next hash bit. An entry's id
// word carries, above the id, the next hash bits after its bucket's base depth (the split
// window), so splits need no external hash; when a bucket's depth outruns its window, its
// entries' external hashes are read back from the tree once to refill the windows. The window
// bits not yet used by splits also filter candidates, so a false match costs a tree read for
// about one find in ten even when windows are narrowest. The id width grows with the shard's id
// space (20, 27, then 32 bits), so small shards have wide windows.
//
// About 5.2 bytes per entry: 4 (id word) + 1 (fingerprint) + bucket and directory overhead.

const (
	extBucketMax = 256 // entries per bucket before it splits
	extGrow      = 8   // entries a bucket grows by (at least; see roundAlloc)
	extFPShift   = 16  // fingerprint = hash bits 16..23 (the directory and windows use the top bits)
	extParts     = 4   // partitions per bucket, by hash bits 24..25
	extPartShift = 24

	// A bucket's data is groups of 8 entries: two words holding the eight 8-bit fingerprints,
	// then the eight id words.
	extGroup      = 8
	extGroupWords = 10

	lanes8 = 0x0101010101010101
	high8  = 0x8080808080808080

	// extMinCheck is the number of window bits a bucket keeps unused by splits (as extra
	// fingerprint bits); it is refilled before a split would leave fewer.
	extMinCheck = 2
)

// extBucket is one bucket of size() entries; partition j holds entries bound(j) .. bound(j+1)−1.
type extBucket struct {
	data  []uint32
	p     [extParts + 1]uint16 // p[j] = bound(j): p[0] = 0, p[extParts] = the entry count
	depth uint8                // local depth: the top depth hash bits are the same for every entry
	base  uint8                // the windows hold hash bits base .. base+32−idBits−1 (from the top)
}

func extPart(h uint64) int { return int(h>>extPartShift) & (extParts - 1) }

// bound returns the first entry of partition j (j = extParts: the end).
func (b *extBucket) bound(j int) int { return int(b.p[j]) }

// size returns the number of entries.
func (b *extBucket) size() int { return int(b.p[extParts]) }

// move copies entry from to entry to.
func (b *extBucket) move(from, to int) {
	d := b.data
	fg, fk := from/extGroup*extGroupWords, from%extGroup
	tg, tk := to/extGroup*extGroupWords, to%extGroup
	d[tg+2+tk] = d[fg+2+fk]
	f := d[fg+fk/4] >> (fk % 4 * 8) & 0xff
	w := &d[tg+tk/4]
	sh := uint(tk%4) * 8
	*w = *w&^(0xff<<sh) | f<<sh
}

// extIndex is the directory of one candidate's buckets (empty until the first insert).
type extIndex struct {
	dir   []*extBucket
	gd    uint8
	count int
}

// extHash mixes an external hash (engine ids are often small or structured) into 64 uniform bits.
func extHash(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

func (x *extIndex) slot(h uint64) int {
	if x.gd == 0 {
		return 0
	}
	return int(h >> (64 - x.gd))
}

// window returns hash bits base .. base+wb−1 (from the top), wb = 32 − idBits.
func window(h uint64, base, idBits uint8) uint32 {
	wb := 32 - idBits
	if wb == 0 {
		return 0
	}
	return uint32((h << base) >> (64 - wb))
}

func (b *extBucket) cap() int { return len(b.data) / extGroupWords * extGroup }

func (b *extBucket) id(i int) uint32 { return b.data[i/extGroup*extGroupWords+2+i%extGroup] }

func (b *extBucket) setID(i int, v uint32) { b.data[i/extGroup*extGroupWords+2+i%extGroup] = v }

func (b *extBucket) fp(i int) uint8 {
	return uint8(b.data[i/extGroup*extGroupWords+i%extGroup/4] >> (i % 4 * 8))
}

func (b *extBucket) setFP(i int, f uint8) {
	w := &b.data[i/extGroup*extGroupWords+i%extGroup/4]
	sh := uint(i % 4 * 8)
	*w = *w&^(0xff<<sh) | uint32(f)<<sh
}

// sizeClasses are the Go allocator's small size classes (bytes); bucket arrays are sized to fill
// them, so the allocator's rounding becomes usable slack instead of hidden waste.
var sizeClasses = [...]int{16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256,
	288, 320, 352, 384, 416, 448, 480, 512, 576, 640, 704, 768, 896, 1024, 1152, 1280, 1408, 1536,
	1792, 2048}

// groupsFor returns how many entry groups to allocate for at least n entries.
func groupsFor(n int) int {
	g := (n + extGroup - 1) / extGroup
	bytes := g * extGroupWords * 4
	for _, c := range sizeClasses {
		if c >= bytes {
			return c / (extGroupWords * 4)
		}
	}
	return g
}

func (b *extBucket) resize(entries int) {
	data := make([]uint32, groupsFor(entries)*extGroupWords)
	copy(data, b.data[:min(len(b.data), (b.size()+extGroup-1)/extGroup*extGroupWords)])
	b.data = data
}

// add inserts an entry into partition j: the first entry of each later partition moves to that
// partition's end to make room.
func (b *extBucket) add(j int, idWord uint32, f uint8) {
	n := b.size()
	if n == b.cap() {
		// Small buckets double (few reallocations); large ones grow by extGrow (little slack).
		b.resize(n + max(extGrow, min(n, 64-n), n/8))
	}
	hole := n
	for k := extParts - 1; k > j; k-- {
		first := b.bound(k)
		if first != hole {
			b.move(first, hole)
		}
		hole = first
		b.p[k]++
	}
	b.setID(hole, idWord)
	b.setFP(hole, f)
	b.p[extParts]++
}

// remove deletes entry i of partition j (the partition's last entry takes its place, and each
// later partition's last entry fills the gap before it) and shrinks the data when more than
// 4·extGrow entries are unused.
func (b *extBucket) remove(j, i int) {
	hole := i
	for k := j; k < extParts; k++ {
		last := b.bound(k+1) - 1
		if last != hole {
			b.move(last, hole)
		}
		hole = last
		if k > j {
			b.p[k]--
		}
	}
	b.setID(hole, 0)
	b.setFP(hole, 0)
	b.p[extParts]--
	if b.cap()-b.size() > 4*extGrow {
		b.resize(b.size() + extGrow)
	}
}

// extFind returns the bucket and position of slot s's entry for ext and its block id.
func (sh *shard) extFind(s uint32, ext uint64) (b *extBucket, i int, id uint32, ok bool) {
	return sh.extFindHash(s, ext, extHash(ext))
}

// extFindHash is extFind for ext with extHash(ext) = h.
func (sh *shard) extFindHash(s uint32, ext, h uint64) (b *extBucket, i int, id uint32, ok bool) {
	x := &sh.slots[s].ext
	if x.count == 0 {
		return nil, 0, 0, false
	}
	b = x.dir[x.slot(h)]
	f := uint8(h >> extFPShift)
	mask := uint32(1)<<sh.idBits - 1
	win := window(h, b.base, sh.idBits)
	want := uint64(f) * lanes8
	j := extPart(h)
	lo, hi := b.bound(j), b.bound(j+1)
	for g, end := lo/extGroup, (hi+extGroup-1)/extGroup; ; g++ {
		var t uint64
		if g, t = fpScan(b.data, g, end, want); g == end {
			break
		}
		d := (*[extGroupWords]uint32)(b.data[g*extGroupWords:])
		v := (uint64(d[0]) | uint64(d[1])<<32) ^ want
		for ; t != 0; t &= t - 1 {
			k := bits.TrailingZeros64(t) / 8 & (extGroup - 1)
			if i := g*extGroup + k; i < lo || i >= hi || v>>(k*8)&0xff != 0 {
				continue
			}
			idw := d[2+k]
			if idw>>sh.idBits != win {
				continue
			}
			if e, held := sh.extOf(idw&mask, s); held && e == ext {
				return b, g*extGroup + k, idw & mask, true
			}
		}
	}
	return nil, 0, 0, false
}

// fpScan returns the first group from g on, below end, of bucket data whose fingerprints may
// include want's byte (want = fingerprint·lanes8), and the high bit of each byte that may match
// (a byte equal to the fingerprint always has it); g = end when no group does. It is a leaf, so
// its loop keeps everything in registers.
//
//go:noinline
func fpScan(data []uint32, g, end int, want uint64) (int, uint64) {
	for i := g * extGroupWords; g < end && i+1 < len(data); g, i = g+1, i+extGroupWords {
		fp := (*[2]uint32)(data[i : i+2])
		v := (uint64(fp[0]) | uint64(fp[1])<<32) ^ want
		if t := (v - lanes8) &^ v & high8; t != 0 {
			return g, t
		}
	}
	return end, 0
}

// extDelete removes slot s's entry (b, i).
func (sh *shard) extDelete(s uint32, b *extBucket, i int) {
	j := 0
	for i >= b.bound(j+1) {
		j++
	}
	b.remove(j, i)
	sh.slots[s].ext.count--
}

// extInsert adds slot s's entry ext → id; ext must not be present.
func (sh *shard) extInsert(s uint32, ext uint64, id uint32) { sh.extInsertHash(s, extHash(ext), id) }

// extInsertHash is extInsert for an external hash with extHash = h.
func (sh *shard) extInsertHash(s uint32, h uint64, id uint32) {
	x := &sh.slots[s].ext
	if x.dir == nil {
		x.dir = []*extBucket{{}}
	}
	for {
		ix := x.slot(h)
		b := x.dir[ix]
		if b.size() < extBucketMax {
			b.add(extPart(h), id|window(h, b.base, sh.idBits)<<sh.idBits, uint8(h>>extFPShift))
			x.count++
			return
		}
		sh.extSplit(s, ix)
	}
}

// extSplit splits the bucket at directory slot ix of slot s's index on hash bit b.depth.
func (sh *shard) extSplit(s uint32, ix int) {
	x := &sh.slots[s].ext
	b := x.dir[ix]
	d := b.depth
	wb := 32 - sh.idBits
	if wb > 0 && d+1-b.base > wb-min(wb, extMinCheck) {
		sh.extRefill(s, b)
	}
	n := b.size()
	// An entry goes to hi when hash bit d is set: bit wb−1−(d−base) of its split window, or,
	// without windows (32-bit ids), read back from the tree.
	var side [extBucketMax]bool
	bit := uint(sh.idBits) + uint(wb-1-(d-b.base))
	ones := 0
	if wb > 0 {
		for i := 0; i < n; i++ {
			ones += int(b.id(i) >> bit & 1)
		}
	} else {
		mask := uint32(1)<<sh.idBits - 1
		for i := 0; i < n; i++ {
			e, _ := sh.extOf(b.id(i)&mask, s)
			if side[i] = extHash(e)>>(63-d)&1 == 1; side[i] {
				ones++
			}
		}
	}
	lo := &extBucket{depth: d + 1, base: b.base}
	hi := &extBucket{depth: d + 1, base: b.base}
	lo.resize(n - ones + extGrow)
	hi.resize(ones + extGrow)
	for j := 0; j < extParts; j++ {
		// Entries arrive in partition order, so each is appended at its half's end.
		for i := b.bound(j); i < b.bound(j+1); i++ {
			idw := b.id(i)
			t := lo
			if wb > 0 && idw>>bit&1 == 1 || wb == 0 && side[i] {
				t = hi
			}
			k := t.size()
			t.setID(k, idw)
			t.setFP(k, b.fp(i))
			t.p[extParts]++
		}
		if j+1 < extParts {
			lo.p[j+1], hi.p[j+1] = lo.p[extParts], hi.p[extParts]
		}
	}
	if d == x.gd {
		dir := make([]*extBucket, 2*len(x.dir))
		for i, p := range x.dir {
			dir[2*i], dir[2*i+1] = p, p
		}
		x.dir = dir
		x.gd++
		ix *= 2
	}
	span := 1 << (x.gd - d)
	start := ix &^ (span - 1)
	for i := 0; i < span/2; i++ {
		x.dir[start+i] = lo
		x.dir[start+span/2+i] = hi
	}
}

// extRefill rewrites bucket b's split windows from the entries' external hashes (read from the
// tree), starting at the bucket's depth.
func (sh *shard) extRefill(s uint32, b *extBucket) {
	mask := uint32(1)<<sh.idBits - 1
	for i := 0; i < b.size(); i++ {
		idw := b.id(i)
		e, _ := sh.extOf(idw&mask, s)
		b.setID(i, idw&mask|window(extHash(e), b.depth, sh.idBits)<<sh.idBits)
	}
	b.base = b.depth
}

// forEachBucket calls f for every bucket of slot s's index.
func (sh *shard) forEachBucket(s uint32, f func(b *extBucket)) { sh.slots[s].ext.forEachBucket(f) }

// forEachBucket calls f for every bucket of the index.
func (x *extIndex) forEachBucket(f func(b *extBucket)) {
	for i := 0; i < len(x.dir); {
		b := x.dir[i]
		f(b)
		i += 1 << (x.gd - b.depth)
	}
}

// forEachExtEntry calls f with every block id of slot s's index.
func (sh *shard) forEachExtEntry(s uint32, f func(id uint32)) {
	mask := uint32(1)<<sh.idBits - 1
	sh.forEachBucket(s, func(b *extBucket) {
		for i := 0; i < b.size(); i++ {
			f(b.id(i) & mask)
		}
	})
}

// idLadder is the sequence of id widths a shard goes through as its id space grows.
var idLadder = []uint8{20, 27, 32}

// growIDSpace is called before chunk ci is created: when its ids no longer fit the id width,
// the width steps up the shard's ladder and every entry keeps only the first bits of its split
// window (a 32-bit width leaves none: splits then read external hashes back from the tree).
func (sh *shard) growIDSpace(ci uint32) {
	old := sh.idBits
	for _, w := range sh.ladder {
		if sh.idBits < 32 && blockID(ci, chunkMask)>>sh.idBits != 0 && w > sh.idBits {
			sh.idBits = w
		}
	}
	if sh.idBits == old {
		return
	}
	oldMask, drop := uint32(1)<<old-1, sh.idBits-old
	for s := range sh.slots {
		sh.forEachBucket(uint32(s), func(b *extBucket) {
			for i := 0; i < b.size(); i++ {
				idw := b.id(i)
				var win uint32
				if sh.idBits < 32 {
					win = idw >> old >> drop << sh.idBits
				}
				b.setID(i, idw&oldMask|win)
			}
		})
	}
}
