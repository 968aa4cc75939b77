package kvindex

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// removeWorkerKind marks a test-stream step that calls RemoveWorker instead of Apply.
const removeWorkerKind EventKind = 200

func step(ix *Index, ev Event) {
	if ev.Kind == removeWorkerKind {
		ix.RemoveWorker(ev.WorkerID)
		return
	}
	_ = ix.Apply(ev)
}

// workerStreams splits n generated events into one stream per worker (index = worker id),
// adding a RemoveWorker step after about one event in removeEvery (never when 0).
func workerStreams(r *rand.Rand, gen genConfig, n, removeEvery int) [][]Event {
	streams := make([][]Event, gen.workers+1)
	for _, ev := range genEvents(r, gen, n) {
		streams[ev.WorkerID] = append(streams[ev.WorkerID], ev)
		if removeEvery > 0 && r.IntN(removeEvery) == 0 {
			streams[ev.WorkerID] = append(streams[ev.WorkerID], Event{WorkerID: ev.WorkerID, Kind: removeWorkerKind})
		}
	}
	return streams
}

// randomLookup looks up a random query of up to 8 tokens hashes below toks, checks that no
// match is longer than the query, and returns the query.
func randomLookup(t *testing.T, ix *Index, r *rand.Rand, toks int) []uint64 {
	q := make([]uint64, 1+r.IntN(8))
	for j := range q {
		q[j] = uint64(r.IntN(toks))
	}
	for _, m := range ix.FindMatches(q, nil) {
		if m.Blocks() > uint32(len(q)) {
			t.Errorf("match %+v longer than the query %v", m, q)
		}
	}
	return q
}

// applyStreams applies each stream (one per worker) on its own goroutine, in order, and waits.
func applyStreams(ix *Index, streams [][]Event) {
	var writers sync.WaitGroup
	for _, evs := range streams {
		writers.Add(1)
		go func() {
			defer writers.Done()
			for _, ev := range evs {
				step(ix, ev)
			}
		}()
	}
	writers.Wait()
}

// TestConcurrentPerWorkerApplication runs one goroutine per worker, each applying its own
// worker's events in order, while other goroutines query. The race detector must stay quiet and
// the final state must equal a serial application of the same per-worker streams.
func TestConcurrentPerWorkerApplication(t *testing.T) {
	for _, cfg := range []Config{{BlockSize: 16}, {BlockSize: 16, Shards: 4, ShardWorkers: 1}} {
		t.Run(fmt.Sprintf("shards=%d", cfg.Shards), func(t *testing.T) { testConcurrentPerWorker(t, cfg, false) })
		t.Run(fmt.Sprintf("shards=%d/every yield point yields", cfg.Shards), func(t *testing.T) { testConcurrentPerWorker(t, cfg, true) })
	}
}

func testConcurrentPerWorker(t *testing.T, cfg Config, yields bool) {
	const workers = 6
	r := rand.New(rand.NewPCG(42, 43))
	gen := genConfig{workers: workers, ranks: 2, toks: 5, exts: 12, lowerTiers: true}
	streams := workerStreams(r, gen, 6000, 300)

	ix := New(cfg)
	if yields {
		forceYields(ix, runtime.Gosched)
	}
	var stop atomic.Bool
	var readers sync.WaitGroup
	for g := 0; g < 3; g++ {
		readers.Add(1)
		go func(g int) {
			defer readers.Done()
			rr := rand.New(rand.NewPCG(uint64(g), 9))
			for i := 0; i < 2000 && !stop.Load(); i++ {
				q := randomLookup(t, ix, rr, gen.toks)
				_ = ix.ExternalHashes(cand(uint64(1+rr.IntN(workers)), 0), q, len(q))
				_ = ix.Stats()
				if i%50 == 0 {
					_ = ix.Dump()
				}
			}
		}(g)
	}
	applyStreams(ix, streams)
	stop.Store(true)
	readers.Wait()

	serial := New(Config{BlockSize: 16})
	for w := workers; w >= 1; w-- { // a different worker order than any interleaving above
		for _, ev := range streams[w] {
			step(serial, ev)
		}
	}
	t.Run("the concurrent and serial indexes have the same counters", func(t *testing.T) {
		if diff := cmp.Diff(serial.Stats(), ix.Stats()); diff != "" {
			t.Fatalf("(-serial +concurrent):\n%s", diff)
		}
	})
	t.Run("the concurrent and serial indexes answer every query alike", func(t *testing.T) {
		if err := checkInvariants(ix); err != nil {
			t.Fatal(err)
		}
		for _, q := range append(genPrompts(r, serial, gen.toks, 200), genPrompts(r, ix, gen.toks, 200)...) {
			if diff := cmp.Diff(matches(serial, q...), matches(ix, q...)); diff != "" {
				t.Fatalf("query %v (-serial +concurrent):\n%s", q, diff)
			}
			for w := uint64(1); w <= workers; w++ {
				for rank := uint32(0); rank < 2; rank++ {
					c := cand(w, rank)
					if diff := cmp.Diff(serial.ExternalHashes(c, q, len(q)), ix.ExternalHashes(c, q, len(q))); diff != "" {
						t.Fatalf("external hashes of %v for %v:\n%s", c, q, diff)
					}
				}
			}
		}
	})
}

// TestConcurrentApprox exercises the approximate index's locking under the race detector.
func TestConcurrentApprox(t *testing.T) {
	a := NewApprox(ApproxConfig{MaxTreeSize: 200, Policy: ApproxLRU})
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 1))
			for i := 0; i < 500; i++ {
				q := []uint64{uint64(r.IntN(3)), uint64(r.IntN(3)), uint64(r.IntN(3))}
				switch i % 5 {
				case 0:
					a.ExpireBefore(at(i))
				case 1:
					a.SetWorkerCapacity(uint64(g), 1+r.IntN(10))
				default:
					_ = a.RecordBooking(cand(uint64(g), 0), q, at(i))
				}
				_ = a.FindMatches(q, nil)
				_ = a.Stats()
			}
		}(g)
	}
	wg.Wait()
	if err := checkApprox(a); err != nil {
		t.Fatal(err)
	}
}

// ---- writes that let lookups in (interleave.go) ----

// forceYields makes every yield point of ix's shards yield, running hook with the lock released.
func forceYields(ix *Index, hook func()) {
	for _, sh := range ix.shards {
		sh.yieldHook = hook
	}
}

// longChain returns n blocks from the root with tokens hashes tok0, tok0+1, … and external
// hashes ext0+i.
func longChain(n int, tok0, ext0 uint64) []StoredBlock {
	out := make([]StoredBlock, n)
	for i := range out {
		out[i] = StoredBlock{BlockHash: ext0 + uint64(i), TokensHash: tok0 + uint64(i)}
	}
	return out
}

func tokens(blocks []StoredBlock) []uint64 {
	out := make([]uint64, len(blocks))
	for i, b := range blocks {
		out[i] = b.TokensHash
	}
	return out
}

// clearFixture is an index where worker 1 (ranks 0 and 1) holds long chains in the device tier,
// shares prefixes with workers 2 and 3 (multi-holder runs), and has host_pinned edges from the
// root; it returns the queries that touch all of that.
func clearFixture(t *testing.T) (*Index, [][]uint64) {
	ix := New(Config{BlockSize: 16})
	main := longChain(1500, 1000, 1<<40)
	side := longChain(300, 5000, 2<<40)
	apply := func(ev Event) {
		t.Helper()
		if err := ix.Apply(ev); err != nil {
			t.Fatal(err)
		}
	}
	for r := uint32(0); r < 2; r++ {
		base := uint64(r) << 50
		own := make([]StoredBlock, len(main))
		for i, b := range main {
			own[i] = StoredBlock{BlockHash: base + b.BlockHash, TokensHash: b.TokensHash}
		}
		apply(store(cand(1, r), TierDevice, nil, own))
		apply(store(cand(1, r), TierDevice, p(own[699].BlockHash), side))
	}
	for w := uint64(2); w <= 3; w++ {
		shared := make([]StoredBlock, 400*w)
		for i := range shared {
			shared[i] = StoredBlock{BlockHash: w<<40 + uint64(i), TokensHash: main[i].TokensHash}
		}
		apply(store(cand(w, 0), TierDevice, nil, shared))
	}
	apply(store(cand(1, 0), TierHostPinned, nil, longChain(50, 9000, 3<<40)))
	apply(store(cand(2, 0), TierHostPinned, nil, longChain(20, 9000, 4<<40)))
	toks := tokens(main)
	queries := [][]uint64{toks[:10], toks[:500], toks[:1000], toks, tokens(longChain(60, 9000, 0))}
	queries = append(queries, append(append([]uint64{}, toks[:700]...), tokens(side)...))
	return ix, queries
}

// TestClearTakesEffectAtOnce: Cleared and RemoveWorker of a candidate with thousands of blocks
// let lookups in while its entries are removed, and every lookup, Stats, ExternalHashes and Dump
// in between already sees the clear complete (never a partly cleared candidate).
func TestClearTakesEffectAtOnce(t *testing.T) {
	for _, tc := range []struct {
		name string
		op   func(ix *Index)
	}{
		{"cleared", func(ix *Index) { _ = ix.Apply(cleared(cand(1, 0))) }},
		{"remove worker", func(ix *Index) { ix.RemoveWorker(1) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ix, queries := clearFixture(t)
			want, _ := clearFixture(t)
			tc.op(want)
			wantStats := want.Stats()
			wantDump := want.Dump()
			// check runs with the shard's lock released by the writer: it reports with
			// t.Errorf (t.Fatalf would end the writer's goroutine mid-write).
			failed := false
			check := func(when string) {
				if failed {
					return
				}
				failed = true
				for _, q := range queries {
					if diff := cmp.Diff(matches(want, q...), matches(ix, q...)); diff != "" {
						t.Errorf("%s: query of %d blocks (-cleared +during):\n%s", when, len(q), diff)
						return
					}
				}
				if diff := cmp.Diff(wantStats, ix.Stats()); diff != "" {
					t.Errorf("%s: stats (-cleared +during):\n%s", when, diff)
					return
				}
				if got := ix.ExternalHashes(cand(1, 0), queries[3], 100); got != nil {
					t.Errorf("%s: the cleared candidate still has %d external hashes", when, len(got))
					return
				}
				if diff := cmp.Diff(wantDump, ix.Dump()); diff != "" {
					t.Errorf("%s: dump (-cleared +during):\n%s", when, diff)
					return
				}
				failed = false
			}
			yields := 0
			forceYields(ix, func() {
				yields++
				if yields%7 == 1 {
					check(fmt.Sprintf("yield %d", yields))
				}
			})
			tc.op(ix)
			if yields < 20 {
				t.Fatalf("the clear yielded %d times, want it to let lookups in between pieces", yields)
			}
			check("after")
			if err := checkInvariants(ix); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestLongEventsShowShorterEvents: a long store, then its removal, let lookups in between
// pieces; a lookup then sees the event partly applied — the candidate's match only grows
// during the store and only shrinks during the removal — and other candidates unchanged.
func TestLongEventsShowShorterEvents(t *testing.T) {
	ix := New(Config{BlockSize: 16})
	chain := longChain(600, 100, 1<<40)
	q := tokens(chain)
	if err := ix.Apply(store(cand(2, 0), TierDevice, nil, longChain(300, 100, 2<<40))); err != nil {
		t.Fatal(err)
	}
	depth := func() (mine, other uint32) {
		for _, m := range ix.FindMatches(q, nil) {
			if m.Candidate == cand(1, 0) {
				mine = m.Device
			} else {
				other = m.Device
			}
		}
		return mine, other
	}
	var seen []uint32
	forceYields(ix, func() {
		mine, other := depth()
		if other != 300 {
			t.Errorf("worker 2 matches %d blocks during worker 1's event, want 300", other)
		}
		seen = append(seen, mine)
	})
	if err := ix.Apply(store(cand(1, 0), TierDevice, nil, chain)); err != nil {
		t.Fatal(err)
	}
	if len(seen) < 10 {
		t.Fatalf("the 600-block store yielded %d times", len(seen))
	}
	for i := 1; i < len(seen); i++ {
		if seen[i] < seen[i-1] {
			t.Fatalf("during the store worker 1 matched %v blocks: a lookup went backwards", seen)
		}
	}
	stored := len(seen)
	hashes := make([]uint64, len(chain))
	for i, b := range chain {
		hashes[i] = b.BlockHash
	}
	if err := ix.Apply(removed(cand(1, 0), TierDevice, hashes...)); err != nil {
		t.Fatal(err)
	}
	during := seen[stored:]
	if len(during) < 10 {
		t.Fatalf("the 600-block removal yielded %d times", len(during))
	}
	for i := 1; i < len(during); i++ {
		if during[i] > during[i-1] {
			t.Fatalf("during the removal worker 1 matched %v blocks: a lookup went forwards", during)
		}
	}
	if mine, other := depth(); mine != 0 || other != 300 {
		t.Fatalf("after the removal: worker 1 matches %d, worker 2 %d", mine, other)
	}
	if err := checkInvariants(ix); err != nil {
		t.Fatal(err)
	}
}

// TestPausedWriteHoldsOffItsWorker: while a write of a worker is paused at a yield, another
// goroutine's RemoveWorker of the same worker waits for it (events of one worker apply one at
// a time), and then removes everything the write stored.
func TestPausedWriteHoldsOffItsWorker(t *testing.T) {
	ix := New(Config{BlockSize: 16})
	sh := ix.shards[0]
	var done chan struct{}
	var once sync.Once
	forceYields(ix, func() {
		once.Do(func() {
			done = make(chan struct{})
			go func() {
				ix.RemoveWorker(1)
				close(done)
			}()
			for { // until RemoveWorker waits for this write
				sh.mu.Lock()
				n := sh.idleWaiters
				sh.mu.Unlock()
				if n == 1 {
					break
				}
				runtime.Gosched()
			}
		})
		select {
		case <-done:
			t.Error("RemoveWorker ran while the worker's store was paused")
		default:
		}
	})
	chain := longChain(400, 100, 1<<40)
	if err := ix.Apply(store(cand(1, 0), TierDevice, nil, chain)); err != nil {
		t.Fatal(err)
	}
	if done == nil {
		t.Fatal("the store never yielded")
	}
	<-done
	if st := ix.Stats(); st.Entries != 0 || st.Candidates != 0 {
		t.Fatalf("after RemoveWorker: %+v", st)
	}
	if got := ix.FindMatches(tokens(chain), nil); len(got) != 0 {
		t.Fatalf("after RemoveWorker: %v", got)
	}
	if err := checkInvariants(ix); err != nil {
		t.Fatal(err)
	}
}

// TestRacingRemoveWorker runs each worker's events on its own goroutine with every yield point
// yielding, while another goroutine removes random workers and others look up. Whatever the
// interleaving, removing every worker at the end leaves an empty, well-formed index that then
// answers a fresh stream exactly as a new index does (nothing leaked from the races).
func TestRacingRemoveWorker(t *testing.T) {
	const workers = 6
	r := rand.New(rand.NewPCG(8, 9))
	gen := genConfig{workers: workers, ranks: 2, toks: 5, exts: 12, lowerTiers: true}
	streams := workerStreams(r, gen, 3000, 0)
	// Long stores, so that yields fall inside events.
	for w := uint64(1); w <= workers; w++ {
		for k := 0; k < 5; k++ {
			streams[w] = append(streams[w], store(cand(w, uint32(k%2)), TierDevice, nil, longChain(80, uint64(k*100), w<<40|uint64(k)<<20)))
		}
	}
	ix := New(Config{BlockSize: 16, Shards: 3, ShardWorkers: 1})
	forceYields(ix, runtime.Gosched)
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // the catalog
		defer wg.Done()
		rr := rand.New(rand.NewPCG(1, 1))
		for !stop.Load() {
			ix.RemoveWorker(uint64(1 + rr.IntN(workers)))
			runtime.Gosched()
		}
	}()
	go func() { // lookups
		defer wg.Done()
		rr := rand.New(rand.NewPCG(2, 2))
		for !stop.Load() {
			randomLookup(t, ix, rr, gen.toks)
			_ = ix.Stats()
		}
	}()
	applyStreams(ix, streams)
	stop.Store(true)
	wg.Wait()
	for w := uint64(1); w <= workers; w++ {
		ix.RemoveWorker(w)
	}
	if err := checkInvariants(ix); err != nil {
		t.Fatal(err)
	}
	if st := ix.Stats(); st.Candidates != 0 || st.Entries != 0 || st.TierEntries != [numTiers]uint64{} {
		t.Fatalf("after removing every worker: %+v", st)
	}
	if n := blockCount(ix); n != 0 {
		t.Fatalf("after removing every worker %d blocks remain", n)
	}
	fresh := New(Config{BlockSize: 16})
	epilogue := genEvents(r, gen, 500)
	for _, ev := range epilogue {
		step(ix, ev)
		step(fresh, ev)
	}
	for _, q := range genPrompts(r, fresh, gen.toks, 100) {
		if diff := cmp.Diff(matches(fresh, q...), matches(ix, q...)); diff != "" {
			t.Fatalf("query %v (-fresh +raced):\n%s", q, diff)
		}
	}
}
