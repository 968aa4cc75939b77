package kvevents_test

import (
	"encoding/binary"
	"math"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

const w1 uint64 = 1

func TestListenerAppliesBatchesInOrder(t *testing.T) {
	pub := kt.New(t, kt.Options{})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)

	pub.Publish(storeChain(1, 0, 2))
	pub.Publish(storeChain(1, 2, 3), storeChain(2, 0, 1))
	pub.Publish(kt.Removed(ext(2, 0)))
	waitNextSeq(t, m, w1, 0, 3)

	if d := deviceDepth(ix, w1, 0, 1, 3); d != 3 {
		t.Errorf("family 1 device depth = %d, want 3 (a chain stored over two batches)", d)
	}
	if d := deviceDepth(ix, w1, 0, 2, 1); d != 0 {
		t.Errorf("family 2 device depth = %d, want 0 after its removal", d)
	}
	st := m.Stats()
	if st.BatchesApplied != 3 || st.EventsApplied != 4 || st.Gaps != 0 || st.LostBatches != 0 || st.BatchesStale != 0 {
		t.Errorf("stats = %+v, want 3 batches / 4 events applied, no gap, nothing stale", st)
	}
}

func TestListenerIgnoresStaleBatches(t *testing.T) {
	pub := kt.New(t, kt.Options{})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)

	pub.Publish(storeChain(1, 0, 1))
	pub.Publish(storeChain(1, 1, 2))
	pub.PublishSeq(1, kt.Cleared()) // a duplicate of seq 1 carrying a clear
	pub.PublishSeq(2, storeChain(1, 2, 3))
	waitNextSeq(t, m, w1, 0, 3)

	if d := deviceDepth(ix, w1, 0, 1, 3); d != 3 {
		t.Errorf("device depth = %d, want 3: the stale clear must not be applied", d)
	}
	if st := m.Stats(); st.BatchesStale != 1 || st.BatchesApplied != 3 {
		t.Errorf("stale = %d applied = %d, want 1 and 3", st.BatchesStale, st.BatchesApplied)
	}
}

func TestListenerGapWithoutReplayIsCountedAndApplied(t *testing.T) {
	pub := kt.New(t, kt.Options{})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)

	pub.Publish(storeChain(1, 0, 1))
	pub.PublishSeq(4, storeChain(2, 0, 2))
	waitNextSeq(t, m, w1, 0, 5)

	st := m.Stats()
	if st.Gaps != 1 || st.LostBatches != 3 {
		t.Errorf("gaps = %d lost = %d, want 1 gap of 3 lost batches", st.Gaps, st.LostBatches)
	}
	if st.ReplaysOK+st.ReplaysFailed+st.ReplaysTimeout != 0 {
		t.Errorf("a replay was attempted without a replay endpoint: %+v", st)
	}
	if d := deviceDepth(ix, w1, 0, 2, 2); d != 2 {
		t.Errorf("the batch after the gap was not applied: depth %d", d)
	}
}

// Two publishers each jumping their seq to near 2^64 lose about 2^64 batches between them: the
// counter must saturate, not wrap to a small number (Prometheus reads a counter going down as a
// reset).
func TestLostBatchesSaturatesInsteadOfWrapping(t *testing.T) {
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	const jump = math.MaxUint64 - 1
	for _, w := range []uint64{w1, w1 + 1} {
		pub := kt.New(t, kt.Options{})
		attachPublisher(t, m, pub, w, ix)
		pub.Publish(storeChain(uint32(w), 0, 1))
		waitNextSeq(t, m, w, 0, 1)
		pub.PublishSeq(jump, storeChain(uint32(w)+10, 0, 1))
		waitNextSeq(t, m, w, 0, jump+1)
	}
	if st := m.Stats(); st.Gaps != 2 || st.LostBatches != math.MaxUint64 {
		t.Errorf("gaps = %d lost = %d, want 2 gaps and a saturated count %d", st.Gaps, st.LostBatches, uint64(math.MaxUint64))
	}
}

func TestListenerRecoversAGapByReplay(t *testing.T) {
	for _, four := range []bool{false, true} {
		name := "3-frame replies recover the gap exactly"
		if four {
			name = "4-frame replies recover the gap exactly"
		}
		t.Run(name, func(t *testing.T) {
			pub := kt.New(t, kt.Options{Replay: true, FourFrameReplies: four, Topic: "kv@0"})
			m := newManager(t, kvevents.ManagerConfig{})
			ix := kvindex.New(kvindex.Config{BlockSize: testBS})
			attachPublisher(t, m, pub, w1, ix)

			pub.Publish(storeChain(1, 0, 1))
			pub.Withhold(storeChain(1, 1, 2))
			pub.Withhold(storeChain(1, 2, 3))
			pub.Publish(storeChain(1, 3, 4)) // its parent is in the withheld batch 2
			waitNextSeq(t, m, w1, 0, 4)

			if d := deviceDepth(ix, w1, 0, 1, 4); d != 4 {
				t.Errorf("device depth = %d, want 4 (replayed batches applied before the live one)", d)
			}
			st := m.Stats()
			if st.Gaps != 1 || st.ReplaysOK != 1 || st.ReplayedBatches != 2 || st.LostBatches != 0 {
				t.Errorf("stats = %+v, want 1 gap, 1 ok replay of 2 batches, none lost", st)
			}
			if got := pub.ReplayRequests(); !slices.Equal(got, []uint64{1}) {
				t.Errorf("replay requests = %v, want [1]", got)
			}
			if st.SinkErrors[kvevents.SinkParentNotFound] != 0 {
				t.Errorf("a store lost its parent: %+v", st.SinkErrors)
			}
		})
	}
}

func TestFreshListenerWhoseFirstSeqIsAboveZeroReplaysFromZero(t *testing.T) {
	pub := kt.New(t, kt.Options{Replay: true})
	for i := uint32(0); i < 5; i++ {
		pub.Withhold(storeChain(1, i, i+1)) // published before anyone subscribed
	}
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)
	pub.Publish(storeChain(1, 5, 6))
	waitNextSeq(t, m, w1, 0, 6)

	if d := deviceDepth(ix, w1, 0, 1, 6); d != 6 {
		t.Errorf("device depth = %d, want 6", d)
	}
	if got := pub.ReplayRequests(); !slices.Equal(got, []uint64{0}) {
		t.Errorf("replay requests = %v, want [0]", got)
	}
	if st := m.Stats(); st.ReplayedBatches != 5 || st.LostBatches != 0 {
		t.Errorf("replayed = %d lost = %d, want 5 and 0", st.ReplayedBatches, st.LostBatches)
	}
}

func TestHoldAndReleaseForStartupRecovery(t *testing.T) {
	t.Run("held events apply after the snapshot and a bootstrapped listener does not replay", func(t *testing.T) {
		pub := kt.New(t, kt.Options{Replay: true})
		for i := uint32(0); i < 3; i++ {
			pub.Withhold(storeChain(1, i, i+1)) // published before anyone subscribed
		}
		m := newManager(t, kvevents.ManagerConfig{})
		ix := kvindex.New(kvindex.Config{BlockSize: testBS})
		m.HoldEvents()
		attachPublisher(t, m, pub, w1, ix)
		pub.Publish(storeChain(1, 3, 4))
		time.Sleep(100 * time.Millisecond)
		if st, _ := m.Listener(w1, 0); st.Started || ix.Stats().Entries != 0 {
			t.Fatalf("events were applied while held: listener %+v, index %+v", st, ix.Stats())
		}
		// The peer snapshot holds blocks 0..2; the held live batch extends them.
		ref := kvindex.New(kvindex.Config{BlockSize: testBS})
		conv := kvevents.NewConverter(w1, 0, testBS, false)
		for i := uint32(0); i < 3; i++ {
			b, _ := kvevents.DecodeBatch(kt.Batch{Events: []kt.Event{storeChain(1, i, i+1)}}.Encode())
			evs, _ := conv.Convert(b, uint64(i), nil)
			_ = ref.Apply(evs[0])
		}
		if err := ix.Restore(ref.Dump()); err != nil {
			t.Fatal(err)
		}
		m.ReleaseEvents(true)
		waitNextSeq(t, m, w1, 0, 4)
		if d := deviceDepth(ix, w1, 0, 1, 4); d != 4 {
			t.Errorf("device depth = %d, want 4", d)
		}
		if got := pub.ReplayRequests(); len(got) != 0 {
			t.Errorf("replay requests = %v, want none after a snapshot bootstrap", got)
		}
		if st := m.Stats(); st.Gaps != 0 {
			t.Errorf("gaps = %d, want 0", st.Gaps)
		}
	})
	t.Run("without a snapshot the released listener replays from zero", func(t *testing.T) {
		pub := kt.New(t, kt.Options{Replay: true})
		pub.Withhold(storeChain(1, 0, 1))
		m := newManager(t, kvevents.ManagerConfig{})
		ix := kvindex.New(kvindex.Config{BlockSize: testBS})
		m.HoldEvents()
		attachPublisher(t, m, pub, w1, ix)
		pub.Publish(storeChain(1, 1, 2))
		m.ReleaseEvents(false)
		waitNextSeq(t, m, w1, 0, 2)
		if d := deviceDepth(ix, w1, 0, 1, 2); d != 2 {
			t.Errorf("device depth = %d, want 2", d)
		}
		if got := pub.ReplayRequests(); !slices.Equal(got, []uint64{0}) {
			t.Errorf("replay requests = %v, want [0]", got)
		}
	})
}

func TestReplayTimeoutAppliesWhatArrived(t *testing.T) {
	pub := kt.New(t, kt.Options{Replay: true, ReplayNoEnd: true})
	m := newManager(t, kvevents.ManagerConfig{ReplayTimeout: 300 * time.Millisecond})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)

	pub.Publish(storeChain(1, 0, 1))
	pub.Withhold(storeChain(1, 1, 2))
	start := time.Now()
	pub.Publish(storeChain(1, 2, 3))
	waitNextSeq(t, m, w1, 0, 3)

	if el := time.Since(start); el < 250*time.Millisecond {
		t.Errorf("replay ended after %v, before its 300ms timeout", el)
	}
	st := m.Stats()
	if st.ReplaysTimeout != 1 || st.ReplaysOK != 0 || st.ReplayedBatches != 1 || st.LostBatches != 0 {
		t.Errorf("stats = %+v, want 1 timed-out replay that still recovered 1 batch", st)
	}
	if d := deviceDepth(ix, w1, 0, 1, 3); d != 3 {
		t.Errorf("device depth = %d, want 3", d)
	}
}

func TestReplayFailureCountsTheLostRange(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadReplay := "tcp://" + l.Addr().String()
	_ = l.Close()

	pub := kt.New(t, kt.Options{})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	spec := kvevents.WorkerSpec{WorkerID: w1, BlockSize: testBS, DPSize: 1, Endpoints: map[uint32]string{0: pub.Endpoint()},
		ReplayEndpoint: deadReplay}
	if err := m.Attach(spec, ix); err != nil {
		t.Fatal(err)
	}
	pub.WaitForSubscriber()
	pub.Publish(storeChain(1, 0, 1))
	pub.PublishSeq(3, storeChain(2, 0, 1))
	waitNextSeq(t, m, w1, 0, 4)
	st := m.Stats()
	if st.ReplaysFailed < 1 || st.LostBatches != 2 || st.Gaps != 1 {
		t.Errorf("stats = %+v, want a failed replay and 2 lost batches", st)
	}
	if d := deviceDepth(ix, w1, 0, 2, 1); d != 1 {
		t.Errorf("the live batch after a failed replay was not applied")
	}
}

func TestPublisherRestartAtTheSameAddressClearsAndResyncs(t *testing.T) {
	for _, replay := range []bool{false, true} {
		name := "without replay the rank is cleared and the new sequence adopted"
		if replay {
			name = "with replay the rank is cleared and the new life replayed from zero"
		}
		t.Run(name, func(t *testing.T) {
			pub := kt.New(t, kt.Options{Replay: replay})
			m := newManager(t, kvevents.ManagerConfig{})
			ix := kvindex.New(kvindex.Config{BlockSize: testBS})
			attachPublisher(t, m, pub, w1, ix)
			for i := uint32(0); i < 5; i++ {
				pub.Publish(storeChain(1, i, i+1))
			}
			waitNextSeq(t, m, w1, 0, 5)
			endpoint := pub.Endpoint()

			pub.Restart()
			if pub.Endpoint() != endpoint {
				t.Fatalf("restart moved the endpoint from %s to %s", endpoint, pub.Endpoint())
			}
			pub.WaitForSubscriber()
			if replay {
				pub.Withhold(storeChain(2, 0, 1))
			} else {
				pub.Publish(storeChain(2, 0, 1))
			}
			pub.Publish(storeChain(2, 1, 2))
			waitNextSeq(t, m, w1, 0, 2)

			if d := deviceDepth(ix, w1, 0, 1, 5); d != 0 {
				t.Errorf("blocks of the publisher's previous life survived: depth %d", d)
			}
			if d := deviceDepth(ix, w1, 0, 2, 2); d != 2 {
				t.Errorf("new life depth = %d, want 2", d)
			}
			st := m.Stats()
			if st.PublisherRestarts != 1 || st.Reconnects < 1 || st.LostBatches != 0 {
				t.Errorf("stats = %+v, want 1 restart, a reconnect, nothing lost", st)
			}
			if replay && !slices.Equal(pub.ReplayRequests(), []uint64{0}) {
				t.Errorf("replay requests after restart = %v, want [0]", pub.ReplayRequests())
			}
		})
	}
}

func TestReconnectThatContinuesTheSequenceKeepsEverything(t *testing.T) {
	pub := kt.New(t, kt.Options{})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)
	pub.Publish(storeChain(1, 0, 1))
	pub.Publish(storeChain(1, 1, 2))
	waitNextSeq(t, m, w1, 0, 2)

	pub.Restart()
	pub.WaitForSubscriber()
	pub.PublishSeq(2, storeChain(1, 2, 3)) // the same engine carries on after a network blip
	waitNextSeq(t, m, w1, 0, 3)
	if d := deviceDepth(ix, w1, 0, 1, 3); d != 3 {
		t.Errorf("device depth = %d, want 3", d)
	}
	if st := m.Stats(); st.PublisherRestarts != 0 || st.RanksCleared != 0 {
		t.Errorf("a continuing sequence was treated as a restart: %+v", st)
	}
}

func TestListenerDropsMalformedMessages(t *testing.T) {
	pub := kt.New(t, kt.Options{})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)

	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], 0)
	pub.PublishFrames([]byte(""), seq[:])                         // 2 frames
	pub.PublishFrames([]byte(""), seq[:], []byte{0x90}, []byte{}) // 4 frames
	pub.PublishFrames([]byte(""), seq[:4], []byte{0x90})          // 4-byte seq
	pub.PublishPayload([]byte{0xc1, 0x00})                        // seq 0: not msgpack
	pub.Publish(storeChain(1, 0, 1))                              // seq 1
	waitNextSeq(t, m, w1, 0, 2)

	st := m.Stats()
	want := [kvevents.NumBatchDropReasons]uint64{}
	want[kvevents.BatchDropFrames] = 2
	want[kvevents.BatchDropSeqFrame] = 1
	want[kvevents.BatchDropPayload] = 1
	if st.BatchesDropped != want {
		t.Errorf("batch drops = %v, want %v", st.BatchesDropped, want)
	}
	if st.Gaps != 0 {
		t.Errorf("an undecodable batch must still advance the watermark; gaps = %d", st.Gaps)
	}
	if d := deviceDepth(ix, w1, 0, 1, 1); d != 1 {
		t.Errorf("device depth = %d, want 1", d)
	}
}

func TestListenerCountsDroppedEventsAndSinkErrors(t *testing.T) {
	pub := kt.New(t, kt.Options{})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)

	pub.Publish(
		kt.Stored(nil, []uint64{1}, []uint32{1, 2}, 2), // block size mismatch
		kt.Stored(nil, []uint64{2}, chainTokens(1, 0, 1), testBS).WithMedium("TAPE"),
		kt.Stored(kt.Parent(99), []uint64{3}, chainTokens(1, 0, 1), testBS), // unknown parent
		kt.Removed(42), // unknown block
		kt.Raw([]any{"Mystery"}),
	)
	waitNextSeq(t, m, w1, 0, 1)
	st := m.Stats()
	if st.EventsDropped[kvevents.DropBlockSize] != 1 || st.EventsDropped[kvevents.DropUnknownMedium] != 1 ||
		st.EventsDropped[kvevents.DropUnknownType] != 1 || st.EventsDroppedTotal() != 3 {
		t.Errorf("event drops = %v", st.EventsDropped)
	}
	if st.SinkErrors[kvevents.SinkParentNotFound] != 1 || st.SinkErrors[kvevents.SinkBlockNotFound] != 1 {
		t.Errorf("sink errors = %v, want one parent-not-found and one block-not-found", st.SinkErrors)
	}
}

func TestBatchDPRankOverridesTheListenerRank(t *testing.T) {
	rank := uint32(1)
	pub := kt.New(t, kt.Options{DPRank: &rank})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	// One endpoint registered for rank 0 of a 2-rank worker carries rank-1 batches.
	spec := kvevents.WorkerSpec{WorkerID: w1, BlockSize: testBS, DPSize: 2,
		Endpoints: map[uint32]string{0: pub.Endpoint(), 1: "tcp://127.0.0.1:1"}}
	if err := m.Attach(spec, ix); err != nil {
		t.Fatal(err)
	}
	pub.WaitForSubscriber()
	pub.Publish(storeChain(1, 0, 1))
	waitNextSeq(t, m, w1, 0, 1)
	if d := deviceDepth(ix, w1, 1, 1, 1); d != 1 {
		t.Errorf("rank 1 depth = %d, want 1", d)
	}
	if d := deviceDepth(ix, w1, 0, 1, 1); d != 0 {
		t.Errorf("rank 0 depth = %d, want 0", d)
	}
}
