package kvevents_test

import (
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

// faultLife is one publisher lifetime: its batches in sequence order and which of them are lost
// on the live path (kept only in the replay buffer).
type faultLife struct {
	batches [][]kt.Event
	lost    map[int]bool
}

// TestFaultInjectedRunEndsWithTheFaultFreeIndex is the fault test: the publisher skips sequence
// numbers on the live path (the batches exist only in its replay buffer), then restarts at the
// same address with its sequence back at 0 and skips again, including its very first batch.
// kvepp must replay every gap from the ROUTER, detect the restart, clear the rank, and end with
// exactly the index a fault-free run builds (every batch applied in order, with the engine's
// restart as a clear).
func TestFaultInjectedRunEndsWithTheFaultFreeIndex(t *testing.T) {
	lives := []faultLife{
		{
			batches: [][]kt.Event{
				{storeChain(1, 0, 2)},
				{storeChain(1, 2, 3), storeChain(2, 0, 1)},
				{storeChain(1, 3, 5)},         // lost live
				{storeChain(2, 1, 3).AsMap()}, // lost live
				{kt.Removed(ext(1, 4)), storeChain(3, 0, 2)},
				{storeChain(1, 4, 6), kt.Removed(ext(3, 1))}, // lost live
				{storeChain(3, 1, 3).WithMedium("CPU")},
				{storeChain(1, 6, 7)},
			},
			lost: map[int]bool{2: true, 3: true, 5: true},
		},
		{
			batches: [][]kt.Event{
				{storeChain(4, 0, 2)}, // lost live: the first batch after the restart
				{storeChain(4, 2, 3)},
				{storeChain(1, 0, 1)}, // lost live
				{storeChain(1, 1, 3), kt.Removed(ext(4, 2))},
			},
			lost: map[int]bool{0: true, 2: true},
		},
	}

	// Fault-free reference: every batch converted and applied in order, the restart as a clear.
	ref := kvindex.New(kvindex.Config{BlockSize: testBS})
	conv := kvevents.NewConverter(w1, 0, testBS, false)
	for li, life := range lives {
		if li > 0 {
			if err := ref.Apply(kvindex.Event{WorkerID: w1, Kind: kvindex.EventCleared}); err != nil {
				t.Fatal(err)
			}
		}
		for seq, events := range life.batches {
			b, err := kvevents.DecodeBatch(kt.Batch{Events: events}.Encode())
			if err != nil {
				t.Fatal(err)
			}
			evs, errs := conv.Convert(b, uint64(seq), nil)
			if len(errs) != 0 {
				t.Fatalf("reference conversion dropped events: %v", errs)
			}
			for _, ev := range evs {
				if err := ref.Apply(ev); err != nil {
					t.Fatalf("reference apply: %v", err)
				}
			}
		}
	}

	// Fault-injected run over real sockets.
	pub := kt.New(t, kt.Options{Replay: true})
	m := newManager(t, kvevents.ManagerConfig{Logger: zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel)})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)
	for li, life := range lives {
		if li > 0 {
			pub.Restart()
			pub.WaitForSubscriber()
		}
		for i, events := range life.batches {
			if life.lost[i] {
				pub.Withhold(events...)
			} else {
				pub.Publish(events...)
			}
		}
		waitNextSeq(t, m, w1, 0, uint64(len(life.batches)))
		if li == 0 {
			// Before the restart the faulty run already equals the reference's first life.
			if got := ix.Stats().Entries; got == 0 {
				t.Fatal("nothing indexed in the first life")
			}
		}
	}

	if d := cmp.Diff(ref.Dump(), ix.Dump()); d != "" {
		t.Errorf("index dump differs from the fault-free run (-want +got):\n%s", d)
	}
	for family := uint32(1); family <= 4; family++ {
		want := sortMatches(ref.FindMatches(localHashes(family, 8), nil))
		got := sortMatches(ix.FindMatches(localHashes(family, 8), nil))
		if d := cmp.Diff(want, got); d != "" {
			t.Errorf("FindMatches for family %d differs (-want +got):\n%s", family, d)
		}
	}
	if got := pub.ReplayRequests(); !slices.Equal(got, []uint64{0, 2}) {
		t.Errorf("replay requests in the second life = %v, want [0 2]", got)
	}
	st := m.Stats()
	if st.PublisherRestarts != 1 || st.LostBatches != 0 || st.ReplayedBatches != 5 || st.ReplaysOK != 4 {
		t.Errorf("stats = %+v, want 1 restart, 0 lost, 5 replayed batches in 4 ok replays", st)
	}
	if st.SinkErrors != [kvevents.NumSinkErrorKinds]uint64{} {
		t.Errorf("the index rejected events: %v", st.SinkErrors)
	}
}

func sortMatches(ms []kvindex.Match) []kvindex.Match {
	slices.SortFunc(ms, func(a, b kvindex.Match) int {
		if a.Candidate.WorkerID != b.Candidate.WorkerID {
			return int(a.Candidate.WorkerID) - int(b.Candidate.WorkerID)
		}
		return int(a.Candidate.DPRank) - int(b.Candidate.DPRank)
	})
	return ms
}
