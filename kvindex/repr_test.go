package kvindex

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestLargeLookupsGrowAndShrink drives a few candidates to thousands of entries each (so their
// external-hash buckets split many times, refill their split windows and, with a short id
// ladder, lose them as the shard's id space widens), with removals and re-stores, and compares
// the index with the reference model throughout.
func TestLargeLookupsGrowAndShrink(t *testing.T) {
	ladders := []struct {
		name   string
		ladder []uint8
	}{
		{"default id widths", nil},
		{"id width grows from 12 to 13, 14 and 32 bits", []uint8{12, 13, 14, 32}},
		{"no split windows after the first chunk", []uint8{12, 32}},
	}
	for _, l := range ladders {
		t.Run(l.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(11, 12))
			ix, m := New(Config{idLadder: l.ladder}), newModel()
			apply := func(ev Event) {
				_ = ix.Apply(ev)
				m.apply(ev)
			}
			// Three workers store chains of 1..200 blocks below random known blocks or the root;
			// tokens hashes come from a small pool so chains share prefixes.
			held := map[uint64][]uint64{}
			nextExt := map[uint64]uint64{}
			var queries [][]uint64
			for step := 0; step < 700; step++ {
				w := uint64(1 + r.IntN(3))
				c := cand(w, 0)
				switch k := r.IntN(10); {
				case k < 7:
					n := 1 + r.IntN(200)
					blocks := make([]StoredBlock, n)
					q := make([]uint64, n)
					for i := range blocks {
						nextExt[w]++
						q[i] = uint64(r.IntN(40))
						blocks[i] = StoredBlock{BlockHash: w<<40 | nextExt[w], TokensHash: q[i]}
					}
					ev := store(c, TierDevice, nil, blocks)
					if h := held[w]; len(h) > 0 && r.IntN(2) == 0 {
						ev.HasParent, ev.ParentHash = true, h[r.IntN(len(h))]
					} else if len(queries) < 40 {
						queries = append(queries, q)
					}
					for _, b := range blocks {
						held[w] = append(held[w], b.BlockHash)
					}
					apply(ev)
				case k < 9:
					h := held[w]
					if len(h) == 0 {
						continue
					}
					var rm []uint64
					for i := 0; i < 1+r.IntN(300); i++ {
						rm = append(rm, h[r.IntN(len(h))])
					}
					apply(removed(c, TierDevice, rm...))
				default:
					// Re-store a known hash elsewhere: the candidate leaves its old block.
					if h := held[w]; len(h) > 0 {
						apply(store(c, TierDevice, nil, blk(h[r.IntN(len(h))], uint64(r.IntN(40)))))
					}
				}
				if step%100 == 99 {
					if err := checkInvariants(ix); err != nil {
						t.Fatalf("step %d: %v", step, err)
					}
					if got, want := ix.Stats().Entries, m.entries(); got != want {
						t.Fatalf("step %d: entries %d, model %d", step, got, want)
					}
					for _, q := range append(queries, genPrompts(r, ix, 40, 20)...) {
						if diff := cmp.Diff(m.findMatches(q), matches(ix, q...)); diff != "" {
							t.Fatalf("step %d query %v (-model +index):\n%s", step, q, diff)
						}
					}
				}
			}
			if st := ix.Stats(); st.Entries < 2000 {
				t.Fatalf("only %d entries: the test did not grow the lookups", st.Entries)
			}
			for _, sh := range ix.shards {
				if l.ladder != nil && sh == ix.shards[0] && sh.idBits == l.ladder[0] {
					t.Fatalf("id width stayed at %d: the test did not widen the id space", sh.idBits)
				}
			}
		})
	}
}

// TestKidsHashCollision stores two children whose (parent, tokens_hash) pairs collide in the
// kids map's 64-bit key: both stay reachable, and removing either keeps the other.
func TestKidsHashCollision(t *testing.T) {
	ix := New(Config{})
	applyAll(t, ix, store(wA, TierDevice, nil, chainBlocks(100, 5, 6)))
	sh := ix.shards[0]
	blk5 := sh.childOf(rootID, 5) // block "5": its child "6" is the next id, so new children use the kids map
	collide := uint64(7) ^ kidHash(rootID, 0) ^ kidHash(blk5, 0)
	if kidHash(blk5, collide) != kidHash(rootID, 7) {
		t.Fatal("the test's keys do not collide")
	}
	applyAll(t, ix,
		store(wB, TierDevice, nil, chainBlocks(200, 7)),
		store(wA, TierDevice, p(105), chainBlocks(100, collide)))
	if len(sh.kidsOver) != 1 {
		t.Fatalf("overflow map %v", sh.kidsOver)
	}
	if err := checkInvariants(ix); err != nil {
		t.Fatal(err)
	}
	want := []Match{{Candidate: wA, Device: 2}}
	if diff := cmp.Diff(want, matches(ix, 5, collide)); diff != "" {
		t.Fatal(diff)
	}
	if diff := cmp.Diff([]Match{{Candidate: wB, Device: 1}}, matches(ix, 7)); diff != "" {
		t.Fatal(diff)
	}
	for _, ev := range []Event{removed(wB, TierDevice, 207), removed(wA, TierDevice, 100+collide)} {
		applyAll(t, ix, ev)
		if err := checkInvariants(ix); err != nil {
			t.Fatal(err)
		}
	}
	if got := matches(ix, 7); len(got) != 0 {
		t.Fatalf("removed child still matches: %v", got)
	}
	if got := matches(ix, 5, 6); !slices.Equal(got, []Match{{Candidate: wA, Device: 2}}) {
		t.Fatalf("got %v", got)
	}
}

// TestShardingDoesNotChangeResults applies the same streams to a single-shard index and to
// indexes spreading the workers over several shards: matches, external hashes, counters and the
// dump (byte for byte) are identical (§11.5: every indexer variant gives identical results).
func TestShardingDoesNotChangeResults(t *testing.T) {
	configs := []Config{{Shards: 4, ShardWorkers: 1}, {Shards: 3, ShardWorkers: 2}, {Shards: 8, ShardWorkers: 3}}
	for seed := uint64(0); seed < 15; seed++ {
		r := rand.New(rand.NewPCG(seed, 21))
		cfg := genConfig{workers: 9, ranks: 2, toks: 5, exts: 10, lowerTiers: seed%2 == 0}
		evs := genEvents(r, cfg, 800)
		ref := New(Config{Shards: 1})
		ixs := make([]*Index, len(configs))
		for i, c := range configs {
			ixs[i] = New(c)
		}
		for _, ev := range evs {
			wantErr := ref.Apply(ev)
			for i, ix := range ixs {
				if err := ix.Apply(ev); (err == nil) != (wantErr == nil) {
					t.Fatalf("seed %d config %d: error %v, single shard %v", seed, i, err, wantErr)
				}
			}
			if r.IntN(100) == 0 {
				w := uint64(1 + r.IntN(cfg.workers))
				ref.RemoveWorker(w)
				for _, ix := range ixs {
					ix.RemoveWorker(w)
				}
			}
		}
		refDump, _ := json.Marshal(ref.Dump())
		prompts := genPrompts(r, ref, cfg.toks, 60)
		for i, ix := range ixs {
			if err := checkInvariants(ix); err != nil {
				t.Fatalf("seed %d config %d: %v", seed, i, err)
			}
			if ix.opened.Load() < 2 {
				t.Fatalf("seed %d config %d: workers stayed in one shard", seed, i)
			}
			if diff := cmp.Diff(ref.Stats(), ix.Stats()); diff != "" {
				t.Fatalf("seed %d config %d stats (-single +sharded):\n%s", seed, i, diff)
			}
			for _, q := range prompts {
				if diff := cmp.Diff(matches(ref, q...), matches(ix, q...)); diff != "" {
					t.Fatalf("seed %d config %d query %v (-single +sharded):\n%s", seed, i, q, diff)
				}
				for w := uint64(1); w <= uint64(cfg.workers); w++ {
					c := cand(w, uint32(w%2))
					if diff := cmp.Diff(ref.ExternalHashes(c, q, len(q)), ix.ExternalHashes(c, q, len(q))); diff != "" {
						t.Fatalf("seed %d config %d: external hashes of %v for %v:\n%s", seed, i, c, q, diff)
					}
				}
			}
			if got, _ := json.Marshal(ix.Dump()); string(got) != string(refDump) {
				t.Fatalf("seed %d config %d: the dump differs from the single-shard dump", seed, i)
			}
		}
	}
}

// TestRestoreEqualsSequentialApply checks the restorer's regrouping of stores into chains
// against applying the same events one by one: for random event lists (stores of every tier
// with and without parents, removals, clears, reused hashes, parents stored later), the indexes,
// counters and error counts agree, also when restoring into a non-empty index.
func TestRestoreEqualsSequentialApply(t *testing.T) {
	for seed := uint64(0); seed < 40; seed++ {
		r := rand.New(rand.NewPCG(seed, 31))
		cfg := genConfig{workers: 4, ranks: 2, toks: 4, exts: 12, lowerTiers: seed%3 == 0}
		pre := genEvents(r, cfg, 100)
		var evs []RouterEvent
		if seed%2 == 0 {
			// A real dump, with a few extra events mixed in.
			src := New(Config{})
			for _, ev := range genEvents(r, cfg, 400) {
				_ = src.Apply(ev)
			}
			evs = src.Dump()
			for _, ev := range genEvents(r, cfg, 20) {
				evs = slices.Insert(evs, r.IntN(len(evs)+1), RouterEvent(ev))
			}
		} else {
			for _, ev := range genEvents(r, cfg, 300) {
				evs = append(evs, RouterEvent(ev))
			}
		}
		seq, res := New(Config{}), New(Config{Shards: 3, ShardWorkers: 1})
		for _, ev := range pre[:seed%2*100] {
			_ = seq.Apply(ev)
			_ = res.Apply(ev)
		}
		failed := 0
		var firstErr error
		for _, ev := range evs {
			if err := seq.Apply(Event(ev)); err != nil {
				failed++
				if firstErr == nil {
					firstErr = err
				}
			}
		}
		err := res.Restore(evs)
		if (err == nil) != (failed == 0) {
			t.Fatalf("seed %d: restore error %v, sequential failures %d", seed, err, failed)
		}
		if err != nil {
			var want error = errors.Unwrap(firstErr)
			if !errors.Is(err, want) {
				t.Fatalf("seed %d: restore error %v does not wrap %v", seed, err, want)
			}
			if wantMsg := fmt.Sprintf("restore: %d of %d events failed", failed, len(evs)); !strings.HasPrefix(err.Error(), wantMsg) {
				t.Fatalf("seed %d: restore error %q, want prefix %q", seed, err, wantMsg)
			}
		}
		if err := checkInvariants(res); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if diff := cmp.Diff(seq.Stats(), res.Stats()); diff != "" {
			t.Fatalf("seed %d stats (-sequential +restored):\n%s", seed, diff)
		}
		for _, q := range genPrompts(r, seq, cfg.toks, 50) {
			if diff := cmp.Diff(matches(seq, q...), matches(res, q...)); diff != "" {
				t.Fatalf("seed %d query %v (-sequential +restored):\n%s", seed, q, diff)
			}
		}
		a, _ := json.Marshal(seq.Dump())
		b, _ := json.Marshal(res.Dump())
		if string(a) != string(b) {
			t.Fatalf("seed %d: dumps differ", seed)
		}
	}
}

// TestLongChainsAcrossChunks stores chains longer than a chunk: they continue in the next
// chunk through a kids link, match end to end, and removals in the middle split them.
func TestLongChainsAcrossChunks(t *testing.T) {
	ix := New(Config{})
	toks := make([]uint64, 3*chunkSize+100)
	for i := range toks {
		toks[i] = uint64(i + 1)
	}
	applyAll(t, ix,
		store(wA, TierDevice, nil, chainBlocks(1<<32, toks...)),
		store(wB, TierDevice, nil, chainBlocks(2<<32, toks[:chunkSize+7]...)),
		store(wC, TierDevice, nil, chainBlocks(3<<32, toks[:10]...)))
	want := []Match{{Candidate: wA, Device: uint32(len(toks))}, {Candidate: wB, Device: chunkSize + 7}, {Candidate: wC, Device: 10}}
	if diff := cmp.Diff(want, matches(ix, toks...)); diff != "" {
		t.Fatal(diff)
	}
	if got := ix.ExternalHashes(wB, toks, len(toks)); len(got) != chunkSize+7 || got[chunkSize+6] != 2<<32+chunkSize+7 {
		t.Fatalf("external hashes of B: %d, last %d", len(got), got[len(got)-1])
	}
	applyAll(t, ix, removed(wA, TierDevice, 1<<32+chunkSize+50, 1<<32+2*chunkSize))
	want[0].Device = chunkSize + 49
	if diff := cmp.Diff(want, matches(ix, toks...)); diff != "" {
		t.Fatal(diff)
	}
	if err := checkInvariants(ix); err != nil {
		t.Fatal(err)
	}
	for _, c := range []Candidate{wA, wB, wC} {
		applyAll(t, ix, cleared(c))
	}
	if n := blockCount(ix); n != 0 {
		t.Fatalf("%d blocks left after clearing everyone", n)
	}
	if err := checkInvariants(ix); err != nil {
		t.Fatal(err)
	}
}

// TestWorkerAssignment: shards fill in order, a full set of shards takes new workers by load,
// a worker keeps its shard while it has entries and is assigned afresh after leaving, and events
// that store nothing assign nobody.
func TestWorkerAssignment(t *testing.T) {
	ix := New(Config{Shards: 3, ShardWorkers: 2})
	shardOf := func(w uint64) int32 { return ix.shardIndex(w, false) }
	for w := uint64(1); w <= 6; w++ {
		applyAll(t, ix, store(cand(w, 0), TierDevice, nil, chainBlocks(w*100, 1)))
	}
	for w, want := range map[uint64]int32{1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2} {
		if got := shardOf(w); got != want {
			t.Fatalf("worker %d in shard %d, want %d", w, got, want)
		}
	}
	ix.RemoveWorker(3)
	ix.RemoveWorker(4)
	applyAll(t, ix, store(cand(7, 0), TierDevice, nil, chainBlocks(700, 1)))
	if got := shardOf(7); got != 1 {
		t.Fatalf("new worker in shard %d, want the emptied shard 1", got)
	}
	if shardOf(3) != -1 {
		t.Fatal("a removed worker keeps its assignment")
	}
	_ = ix.Apply(removed(cand(9, 0), TierDevice, 1))
	_ = ix.Apply(cleared(cand(9, 0)))
	if shardOf(9) != -1 {
		t.Fatal("events that stored nothing assigned a shard")
	}
	if err := checkInvariants(ix); err != nil {
		t.Fatal(err)
	}
	if got := len(matches(ix, 1)); got != 5 {
		t.Fatalf("%d matches over the shards, want 5", got)
	}
}
