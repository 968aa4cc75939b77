package kvindex

import (
	"math/bits"
	"slices"
)

// findMatches appends the shard's matches for local (see Index.FindMatches). The walk compares
// keys block by block inside a run and intersects the candidate set only where a new run starts,
// so its cost is the matched depth plus the holders of the runs on the path (a word per 64 slots
// for sets of more than one holder), whatever the pool size. It stops as soon as no candidate
// is left (§11.5 early exit with early_exit = false).
func (sh *shard) findMatches(local []uint64, dst []Match) []Match {
	if len(local) == 0 {
		return dst
	}
	first := noHolder // holders of the first block: the candidates with Device ≥ 1
	if x := sh.kidGet(rootID, local[0]); x != rootID {
		dst, first = sh.walk(local, x, dst)
	}
	for _, s := range sh.lowerRoot[local[0]] {
		if sh.hasHolder(first, s) || sh.isDead(s) {
			continue
		}
		m := Match{Candidate: sh.slots[s].cand}
		sh.extend(&m, s, 0, true, local, 0)
		if m.Blocks() > 0 {
			dst = append(dst, m)
		}
	}
	return dst
}

// walk matches local from block x (the root child for local[0]) and returns the extended dst and
// the holder set of x. The candidate set is one bitset word for shards of at most 64 slots (the
// run's cached word 0 is its holder set, walkSmall) and a word per 64 slots otherwise.
func (sh *shard) walk(local []uint64, x uint32, dst []Match) ([]Match, uint32) {
	ci, ri := sh.locate(x)
	first := sh.chunks[ci].runs[ri].holder
	if first == noHolder {
		return dst, first // an empty placeholder: nobody matches below it
	}
	if sh.nwords <= 1 {
		return sh.walkSmall(local, ci, ri, dst), first
	}
	return sh.walkLarge(local, ci, ri, dst), first
}

// walkSmall is walk for shards of at most 64 slots, from run ri of chunk ci. Inside a run only
// keys are compared; at a run boundary the next run is the next id's (same chunk, no lookup) or
// a kids-map child, and the candidate set shrinks to the next run's cached word 0. The
// candidates that leave are only noted during the walk (each note removes at least one of the
// 64 slots, so at most 64 notes) and written out afterwards: the walk's few variables then stay
// in registers.
func (sh *shard) walkSmall(local []uint64, ci uint32, ri int, dst []Match) []Match {
	var left [64]leftSet
	nl := 0
	c := sh.chunks[ci]
	runs, keys := c.runs, c.keys
	r := &runs[ri]
	set := r.mask()
	if sh.ndead > 0 {
		set &^= sh.dead[0]
	}
	k := bits.OnesCount64(set) // every candidate leaves once, or stays to the end
	o, d := r.off, 1
	for set != 0 {
		end := r.off + r.n
		for d < len(local) && o+1 < end && keys[o+1] == local[d] {
			o++
			d++
		}
		if d == len(local) || o+1 < end {
			break // the query ends, or it leaves the run's chain mid-run (no branch there)
		}
		// The chain continues in the next id's run, or in a kids-map child (usually the run's
		// recorded kid, found without hashing).
		last := blockID(ci, o)
		nri := ri + 1
		if nri >= len(runs) || runs[nri].off != end || runs[nri].parent != last || keys[end] != local[d] {
			nci := ci
			if nci, nri = sh.kidRunOf(r, last, local[d]); nri < 0 {
				break
			}
			if nci != ci {
				ci = nci
				c := sh.chunks[ci]
				runs, keys = c.runs, c.keys
			}
		}
		r = &runs[nri]
		if keep := set & r.mask(); keep != set {
			left[nl&63] = leftSet{slots: set &^ keep, depth: uint32(d), last: last}
			nl++
			if set = keep; set == 0 {
				break
			}
		}
		ri, o = nri, r.off
		d++
	}
	if set != 0 {
		left[nl&63] = leftSet{slots: set, depth: uint32(d), last: blockID(ci, o)}
		nl++
	}
	return sh.emitLeft(dst, left[:nl], k, local)
}

// leftSet is a set of candidates (word 0 of a shard's slots) that matched depth device blocks,
// the last of which is block last.
type leftSet struct {
	slots uint64
	depth uint32
	last  uint32
}

// emitLeft appends the matches of the sets in left, k candidates in all (see emitSet).
func (sh *shard) emitLeft(dst []Match, left []leftSet, k int, local []uint64) []Match {
	i := len(dst)
	if cap(dst)-i < k {
		dst = slices.Grow(dst, k)
	}
	dst = dst[:i+k]
	out := dst[i:]
	cands := (*[64]Candidate)(sh.cands[:64]) // cands covers whole words of slots
	lower := sh.lowerBits[0]
	j := 0
	for li := range left {
		l := &left[li]
		for set := l.slots; set != 0; set &= set - 1 {
			b := bits.TrailingZeros64(set) & 63
			m := &out[j]
			j++
			*m = Match{Candidate: cands[b], Device: l.depth}
			if lower&(1<<b) != 0 {
				ext, _ := sh.extOf(l.last, uint32(b))
				sh.extend(m, uint32(b), ext, false, local, int(l.depth))
			}
		}
	}
	return dst
}

// walkLarge is walk for shards of more than 64 slots: the candidate set is a word per 64 slots,
// intersected with the next run's holder set where it changes.
func (sh *shard) walkLarge(local []uint64, ci uint32, ri int, dst []Match) []Match {
	c := sh.chunks[ci]
	r := &c.runs[ri]
	var stack [8]uint64
	var set []uint64 // candidates holding every block so far, one bit per slot
	if sh.nwords <= len(stack) {
		set = stack[:sh.nwords]
	} else {
		set = make([]uint64, sh.nwords)
	}
	sh.loadSet(set, r.holder)
	if sh.ndead > 0 && !sh.maskDead(set) {
		return dst
	}
	o, d := r.off, 1
	for {
		end := r.off + r.n
		keys := c.keys
		for d < len(local) && o+1 < end && keys[o+1] == local[d] {
			o++
			d++
		}
		if d == len(local) || o+1 < end {
			break
		}
		last := blockID(ci, o)
		nc, nci, nri := c, ci, ri+1
		if nri >= len(c.runs) || c.runs[nri].off != end || c.runs[nri].parent != last || keys[end] != local[d] {
			if r.kids == 0 {
				break
			}
			if nci, nri = sh.kidRun(r, local[d]); nri < 0 && (r.kids > 1 || r.kid == rootID) {
				if y := sh.kidGet(last, local[d]); y != rootID {
					nci, nri = sh.locate(y)
				}
			}
			if nri < 0 {
				break
			}
			nc = sh.chunks[nci]
		}
		nr := &nc.runs[nri]
		if nr.holder != r.holder {
			var alive bool
			if dst, alive = sh.intersect(dst, set, nr.holder, d, c, r, o, local); !alive {
				return dst
			}
		}
		ci, c, ri, r, o = nci, nc, nri, nr, nr.off
		d++
	}
	for w, v := range set {
		dst = sh.emitSet(dst, w, v, d, c, r, o, local)
	}
	return dst
}

// emitSet appends the matches of the slots in bitset word w of set (see fill). The matches are
// written field by field in place: building each on the stack and copying it stalls on store
// forwarding.
func (sh *shard) emitSet(dst []Match, w int, set uint64, d int, c *chunk, r *run, o uint16, local []uint64) []Match {
	if set == 0 {
		return dst
	}
	i, k := len(dst), bits.OnesCount64(set)
	if cap(dst)-i < k {
		dst = slices.Grow(dst, k)
	}
	dst = dst[:i+k]
	lower := sh.lowerBits[w]
	for ; set != 0; set &= set - 1 {
		b := bits.TrailingZeros64(set)
		m := &dst[i]
		i++
		m.Candidate = sh.cands[w<<6|b]
		m.Device = uint32(d)
		m.HostExt, m.DiskExt, m.ExternalExt = 0, 0, 0
		if lower&(1<<b) != 0 {
			ext, _ := sh.extAt(c, r, o, uint32(w<<6|b))
			sh.extend(m, uint32(w<<6|b), ext, false, local, d)
		}
	}
	return dst
}

// maskDead removes the dead slots from set and reports whether anyone is left.
func (sh *shard) maskDead(set []uint64) bool {
	any := uint64(0)
	for w := range set {
		if w < len(sh.dead) {
			set[w] &^= sh.dead[w]
		}
		any |= set[w]
	}
	return any != 0
}

// loadSet writes holder set h into set (one bit per slot).
func (sh *shard) loadSet(set []uint64, h uint32) {
	clear(set)
	switch {
	case h == noHolder:
	case !isMulti(h):
		set[h>>6] = 1 << (h & 63)
	default:
		m := sh.multi(h)
		for j, w := range m.widx {
			set[w] = m.words[j]
		}
	}
}

// intersect keeps in set only the holders of h, emitting the others with d device blocks (their
// last matched block is offset o of run r in chunk c). It reports whether anyone is left.
func (sh *shard) intersect(dst []Match, set []uint64, h uint32, d int, c *chunk, r *run, o uint16, local []uint64) ([]Match, bool) {
	var m *multi
	if isMulti(h) {
		m = sh.multi(h)
	}
	alive := false
	j := 0
	for w, v := range set {
		if v == 0 {
			continue
		}
		var keep uint64
		switch {
		case m != nil:
			keep, j = m.word(uint16(w), j)
		case h != noHolder && int(h>>6) == w:
			keep = 1 << (h & 63)
		}
		keep &= v
		dst = sh.emitSet(dst, w, v&^keep, d, c, r, o, local)
		set[w] = keep
		alive = alive || keep != 0
	}
	return dst, alive
}

// externalHashes returns slot s's external hashes on the first n blocks of local it holds
// consecutively from the root (see Index.ExternalHashes).
func (sh *shard) externalHashes(s uint32, local []uint64, n int) []uint64 {
	x := sh.kidGet(rootID, local[0])
	if x == rootID {
		return nil
	}
	ci, ri := sh.locate(x)
	c := sh.chunks[ci]
	r := &c.runs[ri]
	if !sh.hasHolder(r.holder, s) {
		return nil
	}
	out := make([]uint64, 0, n)
	o := r.off
	for {
		ext, _ := sh.extAt(c, r, o, s)
		out = append(out, ext)
		if len(out) == n {
			return out
		}
		d := len(out)
		if o+1 < r.off+r.n {
			if c.keys[o+1] != local[d] {
				return out
			}
			o++
			continue
		}
		y := sh.childOf(blockID(ci, o), local[d])
		if y == rootID {
			return out
		}
		ci, ri = sh.locate(y)
		c = sh.chunks[ci]
		r = &c.runs[ri]
		if !sh.hasHolder(r.holder, s) {
			return out
		}
		o = r.off
	}
}
