package kvindex

import (
	"slices"
	"testing"
)

func TestAppendSequenceHashesAfterContinuesTheChain(t *testing.T) {
	tokens := make([]uint32, 16*40)
	for i := range tokens {
		tokens[i] = uint32(i*7 + 3)
	}
	local := BlockHashes(tokens, 16, Seed("", ""))
	want := SequenceHashes(local)
	for _, cut := range []int{1, 2, 17, 39, 40} {
		got := AppendSequenceHashesAfter(slices.Clone(want[:cut]), want[cut-1], local[cut:])
		if !slices.Equal(got, want) {
			t.Fatalf("continued after block %d: chain differs", cut)
		}
	}
}
