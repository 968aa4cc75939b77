package ledger

import (
	"strconv"
	"testing"
	"time"
)

func pkey(id string) PendingKey {
	return PendingKey{ModelName: "model", RoutingGroup: "default", SelectionID: id}
}

func psel(worker uint64, nHashes int) PendingSelection {
	return PendingSelection{
		Candidate:              Candidate{WorkerID: worker},
		SequenceHashes:         make([]uint64, nHashes),
		ISLTokens:              4,
		EffectivePrefillTokens: 4,
		TrackPrefillTokens:     true,
	}
}

// checkOrder asserts the order list holds exactly the map's entries, oldest first, and that the
// byte count is their sum — the order index is bounded by the live entries.
func checkOrder(t *testing.T, c *PendingCache) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	n, bytes := 0, int64(0)
	var prev *pendingEntry
	for e := c.head; e != nil; e = e.next {
		if e.prev != prev {
			t.Fatalf("order list broken at %v", e.key)
		}
		if c.entries[e.key] != e {
			t.Fatalf("order list holds %v which the map does not", e.key)
		}
		n++
		bytes += e.size
		prev = e
	}
	if prev != c.tail {
		t.Fatalf("tail mismatch")
	}
	if n != len(c.entries) {
		t.Fatalf("order list has %d entries, map has %d", n, len(c.entries))
	}
	if bytes != c.bytes {
		t.Fatalf("byte count %d, entries sum to %d", c.bytes, bytes)
	}
}

func TestPendingEntrySizeFollowsTheSpecFormula(t *testing.T) {
	k := PendingKey{ModelName: "model", RoutingGroup: "default", SelectionID: "select-123"}
	s := PendingSelection{SequenceHashes: make([]uint64, 8), LoraName: "lora-a"}
	if got, want := PendingEntrySize(k, &s), int64(8*8+10+5+7+6); got != want {
		t.Fatalf("PendingEntrySize = %d, want %d", got, want)
	}
}

func TestPendingCacheDefaults(t *testing.T) {
	c := NewPendingCache(PendingConfig{})
	if got := c.Config(); got != (PendingConfig{TTL: 120 * time.Second, MaxEntries: 4096, MaxBytes: 268435456}) {
		t.Fatalf("defaults = %+v", got)
	}
	for _, bad := range []PendingConfig{{TTL: -1}, {MaxEntries: -1}, {MaxBytes: -1}} {
		if bad.Validate() == nil {
			t.Errorf("Validate(%+v) accepted a negative bound", bad)
		}
	}
}

// Acceptance 56: peek-then-remove consumes once; expired entries are refused; insertion sweeps
// expired entries; the entry cap and the byte budget both evict oldest first; a removal yields
// to a newer selection for the same key; the order index stays bounded by the live entries.
func TestPendingCache(t *testing.T) {
	t.Run("peek then remove consumes the entry exactly once", func(t *testing.T) {
		c := NewPendingCache(PendingConfig{})
		gen, stored := c.Put(pkey("a"), psel(1, 1), t0)
		if !stored {
			t.Fatal("not stored")
		}
		got, g, ok := c.Peek(pkey("a"), t0)
		if !ok || g != gen || got.Candidate.WorkerID != 1 {
			t.Fatalf("Peek = %+v %d %v", got, g, ok)
		}
		if _, _, ok := c.Peek(pkey("a"), t0); !ok {
			t.Fatal("a peek consumed the entry")
		}
		if !c.Remove(pkey("a"), gen) {
			t.Fatal("Remove with the peeked generation failed")
		}
		if _, _, ok := c.Peek(pkey("a"), t0); ok {
			t.Fatal("entry still there after Remove")
		}
		if c.Remove(pkey("a"), gen) {
			t.Fatal("second Remove succeeded")
		}
		checkOrder(t, c)
	})
	t.Run("a key differs by model, group and id", func(t *testing.T) {
		c := NewPendingCache(PendingConfig{})
		c.Put(pkey("a"), psel(1, 1), t0)
		for _, k := range []PendingKey{
			{ModelName: "other", RoutingGroup: "default", SelectionID: "a"},
			{ModelName: "model", RoutingGroup: "g2", SelectionID: "a"},
			pkey("b"),
		} {
			if _, _, ok := c.Peek(k, t0); ok {
				t.Errorf("Peek(%+v) found the entry of another key", k)
			}
		}
		if _, _, ok := c.Peek(pkey("a"), t0); !ok {
			t.Error("misses for other keys consumed the entry")
		}
	})
	t.Run("expired entries are refused at lookup", func(t *testing.T) {
		c := NewPendingCache(PendingConfig{TTL: 10 * time.Second})
		c.Put(pkey("a"), psel(1, 1), t0)
		if _, _, ok := c.Peek(pkey("a"), t0.Add(9999*time.Millisecond)); !ok {
			t.Fatal("entry gone before its TTL")
		}
		if _, _, ok := c.Peek(pkey("a"), t0.Add(10*time.Second)); ok {
			t.Fatal("entry served at its TTL")
		}
		if c.Len() != 0 {
			t.Fatalf("expired entry kept after lookup: %d", c.Len())
		}
		checkOrder(t, c)
	})
	t.Run("insertion sweeps expired entries from the oldest", func(t *testing.T) {
		c := NewPendingCache(PendingConfig{TTL: 10 * time.Second})
		c.Put(pkey("a"), psel(1, 1), t0)
		c.Put(pkey("b"), psel(1, 1), t0.Add(5*time.Second))
		c.Put(pkey("c"), psel(1, 1), t0.Add(12*time.Second))
		if c.Len() != 2 {
			t.Fatalf("Len = %d after inserting past a's TTL, want 2", c.Len())
		}
		if _, _, ok := c.Peek(pkey("b"), t0.Add(12*time.Second)); !ok {
			t.Fatal("live entry b swept")
		}
		checkOrder(t, c)
	})
	t.Run("the entry cap evicts oldest first", func(t *testing.T) {
		c := NewPendingCache(PendingConfig{MaxEntries: 3})
		for i := range 5 {
			c.Put(pkey(strconv.Itoa(i)), psel(1, 1), t0.Add(time.Duration(i)*time.Millisecond))
		}
		for i := range 5 {
			_, _, ok := c.Peek(pkey(strconv.Itoa(i)), t0)
			if want := i >= 2; ok != want {
				t.Errorf("entry %d present = %v, want %v", i, ok, want)
			}
		}
		checkOrder(t, c)
	})
	t.Run("the byte budget evicts oldest first", func(t *testing.T) {
		one := PendingEntrySize(pkey("0"), &PendingSelection{SequenceHashes: make([]uint64, 4)}) // 8*4+1+5+7
		c := NewPendingCache(PendingConfig{MaxBytes: 3 * one})
		for i := range 4 {
			c.Put(pkey(strconv.Itoa(i)), psel(1, 4), t0)
		}
		if c.Len() != 3 || c.Bytes() != 3*one {
			t.Fatalf("Len %d Bytes %d, want 3 and %d", c.Len(), c.Bytes(), 3*one)
		}
		if _, _, ok := c.Peek(pkey("0"), t0); ok {
			t.Error("oldest entry survived the byte budget")
		}
		checkOrder(t, c)
	})
	t.Run("an entry larger than the budget evicts itself", func(t *testing.T) {
		c := NewPendingCache(PendingConfig{MaxBytes: 100})
		c.Put(pkey("small"), psel(1, 1), t0)
		if _, stored := c.Put(pkey("huge"), psel(1, 100), t0); stored {
			t.Fatal("an entry over the whole budget was stored")
		}
		if _, _, ok := c.Peek(pkey("small"), t0); !ok || c.Len() != 1 {
			t.Fatalf("the oversized entry evicted others: Len %d", c.Len())
		}
		checkOrder(t, c)
	})
	t.Run("replacement is latest wins and resets the TTL", func(t *testing.T) {
		c := NewPendingCache(PendingConfig{TTL: 10 * time.Second})
		g1, _ := c.Put(pkey("a"), psel(1, 1), t0)
		g2, _ := c.Put(pkey("a"), psel(2, 1), t0.Add(8*time.Second))
		if g2 == g1 {
			t.Fatal("replacement kept the generation")
		}
		got, g, ok := c.Peek(pkey("a"), t0.Add(15*time.Second))
		if !ok || g != g2 || got.Candidate.WorkerID != 2 {
			t.Fatalf("Peek after replacement = %+v %d %v", got, g, ok)
		}
		if c.Len() != 1 {
			t.Fatalf("Len = %d", c.Len())
		}
		checkOrder(t, c)
	})
	t.Run("a removal yields to a newer selection for the same key", func(t *testing.T) {
		c := NewPendingCache(PendingConfig{})
		old, _ := c.Put(pkey("a"), psel(1, 1), t0)
		newer, _ := c.Put(pkey("a"), psel(2, 1), t0)
		if c.Remove(pkey("a"), old) {
			t.Fatal("an old generation removed the newer selection")
		}
		if got, _, ok := c.Peek(pkey("a"), t0); !ok || got.Candidate.WorkerID != 2 {
			t.Fatal("newer selection lost")
		}
		if !c.Remove(pkey("a"), newer) {
			t.Fatal("current generation could not remove")
		}
	})
	t.Run("discard drops the entry whatever its generation", func(t *testing.T) {
		c := NewPendingCache(PendingConfig{})
		c.Put(pkey("a"), psel(1, 1), t0)
		if !c.Discard(pkey("a")) || c.Discard(pkey("a")) {
			t.Fatal("Discard did not drop exactly once")
		}
	})
	t.Run("the order index stays bounded by the live entries under churn", func(t *testing.T) {
		c := NewPendingCache(PendingConfig{MaxEntries: 64, TTL: time.Second})
		now := t0
		for i := range 20000 {
			now = now.Add(time.Millisecond)
			k := pkey(strconv.Itoa(i % 100))
			g, _ := c.Put(k, psel(1, i%7), now)
			if i%3 == 0 {
				c.Remove(k, g)
			}
		}
		checkOrder(t, c)
		if c.Len() > 64 {
			t.Fatalf("Len %d over the cap", c.Len())
		}
		c.Sweep(now.Add(2 * time.Second))
		if c.Len() != 0 || c.Bytes() != 0 {
			t.Fatalf("after sweeping everything: Len %d Bytes %d", c.Len(), c.Bytes())
		}
		checkOrder(t, c)
	})
}

// BenchmarkPendingPutPeekRemove measures one select's Put plus a replay's Peek and Remove in a
// cache holding 4096 entries.
func BenchmarkPendingPutPeekRemove(b *testing.B) {
	c := NewPendingCache(PendingConfig{})
	for i := range 4096 {
		c.Put(pkey("bg"+strconv.Itoa(i)), psel(1, 32), t0)
	}
	keys := make([]PendingKey, 1024)
	for i := range keys {
		keys[i] = pkey("k" + strconv.Itoa(i))
	}
	sel := psel(1, 32)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		k := keys[i%len(keys)]
		c.Put(k, sel, t0)
		_, g, _ := c.Peek(k, t0)
		c.Remove(k, g)
	}
}
