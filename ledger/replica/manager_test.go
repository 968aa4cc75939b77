package replica

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/internal/zmqtcp"
	"github.com/kvepp/kvepp/ledger"
)

// deadline bounds every wait in these tests; generous for a loaded machine.
const deadline = 20 * time.Second

// fakeApplier records applied events; reasons lets a test make ApplySlot drop by request id.
type fakeApplier struct {
	mu       sync.Mutex
	slots    []ledger.SlotEvent
	bindings []ledger.AffinityUpdate
	reasons  map[string]DropReason
	unknown  map[Partition]bool
	block    chan struct{} // when non-nil, ApplySlot waits on it
	forgot   []uint64      // ForgetReplica calls
}

// ForgetReplica records origin and drops the admissions applied from it, reporting how many.
func (f *fakeApplier) ForgetReplica(origin uint64) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.forgot = append(f.forgot, origin)
	n := len(f.slots)
	f.slots = slices.DeleteFunc(f.slots, func(ev ledger.SlotEvent) bool { return ev.Origin == origin && ev.Kind == ledger.SlotAdmission })
	return n - len(f.slots)
}

func (f *fakeApplier) forgotten() []uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.forgot)
}

func (f *fakeApplier) HasPartition(p Partition) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return !f.unknown[p]
}

func (f *fakeApplier) ApplySlot(_ Partition, _ uint32, ev ledger.SlotEvent) (bool, DropReason) {
	if f.block != nil {
		<-f.block
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if r, ok := f.reasons[ev.ID]; ok {
		return false, r
	}
	f.slots = append(f.slots, ev)
	return true, 0
}

func (f *fakeApplier) ApplyAffinity(_ Partition, u ledger.AffinityUpdate) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.bindings = append(f.bindings, u)
	return true
}

func (f *fakeApplier) applied() []ledger.SlotEvent {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]ledger.SlotEvent(nil), f.slots...)
}

func (f *fakeApplier) has(id string) bool {
	for _, ev := range f.applied() {
		if ev.ID == id {
			return true
		}
	}
	return false
}

func newManager(t *testing.T, id uint64, mods ...func(*Config)) *Manager {
	t.Helper()
	cfg := Config{Bind: "tcp://127.0.0.1:0", RouterID: id, Logger: zerolog.Nop(), ReconnectMin: 20 * time.Millisecond, ReconnectMax: 200 * time.Millisecond}
	for _, m := range mods {
		m(&cfg)
	}
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
	return m
}

func endpoint(m *Manager) string { return "tcp://" + m.Addr() }

// eventually polls cond every 10 ms until it holds or deadline passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(deadline)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// link makes sub receive from pub: it publishes probes until one arrives, which also covers the
// PUB socket learning the subscription (ZMQ's slow joiner).
func link(t *testing.T, pub *Manager, to *fakeApplier) {
	t.Helper()
	n := 0
	eventually(t, "a probe to cross the link", func() bool {
		n++
		pub.PublishSlot(part, 16, ledger.SlotEvent{Kind: ledger.SlotFree, ID: fmt.Sprintf("probe-%d", n)})
		time.Sleep(20 * time.Millisecond)
		for _, ev := range to.applied() {
			if len(ev.ID) > 6 && ev.ID[:6] == "probe-" {
				return true
			}
		}
		return false
	})
}

func admission(id string) ledger.SlotEvent {
	return ledger.SlotEvent{Kind: ledger.SlotAdmission, ID: id, Candidate: ledger.Candidate{WorkerID: 1},
		SequenceHashes: []uint64{1, 2}, TrackPrefillTokens: true, PrefillTokens: u64p(32)}
}

func TestEventsReachAPeer(t *testing.T) {
	a := newManager(t, 1)
	b := newManager(t, 2, func(c *Config) { c.Peers = []string{"tcp://" + a.Addr()} })
	fb := &fakeApplier{}
	if err := a.Start(&fakeApplier{}); err != nil {
		t.Fatal(err)
	}
	if err := b.Start(fb); err != nil {
		t.Fatal(err)
	}
	link(t, a, fb)
	a.PublishSlot(part, 16, admission("x"))
	a.PublishAffinity(part, ledger.AffinityUpdate{SessionID: "s", Target: ledger.AffinityTarget{WorkerID: 1}, Version: ledger.AffinityVersion{Sequence: 5, WriterID: 1}})
	eventually(t, "the admission and binding on b", func() bool {
		fb.mu.Lock()
		defer fb.mu.Unlock()
		return len(fb.bindings) == 1 && fb.has0("x")
	})
	for _, ev := range fb.applied() {
		if ev.ID == "x" && (ev.Origin != 1 || *ev.PrefillTokens != 32 || len(ev.SequenceHashes) != 2) {
			t.Fatalf("applied %+v, want origin 1 with the admission's fields", ev)
		}
	}
	st := b.Stats()
	if st.PeersConnected != 1 || st.PeersConfigured != 1 || st.AppliedAffinity != 1 || st.InboundLag.Count == 0 {
		t.Fatalf("b stats %+v", st)
	}
	if st := a.Stats(); st.SentSlot < 2 || st.SentAffinity != 1 || st.OutboundLag.Count < 3 {
		t.Fatalf("a stats %+v", st)
	}
}

// has0 is has with f.mu held.
func (f *fakeApplier) has0(id string) bool {
	for _, ev := range f.slots {
		if ev.ID == id {
			return true
		}
	}
	return false
}

func TestOwnEventsAreDropped(t *testing.T) {
	a := newManager(t, 1)
	fa := &fakeApplier{}
	// A static peer list that includes the replica itself (the same list on every replica).
	if _, err := a.RegisterPeer(endpoint(a)); err != nil {
		t.Fatal(err)
	}
	if err := a.Start(fa); err != nil {
		t.Fatal(err)
	}
	eventually(t, "own events counted", func() bool {
		a.PublishSlot(part, 16, admission("own"))
		time.Sleep(20 * time.Millisecond)
		return a.Stats().Dropped[DropOwn] > 0
	})
	if len(fa.applied()) != 0 {
		t.Fatalf("own events applied: %+v", fa.applied())
	}
}

// rawPeer is a zmq4 PUB that sends arbitrary frames, as a buggy or foreign peer would.
func rawPeer(t *testing.T) (zmq4.Socket, string) {
	t.Helper()
	pub := zmq4.NewPub(context.Background(), zmq4.WithLogger(quietZMQ))
	if err := pub.Listen(zmqtcp.Endpoint("tcp://127.0.0.1:0")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub, "tcp://" + pub.Addr().String()
}

func TestReceiveDropRules(t *testing.T) {
	pub, ep := rawPeer(t)
	unknown := Partition{ModelName: "other", RoutingGroup: "default"}
	fb := &fakeApplier{
		unknown: map[Partition]bool{unknown: true},
		reasons: map[string]DropReason{"bs": DropBlockSizeMismatch, "w": DropUnknownWorker, "r": DropUnknownRank, "gone": DropUnknownReservation, "dup": DropConflict},
	}
	b := newManager(t, 2, func(c *Config) { c.Peers = []string{ep} })
	if err := b.Start(fb); err != nil {
		t.Fatal(err)
	}
	slot := func(p Partition, ev ledger.SlotEvent) []byte {
		if ev.Origin == 0 {
			ev.Origin = 7
		}
		buf, err := EncodeSlot(SlotMessage{Partition: p, BlockSize: 16, Event: ev})
		if err != nil {
			t.Fatal(err)
		}
		return buf
	}
	legacy := foreign(t, map[string]any{"model_name": "m", "tenant_id": "g", "block_size": 4, "event": map[string]any{
		"request_id": "r", "worker": map[string]any{"worker_id": 1, "dp_rank": 0}, "router_id": 3, "data": "Free"}})
	send := func(frames ...[]byte) {
		if err := pub.SendMulti(zmq4.NewMsgFrom(frames...)); err != nil {
			t.Fatal(err)
		}
	}
	// Wait until the raw peer reaches b.
	n := 0
	eventually(t, "the raw peer to reach b", func() bool {
		n++
		send([]byte(TopicSlotTracker), slot(part, ledger.SlotEvent{Kind: ledger.SlotFree, ID: fmt.Sprintf("probe-%d", n)}))
		time.Sleep(20 * time.Millisecond)
		return b.Stats().AppliedSlot > 0
	})
	before := b.Stats()
	send([]byte(TopicSlotTracker))                   // one frame
	send([]byte(TopicSlotTracker), []byte{0xc1})     // undecodable
	send([]byte(TopicSlotTracker), legacy)           // tenant_id envelope
	send([]byte(TopicSessionAffinity), []byte{0x80}) // binding without keys
	send([]byte(TopicSlotTracker), slot(part, ledger.SlotEvent{Kind: ledger.SlotFree, ID: "self", Origin: 2}))
	send([]byte(TopicSlotTracker), slot(unknown, admission("x"))) // unknown partition
	for _, id := range []string{"bs", "w", "r", "gone", "dup"} {
		send([]byte(TopicSlotTracker), slot(part, ledger.SlotEvent{Kind: ledger.SlotFree, ID: id}))
	}
	send([]byte(TopicSlotTracker), slot(part, admission("gone"))) // overtaken by its free
	send([]byte(TopicSlotTracker), slot(part, admission("ok")))
	want := map[DropReason]uint64{
		DropMalformed: 3, DropLegacyEnvelope: 1, DropOwn: 1, DropUnknownPartition: 1, DropBlockSizeMismatch: 1,
		DropUnknownWorker: 1, DropUnknownRank: 1, DropUnknownReservation: 1, DropConflict: 1, DropFreedBeforeAdmission: 1,
	}
	eventually(t, "the admission after every dropped event", func() bool { return fb.has("ok") })
	st := b.Stats()
	for r := DropReason(0); r < NumDropReasons; r++ {
		if got := st.Dropped[r] - before.Dropped[r]; got != want[r] {
			t.Errorf("dropped %s = %d, want %d", r, got, want[r])
		}
	}
	// An unknown topic never reaches b's SUB (it subscribes to the two topics only), so that rule
	// is checked on the receive path directly.
	b.receive([][]byte{[]byte("dynamo.other.v1"), {0x80}})
	if b.Stats().Dropped[DropUnknownTopic] != 1 {
		t.Error("unknown topic not counted")
	}
	if fb.has("gone") {
		t.Error("an admission overtaken by its free was applied")
	}
}

func TestPeerMembership(t *testing.T) {
	a := newManager(t, 1)
	b := newManager(t, 2)
	fb := &fakeApplier{}
	if err := b.Start(fb); err != nil {
		t.Fatal(err)
	}
	for _, ep := range []string{"tcp://[::1]:9", endpoint(a), "ipc:///tmp/none"} {
		if added, err := b.RegisterPeer(ep); err != nil || !added {
			t.Fatalf("RegisterPeer(%s) = %v, %v", ep, added, err)
		}
	}
	if added, err := b.RegisterPeer(endpoint(a)); err != nil || added {
		t.Fatalf("re-register = %v, %v; want already registered", added, err)
	}
	want := []string{"ipc:///tmp/none", endpoint(a), "tcp://[::1]:9"}
	if got := b.Peers(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("Peers = %v, want %v", got, want)
	}
	link(t, a, fb)
	eventually(t, "one connected peer", func() bool { return b.Stats().PeersConnected == 1 })
	if err := b.DeregisterPeer(endpoint(a)); err != nil {
		t.Fatal(err)
	}
	if err := b.DeregisterPeer(endpoint(a)); !errors.Is(err, ErrPeerNotFound) {
		t.Fatalf("second deregister = %v, want ErrPeerNotFound", err)
	}
	if st := b.Stats(); st.PeersConnected != 0 || st.PeersConfigured != 2 {
		t.Fatalf("after deregister: %d connected, %d configured", st.PeersConnected, st.PeersConfigured)
	}
	n := len(fb.applied())
	for i := range 20 {
		a.PublishSlot(part, 16, admission(fmt.Sprint("after-", i)))
	}
	eventually(t, "a to send", func() bool { return a.Stats().SentSlot >= uint64(20) })
	time.Sleep(100 * time.Millisecond) // nothing may arrive; a short look suffices to catch a leak
	if got := len(fb.applied()); got != n {
		t.Fatalf("%d events arrived from a deregistered peer", got-n)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := b.RegisterPeer(endpoint(a)); !errors.Is(err, ErrClosed) {
		t.Fatalf("register after Close = %v, want ErrClosed", err)
	}
	b.PublishSlot(part, 16, admission("late"))
	if b.Stats().Dropped[DropClosed] != 1 {
		t.Fatal("a publish after Close was not counted as closed")
	}
}

func TestOutboundQueueDropsTheNewestWhenFull(t *testing.T) {
	m, err := newUnstarted(Config{Bind: "tcp://127.0.0.1:0", RouterID: 1, OutboundCapacity: 3, AffinityOutboundCapacity: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for i := range 5 {
		m.PublishSlot(part, 16, admission(fmt.Sprint(i)))
	}
	for range 2 {
		m.PublishAffinity(part, ledger.AffinityUpdate{SessionID: "s"})
	}
	st := m.Stats()
	if st.Dropped[DropOutboundFull] != 3 || st.OutboundQueued != 4 {
		t.Fatalf("dropped %d queued %d; want 3 dropped (2 slot + 1 binding), 4 queued", st.Dropped[DropOutboundFull], st.OutboundQueued)
	}
	items := m.slotOut.swap(nil)
	if len(items) != 3 || items[0].msg.Event.ID != "0" || items[2].msg.Event.ID != "2" {
		t.Fatalf("queued %+v; want the oldest three", items)
	}
}

func TestInboundQueueIsBounded(t *testing.T) {
	a := newManager(t, 1)
	fb := &fakeApplier{}
	b := newManager(t, 2, func(c *Config) { c.Peers = []string{endpoint(a)}; c.InboundCapacity = 10 })
	if err := b.Start(fb); err != nil {
		t.Fatal(err)
	}
	link(t, a, fb)
	block := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(block) }) }
	t.Cleanup(unblock) // runs before the managers close
	fb.mu.Lock()
	fb.block = block
	fb.mu.Unlock()
	before := b.Stats()
	for i := range 100 {
		a.PublishSlot(part, 16, admission(fmt.Sprint(i)))
	}
	// The applier is stuck on its first event: 10 more wait in the queue, the rest are dropped.
	eventually(t, "the 100 events to arrive", func() bool { return b.Stats().ReceivedSlot-before.ReceivedSlot >= 100 })
	st := b.Stats()
	b.inMu.Lock()
	queued := b.inboxes[part].q.len()
	b.inMu.Unlock()
	if queued != 10 || st.Dropped[DropInboundFull] == 0 {
		t.Fatalf("inbound queue holds %d, dropped %d; want a full queue of 10 and drops", queued, st.Dropped[DropInboundFull])
	}
	unblock()
	eventually(t, "the queue to drain", func() bool {
		st := b.Stats()
		return st.InboundQueued == 0 && st.ReceivedSlot-before.ReceivedSlot == st.AppliedSlot-before.AppliedSlot+st.Dropped[DropInboundFull]
	})
	if fb.has("99") {
		t.Fatal("the newest event of the burst was applied although the queue was full")
	}
}

// TestFloodKeepsMemoryBounded sends 100,000 lifecycle events between two replicas with small
// queues: everything is either delivered or counted as dropped, and the heap returns to its
// starting size once the flood is drained.
func TestFloodKeepsMemoryBounded(t *testing.T) {
	a := newManager(t, 1, func(c *Config) { c.OutboundCapacity = 1000 })
	fb := &fakeApplier{}
	b := newManager(t, 2, func(c *Config) { c.Peers = []string{endpoint(a)}; c.InboundCapacity = 1000 })
	if err := b.Start(fb); err != nil {
		t.Fatal(err)
	}
	link(t, a, fb)
	fb.mu.Lock()
	fb.slots = nil
	fb.mu.Unlock()
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	base := heap()
	before := a.Stats()
	const n = 100_000
	kinds := []ledger.SlotEventKind{ledger.SlotAdmission, ledger.SlotPrefillComplete, ledger.SlotFree}
	for i := range n {
		ev := admission(fmt.Sprint("f", i/3))
		ev.Kind = kinds[i%3]
		a.PublishSlot(part, 16, ev)
		if q := a.slotOut.len(); q > 1000 {
			t.Fatalf("outbound queue at %d > its capacity", q)
		}
	}
	eventually(t, "the flood to drain", func() bool {
		sa, sb := a.Stats(), b.Stats()
		sent := sa.SentSlot - before.SentSlot
		return sa.OutboundQueued == 0 && sent+sa.Dropped[DropOutboundFull] == n && sb.InboundQueued == 0
	})
	fb.mu.Lock()
	got := len(fb.slots)
	fb.slots = nil
	fb.mu.Unlock()
	sa := a.Stats()
	t.Logf("flood: %d sent, %d dropped at the sender, %d applied by the peer", sa.SentSlot-before.SentSlot, sa.Dropped[DropOutboundFull], got)
	if got == 0 {
		t.Fatal("nothing of the flood arrived")
	}
	if grown := int64(heap()) - int64(base); grown > 32<<20 {
		t.Fatalf("heap grew by %d MiB after the flood drained", grown>>20)
	}
}

// TestAStuckSubscriberDoesNotStopTheOthers connects a subscriber that never reads: once its
// socket buffers and queue are full it misses events (counted), while a live peer gets every one.
func TestAStuckSubscriberDoesNotStopTheOthers(t *testing.T) {
	old := subscriberQueueLimit
	subscriberQueueLimit = 1000
	defer func() { subscriberQueueLimit = old }()
	a := newManager(t, 1)
	fb := &fakeApplier{}
	b := newManager(t, 2, func(c *Config) { c.Peers = []string{endpoint(a)} })
	if err := b.Start(fb); err != nil {
		t.Fatal(err)
	}
	raw, err := net.Dial("tcp", a.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	_ = raw.(*net.TCPConn).SetReadBuffer(4096) // fill up sooner
	stuck, err := zmq4.Open(raw, null.Security(), zmq4.Sub, zmq4.SocketIdentity(""), false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := stuck.SendMsg(zmq4.NewMsg(append([]byte{1}, TopicSlotTracker...))); err != nil {
		t.Fatal(err)
	}
	link(t, a, fb)
	eventually(t, "two subscribers", func() bool { return a.Stats().Subscribers == 2 })
	// 1,000 admissions of 200 hashes (~1.8 KB) at a time, each batch waiting for the live peer:
	// the stuck one's socket buffers and its queue of 1,000 fill up and it misses events.
	before := b.Stats().AppliedSlot
	const n, batch = 5000, 1000
	big := admission("")
	big.SequenceHashes = make([]uint64, 200)
	for i := range big.SequenceHashes {
		big.SequenceHashes[i] = uint64(i) << 40
	}
	for i := 0; i < n; i += batch {
		for j := i; j < i+batch; j++ {
			ev := big
			ev.ID = fmt.Sprint("s", j)
			a.PublishSlot(part, 16, ev)
		}
		eventually(t, "the batch at the live peer", func() bool { return b.Stats().AppliedSlot-before >= uint64(i+batch) })
	}
	end := time.Now().Add(deadline)
	for b.Stats().AppliedSlot-before < n && time.Now().Before(end) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := b.Stats().AppliedSlot - before; got < n {
		t.Fatalf("live peer applied %d of %d; a %+v; b %+v", got, n, a.Stats().Dropped, b.Stats().Dropped)
	}
	if a.Stats().Dropped[DropSubscriberFull] == 0 {
		t.Fatal("no drop counted for the subscriber that never reads")
	}
	t.Logf("stuck subscriber missed %d events; the live peer got all %d", a.Stats().Dropped[DropSubscriberFull], n)
}

// TestADeregisteredPeersMirrorsAreReleased: when the peer a replica published through is
// deregistered (it drained and left, or died), its mirrored bookings are released at once, not
// left as load until expiry; a replica reachable through another registered peer is kept.
func TestADeregisteredPeersMirrorsAreReleased(t *testing.T) {
	a := newManager(t, 1)
	c := newManager(t, 3)
	fb := &fakeApplier{}
	b := newManager(t, 2, func(cf *Config) { cf.Peers = []string{endpoint(a), endpoint(c)} })
	if err := b.Start(fb); err != nil {
		t.Fatal(err)
	}
	link(t, a, fb)
	link(t, c, fb)
	a.PublishSlot(part, 16, admission("from-a"))
	c.PublishSlot(part, 16, admission("from-c"))
	eventually(t, "both admissions", func() bool { return fb.has("from-a") && fb.has("from-c") })
	if err := b.DeregisterPeer(endpoint(a)); err != nil {
		t.Fatal(err)
	}
	if got := fb.forgotten(); !slices.Equal(got, []uint64{1}) {
		t.Fatalf("ForgetReplica calls %v, want [1] (only the departed replica)", got)
	}
	if fb.has("from-a") || !fb.has("from-c") {
		t.Fatalf("after a left: from-a kept %v, from-c kept %v", fb.has("from-a"), fb.has("from-c"))
	}
	if !b.departedBefore(1, time.Now().Add(-time.Second)) || b.departedBefore(3, time.Now().Add(-time.Second)) {
		t.Fatal("an admission received from a before it left would still be applied, or c's would be dropped")
	}
}

func TestRegisteredPeersAreBounded(t *testing.T) {
	m := newManager(t, 1)
	for i := range MaxPeers {
		if _, err := m.RegisterPeer(fmt.Sprintf("tcp://10.0.%d.%d:9092", i/250, i%250)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := m.RegisterPeer("tcp://10.9.9.9:9092"); !errors.Is(err, ErrTooManyPeers) {
		t.Fatalf("peer %d: %v, want ErrTooManyPeers", MaxPeers+1, err)
	}
	if added, err := m.RegisterPeer("tcp://10.0.0.0:9092"); added || err != nil {
		t.Fatalf("re-registering a known peer at the limit: %v, %v", added, err)
	}
}
