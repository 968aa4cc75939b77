package jsonscan

import (
	"bytes"
	"testing"
)

// BenchmarkStringSpecial scans 12 KB of plain prompt text for the end of a JSON string.
func BenchmarkStringSpecial(b *testing.B) {
	text := bytes.Repeat([]byte("the quick brown fox jumps over the lazy dog 0. "), 256)
	text = append(text, '"')
	b.SetBytes(int64(len(text)))
	for b.Loop() {
		if StringSpecial(text, 0) != len(text)-1 {
			b.Fatal("wrong end")
		}
	}
}

// TestStringSpecialFindsTheFirst: on text with one quote, backslash or control character placed at
// every offset (before, inside and after the 32- and 8-byte steps), StringSpecial returns the
// offset a byte-by-byte scan finds, from every start.
func TestStringSpecialFindsTheFirst(t *testing.T) {
	for n := 0; n <= 80; n++ {
		for _, c := range []byte{'"', '\\', 0x00, 0x1f, '\n'} {
			for at := -1; at < n; at++ {
				b := bytes.Repeat([]byte{'a', 0xc3, 0xa9, ' ', '~', 0x7f, 0x20}, 12)[:n]
				if at >= 0 {
					b[at] = c
				}
				for start := 0; start <= n; start++ {
					want := start
					for want < n && b[want] != '"' && b[want] != '\\' && b[want] >= 0x20 {
						want++
					}
					if got := StringSpecial(b, start); got != want {
						t.Fatalf("n %d, %#x at %d, from %d: got %d, want %d", n, c, at, start, got, want)
					}
				}
			}
		}
	}
}
