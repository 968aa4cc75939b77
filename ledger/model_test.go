package ledger

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
	"time"
)

// checkInvariants recounts every candidate's state from the live slots and compares it with the
// incrementally maintained tables, exclusive counts and deficits.
func checkInvariants(t testing.TB, l *Ledger) {
	t.Helper()
	l.mu.RLock()
	defer l.mu.RUnlock()
	live, claims := 0, 0
	for id, idx := range l.ids {
		if idx == claimedSlot {
			claims++
			continue
		}
		live++
		if s := l.slots[idx]; !s.live || s.b.ID != id {
			t.Fatalf("ids[%q] = %d points at slot %+v", id, idx, s.b)
		}
	}
	if live != l.live || claims != l.claims {
		t.Fatalf("counters: live %d/%d claims %d/%d", live, l.live, claims, l.claims)
	}
	type holding struct {
		count int
		xor   uint32
		slots map[int32]int
	}
	for c, r := range l.ranks {
		if r.c != c {
			t.Fatalf("rank key %v holds %v", c, r.c)
		}
		var requests uint64
		var prefill wideSum
		held := map[uint64]*holding{}
		listed := map[int32]bool{}
		for i := r.head; i >= 0; i = l.slots[i].next {
			if listed[i] {
				t.Fatalf("%v: booking list has a cycle at slot %d", c, i)
			}
			listed[i] = true
		}
		// r.pending counts exactly the live bookings with prefill tokens still pending.
		var pending uint64
		for _, s := range l.slots {
			if s.live && s.rank == r && !s.b.PrefillCompleted && s.b.PrefillTokens > 0 {
				pending++
			}
		}
		if pending != r.pending {
			t.Fatalf("%v: %d bookings have prefill pending, r.pending is %d", c, pending, r.pending)
		}
		for i, s := range l.slots {
			idx := int32(i)
			if !s.live || s.rank != r {
				continue
			}
			if !listed[idx] {
				t.Fatalf("%v: live slot %d (%s) missing from the rank list", c, idx, s.b.ID)
			}
			requests++
			if !s.b.PrefillCompleted {
				prefill.add(s.b.PrefillTokens)
			}
			if !l.track {
				continue
			}
			for _, hs := range [][]uint64{s.b.SequenceHashes, s.outputs} {
				for _, h := range hs {
					hd := held[h]
					if hd == nil {
						hd = &holding{slots: map[int32]int{}}
						held[h] = hd
					}
					hd.count++
					hd.xor ^= uint32(idx)
					hd.slots[idx]++
				}
			}
		}
		if int(requests) != len(listed) || requests != r.requests || prefill != r.prefill {
			t.Fatalf("%v: requests %d (listed %d, stored %d), prefill %+v (stored %+v)", c, requests, len(listed), r.requests, prefill, r.prefill)
		}
		if len(held) != r.blocks.n {
			t.Fatalf("%v: %d distinct hashes, table holds %d", c, len(held), r.blocks.n)
		}
		excl := map[int32]uint64{}
		var weight float64
		for h, hd := range held {
			i, ok := r.blocks.find(h)
			if !ok || int(r.blocks.vals[i].count) != hd.count || r.blocks.vals[i].xor != hd.xor {
				t.Fatalf("%v: hash %d: table %+v (found %v), recount %d/%d", c, h, r.blocks.vals[i], ok, hd.count, hd.xor)
			}
			if hd.count == 1 {
				excl[int32(hd.xor)]++
				weight += l.slots[hd.xor].b.DecayFraction
			} else {
				weight++
			}
		}
		var deficit, private uint64
		for i, s := range l.slots {
			if !s.live || s.rank != r {
				continue
			}
			if s.excl != excl[int32(i)] {
				t.Fatalf("%v: slot %d (%s) exclusive %d, recount %d", c, i, s.b.ID, s.excl, excl[int32(i)])
			}
			deficit += (s.excl + s.private) * s.q
			private += s.private
			weight += float64(s.private) * s.b.DecayFraction // counted output blocks: distinct, exclusive
		}
		if deficit != r.deficit || private != r.private {
			t.Fatalf("%v: deficit %d, recount %d; private %d, recount %d", c, r.deficit, deficit, r.private, private)
		}
		if frac := weight - math.Floor(weight); math.Abs(frac-0.5) > 1e-6 {
			if got, want := r.activeBlocks(), uint64(math.Round(weight)); got != want {
				t.Fatalf("%v: active blocks %d, Σ weight %v rounds to %d", c, got, weight, want)
			}
		}
	}
}

// refBooking / refLedger are a naive model of §10.3: every Load is recomputed from scratch.
type refBooking struct {
	c        Candidate
	hashes   []uint64
	prefill  uint64
	done     bool
	decay    float64
	admitted time.Time
}

type refLedger struct {
	track    bool
	claims   map[string]bool
	bookings map[string]*refBooking
}

func (m *refLedger) load(c Candidate) Load {
	var ld Load
	holders := map[uint64][]*refBooking{}
	for _, b := range m.bookings {
		if b.c != c {
			continue
		}
		ld.ActiveRequests++
		if !b.done {
			ld.ActivePrefillTokens += b.prefill
			if b.prefill > 0 {
				ld.PrefillRequests++
			}
		}
		if m.track {
			for _, h := range b.hashes {
				holders[h] = append(holders[h], b)
			}
		}
	}
	var w float64
	for _, hs := range holders {
		if len(hs) >= 2 {
			w++
		} else {
			w += hs[0].decay
		}
	}
	ld.ActiveBlocks = uint64(math.Round(w))
	return ld
}

func TestLedgerMatchesNaiveModel(t *testing.T) {
	for _, track := range []bool{true, false} {
		t.Run(fmt.Sprintf("random lifecycle sequences match a full recount (track blocks %v)", track), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(7, uint64(len(fmt.Sprint(track)))))
			l := New(Config{TrackActiveBlocks: track})
			m := &refLedger{track: track, claims: map[string]bool{}, bookings: map[string]*refBooking{}}
			cands := []Candidate{w1r0, w1r1, w2r0}
			decays := []float64{0, 0.125, 0.25, 0.5, 0.75, 1}
			// A few "conversations": each booking takes a prefix of one chain plus a private tail,
			// so prefixes are shared and chains never repeat a hash within a booking.
			chains := [][]uint64{}
			for c := 0; c < 4; c++ {
				var ch []uint64
				for i := 0; i < 12; i++ {
					ch = append(ch, uint64(c*1000+i))
				}
				chains = append(chains, ch)
			}
			next := uint64(1 << 40)
			now := t0
			for step := 0; step < 20000; step++ {
				id := fmt.Sprintf("r%d", rng.IntN(40))
				now = now.Add(time.Second)
				switch op := rng.IntN(100); {
				case op < 10:
					err := l.Claim(id)
					_, live := m.bookings[id]
					if (err == nil) == (m.claims[id] || live) {
						t.Fatalf("step %d Claim(%s) = %v (claimed %v live %v)", step, id, err, m.claims[id], live)
					}
					if err == nil {
						m.claims[id] = true
					}
				case op < 14:
					l.Unclaim(id)
					delete(m.claims, id)
				case op < 45:
					ch := chains[rng.IntN(len(chains))]
					hashes := append([]uint64(nil), ch[:rng.IntN(len(ch)+1)]...)
					for k := rng.IntN(3); k > 0; k-- {
						next++
						hashes = append(hashes, next)
					}
					b := Booking{ID: id, Candidate: cands[rng.IntN(len(cands))], SequenceHashes: hashes,
						PrefillTokens: uint64(rng.IntN(500)), Admitted: now}
					err := l.Book(b)
					if _, live := m.bookings[id]; live != (err != nil) {
						t.Fatalf("step %d Book(%s) = %v, live %v", step, id, err, live)
					}
					if err == nil {
						delete(m.claims, id)
						m.bookings[id] = &refBooking{c: b.Candidate, hashes: hashes, prefill: b.PrefillTokens, decay: 1, admitted: now}
					}
				case op < 55:
					err := l.PrefillComplete(id)
					rb := m.bookings[id]
					if (rb == nil) != (err != nil) {
						t.Fatalf("step %d PrefillComplete(%s) = %v", step, id, err)
					}
					if rb != nil {
						rb.done = true
					}
				case op < 75:
					var d *float64
					if rng.IntN(2) == 0 {
						d = &decays[rng.IntN(len(decays))]
					}
					next++
					err := l.OutputBlock(id, d, next)
					rb := m.bookings[id]
					if (rb == nil) != (err != nil) {
						t.Fatalf("step %d OutputBlock(%s) = %v", step, id, err)
					}
					if rb != nil {
						rb.hashes = append(rb.hashes, next)
						if d != nil {
							rb.decay = *d
						}
					}
				case op < 97:
					_, err := l.Free(id)
					if (m.bookings[id] == nil) != (err != nil) {
						t.Fatalf("step %d Free(%s) = %v", step, id, err)
					}
					delete(m.bookings, id)
				case op < 98:
					w := cands[rng.IntN(len(cands))].WorkerID
					for _, b := range l.FreeWorker(w) {
						if rb := m.bookings[b.ID]; rb == nil || rb.c.WorkerID != w {
							t.Fatalf("step %d FreeWorker(%d) released %s", step, w, b.ID)
						}
						delete(m.bookings, b.ID)
					}
					for id, rb := range m.bookings {
						if rb.c.WorkerID == w {
							t.Fatalf("step %d FreeWorker(%d) kept %s", step, w, id)
						}
					}
				default:
					cut := now.Add(-30 * time.Second)
					for _, b := range l.ExpireAdmittedBefore(cut) {
						if rb := m.bookings[b.ID]; rb == nil || !rb.admitted.Before(cut) {
							t.Fatalf("step %d expired %s", step, b.ID)
						}
						delete(m.bookings, b.ID)
					}
				}
				for _, c := range cands {
					if got, want := l.Load(c), m.load(c); got != want {
						t.Fatalf("step %d: Load(%v) = %+v, model %+v", step, c, got, want)
					}
				}
				if step%97 == 0 {
					checkInvariants(t, l)
				}
			}
			for id := range m.bookings {
				if _, err := l.Free(id); err != nil {
					t.Fatal(err)
				}
			}
			for _, c := range cands {
				if got := l.Load(c); got != (Load{}) {
					t.Fatalf("after freeing everything Load(%v) = %+v", c, got)
				}
			}
			checkInvariants(t, l)
		})
	}
}

func TestNonDyadicDecayRounding(t *testing.T) {
	cases := []struct {
		name  string
		decay float64
		n     int
		want  uint64
	}{
		{"a third of three blocks rounds to one", 1.0 / 3, 3, 1},
		{"0.1 of four blocks rounds to zero", 0.1, 4, 0},
		{"0.1 of six blocks rounds to one", 0.1, 6, 1},
		{"0.3 of one thousand blocks is three hundred", 0.3, 1000, 300},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l := newTracking()
			mustBook(t, l, Booking{ID: "a", Candidate: w1r0})
			for i := 0; i < tc.n; i++ {
				if err := l.OutputBlock("a", &tc.decay, uint64(i)); err != nil {
					t.Fatal(err)
				}
			}
			if got := l.Load(w1r0).ActiveBlocks; got != tc.want {
				t.Fatalf("active blocks %d, want %d", got, tc.want)
			}
		})
	}
}

func TestBlockTable(t *testing.T) {
	keySets := map[string]func(i int) uint64{
		"random hashes":                         func(i int) uint64 { return rand.Uint64() },
		"small sequential hash-form values":     func(i int) uint64 { return uint64(i) },
		"multiples of a large power of two":     func(i int) uint64 { return uint64(i) << 40 },
		"values that include zero and all ones": func(i int) uint64 { return []uint64{0, math.MaxUint64, 1, 2}[i%4] + uint64(i/4)<<1 },
	}
	names := make([]string, 0, len(keySets))
	for n := range keySets {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		gen := keySets[name]
		t.Run("the table agrees with a map under inserts and deletes of "+name, func(t *testing.T) {
			var tb blockTable
			ref := map[uint64]bool{}
			rng := rand.New(rand.NewPCG(1, 2))
			var keys []uint64
			for i := 0; i < 30000; i++ {
				keys = append(keys, gen(i))
			}
			// Grow to 30k, then shrink below the shrink threshold, then churn.
			for phase, ops := range []int{30000, 29500, 20000} {
				for i := 0; i < ops; i++ {
					k := keys[rng.IntN(len(keys))]
					insert := phase == 0 || (phase == 2 && rng.IntN(2) == 0)
					if insert {
						j, ok := tb.slotFor(k)
						if ok != ref[k] {
							t.Fatalf("slotFor(%d) existed=%v, map %v", k, ok, ref[k])
						}
						tb.vals[j] = blockRef{count: 1}
						ref[k] = true
					} else if j, ok := tb.find(k); ok != ref[k] {
						t.Fatalf("find(%d) = %v, map %v", k, ok, ref[k])
					} else if ok {
						tb.deleteAt(j)
						delete(ref, k)
					}
				}
				if tb.n != len(ref) {
					t.Fatalf("phase %d: n %d, map %d", phase, tb.n, len(ref))
				}
				for k := range ref {
					if !tb.contains(k) {
						t.Fatalf("phase %d: lost %d", phase, k)
					}
				}
			}
		})
	}
}

func TestConcurrentStress(t *testing.T) {
	t.Run("concurrent lifecycles leave no residue and keep every invariant", func(t *testing.T) {
		l := newTracking()
		cands := []Candidate{w1r0, w1r1, w2r0}
		const goroutines = 8
		iters := 4000
		if testing.Short() {
			iters = 500
		}
		var wg sync.WaitGroup
		for g := 0; g < goroutines; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(g), 99))
				for i := 0; i < iters; i++ {
					// ids collide across goroutines on purpose: exactly-once must hold under races.
					id := fmt.Sprintf("id-%d", rng.IntN(64))
					c := cands[rng.IntN(len(cands))]
					prefix := []uint64{1, 2, 3, 4}[:rng.IntN(5)]
					hashes := append(append([]uint64(nil), prefix...), rng.Uint64(), rng.Uint64())
					if err := l.Claim(id); err == nil {
						_ = l.Load(c)
						if rng.IntN(8) == 0 {
							l.Unclaim(id)
							continue
						}
						if err := l.Book(Booking{ID: id, Candidate: c, SequenceHashes: hashes, PrefillTokens: 16, Admitted: t0}); err != nil {
							t.Errorf("Book after Claim: %v", err)
							return
						}
					}
					_ = l.PrefillComplete(id)
					d := 0.5
					_ = l.OutputBlock(id, &d, rng.Uint64())
					_ = l.AdditionalBlocks(c, hashes)
					if rng.IntN(2) == 0 {
						_, _ = l.Free(id)
					}
					if rng.IntN(500) == 0 {
						_ = l.ExpireAdmittedBefore(t0)
					}
				}
			}(g)
		}
		wg.Wait()
		checkInvariants(t, l)
		for i := 0; i < 64; i++ {
			_, _ = l.Free(fmt.Sprintf("id-%d", i))
		}
		for _, c := range cands {
			if got := l.Load(c); got != (Load{}) {
				t.Fatalf("residual load on %v: %+v", c, got)
			}
		}
		if b, c := l.Len(); b != 0 || c != 0 {
			t.Fatalf("Len = %d bookings, %d claims", b, c)
		}
	})
}

func benchHashes(n int, seed uint64) []uint64 {
	rng := rand.New(rand.NewPCG(seed, seed))
	h := make([]uint64, n)
	for i := range h {
		h[i] = rng.Uint64()
	}
	return h
}

// BenchmarkBookFree64 measures Book + Free of a 64-block booking on a rank that already has
// 32 other live bookings (goal ≤ 2 µs).
func BenchmarkBookFree64(b *testing.B) {
	for _, shared := range []bool{false, true} {
		b.Run(fmt.Sprintf("prefix_shared=%v", shared), func(b *testing.B) {
			l := newTracking()
			for i := 0; i < 32; i++ {
				_ = l.Book(Booking{ID: fmt.Sprintf("bg%d", i), Candidate: w1r0, SequenceHashes: benchHashes(64, uint64(i+100))})
			}
			hashes := benchHashes(64, 1)
			if shared {
				hashes = append([]uint64(nil), l.slots[0].b.SequenceHashes...)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := l.Book(Booking{ID: "bench", Candidate: w1r0, SequenceHashes: hashes, PrefillTokens: 1024}); err != nil {
					b.Fatal(err)
				}
				if _, err := l.Free("bench"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkLoad measures one Load on a rank with 64 live bookings of 64 blocks each.
func BenchmarkLoad(b *testing.B) {
	l := newTracking()
	for i := 0; i < 64; i++ {
		_ = l.Book(Booking{ID: fmt.Sprintf("bg%d", i), Candidate: w1r0, SequenceHashes: benchHashes(64, uint64(i))})
		d := 0.5
		_ = l.OutputBlock(fmt.Sprintf("bg%d", i), &d, uint64(i))
	}
	b.ReportAllocs()
	b.ResetTimer()
	var sink uint64
	for i := 0; i < b.N; i++ {
		sink += l.Load(w1r0).ActiveBlocks
	}
	_ = sink
}

// BenchmarkLoadAndAdditional128 measures decode_cost inputs for a 128-block request.
func BenchmarkLoadAndAdditional128(b *testing.B) {
	l := newTracking()
	for i := 0; i < 64; i++ {
		_ = l.Book(Booking{ID: fmt.Sprintf("bg%d", i), Candidate: w1r0, SequenceHashes: benchHashes(64, uint64(i))})
	}
	req := append(append([]uint64(nil), l.slots[0].b.SequenceHashes...), benchHashes(64, 999)...)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		_, _ = l.LoadAndAdditional(w1r0, req)
	}
}
