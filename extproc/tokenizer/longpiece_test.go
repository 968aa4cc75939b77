package tokenizer

import (
	"encoding/json"
	"errors"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// randomLetters is n pseudo-random lowercase letters (one pre-tokenized piece, no cache help).
func randomLetters(n int, seed uint64) string {
	r := rand.New(rand.NewPCG(seed, 7))
	b := make([]byte, n)
	for i := range b {
		b[i] = 'a' + byte(r.IntN(26))
	}
	return string(b)
}

// allocatedBy returns the bytes f allocates (single run; the tests using it do not run in
// parallel, and the bounds they check are orders of magnitude apart).
func allocatedBy(f func()) uint64 {
	var a, b runtime.MemStats
	runtime.ReadMemStats(&a)
	f()
	runtime.ReadMemStats(&b)
	return b.TotalAlloc - a.TotalAlloc
}

// TestLongPieceIsEstimatedNotMerged (audit 7 R2/R2b): a piece longer than MaxExactPieceBytes —
// a word without spaces, a run of spaces — is not run through BPE (which keeps ~25 bytes of
// state per byte): the ids before it are exact, its ids are a counted estimate booked as
// uncached, and the text after it is encoded (exact ids, but uncached since their position is
// estimated). /tokenize-style exact APIs refuse it with a 400.
func TestLongPieceIsEstimatedNotMerged(t *testing.T) {
	tk := qwen3(t)
	const n = 1 << 20
	for _, tc := range []struct{ name, piece string }{
		{"a run of spaces", strings.Repeat(" ", n)},
		{"a word without spaces", randomLetters(n, 1)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			head, tail := "Tell me about this: a", "b and then stop."
			text := head + tc.piece + tail
			var p ChatPrompt
			var err error
			alloc := allocatedBy(func() {
				p, err = tk.CompletionPromptFor(mustRequest(t, completionBody(t, text)))
			})
			if err != nil {
				t.Fatal(err)
			}
			// Encoding the piece exactly allocates > 25 bytes per byte (mergeHeap's state, on top
			// of the body, the decoded prompt and the ids); the estimate only its ids.
			if limit := uint64(16 * n); alloc > limit {
				t.Errorf("allocated %d bytes for a %d-byte piece, want <= %d (BPE ran on it)", alloc, n, limit)
			}
			exactHead := tk.Encode(head, false)
			if p.UncachedFrom > len(exactHead) || !slices.Equal(p.TokenIDs[:p.UncachedFrom], exactHead[:p.UncachedFrom]) {
				t.Fatalf("UncachedFrom %d, ids %v…, want an exact prefix of %v", p.UncachedFrom, p.TokenIDs[:min(8, len(p.TokenIDs))], exactHead)
			}
			if p.UncachedFrom < len(exactHead)-1 {
				t.Errorf("UncachedFrom %d, want the exact ids of the text before the piece (%d)", p.UncachedFrom, len(exactHead))
			}
			// The estimate is counted from an exact sample: close to the exact count.
			exact := len(tk.model.mergeHeap(symsOf(tk, tc.piece)))
			est := len(p.TokenIDs) - p.UncachedFrom - len(tk.Encode(tail, false))
			if est < exact*9/10 || est > exact*11/10+2 {
				t.Errorf("estimated %d ids for the piece, exact %d", est, exact)
			}
			for _, id := range p.TokenIDs {
				if id == inexactID {
					t.Fatal("an internal inexactID left the package")
				}
			}
			_, err = tk.CompletionIDs(mustRequest(t, completionBody(t, text)))
			var re *RequestError
			if !errors.As(err, &re) || !strings.Contains(err.Error(), "more than 16384 bytes") {
				t.Errorf("CompletionIDs (exact ids) = %v, want a RequestError", err)
			}
		})
	}
	if InexactPieces() == 0 {
		t.Error("InexactPieces did not count the long pieces")
	}
}

// symsOf is the byte-level symbols of a piece, as encodeWord builds them.
func symsOf(tk *Tokenizer, p string) []uint32 {
	syms := make([]uint32, len(p))
	for i := 0; i < len(p); i++ {
		syms[i] = uint32(tk.model.byteIDs[p[i]])
	}
	return syms
}

// TestLongPieceSentencePiece: SentencePiece layouts reach BPE through appendCharWord; a word of
// more than MaxExactPieceBytes is estimated there too, and shorter words stay exact.
func TestLongPieceSentencePiece(t *testing.T) {
	tk := spLayout(t, "llama-legacy", false)
	before := InexactPieces()
	// Letters without "h", "i" and "w": the layout's normalized added tokens "hi" and "word"
	// would cut the word; and only letters some merge uses, since the others are cut around
	// exactly (markIsolated).
	word := func(n int) string { return strings.Repeat("abcdelmnoqrstuvx", n/16+1)[:n] }
	short := tk.encode("hello "+word(MaxExactPieceBytes-16), false)
	if _, err := boundPrompt(short, before); err != nil || InexactPieces() != before {
		t.Fatalf("a word within MaxExactPieceBytes was estimated (err %v)", err)
	}
	long := tk.encode("hello "+word(1<<20), false)
	exact, err := boundPrompt(long, before)
	if err != nil {
		t.Fatal(err)
	}
	if exact == len(long) || exact > 4 {
		t.Fatalf("a 1 MiB word: %d of %d ids exact, want the estimate to start after \"hello\"", exact, len(long))
	}
}

// TestEncodeStopsAtTokenLimit: encoding stops as soon as the prompt has more ids than the limit
// (it used to tokenize a 60 MB word whole, 44 CPU-seconds, before the 16 M-token check), and a
// long piece whose exact lower bound already exceeds the room is not encoded at all.
func TestEncodeStopsAtTokenLimit(t *testing.T) {
	tk := qwen3(t)
	old := promptTokenLimit
	promptTokenLimit = 1000
	t.Cleanup(func() { promptTokenLimit = old })

	words := make([]string, 20_000)
	for i := range words {
		words[i] = randomLetters(7, uint64(i))
	}
	text := strings.Join(words, " ")
	if ids := tk.encode(text, false); len(ids) <= promptTokenLimit || len(ids) > promptTokenLimit+8 {
		t.Fatalf("encode of ~%d tokens with a limit of %d returned %d ids, want it to stop at limit+1", 3*len(words), promptTokenLimit, len(ids))
	}
	_, err := tk.CompletionPromptFor(mustRequest(t, completionBody(t, text)))
	var re *RequestError
	if !errors.As(err, &re) || !strings.Contains(err.Error(), "longer than the limit of 1000 tokens") {
		t.Fatalf("CompletionPromptFor = %v, want the token limit's RequestError", err)
	}
	// 4 MiB of spaces: at least 4 MiB / maxTokenBytes ids > 1000, refused without BPE.
	huge := "a" + strings.Repeat(" ", 4<<20) + "b"
	if lb := (len(huge) - 2) / tk.maxTokenBytes(); lb <= promptTokenLimit {
		t.Fatalf("test premise: lower bound %d", lb)
	}
	var ids []uint32
	if alloc := allocatedBy(func() { ids = tk.encode(huge, false) }); alloc > uint64(2*len(huge)) {
		t.Errorf("a piece over the token limit allocated %d bytes", alloc)
	}
	if len(ids) != promptTokenLimit+1 {
		t.Errorf("%d ids, want %d", len(ids), promptTokenLimit+1)
	}
}

// completionBody is a completions body with the given prompt string.
func completionBody(t *testing.T, prompt string) []byte {
	t.Helper()
	body, err := json.Marshal(map[string]any{"model": "m", "prompt": prompt})
	if err != nil {
		t.Fatal(err)
	}
	return body
}

func mustRequest(t *testing.T, body []byte) *Request {
	t.Helper()
	r, err := ParseRequest(body)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestHugeSegmentScratchIsNotPooled: a text of thousands of added tokens needs a segment each;
// that scratch is not returned to the pool, which would keep it for the process (audit 7 R3).
func TestHugeSegmentScratchIsNotPooled(t *testing.T) {
	tk := qwen3(t)
	tk.Encode(strings.Repeat("<|im_end|>", 4*maxPooledSegments), false)
	if s := tk.getSegs(); cap(*s) > maxPooledSegments {
		t.Fatalf("the pool kept a scratch of %d segments", cap(*s))
	}
}

// TestAddedTokenSegmentsAreBounded (audit 7 R3): 56 MB of "<|im_end|>" made 5.6 M segments and
// cache marks (~1 GB). The split stops at MaxAddedTokenSegments; the ids before are exact, the
// rest is estimated at the same ids per byte and booked as uncached.
func TestAddedTokenSegmentsAreBounded(t *testing.T) {
	tk := qwen3(t)
	old := segmentLimit
	segmentLimit = 100
	t.Cleanup(func() { segmentLimit = old })
	text := strings.Repeat("<|im_end|>", 1000) + "hello"
	p, err := tk.CompletionPromptFor(mustRequest(t, completionBody(t, text)))
	if err != nil {
		t.Fatal(err)
	}
	imEnd := tk.Encode("<|im_end|>", false)
	if len(imEnd) != 1 {
		t.Fatalf("<|im_end|> is %v", imEnd)
	}
	if p.UncachedFrom < 90 || p.UncachedFrom > segmentLimit {
		t.Fatalf("UncachedFrom %d, want the ids of the first %d segments", p.UncachedFrom, segmentLimit)
	}
	for i, id := range p.TokenIDs[:p.UncachedFrom] {
		if id != imEnd[0] {
			t.Fatalf("exact prefix id %d = %d, want <|im_end|> %d", i, id, imEnd[0])
		}
	}
	if n := len(p.TokenIDs); n < 950 || n > 1050 {
		t.Errorf("%d ids in all, want about 1001 (the estimate of the unsplit rest)", n)
	}
	if got := tk.getSegs(); cap(*got) > 4*segmentLimit {
		t.Errorf("segment scratch of %d for a limit of %d", cap(*got), segmentLimit)
	}
	// /tokenize refuses it with its own reason (audit 8: it used to blame a long word).
	_, err = tk.TokenizeCompletion(completionBody(t, text))
	if err == nil || !strings.Contains(err.Error(), "more than 100 added (special) tokens") || strings.Contains(err.Error(), "bytes") {
		t.Errorf("TokenizeCompletion: %v, want the added-token segment limit named", err)
	}
}

// TestLongPieceRealSentencePieceModels: in the real Llama 2 and Gemma 3 tokenizers (fetched by
// testdata/fetch_models.sh; skipped without them) a run of spaces and a long word reach BPE
// through the SentencePiece path and are estimated there, with the text before them exact.
func TestLongPieceRealSentencePieceModels(t *testing.T) {
	for _, name := range []string{"llama2", "gemma3"} {
		t.Run(name, func(t *testing.T) {
			tk := realModel(t, name)
			for _, piece := range []string{strings.Repeat(" ", 1<<20), strings.Repeat("zq", 1<<19)} {
				head := tk.Encode("Hello there", false)
				before := InexactPieces()
				ids := tk.encode("Hello there"+piece+"end", false)
				if InexactPieces() == before {
					t.Fatal("the piece was encoded, not estimated")
				}
				exact, err := boundPrompt(ids, before)
				if err != nil {
					t.Fatal(err)
				}
				if exact == len(ids) || exact > len(head) || !slices.Equal(ids[:exact], head[:exact]) {
					t.Fatalf("%d of %d ids exact (head %v, ids %v…)", exact, len(ids), head, ids[:min(8, len(ids))])
				}
			}
		})
	}
}
