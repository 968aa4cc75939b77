package kvevents_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/internal/syncbuf"
	"github.com/kvepp/kvepp/internal/zmqtcp"
	"github.com/kvepp/kvepp/internal/zmqtcp/zmqtcptest"
	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

// Tests of the fresh-user audit (issue 10): one result per event, index rejections logged at
// info, backoff reset on connect, log texts.

// logged returns a Manager config logging JSON at level into a new buffer.
func logged(level zerolog.Level) (kvevents.ManagerConfig, *syncbuf.Buffer) {
	b := &syncbuf.Buffer{}
	return kvevents.ManagerConfig{Logger: zerolog.New(b).Level(level)}, b
}

// loggedPublisher attaches pub as worker w1 to a Manager logging JSON at info into the returned
// buffer.
func loggedPublisher(t *testing.T, pub *kt.Publisher) (*kt.Publisher, *kvevents.Manager, *syncbuf.Buffer) {
	t.Helper()
	cfg, logs := logged(zerolog.InfoLevel)
	m := newManager(t, cfg)
	attachPublisher(t, m, pub, w1, kvindex.New(kvindex.Config{BlockSize: testBS}))
	return pub, m, logs
}

func TestEachEventCountsUnderOneResult(t *testing.T) {
	pub := kt.New(t, kt.Options{})
	cfg, logs := logged(zerolog.InfoLevel)
	m := newManager(t, cfg)
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	attachPublisher(t, m, pub, w1, ix)

	pub.Publish(
		storeChain(1, 0, 1), // applied
		kt.Stored(kt.Parent(99), []uint64{3}, chainTokens(2, 0, 1), testBS), // unknown parent: rejected
		kt.Removed(42), // unknown block: nothing to remove, applied
		kt.Stored(nil, []uint64{1}, []uint32{1, 2}, 2),                      // block size mismatch: dropped
		kt.Stored(kt.Parent(98), []uint64{4}, chainTokens(3, 0, 1), testBS), // rejected
	)
	pub.Publish(kt.Stored(kt.Parent(97), []uint64{5}, chainTokens(4, 0, 1), testBS)) // rejected
	waitNextSeq(t, m, w1, 0, 2)

	st := m.Stats()
	if st.EventsApplied != 2 || st.EventsRejected != 3 || st.EventsDroppedTotal() != 1 {
		t.Fatalf("applied %d rejected %d dropped %d, want 2, 3 and 1 (one result per event)",
			st.EventsApplied, st.EventsRejected, st.EventsDroppedTotal())
	}
	if st.SinkErrors[kvevents.SinkParentNotFound] != 3 || st.SinkErrors[kvevents.SinkBlockNotFound] != 1 {
		t.Fatalf("index errors %v", st.SinkErrors)
	}
	t.Run("index rejections are logged at info, at most once per rank per interval", func(t *testing.T) {
		lines := logRecords(t, logs, "index rejected KV event")
		if len(lines) != 1 {
			t.Fatalf("%d rejection log lines, want 1: %v", len(lines), lines)
		}
		l := lines[0]
		if l["level"] != "info" || l["worker_id"] != float64(w1) || l["dp_rank"] != 0.0 || l["rank_rejections"] != 1.0 {
			t.Fatalf("rejection log line %v", l)
		}
	})
}

func TestRedialBackoffResetsOnASuccessfulConnection(t *testing.T) {
	pub := kt.New(t, kt.Options{})
	cfg, logs := logged(zerolog.DebugLevel)
	cfg.ReconnectMinBackoff = 20 * time.Millisecond
	cfg.ReconnectMaxBackoff = 5 * time.Second
	m := newManager(t, cfg)
	attachPublisher(t, m, pub, w1, kvindex.New(kvindex.Config{BlockSize: testBS}))
	// The publisher restarts twice and never publishes in between.
	for i := 1; i <= 2; i++ {
		pub.Restart()
		waitUntil(t, fmt.Sprintf("connection loss %d is logged", i), func() bool {
			return len(logRecords(t, logs, "connection lost")) >= i
		})
		pub.WaitForSubscriber()
		waitUntil(t, fmt.Sprintf("reconnect %d is counted", i), func() bool { return m.Stats().Reconnects >= uint64(i) })
	}
	for i, l := range logRecords(t, logs, "connection lost") {
		if l["retry_in_ms"] != 20.0 {
			t.Errorf("connection loss %d: retry_in_ms %v, want the 20 ms minimum after a successful connection", i+1, l["retry_in_ms"])
		}
	}
}

func TestKVEventLogsReadWell(t *testing.T) {
	t.Run("a dial error names the endpoint as configured", func(t *testing.T) {
		cfg, logs := logged(zerolog.InfoLevel)
		m := newManager(t, cfg)
		spec := kvevents.WorkerSpec{WorkerID: w1, BlockSize: testBS, DPSize: 1, Endpoints: map[uint32]string{0: "tcp://127.0.0.1:1"}}
		if err := m.Attach(spec, kvindex.New(kvindex.Config{BlockSize: testBS})); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, "the dial failure is logged", func() bool { return len(logRecords(t, logs, "not reachable")) > 0 })
		l := logRecords(t, logs, "not reachable")[0]
		if e, _ := l["error"].(string); strings.Contains(e, "kvepp-watched") || !strings.Contains(e, "tcp://127.0.0.1:1") {
			t.Fatalf("dial error %q", e)
		}
		if _, ok := l["retry_in_ms"]; !ok {
			t.Fatalf("the retry delay has no unit in its name: %v", l)
		}
	})
	t.Run("batches published before the subscription are its start point, logged at info", func(t *testing.T) {
		pub := kt.New(t, kt.Options{})
		for i := uint32(0); i < 3; i++ {
			pub.Withhold(storeChain(1, i, i+1))
		}
		pub, m, logs := loggedPublisher(t, pub)
		pub.Publish(storeChain(1, 3, 4))
		waitNextSeq(t, m, w1, 0, 4)
		if lost := logRecords(t, logs, "batches lost"); len(lost) != 0 {
			t.Fatalf("the subscription's start point was logged as a loss: %v", lost)
		}
		starts := logRecords(t, logs, "subscription starts")
		if len(starts) != 1 || starts[0]["level"] != "info" || starts[0]["seq"] != 3.0 {
			t.Fatalf("start-point log lines %v", starts)
		}
	})
	t.Run("a gap after the start is still a warning", func(t *testing.T) {
		pub, m, logs := loggedPublisher(t, kt.New(t, kt.Options{}))
		pub.Publish(storeChain(1, 0, 1))
		pub.PublishSeq(4, storeChain(2, 0, 2))
		waitNextSeq(t, m, w1, 0, 5)
		if lost := logRecords(t, logs, "batches lost"); len(lost) != 1 || lost[0]["level"] != "warn" {
			t.Fatalf("gap log lines %v", lost)
		}
	})
	t.Run("the block-size warning has no duplicate keys", func(t *testing.T) {
		pub, m, logs := loggedPublisher(t, kt.New(t, kt.Options{}))
		pub.Publish(kt.Stored(nil, []uint64{1}, []uint32{1, 2}, 2))
		waitNextSeq(t, m, w1, 0, 1)
		raw := logs.String()
		for _, line := range strings.Split(strings.TrimSpace(raw), "\n") {
			if !strings.Contains(line, "block_size") {
				continue
			}
			if k := duplicateKey(t, line); k != "" {
				t.Fatalf("log line %s repeats the key %q", line, k)
			}
		}
	})
}

// duplicateKey returns a top-level key that occurs twice in the JSON object line, or "".
func duplicateKey(t *testing.T, line string) string {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(line))
	if _, err := dec.Token(); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		k := tok.(string)
		if seen[k] {
			return k
		}
		seen[k] = true
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			t.Fatal(err)
		}
	}
	return ""
}

// TestAHostilePublisherDoesNotCrashTheListener attaches a worker whose KV-event endpoint and
// replay endpoint declare a 1 TiB frame (without internal/zmqtcp's frame bound zmq4 allocates it
// and the process aborts): the frames are refused and counted, the worker's listener keeps
// redialling, and another worker's events still reach the index.
func TestAHostilePublisherDoesNotCrashTheListener(t *testing.T) {
	before := zmqtcp.OversizedFrames()
	hostile := "tcp://" + zmqtcptest.ServeOversized(t, 1<<40)
	m := newManager(t, kvevents.ManagerConfig{Logger: zerolog.Nop()})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	spec := kvevents.WorkerSpec{WorkerID: 77, BlockSize: testBS, DPSize: 1,
		Endpoints: map[uint32]string{0: hostile}, ReplayEndpoint: hostile}
	if err := m.Attach(spec, ix); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the oversized frames to be refused twice (redialled)", func() bool { return zmqtcp.OversizedFrames()-before >= 2 })
	pub := kt.New(t, kt.Options{})
	attachPublisher(t, m, pub, w1, ix)
	pub.Publish(storeChain(1, 0, 1))
	waitUntil(t, "the good worker's event to be applied", func() bool { return m.Stats().EventsApplied == 1 })
}
