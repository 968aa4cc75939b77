package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// TestAddedMatcherSecondByteIndex (audit 8 finding 4): with many added tokens sharing a first byte
// (Gemma 3: 6,322 start with "<"), the matcher narrows the candidates by the second byte; its
// segments equal the full candidate scan's (leftmost-longest, one-byte tokens, a token at the
// very end) on random text; and Gemma 3's "<" no longer costs a comparison per "<unused…>"
// token (counted, not timed).
func TestAddedMatcherSecondByteIndex(t *testing.T) {
	var toks []*addedToken
	for i := range 40 {
		toks = append(toks, &addedToken{id: uint32(i), content: fmt.Sprintf("<unused%d>", i)})
	}
	for i, c := range []string{"<", "</b>", "</", "<b>", "<br/>", "<<", "x", "xy"} {
		toks = append(toks, &addedToken{id: uint32(100 + i), content: c})
	}
	m := newAddedMatcher(toks, func(a *addedToken) string { return a.content })
	if m.bySecond['<'] == nil {
		t.Fatal("no second-byte index for '<'")
	}
	full := *m
	full.bySecond = [256]*[256][]*addedToken{} // the scan over every candidate of a first byte
	alphabet := []string{"<", "/", "b", ">", "u", "n", "used", "1", "2", "x", "y", " ", "<unused1", "</b"}
	rng := rand.New(rand.NewPCG(4, 8))
	for range 5000 {
		var b strings.Builder
		for range rng.IntN(20) {
			b.WriteString(alphabet[rng.IntN(len(alphabet))])
		}
		s := b.String()
		if got, want := m.split(s, nil), full.split(s, nil); !slices.Equal(got, want) {
			t.Fatalf("%q: %v, the full scan %v", s, got, want)
		}
	}
	tk := realModel(t, "gemma3")
	if n := len(tk.addedRaw.candidates("<?", 0)); n > manyCandidates {
		t.Fatalf(`Gemma 3: %d candidates for "<?", want the few starting with it`, n)
	}
}
