package tokenizer

import (
	"fmt"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
)

// The split patterns with hand-written scanners (tokenizer.md step 4). Each scanner is verified
// equal to regexp2 (default mode) by the differential tests in pretokenize_test.go.
const (
	// patternQwen2 is the Qwen2/2.5/3 pattern (digits split singly).
	patternQwen2 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// patternLlama3 is the Llama 3 pattern (digits in groups of up to three).
	patternLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// patternGPT2 is the pattern ByteLevel uses when use_regex is true.
	patternGPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// scanFunc returns the end (byte offset) of the piece starting at i; i < len(s) and s is valid
// UTF-8. Every position starts a match for the supported patterns, so pieces tile the input.
type scanFunc func(s string, i int) int

// knownScanner returns the hand-written scanner for pattern, or nil.
func knownScanner(pattern string) scanFunc {
	switch pattern {
	case patternQwen2:
		return scanQwen2
	case patternLlama3:
		return scanLlama3
	case patternGPT2:
		return scanGPT2
	}
	return nil
}

const (
	clsOther uint8 = iota
	clsLetter
	clsNumber
	clsSpace
)

var asciiClass [utf8.RuneSelf]uint8

// isASCIILetter reports c in A-Z or a-z (the ASCII bytes of class letter).
func isASCIILetter(c byte) bool { return (c|0x20)-'a' < 26 }

func init() {
	for c := 0; c < utf8.RuneSelf; c++ {
		r := rune(c)
		switch {
		case unicode.IsLetter(r):
			asciiClass[c] = clsLetter
		case unicode.IsNumber(r):
			asciiClass[c] = clsNumber
		case unicode.IsSpace(r):
			asciiClass[c] = clsSpace
		}
	}
}

// classOf classifies r as regexp2 does: \p{L} is unicode.L, \p{N} unicode.N, \s unicode.IsSpace.
func classOf(r rune) uint8 {
	if r < utf8.RuneSelf {
		return asciiClass[r]
	}
	switch {
	case unicode.IsLetter(r):
		return clsLetter
	case unicode.IsNumber(r):
		return clsNumber
	case unicode.IsSpace(r):
		return clsSpace
	}
	return clsOther
}

// at decodes the rune at i and returns it, its width and its class.
func at(s string, i int) (rune, int, uint8) {
	c := s[i]
	if c < utf8.RuneSelf {
		return rune(c), 1, asciiClass[c]
	}
	r, n := utf8.DecodeRuneInString(s[i:])
	return r, n, classOf(r)
}

// skipClass returns the end of the run of class cls starting at j.
func skipClass(s string, j int, cls uint8) int {
	for j < len(s) {
		c := s[j]
		if c < utf8.RuneSelf {
			if asciiClass[c] != cls {
				return j
			}
			j++
			continue
		}
		r, n := utf8.DecodeRuneInString(s[j:])
		if classOf(r) != cls {
			return j
		}
		j += n
	}
	return j
}

// contraction reports the length of an English contraction at i ("'s", "'re", …), 0 if none.
// fold makes the match ASCII case-insensitive; regexp2's IgnoreCase lowercases with
// unicode.ToLower, and no non-ASCII rune lowercases to one of s,t,r,e,v,m,l,d, so ASCII folding
// is exact.
func contraction(s string, i int, fold bool) int {
	if s[i] != '\'' || i+1 >= len(s) {
		return 0
	}
	low := func(b byte) byte {
		if fold && b >= 'A' && b <= 'Z' {
			return b + ('a' - 'A')
		}
		return b
	}
	switch low(s[i+1]) {
	case 's', 't', 'm', 'd':
		return 2
	case 'r', 'v':
		if i+2 < len(s) && low(s[i+2]) == 'e' {
			return 3
		}
	case 'l':
		if i+2 < len(s) && low(s[i+2]) == 'l' {
			return 3
		}
	}
	return 0
}

// scanWhitespaceLlama handles `\s*[\r\n]+|\s+(?!\S)|\s+` at a whitespace rune.
func scanWhitespaceLlama(s string, i int) int {
	j, lastNL, lastStart := i, -1, i
	for j < len(s) {
		r, n, cls := at(s, j)
		if cls != clsSpace {
			break
		}
		if r == '\r' || r == '\n' {
			lastNL = j
		}
		lastStart = j
		j += n
	}
	if lastNL >= 0 {
		return lastNL + 1
	}
	return whitespaceTail(s, i, j, lastStart)
}

// whitespaceTail applies `\s+(?!\S)|\s+` to the whitespace run [i, j) whose last rune starts
// at lastStart: the run stops before its last rune when a non-space follows and that leaves a
// non-empty match.
func whitespaceTail(s string, i, j, lastStart int) int {
	if j == len(s) || lastStart == i {
		return j
	}
	return lastStart
}

func scanLlamaLike(s string, i int, maxDigits int) int {
	// The common pieces first: ASCII letters, or a space and ASCII letters (`[^\r\n\p{L}\p{N}]?\p{L}+`;
	// a contraction needs a quote, so none starts here).
	if j := i; s[j] == ' ' || isASCIILetter(s[j]) {
		if s[j] == ' ' {
			j++
		}
		if j < len(s) && isASCIILetter(s[j]) {
			for j++; j < len(s) && isASCIILetter(s[j]); j++ {
			}
			if j < len(s) && s[j] >= utf8.RuneSelf {
				return skipClass(s, j, clsLetter) // the letters go on beyond ASCII
			}
			return j
		}
	}
	if j := asciiSingleEnd(s, i, maxDigits); j > 0 {
		return j
	}
	if n := contraction(s, i, true); n > 0 {
		return i + n
	}
	r0, n0, c0 := at(s, i)
	switch c0 {
	case clsLetter:
		return skipClass(s, i+n0, clsLetter)
	case clsNumber:
		j := i + n0
		for k := 1; (maxDigits <= 0 || k < maxDigits) && j < len(s); k++ {
			_, n, c := at(s, j)
			if c != clsNumber {
				break
			}
			j += n
		}
		return j
	}
	// [^\r\n\p{L}\p{N}]?\p{L}+ with the optional character present.
	j := i + n0
	var c1 uint8 = clsSpace
	n1 := 0
	if j < len(s) {
		_, n1, c1 = at(s, j)
	}
	if r0 != '\r' && r0 != '\n' && j < len(s) && c1 == clsLetter {
		return skipClass(s, j+n1, clsLetter)
	}
	// ` ?[^\s\p{L}\p{N}]+[\r\n]*`
	if c0 == clsOther || (r0 == ' ' && j < len(s) && c1 == clsOther) {
		if c0 != clsOther {
			j += n1
		}
		j = skipClass(s, j, clsOther)
		for j < len(s) && (s[j] == '\r' || s[j] == '\n') {
			j++
		}
		return j
	}
	return scanWhitespaceLlama(s, i)
}

// asciiWordEnd is the first case of scanLlamaLike, small enough to inline into the encoder's
// loop: the end of the ASCII letters starting at i, after an optional leading space, or -1 when
// there are none or the letters go on beyond ASCII (the scanner then decides).
func asciiWordEnd(s string, i int) int {
	j := i
	if s[j] == ' ' {
		j++
	}
	if j >= len(s) || !isASCIILetter(s[j]) {
		return -1
	}
	for j++; j < len(s) && isASCIILetter(s[j]); j++ {
	}
	if j < len(s) && s[j] >= utf8.RuneSelf {
		return -1
	}
	return j
}

// highBits is the high bit of every byte of a word.
const highBits = 0x8080808080808080

// asciiLetters returns a word with the high bit set in every byte of w that is an ASCII letter
// (A-Z, a-z) and no other bit: setting 0x20 folds the upper case onto the lower, and with the high
// bit cleared each byte y is in 'a'..'z' when y+0x1f carries into the high bit and y+0x05 does
// not (no sum reaches the next byte).
func asciiLetters(w uint64) uint64 {
	y := (w | 0x2020202020202020) & 0x7f7f7f7f7f7f7f7f
	return (y + 0x1f1f1f1f1f1f1f1f) &^ (y + 0x0505050505050505) &^ w & highBits
}

// asciiSingleEnd returns i+1 for the one-byte pieces of ASCII prose that the cases of
// scanLlamaLike after its first cut that way, found without them (asciiSingle), 0 otherwise.
func asciiSingleEnd(s string, i, maxDigits int) int {
	var next byte // 0 at the end: a byte no case takes
	if i+1 < len(s) {
		next = s[i+1]
	}
	if asciiSingle(s[i], next, maxDigits) {
		return i + 1
	}
	return 0
}

// asciiSingle reports whether byte c, followed by next, is one of the one-byte pieces of ASCII
// prose that the cases of scanLlamaLike after its first (an ASCII word) cut: a digit when numbers
// are cut digit by digit (`\p{N}`, Qwen2), a space before a digit (`\s+` stopping before it), and
// punctuation other than a quote before a space (` ?[^\s\p{L}\p{N}]+[\r\n]*`).
func asciiSingle(c, next byte, maxDigits int) bool {
	if c >= utf8.RuneSelf {
		return false
	}
	switch asciiClass[c] {
	case clsNumber:
		return maxDigits == 1
	case clsSpace:
		return c == ' ' && next < utf8.RuneSelf && asciiClass[next] == clsNumber
	case clsOther:
		return c != '\'' && next == ' '
	}
	return false
}

func scanQwen2(s string, i int) int  { return scanLlamaLike(s, i, 1) }
func scanLlama3(s string, i int) int { return scanLlamaLike(s, i, 3) }

func scanGPT2(s string, i int) int {
	if n := contraction(s, i, false); n > 0 {
		return i + n
	}
	r0, n0, c0 := at(s, i)
	j := i + n0
	if r0 == ' ' && j < len(s) {
		_, n1, c1 := at(s, j)
		if c1 != clsSpace {
			return skipClass(s, j+n1, c1)
		}
	}
	if c0 != clsSpace {
		return skipClass(s, j, c0)
	}
	lastStart := i
	for j < len(s) {
		_, n, c := at(s, j)
		if c != clsSpace {
			break
		}
		lastStart = j
		j += n
	}
	return whitespaceTail(s, i, j, lastStart)
}

// regexMatcher finds the match spans of a general pattern with regexp2 in its default
// (.NET-compatible) mode, the fallback for patterns without a scanner.
type regexMatcher struct {
	re *regexp2.Regexp
}

func newRegexMatcher(pattern string) (*regexMatcher, error) {
	re, err := regexp2.Compile(pattern, regexp2.None)
	if err != nil {
		return nil, fmt.Errorf("compile split pattern %q: %w", pattern, err)
	}
	return &regexMatcher{re: re}, nil
}

// spans appends the non-empty match spans of s as byte offsets.
func (m *regexMatcher) spans(s string, dst [][2]int) [][2]int {
	runes := []rune(s)
	offs := make([]int, len(runes)+1)
	o := 0
	for k, r := range runes {
		offs[k] = o
		o += utf8.RuneLen(r)
	}
	offs[len(runes)] = o
	match, err := m.re.FindRunesMatch(runes)
	for err == nil && match != nil {
		start, end := match.Index, match.Index+match.Length
		if end > start {
			dst = append(dst, [2]int{offs[start], offs[end]})
		}
		match, err = m.re.FindNextMatch(match)
	}
	return dst
}

// scanSpans appends the spans produced by a scanner.
func scanSpans(scan scanFunc, s string, dst [][2]int) [][2]int {
	for i := 0; i < len(s); {
		j := scan(s, i)
		dst = append(dst, [2]int{i, j})
		i = j
	}
	return dst
}
