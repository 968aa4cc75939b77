package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"
)

// TestPieceCacheRoundTrip: pieces of the short table (up to shortPiece bytes, up to inlineIDs ids
// of fewer than idBits bits) and of the long one (longer pieces, more ids, larger ids) come back
// with their own ids, detached from the caller's buffers, whether looked up alone or inside a
// longer text, and a look-up never answers for another piece of the same length, a prefix or an
// extension.
func TestPieceCacheRoundTrip(t *testing.T) {
	c := newPieceCache()
	cases := []struct {
		piece string
		ids   []uint32
	}{
		{"ab", []uint32{7}},
		{" hello", []uint32{1, 2, 3}},
		{" world", []uint32{1, 2, 3, 4}},
		{"big", []uint32{idMask + 1}},
		{"max", []uint32{idMask, idMask - 1, 0}},
		{strings.Repeat("x", 8), []uint32{9, 10}},
		{strings.Repeat("v", 9), []uint32{11}},
		{strings.Repeat("x", shortPiece), []uint32{5, 6, 7, 8, 9}},
		{strings.Repeat("u", shortPiece), []uint32{5, 6}},
		{strings.Repeat("y", shortPiece+1), []uint32{10}},
		{strings.Repeat("z", maxCachedPiece), []uint32{11, 12, 13, 14, 15, 16}},
	}
	for _, tc := range cases {
		buf := []byte(tc.piece) // the caller's text, reused after put
		ids := slices.Clone(tc.ids)
		c.put(string(buf), ids)
		for i := range ids {
			ids[i] = 0
		}
		for i := range buf {
			buf[i] = '#'
		}
		got, ok := c.appendCached(tc.piece, 0, len(tc.piece), []uint32{99})
		if !ok || !slices.Equal(got, append([]uint32{99}, tc.ids...)) {
			t.Fatalf("appendCached(%q) = %v, %v; want 99 then %v", tc.piece, got, ok, tc.ids)
		}
		text := "<<" + tc.piece + strings.Repeat("!", 20)
		if got, ok := c.appendCached(text, 2, 2+len(tc.piece), nil); !ok || !slices.Equal(got, tc.ids) {
			t.Fatalf("appendCached(%q inside a text) = %v, %v; want %v", tc.piece, got, ok, tc.ids)
		}
		other := []byte(tc.piece)
		other[len(other)-1] ^= 1
		if got, ok := c.appendCached(string(other), 0, len(other), nil); ok {
			t.Fatalf("appendCached(%q) answered %v for the piece %q", other, got, tc.piece)
		}
		if got, ok := c.appendCached(tc.piece, 0, len(tc.piece)-1, nil); ok && len(tc.piece) > 1 {
			t.Fatalf("appendCached(%q) answered %v for its extension %q", tc.piece[:len(tc.piece)-1], got, tc.piece)
		}
		if got, ok := c.appendCached(text, 2, 3+len(tc.piece), nil); ok {
			t.Fatalf("appendCached(%q) answered %v for its prefix %q", text[2:3+len(tc.piece)], got, tc.piece)
		}
	}
	long := strings.Repeat("w", maxCachedPiece+1)
	c.put(long, []uint32{1})
	if _, ok := c.appendCached(long, 0, len(long), nil); ok {
		t.Fatalf("a piece over maxCachedPiece bytes was cached")
	}
}

// TestPieceCacheConcurrentSlot: readers never take a slot a writer is filling (pieceSlot's
// seqlock). Pieces of one length whose hash picks the same pair of slots are written over each
// other, each with its own ids, while readers look them up: every answer must be the ids of the
// piece asked for. Under the race detector every access of a slot is checked too.
func TestPieceCacheConcurrentSlot(t *testing.T) {
	c := newPieceCache()
	// Find pieces of 5 bytes sharing a pair of slots.
	byPair := map[*[2]pieceSlot][]string{}
	var group []string
	for x := 0; len(group) < 4; x++ {
		p := fmt.Sprintf("%05d", x)
		a, b := pieceKey(p, 0, len(p))
		pr := c.short.pair(a, b, len(p))
		byPair[pr] = append(byPair[pr], p)
		if len(byPair[pr]) == 4 {
			group = byPair[pr]
		}
	}
	idsOf := func(k int) []uint32 { return []uint32{uint32(100 * k), uint32(100*k + 1), uint32(100*k + 2)} }
	iters := 200_000
	if testing.Short() || raceEnabled {
		iters = 20_000
	}
	var wg sync.WaitGroup
	var bad atomic.Int64
	for w := range 2 {
		wg.Go(func() {
			for i := range iters {
				k := (i + w) % len(group)
				c.put(group[k], idsOf(k))
			}
		})
	}
	for range 2 {
		wg.Go(func() {
			var buf []uint32
			for i := range iters {
				k := i % len(group)
				got, ok := c.appendCached(group[k], 0, len(group[k]), buf[:0])
				if ok && !slices.Equal(got, idsOf(k)) {
					bad.Add(1)
				}
				buf = got
			}
		})
	}
	wg.Wait()
	if n := bad.Load(); n > 0 {
		t.Fatalf("%d look-ups answered another piece's ids", n)
	}
}

// TestPieceKeyIdentifiesShortPieces: two pieces of the same length up to shortPiece bytes have the
// same pieceKey only when they are equal, and the key of a piece inside a longer text (the
// in-place loads) is the key of the piece alone.
func TestPieceKeyIdentifiesShortPieces(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for n := 1; n <= shortPiece; n++ {
		for range 50 {
			b := make([]byte, n)
			for i := range b {
				b[i] = byte(rng.IntN(256))
			}
			a0, b0 := pieceKey(string(b), 0, n)
			for i := range b {
				c := b[i]
				b[i] ^= byte(1 + rng.IntN(255))
				if a1, b1 := pieceKey(string(b), 0, n); a1 == a0 && b1 == b0 {
					t.Fatalf("len %d: a change at byte %d leaves the key equal", n, i)
				}
				b[i] = c
			}
			for pre := 0; pre < 3; pre++ {
				for post := 0; post < 20; post++ {
					text := strings.Repeat("\xff", pre) + string(b) + strings.Repeat("\xfe", post)
					if a1, b1 := pieceKey(text, pre, pre+n); a1 != a0 || b1 != b0 {
						t.Fatalf("len %d at %d of %d bytes: key %x %x, alone %x %x", n, pre, len(text), a1, b1, a0, b0)
					}
				}
			}
		}
	}
}

// TestIsASCIIOverEveryPosition: isASCII is false exactly when some byte is ≥ 0x80, wherever it
// lies relative to the 32- and 8-byte steps.
func TestIsASCIIOverEveryPosition(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for n := 0; n <= 100; n++ {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.IntN(0x80))
		}
		if !isASCII(string(b)) {
			t.Fatalf("len %d: ASCII text reported non-ASCII", n)
		}
		for i := range b {
			c := b[i]
			b[i] = 0x80 | byte(rng.IntN(0x80))
			if isASCII(string(b)) {
				t.Fatalf("len %d: byte %#x at %d not seen", n, b[i], i)
			}
			b[i] = c
		}
	}
}

// TestShortTablePairsAreCacheLines: each pair of slots a short piece may be in is one aligned
// 64-byte cache line, which is what makes a look-up one memory access.
func TestShortTablePairsAreCacheLines(t *testing.T) {
	c := newPieceCache()
	if sz := unsafe.Sizeof(c.short.pairs[0]); sz != 64 {
		t.Fatalf("a pair is %d bytes, want 64", sz)
	}
	for _, i := range []int{0, 1, len(c.short.pairs) - 1} {
		if a := uintptr(unsafe.Pointer(&c.short.pairs[i])); a%64 != 0 {
			t.Fatalf("pair %d at %#x is not 64-byte aligned", i, a)
		}
	}
}
