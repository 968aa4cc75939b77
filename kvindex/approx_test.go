package kvindex

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

func at(sec int) time.Time { return t0.Add(time.Duration(sec) * time.Second) }

func book(t *testing.T, a *Approx, c Candidate, now time.Time, local ...uint64) {
	t.Helper()
	if err := a.RecordBooking(c, local, now); err != nil {
		t.Fatal(err)
	}
	if err := checkApprox(a); err != nil {
		t.Fatal(err)
	}
}

func amatches(a *Approx, q ...uint64) []Match { return sortMatches(a.FindMatches(q, nil)) }

// checkApprox verifies the index invariants plus: the bookkeeping holds exactly the candidates'
// lookup entries, the heap indices are right, and each recency list has every entry once.
func checkApprox(a *Approx) error {
	a.sh.mu.RLock()
	err := checkShard(a.sh)
	a.sh.mu.RUnlock()
	if err != nil {
		return err
	}
	a.sh.mu.RLock()
	defer a.sh.mu.RUnlock()
	total := 0
	for c, pc := range a.per {
		s, ok := a.sh.slotOf[c]
		if !ok {
			return fmt.Errorf("bookkeeping for %v, which has no slot", c)
		}
		if got := a.sh.slots[s].ext.count; got != len(pc.entries) {
			return fmt.Errorf("%v: %d lookup entries, %d bookkeeping entries", c, got, len(pc.entries))
		}
		n := 0
		for e := pc.head; e != nil; e = e.next {
			if pc.entries[e.ext] != e {
				return fmt.Errorf("%v: recency list holds a stale entry", c)
			}
			if _, _, _, ok := a.sh.extFind(s, e.ext); !ok {
				return fmt.Errorf("%v: entry %d is not in the lookup", c, e.ext)
			}
			n++
		}
		if n != len(pc.entries) {
			return fmt.Errorf("%v: recency list has %d of %d entries", c, n, len(pc.entries))
		}
		total += n
	}
	for c, s := range a.sh.slotOf {
		if a.sh.slots[s].ext.count > 0 && a.per[c] == nil {
			return fmt.Errorf("%v has entries without bookkeeping", c)
		}
	}
	if len(a.byExpiry) != total {
		return fmt.Errorf("heap %d entries, bookkeeping %d", len(a.byExpiry), total)
	}
	for i, e := range a.byExpiry {
		if e.heapIdx != i {
			return fmt.Errorf("heap index %d stored as %d", i, e.heapIdx)
		}
	}
	return nil
}

func TestApproxRecordBooking(t *testing.T) {
	t.Run("a booking inserts the local hashes with the sequence-hash chain as external ids", func(t *testing.T) {
		a := NewApprox(ApproxConfig{BlockSize: 16})
		local := []uint64{11, 22, 33}
		book(t, a, wA, at(0), local...)
		if diff := cmp.Diff([]Match{{Candidate: wA, Device: 3}}, amatches(a, local...)); diff != "" {
			t.Fatal(diff)
		}
		if got := a.ExternalHashes(wA, local, 3); !slices.Equal(got, SequenceHashes(local)) {
			t.Fatalf("external ids %v", got)
		}
	})
	t.Run("bookings of different candidates share the prefix nodes", func(t *testing.T) {
		a := NewApprox(ApproxConfig{})
		book(t, a, wA, at(0), 1, 2, 3)
		book(t, a, wB, at(0), 1, 2, 4)
		want := []Match{{Candidate: wA, Device: 3}, {Candidate: wB, Device: 2}}
		if diff := cmp.Diff(want, amatches(a, 1, 2, 3)); diff != "" {
			t.Fatal(diff)
		}
		if got := a.Stats(); got.Entries != 6 || got.Bookings != 2 {
			t.Fatalf("stats %+v", got)
		}
	})
	t.Run("an empty booking records nothing", func(t *testing.T) {
		a := NewApprox(ApproxConfig{})
		book(t, a, wA, at(0))
		if got := a.Stats(); got.Entries != 0 || got.Bookings != 0 || got.Candidates != 0 {
			t.Fatalf("stats %+v", got)
		}
	})
	t.Run("the defaults are those of the spec", func(t *testing.T) {
		cfg := NewApprox(ApproxConfig{PruneTargetRatio: 3}).Config()
		if cfg.TTL != 120*time.Second || cfg.MaxTreeSize != 1<<20 || cfg.PruneTargetRatio != 0.8 || cfg.Policy != ApproxTTL {
			t.Fatalf("config %+v", cfg)
		}
	})
}

func TestApproxTTL(t *testing.T) {
	tests := []struct {
		name        string
		bookings    func(t *testing.T, a *Approx)
		expireAt    int
		wantRemoved int
		query       []uint64
		want        []Match
	}{
		{
			name:        "entries survive until their TTL has passed",
			bookings:    func(t *testing.T, a *Approx) { book(t, a, wA, at(0), 1, 2, 3) },
			expireAt:    119,
			wantRemoved: 0,
			query:       []uint64{1, 2, 3},
			want:        []Match{{Candidate: wA, Device: 3}},
		},
		{
			name:        "entries expire 120 s after insertion",
			bookings:    func(t *testing.T, a *Approx) { book(t, a, wA, at(0), 1, 2, 3) },
			expireAt:    120,
			wantRemoved: 3,
			query:       []uint64{1, 2, 3},
			want:        nil,
		},
		{
			name: "re-insertion refreshes the expiry",
			bookings: func(t *testing.T, a *Approx) {
				book(t, a, wA, at(0), 1, 2, 3)
				book(t, a, wA, at(60), 1, 2, 3)
			},
			expireAt:    170,
			wantRemoved: 0,
			query:       []uint64{1, 2, 3},
			want:        []Match{{Candidate: wA, Device: 3}},
		},
		{
			name: "only the re-inserted prefix is refreshed",
			bookings: func(t *testing.T, a *Approx) {
				book(t, a, wA, at(0), 1, 2, 3)
				book(t, a, wA, at(60), 1, 2)
			},
			expireAt:    150,
			wantRemoved: 1,
			query:       []uint64{1, 2, 3},
			want:        []Match{{Candidate: wA, Device: 2}},
		},
		{
			name: "expiry removes entries as if Removed, leaving other candidates' entries",
			bookings: func(t *testing.T, a *Approx) {
				book(t, a, wA, at(0), 1, 2)
				book(t, a, wB, at(100), 1, 2)
			},
			expireAt:    130,
			wantRemoved: 2,
			query:       []uint64{1, 2},
			want:        []Match{{Candidate: wB, Device: 2}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := NewApprox(ApproxConfig{})
			tt.bookings(t, a)
			if got := a.ExpireBefore(at(tt.expireAt)); got != tt.wantRemoved {
				t.Fatalf("removed %d want %d", got, tt.wantRemoved)
			}
			if err := checkApprox(a); err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.want, amatches(a, tt.query...)); diff != "" {
				t.Fatal(diff)
			}
			if got := a.Stats().Expired; got != uint64(tt.wantRemoved) {
				t.Fatalf("Expired counter %d", got)
			}
		})
	}
	t.Run("a custom TTL is honoured", func(t *testing.T) {
		a := NewApprox(ApproxConfig{TTL: 5 * time.Second})
		book(t, a, wA, at(0), 1)
		if a.ExpireBefore(at(4)) != 0 || a.ExpireBefore(at(5)) != 1 {
			t.Fatal("custom TTL not applied")
		}
	})
}

func TestApproxSizeCap(t *testing.T) {
	t.Run("exceeding max_tree_size prunes to the target ratio, earliest expiry first and deepest first on ties", func(t *testing.T) {
		a := NewApprox(ApproxConfig{MaxTreeSize: 10, PruneTargetRatio: 0.8})
		book(t, a, wA, at(0), 1, 2, 3, 4)
		book(t, a, wB, at(1), 1, 2, 3, 4)
		book(t, a, wC, at(2), 5, 6, 7) // 11 entries > 10: prune to 8
		st := a.Stats()
		if st.Entries != 8 || st.Pruned != 3 {
			t.Fatalf("stats %+v", st)
		}
		want := []Match{{Candidate: wA, Device: 1}, {Candidate: wB, Device: 4}}
		if diff := cmp.Diff(want, amatches(a, 1, 2, 3, 4)); diff != "" {
			t.Fatal(diff)
		}
		if diff := cmp.Diff([]Match{{Candidate: wC, Device: 3}}, amatches(a, 5, 6, 7)); diff != "" {
			t.Fatal(diff)
		}
	})
	t.Run("staying at max_tree_size does not prune", func(t *testing.T) {
		a := NewApprox(ApproxConfig{MaxTreeSize: 4})
		book(t, a, wA, at(0), 1, 2, 3, 4)
		if st := a.Stats(); st.Entries != 4 || st.Pruned != 0 {
			t.Fatalf("stats %+v", st)
		}
	})
}

func TestApproxLRU(t *testing.T) {
	newLRU := func() *Approx {
		a := NewApprox(ApproxConfig{Policy: ApproxLRU})
		a.SetWorkerCapacity(wA.WorkerID, 4)
		return a
	}
	t.Run("inserting beyond capacity evicts the least recently inserted blocks, deepest first", func(t *testing.T) {
		a := newLRU()
		book(t, a, wA, at(0), 1, 2, 3)
		book(t, a, wA, at(1), 5, 6)
		if diff := cmp.Diff([]Match{{Candidate: wA, Device: 2}}, amatches(a, 1, 2, 3)); diff != "" {
			t.Fatal(diff)
		}
		if diff := cmp.Diff([]Match{{Candidate: wA, Device: 2}}, amatches(a, 5, 6)); diff != "" {
			t.Fatal(diff)
		}
		if got := a.Stats().Evicted; got != 1 {
			t.Fatalf("evicted %d", got)
		}
	})
	t.Run("re-insertion makes blocks recent again", func(t *testing.T) {
		a := newLRU()
		book(t, a, wA, at(0), 1, 2)
		book(t, a, wA, at(1), 5, 6)
		book(t, a, wA, at(2), 1, 2)
		book(t, a, wA, at(3), 7)
		if diff := cmp.Diff([]Match{{Candidate: wA, Device: 2}}, amatches(a, 1, 2)); diff != "" {
			t.Fatal(diff)
		}
		if diff := cmp.Diff([]Match{{Candidate: wA, Device: 1}}, amatches(a, 5, 6)); diff != "" {
			t.Fatal(diff)
		}
	})
	t.Run("capacity applies to every rank of the worker separately and not to other workers", func(t *testing.T) {
		a := newLRU()
		book(t, a, wA, at(0), 1, 2, 3, 4, 5)
		book(t, a, wA1, at(0), 1, 2, 3, 4, 5)
		book(t, a, wB, at(0), 1, 2, 3, 4, 5)
		want := []Match{{Candidate: wA, Device: 4}, {Candidate: wA1, Device: 4}, {Candidate: wB, Device: 5}}
		if diff := cmp.Diff(want, amatches(a, 1, 2, 3, 4, 5)); diff != "" {
			t.Fatal(diff)
		}
	})
	t.Run("lowering the capacity trims at once", func(t *testing.T) {
		a := newLRU()
		book(t, a, wA, at(0), 1, 2, 3, 4)
		a.SetWorkerCapacity(wA.WorkerID, 2)
		if err := checkApprox(a); err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff([]Match{{Candidate: wA, Device: 2}}, amatches(a, 1, 2, 3, 4)); diff != "" {
			t.Fatal(diff)
		}
	})
	t.Run("TTL still applies under LRU", func(t *testing.T) {
		a := newLRU()
		book(t, a, wA, at(0), 1)
		if a.ExpireBefore(at(120)) != 1 {
			t.Fatal("not expired")
		}
	})
	t.Run("the TTL policy ignores capacities", func(t *testing.T) {
		a := NewApprox(ApproxConfig{})
		a.SetWorkerCapacity(wA.WorkerID, 1)
		book(t, a, wA, at(0), 1, 2, 3)
		if got := a.Stats().Entries; got != 3 {
			t.Fatalf("entries %d", got)
		}
	})
}

func TestApproxRemoveWorkerAndRestore(t *testing.T) {
	t.Run("removing a worker drops its entries and bookkeeping", func(t *testing.T) {
		a := NewApprox(ApproxConfig{})
		book(t, a, wA, at(0), 1, 2)
		book(t, a, wA1, at(0), 1, 2)
		book(t, a, wB, at(0), 1)
		a.RemoveWorker(wA.WorkerID)
		if err := checkApprox(a); err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff([]Match{{Candidate: wB, Device: 1}}, amatches(a, 1, 2)); diff != "" {
			t.Fatal(diff)
		}
		if a.ExpireBefore(at(1000)) != 1 {
			t.Fatal("only B's entry should be left to expire")
		}
	})
	t.Run("clearing one rank keeps the worker's other ranks", func(t *testing.T) {
		a := NewApprox(ApproxConfig{})
		book(t, a, wA, at(0), 1, 2)
		book(t, a, wA1, at(0), 1, 2)
		a.Clear(wA)
		if err := checkApprox(a); err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff([]Match{{Candidate: wA1, Device: 2}}, amatches(a, 1, 2)); diff != "" {
			t.Fatal(diff)
		}
	})
	t.Run("a restored dump reproduces the matches and expires TTL after the restore time", func(t *testing.T) {
		a := NewApprox(ApproxConfig{})
		book(t, a, wA, at(0), 1, 2, 3)
		book(t, a, wB, at(0), 1, 2)
		b := NewApprox(ApproxConfig{})
		if err := b.Restore(a.Dump(), at(500)); err != nil {
			t.Fatal(err)
		}
		if err := checkApprox(b); err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(amatches(a, 1, 2, 3), amatches(b, 1, 2, 3)); diff != "" {
			t.Fatal(diff)
		}
		if b.ExpireBefore(at(619)) != 0 || b.ExpireBefore(at(620)) != 5 {
			t.Fatal("restored entries did not get the restore-time expiry")
		}
	})
	t.Run("restored entries keep their depth for pruning ties", func(t *testing.T) {
		a := NewApprox(ApproxConfig{})
		book(t, a, wA, at(0), 1, 2, 3)
		b := NewApprox(ApproxConfig{MaxTreeSize: 3, PruneTargetRatio: 0.67})
		if err := b.Restore(a.Dump(), at(0)); err != nil {
			t.Fatal(err)
		}
		book(t, b, wB, at(0), 9) // 4 entries > 3: prune to 2, deepest first among equal expiries
		if got := b.Stats().Entries; got != 2 {
			t.Fatalf("entries %d", got)
		}
		if diff := cmp.Diff([]Match{{Candidate: wA, Device: 1}}, amatches(b, 1, 2, 3)); diff != "" {
			t.Fatal(diff)
		}
		if diff := cmp.Diff([]Match{{Candidate: wB, Device: 1}}, amatches(b, 9)); diff != "" {
			t.Fatal(diff)
		}
	})
}

// TestApproxRandomOperations mixes bookings, expiry, capacity changes and worker removal and
// checks the bookkeeping invariants after every step.
func TestApproxRandomOperations(t *testing.T) {
	for seed := uint64(0); seed < 10; seed++ {
		r := rand.New(rand.NewPCG(seed, 11))
		a := NewApprox(ApproxConfig{MaxTreeSize: 40, Policy: ApproxLRU, TTL: 30 * time.Second})
		now := 0
		for step := 0; step < 400; step++ {
			c := cand(uint64(r.IntN(5)+1), uint32(r.IntN(2)))
			switch k := r.IntN(10); {
			case k < 7:
				q := make([]uint64, 1+r.IntN(6))
				for i := range q {
					q[i] = uint64(r.IntN(4))
				}
				book(t, a, c, at(now), q...)
			case k < 8:
				now += r.IntN(20)
				a.ExpireBefore(at(now))
			case k < 9:
				a.SetWorkerCapacity(c.WorkerID, r.IntN(8))
			default:
				a.RemoveWorker(c.WorkerID)
			}
			if err := checkApprox(a); err != nil {
				t.Fatalf("seed %d step %d: %v", seed, step, err)
			}
			if got := a.Stats().Entries; got > 40 {
				t.Fatalf("seed %d step %d: %d entries above the cap", seed, step, got)
			}
		}
	}
}
