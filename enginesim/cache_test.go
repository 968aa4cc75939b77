package enginesim

import (
	"slices"
	"testing"
)

// runRequest admits, commits and releases one prompt on c, returning the hit in
// blocks and the commit result.
func runRequest(c *prefixCache, tokens []uint32) (int, commitResult) {
	hashes := c.blockHashes(tokens)
	pinned := c.admit(hashes, len(tokens))
	hit := len(pinned)
	res := c.commit(pinned, hashes)
	c.release(res.pinned)
	return hit, res
}

func TestPrefixCacheHits(t *testing.T) {
	tests := []struct {
		name      string
		first     []uint32
		second    []uint32
		wantHit   int // blocks hit by the second prompt
		wantStore int // blocks stored by the first prompt
	}{
		{"a second identical request hits every full block", seqTokens(0, 40), seqTokens(0, 40), 2, 2},
		{"the partial tail block is never cached", seqTokens(0, 40), append(seqTokens(0, 32), seqTokens(900, 15)...), 2, 2},
		{"a block-aligned prompt cached in full still computes its last block, as in vLLM", seqTokens(0, 32), seqTokens(0, 32), 1, 2},
		{"a prompt shorter than one block stores and hits nothing", seqTokens(0, 15), seqTokens(0, 15), 0, 0},
		{"the hit stops at the first block that differs", seqTokens(0, 64), append(append(seqTokens(0, 16), seqTokens(500, 16)...), seqTokens(32, 32)...), 1, 4},
		{"a different first block hits nothing even when later tokens match", seqTokens(0, 48), append(seqTokens(7, 16), seqTokens(16, 32)...), 0, 3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := newPrefixCache(16, 100, 0)
			hit, res := runRequest(c, tc.first)
			if hit != 0 || len(res.pinned)-res.start != tc.wantStore {
				t.Fatalf("first request: hit %d, stored %d; want 0, %d", hit, len(res.pinned)-res.start, tc.wantStore)
			}
			if hit, _ := runRequest(c, tc.second); hit != tc.wantHit {
				t.Errorf("second request hit %d blocks, want %d", hit, tc.wantHit)
			}
		})
	}
}

func TestPrefixCacheStoresAfterTheHit(t *testing.T) {
	c := newPrefixCache(16, 100, 0)
	runRequest(c, seqTokens(0, 32))
	long := seqTokens(0, 80)
	hit, res := runRequest(c, long)
	if hit != 2 || res.start != 2 || len(res.pinned) != 5 {
		t.Fatalf("hit %d, start %d, holdings %d; want 2, 2, 5", hit, res.start, len(res.pinned))
	}
	if len(res.removed) != 0 {
		t.Errorf("removed %v with free capacity", res.removed)
	}
}

func TestPrefixCacheEviction(t *testing.T) {
	t.Run("LRU evicts the least recently used unpinned blocks, tail first", func(t *testing.T) {
		c := newPrefixCache(16, 4, 0)
		a, b, x := seqTokens(0, 32), seqTokens(1000, 32), seqTokens(2000, 32)
		runRequest(c, a)
		runRequest(c, b)
		runRequest(c, a) // touches a: b is now least recently used
		_, res := runRequest(c, x)
		hb := c.blockHashes(b)
		if want := []uint64{hb[1], hb[0]}; !slices.Equal(res.removed, want) {
			t.Fatalf("removed %v, want b's blocks tail first %v", res.removed, want)
		}
		for _, h := range c.blockHashes(a) {
			if !c.contains(h) {
				t.Errorf("recently used block %d was evicted", h)
			}
		}
		if c.evicted != 2 || c.stored != 6 {
			t.Errorf("counters evicted %d stored %d, want 2 and 6", c.evicted, c.stored)
		}
	})
	t.Run("eviction takes leaves, never a parent whose child stays cached", func(t *testing.T) {
		c := newPrefixCache(16, 3, 0)
		a := seqTokens(0, 48)
		runRequest(c, a)
		_, res := runRequest(c, seqTokens(1000, 32))
		ha := c.blockHashes(a)
		if want := []uint64{ha[2], ha[1]}; !slices.Equal(res.removed, want) {
			t.Fatalf("removed %v, want %v", res.removed, want)
		}
		if hit, _ := runRequest(c, seqTokens(0, 20)); hit != 1 {
			t.Errorf("the surviving root block hit %d blocks, want 1", hit)
		}
	})
	t.Run("blocks pinned by a running request are never evicted", func(t *testing.T) {
		c := newPrefixCache(16, 2, 0)
		a := seqTokens(0, 32)
		ha := c.blockHashes(a)
		held := c.commit(c.admit(ha, len(a)), ha).pinned // still running
		_, res := runRequest(c, seqTokens(1000, 32))
		if len(res.removed) != 0 || len(res.pinned) != 0 {
			t.Fatalf("removed %v, stored %d blocks while the cache was fully pinned", res.removed, len(res.pinned))
		}
		if cached, pinned := c.size(); cached != 2 || pinned != 2 {
			t.Fatalf("size = %d cached, %d pinned; want 2, 2", cached, pinned)
		}
		c.release(held)
		_, res = runRequest(c, seqTokens(1000, 32))
		if want := []uint64{ha[1], ha[0]}; !slices.Equal(res.removed, want) {
			t.Errorf("after release removed %v, want %v", res.removed, want)
		}
	})
	t.Run("a store that does not fit stops at the first block without room", func(t *testing.T) {
		c := newPrefixCache(16, 3, 0)
		a := seqTokens(0, 32)
		ha := c.blockHashes(a)
		held := c.commit(c.admit(ha, len(a)), ha).pinned
		_, res := runRequest(c, seqTokens(1000, 48))
		if len(res.pinned) != 1 || len(res.removed) != 0 {
			t.Errorf("stored %d blocks, removed %v; want 1 stored, none removed", len(res.pinned), res.removed)
		}
		c.release(held)
	})
}

func TestPrefixCacheConcurrentDuplicates(t *testing.T) {
	c := newPrefixCache(16, 10, 0)
	p := seqTokens(0, 40)
	h := c.blockHashes(p)
	first := c.admit(h, len(p))
	second := c.admit(h, len(p)) // both admitted before either stored
	r1 := c.commit(first, h)
	r2 := c.commit(second, h)
	if r2.start != 0 || len(r2.pinned) != 2 || c.stored != 2 {
		t.Fatalf("second commit start %d holdings %d, stored counter %d; want 0, 2, 2 (blocks reused)", r2.start, len(r2.pinned), c.stored)
	}
	c.release(r1.pinned)
	if _, pinned := c.size(); pinned != 2 {
		t.Errorf("pinned %d after one of two holders released, want 2", pinned)
	}
	c.release(r2.pinned)
	if _, pinned := c.size(); pinned != 0 {
		t.Errorf("pinned %d after both released, want 0", pinned)
	}
}

func TestPrefixCacheClear(t *testing.T) {
	c := newPrefixCache(16, 10, 0)
	p := seqTokens(0, 48)
	runRequest(c, p)
	h := c.blockHashes(p)
	held := c.admit(h, len(p)) // hits 2 blocks, running
	c.clear()
	res := c.commit(held, h)
	if res.start != 0 || len(res.pinned) != 3 {
		t.Fatalf("after clear the running request stored from block %d (%d blocks), want from 0 (3)", res.start, len(res.pinned))
	}
	c.release(res.pinned)
	if cached, pinned := c.size(); cached != 3 || pinned != 0 {
		t.Errorf("size = %d cached %d pinned, want 3, 0", cached, pinned)
	}
}

func TestBlockHashesAreChainedAndSeeded(t *testing.T) {
	a := newPrefixCache(16, 1, 0)
	b := newPrefixCache(16, 1, 1)
	x := append(seqTokens(0, 16), seqTokens(0, 16)...)
	h := a.blockHashes(x)
	if len(h) != 2 || h[0] == h[1] {
		t.Fatalf("identical blocks at different positions must differ: %v", h)
	}
	if hb := b.blockHashes(x); hb[0] == h[0] {
		t.Error("a different HashSeed must give different engine hashes")
	}
	if again := a.blockHashes(append(x, 99)); !slices.Equal(again, h) {
		t.Error("the partial tail must not change the full-block hashes")
	}
}

func BenchmarkPrefixCache(b *testing.B) {
	// 64-block prompts sharing a 32-block prefix, cache of 512 blocks under churn.
	c := newPrefixCache(16, 512, 0)
	shared := seqTokens(0, 512)
	prompts := make([][]uint32, 64)
	for i := range prompts {
		prompts[i] = append(append([]uint32(nil), shared...), seqTokens(100000*(i+1), 512)...)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		runRequest(c, prompts[i%len(prompts)])
		i++
	}
}
