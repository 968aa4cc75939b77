package tokenizer

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
