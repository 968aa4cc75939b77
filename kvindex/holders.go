package kvindex

import (
	"math/bits"
	"slices"
)

// Holder sets of runs. A run with no holder is a placeholder (noHolder); one holder is stored as
// its slot number; two or more live in a multi: a compressed bitset of slots (the nonzero 64-slot
// words and their word indices) plus the external hashes of every holder but the lowest, block
// by block. The lowest holder's external hashes are in the chunk's ext1 array, so a chain held by
// one worker needs no allocation beyond the arena.

const (
	noHolder uint32 = ^uint32(0)
	multiBit uint32 = 1 << 31
)

// multi is a run's holder set of two or more slots.
type multi struct {
	widx  []uint16 // word indices of the nonzero bitset words, ascending
	words []uint64 // the bitset words
	h     int      // number of holders (≥ 2)
	// exts[i·stride + r−1] is the external hash of the holder of rank r ≥ 1 (rank = position in
	// ascending slot order) on the run's block i; stride ≥ h−1, and the columns from h−1 on
	// are room for more holders, so a growing holder set is not copied on every addition.
	// Split runs may share one backing array; each cell belongs to one block.
	exts   []uint64
	stride int
}

// spareColumns is the room a multi keeps for more holders when its rows are widened: a
// quarter of the columns in use, so the copies of a growing set stay linear in its size.
func spareColumns(w int) int { return w / 4 }

func isMulti(h uint32) bool { return h&multiBit != 0 && h != noHolder }

func (sh *shard) multi(h uint32) *multi { return &sh.multis[h&^multiBit] }

func (sh *shard) newMulti(m multi) uint32 {
	if n := len(sh.freeMultis); n > 0 {
		i := sh.freeMultis[n-1]
		sh.freeMultis = sh.freeMultis[:n-1]
		sh.multis[i] = m
		return multiBit | i
	}
	sh.multis = append(sh.multis, m)
	return multiBit | uint32(len(sh.multis)-1)
}

func (sh *shard) freeMulti(h uint32) {
	i := h &^ multiBit
	sh.multis[i] = multi{}
	sh.freeMultis = append(sh.freeMultis, i)
}

// splitMulti gives the blocks from k on of multi h their own multi (same holders) and returns it.
func (sh *shard) splitMulti(h uint32, k int) uint32 {
	m := sh.multi(h)
	w := m.stride * k
	right := multi{widx: slices.Clone(m.widx), words: slices.Clone(m.words), h: m.h, stride: m.stride, exts: m.exts[w:]}
	m.exts = m.exts[:w:w]
	return sh.newMulti(right)
}

// word returns bitset word w of the set, and the position just after it in widx, scanning from j.
func (m *multi) word(w uint16, j int) (uint64, int) {
	for j < len(m.widx) && m.widx[j] < w {
		j++
	}
	if j < len(m.widx) && m.widx[j] == w {
		return m.words[j], j + 1
	}
	return 0, j
}

// rank returns the number of holders below slot s (its rank, or the rank it would get) and
// whether s is a holder.
func (m *multi) rank(s uint32) (int, bool) {
	w, bit := uint16(s>>6), uint64(1)<<(s&63)
	r := 0
	for j, wi := range m.widx {
		if wi < w {
			r += bits.OnesCount64(m.words[j])
			continue
		}
		if wi == w {
			return r + bits.OnesCount64(m.words[j]&(bit-1)), m.words[j]&bit != 0
		}
		return r, false
	}
	return r, false
}

// lowest returns the lowest holder.
func (m *multi) lowest() uint32 {
	return uint32(m.widx[0])<<6 | uint32(bits.TrailingZeros64(m.words[0]))
}

func (m *multi) set(s uint32) {
	w, bit := uint16(s>>6), uint64(1)<<(s&63)
	j, found := slices.BinarySearch(m.widx, w)
	if found {
		m.words[j] |= bit
		return
	}
	m.widx = slices.Insert(m.widx, j, w)
	m.words = slices.Insert(m.words, j, bit)
}

func (m *multi) unset(s uint32) {
	w, bit := uint16(s>>6), uint64(1)<<(s&63)
	j, found := slices.BinarySearch(m.widx, w)
	if !found {
		return
	}
	if m.words[j] &^= bit; m.words[j] == 0 {
		m.widx = slices.Delete(m.widx, j, j+1)
		m.words = slices.Delete(m.words, j, j+1)
	}
}

// hasHolder reports whether slot s is in holder set h.
func (sh *shard) hasHolder(h, s uint32) bool {
	switch {
	case h == noHolder:
		return false
	case !isMulti(h):
		return h == s
	}
	_, ok := sh.multi(h).rank(s)
	return ok
}

// holderCount returns the size of holder set h.
func (sh *shard) holderCount(h uint32) int {
	switch {
	case h == noHolder:
		return 0
	case !isMulti(h):
		return 1
	}
	return sh.multi(h).h
}

// sameHolders reports whether two holder sets are equal.
func (sh *shard) sameHolders(a, b uint32) bool {
	if !isMulti(a) || !isMulti(b) {
		return a == b
	}
	ma, mb := sh.multi(a), sh.multi(b)
	return ma.h == mb.h && slices.Equal(ma.widx, mb.widx) && slices.Equal(ma.words, mb.words)
}

// forEachHolder calls f for every slot of holder set h, ascending.
func (sh *shard) forEachHolder(h uint32, f func(s uint32)) {
	switch {
	case h == noHolder:
		return
	case !isMulti(h):
		f(h)
		return
	}
	m := sh.multi(h)
	for j, w := range m.widx {
		for v := m.words[j]; v != 0; v &= v - 1 {
			f(uint32(w)<<6 | uint32(bits.TrailingZeros64(v)))
		}
	}
}

// extAt returns slot s's external hash on the block at offset o of run r in chunk c.
func (sh *shard) extAt(c *chunk, r *run, o uint16, s uint32) (uint64, bool) {
	switch {
	case r.holder == noHolder:
		return 0, false
	case !isMulti(r.holder):
		if r.holder != s {
			return 0, false
		}
		return c.ext1[o], true
	}
	m := sh.multi(r.holder)
	k, ok := m.rank(s)
	if !ok {
		return 0, false
	}
	if k == 0 {
		return c.ext1[o], true
	}
	return m.exts[int(o-r.off)*m.stride+k-1], true
}

// extCol is one holder's column of external hashes along a run: at(o) is the hash on the block
// at offset o.
type extCol struct {
	a             []uint64
	start, stride int
}

func (e extCol) at(o uint16) uint64 { return e.a[e.start+int(o)*e.stride] }

// extColumn returns slot s's column of external hashes on run r of chunk c, and whether s holds
// the run.
func (sh *shard) extColumn(c *chunk, r *run, s uint32) (extCol, bool) {
	switch {
	case r.holder == noHolder:
		return extCol{}, false
	case !isMulti(r.holder):
		return extCol{a: c.ext1, stride: 1}, r.holder == s
	}
	m := sh.multi(r.holder)
	k, ok := m.rank(s)
	if !ok || k == 0 {
		return extCol{a: c.ext1, stride: 1}, ok
	}
	return extCol{a: m.exts, start: k - 1 - int(r.off)*m.stride, stride: m.stride}, true
}

// extOf returns slot s's external hash on block id.
func (sh *shard) extOf(id, s uint32) (uint64, bool) {
	ci, ri := sh.locate(id)
	if ri < 0 {
		return 0, false
	}
	c := sh.chunks[ci]
	return sh.extAt(c, &c.runs[ri], uint16(id&chunkMask), s)
}

// setExt replaces slot s's external hash on block id; s must hold it.
func (sh *shard) setExt(id, s uint32, ext uint64) {
	ci, ri := sh.locate(id)
	c := sh.chunks[ci]
	r := &c.runs[ri]
	o := uint16(id & chunkMask)
	if isMulti(r.holder) {
		m := sh.multi(r.holder)
		if k, _ := m.rank(s); k > 0 {
			m.exts[int(o-r.off)*m.stride+k-1] = ext
			return
		}
	}
	c.ext1[o] = ext
}

// addHolder adds slot s (not a holder) to every block of run ri of chunk ci, with external
// hashes exts (one per block, in order).
func (sh *shard) addHolder(ci uint32, ri int, s uint32, exts []uint64) {
	c := sh.chunks[ci]
	r := &c.runs[ri]
	n, base := int(r.n), int(r.off)
	ext1 := c.ext1[base : base+n]
	r.setMask(r.mask() | holderWord0(s))
	switch {
	case r.holder == noHolder:
		r.holder = s
		copy(ext1, exts)
	case !isMulti(r.holder):
		t := r.holder
		m := multi{h: 2, stride: 1, exts: make([]uint64, n)}
		m.set(t)
		m.set(s)
		if s < t {
			copy(m.exts, ext1)
			copy(ext1, exts)
		} else {
			copy(m.exts, exts)
		}
		r.holder = sh.newMulti(m)
	default:
		// The new holder's hash goes in at column col of each row (the old lowest holder's, when
		// the new one becomes the lowest): in place when the rows have a spare column, else
		// into rows widened with spare room.
		m := sh.multi(r.holder)
		k, _ := m.rank(s)
		w, col := m.h-1, max(k-1, 0)
		src, st := m.exts, m.stride
		dst, ds := src, st
		if st == w {
			ds = w + 1 + spareColumns(w+1)
			dst = make([]uint64, n*ds)
		}
		for i := 0; i < n; i++ {
			row, out := src[i*st:i*st+w], dst[i*ds:i*ds+w+1]
			v := exts[i]
			if k == 0 {
				v, ext1[i] = ext1[i], v
			}
			copy(out[col+1:], row[col:])
			copy(out[:col], row[:col])
			out[col] = v
		}
		m.exts, m.stride = dst, ds
		m.h++
		m.set(s)
	}
}

// removeHolder removes slot s (a holder) from every block of run ri of chunk ci.
func (sh *shard) removeHolder(ci uint32, ri int, s uint32) {
	c := sh.chunks[ci]
	r := &c.runs[ri]
	n, base := int(r.n), int(r.off)
	ext1 := c.ext1[base : base+n]
	r.setMask(r.mask() &^ holderWord0(s))
	if !isMulti(r.holder) {
		r.holder = noHolder
		return
	}
	m := sh.multi(r.holder)
	k, _ := m.rank(s)
	if m.h == 2 {
		if k == 0 {
			for i := range ext1 {
				ext1[i] = m.exts[i*m.stride]
			}
		}
		m.unset(s)
		other := m.lowest()
		sh.freeMulti(r.holder)
		r.holder = other
		return
	}
	// Column col leaves each row (column 0, the new lowest holder's, moves to ext1 when the
	// lowest leaves): in place, unless the rows would keep too much spare room.
	w, nw, col := m.h-1, m.h-2, max(k-1, 0)
	src, st := m.exts, m.stride
	dst, ds := src, st
	if st > nw+2*spareColumns(nw)+1 {
		ds = nw
		dst = make([]uint64, n*ds)
	}
	for i := 0; i < n; i++ {
		row, out := src[i*st:i*st+w], dst[i*ds:i*ds+nw]
		if k == 0 {
			ext1[i] = row[0]
		}
		copy(out[:col], row[:col])
		copy(out[col:], row[col+1:])
	}
	m.exts, m.stride = dst, ds
	m.h--
	m.unset(s)
}
