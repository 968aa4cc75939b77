package kvindex

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Scale benchmark settings (environment variables, so `go test -bench` needs no extra flags):
//
//	KVINDEX_FLEET         fleets to build, comma-separated WORKERSxBLOCKS (blocks per worker);
//	                      default "1000x4096,10000x512"; the full-size runs are "1000x131072" and
//	                      "10000x65536" (see kvindex/README.md for their memory)
//	KVINDEX_FLEET_DUMP    json (Dump, JSON encode and decode, Restore), events (Dump and Restore,
//	                      no JSON) or off; default json up to 1 Mi pairs, events up to 8 Mi, off above
//	KVINDEX_FLEET_SHARDS  Config.Shards of the fleet index (default DefaultShards)
//	KVINDEX_FLEET_PAR     the fleet of the parallel benchmarks, WORKERSxBLOCKS; default 1000x2048
func fleetSpecs(tb testing.TB, env, def string) []fleetSpec {
	v := os.Getenv(env)
	if v == "" {
		v = def
	}
	shards := 0
	if s := os.Getenv("KVINDEX_FLEET_SHARDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 {
			tb.Fatalf("KVINDEX_FLEET_SHARDS=%q: want a positive integer", s)
		}
		shards = n
	}
	var out []fleetSpec
	for _, f := range strings.Split(v, ",") {
		w, b, ok := strings.Cut(strings.TrimSpace(f), "x")
		workers, err1 := strconv.Atoi(w)
		blocks, err2 := strconv.Atoi(b)
		if !ok || err1 != nil || err2 != nil || workers <= 0 || blocks <= 0 {
			tb.Fatalf("%s=%q: want WORKERSxBLOCKS[,...], e.g. 1000x131072", env, v)
		}
		out = append(out, fleetSpec{workers: workers, blocks: blocks, cfg: Config{BlockSize: 16, Shards: shards}})
	}
	return out
}

// findLatencies times FindMatches on every query, passes times, and returns the sorted
// latencies (timer overhead subtracted), the mean matches per call and the mean matched blocks.
func findLatencies(ix *Index, queries [][]uint64, passes int) (lat []time.Duration, matchesPer, blocksPer float64) {
	var overhead []time.Duration
	for i := 0; i < 1000; i++ {
		t := time.Now()
		overhead = append(overhead, time.Since(t))
	}
	slices.Sort(overhead)
	dst := make([]Match, 0, 1024)
	var nm, nb uint64
	for p := 0; p < passes; p++ {
		for _, q := range queries {
			t := time.Now()
			dst = ix.FindMatches(q, dst[:0])
			lat = append(lat, time.Since(t)-overhead[len(overhead)/2])
			if p == 0 {
				nm += uint64(len(dst))
				for _, m := range dst {
					nb += uint64(m.Device)
				}
			}
		}
	}
	slices.Sort(lat)
	return lat, float64(nm) / float64(len(queries)), float64(nb) / float64(len(queries))
}

func pct(lat []time.Duration, p float64) float64 {
	return float64(lat[int(p*float64(len(lat)-1))].Nanoseconds())
}

func heapAlloc() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// BenchmarkFleet builds each synthetic fleet of KVINDEX_FLEET (fleet_test.go: Mooncake
// sessions routed to the least-loaded worker until every worker holds its block count) and
// reports:
//
//   - bytes/pair: live heap of the index per (block, worker) device entry (goal ≤ 24), and pairs;
//   - apply-blocks/s: Stored-event application while building, one goroutine (goal ≥ 5 M/s),
//     counting time inside Index.Apply only;
//   - find-p50-ns, find-p99-ns: FindMatches of 128-block prompts sampled from the stored requests
//     (goal p99 ≤ 20 µs at 1,000 workers, ≤ 100 µs at 10,000), with matches/find (candidates
//     returned) and blocks/find (their device blocks, summed) for context;
//   - dump-s, json-bytes/pair, json-encode-s, json-decode-s, restore-s: the /dump path — Dump,
//     the /dump JSON of its events (json.Marshal, as the HTTP handler does), decoding it
//     (json.Unmarshal, as peer recovery does) and Restore into an empty index (whose entries are
//     checked against the original) — per KVINDEX_FLEET_DUMP.
//
// One iteration builds the fleet; run with -benchtime 1x.
func BenchmarkFleet(b *testing.B) {
	for _, spec := range fleetSpecs(b, "KVINDEX_FLEET", "1000x4096,10000x512") {
		b.Run(spec.String(), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				runFleet(b, spec)
			}
		})
	}
}

func runFleet(b *testing.B, spec fleetSpec) {
	loadFleetTraces(b)
	base := heapAlloc()
	start := time.Now()
	f := buildFleet(b, spec, false)
	build := time.Since(start)
	live := heapAlloc() - base - uint64(8*fleetQueries*fleetQuery)
	st := f.ix.Stats()
	pairs := float64(st.Entries)
	b.ReportMetric(float64(live)/pairs, "bytes/pair")
	b.ReportMetric(pairs, "pairs")
	b.ReportMetric(float64(f.applied)/f.applyTime.Seconds(), "apply-blocks/s")
	b.ReportMetric(build.Seconds(), "build-s")
	b.ReportMetric(float64(f.tenants), "tenants")

	lat, mper, bper := findLatencies(f.ix, f.queries, max(1, 20000/len(f.queries)))
	b.ReportMetric(pct(lat, 0.50), "find-p50-ns")
	b.ReportMetric(pct(lat, 0.99), "find-p99-ns")
	b.ReportMetric(mper, "matches/find")
	b.ReportMetric(bper, "blocks/find")

	mode := os.Getenv("KVINDEX_FLEET_DUMP")
	if mode == "" {
		switch {
		case st.Entries <= 1<<20:
			mode = "json"
		case st.Entries <= 8<<20:
			mode = "events"
		default:
			mode = "off"
		}
	}
	switch mode {
	case "off":
		return
	case "json", "events":
	default:
		b.Fatalf("KVINDEX_FLEET_DUMP=%q: want json, events or off", mode)
	}
	t0 := time.Now()
	evs := f.ix.Dump()
	b.ReportMetric(time.Since(t0).Seconds(), "dump-s")
	if mode == "json" {
		t0 = time.Now()
		raw, err := json.Marshal(evs)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(time.Since(t0).Seconds(), "json-encode-s")
		b.ReportMetric(float64(len(raw))/pairs, "json-bytes/pair")
		evs = nil
		t0 = time.Now()
		if err := json.Unmarshal(raw, &evs); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(time.Since(t0).Seconds(), "json-decode-s")
	}
	restored := New(spec.cfg)
	t0 = time.Now()
	if err := restored.Restore(evs); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(time.Since(t0).Seconds(), "restore-s")
	if got := restored.Stats().Entries; got != st.Entries {
		b.Fatalf("restored %d of %d entries", got, st.Entries)
	}
	for _, q := range f.queries[:min(len(f.queries), 50)] {
		if a, c := matches(f.ix, q...), matches(restored, q...); !slices.Equal(a, c) {
			b.Fatalf("restored index answers %v, the original %v", c, a)
		}
	}
}

// parFleet is the fleet of the parallel benchmarks, built once per process.
var (
	parOnce  sync.Once
	parFleet *fleet
)

func parallelFleet(b *testing.B) *fleet {
	parOnce.Do(func() { parFleet = buildFleet(b, fleetSpecs(b, "KVINDEX_FLEET_PAR", "1000x2048")[0], false) })
	return parFleet
}

// churner applies, for the workers of one goroutine, a new 64-block turn below a stored prompt
// and then its removal, so the fleet stays the same size; every call is 128 block events.
type churner struct {
	f      *fleet
	mine   []int // query indexes whose worker this goroutine owns
	next   int
	seq    uint64
	blocks []StoredBlock
	hashes []uint64
	r      *rand.Rand
}

func newChurner(f *fleet, g, n int) *churner {
	ch := &churner{f: f, r: rand.New(rand.NewPCG(uint64(g), 5))}
	for i, w := range f.queryWorker {
		if w%n == g {
			ch.mine = append(ch.mine, i)
		}
	}
	return ch
}

func (ch *churner) step(tb testing.TB) {
	i := ch.mine[ch.next%len(ch.mine)]
	ch.next++
	w := ch.f.queryWorker[i]
	c := Candidate{WorkerID: uint64(w + 1)}
	parent := mcExt(w, ch.f.queries[i][fleetQuery/2-1])
	ch.blocks, ch.hashes = ch.blocks[:0], ch.hashes[:0]
	for j := 0; j < 64; j++ {
		ch.seq++
		h := ch.r.Uint64()
		ch.blocks = append(ch.blocks, StoredBlock{BlockHash: 1<<63 | uint64(w)<<40 | ch.seq, TokensHash: h})
		ch.hashes = append(ch.hashes, ch.blocks[j].BlockHash)
	}
	if err := ch.f.ix.Apply(Event{WorkerID: c.WorkerID, Kind: EventStored, HasParent: true, ParentHash: parent, Blocks: ch.blocks}); err != nil {
		tb.Fatal(err)
	}
	if err := ch.f.ix.Apply(Event{WorkerID: c.WorkerID, Kind: EventRemoved, BlockHashes: ch.hashes}); err != nil {
		tb.Fatal(err)
	}
}

// BenchmarkFleetParallelFind: FindMatches of the fleet's 128-block prompts from all goroutines
// at once (many ext_proc streams). Run with -cpu 1,2,4: ns/op is wall time per lookup, so it
// falls as lookups run in parallel.
func BenchmarkFleetParallelFind(b *testing.B) {
	f := parallelFleet(b)
	var next atomic.Uint64
	b.ResetTimer()
	cpu := processCPU()
	b.RunParallel(func(pb *testing.PB) {
		dst := make([]Match, 0, 1024)
		i := int(next.Add(997))
		for pb.Next() {
			dst = f.ix.FindMatches(f.queries[i%len(f.queries)], dst[:0])
			i++
		}
	})
	reportCPU(b, cpu)
}

// reportCPU reports the process CPU time per op since cpu: flat across -cpu values when the
// work runs in parallel without contention (wall time then depends only on free cores).
func reportCPU(b *testing.B, cpu time.Duration) {
	if d := processCPU() - cpu; d > 0 {
		b.ReportMetric(float64(d.Nanoseconds())/float64(b.N), "cpu-ns/op")
	}
}

// BenchmarkFleetParallelApply: each goroutine applies Stored and Removed events for its own
// workers (many listeners), 128 block events per op, workers spread over the index's shards.
// Run with -cpu 1,2,4; blocks/s is the total over all goroutines.
func BenchmarkFleetParallelApply(b *testing.B) {
	f := parallelFleet(b)
	n := runtime.GOMAXPROCS(0)
	var g atomic.Int32
	b.ResetTimer()
	start, cpu := time.Now(), processCPU()
	b.RunParallel(func(pb *testing.PB) {
		ch := newChurner(f, int(g.Add(1)-1)%n, n)
		for pb.Next() {
			ch.step(b)
		}
	})
	b.ReportMetric(float64(128*b.N)/time.Since(start).Seconds(), "blocks/s")
	reportCPU(b, cpu)
}

// BenchmarkFleetParallelMixed: half the goroutines (at least one) apply events as in
// BenchmarkFleetParallelApply while the others look up prompts; reports lookup latency under
// concurrent application (find-p50-ns, find-p90-ns, find-p99-ns; calm-p99-ns, the p99 of the
// lookups during which the OS did not preempt their thread (Linux), and preempted-%, the share
// it did — on a busy machine those make the p99), the application rate (blocks/s) and the
// duration of an apply step (step-p50-ns, step-p99-ns: two events, each under a shard's write
// lock). An op is one lookup or one 128-block apply step.
func BenchmarkFleetParallelMixed(b *testing.B) {
	f := parallelFleet(b)
	n := runtime.GOMAXPROCS(0)
	appliers := max(1, n/2)
	var g atomic.Int32
	var applied atomic.Uint64
	var mu sync.Mutex
	var lat, calm, steps []time.Duration
	b.ResetTimer()
	start, cpu := time.Now(), processCPU()
	b.RunParallel(func(pb *testing.PB) {
		id := int(g.Add(1) - 1)
		if id%2 == 0 || n == 1 {
			ch := newChurner(f, (id/2)%appliers, appliers)
			var mine []time.Duration
			for pb.Next() {
				t := time.Now()
				ch.step(b)
				mine = append(mine, time.Since(t))
				applied.Add(128)
			}
			mu.Lock()
			steps = append(steps, mine...)
			mu.Unlock()
			return
		}
		dst := make([]Match, 0, 1024)
		var mine, undisturbed []time.Duration
		for i := id; pb.Next(); i++ {
			// A lookup whose thread the OS preempted is told apart (on a shared machine those
			// make the p99); one that moved to another thread (it slept on a lock) is kept.
			tid, n, ok := threadState()
			t := time.Now()
			dst = f.ix.FindMatches(f.queries[i%len(f.queries)], dst[:0])
			d := time.Since(t)
			mine = append(mine, d)
			if tid2, n2, _ := threadState(); ok && (tid2 != tid || n2 == n) {
				undisturbed = append(undisturbed, d)
			}
		}
		mu.Lock()
		lat = append(lat, mine...)
		calm = append(calm, undisturbed...)
		mu.Unlock()
	})
	el := time.Since(start)
	reportCPU(b, cpu)
	b.ReportMetric(float64(applied.Load())/el.Seconds(), "blocks/s")
	if len(lat) > 0 {
		slices.Sort(lat)
		b.ReportMetric(pct(lat, 0.5), "find-p50-ns")
		b.ReportMetric(pct(lat, 0.9), "find-p90-ns")
		b.ReportMetric(pct(lat, 0.99), "find-p99-ns")
	}
	if len(calm) > 0 {
		slices.Sort(calm)
		b.ReportMetric(pct(calm, 0.99), "calm-p99-ns")
		b.ReportMetric(100*float64(len(lat)-len(calm))/float64(len(lat)), "preempted-%")
	}
	if len(steps) > 0 {
		// Each step is two events (64 blocks stored, then removed), each holding a shard's write
		// lock for its duration: the lookup tail above is bounded by it when nothing is preempted.
		slices.Sort(steps)
		b.ReportMetric(pct(steps, 0.5), "step-p50-ns")
		b.ReportMetric(pct(steps, 0.99), "step-p99-ns")
	}
}

// TestFleetSpecs checks the KVINDEX_FLEET parsing used by the scale benchmark.
func TestFleetSpecs(t *testing.T) {
	t.Setenv("KVINDEX_FLEET_SHARDS", "4")
	t.Setenv("KVINDEX_FLEET", "1000x131072, 10x7")
	got := fleetSpecs(t, "KVINDEX_FLEET", "1x1")
	if fmt.Sprint(got) != "[workers=1000/blocks=131072 workers=10/blocks=7]" || got[1].cfg.Shards != 4 || got[1].cfg.BlockSize != 16 {
		t.Fatalf("got %v", got)
	}
}

// BenchmarkFindDuringClear: lookup latency while a worker holding 131,072 blocks (the cache of
// an 8B model on one 80 GB GPU) is removed from the shard the lookups read. 63 other workers
// share the shard (16 prompts of 128 blocks each, on 8 shared 32-block system prompts). Each op
// stores the big worker again (1,024 prompts of 128 blocks, as 64-block Stored events) and
// removes it (RemoveWorker) while GOMAXPROCS−1 goroutines (at least one) look up the other
// workers' prompts. Reports clear-ms (the RemoveWorker call); of the lookups that began during
// a clear, how many (finds/clear), their latency (find-p50-ns, find-p99-ns), and the slowest
// one of each clear, as the median and the largest over the clears (worst-p50-ns,
// worst-max-ns: without yields a lookup waits for the whole clear, so this is the figure the
// clear shows in; the largest also catches the machine's own stalls). Run with -cpu 1,2,4.
func BenchmarkFindDuringClear(b *testing.B) {
	const bigWorker, prompts, promptBlocks = 1000, 1024, 128
	ix := New(Config{BlockSize: 16})
	r := rand.New(rand.NewPCG(11, 12))
	var system [8][32]uint64
	for i := range system {
		for j := range system[i] {
			system[i][j] = r.Uint64()
		}
	}
	var queries [][]uint64
	for w := uint64(1); w <= 63; w++ {
		for k := 0; k < 16; k++ {
			q := append([]uint64{}, system[r.IntN(len(system))][:]...)
			for len(q) < promptBlocks {
				q = append(q, r.Uint64())
			}
			blocks := make([]StoredBlock, len(q))
			for i, h := range q {
				blocks[i] = StoredBlock{BlockHash: h ^ w*0x9e3779b97f4a7c15, TokensHash: h}
			}
			if err := ix.Apply(Event{WorkerID: w, Kind: EventStored, Blocks: blocks}); err != nil {
				b.Fatal(err)
			}
			queries = append(queries, q)
		}
	}
	var fill []Event
	for k := 0; k < prompts; k++ {
		blocks := make([]StoredBlock, promptBlocks)
		for i := range blocks {
			h := r.Uint64()
			if i < 32 {
				h = system[k%len(system)][i]
			}
			blocks[i] = StoredBlock{BlockHash: uint64(k)<<16 | uint64(i), TokensHash: h}
		}
		fill = append(fill,
			Event{WorkerID: bigWorker, Kind: EventStored, Blocks: blocks[:64]},
			Event{WorkerID: bigWorker, Kind: EventStored, HasParent: true, ParentHash: blocks[63].BlockHash, Blocks: blocks[64:]})
	}
	var clearing, stop atomic.Bool
	var inflight, worst atomic.Int64 // lookups begun during the clear still running; the slowest
	var mu sync.Mutex
	var lat []time.Duration
	var wg sync.WaitGroup
	for g := 0; g < max(1, runtime.GOMAXPROCS(0)-1); g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			dst := make([]Match, 0, 64)
			var mine []time.Duration
			for i := g; !stop.Load(); i++ {
				during := clearing.Load()
				if during {
					inflight.Add(1)
				}
				t := time.Now()
				dst = ix.FindMatches(queries[i%len(queries)], dst[:0])
				if d := time.Since(t); during {
					mine = append(mine, d)
					for w := worst.Load(); int64(d) > w && !worst.CompareAndSwap(w, int64(d)); w = worst.Load() {
					}
					inflight.Add(-1)
				}
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		}(g)
	}
	var clears time.Duration
	var worsts []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, ev := range fill {
			if err := ix.Apply(ev); err != nil {
				b.Fatal(err)
			}
		}
		worst.Store(0)
		clearing.Store(true)
		t := time.Now()
		ix.RemoveWorker(bigWorker)
		clears += time.Since(t)
		clearing.Store(false)
		for inflight.Load() > 0 {
			runtime.Gosched()
		}
		worsts = append(worsts, time.Duration(worst.Load()))
	}
	b.StopTimer()
	stop.Store(true)
	wg.Wait()
	if st := ix.Stats(); st.Candidates != 63 {
		b.Fatalf("%d candidates after the clears", st.Candidates)
	}
	b.ReportMetric(float64(clears.Nanoseconds())/1e6/float64(b.N), "clear-ms")
	b.ReportMetric(float64(len(lat))/float64(b.N), "finds/clear")
	if len(lat) > 0 {
		slices.Sort(lat)
		b.ReportMetric(pct(lat, 0.5), "find-p50-ns")
		b.ReportMetric(pct(lat, 0.99), "find-p99-ns")
	}
	slices.Sort(worsts)
	b.ReportMetric(pct(worsts, 0.5), "worst-p50-ns")
	b.ReportMetric(float64(worsts[len(worsts)-1].Nanoseconds()), "worst-max-ns")
}
