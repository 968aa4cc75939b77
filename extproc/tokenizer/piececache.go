package tokenizer

import (
	"hash/maphash"
	"math/bits"
	"slices"
	"strings"
	"sync/atomic"
)

// pieceCache is a bounded, concurrency-safe map from a pre-tokenized piece (raw bytes) to its
// BPE ids (tokenizer.md step 8), looked up once for every word of every prompt. It is two tables
// of pieceSlots slots each, the piece's hash choosing two neighbouring slots in one; an insert
// stores into an empty one of them or replaces one. Memory stays bounded: 2 × pieceSlots pieces of
// at most maxCachedPiece bytes.
//
//   - short holds nearly every piece of real text: up to shortPiece bytes with up to inlineIDs ids
//     of fewer than idBits bits. A slot holds the piece's bytes and its ids in four words, and the
//     two slots a piece may be in share one 64-byte cache line, so a look-up reads one line of
//     memory: no pointer to an entry to follow, which on a busy machine is a second cache miss per
//     word. Reads take no lock: a slot is a seqlock (pieceSlot).
//   - long holds the rest as atomic pointers to immutable entries.
type pieceCache struct {
	short *shortTable
	seed  maphash.Seed
	long  []atomic.Pointer[pieceEntry]
}

// shortTable is the pieceCache's table of short pieces: pieceSlots slots in pairs. It is allocated
// on its own (a large object, so page-aligned), and the pairs start 64 bytes in: each pair of
// 32-byte slots is one cache line.
type shortTable struct {
	k0, k1 uint64 // per-process keys of the hash
	_      [48]byte
	pairs  [pieceSlots / 2][2]pieceSlot
}

// pieceSlot is one short piece: its length n, its bytes as two words (pieceKey) and its k ids
// packed idBits apiece. meta is seq | n<<32 | k<<40 where seq, the slot's version, is odd while a
// writer fills the slot: a reader takes the slot's words only when meta reads the same even value
// before and after them (a seqlock), so a torn slot is never taken; writers claim a slot by
// moving seq from even to odd (one writer at a time; a put that finds the slot claimed is
// dropped). Every word is accessed atomically, which the race detector checks.
type pieceSlot struct {
	meta, a, b, ids atomic.Uint64
}

const (
	// shortPiece is the longest piece of the short table, bytes.
	shortPiece = 16
	// inlineIDs is the most ids a short slot holds, idBits the bits of each: 3 × 21 bits fit one
	// word, and vocabularies have fewer than 2^21 (two million) ids.
	inlineIDs = 3
	idBits    = 21
	idMask    = 1<<idBits - 1

	metaShift = 32 // n at bit 32, k at bit 40
)

// pieceEntry is one piece of the long table; never modified once stored.
type pieceEntry struct {
	piece string
	ids   []uint32
}

const (
	pieceSlots     = 1 << 17 // per table; a power of two
	maxCachedPiece = 256
)

func newPieceCache() *pieceCache {
	seed := maphash.MakeSeed()
	st := &shortTable{k0: maphash.String(seed, "piece0"), k1: maphash.String(seed, "piece1")}
	return &pieceCache{short: st, seed: seed, long: make([]atomic.Pointer[pieceEntry], pieceSlots)}
}

// lowBytes returns the mask of the low n bytes of a word: all of it for n ≥ 8, none for n ≤ 0.
// Branch-free (piece lengths vary word to word, a branch on them is mispredicted): a shift by 64
// is 0 in Go, so 1<<64 - 1 is all ones.
func lowBytes(n int) uint64 {
	return 1<<(8*uint(min(max(n, 0), 8))) - 1
}

// pieceKey returns the two words that, with its length, identify the piece s[i:j] of 1 to
// shortPiece bytes: a holds its first min(n, 8) bytes and b the rest, little-endian, zero-padded.
// Inside a longer text (16 bytes from i on) each is one load and a mask.
func pieceKey(s string, i, j int) (a, b uint64) {
	n := j - i
	if i+16 <= len(s) {
		w := s[i : i+16]
		return le64(w[:8]) & lowBytes(n), le64(w[8:]) & lowBytes(n-8)
	}
	var buf [16]byte
	copy(buf[:], s[i:j])
	return le64(string(buf[:8])), le64(string(buf[8:]))
}

// le64 returns the first 8 bytes of s as a little-endian word: one bounds check (none when the
// caller's slicing shows the length), and the compiler makes the byte loads one load.
func le64(s string) uint64 {
	s = s[:8]
	return uint64(s[0]) | uint64(s[1])<<8 | uint64(s[2])<<16 | uint64(s[3])<<24 |
		uint64(s[4])<<32 | uint64(s[5])<<40 | uint64(s[6])<<48 | uint64(s[7])<<56
}

// load64 returns s[i:i+8] as a little-endian word.
func load64(s string, i int) uint64 { return le64(s[i:]) }

// pair returns the two slots of the short piece with key a, b, n: one cache line (shortTable).
func (st *shortTable) pair(a, b uint64, n int) *[2]pieceSlot {
	hi, lo := bits.Mul64(a^st.k0, b^st.k1^uint64(n)<<56)
	return &st.pairs[(hi^lo)&(pieceSlots/2-1)]
}

// get returns the k ids of the short piece with key a, b and length n packed idBits apiece
// (appendPacked); hit false when it is not in the table.
func (st *shortTable) get(a, b uint64, n int) (ids, k uint64, hit bool) {
	p := st.pair(a, b, n)
	want := uint64(n) << metaShift
	if m := p[0].meta.Load(); m&(0xff<<metaShift|1) == want {
		ids = p[0].ids.Load()
		if p[0].a.Load() == a && p[0].b.Load() == b && p[0].meta.Load() == m {
			return ids, m >> (metaShift + 8) & 3, true
		}
	}
	if m := p[1].meta.Load(); m&(0xff<<metaShift|1) == want {
		ids = p[1].ids.Load()
		if p[1].a.Load() == a && p[1].b.Load() == b && p[1].meta.Load() == m {
			return ids, m >> (metaShift + 8) & 3, true
		}
	}
	return 0, 0, false
}

// runBytes bounds the text one appendRun goes through, so that its caller looks at the request's
// context (encodeStop) as often as for other pieces.
const runBytes = 4 << 10

// appendRun appends the ids of the pieces of s from i on, as long as they are the common pieces
// of a llama-like scanner's prose that the short table holds: ASCII words with an optional leading
// space, cut as asciiWordEnd does, and the one-byte pieces asciiSingle finds (maxDigits is the
// scanner's), whose id is byteIDs'. It returns where it stopped: before a piece of another kind,
// one not in the table, 16 bytes before the end of s (the loads are 16 bytes), after runBytes, or
// once len(dst) > limit or dst is out of room; the caller encodes the piece there.
//
// It is the loop of the encoder (about 3,000 pieces for 12 KB of text) and makes no call: a call
// spills every live register, and the branches on a word's length, mispredicted word to word, are
// replaced by bit arithmetic. Each step loads 16 bytes once as two words, finds the word's end in
// them (asciiLetters), and looks the piece up by the same words masked to its length (pieceKey),
// inlining get's first slot.
func (st *shortTable) appendRun(s string, i int, dst []uint32, byteIDs *[256]int64, maxDigits, limit int) (int, []uint32) {
	rest := s[i:]
	stop, full := max(len(rest)-runBytes, 16), min(limit, cap(dst)-inlineIDs)
	for len(rest) >= 16 && len(rest) >= stop && len(dst) <= full { // (the first test drops w's)
		w := rest[:16]
		w0, w1 := le64(w[:8]), le64(w[8:])
		// The word: an optional space, then ASCII letters up to a byte that is neither (and is
		// ASCII: else the letters may go on, which the scanner decides).
		lead := (uint32(byte(w0)^' ') - 1) >> 31 // 1 for a leading space, else 0
		others0 := ^asciiLetters(w0) & highBits &^ (uint64(lead) << 7)
		others1 := ^asciiLetters(w1) & highBits
		n := 0
		if others0>>(8*lead+7)&1 == 0 {
			if others0|others1 == 0 {
				break // 16 letters or more
			}
			e, next := 8+bits.TrailingZeros64(others1)>>3, w1
			if others0 != 0 {
				e, next = bits.TrailingZeros64(others0)>>3, w0
			}
			if next>>(8*(e&7)+7)&1 != 0 {
				break
			}
			n = e
		}
		if n <= 1 {
			if n == 0 && !asciiSingle(byte(w0), byte(w0>>8), maxDigits) {
				break
			}
			id := byteIDs[byte(w0)]
			if id < 0 {
				break
			}
			k := len(dst)
			dst = dst[:k+1]
			dst[k] = uint32(id)
			rest = rest[1:]
			continue
		}
		a, b := w0&lowBytes(n), w1&lowBytes(n-8)
		p := st.pair(a, b, n)
		want := uint64(n) << metaShift
		var ids, m uint64
		if m = p[0].meta.Load(); m&(0xff<<metaShift|1) == want {
			ids = p[0].ids.Load()
			if p[0].a.Load() != a || p[0].b.Load() != b || p[0].meta.Load() != m {
				m = 0
			}
		}
		if m&(0xff<<metaShift|1) != want {
			if m = p[1].meta.Load(); m&(0xff<<metaShift|1) != want {
				break
			}
			ids = p[1].ids.Load()
			if p[1].a.Load() != a || p[1].b.Load() != b || p[1].meta.Load() != m {
				break
			}
		}
		k := len(dst)
		out := (*[inlineIDs]uint32)(dst[k : k+inlineIDs]) // room checked above; the ids past the count are overwritten later
		out[0], out[1], out[2] = uint32(ids&idMask), uint32(ids>>idBits&idMask), uint32(ids>>(2*idBits)&idMask)
		dst = dst[:k+int(m>>(metaShift+8)&3)]
		rest = rest[n:]
	}
	return len(s) - len(rest), dst
}

// appendPacked appends the k (1 to inlineIDs) ids packed in ids to dst.
func appendPacked(dst []uint32, ids, k uint64) []uint32 {
	dst = append(dst, uint32(ids&idMask))
	if k > 1 {
		dst = append(dst, uint32(ids>>idBits&idMask))
		if k > 2 {
			dst = append(dst, uint32(ids>>(2*idBits)&idMask))
		}
	}
	return dst
}

// putShort stores ids for the short piece with key a, b and length n; false when they do not fit
// a slot (more than inlineIDs ids, or one of idBits bits or more).
func (st *shortTable) put(a, b uint64, n int, ids []uint32) bool {
	if len(ids) == 0 || len(ids) > inlineIDs {
		return false
	}
	var packed uint64
	for k, id := range ids {
		if id > idMask {
			return false
		}
		packed |= uint64(id) << (idBits * k)
	}
	p := st.pair(a, b, n)
	s := &p[0]
	switch {
	case p[0].meta.Load()>>metaShift == 0:
	case p[1].meta.Load()>>metaShift == 0:
		s = &p[1]
	default:
		s = &p[(a^b)&1] // both taken: replace one of them
	}
	m := s.meta.Load()
	if m&1 != 0 || !s.meta.CompareAndSwap(m, m+1) {
		return true // another writer has the slot: this piece is just not cached now
	}
	s.a.Store(a)
	s.b.Store(b)
	s.ids.Store(packed)
	s.meta.Store(uint64(uint32(m)+2) | uint64(n)<<metaShift | uint64(len(ids))<<(metaShift+8))
	return true
}

// appendCached appends the cached ids of piece s[i:j] (not empty) to dst; false (dst unchanged)
// when it is not cached.
func (c *pieceCache) appendCached(s string, i, j int, dst []uint32) ([]uint32, bool) {
	if j-i <= shortPiece {
		a, b := pieceKey(s, i, j)
		if ids, k, hit := c.short.get(a, b, j-i); hit {
			return appendPacked(dst, ids, k), true
		}
	}
	return c.appendLong(s[i:j], dst)
}

// appendLong appends the ids of piece p from the long table to dst; false when it is not there.
func (c *pieceCache) appendLong(p string, dst []uint32) ([]uint32, bool) {
	i := maphash.String(c.seed, p) & (pieceSlots - 1)
	if e := c.long[i].Load(); e != nil && e.piece == p {
		return append(dst, e.ids...), true
	}
	if e := c.long[i^1].Load(); e != nil && e.piece == p {
		return append(dst, e.ids...), true
	}
	return dst, false
}

// put caches ids for piece p (not empty; both copied); pieces over maxCachedPiece bytes are not
// kept.
func (c *pieceCache) put(p string, ids []uint32) {
	if len(p) > maxCachedPiece {
		return
	}
	if len(p) <= shortPiece {
		a, b := pieceKey(p, 0, len(p))
		if c.short.put(a, b, len(p), ids) {
			return
		}
	}
	h := maphash.String(c.seed, p)
	i := h & (pieceSlots - 1)
	e := &pieceEntry{piece: strings.Clone(p), ids: slices.Clone(ids)}
	switch {
	case c.long[i].Load() == nil:
	case c.long[i^1].Load() == nil:
		i ^= 1
	default:
		i ^= (h >> 32) & 1 // both taken: replace one of them
	}
	c.long[i].Store(e)
}
