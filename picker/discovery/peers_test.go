package discovery_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/kvepp/kvepp/picker/discovery"
)

// fakeSink records replica-sync membership like the replica manager does.
type fakeSink struct {
	mu    sync.Mutex
	peers map[string]bool
	fail  error
}

func (s *fakeSink) RegisterPeer(ep string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		return false, s.fail
	}
	if s.peers[ep] {
		return false, nil
	}
	s.peers[ep] = true
	return true, nil
}

func (s *fakeSink) DeregisterPeer(ep string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.peers[ep] {
		return errors.New("peer not found")
	}
	delete(s.peers, ep)
	return nil
}

func (s *fakeSink) list() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for ep := range s.peers {
		out = append(out, ep)
	}
	slices.Sort(out)
	return out
}

func ptr[T any](v T) *T { return &v }

// slice is an EndpointSlice of service svc with the given named ports and endpoints (address →
// ready; nil = condition unset).
func slice(name, svc string, ports map[string]int32, eps map[string]*bool) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: "ns", Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for n, p := range ports {
		s.Ports = append(s.Ports, discoveryv1.EndpointPort{Name: ptr(n), Port: ptr(p)})
	}
	for addr, ready := range eps {
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{Addresses: []string{addr}, Conditions: discoveryv1.EndpointConditions{Ready: ready}})
	}
	return s
}

func newWatcher(t *testing.T, sink discovery.PeerSink, objs ...client.Object) (*discovery.PeerWatcher, client.Client) {
	t.Helper()
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(objs...).Build()
	w, err := discovery.NewPeerWatcher(discovery.PeerConfig{Namespace: "ns", Service: "kvepp-peers", PodIP: "10.0.0.1",
		ReplicaPort: 9092, SelectionPort: 8092, Logger: zerolog.Nop()}, c, sink)
	if err != nil {
		t.Fatal(err)
	}
	return w, c
}

func TestPeerWatcherFollowsEndpointSlices(t *testing.T) {
	ctx := context.Background()
	sink := &fakeSink{peers: map[string]bool{"tcp://static:9092": true}}
	named := map[string]int32{discovery.PeerPortReplica: 19092, discovery.PeerPortSelection: 18092, "grpc": 9002}
	w, c := newWatcher(t, sink,
		slice("a", "kvepp-peers", named, map[string]*bool{"10.0.0.1": ptr(true), "10.0.0.2": ptr(true), "10.0.0.3": nil, "10.0.0.4": ptr(false)}),
		slice("b", "kvepp-peers", nil, map[string]*bool{"10.0.1.5": ptr(true)}),
		slice("c", "other-service", named, map[string]*bool{"10.9.9.9": ptr(true)}),
	)
	peers, err := w.Sync(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := discovery.Peers{
		Replica:   []string{"tcp://10.0.0.2:19092", "tcp://10.0.0.3:19092", "tcp://10.0.0.4:19092", "tcp://10.0.1.5:9092"},
		Selection: []string{"http://10.0.0.2:18092", "http://10.0.0.3:18092", "http://10.0.1.5:8092"},
	}
	if d := cmp.Diff(want, peers); d != "" {
		t.Fatalf("peers (-want +got): own POD_IP and other services excluded, ready:false followed but not a recovery peer, defaults for unnamed ports\n%s", d)
	}
	if d := cmp.Diff(append(slices.Clone(want.Replica), "tcp://static:9092"), sink.list()); d != "" {
		t.Fatalf("registered (-want +got):\n%s", d)
	}

	t.Run("an endpoint turning not ready stays followed (no recovery); one leaving its slice and a deleted slice are deregistered", func(t *testing.T) {
		var a discoveryv1.EndpointSlice
		if err := c.Get(ctx, client.ObjectKey{Namespace: "ns", Name: "a"}, &a); err != nil {
			t.Fatal(err)
		}
		for i := range a.Endpoints {
			if a.Endpoints[i].Addresses[0] == "10.0.0.3" {
				a.Endpoints[i].Conditions.Ready = ptr(false)
			}
		}
		a.Endpoints = slices.DeleteFunc(a.Endpoints, func(e discoveryv1.Endpoint) bool { return e.Addresses[0] == "10.0.0.4" })
		a.Endpoints = append(a.Endpoints, discoveryv1.Endpoint{Addresses: []string{"10.0.0.7"}})
		if err := c.Update(ctx, &a); err != nil {
			t.Fatal(err)
		}
		if err := c.Delete(ctx, &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Name: "b", Namespace: "ns"}}); err != nil {
			t.Fatal(err)
		}
		if _, err := w.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff([]string{"tcp://10.0.0.2:19092", "tcp://10.0.0.3:19092", "tcp://10.0.0.7:19092", "tcp://static:9092"}, sink.list()); d != "" {
			t.Fatalf("registered (-want +got):\n%s", d)
		}
		if got := w.Last().Selection; !slices.Equal(got, []string{"http://10.0.0.2:18092", "http://10.0.0.7:18092"}) {
			t.Fatalf("recovery peers %v", got)
		}
	})
	t.Run("a terminating replica stays followed until it leaves the slice, but serves no recovery", func(t *testing.T) {
		var a discoveryv1.EndpointSlice
		if err := c.Get(ctx, client.ObjectKey{Namespace: "ns", Name: "a"}, &a); err != nil {
			t.Fatal(err)
		}
		for i := range a.Endpoints {
			if a.Endpoints[i].Addresses[0] == "10.0.0.2" {
				a.Endpoints[i].Conditions = discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(false), Terminating: ptr(true)}
			}
		}
		if err := c.Update(ctx, &a); err != nil {
			t.Fatal(err)
		}
		if _, err := w.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff([]string{"tcp://10.0.0.2:19092", "tcp://10.0.0.3:19092", "tcp://10.0.0.7:19092", "tcp://static:9092"}, sink.list()); d != "" {
			t.Fatalf("registered (-want +got):\n%s", d)
		}
		if got := w.Last().Selection; !slices.Equal(got, []string{"http://10.0.0.7:18092"}) {
			t.Fatalf("recovery peers %v, want only the ready one", got)
		}
	})
	t.Run("peers registered by others are never deregistered", func(t *testing.T) {
		for _, name := range []string{"a"} {
			if err := c.Delete(ctx, &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns"}}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := w.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff([]string{"tcp://static:9092"}, sink.list()); d != "" {
			t.Fatalf("registered (-want +got):\n%s", d)
		}
	})
	t.Run("a failed registration is reported and retried by the next sync", func(t *testing.T) {
		if err := c.Create(ctx, slice("d", "kvepp-peers", nil, map[string]*bool{"10.0.2.1": nil})); err != nil {
			t.Fatal(err)
		}
		sink.mu.Lock()
		sink.fail = errors.New("replica peer manager is unavailable")
		sink.mu.Unlock()
		if _, err := w.Sync(ctx); err == nil {
			t.Fatal("Sync hid the registration error")
		}
		sink.mu.Lock()
		sink.fail = nil
		sink.mu.Unlock()
		if _, err := w.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(sink.list(), "tcp://10.0.2.1:9092") {
			t.Fatalf("registered %v after the retry", sink.list())
		}
	})
}

func TestPeerWatcherIPv6AndConfig(t *testing.T) {
	sink := &fakeSink{peers: map[string]bool{}}
	w, _ := newWatcher(t, sink, slice("a", "kvepp-peers", nil, map[string]*bool{"fd00::5": nil}))
	peers, err := w.Sync(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(peers.Replica, []string{"tcp://[fd00::5]:9092"}) || !slices.Equal(peers.Selection, []string{"http://[fd00::5]:8092"}) {
		t.Fatalf("IPv6 peers %+v, want bracketed hosts", peers)
	}
	if _, err := discovery.NewPeerWatcher(discovery.PeerConfig{Service: "x"}, nil, sink); err == nil {
		t.Fatal("a watcher without namespace was built")
	}
}

// TestPeerWatcherLoop drives the watcher the way Kube.WatchPeers does, through Trigger: the first
// sync releases WaitSynced with the recovery peers, a failed registration is retried without a new
// event, Problem says what failed, and Close ends the loop.
func TestPeerWatcherLoop(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sink := &fakeSink{peers: map[string]bool{}, fail: errors.New("replica peer manager is unavailable")}
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(slice("a", "kvepp-peers", nil, map[string]*bool{"10.0.0.2": nil})).Build()
	w, err := discovery.NewPeerWatcher(discovery.PeerConfig{Namespace: "ns", Service: "kvepp-peers", PodIP: "10.0.0.1",
		ReplicaPort: 9092, SelectionPort: 8092, RetryInterval: 10 * time.Millisecond, Logger: zerolog.Nop()}, c, sink)
	if err != nil {
		t.Fatal(err)
	}
	w.SetWaitingFor("RBAC forbids listing or watching *v1.EndpointSlice")
	if got := w.Problem(); !strings.Contains(got, "RBAC") {
		t.Fatalf("Problem() = %q before the first sync, want the cache's note", got)
	}
	short, stop := context.WithTimeout(ctx, 50*time.Millisecond)
	_, err = w.WaitSynced(short)
	stop()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitSynced before any sync = %v, want the deadline", err)
	}
	if err := w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	if err := w.Start(ctx); err == nil {
		t.Fatal("a second Start succeeded")
	}
	w.SetWaitingFor("")
	w.Trigger()
	peers, err := w.WaitSynced(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(peers.Selection, []string{"http://10.0.0.2:8092"}) {
		t.Fatalf("first sync's recovery peers %v", peers.Selection)
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for !cond() {
			if ctx.Err() != nil {
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitFor("the failed registration in Problem", func() bool { return strings.Contains(w.Problem(), "replica peer manager is unavailable") })
	sink.mu.Lock()
	sink.fail = nil
	sink.mu.Unlock()
	// No trigger: the retry timer registers the peer.
	waitFor("the retried registration", func() bool { return slices.Equal(sink.list(), []string{"tcp://10.0.0.2:9092"}) })
	waitFor("Problem cleared", func() bool { return w.Problem() == "" })

	// A slice event (Trigger) brings a new peer.
	if err := c.Create(ctx, slice("b", "kvepp-peers", nil, map[string]*bool{"10.0.0.3": ptr(true)})); err != nil {
		t.Fatal(err)
	}
	w.Trigger()
	waitFor("the new peer", func() bool { return slices.Equal(sink.list(), []string{"tcp://10.0.0.2:9092", "tcp://10.0.0.3:9092"}) })

	// Close ends the loop (goleak checks its goroutine is gone) and may be repeated.
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// TestNewKubeWithAPeerServiceIsOffline checks that narrowing the EndpointSlice cache to the peer
// Service does not make NewKube contact the API server (controller-runtime asks the REST mapper
// whether a ByObject kind is namespaced while it builds the cache): an unreachable API server
// at startup is the informers' retry, not a startup error.
func TestNewKubeWithAPeerServiceIsOffline(t *testing.T) {
	k, err := discovery.NewKube(discovery.KubeConfig{RestConfig: &rest.Config{Host: "https://127.0.0.1:1"}, Namespace: "ns",
		PeerService: "kvepp-peers", Logger: zerolog.Nop()})
	if err != nil {
		t.Fatalf("NewKube contacted the API server: %v", err)
	}
	w, err := discovery.NewPeerWatcher(discovery.PeerConfig{Namespace: "ns", Service: "kvepp-peers"}, k.Reader(), &fakeSink{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // ends the watch goroutine of the never-started cache
	if err := k.WatchPeers(ctx, w); err != nil {
		t.Fatalf("WatchPeers of the narrowed Service: %v", err)
	}
	other, _ := discovery.NewPeerWatcher(discovery.PeerConfig{Namespace: "other-ns", Service: "kvepp-peers"}, k.Reader(), &fakeSink{})
	if err := k.WatchPeers(ctx, other); err == nil {
		t.Fatal("WatchPeers accepted a namespace the cache does not hold")
	}
}
