package tokenizer

import (
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// fuzzAtoms are the building blocks of the differential tests: every character class the
// patterns distinguish, with ASCII and non-ASCII members, plus the sequences that exercise
// backtracking (`\s+(?!\S)`, `\s*[\r\n]+`, contractions).
var fuzzAtoms = []string{
	"a", "Z", "word", " the", "'s", "'S", "'re", "'RE", "'ll", "'Ll", "'ve", "'d", "'m", "'t", "'x", "'", "''",
	"0", "42", "1234", "٣", "１", "²", "Ⅻ", "½",
	" ", "  ", "\t", "\n", "\r", "\r\n", "\v", "\f", "\u00a0", "\u3000", "\u2028", "\u2029", "\u0085", "\u1680", "\u2009", "\u202f", "\u205f",
	"\u200b", "\u180e", "\ufeff", "\u001c", "\u0000", "\u007f",
	".", ",", "!?", "...", "-", "(", ")", "\"", "#", "<", ">", "|", "_", "\\", "@", "~", "`",
	"é", "e\u0301", "\u0301", "\u0338", "ß", "Ж", "中", "你好", "，", "。", "ſ", "İ", "K", "ǅ", "ʰ", "ª",
	"🚀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "𝔘", "\ufffd",
}

func randomText(r *rand.Rand, maxAtoms int) string {
	var b strings.Builder
	n := 1 + r.Intn(maxAtoms)
	for i := 0; i < n; i++ {
		b.WriteString(fuzzAtoms[r.Intn(len(fuzzAtoms))])
	}
	return b.String()
}

// TestScannersMatchRegexp2 is the differential test of the hand-written scanners against
// regexp2 in its default mode on the same patterns: 30,000 random strings per pattern.
func TestScannersMatchRegexp2(t *testing.T) {
	patterns := []struct {
		name    string
		pattern string
	}{
		{"Qwen2", patternQwen2},
		{"Llama 3", patternLlama3},
		{"GPT-2", patternGPT2},
	}
	for _, p := range patterns {
		t.Run("the "+p.name+" scanner splits exactly like regexp2", func(t *testing.T) {
			scan := knownScanner(p.pattern)
			if scan == nil {
				t.Fatal("no scanner registered")
			}
			re, err := newRegexMatcher(p.pattern)
			if err != nil {
				t.Fatal(err)
			}
			r := rand.New(rand.NewSource(7))
			n := 30000
			if testing.Short() || raceEnabled {
				n = 3000
			}
			for i := 0; i < n; i++ {
				s := randomText(r, 20)
				want := re.spans(s, nil)
				got := scanSpans(scan, s, nil)
				if !cmp.Equal(want, got) {
					t.Fatalf("%q:\nregexp2 %v\nscanner %v", s, pieces(s, want), pieces(s, got))
				}
			}
		})
	}
	t.Run("regexp2 leaves no gaps on the supported patterns, so scanners may tile the input", func(t *testing.T) {
		re, _ := newRegexMatcher(patternQwen2)
		r := rand.New(rand.NewSource(9))
		for i := 0; i < 2000; i++ {
			s := randomText(r, 10)
			prev := 0
			for _, sp := range re.spans(s, nil) {
				if sp[0] != prev {
					t.Fatalf("%q: gap before %v", s, sp)
				}
				prev = sp[1]
			}
			if prev != len(s) {
				t.Fatalf("%q: tail not covered", s)
			}
		}
	})
}

func pieces(s string, spans [][2]int) []string {
	out := make([]string, len(spans))
	for i, sp := range spans {
		out[i] = s[sp[0]:sp[1]]
	}
	return out
}

// TestScannerEdgeCases pins the pieces of the Qwen2 pattern on inputs named in tokenizer.md.
func TestScannerEdgeCases(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want []string
	}{
		{"spaces before a word leave one space to join the word", "a   b", []string{"a", "  ", " b"}},
		{"trailing spaces at the end of text are one piece", "a   ", []string{"a", "   "}},
		{"a newline run keeps the spaces before it", "a  \n\n  b", []string{"a", "  \n\n", " ", " b"}},
		{"CRLF is grouped with preceding punctuation", "x.\r\ny", []string{"x", ".\r\n", "y"}},
		{"a tab joins the following word", "\tword", []string{"\tword"}},
		{"digits are single pieces", "x123", []string{"x", "1", "2", "3"}},
		{"contractions are case-insensitive", "IT'S", []string{"IT", "'S"}},
		{"emoji are punctuation-like runs", "a 🚀🔥!", []string{"a", " 🚀🔥!"}},
		{"non-ASCII whitespace before a letter joins it", "\u3000\u3000x", []string{"\u3000", "\u3000x"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := pieces(tc.in, scanSpans(scanQwen2, tc.in, nil)); !cmp.Equal(got, tc.want) {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
		})
	}
}

// TestLowercaseNormalizer checks the per-character Rust lowercase (İ expands, no final sigma)
// against ids from the reference (testdata/gen_encode_golden.js's flags layout with a plain
// Lowercase normalizer).
func TestLowercaseNormalizer(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("testdata", "layouts", "flags-nfd-lowercase.json"))
	if err != nil {
		t.Fatal(err)
	}
	tk, err := parseTokenizerJSON(data)
	if err != nil {
		t.Fatal(err)
	}
	tk.norm = lowercaseNormalizer{}
	tests := []struct {
		name string
		in   string
		want []uint32
	}{
		{"dotted capital I lowercases to i + combining dot and sigma is never final", "İstanbul ΣΑΣ",
			[]uint32{72, 136, 229, 267, 276, 65, 360, 220, 139, 225, 138, 109, 139, 225}},
		{"capital sharp s and titlecase digraphs lowercase per character", "ẞ Ǆ ǅ", []uint32{127, 253, 220, 131, 228, 220, 131, 228}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tk.Encode(tc.in, false); !cmp.Equal(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}

// TestASCIIWordEndIsTheScannersFirstCase: wherever asciiWordEnd cuts a piece, the Qwen2 and
// Llama 3 scanners cut the same one (it is their first case, inlined into the encoder).
func TestASCIIWordEndIsTheScannersFirstCase(t *testing.T) {
	texts := []string{
		"Hello world, it's  a test\n\n  of   words;x y", " a", "a", " ", "  b", "ab\u00e9cd", " ab\u00e9", "x1 y2",
		"don't stop", "\tword", "A\u0301b", "ab's", "\r\nline", "end.", "MiXeD CaSe wordsGoOn",
	}
	// And random strings over the characters that decide the case: spaces, ASCII and other
	// letters, marks, digits, quotes, punctuation, line breaks.
	alphabet := []string{" ", " ", "a", "Z", "q", "é", "\u0301", "ж", "1", "'", ".", "\n", "\t", "🚀"}
	rng := rand.New(rand.NewSource(15))
	for n := 0; n < 2000; n++ {
		var b strings.Builder
		for k := rng.Intn(24); k >= 0; k-- {
			b.WriteString(alphabet[rng.Intn(len(alphabet))])
		}
		texts = append(texts, b.String())
	}
	for _, s := range texts {
		for i := 0; i < len(s); i++ {
			j := asciiWordEnd(s, i)
			if j < 0 {
				continue
			}
			if q, l := scanQwen2(s, i), scanLlama3(s, i); j != q || j != l {
				t.Fatalf("%q at %d: asciiWordEnd %d, scanQwen2 %d, scanLlama3 %d", s, i, j, q, l)
			}
		}
	}
}
