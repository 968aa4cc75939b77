package kvindex

import (
	"slices"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/kvepp/kvepp/internal/sharedtest"
)

type goldenHashes struct {
	ReferenceConstants map[string]uint64 `json:"reference_constants"`
	Multimodal         struct {
		Tokens     []uint32 `json:"tokens"`
		MMHashes   []uint64 `json:"mm_hashes"`
		BlockHash  uint64   `json:"block_hash"`
		SingleMM42 uint64   `json:"single_mm_42"`
	} `json:"multimodal"`
	Vectors []struct {
		Name           string   `json:"name"`
		TokenIDs       []uint32 `json:"token_ids"`
		BlockSize      int      `json:"block_size"`
		LoraName       *string  `json:"lora_name"`
		CacheNamespace *string  `json:"cache_namespace"`
		Seed           uint64   `json:"seed"`
		BlockHashes    []uint64 `json:"block_hashes"`
		SequenceHashes []uint64 `json:"sequence_hashes"`
	} `json:"vectors"`
}

// loadGolden decodes hashes.json into uint64 fields (never through float64).
func loadGolden(t *testing.T) goldenHashes {
	t.Helper()
	var g goldenHashes
	sharedtest.DecodeJSON(t, &g, "golden", "hashes.json")
	if len(g.Vectors) == 0 {
		t.Fatal("hashes.json has no vectors")
	}
	return g
}

func TestGoldenHashVectors(t *testing.T) {
	g := loadGolden(t)
	t.Run("xxh3 of test data with seed 1337 matches the reference constant", func(t *testing.T) {
		want, ok := g.ReferenceConstants["xxh3_64('test data', seed 1337)"]
		if !ok {
			t.Fatal("reference constant missing")
		}
		if got := xxh3.HashSeed([]byte("test data"), BaseSeed); got != want {
			t.Fatalf("got %d want %d", got, want)
		}
	})
	for _, v := range g.Vectors {
		t.Run("vector "+v.Name+" reproduces seed, block hashes and sequence hashes", func(t *testing.T) {
			var lora, ns string
			if v.LoraName != nil {
				lora = *v.LoraName
			}
			if v.CacheNamespace != nil {
				ns = *v.CacheNamespace
			}
			seed := Seed(lora, ns)
			if seed != v.Seed {
				t.Fatalf("seed: got %d want %d", seed, v.Seed)
			}
			bh := BlockHashes(v.TokenIDs, v.BlockSize, seed)
			if !slices.Equal(bh, v.BlockHashes) && !(len(bh) == 0 && len(v.BlockHashes) == 0) {
				t.Fatalf("block hashes: got %v want %v", bh, v.BlockHashes)
			}
			sh := SequenceHashes(bh)
			if !slices.Equal(sh, v.SequenceHashes) && !(len(sh) == 0 && len(v.SequenceHashes) == 0) {
				t.Fatalf("sequence hashes: got %v want %v", sh, v.SequenceHashes)
			}
		})
	}
	t.Run("multimodal block hashes sort the mm suffix", func(t *testing.T) {
		m := g.Multimodal
		if got := BlockHash(m.Tokens, BaseSeed, m.MMHashes); got != m.BlockHash {
			t.Fatalf("two mm hashes: got %d want %d", got, m.BlockHash)
		}
		if got := BlockHash(m.Tokens, BaseSeed, []uint64{42}); got != m.SingleMM42 {
			t.Fatalf("single mm hash: got %d want %d", got, m.SingleMM42)
		}
	})
}

// TestSpecSection3Vectors checks every row of kv-events-index.md §3.
func TestSpecSection3Vectors(t *testing.T) {
	seq := func(n int) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = uint32(i + 1)
		}
		return out
	}
	tok0123 := []uint32{0, 1, 2, 3}
	tests := []struct {
		name string
		got  func() []uint64
		want []uint64
	}{
		{"test data with seed 1337 hashes to the anchor", func() []uint64 {
			return []uint64{xxh3.HashSeed([]byte("test data"), 1337)}
		}, []uint64{13226331709069118873}},
		{"tokens 1..12 at bs 4 give three local hashes", func() []uint64 {
			return BlockHashes(seq(12), 4, Seed("", ""))
		}, []uint64{14643705804678351452, 16777012769546811212, 483935686894639516}},
		{"tokens 1..12 at bs 4 give three sequence hashes", func() []uint64 {
			return SequenceHashes(BlockHashes(seq(12), 4, Seed("", "")))
		}, []uint64{14643705804678351452, 4945711292740353085, 12583592247330656132}},
		{"tokens 1..10 at bs 4 drop the partial tail", func() []uint64 {
			return BlockHashes(seq(10), 4, BaseSeed)
		}, []uint64{14643705804678351452, 16777012769546811212}},
		{"tokens 0..3 unsalted", func() []uint64 { return BlockHashes(tok0123, 4, BaseSeed) }, []uint64{9143094415614847814}},
		{"LoRA adapter-a seed", func() []uint64 { return []uint64{Seed("adapter-a", "")} }, []uint64{8842669519798868182}},
		{"LoRA adapter-a block", func() []uint64 { return BlockHashes(tok0123, 4, Seed("adapter-a", "")) }, []uint64{6665157333201000639}},
		{"namespace tenant-a seed", func() []uint64 { return []uint64{Seed("", "tenant-a")} }, []uint64{1948188790972764086}},
		{"namespace tenant-a block", func() []uint64 { return BlockHashes(tok0123, 4, Seed("", "tenant-a")) }, []uint64{17009624042690211646}},
		{"LoRA and namespace seed", func() []uint64 { return []uint64{Seed("adapter-a", "tenant-a")} }, []uint64{10790858310771630931}},
		{"LoRA and namespace block", func() []uint64 {
			return BlockHashes(tok0123, 4, Seed("adapter-a", "tenant-a"))
		}, []uint64{8269515957840517240}},
		{"namespace tenant-a tokens 1..4", func() []uint64 {
			return BlockHashes([]uint32{1, 2, 3, 4}, 4, Seed("", "tenant-a"))
		}, []uint64{5738685477468498325}},
		{"one mm hash 42", func() []uint64 {
			return []uint64{BlockHash(tok0123, BaseSeed, []uint64{42})}
		}, []uint64{18280081842874931122}},
		{"mm hashes 42 and 7 hash as 7, 42", func() []uint64 {
			return []uint64{BlockHash(tok0123, BaseSeed, []uint64{42, 7})}
		}, []uint64{4581426371996505827}},
		{"mm hashes through AppendBlockHashes per block", func() []uint64 {
			return AppendBlockHashes(nil, tok0123, 4, BaseSeed, [][]uint64{{42, 7}})
		}, []uint64{4581426371996505827}},
		{"eagle tokens 0..5 at bs 2 use overlapping windows", func() []uint64 {
			return EagleBlockHashes([]uint32{0, 1, 2, 3, 4, 5}, 2, BaseSeed, nil)
		}, []uint64{11646242937812223497, 9948816348502404300}},
		{"opaque mm identifier", func() []uint64 {
			return []uint64{HashMMIdentifier("opaque-renderer-image-0")}
		}, []uint64{14437604544409538977}},
		{"pad value of the opaque identifier", func() []uint64 {
			return []uint64{uint64(PadValue(HashMMIdentifier("opaque-renderer-image-0")))}
		}, []uint64{623367137}},
		{"sha256 identifier uses its first 16 hex chars", func() []uint64 {
			return []uint64{HashMMIdentifier("0123456789abcdef" + "0123456789abcdef0123456789abcdef0123456789abcdef")}
		}, []uint64{81985529216486895}},
		{"upper-case sha256 identifier parses the same", func() []uint64 {
			return []uint64{HashMMIdentifier("0123456789ABCDEF" + "0123456789abcdef0123456789abcdef0123456789abcdef")}
		}, []uint64{81985529216486895}},
		{"pad value for mm hash 42", func() []uint64 { return []uint64{uint64(PadValue(42))} }, []uint64{1000042}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.got(); !slices.Equal(got, tt.want) {
				t.Fatalf("got %v want %v", got, tt.want)
			}
		})
	}
}

func TestSequenceHashesAsSignedI64(t *testing.T) {
	t.Run("sequence hashes of tokens 1..12 render as the spec's i64 values", func(t *testing.T) {
		sh := SequenceHashes(BlockHashes([]uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, 4, BaseSeed))
		want := []int64{-3803038269031200164, 4945711292740353085, -5863151826378895484}
		for i, h := range sh {
			if int64(h) != want[i] {
				t.Fatalf("seq[%d] as i64: got %d want %d", i, int64(h), want[i])
			}
		}
	})
}

func TestHashingEdgeCases(t *testing.T) {
	t.Run("block size zero yields no blocks", func(t *testing.T) {
		if got := BlockHashes([]uint32{1, 2, 3}, 0, BaseSeed); len(got) != 0 {
			t.Fatalf("got %v", got)
		}
		if got := EagleBlockHashes([]uint32{1, 2, 3}, 0, BaseSeed, nil); len(got) != 0 {
			t.Fatalf("eagle got %v", got)
		}
	})
	t.Run("negative block size yields no blocks", func(t *testing.T) {
		if got := BlockHashes([]uint32{1, 2, 3}, -4, BaseSeed); len(got) != 0 {
			t.Fatalf("got %v", got)
		}
	})
	t.Run("eagle needs bs plus one tokens per block", func(t *testing.T) {
		if got := EagleBlockHashes([]uint32{0, 1}, 2, BaseSeed, nil); len(got) != 0 {
			t.Fatalf("two tokens at bs 2: got %v", got)
		}
		if got := EagleBlockHashes([]uint32{0, 1, 2}, 2, BaseSeed, nil); len(got) != 1 {
			t.Fatalf("three tokens at bs 2: got %v", got)
		}
		if got := EagleBlockHashes(nil, 2, BaseSeed, nil); len(got) != 0 {
			t.Fatalf("empty: got %v", got)
		}
	})
	t.Run("BlockHash does not reorder the caller's mm slice", func(t *testing.T) {
		mm := []uint64{42, 7}
		BlockHash([]uint32{0, 1, 2, 3}, BaseSeed, mm)
		if !slices.Equal(mm, []uint64{42, 7}) {
			t.Fatalf("mm mutated to %v", mm)
		}
	})
	t.Run("duplicate mm hashes are kept", func(t *testing.T) {
		a := BlockHash([]uint32{0, 1, 2, 3}, BaseSeed, []uint64{7, 7})
		b := BlockHash([]uint32{0, 1, 2, 3}, BaseSeed, []uint64{7})
		if a == b {
			t.Fatal("duplicate mm hash was collapsed")
		}
	})
	t.Run("mm hashes of a block beyond the last full block are ignored", func(t *testing.T) {
		got := AppendBlockHashes(nil, []uint32{0, 1, 2, 3, 9}, 4, BaseSeed, [][]uint64{nil, {42}})
		if !slices.Equal(got, []uint64{9143094415614847814}) {
			t.Fatalf("got %v", got)
		}
	})
	t.Run("large blocks with mm hashes hash like BlockHash", func(t *testing.T) {
		toks := make([]uint32, 256)
		for i := range toks {
			toks[i] = uint32(i * 7)
		}
		mm := [][]uint64{{3, 1}, nil}
		got := AppendBlockHashes(nil, toks, 128, BaseSeed, mm)
		want := []uint64{BlockHash(toks[:128], BaseSeed, []uint64{1, 3}), BlockHash(toks[128:], BaseSeed, nil)}
		if !slices.Equal(got, want) {
			t.Fatalf("got %v want %v", got, want)
		}
	})
	t.Run("AppendBlockHashes appends after existing entries without allocating", func(t *testing.T) {
		toks := make([]uint32, 64)
		dst := make([]uint64, 1, 8)
		allocs := testing.AllocsPerRun(100, func() { _ = AppendBlockHashes(dst[:1], toks, 16, BaseSeed, nil) })
		if allocs != 0 {
			t.Fatalf("allocs %v", allocs)
		}
		if got := AppendBlockHashes(dst[:1], toks, 16, BaseSeed, nil); len(got) != 5 || got[0] != 0 {
			t.Fatalf("got %v", got)
		}
	})
	t.Run("AppendSequenceHashes starts a fresh chain after existing entries", func(t *testing.T) {
		got := AppendSequenceHashes([]uint64{99}, []uint64{5, 6})
		want := append([]uint64{99}, SequenceHashes([]uint64{5, 6})...)
		if !slices.Equal(got, want) || got[1] != 5 {
			t.Fatalf("got %v want %v", got, want)
		}
	})
	t.Run("63 hex characters are not a sha256 identifier", func(t *testing.T) {
		id := "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde"
		if got := HashMMIdentifier(id); got != xxh3.HashStringSeed(id, 0) {
			t.Fatalf("got %d", got)
		}
	})
	t.Run("64 characters with a non-hex one are hashed", func(t *testing.T) {
		id := "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdeg"
		if got := HashMMIdentifier(id); got != xxh3.HashStringSeed(id, 0) {
			t.Fatalf("got %d", got)
		}
	})
}
