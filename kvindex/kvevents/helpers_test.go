package kvevents_test

import (
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

// testBS is the block size (tokens) of the socket tests.
const testBS = 4

// newManager returns a Manager with short timeouts, closed at the end of the test.
func newManager(t testing.TB, cfg kvevents.ManagerConfig) *kvevents.Manager {
	t.Helper()
	if cfg.ReconnectMinBackoff == 0 {
		cfg.ReconnectMinBackoff = 20 * time.Millisecond
	}
	if cfg.ReconnectMaxBackoff == 0 {
		cfg.ReconnectMaxBackoff = 200 * time.Millisecond
	}
	if cfg.ReplayTimeout == 0 {
		cfg.ReplayTimeout = 2 * time.Second
	}
	m := kvevents.NewManager(cfg)
	t.Cleanup(func() { _ = m.Close() })
	return m
}

// waitUntil polls cond every 5 ms and fails the test with what after 10 s.
func waitUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitNextSeq waits until the listener of (worker, rank) expects seq next.
func waitNextSeq(t testing.TB, m *kvevents.Manager, worker uint64, rank uint32, seq uint64) {
	t.Helper()
	waitUntil(t, "the listener has applied every batch before the next seq", func() bool {
		st, ok := m.Listener(worker, rank)
		return ok && st.Started && st.NextSeq == seq
	})
}

// attachPublisher attaches worker id to pub's endpoints with sink and waits for the subscription.
func attachPublisher(t testing.TB, m *kvevents.Manager, pub *kt.Publisher, id uint64, sink kvevents.Sink) {
	t.Helper()
	spec := kvevents.WorkerSpec{WorkerID: id, BlockSize: testBS, DPSize: 1,
		Endpoints: map[uint32]string{0: pub.Endpoint()}, ReplayEndpoint: pub.ReplayEndpoint()}
	if err := m.Attach(spec, sink); err != nil {
		t.Fatalf("Attach: %v", err)
	}
	pub.WaitForSubscriber()
}

// toks returns block i's tokens for a family of distinct test prompts: 4 tokens derived from
// (family, i).
func toks(family, i uint32) []uint32 {
	b := family*1000 + i*4
	return []uint32{b, b + 1, b + 2, b + 3}
}

// chainTokens concatenates blocks [from, to) of a family.
func chainTokens(family, from, to uint32) []uint32 {
	var out []uint32
	for i := from; i < to; i++ {
		out = append(out, toks(family, i)...)
	}
	return out
}

// ext returns the engine hash of block i of a family.
func ext(family, i uint32) uint64 { return uint64(family)<<32 + uint64(i) + 1 }

func exts(family, from, to uint32) []uint64 {
	var out []uint64
	for i := from; i < to; i++ {
		out = append(out, ext(family, i))
	}
	return out
}

// storeChain builds a BlockStored of blocks [from, to) of a family, chained after block from-1.
func storeChain(family, from, to uint32) kt.Event {
	var parent *uint64
	if from > 0 {
		parent = kt.Parent(ext(family, from-1))
	}
	return kt.Stored(parent, exts(family, from, to), chainTokens(family, from, to), testBS)
}

// localHashes returns the unsalted local hashes of blocks [0, n) of a family.
func localHashes(family, n uint32) []uint64 {
	return kvindex.BlockHashes(chainTokens(family, 0, n), testBS, kvindex.BaseSeed)
}

// deviceDepth returns the device overlap of (worker, rank) with the first n blocks of a family.
func deviceDepth(ix *kvindex.Index, worker uint64, rank uint32, family, n uint32) uint32 {
	for _, m := range ix.FindMatches(localHashes(family, n), nil) {
		if m.Candidate == (kvindex.Candidate{WorkerID: worker, DPRank: rank}) {
			return m.Device
		}
	}
	return 0
}

// recordingSink records applied events.
type recordingSink struct {
	mu  sync.Mutex
	evs []kvindex.Event
}

func (s *recordingSink) Apply(ev kvindex.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.evs = append(s.evs, ev)
	return nil
}

func (s *recordingSink) events() []kvindex.Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.evs)
}

func (s *recordingSink) count(kind kvindex.EventKind) int {
	n := 0
	for _, ev := range s.events() {
		if ev.Kind == kind {
			n++
		}
	}
	return n
}
