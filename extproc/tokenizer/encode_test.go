package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

type encodeCase struct {
	Text       string   `json:"text"`
	IDs        []uint32 `json:"ids"`
	IDsSpecial []uint32 `json:"ids_special"`
}

func readJSON(t testing.TB, path string, v any) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, v); err != nil {
		t.Fatalf("decode %s: %v", path, err)
	}
}

func checkCases(t *testing.T, tk *Tokenizer, cases []encodeCase) {
	t.Helper()
	failed := 0
	for i, c := range cases {
		got := tk.Encode(c.Text, false)
		gotS := tk.Encode(c.Text, true)
		if !cmp.Equal(got, c.IDs, cmpEmpty) || !cmp.Equal(gotS, c.IDsSpecial, cmpEmpty) {
			failed++
			if failed <= 5 {
				t.Errorf("case %d %q:\n want %v / %v\n  got %v / %v", i, c.Text, c.IDs, c.IDsSpecial, got, gotS)
			}
		}
	}
	if failed > 0 {
		t.Errorf("%d of %d cases differ from the reference", failed, len(cases))
	}
}

var cmpEmpty = cmp.Comparer(func(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
})

// TestEncodeMatchesReferenceQwen3 compares Encode with the Rust reference (npm tokenizers) on
// hand-picked hard cases and seeded random strings (testdata/gen_encode_golden.js).
func TestEncodeMatchesReferenceQwen3(t *testing.T) {
	tk := qwen3(t)
	var g struct {
		Cases []encodeCase `json:"cases"`
	}
	readJSON(t, filepath.Join("testdata", "qwen3-encode-golden.json"), &g)
	if len(g.Cases) < 500 {
		t.Fatalf("only %d cases", len(g.Cases))
	}
	t.Run("every reference case encodes identically, with and without special tokens", func(t *testing.T) {
		checkCases(t, tk, g.Cases)
	})
	t.Run("a cold cache gives the same ids as a warm one", func(t *testing.T) {
		cold := &Tokenizer{model: tk.model, addedRaw: tk.addedRaw, addedNorm: tk.addedNorm, norm: tk.norm,
			pre: tk.pre, post: tk.post, cache: newPieceCache(), idToToken: tk.idToToken, addedByID: tk.addedByID}
		checkCases(t, cold, g.Cases[:200])
	})
}

// TestEncodeMatchesReferenceLayouts covers the other byte-level layouts (GPT-2 ByteLevel regex,
// add_prefix_space, Llama 3 split + BOS template + ignore_merges, added-token flags with an
// NFD+Lowercase normalizer, Split behaviours, Digits, String patterns, NFKC) with small
// synthetic tokenizers built from Qwen3's first merges.
func TestEncodeMatchesReferenceLayouts(t *testing.T) {
	var g struct {
		Layouts map[string][]encodeCase `json:"layouts"`
	}
	readJSON(t, filepath.Join("testdata", "layouts-golden.json"), &g)
	names := make([]string, 0, len(g.Layouts))
	for n := range g.Layouts {
		names = append(names, n)
	}
	sort.Strings(names)
	if len(names) < 6 {
		t.Fatalf("only %d layouts", len(names))
	}
	for _, name := range names {
		t.Run("layout "+name+" encodes like the reference", func(t *testing.T) {
			data, err := os.ReadFile(filepath.Join("testdata", "layouts", name+".json"))
			if err != nil {
				t.Fatal(err)
			}
			tk, err := parseTokenizerJSON(data)
			if err != nil {
				t.Fatalf("parse: %v", err)
			}
			checkCases(t, tk, g.Layouts[name])
		})
	}
}

// TestEncodeHardCases pins behaviours that are easy to get wrong, with ids from the reference.
func TestEncodeHardCases(t *testing.T) {
	tk := qwen3(t)
	tests := []struct {
		name string
		text string
		want []uint32
	}{
		{"NFD input is composed to NFC before BPE", "cafe\u0301", tk.Encode("café", false)},
		{"a special token typed inside user content stays one token", "say <|im_end|> now", nil},
		{"a special token followed by U+0338 keeps the token (normalizer runs per segment)", "a<|im_end|>\u0338", []uint32{64, 151645, 136, 116}},
		{"non-ASCII whitespace is split like the reference", "a\u00a0\u00a0b", []uint32{64, 4102, 4102, 65}},
		{"ideographic spaces before a letter", "\u3000\u3000x", []uint32{22441, 22441, 87}},
		{"trailing spaces form one piece at the end of text", "x   ", []uint32{87, 262}},
		{"a non-ASCII letter after an apostrophe is not a contraction", "x'ſ y", []uint32{87, 6, 144815, 379}},
		{"upper-case contractions match case-insensitively", "x'S y", []uint32{87, 13272, 379}},
		{"digits are split singly", "1234", []uint32{16, 17, 18, 19}},
		{"tabs and CRLF split like the reference", "a\tb\r\nc\r\n", []uint32{64, 2233, 319, 66, 319}},
		{"emoji and skin-tone modifiers are byte-level pieces", "hi 🚀🔥 👍🏽", []uint32{6023, 11162, 248, 222, 144670, 61804, 235, 145375}},
		{"a newline run followed by indentation keeps one space for the word", "x\n\n  y", []uint32{87, 271, 220, 379}},
		{"NFD e + combining acute becomes the NFC token", "e\u0301", []uint32{963}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := tk.Encode(tc.text, false)
			if tc.want == nil {
				// The special token must appear exactly once, as its own id.
				n := 0
				for _, id := range got {
					if id == 151645 {
						n++
					}
				}
				if n != 1 {
					t.Fatalf("Encode(%q) = %v, want <|im_end|> (151645) exactly once", tc.text, got)
				}
				return
			}
			if !cmp.Equal(got, tc.want) {
				t.Fatalf("Encode(%q) = %v, want %v", tc.text, got, tc.want)
			}
		})
	}
	t.Run("invalid UTF-8 bytes are replaced by U+FFFD", func(t *testing.T) {
		if got, want := tk.Encode("a\xffb", false), tk.Encode("a\uFFFDb", false); !cmp.Equal(got, want) {
			t.Fatalf("got %v, want %v", got, want)
		}
	})
	t.Run("long runs of one character merge like the reference", func(t *testing.T) {
		long := strings.Repeat("a", 5000)
		ids := tk.Encode(long, false)
		if mustDecode(t, tk, ids) != long {
			t.Fatalf("round trip failed")
		}
		// The heap path and the scan path agree.
		syms := make([]uint32, 0, 300)
		for i := 0; i < 300; i++ {
			syms = append(syms, uint32(tk.model.byteIDs['a']))
		}
		a := tk.model.mergeHeap(append([]uint32(nil), syms...))
		b := tk.model.mergeScan(append([]uint32(nil), syms[:heapThreshold]...))
		c := tk.model.mergeHeap(append([]uint32(nil), syms[:heapThreshold]...))
		if !cmp.Equal(b, c) || len(a) == 0 {
			t.Fatalf("heap %v and scan %v disagree", c, b)
		}
	})
}

// TestLoadErrors checks that unsupported layouts and broken files fail clearly.
func TestLoadErrors(t *testing.T) {
	base := func(model, pre string) string {
		return `{"added_tokens":[],"normalizer":null,"pre_tokenizer":` + pre + `,"post_processor":null,"model":` + model + `}`
	}
	bpe := `{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]}`
	bl := `{"type":"ByteLevel","add_prefix_space":false,"use_regex":true}`
	tests := []struct {
		name        string
		json        string
		unsupported bool
	}{
		{"a Precompiled (Unigram charsmap) normalizer is unsupported", strings.Replace(base(bpe, `null`), `"normalizer":null`, `"normalizer":{"type":"Precompiled","precompiled_charsmap":""}`, 1), true},
		{"a Metaspace with an invalid prepend_scheme is an error", base(bpe, `{"type":"Metaspace","replacement":"▁","prepend_scheme":"sometimes"}`), false},
		{"a WordPiece model is unsupported", base(`{"type":"WordPiece","vocab":{"a":0}}`, bl), true},
		{"a Unigram model is unsupported", base(`{"type":"Unigram","vocab":[["a",0]]}`, bl), true},
		{"byte fallback behind ByteLevel is unsupported", base(`{"type":"BPE","byte_fallback":true,"vocab":{},"merges":[]}`, bl), true},
		{"a WordPiece pre-tokenizer is unsupported", base(bpe, `{"type":"BertPreTokenizer"}`), true},
		{"a merge whose result is missing is an error", base(`{"type":"BPE","vocab":{"a":0,"b":1},"merges":[["a","b"]]}`, bl), false},
		{"a malformed merge string is an error", base(`{"type":"BPE","vocab":{"a":0},"merges":["a"]}`, bl), false},
		{"truncated JSON is an error", `{"model":`, false},
		{"an invalid split regex is an error", base(bpe, `{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"("},"behavior":"Isolated"},`+bl+`]}`), false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseTokenizerJSON([]byte(tc.json))
			if err == nil {
				t.Fatal("want an error")
			}
			if got := errors.Is(err, ErrUnsupported); got != tc.unsupported {
				t.Fatalf("errors.Is(err, ErrUnsupported) = %v, want %v (err: %v)", got, tc.unsupported, err)
			}
			if tc.unsupported && !strings.Contains(err.Error(), "DYN_EPP_TOKENIZER_PROTOCOL=vllm-render") {
				t.Fatalf("error %q does not suggest vllm-render", err)
			}
		})
	}
	t.Run("a missing directory names the file", func(t *testing.T) {
		_, err := Load(filepath.Join(t.TempDir(), "nope"))
		if err == nil || !strings.Contains(err.Error(), "tokenizer.json") {
			t.Fatalf("err = %v", err)
		}
	})
}

// TestDecodeRoundTrip checks Decode(Encode(x)) == per-segment NFC of x on the reference texts.
func TestDecodeRoundTrip(t *testing.T) {
	tk := qwen3(t)
	var g struct {
		Cases []encodeCase `json:"cases"`
	}
	readJSON(t, filepath.Join("testdata", "qwen3-encode-golden.json"), &g)
	for i, c := range g.Cases {
		if got, want := mustDecode(t, tk, tk.Encode(c.Text, false)), nfcBetweenAdded(tk, c.Text); got != want {
			t.Fatalf("case %d: Decode(Encode(%q)) = %q, want %q", i, c.Text, got, want)
		}
	}
}

// nfcBetweenAdded is an independent statement of the normalization contract: NFC applies to the
// text between added tokens (found leftmost-longest with strings.Index), never across them.
func nfcBetweenAdded(tk *Tokenizer, s string) string {
	var contents []string
	for _, a := range tk.addedByID {
		contents = append(contents, a.content)
	}
	var b strings.Builder
	for len(s) > 0 {
		best, bestLen := -1, 0
		for _, c := range contents {
			if k := strings.Index(s, c); k >= 0 && (best < 0 || k < best || (k == best && len(c) > bestLen)) {
				best, bestLen = k, len(c)
			}
		}
		if best < 0 {
			b.WriteString(tk.norm.normalize(s))
			break
		}
		b.WriteString(tk.norm.normalize(s[:best]))
		b.WriteString(s[best : best+bestLen])
		s = s[best+bestLen:]
	}
	return b.String()
}

// TestConcurrentEncode runs encodes from many goroutines against the shared piece cache (run
// with -race) and checks every result.
func TestConcurrentEncode(t *testing.T) {
	tk := qwen3(t)
	var g struct {
		Cases []encodeCase `json:"cases"`
	}
	readJSON(t, filepath.Join("testdata", "qwen3-encode-golden.json"), &g)
	done := make(chan error, 4)
	for w := 0; w < 4; w++ {
		go func(w int) {
			for i := w; i < len(g.Cases); i += 4 {
				if got := tk.Encode(g.Cases[i].Text, false); !cmp.Equal(got, g.Cases[i].IDs, cmpEmpty) {
					done <- fmt.Errorf("case %d differs under concurrency", i)
					return
				}
			}
			done <- nil
		}(w)
	}
	for w := 0; w < 4; w++ {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

// TestEncodeRunMatchesPieceByPiece: the encoder's loop (appendScanned, whose appendRun takes ASCII
// words and one-byte pieces sixteen bytes at a time through the piece cache's short table) gives
// the ids of cutting the text with the scanner piece by piece and merging every piece without a
// cache, for the Qwen2 (digits one by one) and Llama 3 (digits by three) patterns, with a cold and
// a warm cache, over long random prose of words of every length up to past 16 bytes, digits,
// punctuation, contractions, line breaks and non-ASCII letters (after words that are their ASCII
// prefixes, so that a run cutting a word short would find the prefix cached).
func TestEncodeRunMatchesPieceByPiece(t *testing.T) {
	tk := qwen3(t)
	words := []string{"a", "I", "the", "Paragraph", "blocks", "warm", "extraordinarily", "Incomprehensibilities",
		"supercalifragilistic", "ab", "xyzzyxyzzyxyzzy", "WORD", "MiXeD", "café", "caf", "naïve", "na", "жук", "x",
		"abcdefghijklmno", "abcdefghijklmnop", "abcdefghijklmnopq"}
	seps := []string{" ", " ", " ", "  ", "\n", "\n\n", ", ", ". ", ": ", "; ", "'s ", "'re ", " '", "(", ")", "-",
		"...", " 42 ", "7", " 2024", "3.14", "\t", " 🚀 ", "\u00a0", "'", "\"", "!", " ?", "$ ", "é"}
	rng := rand.New(rand.NewSource(16))
	var texts []string
	for n := 0; n < 300; n++ {
		var b strings.Builder
		for b.Len() < 40+rng.Intn(600) {
			w := words[rng.Intn(len(words))]
			if rng.Intn(4) == 0 {
				w = strings.Repeat(w, 1+rng.Intn(3))
			}
			b.WriteString(w)
			b.WriteString(seps[rng.Intn(len(seps))])
		}
		texts = append(texts, b.String())
	}
	for _, sc := range []struct {
		name      string
		scan      scanFunc
		maxDigits int
	}{{"qwen2", scanQwen2, 1}, {"llama3", scanLlama3, 3}} {
		pre := &preTokenizer{fast: sc.scan, asciiWords: true, maxDigits: sc.maxDigits, byteLevel: true}
		tok := &Tokenizer{model: tk.model, addedRaw: tk.addedRaw, addedNorm: tk.addedNorm, pre: pre,
			cache: newPieceCache(), idToToken: tk.idToToken, addedByID: tk.addedByID}
		for _, name := range []string{"cold", "warm"} {
			for k, s := range texts {
				var want []uint32
				for i := 0; i < len(s); {
					j := sc.scan(s, i)
					want = tk.model.encodeWord(s[i:j], want)
					i = j
				}
				if got := tok.appendWords(s, true, nil); !slices.Equal(got, want) {
					t.Fatalf("%s, %s cache, text %d %q:\n got %v\nwant %v", sc.name, name, k, s, got, want)
				}
			}
		}
	}
}
