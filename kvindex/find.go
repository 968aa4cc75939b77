package kvindex

import "math/bits"

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
		if sh.hasHolder(first, s) {
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
// the holder set of x.
func (sh *shard) walk(local []uint64, x uint32, dst []Match) ([]Match, uint32) {
	ci, ri := sh.locate(x)
	c := sh.chunks[ci]
	r := &c.runs[ri]
	first := r.holder
	if first == noHolder {
		return dst, first // an empty placeholder: nobody matches below it
	}
	var stack [8]uint64
	var set []uint64 // candidates holding every block so far, one bit per slot
	if sh.nwords <= len(stack) {
		set = stack[:sh.nwords]
	} else {
		set = make([]uint64, sh.nwords)
	}
	sh.loadSet(set, r.holder)
	o, d := r.off, 1
	for {
		end := r.off + r.n
		keys := c.keys
		for d < len(local) && o+1 < end && keys[o+1] == local[d] {
			o++
			d++
		}
		if d == len(local) || o+1 < end {
			break // the query ends, or it leaves the run's chain mid-run (no branch there)
		}
		last := blockID(ci, o)
		nci, nri := ci, -1
		if ri+1 < len(c.runs) {
			if nr := &c.runs[ri+1]; nr.off == end && nr.parent == last && keys[end] == local[d] {
				nri = ri + 1
			}
		}
		if nri < 0 && r.kids > 0 {
			if y := sh.kidOf(r, last, local[d]); y != rootID {
				nci, nri = sh.locate(y)
			}
		}
		if nri < 0 {
			break
		}
		nc := sh.chunks[nci]
		nr := &nc.runs[nri]
		if nr.holder != r.holder {
			var alive bool
			if dst, alive = sh.intersect(dst, set, nr.holder, d, c, r, o, local); !alive {
				return dst, first
			}
		}
		ci, c, ri, r, o = nci, nc, nri, nr, nr.off
		d++
	}
	for w, v := range set {
		for ; v != 0; v &= v - 1 {
			dst = sh.emit(dst, uint32(w<<6|bits.TrailingZeros64(v)), d, c, r, o, local)
		}
	}
	return dst, first
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
		for drop := v &^ keep; drop != 0; drop &= drop - 1 {
			dst = sh.emit(dst, uint32(w<<6|bits.TrailingZeros64(drop)), d, c, r, o, local)
		}
		set[w] = keep
		alive = alive || keep != 0
	}
	return dst, alive
}

// emit appends slot s's match with d device blocks, the last one at offset o of run r in chunk c,
// extended through the lower tiers (§12.2) when the candidate has any.
func (sh *shard) emit(dst []Match, s uint32, d int, c *chunk, r *run, o uint16, local []uint64) []Match {
	st := &sh.slots[s]
	m := Match{Candidate: st.cand, Device: uint32(d)}
	if st.hasLower() {
		ext, _ := sh.extAt(c, r, o, s)
		sh.extend(&m, s, ext, false, local, d)
	}
	return append(dst, m)
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
