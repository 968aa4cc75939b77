package discovery_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/rs/zerolog"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

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
		Replica:   []string{"tcp://10.0.0.2:19092", "tcp://10.0.0.3:19092", "tcp://10.0.1.5:9092"},
		Selection: []string{"http://10.0.0.2:18092", "http://10.0.0.3:18092", "http://10.0.1.5:8092"},
	}
	if d := cmp.Diff(want, peers); d != "" {
		t.Fatalf("peers (-want +got): own POD_IP, ready:false and other services excluded, defaults for unnamed ports\n%s", d)
	}
	if d := cmp.Diff(append(slices.Clone(want.Replica), "tcp://static:9092"), sink.list()); d != "" {
		t.Fatalf("registered (-want +got):\n%s", d)
	}

	t.Run("an endpoint turning not ready and a slice deleted are deregistered", func(t *testing.T) {
		var a discoveryv1.EndpointSlice
		if err := c.Get(ctx, client.ObjectKey{Namespace: "ns", Name: "a"}, &a); err != nil {
			t.Fatal(err)
		}
		for i := range a.Endpoints {
			if a.Endpoints[i].Addresses[0] == "10.0.0.3" {
				a.Endpoints[i].Conditions.Ready = ptr(false)
			}
		}
		a.Endpoints = append(a.Endpoints, discoveryv1.Endpoint{Addresses: []string{"10.0.0.7"}})
		if err := c.Update(ctx, &a); err != nil {
			t.Fatal(err)
		}
		if err := c.Delete(ctx, &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Name: "b", Namespace: "ns"}}); err != nil {
			t.Fatal(err)
		}
		if _, err := w.Reconcile(ctx, reconcileRequest("a")); err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff([]string{"tcp://10.0.0.2:19092", "tcp://10.0.0.7:19092", "tcp://static:9092"}, sink.list()); d != "" {
			t.Fatalf("registered (-want +got):\n%s", d)
		}
		if got := w.Last().Selection; !slices.Equal(got, []string{"http://10.0.0.2:18092", "http://10.0.0.7:18092"}) {
			t.Fatalf("recovery peers %v", got)
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

func reconcileRequest(name string) reconcile.Request {
	return reconcile.Request{NamespacedName: types.NamespacedName{Namespace: "ns", Name: name}}
}
