package kvevents_test

import (
	"bufio"
	"fmt"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/internal/pythontest"
	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

// interopScript mirrors script() in testdata/vllm_publisher.py with kveventstest events.
func interopScript() [][]kt.Event {
	neg5 := uint64(1<<64 - 5)
	return [][]kt.Event{
		{storeChain(1, 0, 2).WithMedium("GPU")},
		{storeChain(1, 2, 3)},
		{storeChain(2, 0, 2).WithHashEncoding(kt.HashBytes)},
		{kt.Stored(nil, []uint64{ext(3, 0)}, chainTokens(3, 0, 1), testBS).WithMedium("GPU").WithCacheSalt("tenant-a")},
		{kt.Stored(kt.Parent(ext(3, 0)), []uint64{neg5}, chainTokens(3, 1, 2), testBS).WithHashEncoding(kt.HashInt64)},
		{kt.Removed(ext(1, 2)).WithMedium("GPU"), storeChain(1, 2, 3).WithMedium("CPU")},
		{kt.Stored(nil, []uint64{ext(5, 0)}, chainTokens(5, 0, 1), testBS).WithGroup(1, "sliding_window").WithSlidingWindow(128),
			kt.Stored(nil, []uint64{ext(5, 0)}, chainTokens(5, 0, 1), testBS).WithGroup(0, "full_attention")},
	}
}

func TestInteropWithALibzmqVLLMPublisher(t *testing.T) {
	pythontest.RequireZMQ(t)
	_, stdout := pythontest.Start(t, "testdata/vllm_publisher.py")
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("publisher did not start: %v", err)
	}
	var pubPort, replayPort int
	if _, err := fmt.Sscanf(line, "READY %d %d", &pubPort, &replayPort); err != nil {
		t.Fatalf("publisher said %q: %v", line, err)
	}

	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	spec := kvevents.WorkerSpec{WorkerID: w1, BlockSize: testBS, DPSize: 1,
		Endpoint:       fmt.Sprintf("tcp://127.0.0.1:%d", pubPort),
		ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", replayPort)}
	if err := m.Attach(spec, ix); err != nil {
		t.Fatal(err)
	}
	script := interopScript()
	waitUntil(t, "every scripted batch from the libzmq publisher is applied, then a live one", func() bool {
		st, ok := m.Listener(w1, 0)
		return ok && st.NextSeq > uint64(len(script))+1
	})

	ref := kvindex.New(kvindex.Config{BlockSize: testBS})
	conv := kvevents.NewConverter(w1, 0, testBS, false)
	for seq, events := range script {
		b, err := kvevents.DecodeBatch(kt.Batch{Events: events}.Encode())
		if err != nil {
			t.Fatal(err)
		}
		evs, _ := conv.Convert(b, uint64(seq), nil)
		for _, ev := range evs {
			if err := ref.Apply(ev); err != nil {
				t.Fatalf("reference apply: %v", err)
			}
		}
	}
	if d := cmp.Diff(ref.Dump(), ix.Dump()); d != "" {
		t.Errorf("index built from the libzmq publisher differs (-want +got):\n%s", d)
	}
	tenant := kvindex.BlockHashes(chainTokens(3, 0, 2), testBS, kvindex.Seed("", "tenant-a"))
	queries := map[string][]uint64{
		"family 1 (device + host tier)":        localHashes(1, 3),
		"family 2 (bin hashes)":                localHashes(2, 2),
		"family 3 (namespace and inheritance)": tenant,
		"family 5 (hybrid groups)":             localHashes(5, 1),
	}
	for name, q := range queries {
		want := sortMatches(ref.FindMatches(q, nil))
		got := sortMatches(ix.FindMatches(q, nil))
		if len(want) == 0 {
			t.Errorf("%s: the reference matches nothing; the script is wrong", name)
		}
		if d := cmp.Diff(want, got); d != "" {
			t.Errorf("%s: matches differ (-want +got):\n%s", name, d)
		}
	}
	st := m.Stats()
	if st.ReplaysOK < 1 || st.ReplayedBatches < uint64(len(script)) {
		t.Errorf("replayed %d batches in %d replays, want the %d scripted batches over the libzmq ROUTER",
			st.ReplayedBatches, st.ReplaysOK, len(script))
	}
	if st.BatchesApplied <= st.ReplayedBatches {
		t.Errorf("no live batch from the libzmq PUB was applied: %+v", st)
	}
	if st.EventsDropped[kvevents.DropGroupKind] != 1 || st.EventsDroppedTotal() != 1 {
		t.Errorf("event drops = %v, want only the sliding-window store", st.EventsDropped)
	}
	if st.SinkErrors != [kvevents.NumSinkErrorKinds]uint64{} || st.LostBatches != 0 || st.BatchesDroppedTotal() != 0 {
		t.Errorf("stats = %+v, want no sink error, loss or dropped batch", st)
	}
}
