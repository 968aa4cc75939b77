package tokenizer

// GPT-2's bytes-to-unicode table (tokenizer.md "Byte-level BPE", step 5): every byte maps to one
// printable rune so that BPE vocabularies never contain raw control bytes or spaces. Printable
// Latin-1 bytes map to themselves; the remaining 68 bytes map to U+0100 upwards in byte order.
var (
	byteToRune [256]rune
	runeToByte = make(map[rune]byte, 256)
)

func init() {
	n := 0
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			byteToRune[b] = rune(b)
		} else {
			byteToRune[b] = rune(256 + n)
			n++
		}
		runeToByte[byteToRune[b]] = byte(b)
	}
}

// byteLevelString maps every byte of s through byteToRune (the vocabulary spelling of s).
func byteLevelString(s string) string {
	buf := make([]rune, len(s))
	for i := 0; i < len(s); i++ {
		buf[i] = byteToRune[s[i]]
	}
	return string(buf)
}

// unByteLevel appends the bytes a token spelling stands for; a token with any rune outside the
// table is appended verbatim (the Hugging Face ByteLevel decoder's rule).
func unByteLevel(dst []byte, tok string) []byte {
	n := len(dst)
	for _, r := range tok {
		b, ok := runeToByte[r]
		if !ok {
			return append(dst[:n], tok...)
		}
		dst = append(dst, b)
	}
	return dst
}
