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
	streams := make([][]Event, workers+1)
	for _, ev := range genEvents(r, gen, 6000) {
		streams[ev.WorkerID] = append(streams[ev.WorkerID], ev)
		if r.IntN(300) == 0 {
			streams[ev.WorkerID] = append(streams[ev.WorkerID], Event{WorkerID: ev.WorkerID, Kind: removeWorkerKind})
		}
	}

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
			dst := make([]Match, 0, 32)
			for i := 0; i < 2000 && !stop.Load(); i++ {
				q := make([]uint64, 1+rr.IntN(8))
				for j := range q {
					q[j] = uint64(rr.IntN(gen.toks))
				}
				dst = ix.FindMatches(q, dst[:0])
				for _, m := range dst {
					if m.Blocks() > uint32(len(q)) {
						t.Errorf("match %+v longer than the query %v", m, q)
					}
				}
				_ = ix.ExternalHashes(cand(uint64(1+rr.IntN(workers)), 0), q, len(q))
				_ = ix.Stats()
				if i%50 == 0 {
					_ = ix.Dump()
				}
			}
		}(g)
	}
	var writers sync.WaitGroup
	for w := 1; w <= workers; w++ {
		writers.Add(1)
		go func(evs []Event) {
			defer writers.Done()
			for _, ev := range evs {
				step(ix, ev)
			}
		}(streams[w])
	}
	writers.Wait()
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
