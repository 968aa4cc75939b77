package tokenizer

import (
	"hash/maphash"
	"slices"
	"strings"
	"sync/atomic"
)

// bpeModel is the BPE model of tokenizer.json: byte-level (tokenizer.md "Byte-level BPE", step
// 6) or, with chars set, SentencePiece-style.
type bpeModel struct {
	vocab map[string]uint32 // vocabulary spelling → id
	// byteIDs[b] is the id of the single-character token for byte b, or -1 when the vocabulary
	// lacks it (then unk applies).
	byteIDs [256]int64
	// merges maps (left id << 32 | right id) → (rank << 32 | merged id).
	merges       map[uint64]uint64
	unkID        int64 // -1 when the model has no unk token
	fuseUnk      bool
	ignoreMerges bool
	// chars is set for SentencePiece-style models, whose symbols are characters (not byte-level
	// runes) with optional byte fallback; nil for byte-level BPE.
	chars *charSymbols
}

// heapThreshold is the symbol count above which merging switches from the quadratic scan to
// the priority queue (same result, bounded cost on long pieces such as runs of one character).
const heapThreshold = 96

func (m *bpeModel) mergeOf(left, right uint32) (rank, id uint32, ok bool) {
	v, ok := m.merges[uint64(left)<<32|uint64(right)]
	return uint32(v >> 32), uint32(v), ok
}

// encodeWord appends the BPE ids of one pre-tokenized piece (raw bytes, before byte-level
// mapping) to dst.
func (m *bpeModel) encodeWord(word string, dst []uint32) []uint32 {
	if len(word) == 0 {
		return dst
	}
	if m.ignoreMerges {
		if id, ok := m.vocab[byteLevelString(word)]; ok {
			return append(dst, id)
		}
	}
	syms := make([]uint32, 0, len(word))
	prevUnk := false
	for i := 0; i < len(word); i++ {
		id := m.byteIDs[word[i]]
		if id < 0 {
			if m.unkID < 0 {
				continue // Hugging Face drops characters it cannot represent without unk
			}
			if m.fuseUnk && prevUnk {
				continue
			}
			prevUnk = true
			syms = append(syms, uint32(m.unkID))
			continue
		}
		prevUnk = false
		syms = append(syms, uint32(id))
	}
	if len(syms) > heapThreshold {
		return append(dst, m.mergeHeap(syms)...)
	}
	return append(dst, m.mergeScan(syms)...)
}

// mergeScan applies merges lowest rank first, ties by leftmost position, by rescanning a rank
// array after every merge. Quadratic in comparisons but linear in map look-ups; fastest for the
// short pieces that dominate real text.
func (m *bpeModel) mergeScan(syms []uint32) []uint32 {
	if len(syms) < 2 {
		return syms
	}
	const none = ^uint64(0)
	var stack [heapThreshold]uint64
	ranks := stack[:len(syms)-1]
	for i := range ranks {
		ranks[i] = none
		if r, id, ok := m.mergeOf(syms[i], syms[i+1]); ok {
			ranks[i] = uint64(r)<<32 | uint64(id)
		}
	}
	for len(ranks) > 0 {
		best := 0
		for i := 1; i < len(ranks); i++ {
			if ranks[i] < ranks[best] { // strict: ties keep the leftmost
				best = i
			}
		}
		if ranks[best] == none {
			break
		}
		syms[best] = uint32(ranks[best])
		copy(syms[best+1:], syms[best+2:])
		syms = syms[:len(syms)-1]
		copy(ranks[best:], ranks[best+1:])
		ranks = ranks[:len(ranks)-1]
		if best > 0 {
			ranks[best-1] = none
			if r, id, ok := m.mergeOf(syms[best-1], syms[best]); ok {
				ranks[best-1] = uint64(r)<<32 | uint64(id)
			}
		}
		if best < len(ranks) {
			ranks[best] = none
			if r, id, ok := m.mergeOf(syms[best], syms[best+1]); ok {
				ranks[best] = uint64(r)<<32 | uint64(id)
			}
		}
	}
	return syms
}

type mergeItem struct {
	rank  uint32
	pos   int32
	newID uint32
}

func (a mergeItem) less(b mergeItem) bool {
	return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos)
}

type mergeHeap []mergeItem

func (h *mergeHeap) push(it mergeItem) {
	*h = append(*h, it)
	s := *h
	i := len(s) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !s[i].less(s[p]) {
			break
		}
		s[i], s[p] = s[p], s[i]
		i = p
	}
}

func (h *mergeHeap) pop() mergeItem {
	s := *h
	top := s[0]
	n := len(s) - 1
	s[0] = s[n]
	s = s[:n]
	i := 0
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		c := l
		if r := l + 1; r < n && s[r].less(s[l]) {
			c = r
		}
		if !s[c].less(s[i]) {
			break
		}
		s[i], s[c] = s[c], s[i]
		i = c
	}
	*h = s
	return top
}

// mergeHeap is the Hugging Face algorithm (Word::merge_all): a priority queue of candidate
// merges ordered by (rank, position), skipping entries made stale by earlier merges.
func (m *bpeModel) mergeHeap(syms []uint32) []uint32 {
	n := len(syms)
	prev := make([]int32, n)
	next := make([]int32, n)
	alive := make([]bool, n)
	for i := range syms {
		prev[i] = int32(i - 1)
		next[i] = int32(i + 1)
		alive[i] = true
	}
	next[n-1] = -1
	h := make(mergeHeap, 0, n)
	for i := 0; i+1 < n; i++ {
		if r, id, ok := m.mergeOf(syms[i], syms[i+1]); ok {
			h.push(mergeItem{rank: r, pos: int32(i), newID: id})
		}
	}
	for len(h) > 0 {
		top := h.pop()
		p := top.pos
		if !alive[p] || next[p] < 0 {
			continue
		}
		q := next[p]
		if _, id, ok := m.mergeOf(syms[p], syms[q]); !ok || id != top.newID {
			continue // stale entry
		}
		syms[p] = top.newID
		alive[q] = false
		next[p] = next[q]
		if next[q] >= 0 {
			prev[next[q]] = p
		}
		if pp := prev[p]; pp >= 0 {
			if r, id, ok := m.mergeOf(syms[pp], syms[p]); ok {
				h.push(mergeItem{rank: r, pos: pp, newID: id})
			}
		}
		if nn := next[p]; nn >= 0 {
			if r, id, ok := m.mergeOf(syms[p], syms[nn]); ok {
				h.push(mergeItem{rank: r, pos: p, newID: id})
			}
		}
	}
	out := syms[:0]
	for i := 0; i >= 0 && i < n; i = int(next[i]) {
		out = append(out, syms[i])
	}
	return out
}

// pieceCache is a bounded, concurrency-safe map from a pre-tokenized piece (raw bytes) to its
// BPE ids (tokenizer.md step 8). Lookups take no lock: it is a table of pieceSlots atomic
// pointers to immutable entries, the piece's hash choosing two neighbouring slots; an insert
// stores into an empty one of them or replaces one. Memory stays bounded at pieceSlots pieces
// of at most maxCachedPiece bytes.
type pieceCache struct {
	seed  maphash.Seed
	key   uint64 // per-process key of the inline hash
	slots []atomic.Pointer[pieceEntry]
}

// pieceEntry is one cached piece; never modified once stored. A piece of up to shortPiece bytes
// — nearly every word of real text — is identified by its length and two words (pieceWords), and
// ids of up to len(inl) tokens are kept inside the entry: a look-up reads one object and compares
// three integers instead of chasing pointers to the piece and to the ids (on a busy machine each
// of those is a cache miss) and comparing bytes, for every word of a prompt.
type pieceEntry struct {
	ids    []uint32 // inl[:k] when the ids fit there
	piece  string   // set only for pieces longer than shortPiece
	wa, wb uint64   // pieceWords of a short piece
	n      uint8    // len of a short piece; 0 for a long one
	inl    [4]uint32
}

// shortPiece is the longest piece pieceWords identifies, bytes.
const shortPiece = 16

// pieceWords returns two words that, with its length, identify a piece s of 1 to shortPiece
// bytes: loads that together cover every byte of s (overlapping when len(s) is not 4 or 8).
func pieceWords(s string) (a, b uint64) {
	switch n := len(s); {
	case n >= 8:
		return load64(s, 0), load64(s, n-8)
	case n >= 4:
		return uint64(load32(s, 0)), uint64(load32(s, n-4))
	case n > 0:
		return uint64(s[0])<<16 | uint64(s[n>>1])<<8 | uint64(s[n-1]), 0
	}
	return 0, 0
}

// newPieceEntry returns the entry for piece s (not empty) and its ids, both copied (detached from
// the caller's possibly large text and reused id buffer).
func newPieceEntry(s string, ids []uint32) *pieceEntry {
	e := &pieceEntry{}
	if len(s) <= shortPiece {
		e.n = uint8(len(s))
		e.wa, e.wb = pieceWords(s)
	} else {
		e.piece = strings.Clone(s)
	}
	if len(ids) <= len(e.inl) {
		k := copy(e.inl[:], ids)
		e.ids = e.inl[:k:k]
	} else {
		e.ids = slices.Clone(ids)
	}
	return e
}

const (
	pieceSlots     = 1 << 17 // power of two
	maxCachedPiece = 256
)

func newPieceCache() *pieceCache {
	seed := maphash.MakeSeed()
	return &pieceCache{seed: seed, key: maphash.String(seed, "piece"), slots: make([]atomic.Pointer[pieceEntry], pieceSlots)}
}

// hash hashes a piece: pieces are mostly words of up to shortPiece bytes, hashed inline from
// their pieceWords, which costs a fraction of a maphash call; longer ones go through maphash.
func (c *pieceCache) hash(s string) uint64 {
	if len(s) > shortPiece {
		return maphash.String(c.seed, s)
	}
	a, b := pieceWords(s)
	return c.mix(a, b, len(s))
}

// mix is the inline hash of a short piece of n bytes with pieceWords a, b.
func (c *pieceCache) mix(a, b uint64, n int) uint64 {
	h := (a^c.key)*0x9E3779B97F4A7C15 ^ (b+uint64(n))*0xC2B2AE3D27D4EB4F
	return h ^ h>>29
}

func load64(s string, i int) uint64 {
	return uint64(s[i]) | uint64(s[i+1])<<8 | uint64(s[i+2])<<16 | uint64(s[i+3])<<24 |
		uint64(s[i+4])<<32 | uint64(s[i+5])<<40 | uint64(s[i+6])<<48 | uint64(s[i+7])<<56
}

func load32(s string, i int) uint32 {
	return uint32(s[i]) | uint32(s[i+1])<<8 | uint32(s[i+2])<<16 | uint32(s[i+3])<<24
}

// get returns the cached ids of piece s (read-only).
func (c *pieceCache) get(s string) ([]uint32, bool) {
	n := len(s)
	if n > shortPiece {
		i := maphash.String(c.seed, s) & (pieceSlots - 1)
		if e := c.slots[i].Load(); e != nil && e.n == 0 && e.piece == s {
			return e.ids, true
		}
		if e := c.slots[i^1].Load(); e != nil && e.n == 0 && e.piece == s {
			return e.ids, true
		}
		return nil, false
	}
	if n == 0 {
		return nil, false
	}
	a, b := pieceWords(s)
	i := c.mix(a, b, n) & (pieceSlots - 1)
	if e := c.slots[i].Load(); e != nil && e.wa == a && e.wb == b && int(e.n) == n {
		return e.ids, true
	}
	if e := c.slots[i^1].Load(); e != nil && e.wa == a && e.wb == b && int(e.n) == n {
		return e.ids, true
	}
	return nil, false
}

// put caches ids for piece s (both copied); pieces over maxCachedPiece bytes are not kept.
func (c *pieceCache) put(s string, ids []uint32) {
	if len(s) > maxCachedPiece {
		return
	}
	h := c.hash(s)
	i := h & (pieceSlots - 1)
	e := newPieceEntry(s, ids)
	switch {
	case c.slots[i].Load() == nil:
	case c.slots[i^1].Load() == nil:
		i ^= 1
	default:
		i ^= (h >> 32) & 1 // both taken: replace one of them
	}
	c.slots[i].Store(e)
}
