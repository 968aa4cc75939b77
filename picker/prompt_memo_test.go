package picker

import (
	"slices"
	"sync"
	"testing"

	"github.com/kvepp/kvepp/kvindex"
)

// mapMemo is a BlockHashMemo over a map.
type mapMemo struct {
	mu     sync.Mutex
	tokens int
	m      map[BlockHashKey][2][]uint64
	stores int
}

func (m *mapMemo) Tokens() int { return m.tokens }
func (m *mapMemo) LoadBlockHashes(k BlockHashKey) (local, seq []uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	h := m.m[k]
	return h[0], h[1]
}
func (m *mapMemo) StoreBlockHashes(k BlockHashKey, local, seq []uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.m[k] = [2][]uint64{local, seq}
	m.stores++
}

// TestHashMemoGivesTheSameHashes: a prompt with a memo of its prefix hashes to exactly the
// hashes without one — whatever the memo already holds, whatever the prefix length — and the
// memo learns the prefix's hashes once.
func TestHashMemoGivesTheSameHashes(t *testing.T) {
	tokens := make([]uint32, 1000)
	for i := range tokens {
		tokens[i] = uint32(i*31 + 7)
	}
	for _, bs := range []uint32{1, 16, 64} {
		for _, prefix := range []int{0, 5, 16, 17, 500, 999, 1000, 2000} {
			for _, salt := range []string{"", "tenant"} {
				pr := Prompt{TokenIDs: tokens, CacheSalt: salt}
				want, err := normalizePrompt(&pr, bs, false, true)
				if err != nil {
					t.Fatal(err)
				}
				memo := &mapMemo{tokens: prefix, m: map[BlockHashKey][2][]uint64{}}
				pr.HashMemo = memo
				for pass := 0; pass < 3; pass++ {
					got, err := normalizePrompt(&pr, bs, false, true)
					if err != nil {
						t.Fatal(err)
					}
					if !slices.Equal(got.local, want.local) || !slices.Equal(got.seq, want.seq) {
						t.Fatalf("bs %d prefix %d salt %q pass %d: hashes differ", bs, prefix, salt, pass)
					}
				}
				wantStores := 0
				if min(prefix, len(tokens))/int(bs) > 0 {
					wantStores = 1
				}
				if memo.stores != wantStores {
					t.Fatalf("bs %d prefix %d: %d stores, want %d", bs, prefix, memo.stores, wantStores)
				}
				if l, s := memo.LoadBlockHashes(BlockHashKey{BlockSize: bs, Seed: kvindex.Seed("", salt)}); wantStores == 1 &&
					(len(l) != min(prefix, len(tokens))/int(bs) || len(s) != len(l)) {
					t.Fatalf("bs %d prefix %d: memo holds %d/%d hashes", bs, prefix, len(l), len(s))
				}
			}
		}
	}
	// A memo holding fewer blocks than its prefix (a shorter cached prefix's) is extended.
	memo := &mapMemo{tokens: 800, m: map[BlockHashKey][2][]uint64{}}
	pr := Prompt{TokenIDs: tokens}
	want, _ := normalizePrompt(&pr, 16, false, true)
	memo.m[BlockHashKey{BlockSize: 16, Seed: kvindex.Seed("", "")}] = [2][]uint64{want.local[:10], want.seq[:10]}
	pr.HashMemo = memo
	got, _ := normalizePrompt(&pr, 16, false, true)
	if !slices.Equal(got.local, want.local) || !slices.Equal(got.seq, want.seq) || memo.stores != 1 {
		t.Fatalf("extending a short memo: equal %v, stores %d", slices.Equal(got.seq, want.seq), memo.stores)
	}
	// Multimodal and eagle prompts do not use the memo.
	pr = Prompt{TokenIDs: tokens, MMItems: []MMItem{{Start: 3, End: 40, Hash: 9}}, HashMemo: &mapMemo{tokens: 500, m: map[BlockHashKey][2][]uint64{}}}
	if _, err := normalizePrompt(&pr, 16, true, true); err != nil || pr.HashMemo.(*mapMemo).stores != 0 {
		t.Fatalf("an eagle prompt used the memo: %v", err)
	}
}
