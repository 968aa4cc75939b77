package kvindex

import (
	"bufio"
	"container/heap"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/zeebo/xxh3"

	"github.com/kvepp/kvepp/internal/sharedtest"
)

// A synthetic fleet for the scale benchmark (BenchmarkFleet) and its CI-size check
// (TestFleetSmall). Its content and sharing come from the Mooncake traces
// (../shared/traces): a tenant is one salted copy of the conversation trace (even tenants) or
// the synthetic trace (odd tenants), so tenants share nothing while each keeps the trace's
// prefix structure (every conversation request starts with the same 512-token block, sessions
// share their earlier turns). Each 512-token hash id expands into 32 blocks of 16 tokens.
//
// Routing: a session (a tenant's requests with the same first two hash ids: one conversation)
// goes to the least-loaded worker when it first appears and stays there, as a KV-aware router
// with load balancing places it. A request stores only the blocks its worker does not hold yet
// (its cached prefix is looked up with ExternalHashes), chained below that prefix, in Stored
// events of at most fleetChunk blocks, with the worker's own external ids. Tenants are added
// until every worker holds its target number of blocks; a worker that is full takes no more
// requests. There are no evictions: the index is a snapshot of full caches.

const (
	fleetChunk   = 128 // blocks per Stored event (a 2048-token prefill chunk)
	fleetQueries = 1000
	fleetQuery   = 128 // blocks per lookup prompt
)

// fleetSpec is one synthetic fleet.
type fleetSpec struct {
	workers, blocks int // candidates (worker i+1, dp_rank 0) and target device blocks per worker
	cfg             Config
}

func (s fleetSpec) String() string { return fmt.Sprintf("workers=%d/blocks=%d", s.workers, s.blocks) }

// fleet is a built fleet and what building it measured.
type fleet struct {
	spec        fleetSpec
	ix          *Index
	tenants     int
	requests    int // requests routed and stored
	events      int // Stored events applied
	applied     uint64
	applyTime   time.Duration // inside Index.Apply only
	queries     [][]uint64    // fleetQuery-block prompts sampled from the stored requests
	held        []map[uint64]bool
	trackHeld   bool
	queryWorker []int // the worker each query's request was routed to
}

var (
	fleetOnce  sync.Once
	fleetConv  []mcLine
	fleetSyn   []mcLine
	fleetErr   error
	fleetLines = []string{"mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"}
)

func loadFleetTraces(tb testing.TB) ([]mcLine, []mcLine) {
	tb.Helper()
	fleetOnce.Do(func() {
		var out [2][]mcLine
		for i, name := range fleetLines {
			f, err := os.Open(sharedtest.Path(tb, "traces", name))
			if err != nil {
				fleetErr = err
				return
			}
			sc := bufio.NewScanner(f)
			sc.Buffer(make([]byte, 1<<20), 1<<24)
			for sc.Scan() {
				var ln mcLine
				if err := json.Unmarshal(sc.Bytes(), &ln); err != nil {
					fleetErr = fmt.Errorf("%s line %d: %w", name, len(out[i])+1, err)
					break
				}
				out[i] = append(out[i], ln)
			}
			f.Close()
			if fleetErr == nil {
				fleetErr = sc.Err()
			}
		}
		fleetConv, fleetSyn = out[0], out[1]
	})
	if fleetErr != nil {
		tb.Fatal(fleetErr)
	}
	return fleetConv, fleetSyn
}

// fleetLocal is tenant t's local block hash of sub-block k (0..31) of trace hash id id.
func fleetLocal(t int, id uint64, k int) uint64 {
	var b [24]byte
	binary.LittleEndian.PutUint64(b[:8], id)
	binary.LittleEndian.PutUint64(b[8:16], uint64(k))
	binary.LittleEndian.PutUint64(b[16:], uint64(t))
	return xxh3.HashSeed(b[:], BaseSeed)
}

// loadHeap orders workers by stored blocks (then id), for least-loaded routing.
type loadHeap struct {
	load []int
	ws   []int
	pos  []int
}

func (h *loadHeap) Len() int { return len(h.ws) }
func (h *loadHeap) Less(i, j int) bool {
	a, b := h.ws[i], h.ws[j]
	return h.load[a] < h.load[b] || h.load[a] == h.load[b] && a < b
}
func (h *loadHeap) Swap(i, j int) {
	h.ws[i], h.ws[j] = h.ws[j], h.ws[i]
	h.pos[h.ws[i]], h.pos[h.ws[j]] = i, j
}
func (h *loadHeap) Push(any)  { panic("fixed size") }
func (h *loadHeap) Pop() any  { panic("fixed size") }
func (h *loadHeap) min() int  { return h.ws[0] }
func (h *loadHeap) fix(w int) { heap.Fix(h, h.pos[w]) }
func newLoadHeap(n int) *loadHeap {
	h := &loadHeap{load: make([]int, n), ws: make([]int, n), pos: make([]int, n)}
	for i := range h.ws {
		h.ws[i], h.pos[i] = i, i
	}
	return h
}

// buildFleet builds spec's fleet. With trackHeld it also records every worker's blocks (for the
// reference check of TestFleetSmall).
func buildFleet(tb testing.TB, spec fleetSpec, trackHeld bool) *fleet {
	tb.Helper()
	conv, syn := loadFleetTraces(tb)
	f := &fleet{spec: spec, ix: New(spec.cfg), trackHeld: trackHeld}
	if trackHeld {
		f.held = make([]map[uint64]bool, spec.workers)
		for i := range f.held {
			f.held[i] = map[uint64]bool{}
		}
	}
	r := rand.New(rand.NewPCG(uint64(spec.workers), uint64(spec.blocks)))
	loads := newLoadHeap(spec.workers)
	full := 0
	seen := 0 // requests eligible as queries (reservoir sampling)
	backing := make([]uint64, fleetQueries*fleetQuery)
	var q []uint64
	var blocks []StoredBlock
	for t := 0; full < spec.workers; t++ {
		if t > 10000 {
			tb.Fatalf("%v: %d tenants did not fill the fleet", spec, t)
		}
		f.tenants = t + 1
		lines := conv
		if t%2 == 1 {
			lines = syn
		}
		sessions := map[[2]uint64]int{}
		for _, ln := range lines {
			n := min(ln.InputLength/16, 32*len(ln.HashIDs))
			if n == 0 {
				continue
			}
			key := [2]uint64{ln.HashIDs[0], ^uint64(0)}
			if len(ln.HashIDs) > 1 {
				key[1] = ln.HashIDs[1]
			}
			w, ok := sessions[key]
			if !ok {
				w = loads.min()
				sessions[key] = w
			}
			if loads.load[w] >= spec.blocks {
				continue
			}
			q = q[:0]
			for i := 0; i < n; i++ {
				q = append(q, fleetLocal(t, ln.HashIDs[i/32], i%32))
			}
			c := Candidate{WorkerID: uint64(w + 1)}
			hit := len(f.ix.ExternalHashes(c, q, n))
			for start := hit; start < n; start += fleetChunk {
				end := min(start+fleetChunk, n)
				blocks = blocks[:0]
				for _, h := range q[start:end] {
					blocks = append(blocks, StoredBlock{BlockHash: mcExt(w, h), TokensHash: h})
				}
				ev := Event{WorkerID: c.WorkerID, Kind: EventStored, Blocks: blocks}
				if start > 0 {
					ev.HasParent, ev.ParentHash = true, mcExt(w, q[start-1])
				}
				t0 := time.Now()
				err := f.ix.Apply(ev)
				f.applyTime += time.Since(t0)
				if err != nil {
					tb.Fatalf("%v: tenant %d worker %d: %v", spec, t, w, err)
				}
				f.events++
				f.applied += uint64(end - start)
			}
			if trackHeld {
				for _, h := range q {
					f.held[w][h] = true
				}
			}
			f.requests++
			before := loads.load[w]
			loads.load[w] += n - hit
			loads.fix(w)
			if before < spec.blocks && loads.load[w] >= spec.blocks {
				full++
			}
			if n >= fleetQuery {
				seen++
				slot := len(f.queries)
				if slot == fleetQueries {
					slot = r.IntN(seen)
				}
				if slot < fleetQueries {
					dst := backing[slot*fleetQuery : (slot+1)*fleetQuery : (slot+1)*fleetQuery]
					copy(dst, q[:fleetQuery])
					if slot == len(f.queries) {
						f.queries = append(f.queries, dst)
						f.queryWorker = append(f.queryWorker, w)
					} else {
						f.queryWorker[slot] = w
					}
				}
			}
			if full == spec.workers {
				break
			}
		}
	}
	return f
}

// reference returns the expected matches of q from the recorded worker contents: for every
// worker, the number of leading blocks of q it holds.
func (f *fleet) reference(q []uint64) []Match {
	var out []Match
	for w, held := range f.held {
		d := 0
		for d < len(q) && held[q[d]] {
			d++
		}
		if d > 0 {
			out = append(out, Match{Candidate: Candidate{WorkerID: uint64(w + 1)}, Device: uint32(d)})
		}
	}
	return out
}

// TestFleetSmall builds a CI-size synthetic fleet (the scale benchmark's generator on 48 workers
// of 3,000 blocks, spread over 4 shards) and checks it: the structural invariants; every sampled
// prompt's matches against the workers' recorded contents; and Dump → Restore into a fresh
// single-shard index reproducing the entries and every match.
func TestFleetSmall(t *testing.T) {
	spec := fleetSpec{workers: 48, blocks: 3000, cfg: Config{BlockSize: 16, Shards: 4, ShardWorkers: 12}}
	f := buildFleet(t, spec, true)
	if err := checkInvariants(f.ix); err != nil {
		t.Fatal(err)
	}
	st := f.ix.Stats()
	pairs := 0
	for _, h := range f.held {
		pairs += len(h)
	}
	if st.Entries != uint64(pairs) || st.Candidates != spec.workers {
		t.Fatalf("index holds %d entries of %d candidates, the workers %d of %d", st.Entries, st.Candidates, pairs, spec.workers)
	}
	if f.ix.opened.Load() != 4 || len(f.queries) < 50 {
		t.Fatalf("%d shards open, %d queries: the fleet is too small to test", f.ix.opened.Load(), len(f.queries))
	}
	restored := New(Config{BlockSize: 16})
	if err := restored.Restore(f.ix.Dump()); err != nil {
		t.Fatal(err)
	}
	if got := restored.Stats().Entries; got != st.Entries {
		t.Fatalf("restored %d entries of %d", got, st.Entries)
	}
	for i, q := range f.queries {
		want := sortMatches(f.reference(q))
		if diff := cmp.Diff(want, matches(f.ix, q...)); diff != "" {
			t.Fatalf("query %d (-workers +index):\n%s", i, diff)
		}
		if diff := cmp.Diff(want, matches(restored, q...)); diff != "" {
			t.Fatalf("query %d (-workers +restored):\n%s", i, diff)
		}
		if !slices.ContainsFunc(want, func(m Match) bool { return m.Candidate.WorkerID == uint64(f.queryWorker[i]+1) }) {
			t.Fatalf("query %d does not match the worker its request was stored on", i)
		}
	}
}
