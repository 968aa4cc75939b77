package runner

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/rs/zerolog"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/discovery"
)

// TestPeerDiscoveryAgainstAnAPIServer runs the runner's Kubernetes peer discovery (the
// controller-runtime manager of newKubeManager, the EndpointSlice watch, the first sync that gives
// the recovery peers) against a real API server: envtest, with KUBEBUILDER_ASSETS naming its
// binaries (else the test is skipped). The API server refuses loopback addresses in slices and
// tests may only reach loopback, so the slices name TEST-NET-1 addresses and the replica manager
// is never started: peers are registered, not dialled, and nothing fetches the recovery URLs.
func TestPeerDiscoveryAgainstAnAPIServer(t *testing.T) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		t.Skip("KUBEBUILDER_ASSETS is not set: no envtest API server")
	}
	env := &envtest.Environment{}
	rc, err := env.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	user, err := env.AddUser(envtest.User{Name: "kvepp", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, kubeconfig, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KUBECONFIG", path)
	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	kc, err := client.New(rc, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	name := func(s string) *string { return &s }
	notReady := false
	slice := func(n, svc string, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
		return &discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: n, Namespace: "default", Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports: []discoveryv1.EndpointPort{{Name: name(discovery.PeerPortReplica), Port: new(int32(19092))},
				{Name: name(discovery.PeerPortSelection), Port: new(int32(18092))}},
			Endpoints: eps,
		}
	}
	ctx := context.Background()
	peers := slice("kvepp-peers-1", "kvepp-peers",
		discoveryv1.Endpoint{Addresses: []string{"192.0.2.10"}},
		discoveryv1.Endpoint{Addresses: []string{"192.0.2.11"}, Conditions: discoveryv1.EndpointConditions{Ready: &notReady}},
		discoveryv1.Endpoint{Addresses: []string{"192.0.2.99"}}) // the replica itself (POD_IP)
	for _, s := range []*discoveryv1.EndpointSlice{peers, slice("other-1", "other", discoveryv1.Endpoint{Addresses: []string{"192.0.2.50"}})} {
		if err := kc.Create(ctx, s); err != nil {
			t.Fatal(err)
		}
	}

	cfg := replicaConfig(t)
	cfg.PeerService, cfg.PodNamespace, cfg.PodIP = "kvepp-peers", "default", "192.0.2.99"
	var pcfg picker.Config
	rs, err := bindReplicaSync(cfg, &pcfg, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rs.close() })
	recovery, err := rs.discoverPeers(ctx, cfg, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"http://192.0.2.10:18092"}; !slices.Equal(recovery, want) {
		t.Fatalf("recovery peers %v, want %v", recovery, want)
	}
	if got, want := rs.m.Peers(), []string{"tcp://192.0.2.10:19092"}; !slices.Equal(got, want) {
		t.Fatalf("replica peers %v, want %v", got, want)
	}

	waitPeers := func(want []string) {
		t.Helper()
		end := time.Now().Add(30 * time.Second)
		for !slices.Equal(rs.m.Peers(), want) {
			if time.Now().After(end) {
				t.Fatalf("replica peers %v, want %v", rs.m.Peers(), want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// A peer turns ready and a new one joins: both are registered by the watch.
	peers.Endpoints[1].Conditions.Ready = nil
	peers.Endpoints = append(peers.Endpoints, discoveryv1.Endpoint{Addresses: []string{"192.0.2.12"}})
	if err := kc.Update(ctx, peers); err != nil {
		t.Fatal(err)
	}
	waitPeers([]string{"tcp://192.0.2.10:19092", "tcp://192.0.2.11:19092", "tcp://192.0.2.12:19092"})
	// The slice goes away: every discovered peer is deregistered.
	if err := kc.Delete(ctx, peers); err != nil {
		t.Fatal(err)
	}
	waitPeers([]string{})
}
