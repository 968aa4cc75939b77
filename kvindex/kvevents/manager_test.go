package kvevents_test

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

func TestValidateAndOffsetEndpoints(t *testing.T) {
	valid := []string{"tcp://127.0.0.1:5557", "tcp://worker-0.pool:1", "tcp://[::1]:65535", "ipc:///tmp/kv.sock", "inproc://kv"}
	for _, ep := range valid {
		t.Run(ep+" is a valid endpoint", func(t *testing.T) {
			if err := kvevents.ValidateEndpoint(ep); err != nil {
				t.Error(err)
			}
		})
	}
	invalid := []string{"", "127.0.0.1:5557", "tcp://127.0.0.1", "tcp://:5557", "tcp://*:5557", "tcp://0.0.0.0:5557",
		"tcp://h:0", "tcp://h:70000", "tcp://h:port", "http://h:80", "ipc://", "inproc://"}
	for _, ep := range invalid {
		t.Run("endpoint "+ep+" is rejected", func(t *testing.T) {
			if err := kvevents.ValidateEndpoint(ep); err == nil {
				t.Error("accepted")
			}
		})
	}
	offsets := []struct {
		base string
		rank uint32
		want string
	}{
		{"tcp://10.0.0.1:5557", 0, "tcp://10.0.0.1:5557"},
		{"tcp://10.0.0.1:5557", 3, "tcp://10.0.0.1:5560"},
		{"tcp://[::1]:5557", 1, "tcp://[::1]:5558"},
		{"ipc:///tmp/kv", 2, "ipc:///tmp/kv_dp2"},
		{"inproc://kv", 1, "inproc://kv_dp1"},
	}
	for _, o := range offsets {
		t.Run("rank "+o.want+" is derived from its base", func(t *testing.T) {
			got, err := kvevents.OffsetEndpoint(o.base, o.rank)
			if err != nil || got != o.want {
				t.Errorf("OffsetEndpoint(%q, %d) = %q, %v; want %q", o.base, o.rank, got, err, o.want)
			}
		})
	}
	t.Run("an offset beyond port 65535 is an error", func(t *testing.T) {
		if _, err := kvevents.OffsetEndpoint("tcp://h:65535", 1); err == nil {
			t.Error("accepted")
		}
	})
}

func TestAttachRejectsInvalidSpecsAndStartsNothing(t *testing.T) {
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	good := "tcp://127.0.0.1:5557"
	cases := []struct {
		name    string
		spec    kvevents.WorkerSpec
		sink    kvevents.Sink
		wantIs  error
		wantMsg string
	}{
		{"block size 0 is invalid", kvevents.WorkerSpec{WorkerID: 1, DPSize: 1, Endpoints: map[uint32]string{0: good}}, ix,
			kvevents.ErrInvalidSpec, "block_size 0"},
		{"data parallel size 0 is invalid", kvevents.WorkerSpec{WorkerID: 1, BlockSize: 4}, ix, kvevents.ErrInvalidSpec, "data_parallel_size"},
		{"a nil sink is invalid", kvevents.WorkerSpec{WorkerID: 1, BlockSize: 4, DPSize: 1, Endpoints: map[uint32]string{0: good}}, nil,
			kvevents.ErrInvalidSpec, "nil sink"},
		{"a rank without endpoint is reported", kvevents.WorkerSpec{WorkerID: 1, BlockSize: 4, DPSize: 2, Endpoints: map[uint32]string{0: good}}, ix,
			kvevents.ErrMissingEndpoint, "kv_events endpoint is required for dp_rank 1"},
		{"an endpoint without port names worker and rank", kvevents.WorkerSpec{WorkerID: 1, BlockSize: 4, DPSize: 2,
			Endpoints: map[uint32]string{0: good, 1: "tcp://127.0.0.1"}}, ix, nil, "invalid kv_events endpoint for worker 1 dp_rank 1: "},
		{"a wildcard host cannot be connected to", kvevents.WorkerSpec{WorkerID: 1, BlockSize: 4, DPSize: 1,
			Endpoints: map[uint32]string{0: "tcp://*:5557"}}, ix, nil, "invalid kv_events endpoint for worker 1 dp_rank 0: "},
		{"an unknown scheme is invalid", kvevents.WorkerSpec{WorkerID: 1, BlockSize: 4, DPStartRank: 4, DPSize: 1,
			Endpoints: map[uint32]string{4: "udp://h:1"}}, ix, nil, "invalid kv_events endpoint for worker 1 dp_rank 4: "},
		{"an invalid replay endpoint is reported", kvevents.WorkerSpec{WorkerID: 1, BlockSize: 4, DPSize: 1,
			Endpoints: map[uint32]string{0: good}, ReplayEndpoint: "tcp://h:0"}, ix, nil, "invalid replay endpoint for worker 1 dp_rank 0: "},
		{"a base endpoint offset beyond 65535 is invalid", kvevents.WorkerSpec{WorkerID: 1, BlockSize: 4, DPStartRank: 1, DPSize: 2,
			Endpoint: "tcp://h:65534"}, ix, nil, "invalid kv_events endpoint for worker 1 dp_rank 2: "},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := newManager(t, kvevents.ManagerConfig{})
			err := m.Attach(c.spec, c.sink)
			if err == nil {
				t.Fatal("Attach succeeded")
			}
			if c.wantIs != nil && !errors.Is(err, c.wantIs) {
				t.Errorf("error %v does not wrap %v", err, c.wantIs)
			}
			if !strings.Contains(err.Error(), c.wantMsg) {
				t.Errorf("error %q does not contain %q", err, c.wantMsg)
			}
			for r := uint32(0); r < 8; r++ {
				if _, ok := m.Listener(1, r); ok {
					t.Errorf("a listener for rank %d was left running", r)
				}
			}
		})
	}
}

func TestAttachResolvesABaseEndpointPerRank(t *testing.T) {
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	specs := []struct {
		name string
		spec kvevents.WorkerSpec
		want map[uint32][2]string
	}{
		{"a single-rank worker uses the base endpoints as they are",
			kvevents.WorkerSpec{WorkerID: 1, BlockSize: 4, DPStartRank: 3, DPSize: 1, Endpoint: "tcp://127.0.0.1:6000", ReplayEndpoint: "tcp://127.0.0.1:7000"},
			map[uint32][2]string{3: {"tcp://127.0.0.1:6000", "tcp://127.0.0.1:7000"}}},
		{"a multi-rank tcp worker offsets ports by rank",
			kvevents.WorkerSpec{WorkerID: 2, BlockSize: 4, DPStartRank: 0, DPSize: 2, Endpoint: "tcp://127.0.0.1:6000", ReplayEndpoint: "tcp://127.0.0.1:7000"},
			map[uint32][2]string{0: {"tcp://127.0.0.1:6000", "tcp://127.0.0.1:7000"}, 1: {"tcp://127.0.0.1:6001", "tcp://127.0.0.1:7001"}}},
		{"a multi-rank ipc worker appends _dp{rank}",
			kvevents.WorkerSpec{WorkerID: 3, BlockSize: 4, DPStartRank: 2, DPSize: 2, Endpoint: "ipc:///tmp/kvepp-none"},
			map[uint32][2]string{2: {"ipc:///tmp/kvepp-none_dp2", ""}, 3: {"ipc:///tmp/kvepp-none_dp3", ""}}},
		{"explicit per-rank endpoints win over the base",
			kvevents.WorkerSpec{WorkerID: 4, BlockSize: 4, DPSize: 2, Endpoint: "tcp://127.0.0.1:6000", Endpoints: map[uint32]string{1: "inproc://r1"}},
			map[uint32][2]string{0: {"tcp://127.0.0.1:6000", ""}, 1: {"inproc://r1", ""}}},
	}
	for _, s := range specs {
		t.Run(s.name, func(t *testing.T) {
			if err := m.Attach(s.spec, ix); err != nil {
				t.Fatal(err)
			}
			for r, want := range s.want {
				st, ok := m.Listener(s.spec.WorkerID, r)
				if !ok || st.Endpoint != want[0] || st.ReplayEndpoint != want[1] {
					t.Errorf("rank %d: listener %+v (found %t), want endpoints %v", r, st, ok, want)
				}
			}
		})
	}
}

func TestAttachReconcilesRankByRank(t *testing.T) {
	pubA := kt.New(t, kt.Options{})
	pubB := kt.New(t, kt.Options{})
	pubC := kt.New(t, kt.Options{})
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	spec := kvevents.WorkerSpec{WorkerID: w1, BlockSize: testBS, DPSize: 2,
		Endpoints: map[uint32]string{0: pubA.Endpoint(), 1: pubB.Endpoint()}}
	if err := m.Attach(spec, ix); err != nil {
		t.Fatal(err)
	}
	pubA.WaitForSubscriber()
	pubB.WaitForSubscriber()
	pubA.Publish(storeChain(1, 0, 2))
	pubB.Publish(storeChain(2, 0, 2))
	waitNextSeq(t, m, w1, 0, 1)
	waitNextSeq(t, m, w1, 1, 1)

	t.Run("an unchanged rank keeps its listener, watermark and blocks", func(t *testing.T) {
		if err := m.Attach(spec, ix); err != nil {
			t.Fatal(err)
		}
		pubA.Publish(storeChain(1, 2, 3))
		waitNextSeq(t, m, w1, 0, 2)
		if d := deviceDepth(ix, w1, 0, 1, 3); d != 3 {
			t.Errorf("rank 0 depth = %d, want 3", d)
		}
		if st := m.Stats(); st.Gaps != 0 || st.RanksCleared != 0 {
			t.Errorf("re-attach disturbed an unchanged rank: %+v", st)
		}
	})
	t.Run("a failed re-attach changes nothing", func(t *testing.T) {
		bad := spec
		bad.Endpoints = map[uint32]string{0: "tcp://127.0.0.1", 1: pubC.Endpoint()}
		if err := m.Attach(bad, ix); err == nil {
			t.Fatal("Attach with an invalid endpoint succeeded")
		}
		if st, _ := m.Listener(w1, 1); st.Endpoint != pubB.Endpoint() || st.NextSeq != 1 {
			t.Errorf("rank 1 listener changed: %+v", st)
		}
		if d := deviceDepth(ix, w1, 1, 2, 2); d != 2 {
			t.Errorf("rank 1 blocks were touched: depth %d", d)
		}
	})
	t.Run("a changed endpoint clears the rank and starts a fresh watermark", func(t *testing.T) {
		changed := spec
		changed.Endpoints = map[uint32]string{0: pubA.Endpoint(), 1: pubC.Endpoint()}
		if err := m.Attach(changed, ix); err != nil {
			t.Fatal(err)
		}
		if d := deviceDepth(ix, w1, 1, 2, 2); d != 0 {
			t.Errorf("rank 1 kept blocks of its old endpoint: depth %d", d)
		}
		if d := deviceDepth(ix, w1, 0, 1, 3); d != 3 {
			t.Errorf("rank 0 lost blocks: depth %d", d)
		}
		if st, _ := m.Listener(w1, 1); st.Started {
			t.Errorf("the new listener inherited a watermark: %+v", st)
		}
		pubC.WaitForSubscriber()
		pubC.Publish(storeChain(3, 0, 1))
		waitNextSeq(t, m, w1, 1, 1)
		if d := deviceDepth(ix, w1, 1, 3, 1); d != 1 {
			t.Errorf("the new endpoint's events were not applied: depth %d", d)
		}
		spec = changed
	})
	t.Run("a rank that left the range is stopped and cleared", func(t *testing.T) {
		shrunk := spec
		shrunk.DPSize = 1
		if err := m.Attach(shrunk, ix); err != nil {
			t.Fatal(err)
		}
		if _, ok := m.Listener(w1, 1); ok {
			t.Error("rank 1 still has a listener")
		}
		if d := deviceDepth(ix, w1, 1, 3, 1); d != 0 {
			t.Errorf("rank 1 kept blocks: depth %d", d)
		}
		if d := deviceDepth(ix, w1, 0, 1, 3); d != 3 {
			t.Errorf("rank 0 lost blocks: depth %d", d)
		}
	})
}

func TestDetachAndCloseStopListeners(t *testing.T) {
	pub := kt.New(t, kt.Options{})
	m := newManager(t, kvevents.ManagerConfig{})
	sink := &recordingSink{}
	attachPublisher(t, m, pub, w1, sink)
	pub.Publish(storeChain(1, 0, 1))
	waitNextSeq(t, m, w1, 0, 1)

	m.Detach(w1)
	if _, ok := m.Listener(w1, 0); ok {
		t.Fatal("listener still registered after Detach")
	}
	pub.Publish(storeChain(1, 1, 2))
	time.Sleep(100 * time.Millisecond)
	if n := len(sink.events()); n != 1 {
		t.Errorf("%d events applied, want 1: events arrived after Detach", n)
	}
	if sink.count(kvindex.EventCleared) != 0 {
		t.Error("Detach touched the index")
	}
	m.Detach(w1) // idempotent

	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	err := m.Attach(kvevents.WorkerSpec{WorkerID: 2, BlockSize: 4, DPSize: 1, Endpoint: pub.Endpoint()}, sink)
	if !errors.Is(err, kvevents.ErrClosed) {
		t.Errorf("Attach after Close = %v, want ErrClosed", err)
	}
	if err := m.Close(); err != nil {
		t.Errorf("second Close = %v", err)
	}
}

func TestListenerSubscribesOverIPC(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kv.sock")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub := zmq4.NewPub(ctx)
	defer pub.Close()
	if err := pub.Listen("ipc://" + path); err != nil {
		t.Fatal(err)
	}
	m := newManager(t, kvevents.ManagerConfig{})
	ix := kvindex.New(kvindex.Config{BlockSize: testBS})
	if err := m.Attach(kvevents.WorkerSpec{WorkerID: w1, BlockSize: testBS, DPSize: 1, Endpoint: "ipc://" + path}, ix); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the SUB socket subscribed over ipc", func() bool { return len(pub.(zmq4.Topics).Topics()) > 0 })
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], 0)
	payload := kt.Batch{Events: []kt.Event{storeChain(1, 0, 2)}}.Encode()
	if err := pub.SendMulti(zmq4.NewMsgFrom([]byte{}, seq[:], payload)); err != nil {
		t.Fatal(err)
	}
	waitNextSeq(t, m, w1, 0, 1)
	if d := deviceDepth(ix, w1, 0, 1, 2); d != 2 {
		t.Errorf("device depth = %d, want 2", d)
	}
}

// silentServer accepts TCP connections and never answers, like a hung process.
func silentServer(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var conns []net.Conn
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	t.Cleanup(func() {
		_ = l.Close()
		<-done
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return "tcp://" + l.Addr().String()
}

func TestHungPeersNeverBlockShutdownOrReplay(t *testing.T) {
	t.Run("detaching from a publisher that never completes the handshake returns promptly", func(t *testing.T) {
		m := newManager(t, kvevents.ManagerConfig{})
		ix := kvindex.New(kvindex.Config{BlockSize: testBS})
		if err := m.Attach(kvevents.WorkerSpec{WorkerID: w1, BlockSize: testBS, DPSize: 1, Endpoint: silentServer(t)}, ix); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
		start := time.Now()
		m.Detach(w1)
		if el := time.Since(start); el > time.Second {
			t.Errorf("Detach took %v", el)
		}
	})
	t.Run("a replay endpoint that never answers times out and live events continue", func(t *testing.T) {
		pub := kt.New(t, kt.Options{})
		m := newManager(t, kvevents.ManagerConfig{ReplayTimeout: 300 * time.Millisecond})
		ix := kvindex.New(kvindex.Config{BlockSize: testBS})
		spec := kvevents.WorkerSpec{WorkerID: w1, BlockSize: testBS, DPSize: 1, Endpoint: pub.Endpoint(), ReplayEndpoint: silentServer(t)}
		if err := m.Attach(spec, ix); err != nil {
			t.Fatal(err)
		}
		pub.WaitForSubscriber()
		pub.Publish(storeChain(1, 0, 1))
		pub.PublishSeq(2, storeChain(2, 0, 1))
		waitNextSeq(t, m, w1, 0, 3)
		st := m.Stats()
		if st.ReplaysTimeout != 1 || st.LostBatches != 1 {
			t.Errorf("stats = %+v, want one timed-out replay and one lost batch", st)
		}
		if d := deviceDepth(ix, w1, 0, 2, 1); d != 1 {
			t.Errorf("the live batch after the hung replay was not applied")
		}
	})
}
