package kvevents_test

import (
	"fmt"
	"net"
	"slices"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

// consecutivePorts returns a loopback port p such that p and p+1 were both free a moment ago.
func consecutivePorts(t *testing.T) int {
	t.Helper()
	for attempt := 0; attempt < 100; attempt++ {
		l1, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		p := l1.Addr().(*net.TCPAddr).Port
		l2, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p+1))
		_ = l1.Close()
		if err == nil {
			_ = l2.Close()
			return p
		}
	}
	t.Fatal("no two consecutive free ports found")
	return 0
}

// TestDataParallelWorkerSubscribesOncePerRank registers a 2-rank worker (global ranks 4 and 5)
// with one base endpoint and one base replay endpoint: kvepp must subscribe to each rank's
// publisher at port + rank offset (here the ranks' own ports are base+4 and base+5), keep one
// watermark per rank, replay each rank's gaps from that rank's ROUTER, and index each rank's
// blocks under its own (worker, dp_rank).
func TestDataParallelWorkerSubscribesOncePerRank(t *testing.T) {
	live, replay := consecutivePorts(t), consecutivePorts(t)
	var pubs [2]*kt.Publisher
	for i := range pubs {
		pubs[i] = kt.New(t, kt.Options{Replay: true,
			Endpoint:       fmt.Sprintf("tcp://127.0.0.1:%d", live+i),
			ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", replay+i)})
	}
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	spec := kvevents.WorkerSpec{WorkerID: w1, BlockSize: testBS, DPStartRank: 4, DPSize: 2,
		Endpoint:       fmt.Sprintf("tcp://127.0.0.1:%d", live-4),
		ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", replay-4)}
	if err := m.Attach(spec, ix); err != nil {
		t.Fatal(err)
	}
	for _, p := range pubs {
		p.WaitForSubscriber()
	}
	// Rank 4 publishes family 1 in order; rank 5 publishes family 2 with a gap at seq 1, and
	// both ranks' sequences are independent.
	pubs[0].Publish(storeChain(1, 0, 1))
	pubs[0].Publish(storeChain(1, 1, 2))
	pubs[1].Publish(storeChain(2, 0, 1))
	pubs[1].Withhold(storeChain(2, 1, 2))
	pubs[1].Publish(storeChain(2, 2, 3))
	waitNextSeq(t, m, w1, 4, 2)
	waitNextSeq(t, m, w1, 5, 3)

	for _, c := range []struct {
		rank   uint32
		family uint32
		want   uint32
	}{{4, 1, 2}, {5, 2, 3}, {4, 2, 0}, {5, 1, 0}} {
		if d := deviceDepth(ix, w1, c.rank, c.family, 3); d != c.want {
			t.Errorf("dp_rank %d family %d depth = %d, want %d", c.rank, c.family, d, c.want)
		}
	}
	if got := pubs[1].ReplayRequests(); !slices.Equal(got, []uint64{1}) {
		t.Errorf("rank 5 replay requests = %v, want [1] at its own ROUTER", got)
	}
	if got := pubs[0].ReplayRequests(); len(got) != 0 {
		t.Errorf("rank 4 replay requests = %v, want none", got)
	}
	for r := uint32(4); r < 6; r++ {
		st, ok := m.Listener(w1, r)
		want := fmt.Sprintf("tcp://127.0.0.1:%d", live+int(r)-4)
		if !ok || st.Endpoint != want {
			t.Errorf("dp_rank %d listener = %+v (found %t), want endpoint %s", r, st, ok, want)
		}
	}
	if _, ok := m.Listener(w1, 0); ok {
		t.Error("a listener exists for rank 0, outside the worker's range [4, 6)")
	}
}

// TestWorkersApplyConcurrentlyWhileLookupsRun is the Manager-level stress test of §16: four
// workers publish interleaved stores and removals at once into one index while lookups run; each
// worker's events apply in its own order, so the final index equals a serial application of each
// worker's stream (run under -race).
func TestWorkersApplyConcurrentlyWhileLookupsRun(t *testing.T) {
	const workers, batches = 4, 60
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	ref := kvindex.New(kvindex.Config{BlockSize: testBS})
	streams := make([][][]kt.Event, workers)
	pubs := make([]*kt.Publisher, workers)
	for w := range streams {
		// Worker w stores chains of families 1..3 in steps of two blocks and removes older tails;
		// every worker shares the families' tokens, so their blocks meet in the same tree nodes.
		for b := 0; b < batches; b++ {
			f, i := uint32(1+b%3), uint32(2*(b/3)%8)
			evs := []kt.Event{storeChain(f, i, i+2)}
			if i == 6 && (b+w)%2 == 0 {
				evs = append(evs, kt.Removed(ext(f, 7), ext(f, 6)))
			}
			if b == batches/2 && w == 0 {
				evs = append(evs, kt.Cleared())
			}
			streams[w] = append(streams[w], evs)
		}
		conv := kvevents.NewConverter(uint64(w+1), 0, testBS, false)
		for seq, evs := range streams[w] {
			b, err := kvevents.DecodeBatch(kt.Batch{Events: evs}.Encode())
			if err != nil {
				t.Fatal(err)
			}
			out, _ := conv.Convert(b, uint64(seq), nil)
			for _, ev := range out {
				_ = ref.Apply(ev)
			}
		}
		pubs[w] = kt.New(t, kt.Options{})
		attachPublisher(t, m, pubs[w], uint64(w+1), ix)
	}

	stop := make(chan struct{})
	var lookups sync.WaitGroup
	lookups.Add(1)
	go func() {
		defer lookups.Done()
		for n := 0; ; n++ {
			select {
			case <-stop:
				return
			default:
			}
			q := localHashes(uint32(1+n%3), 8)
			for _, mt := range ix.FindMatches(q, nil) {
				if mt.Blocks() > 8 {
					t.Errorf("match %+v longer than the query", mt)
				}
			}
		}
	}()
	var pubsDone sync.WaitGroup
	for w := range pubs {
		pubsDone.Add(1)
		go func() {
			defer pubsDone.Done()
			for _, evs := range streams[w] {
				pubs[w].Publish(evs...)
			}
		}()
	}
	pubsDone.Wait()
	for w := range pubs {
		waitNextSeq(t, m, uint64(w+1), 0, batches)
	}
	close(stop)
	lookups.Wait()

	if d := cmp.Diff(ref.Dump(), ix.Dump()); d != "" {
		t.Errorf("concurrent index differs from the serial one (-serial +concurrent):\n%s", d)
	}
	if st := m.Stats(); st.Gaps != 0 || st.BatchesApplied != workers*batches {
		t.Errorf("stats = %+v, want %d batches applied without gaps", st, workers*batches)
	}
}
