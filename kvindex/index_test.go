package kvindex

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// applyAll applies events, failing the test on errors other than the allowed ones.
func applyAll(t *testing.T, ix *Index, evs ...Event) {
	t.Helper()
	for i, ev := range evs {
		if err := ix.Apply(ev); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
	}
}

func matches(ix *Index, q ...uint64) []Match {
	return sortMatches(ix.FindMatches(q, nil))
}

var (
	wA  = cand(1, 0)
	wA1 = cand(1, 1)
	wB  = cand(2, 0)
	wC  = cand(3, 0)
)

func TestStoredRules(t *testing.T) {
	tests := []struct {
		name    string
		events  []Event
		lastErr error // error expected from the last event
		query   []uint64
		want    []Match
		entries uint64
	}{
		{
			name:    "a store from the root is matched block by block",
			events:  []Event{store(wA, TierDevice, nil, chainBlocks(100, 1, 2, 3))},
			query:   []uint64{1, 2, 3},
			want:    []Match{{Candidate: wA, Device: 3}},
			entries: 3,
		},
		{
			name: "a store below a known parent extends the chain",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1, 2)),
				store(wA, TierDevice, p(102), chainBlocks(100, 3)),
			},
			query:   []uint64{1, 2, 3, 4},
			want:    []Match{{Candidate: wA, Device: 3}},
			entries: 3,
		},
		{
			name: "an unknown parent skips the whole store and attaches nothing to the root",
			events: []Event{
				store(wA, TierDevice, p(999), chainBlocks(100, 1, 2)),
			},
			lastErr: ErrParentBlockNotFound,
			query:   []uint64{1, 2},
			want:    nil,
			entries: 0,
		},
		{
			name: "a parent known only to another worker is unknown",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1)),
				store(wB, TierDevice, p(101), chainBlocks(200, 2)),
			},
			lastErr: ErrParentBlockNotFound,
			query:   []uint64{1, 2},
			want:    []Match{{Candidate: wA, Device: 1}},
			entries: 1,
		},
		{
			name: "a parent known only to another dp_rank of the same worker is unknown",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1)),
				store(wA1, TierDevice, p(101), chainBlocks(100, 2)),
			},
			lastErr: ErrParentBlockNotFound,
			query:   []uint64{1, 2},
			want:    []Match{{Candidate: wA, Device: 1}},
			entries: 1,
		},
		{
			name: "a block equal to its parent skips the store",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1)),
				store(wA, TierDevice, p(101), blk(101, 2)),
			},
			lastErr: ErrInvalidBlockSequence,
			query:   []uint64{1, 2},
			want:    []Match{{Candidate: wA, Device: 1}},
			entries: 1,
		},
		{
			name: "a later block equal to the parent skips the store",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1)),
				store(wA, TierDevice, p(101), blk(102, 2, 101, 3)),
			},
			lastErr: ErrInvalidBlockSequence,
			query:   []uint64{1, 2, 3},
			want:    []Match{{Candidate: wA, Device: 1}},
			entries: 1,
		},
		{
			name:    "duplicate hashes inside one store skip the whole store",
			events:  []Event{store(wA, TierDevice, nil, blk(5, 1, 6, 2, 5, 3))},
			lastErr: ErrInvalidBlockSequence,
			query:   []uint64{1, 2, 3},
			entries: 0,
		},
		{
			name: "duplicate hashes in a long store skip the whole store",
			events: []Event{store(wA, TierDevice, nil, func() []StoredBlock {
				b := chainBlocks(100, seqToks(40)...)
				b[39].BlockHash = b[3].BlockHash
				return b
			}())},
			lastErr: ErrInvalidBlockSequence,
			query:   []uint64{1},
			entries: 0,
		},
		{
			name: "two workers sharing a prefix each resolve their own parents",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1, 2)),
				store(wB, TierDevice, nil, chainBlocks(200, 1)),
				store(wB, TierDevice, p(201), chainBlocks(200, 2, 3)),
			},
			query:   []uint64{1, 2, 3},
			want:    []Match{{Candidate: wA, Device: 2}, {Candidate: wB, Device: 3}},
			entries: 5,
		},
		{
			name: "re-storing the same blocks is idempotent",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1, 2)),
				store(wA, TierDevice, nil, chainBlocks(100, 1, 2)),
			},
			query:   []uint64{1, 2},
			want:    []Match{{Candidate: wA, Device: 2}},
			entries: 2,
		},
		{
			name: "an external hash re-stored at another position moves there",
			events: []Event{
				store(wA, TierDevice, nil, blk(7, 1)),
				store(wA, TierDevice, nil, blk(7, 2)),
			},
			query:   []uint64{1},
			want:    nil,
			entries: 1,
		},
		{
			name: "a block re-stored under a new external hash answers only to the new one",
			events: []Event{
				store(wA, TierDevice, nil, blk(7, 1)),
				store(wA, TierDevice, nil, blk(8, 1)),
				removed(wA, TierDevice, 7),
			},
			lastErr: ErrBlockNotFound,
			query:   []uint64{1},
			want:    []Match{{Candidate: wA, Device: 1}},
			entries: 1,
		},
		{
			name:    "an empty store changes nothing",
			events:  []Event{store(wA, TierDevice, nil, nil)},
			query:   []uint64{1},
			entries: 0,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix := New(Config{BlockSize: 4})
			var err error
			for _, ev := range tt.events {
				err = ix.Apply(ev)
			}
			if tt.lastErr == nil && err != nil {
				t.Fatalf("unexpected error %v", err)
			}
			if tt.lastErr != nil && !errors.Is(err, tt.lastErr) {
				t.Fatalf("error %v, want %v", err, tt.lastErr)
			}
			if diff := cmp.Diff(tt.want, matches(ix, tt.query...)); diff != "" {
				t.Fatalf("matches (-want +got):\n%s", diff)
			}
			if got := ix.Stats().Entries; got != tt.entries {
				t.Fatalf("entries %d want %d", got, tt.entries)
			}
		})
	}
}

func seqToks(n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(i + 1)
	}
	return out
}

func TestRemovedRules(t *testing.T) {
	t.Run("missing hashes are non-fatal and the rest of the removal applies", func(t *testing.T) {
		ix := New(Config{})
		applyAll(t, ix, store(wA, TierDevice, nil, chainBlocks(100, 1, 2, 3)))
		err := ix.Apply(removed(wA, TierDevice, 999, 103, 998))
		if !errors.Is(err, ErrBlockNotFound) {
			t.Fatalf("error %v", err)
		}
		if got := matches(ix, 1, 2, 3); !slices.Equal(got, []Match{{Candidate: wA, Device: 2}}) {
			t.Fatalf("got %v", got)
		}
		st := ix.Stats()
		if st.RemovalsBlockNotFound != 1 || st.BlocksNotFound != 2 || st.Entries != 2 || st.EventsApplied != 2 {
			t.Fatalf("stats %+v", st)
		}
	})
	t.Run("removing from an unknown candidate reports every hash missing", func(t *testing.T) {
		ix := New(Config{})
		if err := ix.Apply(removed(wA, TierDevice, 1, 2)); !errors.Is(err, ErrBlockNotFound) {
			t.Fatalf("error %v", err)
		}
		if st := ix.Stats(); st.BlocksNotFound != 2 {
			t.Fatalf("stats %+v", st)
		}
	})
	t.Run("removing a middle block cuts the candidate's consecutive match there", func(t *testing.T) {
		ix := New(Config{})
		applyAll(t, ix,
			store(wA, TierDevice, nil, chainBlocks(100, 1, 2, 3)),
			store(wB, TierDevice, nil, chainBlocks(200, 1, 2, 3)),
			removed(wA, TierDevice, 102))
		want := []Match{{Candidate: wA, Device: 1}, {Candidate: wB, Device: 3}}
		if diff := cmp.Diff(want, matches(ix, 1, 2, 3)); diff != "" {
			t.Fatal(diff)
		}
	})
	t.Run("an emptied node stops matching together with its subtree", func(t *testing.T) {
		ix := New(Config{})
		applyAll(t, ix,
			store(wA, TierDevice, nil, chainBlocks(100, 1)),
			store(wB, TierDevice, nil, chainBlocks(200, 1, 2)),
			removed(wB, TierDevice, 201), // node 1 keeps A; B's node 2 now hangs below a node B left
			removed(wA, TierDevice, 101)) // node 1 empties
		if got := matches(ix, 1, 2); len(got) != 0 {
			t.Fatalf("blocks below an emptied node matched: %v", got)
		}
		if got := ix.Stats().Entries; got != 1 {
			t.Fatalf("entries %d want 1 (B's entry below the emptied node)", got)
		}
		// Another worker storing the same path matches only its own blocks.
		applyAll(t, ix, store(wC, TierDevice, nil, chainBlocks(300, 1, 2)))
		if diff := cmp.Diff([]Match{{Candidate: wC, Device: 2}}, matches(ix, 1, 2)); diff != "" {
			t.Fatal(diff)
		}
		// B's entry is still in its lookup: removing it is not an error.
		applyAll(t, ix, removed(wB, TierDevice, 202))
		if got := ix.Stats().Entries; got != 2 {
			t.Fatalf("entries %d want 2", got)
		}
	})
	t.Run("a worker re-storing an emptied parent reconnects its own blocks below it", func(t *testing.T) {
		ix := New(Config{})
		applyAll(t, ix,
			store(wA, TierDevice, nil, chainBlocks(100, 1, 2, 3)),
			removed(wA, TierDevice, 101),
			// 103 is still known: storing below it succeeds.
			store(wA, TierDevice, p(103), chainBlocks(100, 4)))
		if got := matches(ix, 1, 2, 3, 4); len(got) != 0 {
			t.Fatalf("blocks below the removed parent matched: %v", got)
		}
		applyAll(t, ix, store(wA, TierDevice, nil, chainBlocks(100, 1)))
		if diff := cmp.Diff([]Match{{Candidate: wA, Device: 4}}, matches(ix, 1, 2, 3, 4)); diff != "" {
			t.Fatal(diff)
		}
	})
	t.Run("removing every block prunes the emptied path from the tree", func(t *testing.T) {
		ix := New(Config{})
		applyAll(t, ix,
			store(wA, TierDevice, nil, chainBlocks(100, 1, 2, 3)),
			removed(wA, TierDevice, 101, 102), // 1 and 2 stay as placeholders above 3
			removed(wA, TierDevice, 103))      // 3 goes, and the placeholders with it
		if n := blockCount(ix); n != 0 {
			t.Fatalf("%d emptied blocks are still allocated", n)
		}
		if st := ix.Stats(); st.Entries != 0 || st.Candidates != 0 {
			t.Fatalf("stats %+v", st)
		}
	})
	t.Run("results do not depend on how different workers' events interleave", func(t *testing.T) {
		b1 := store(wB, TierDevice, nil, chainBlocks(200, 1, 2))
		b2 := removed(wB, TierDevice, 201)
		b3 := store(wB, TierDevice, nil, chainBlocks(200, 1))
		a1 := store(wA, TierDevice, nil, chainBlocks(100, 1))
		a2 := removed(wA, TierDevice, 101)
		orders := [][]Event{
			{a1, b1, b2, a2, b3}, // node 1 empties while B is off it
			{a1, b1, b2, b3, a2}, // node 1 never empties
			{b1, b2, b3, a1, a2},
		}
		for i, order := range orders {
			ix := New(Config{})
			applyAll(t, ix, order...)
			if diff := cmp.Diff([]Match{{Candidate: wB, Device: 2}}, matches(ix, 1, 2)); diff != "" {
				t.Fatalf("order %d: %s", i, diff)
			}
		}
	})
	t.Run("a node keeps other workers when one removes it", func(t *testing.T) {
		ix := New(Config{})
		applyAll(t, ix,
			store(wA, TierDevice, nil, chainBlocks(100, 1, 2)),
			store(wB, TierDevice, nil, chainBlocks(200, 1, 2)),
			removed(wA, TierDevice, 101, 102))
		if diff := cmp.Diff([]Match{{Candidate: wB, Device: 2}}, matches(ix, 1, 2)); diff != "" {
			t.Fatal(diff)
		}
	})
}

func TestClearedAndRemoveWorker(t *testing.T) {
	setup := func(t *testing.T) *Index {
		ix := New(Config{})
		applyAll(t, ix,
			store(wA, TierDevice, nil, chainBlocks(100, 1, 2)),
			store(wA1, TierDevice, nil, chainBlocks(100, 1, 2)),
			store(wB, TierDevice, nil, chainBlocks(200, 1, 2)),
			store(wA, TierHostPinned, p(102), chainBlocks(100, 3)),
			store(wA1, TierDisk, p(102), chainBlocks(100, 3)))
		return ix
	}
	t.Run("cleared removes one dp_rank from every tier and leaves the others", func(t *testing.T) {
		ix := setup(t)
		applyAll(t, ix, cleared(wA))
		want := []Match{{Candidate: wA1, Device: 2, DiskExt: 1}, {Candidate: wB, Device: 2}}
		if diff := cmp.Diff(want, matches(ix, 1, 2, 3)); diff != "" {
			t.Fatal(diff)
		}
		st := ix.Stats()
		if st.Entries != 4 || st.TierEntries[TierHostPinned] != 0 || st.TierEntries[TierDisk] != 1 || st.Candidates != 2 {
			t.Fatalf("stats %+v", st)
		}
	})
	t.Run("a cleared candidate can store again from the root", func(t *testing.T) {
		ix := setup(t)
		applyAll(t, ix, cleared(wA), store(wA, TierDevice, nil, chainBlocks(500, 1)))
		want := []Match{{Candidate: wA, Device: 1}, {Candidate: wA1, Device: 2, DiskExt: 1}, {Candidate: wB, Device: 2}}
		if diff := cmp.Diff(want, matches(ix, 1, 2, 3)); diff != "" {
			t.Fatal(diff)
		}
		if err := ix.Apply(store(wA, TierDevice, p(102), chainBlocks(100, 9))); !errors.Is(err, ErrParentBlockNotFound) {
			t.Fatalf("old lookup survived the clear: %v", err)
		}
	})
	t.Run("clearing an unknown candidate is a no-op", func(t *testing.T) {
		ix := setup(t)
		applyAll(t, ix, cleared(cand(42, 0)))
		if got := ix.Stats().Entries; got != 6 {
			t.Fatalf("entries %d", got)
		}
	})
	t.Run("remove worker drops every rank and every tier of that worker only", func(t *testing.T) {
		ix := setup(t)
		ix.RemoveWorker(1)
		if diff := cmp.Diff([]Match{{Candidate: wB, Device: 2}}, matches(ix, 1, 2, 3)); diff != "" {
			t.Fatal(diff)
		}
		st := ix.Stats()
		if st.Entries != 2 || st.Candidates != 1 || st.TierEntries != [numTiers]uint64{2, 0, 0, 0} {
			t.Fatalf("stats %+v", st)
		}
	})
}

func TestFindMatches(t *testing.T) {
	ix := New(Config{})
	applyAll(t, ix,
		store(wA, TierDevice, nil, chainBlocks(100, 1, 2, 3, 4, 5, 6)),
		store(wB, TierDevice, nil, chainBlocks(200, 1, 2)),
		store(wC, TierDevice, nil, chainBlocks(300, 1, 7)),
		store(cand(4, 0), TierDevice, nil, chainBlocks(400, 9)))
	tests := []struct {
		name  string
		query []uint64
		want  []Match
	}{
		{"an empty query matches nothing", nil, nil},
		{"an unknown first block matches nothing", []uint64{8, 1}, nil},
		{"scores count consecutive blocks from the root", []uint64{1, 2, 3}, []Match{
			{Candidate: wA, Device: 3}, {Candidate: wB, Device: 2}, {Candidate: wC, Device: 1}}},
		{"the walk continues after a single candidate remains (early_exit false)", []uint64{1, 2, 3, 4, 5, 6, 7}, []Match{
			{Candidate: wA, Device: 6}, {Candidate: wB, Device: 2}, {Candidate: wC, Device: 1}}},
		{"a divergent branch is scored only for its holders", []uint64{1, 7}, []Match{
			{Candidate: wA, Device: 1}, {Candidate: wB, Device: 1}, {Candidate: wC, Device: 2}}},
		{"blocks deeper in the tree are not matched out of position", []uint64{2, 3}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, matches(ix, tt.query...)); diff != "" {
				t.Fatal(diff)
			}
		})
	}
	t.Run("a candidate missing a middle block scores only up to the gap", func(t *testing.T) {
		ix := New(Config{})
		applyAll(t, ix,
			store(wA, TierDevice, nil, chainBlocks(100, 1, 2, 3)),
			store(wB, TierDevice, nil, chainBlocks(200, 1, 2, 3)),
			removed(wB, TierDevice, 202))
		want := []Match{{Candidate: wA, Device: 3}, {Candidate: wB, Device: 1}}
		if diff := cmp.Diff(want, matches(ix, 1, 2, 3)); diff != "" {
			t.Fatal(diff)
		}
	})
	t.Run("matches are appended after dst's existing entries", func(t *testing.T) {
		dst := []Match{{Candidate: cand(99, 9)}}
		got := ix.FindMatches([]uint64{9}, dst)
		if len(got) != 2 || got[0].Candidate != cand(99, 9) || got[1] != (Match{Candidate: cand(4, 0), Device: 1}) {
			t.Fatalf("got %v", got)
		}
	})
	t.Run("FindMatches does not allocate when dst has capacity", func(t *testing.T) {
		dst := make([]Match, 0, 8)
		q := []uint64{1, 2, 3, 4, 5, 6, 7}
		if a := testing.AllocsPerRun(100, func() { dst = ix.FindMatches(q, dst[:0]) }); a != 0 {
			t.Fatalf("%v allocations", a)
		}
	})
}

func TestManyCandidatesUseSpilledBitsets(t *testing.T) {
	// 200 candidates: slots beyond 63 live in the spill words.
	ix := New(Config{})
	var want []Match
	for i := 0; i < 200; i++ {
		c := cand(uint64(i+1), uint32(i%3))
		k := 1 + i%10
		applyAll(t, ix, store(c, TierDevice, nil, chainBlocks(uint64(i)*1000, seqToks(k)...)))
		want = append(want, Match{Candidate: c, Device: uint32(k)})
	}
	t.Run("every candidate scores its own prefix length", func(t *testing.T) {
		if diff := cmp.Diff(sortMatches(want), matches(ix, seqToks(12)...)); diff != "" {
			t.Fatal(diff)
		}
	})
	t.Run("the walk with spilled bitsets does not allocate", func(t *testing.T) {
		dst := make([]Match, 0, 256)
		q := seqToks(12)
		if a := testing.AllocsPerRun(50, func() { dst = ix.FindMatches(q, dst[:0]) }); a != 0 {
			t.Fatalf("%v allocations", a)
		}
	})
	t.Run("external hashes are per candidate", func(t *testing.T) {
		got := ix.ExternalHashes(cand(151, 0), seqToks(12), 12)
		if !slices.Equal(got, []uint64{150001}) {
			t.Fatalf("got %v", got)
		}
	})
	t.Run("freed slots are reused without leaking old entries", func(t *testing.T) {
		for i := 0; i < 150; i++ {
			ix.RemoveWorker(uint64(i + 1))
		}
		c := cand(5000, 0)
		applyAll(t, ix, store(c, TierDevice, nil, chainBlocks(7000, 1)))
		got := matches(ix, seqToks(12)...)
		if len(got) != 51 {
			t.Fatalf("got %d matches", len(got))
		}
		if got[len(got)-1] != (Match{Candidate: c, Device: 1}) {
			t.Fatalf("new candidate matched %v", got[len(got)-1])
		}
		// Workers 1..64 filled shard 0 and all left: the new worker fills it again, in the
		// lowest free slot.
		k := ix.shardIndex(c.WorkerID, false)
		sh := ix.shards[k]
		sh.mu.RLock()
		s := sh.slotOf[c]
		nw := sh.nwords
		sh.mu.RUnlock()
		if k != 0 || s != 0 {
			t.Fatalf("new candidate got shard %d slot %d, want shard 0 slot 0", k, s)
		}
		if nw != 1 {
			t.Fatalf("nwords %d", nw)
		}
		if err := checkInvariants(ix); err != nil {
			t.Fatal(err)
		}
	})
}

func TestLowerTiers(t *testing.T) {
	tests := []struct {
		name    string
		events  []Event
		lastErr error
		query   []uint64
		want    []Match
	}{
		{
			name: "host extends beyond the device prefix",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1, 2)),
				store(wA, TierHostPinned, p(102), chainBlocks(100, 3, 4)),
			},
			query: []uint64{1, 2, 3, 4, 5},
			want:  []Match{{Candidate: wA, Device: 2, HostExt: 2}},
		},
		{
			name: "spec check: device 2, host 1, disk 2",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1, 2)),
				store(wA, TierHostPinned, p(102), chainBlocks(100, 3)),
				store(wA, TierDisk, p(103), chainBlocks(100, 4, 5)),
			},
			query: []uint64{1, 2, 3, 4, 5},
			want:  []Match{{Candidate: wA, Device: 2, HostExt: 1, DiskExt: 2}},
		},
		{
			name: "tiers chain in order device, host, disk, external",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1)),
				store(wA, TierHostPinned, p(101), chainBlocks(100, 2)),
				store(wA, TierDisk, p(102), chainBlocks(100, 3)),
				store(wA, TierExternal, p(103), chainBlocks(100, 4)),
			},
			query: []uint64{1, 2, 3, 4},
			want:  []Match{{Candidate: wA, Device: 1, HostExt: 1, DiskExt: 1, ExternalExt: 1}},
		},
		{
			name: "a lower tier counts only blocks beyond the higher-tier prefix",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1, 2, 3)),
				store(wA, TierHostPinned, nil, chainBlocks(100, 1, 2)),
			},
			query: []uint64{1, 2, 3},
			want:  []Match{{Candidate: wA, Device: 3}},
		},
		{
			name: "a disk block after a missing host block does not count",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1)),
				store(wA, TierHostPinned, p(101), chainBlocks(100, 2)),
				store(wA, TierDisk, p(102), chainBlocks(100, 3)),
				removed(wA, TierHostPinned, 102),
			},
			query: []uint64{1, 2, 3},
			want:  []Match{{Candidate: wA, Device: 1}},
		},
		{
			name: "a candidate only in lower tiers starts from the root",
			events: []Event{
				store(wB, TierHostPinned, nil, chainBlocks(200, 1, 2)),
				store(wB, TierExternal, p(202), chainBlocks(200, 3)),
			},
			query: []uint64{1, 2, 3},
			want:  []Match{{Candidate: wB, HostExt: 2, ExternalExt: 1}},
		},
		{
			name: "a device candidate that misses the first block also starts lower tiers from the root",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 9)),
				store(wA, TierDisk, nil, chainBlocks(500, 1)),
			},
			query: []uint64{1, 2},
			want:  []Match{{Candidate: wA, DiskExt: 1}},
		},
		{
			name: "a lower-tier parent may be known in another tier",
			events: []Event{
				store(wA, TierHostPinned, nil, chainBlocks(100, 1)),
				store(wA, TierDisk, p(101), chainBlocks(100, 2)),
			},
			query: []uint64{1, 2},
			want:  []Match{{Candidate: wA, HostExt: 1, DiskExt: 1}},
		},
		{
			name: "a lower-tier store with an unknown parent is skipped",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1)),
				store(wA, TierHostPinned, p(777), chainBlocks(100, 2)),
			},
			lastErr: ErrParentBlockNotFound,
			query:   []uint64{1, 2},
			want:    []Match{{Candidate: wA, Device: 1}},
		},
		{
			name: "lower-tier removals cut the extension and missing ones are reported",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1)),
				store(wA, TierHostPinned, p(101), chainBlocks(100, 2, 3)),
				removed(wA, TierHostPinned, 103, 555),
			},
			lastErr: ErrBlockNotFound,
			query:   []uint64{1, 2, 3},
			want:    []Match{{Candidate: wA, Device: 1, HostExt: 1}},
		},
		{
			name: "a lower-tier removal does not touch the device tier",
			events: []Event{
				store(wA, TierDevice, nil, chainBlocks(100, 1)),
				removed(wA, TierDisk, 101),
			},
			lastErr: ErrBlockNotFound,
			query:   []uint64{1},
			want:    []Match{{Candidate: wA, Device: 1}},
		},
		{
			name: "lower-tier extensions never exceed the query",
			events: []Event{
				store(wA, TierHostPinned, nil, chainBlocks(100, 1, 2, 3)),
			},
			query: []uint64{1, 2},
			want:  []Match{{Candidate: wA, HostExt: 2}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix := New(Config{})
			var err error
			for _, ev := range tt.events {
				err = ix.Apply(ev)
			}
			if tt.lastErr == nil && err != nil {
				t.Fatalf("unexpected error %v", err)
			}
			if tt.lastErr != nil && !errors.Is(err, tt.lastErr) {
				t.Fatalf("error %v want %v", err, tt.lastErr)
			}
			if diff := cmp.Diff(tt.want, matches(ix, tt.query...)); diff != "" {
				t.Fatalf("(-want +got):\n%s", diff)
			}
		})
	}
}

func TestExternalHashes(t *testing.T) {
	ix := New(Config{})
	applyAll(t, ix,
		store(wA, TierDevice, nil, chainBlocks(100, 1, 2, 3)),
		store(wB, TierDevice, nil, chainBlocks(200, 1, 2)))
	tests := []struct {
		name string
		c    Candidate
		n    int
		want []uint64
	}{
		{"returns the candidate's own ids for the first n blocks", wA, 2, []uint64{101, 102}},
		{"another worker on the same nodes gets its own ids", wB, 2, []uint64{201, 202}},
		{"stops where the candidate's device prefix ends", wB, 3, []uint64{201, 202}},
		{"n beyond the query is clamped", wA, 10, []uint64{101, 102, 103}},
		{"n of zero yields nothing", wA, 0, nil},
		{"an unknown candidate yields nothing", wC, 3, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, ix.ExternalHashes(tt.c, []uint64{1, 2, 3}, tt.n)); diff != "" {
				t.Fatal(diff)
			}
		})
	}
}

func TestInvalidEvents(t *testing.T) {
	tests := []struct {
		name string
		ev   Event
	}{
		{"an out-of-range tier is rejected", Event{WorkerID: 1, Tier: 9, Kind: EventStored, Blocks: blk(1, 1)}},
		{"a zero kind is rejected", Event{WorkerID: 1}},
		{"an out-of-range kind is rejected", Event{WorkerID: 1, Kind: 77}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix := New(Config{})
			if err := ix.Apply(tt.ev); !errors.Is(err, ErrInvalidEvent) {
				t.Fatalf("error %v", err)
			}
			if st := ix.Stats(); st.EventsInvalid != 1 || st.EventsApplied != 0 || st.Entries != 0 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

func TestStatsCountDropsByReason(t *testing.T) {
	ix := New(Config{})
	_ = ix.Apply(store(wA, TierDevice, nil, chainBlocks(100, 1, 2)))
	_ = ix.Apply(store(wA, TierDevice, p(5), chainBlocks(100, 3)))
	_ = ix.Apply(store(wA, TierDisk, p(5), chainBlocks(100, 3)))
	_ = ix.Apply(store(wA, TierDevice, nil, blk(1, 1, 1, 2)))
	_ = ix.Apply(removed(wA, TierDevice, 101, 9, 10))
	_ = ix.Apply(store(wA, TierHostPinned, p(102), chainBlocks(100, 3)))
	want := Stats{
		Candidates: 1, Entries: 1, TierEntries: [numTiers]uint64{1, 1, 0, 0},
		EventsApplied: 3, StoresParentNotFound: 2, StoresInvalidSequence: 1,
		RemovalsBlockNotFound: 1, BlocksNotFound: 2,
	}
	if diff := cmp.Diff(want, ix.Stats()); diff != "" {
		t.Fatalf("(-want +got):\n%s", diff)
	}
}

// TestIndexAgreesWithReferenceModel applies random event streams to the Index and to a naive
// map-based model written from the spec, comparing matches, entries and external hashes.
func TestIndexAgreesWithReferenceModel(t *testing.T) {
	configs := []struct {
		name string
		cfg  genConfig
	}{
		{"few workers, small universes, device only", genConfig{workers: 3, ranks: 2, toks: 4, exts: 8}},
		{"few workers with lower tiers", genConfig{workers: 3, ranks: 2, toks: 4, exts: 8, lowerTiers: true}},
		{"many candidates across spill words", genConfig{workers: 60, ranks: 3, toks: 5, exts: 10, lowerTiers: true}},
	}
	for _, c := range configs {
		t.Run(c.name+" agree on every query", func(t *testing.T) {
			for seed := uint64(0); seed < 20; seed++ {
				r := rand.New(rand.NewPCG(seed, 7))
				ix, m := New(Config{}), newModel()
				for step, ev := range genEvents(r, c.cfg, 600) {
					_ = ix.Apply(ev)
					m.apply(ev)
					if r.IntN(50) == 0 {
						w := uint64(r.IntN(c.cfg.workers) + 1)
						ix.RemoveWorker(w)
						m.removeWorker(w)
					}
					if step%25 != 0 {
						continue
					}
					for _, q := range genPrompts(r, ix, c.cfg.toks, 8) {
						if diff := cmp.Diff(m.findMatches(q), matches(ix, q...)); diff != "" {
							t.Fatalf("seed %d step %d query %v (-model +index):\n%s", seed, step, q, diff)
						}
					}
					if got, want := ix.Stats().Entries, m.entries(); got != want {
						t.Fatalf("seed %d step %d: entries %d, model %d", seed, step, got, want)
					}
					if err := checkInvariants(ix); err != nil {
						t.Fatalf("seed %d step %d: %v", seed, step, err)
					}
				}
			}
		})
	}
}
