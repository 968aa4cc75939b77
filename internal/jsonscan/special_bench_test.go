package jsonscan

import (
	"bytes"
	"testing"
)

// BenchmarkStringSpecial walks 12 KB of prompt text to the end of its JSON string as ValidString
// does: plain text, and text with an escaped paragraph break every 70 bytes (as the synthetic
// conversations of benchbody have).
func BenchmarkStringSpecial(b *testing.B) {
	for _, tc := range []struct{ name, unit string }{
		{"plain", "the quick brown fox jumps over the lazy dog 0. "},
		{"escapes", "the quick brown fox jumps over the lazy dog while the router keeps\\n"},
	} {
		text := bytes.Repeat([]byte(tc.unit), 12<<10/len(tc.unit))
		text = append([]byte{'"'}, append(text, '"')...)
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(int64(len(text)))
			for b.Loop() {
				if end, ok := ValidString(text, 0); !ok || end != len(text) {
					b.Fatal("wrong end")
				}
			}
		})
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
