package kvevents_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/internal/syncbuf"
	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

// logRecords returns the JSON log records in logs whose message contains msg.
func logRecords(t *testing.T, logs *syncbuf.Buffer, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(logs.Bytes()))
	for sc.Scan() {
		var rec map[string]any
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		if m, _ := rec["message"].(string); strings.Contains(m, msg) {
			out = append(out, rec)
		}
	}
	return out
}

// teeSink records every event and applies it to an index.
type teeSink struct {
	recordingSink
	ix *kvindex.Index
}

func (s *teeSink) Apply(ev kvindex.Event) error {
	_ = s.recordingSink.Apply(ev)
	return s.ix.Apply(ev)
}

// eventIDs returns the event ids (batch sequence numbers) in application order.
func (s *teeSink) eventIDs() []uint64 {
	var ids []uint64
	for _, ev := range s.events() {
		ids = append(ids, ev.EventID)
	}
	return ids
}

func TestGapWithoutReplayIsLoggedWithItsRange(t *testing.T) {
	var logs syncbuf.Buffer
	pub := kt.New(t, kt.Options{})
	m := newManager(t, kvevents.ManagerConfig{Logger: zerolog.New(&logs)})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)

	pub.Publish(storeChain(1, 0, 1))
	pub.PublishSeq(4, storeChain(2, 0, 1))
	waitNextSeq(t, m, w1, 0, 5)

	recs := logRecords(t, &logs, "KV event batches lost")
	if len(recs) != 1 {
		t.Fatalf("%d lost-range warnings, want 1", len(recs))
	}
	r := recs[0]
	if r["level"] != "warn" || r["from"] != 1.0 || r["to"] != 4.0 || r["lost"] != 3.0 || r["worker_id"] != 1.0 || r["replay"] != false {
		t.Errorf("lost-range warning = %v, want level warn, from 1, to 4, lost 3, worker_id 1, replay false", r)
	}
	if st := m.Stats(); st.LostBatches != 3 || st.Gaps != 1 {
		t.Errorf("stats = %+v, want 3 lost batches in 1 gap", st)
	}
}

func TestReplayEndsOnEitherEndMarker(t *testing.T) {
	for _, c := range []struct {
		name string
		end  kt.EndMarker
	}{
		{"the all-ones seq ends the replay even with a payload", kt.EndSeqOnly},
		{"an empty payload ends the replay whatever its seq", kt.EndEmptyPayloadOnly},
		{"vLLM's marker (all-ones seq, empty payload) ends the replay", kt.EndSeqAndEmptyPayload},
	} {
		t.Run(c.name, func(t *testing.T) {
			pub := kt.New(t, kt.Options{Replay: true, ReplayEnd: c.end})
			m := newManager(t, kvevents.ManagerConfig{ReplayTimeout: 5 * time.Second})
			ix := kvindex.New(kvindex.Config{BlockSize: testBS})
			attachPublisher(t, m, pub, w1, ix)

			pub.Publish(storeChain(1, 0, 1))
			pub.Withhold(storeChain(1, 1, 2))
			start := time.Now()
			pub.Publish(storeChain(1, 2, 3))
			waitNextSeq(t, m, w1, 0, 3)
			if el := time.Since(start); el > 2*time.Second {
				t.Errorf("the replay took %v: the end marker was not recognised", el)
			}
			st := m.Stats()
			if st.ReplaysOK != 1 || st.ReplaysTimeout != 0 || st.ReplaysFailed != 0 || st.ReplayedBatches != 1 || st.LostBatches != 0 {
				t.Errorf("stats = %+v, want one ok replay of one batch", st)
			}
			if d := deviceDepth(ix, w1, 0, 1, 3); d != 3 {
				t.Errorf("device depth = %d, want 3", d)
			}
		})
	}
}

func TestMalformedReplayReplyAbortsTheReplay(t *testing.T) {
	pub := kt.New(t, kt.Options{Replay: true, ReplayMalformed: true})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)

	pub.Publish(storeChain(1, 0, 1))
	pub.Withhold(storeChain(2, 0, 1))
	pub.Withhold(storeChain(3, 0, 1))
	pub.Publish(storeChain(4, 0, 1))
	waitNextSeq(t, m, w1, 0, 4)

	st := m.Stats()
	if st.ReplaysFailed != 1 || st.ReplaysOK != 0 || st.ReplayedBatches != 0 || st.LostBatches != 2 {
		t.Errorf("stats = %+v, want one failed replay and the 2-batch gap lost", st)
	}
	if d := deviceDepth(ix, w1, 0, 4, 1); d != 1 {
		t.Errorf("the live batch after the aborted replay was not applied: depth %d", d)
	}
}

func TestGapOlderThanTheReplayBufferRecoversWhatIsBuffered(t *testing.T) {
	pub := kt.New(t, kt.Options{Replay: true, ReplayBuffer: 2})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)

	pub.Publish(storeChain(1, 0, 1)) // seq 0
	for f := uint32(2); f <= 5; f++ {
		pub.Withhold(storeChain(f, 0, 1)) // seq 1..4; the ring keeps only the newest 2 batches
	}
	pub.Publish(storeChain(6, 0, 1)) // seq 5: ring = {4, 5}
	waitNextSeq(t, m, w1, 0, 6)

	for f, want := range map[uint32]uint32{1: 1, 2: 0, 3: 0, 4: 0, 5: 1, 6: 1} {
		if d := deviceDepth(ix, w1, 0, f, 1); d != want {
			t.Errorf("family %d depth = %d, want %d", f, d, want)
		}
	}
	st := m.Stats()
	if st.Gaps != 1 || st.ReplaysOK != 1 || st.ReplayedBatches != 1 || st.LostBatches != 3 {
		t.Errorf("stats = %+v, want 1 gap, 1 ok replay recovering seq 4, seqs 1..3 lost", st)
	}
}

func TestLiveBatchesDuringAReplayApplyAfterTheReplayedOnes(t *testing.T) {
	pub := kt.New(t, kt.Options{Replay: true, ReplayDelay: 300 * time.Millisecond})
	m := newManager(t, kvevents.ManagerConfig{})
	sink := &teeSink{ix: kvindex.New(kvindex.Config{BlockSize: testBS})}
	attachPublisher(t, m, pub, w1, sink)

	pub.Publish(storeChain(1, 0, 1))  // seq 0
	pub.Withhold(storeChain(1, 1, 2)) // seq 1, lost live
	pub.Withhold(storeChain(1, 2, 3)) // seq 2, lost live
	pub.Publish(storeChain(1, 3, 4))  // seq 3: triggers a replay that answers after 300 ms
	pub.Publish(storeChain(1, 4, 5))  // seq 4 and 5 arrive while the replay is in flight
	pub.Publish(storeChain(1, 5, 6))
	waitNextSeq(t, m, w1, 0, 6)

	if got := sink.eventIDs(); !slices.Equal(got, []uint64{0, 1, 2, 3, 4, 5}) {
		t.Errorf("events applied in seq order %v, want 0..5", got)
	}
	if got := pub.ReplayRequests(); !slices.Equal(got, []uint64{1}) {
		t.Errorf("replay requests = %v, want one, from 1", got)
	}
	if d := deviceDepth(sink.ix, w1, 0, 1, 6); d != 6 {
		t.Errorf("device depth = %d, want 6", d)
	}
	if st := m.Stats(); st.SinkErrors != [kvevents.NumSinkErrorKinds]uint64{} || st.ReplayedBatches != 2 {
		t.Errorf("stats = %+v, want 2 replayed batches and no sink error", st)
	}
}

// TestDeleteThenRegisterResetsTheWorker is the catalog's DELETE then POST of one worker with
// unchanged endpoints: the caller detaches the listeners and removes the worker's blocks, and the
// new registration starts from a fresh watermark, replaying the publisher's buffer from 0.
func TestDeleteThenRegisterResetsTheWorker(t *testing.T) {
	pub := kt.New(t, kt.Options{Replay: true})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)
	for i := uint32(0); i < 3; i++ {
		pub.Publish(storeChain(1, i, i+1))
	}
	waitNextSeq(t, m, w1, 0, 3)

	m.Detach(w1)
	ix.RemoveWorker(w1)
	if d := deviceDepth(ix, w1, 0, 1, 3); d != 0 {
		t.Fatalf("blocks survived RemoveWorker: depth %d", d)
	}
	pub.WaitForNoSubscriber()
	// Seq 3, published while the worker is unregistered: nobody receives it live. Withheld rather
	// than published, because zmq4's PUB sends from a queue and could still hand a published
	// batch to the new subscriber, which would then start before the check below.
	pub.Withhold(storeChain(1, 3, 4))

	attachPublisher(t, m, pub, w1, ix)
	if st, ok := m.Listener(w1, 0); !ok || st.Started {
		t.Fatalf("the re-registered worker's listener = %+v (found %t), want a fresh watermark", st, ok)
	}
	pub.Publish(storeChain(1, 4, 5)) // seq 4: first batch of the new listener, above 0
	waitNextSeq(t, m, w1, 0, 5)

	if got := pub.ReplayRequests(); !slices.Equal(got, []uint64{0}) {
		t.Errorf("replay requests = %v, want one from 0", got)
	}
	if d := deviceDepth(ix, w1, 0, 1, 5); d != 5 {
		t.Errorf("device depth = %d, want 5: the fresh listener rebuilt the worker from the replay buffer", d)
	}
	if st := m.Stats(); st.SinkErrors != [kvevents.NumSinkErrorKinds]uint64{} {
		t.Errorf("sink errors = %v", st.SinkErrors)
	}
}
