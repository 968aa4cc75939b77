package runner

import (
	"context"
	"fmt"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/picker"
)

// replicaConfig is a loopback EPP with replica sync on an ephemeral port, approximate indexing
// and no tokenizer (the replicas are driven over the selection API).
func replicaConfig(t testing.TB) Config {
	cfg := loopbackConfig(t)
	cfg.TokenizerDir, cfg.TokenizerProtocol, cfg.UseKVEvents = "", TokenizerProtocolNone, false
	cfg.ReplicaSyncPort = OptPort{Set: true}
	cfg.DrainTimeout = 0
	return cfg
}

const replicaModel = "model"

// registerWorkers registers workers 1 and 2 (block size 4) on inst over POST /workers.
func registerWorkers(t *testing.T, inst *Instance) {
	t.Helper()
	for _, id := range []uint64{1, 2} {
		rec := map[string]any{"worker_id": id, "model_name": replicaModel, "endpoint": fmt.Sprintf("http://127.0.0.1:%d", 18000+id), "block_size": 4}
		if st := httpJSON(t, http.MethodPost, "http://"+inst.Addrs().Selection+"/workers", rec, nil); st != http.StatusCreated {
			t.Fatalf("POST /workers on %s: %d", inst.Addrs().Selection, st)
		}
	}
}

// workerLoad is worker w's row (rank 0) of GET /loads: (requests, blocks, prefill tokens).
func workerLoad(t testing.TB, inst *Instance, w uint64) [3]uint64 {
	t.Helper()
	var pl partitionLoads
	httpJSON(t, http.MethodGet, "http://"+inst.Addrs().Selection+"/loads?model_name="+replicaModel, nil, &pl)
	for _, p := range pl {
		for _, l := range p.Loads {
			if l.WorkerID == w && l.DPRank == 0 {
				return [3]uint64{l.ActiveRequests, l.PotentialDecodeBlocks, l.PotentialPrefillTokens}
			}
		}
	}
	return [3]uint64{}
}

// waitLoad polls inst's /loads until worker w shows want and returns how long it took; it fails
// after limit.
func waitLoad(t *testing.T, name string, inst *Instance, w uint64, want [3]uint64, limit time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		got := workerLoad(t, inst, w)
		if got == want {
			return time.Since(start)
		}
		if time.Since(start) > limit {
			t.Fatalf("%s: worker %d load (requests, blocks, prefill) = %v after %v, want %v", name, w, got, limit, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// book is POST /select_and_reserve on inst; it returns the booked worker.
func book(t *testing.T, inst *Instance, id string, tokens []uint32) uint64 {
	t.Helper()
	var sel struct {
		WorkerID uint64 `json:"worker_id"`
	}
	body := map[string]any{"model_name": replicaModel, "selection_id": id, "token_ids": tokens}
	if st := httpJSON(t, http.MethodPost, "http://"+inst.Addrs().Selection+"/select_and_reserve", body, &sel); st != http.StatusOK {
		t.Fatalf("select_and_reserve %s: %d", id, st)
	}
	return sel.WorkerID
}

func lifecycle(t *testing.T, inst *Instance, method, id, suffix string) int {
	t.Helper()
	return httpJSON(t, method, "http://"+inst.Addrs().Selection+"/reservations/"+id+suffix, nil, nil)
}

func registerPeer(t *testing.T, on, peer *Instance) int {
	t.Helper()
	return httpJSON(t, http.MethodPost, "http://"+on.Addrs().Selection+"/replica_sync/register_peer",
		map[string]string{"endpoint": "tcp://" + peer.Addrs().ReplicaSync}, nil)
}

// linkAll waits until a booking on from reaches every other replica (the SUBs are connected and
// the PUB sockets know their subscriptions), then frees the probes.
func linkAll(t *testing.T, from *Instance, to ...*Instance) {
	t.Helper()
	end := time.Now().Add(20 * time.Second)
	for i := 0; ; i++ {
		id := fmt.Sprintf("probe-%p-%d", from, i)
		book(t, from, id, []uint32{900, 901, 902, 903})
		ok := true
		for _, inst := range to {
			if _, seen := inst.Service.Booking(id); !seen {
				ok = false
			}
		}
		// Give the event a moment before judging the link down.
		for wait := time.Now().Add(200 * time.Millisecond); !ok && time.Now().Before(wait); time.Sleep(5 * time.Millisecond) {
			ok = true
			for _, inst := range to {
				if _, seen := inst.Service.Booking(id); !seen {
					ok = false
				}
			}
		}
		lifecycle(t, from, http.MethodDelete, id, "")
		if ok {
			return
		}
		if time.Now().After(end) {
			t.Fatalf("replicas not linked after 20 s")
		}
	}
}

// TestThreeReplicas is the acceptance: three EPPs on loopback share bookings, lifecycle
// calls work on any replica, a replica killed and restarted recovers the index from a peer before
// it is ready, a vanished peer does not stop the others, and a flood of lifecycle events keeps
// memory bounded.
func TestThreeReplicas(t *testing.T) {
	a, b := startInstance(t, replicaConfig(t)), startInstance(t, replicaConfig(t))
	cCfg := replicaConfig(t)
	c, err := Start(context.Background(), Options{Config: cCfg, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	all := []*Instance{a, b, c}
	for _, inst := range all {
		registerWorkers(t, inst)
	}
	for _, on := range all {
		for _, peer := range all {
			if on != peer {
				if st := registerPeer(t, on, peer); st != http.StatusCreated {
					t.Fatalf("register_peer: %d, want 201", st)
				}
			}
		}
	}
	if st := registerPeer(t, a, b); st != http.StatusOK {
		t.Fatalf("repeated register_peer: %d, want 200", st)
	}
	var peers []string
	httpJSON(t, http.MethodGet, "http://"+a.Addrs().Selection+"/replica_sync/peers", nil, &peers)
	if len(peers) != 2 || peers[0] > peers[1] {
		t.Fatalf("GET /replica_sync/peers = %v, want b and c sorted", peers)
	}
	linkAll(t, a, b, c)
	linkAll(t, b, a, c)

	prompt := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	w := book(t, a, "s1", prompt)
	for name, inst := range map[string]*Instance{"b": b, "c": c} {
		took := waitLoad(t, name+" after the admission on a", inst, w, [3]uint64{1, 2, 8}, time.Second)
		t.Logf("admission on a visible on %s after %v", name, took)
	}
	if st := lifecycle(t, a, http.MethodPost, "s1", "/prefill_complete"); st != http.StatusOK {
		t.Fatalf("prefill_complete: %d", st)
	}
	for name, inst := range map[string]*Instance{"b": b, "c": c} {
		waitLoad(t, name+" after prefill_complete on a", inst, w, [3]uint64{1, 2, 0}, time.Second)
	}
	// B frees A's booking.
	if st := lifecycle(t, b, http.MethodDelete, "s1", ""); st != http.StatusOK {
		t.Fatalf("DELETE on b of a's booking: %d", st)
	}
	for name, inst := range map[string]*Instance{"a": a, "c": c} {
		waitLoad(t, name+" after b freed a's booking", inst, w, [3]uint64{}, time.Second)
	}
	if st := lifecycle(t, a, http.MethodDelete, "s1", ""); st != http.StatusNotFound {
		t.Fatalf("DELETE on a after b freed it: %d, want 404", st)
	}

	// C is killed: A and B go on, A's bookings still reach B at once.
	cSync := c.Addrs().ReplicaSync
	if err := c.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	w = book(t, a, "s2", prompt)
	waitLoad(t, "b with c gone", b, w, [3]uint64{1, 2, 0}, time.Second) // the prefix is cached on a's index now
	lifecycle(t, a, http.MethodDelete, "s2", "")
	waitLoad(t, "b after the free with c gone", b, w, [3]uint64{}, time.Second)

	// C restarts on the same replica port, with a and b as its static peers and a as its
	// recovery peer: the index comes from a's /dump before C is ready.
	_, port, _ := strings.Cut(cSync, ":")
	cCfg.ReplicaSyncPort = OptPort{Set: true, Value: mustAtoi(t, port)}
	cCfg.ReplicaSyncPeers = []string{"tcp://" + a.Addrs().ReplicaSync, "tcp://" + b.Addrs().ReplicaSync}
	cCfg.IndexerPeers = []string{"http://" + a.Addrs().Selection}
	c2 := startInstance(t, cCfg)
	want, got := dumpEvents(a.Service), dumpEvents(c2.Service)
	if want == 0 || got != want {
		t.Fatalf("restarted c's index has %d events right after it is ready, a's has %d", got, want)
	}
	registerWorkers(t, c2)
	linkAll(t, a, b, c2)
	linkAll(t, c2, a, b)
	w = book(t, c2, "s3", prompt)
	waitLoad(t, "a after a booking on the restarted c", a, w, [3]uint64{1, 2, 0}, time.Second)
	lifecycle(t, a, http.MethodDelete, "s3", "")
	waitLoad(t, "c after a freed its booking", c2, w, [3]uint64{}, time.Second)

	// 15,000 events through three real EPPs keep this test short under -race; ledger/replica's
	// TestFloodKeepsMemoryBounded sends 100,000 between two replicas.
	t.Run("a flood of lifecycle events keeps memory bounded", func(t *testing.T) {
		floodLifecycle(t, a, []*Instance{b, c2}, 15_000)
	})
}

// floodLifecycle makes n/3 bookings on from, each completing prefill and freed at once, and checks
// that every replica's queues drain and the heap returns near its starting size.
func floodLifecycle(t *testing.T, from *Instance, to []*Instance, n int) {
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	base := heap()
	ctx := context.Background()
	start := time.Now()
	for i := 0; i < n; i += 3 {
		id := "flood-" + strconv.Itoa(i)
		if _, err := from.Service.SelectAndReserve(ctx, picker.SelectRequest{ModelName: replicaModel, SelectionID: id,
			Prompt: picker.Prompt{TokenIDs: []uint32{uint32(i), 1, 2, 3, 4, 5, 6, 7}}}); err != nil {
			t.Fatal(err)
		}
		if err := from.Service.PrefillComplete(ctx, id); err != nil {
			t.Fatal(err)
		}
		if err := from.Service.Free(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	// Drained: nothing queued on either side and the peers' receive counts steady for 300 ms
	// (zmq4's own socket queue is not observable).
	end := time.Now().Add(60 * time.Second)
	received := func() (n uint64, queued int) {
		queued = from.replica.m.Stats().OutboundQueued
		for _, inst := range to {
			st := inst.replica.m.Stats()
			n, queued = n+st.ReceivedSlot, queued+st.InboundQueued
		}
		return n, queued
	}
	last, steadySince := uint64(0), time.Now()
	for {
		n, queued := received()
		if n != last || queued != 0 {
			last, steadySince = n, time.Now()
		} else if time.Since(steadySince) > 300*time.Millisecond {
			break
		}
		if time.Now().After(end) {
			t.Fatal("replica sync did not drain within 60 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	st := from.replica.m.Stats()
	t.Logf("%d lifecycle events in %v: sent %d, dropped at the sender %d", n, time.Since(start), st.SentSlot, st.DroppedTotal())
	for _, inst := range to {
		rs := inst.replica.m.Stats()
		live, _ := inst.Service.ReservationCounts()
		t.Logf("peer: received %d, applied %d, dropped %d, live mirrors left %d", rs.ReceivedSlot, rs.AppliedSlot, rs.DroppedTotal(), live)
		if rs.ReceivedSlot != rs.AppliedSlot+rs.DroppedTotal() {
			t.Fatalf("peer received %d events but applied %d and dropped %d", rs.ReceivedSlot, rs.AppliedSlot, rs.DroppedTotal())
		}
		if rs.DroppedTotal() == 0 && live != 0 {
			t.Fatalf("%d mirrors left although nothing was dropped", live)
		}
	}
	if grown := int64(heap()) - int64(base); grown > 64<<20 {
		t.Fatalf("heap grew by %d MiB over the flood", grown>>20)
	}
}

func dumpEvents(s *picker.Service) int {
	n := 0
	for _, p := range s.Dump() {
		n += len(p.Events)
	}
	return n
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	v, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestReplicaSyncSettings(t *testing.T) {
	base := func() Config {
		cfg := replicaConfig(t)
		cfg.ReplicaSyncPort = OptPort{}
		return cfg
	}
	t.Run("off by default; each of port, peers and peer service turns it on", func(t *testing.T) {
		cfg := base()
		if cfg.ReplicaSyncEnabled() {
			t.Fatal("replica sync on by default")
		}
		for _, mod := range []func(*Config){
			func(c *Config) { c.ReplicaSyncPort = OptPort{Set: true, Value: 9092} },
			func(c *Config) { c.ReplicaSyncPeers = []string{"tcp://peer:9092"} },
			func(c *Config) { c.PeerService, c.PodNamespace, c.PodIP = "peers", "ns", "10.0.0.1" },
		} {
			c := base()
			mod(&c)
			if !c.ReplicaSyncEnabled() || c.Validate() != nil {
				t.Fatalf("enabled %v, validate %v", c.ReplicaSyncEnabled(), c.Validate())
			}
		}
	})
	for name, tc := range map[string]struct {
		env  []string
		want string
	}{
		"an invalid peer":                    {[]string{"DYN_EPP_REPLICA_SYNC_PEERS=peer:9092"}, `invalid DYN_EPP_REPLICA_SYNC_PEERS "peer:9092"`},
		"an unbracketed IPv6 peer":           {[]string{"DYN_EPP_REPLICA_SYNC_PEERS=tcp://::1:9092"}, "IPv6 hosts must be bracketed"},
		"a port out of range":                {[]string{"DYN_EPP_REPLICA_SYNC_PORT=70000"}, `invalid DYN_EPP_REPLICA_SYNC_PORT "70000": must be a port in 0..65535`},
		"a port used by another listener":    {[]string{"DYN_EPP_REPLICA_SYNC_PORT=9090"}, "port is already used by DYN_EPP_METRICS_PORT"},
		"a peer service without POD_IP":      {[]string{"DYN_EPP_PEER_SERVICE=peers", "POD_NAMESPACE=ns"}, `invalid POD_IP ""`},
		"a peer service without a namespace": {[]string{"DYN_EPP_PEER_SERVICE=peers", "POD_IP=10.0.0.1"}, `invalid POD_NAMESPACE ""`},
	} {
		t.Run(name, func(t *testing.T) {
			env := append([]string{"DYN_EPP_TOKENIZER_PROTOCOL=none", "DYN_ROUTER_USE_KV_EVENTS=false"}, tc.env...)
			_, err := LoadConfig(env, nil, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error = %v, want it to contain %q", err, tc.want)
			}
		})
	}
	t.Run("the flag form", func(t *testing.T) {
		cfg, err := LoadConfig([]string{"DYN_EPP_TOKENIZER_PROTOCOL=none", "DYN_ROUTER_USE_KV_EVENTS=false"},
			[]string{"--replica-sync-port", "9500", "--replica-sync-peers", "tcp://a:9092,tcp://[::1]:9092"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if cfg.replicaSyncPort() != 9500 || len(cfg.ReplicaSyncPeers) != 2 {
			t.Fatalf("port %d peers %v", cfg.replicaSyncPort(), cfg.ReplicaSyncPeers)
		}
	})
}

func TestReplicaRoutesWithoutSync(t *testing.T) {
	inst := startInstance(t, func() Config { c := replicaConfig(t); c.ReplicaSyncPort = OptPort{}; return c }())
	if inst.Addrs().ReplicaSync != "" {
		t.Fatalf("replica sync bound %s while off", inst.Addrs().ReplicaSync)
	}
	var peers []string
	if st := httpJSON(t, http.MethodGet, "http://"+inst.Addrs().Selection+"/replica_sync/peers", nil, &peers); st != http.StatusOK || len(peers) != 0 {
		t.Fatalf("GET /replica_sync/peers = %d %v", st, peers)
	}
	var e struct{ Error string }
	st := httpJSON(t, http.MethodPost, "http://"+inst.Addrs().Selection+"/replica_sync/register_peer", map[string]string{"endpoint": "tcp://a:1"}, &e)
	if st != http.StatusConflict || e.Error != "replica sync is disabled" {
		t.Fatalf("register_peer = %d %q", st, e.Error)
	}
}

func TestReplicaPeerRoutes(t *testing.T) {
	inst := startInstance(t, replicaConfig(t))
	url := "http://" + inst.Addrs().Selection + "/replica_sync/"
	var e struct{ Error string }
	for _, tc := range []struct {
		path, ep string
		want     int
		msg      string
	}{
		{"register_peer", "tcp://b:9092", http.StatusCreated, ""},
		{"register_peer", "tcp://b:9092", http.StatusOK, ""},
		{"register_peer", "tcp://a:9092", http.StatusCreated, ""},
		{"register_peer", "udp://a:9092", http.StatusBadRequest, ""},
		{"deregister_peer", "tcp://b:9092", http.StatusOK, ""},
		{"deregister_peer", "tcp://b:9092", http.StatusNotFound, "peer not found"},
		{"deregister_peer", "tcp://b", http.StatusBadRequest, ""},
	} {
		e.Error = ""
		if st := httpJSON(t, http.MethodPost, url+tc.path, map[string]string{"endpoint": tc.ep}, &e); st != tc.want || (tc.msg != "" && e.Error != tc.msg) {
			t.Fatalf("%s %s = %d %q, want %d %q", tc.path, tc.ep, st, e.Error, tc.want, tc.msg)
		}
	}
	var peers []string
	httpJSON(t, http.MethodGet, url+"peers", nil, &peers)
	if len(peers) != 1 || peers[0] != "tcp://a:9092" {
		t.Fatalf("peers = %v", peers)
	}
	// After shutdown begins the peer manager is gone: 503.
	if err := inst.replica.m.Close(); err != nil {
		t.Fatal(err)
	}
	if st := httpJSON(t, http.MethodPost, url+"register_peer", map[string]string{"endpoint": "tcp://c:1"}, &e); st != http.StatusServiceUnavailable || e.Error != "replica peer manager is unavailable" {
		t.Fatalf("register after close = %d %q", st, e.Error)
	}
}

// TestReplicatedSessionBindingSteersThePeer: with session affinity on, a session bound by a
// booking on one replica steers the same session on the other (selection-service.md §12.1,
// acceptance 54), although the peer's load view alone would pick the other worker.
func TestReplicatedSessionBindingSteersThePeer(t *testing.T) {
	cfg := replicaConfig(t)
	cfg.SessionAffinityTTL = OptFloat{Set: true, Value: 60}
	a, b := startInstance(t, cfg), startInstance(t, cfg)
	for _, inst := range []*Instance{a, b} {
		registerWorkers(t, inst)
	}
	registerPeer(t, a, b)
	registerPeer(t, b, a)
	linkAll(t, a, b)
	linkAll(t, b, a)
	var sel struct {
		WorkerID uint64 `json:"worker_id"`
	}
	body := map[string]any{"model_name": replicaModel, "selection_id": "s1", "token_ids": []uint32{1, 2, 3, 4, 5, 6, 7, 8}, "session_id": "conv-1"}
	if st := httpJSON(t, http.MethodPost, "http://"+a.Addrs().Selection+"/select_and_reserve", body, &sel); st != http.StatusOK {
		t.Fatalf("select_and_reserve on a: %d", st)
	}
	bound := sel.WorkerID
	key := picker.PartitionKey{ModelName: replicaModel, RoutingGroup: "default"}
	end := time.Now().Add(5 * time.Second)
	for {
		if target, _, _, ok := b.Service.SessionBinding(key, "conv-1"); ok && target.WorkerID == bound {
			break
		}
		if time.Now().After(end) {
			t.Fatal("the binding never reached b")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// A different prompt for the same session on b: b's loads alone favour the idle worker.
	q := map[string]any{"model_name": replicaModel, "token_ids": []uint32{50, 51, 52, 53}, "session_id": "conv-1"}
	if st := httpJSON(t, http.MethodPost, "http://"+b.Addrs().Selection+"/select", q, &sel); st != http.StatusOK || sel.WorkerID != bound {
		t.Fatalf("select on b for the session: %d worker %d, want worker %d", st, sel.WorkerID, bound)
	}
	q["session_id"] = "another"
	if st := httpJSON(t, http.MethodPost, "http://"+b.Addrs().Selection+"/select", q, &sel); st != http.StatusOK || sel.WorkerID == bound {
		t.Fatalf("select on b for another session: %d worker %d; want the idle worker (the peer's booking is counted)", st, sel.WorkerID)
	}
}

// TestADepartedReplicasBookingsLeaveThePeers: B follows A; A books; when A's peer is deregistered
// on B (what the EndpointSlice watcher does once a drained or dead replica leaves the slice), B
// stops counting A's booking at once instead of until the expiry sweep.
func TestADepartedReplicasBookingsLeaveThePeers(t *testing.T) {
	a, b := startInstance(t, replicaConfig(t)), startInstance(t, replicaConfig(t))
	for _, inst := range []*Instance{a, b} {
		registerWorkers(t, inst)
	}
	if st := registerPeer(t, b, a); st != http.StatusCreated {
		t.Fatalf("register_peer: %d", st)
	}
	linkAll(t, a, b)
	w := book(t, a, "held-by-a", []uint32{1, 2, 3, 4, 5, 6, 7, 8})
	waitLoad(t, "the mirror on B", b, w, workerLoad(t, a, w), 10*time.Second)
	st := httpJSON(t, http.MethodPost, "http://"+b.Addrs().Selection+"/replica_sync/deregister_peer",
		map[string]string{"endpoint": "tcp://" + a.Addrs().ReplicaSync}, nil)
	if st != http.StatusOK {
		t.Fatalf("deregister_peer: %d", st)
	}
	if _, held := b.Service.Booking("held-by-a"); held {
		t.Fatal("B still holds the departed replica's booking")
	}
	waitLoad(t, "B after A left", b, w, [3]uint64{}, time.Second)
	if _, held := a.Service.Booking("held-by-a"); !held {
		t.Fatal("A's own booking was released")
	}
}
