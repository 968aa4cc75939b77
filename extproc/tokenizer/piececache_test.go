package tokenizer

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// TestPieceCacheRoundTrip: pieces identified by their words (up to shortPiece bytes) and by
// their bytes, with ids inline (up to len(pieceEntry.inl)) and out of line, come back with their
// own ids, detached from the caller's buffers, and a look-up never answers for another piece of
// the same length or a prefix.
func TestPieceCacheRoundTrip(t *testing.T) {
	c := newPieceCache()
	cases := []struct {
		piece string
		ids   []uint32
	}{
		{"ab", []uint32{7}},
		{" hello", []uint32{1, 2, 3, 4}},
		{strings.Repeat("x", shortPiece), []uint32{5, 6, 7, 8, 9}},
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
		got, ok := c.get(tc.piece)
		if !ok || !slices.Equal(got, tc.ids) {
			t.Fatalf("get(%q) = %v, %v; want %v", tc.piece, got, ok, tc.ids)
		}
		other := []byte(tc.piece)
		other[len(other)-1] ^= 1
		if got, ok := c.get(string(other)); ok {
			t.Fatalf("get(%q) answered %v for the piece %q", other, got, tc.piece)
		}
		if got, ok := c.get(tc.piece[:len(tc.piece)-1]); ok && len(tc.piece) > 1 {
			t.Fatalf("get(%q) answered %v for its extension %q", tc.piece[:len(tc.piece)-1], got, tc.piece)
		}
	}
	long := strings.Repeat("w", maxCachedPiece+1)
	c.put(long, []uint32{1})
	if _, ok := c.get(long); ok {
		t.Fatalf("a piece over maxCachedPiece bytes was cached")
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

// TestPieceWordsIdentifyShortPieces: two pieces of the same length up to shortPiece bytes have the
// same pieceWords only when they are equal — every byte is covered by one of the loads.
func TestPieceWordsIdentifyShortPieces(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for n := 1; n <= shortPiece; n++ {
		for range 50 {
			b := make([]byte, n)
			for i := range b {
				b[i] = byte(rng.IntN(256))
			}
			a0, b0 := pieceWords(string(b))
			for i := range b {
				c := b[i]
				b[i] ^= byte(1 + rng.IntN(255))
				if a1, b1 := pieceWords(string(b)); a1 == a0 && b1 == b0 {
					t.Fatalf("len %d: a change at byte %d leaves the words equal", n, i)
				}
				b[i] = c
			}
		}
	}
}
