package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"go.uber.org/goleak"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	inferencev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/kvepp/kvepp/internal/syncbuf"
	"github.com/kvepp/kvepp/picker/discovery"
	"github.com/kvepp/kvepp/picker/discovery/discoverytest"
)

// TestKubernetesEPPWithPoolAndPeers runs one EPP with both DYN_EPP_INFERENCE_POOL_NAME and
// DYN_EPP_PEER_SERVICE against a real API server (envtest), through the one Kubernetes cache of
// the process, built from Options.KubeRestConfig (KUBECONFIG names a dead server, so a watcher
// that ignored the override would never sync): the pool's pod registers; a peer listed in the
// peer Service's slice at startup is a replica-sync peer and, once the pod is registered and
// before readiness, the recovery peer whose GET /dump is read (epp.md §10.4, §11.1); a slice that
// appears later adds its peer to GET /replica_sync/peers, and removing it removes the peer; POD_IP
// and other Services' slices are never peers. Stop ends every goroutine the EPP started.
//
// The API server refuses loopback addresses in slices, so the startup peer's /dump is served on
// a non-loopback address of this machine (that part is skipped without one) and the other peers
// are TEST-NET-1 addresses nothing is dialled on successfully: peers are registered, not synced.
func TestKubernetesEPPWithPoolAndPeers(t *testing.T) {
	verifyNoGoroutineLeaks(t)
	env := discoverytest.Start(t, true)
	deadKubeconfig(t)
	admin, err := client.New(env.Config, client.Options{Scheme: discovery.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	const ns, podIP, selectionPort = "kvepp-peers-e2e", "192.0.2.99", 18092
	cfg := replicaConfig(t)
	cfg.InferencePoolName, cfg.PodNamespace, cfg.ModelName = "qwen", ns, replicaModel
	cfg.PeerService, cfg.PodIP = "kvepp-peers", podIP
	cfg.RecoveryTimeout = Seconds(20 * time.Second)

	// The startup peer's /dump: it records whether the pod was registered and readiness still off
	// when recovery asked.
	var inst atomic.Pointer[Instance]
	var dumps, dumpBeforePods, dumpWhileReady atomic.Int32
	startupPeer := nonLoopbackIPv4()
	startSlice := peerSlice(ns, "kvepp-peers-1", cfg.PeerService, selectionPort, podIP)
	if startupPeer != "" {
		ln, err := net.Listen("tcp", net.JoinHostPort(startupPeer, "0"))
		if err != nil {
			t.Fatal(err)
		}
		startSlice = peerSlice(ns, "kvepp-peers-1", cfg.PeerService, int32(ln.Addr().(*net.TCPAddr).Port), podIP, startupPeer)
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/dump" {
				http.NotFound(w, r)
				return
			}
			// With a pool, recovery runs after Start returned (awaitPoolReady): allow the test
			// goroutine a moment to store the instance; recovery inside Start counts as too early.
			for end := time.Now().Add(2 * time.Second); inst.Load() == nil && time.Now().Before(end); {
				time.Sleep(5 * time.Millisecond)
			}
			switch i := inst.Load(); {
			case i == nil || i.Pool().Stats().Registered != 1:
				dumpBeforePods.Add(1)
			case i.Health.Ready():
				dumpWhileReady.Add(1)
			}
			dumps.Add(1)
			_, _ = w.Write([]byte("{}"))
		}))
		srv.Listener.Close()
		srv.Listener = ln
		srv.Start()
		defer srv.Close()
	} else {
		t.Log("no non-loopback IPv4 address on this machine: the startup recovery peer is not tested")
	}
	pool := &inferencev1.InferencePool{
		ObjectMeta: metav1.ObjectMeta{Name: "qwen", Namespace: ns},
		Spec: inferencev1.InferencePoolSpec{
			Selector:          inferencev1.LabelSelector{MatchLabels: map[inferencev1.LabelKey]inferencev1.LabelValue{"app": "vllm"}},
			TargetPorts:       []inferencev1.Port{{Number: 8000}},
			EndpointPickerRef: &inferencev1.EndpointPickerRef{Name: "kvepp", Port: &inferencev1.Port{Number: 9002}},
		},
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "vllm-0", Namespace: ns, Labels: map[string]string{"app": "vllm"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vllm", Image: "vllm"}}},
	}
	for _, o := range []client.Object{&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, pool, pod,
		startSlice, peerSlice(ns, "other-1", "other", selectionPort, "192.0.2.50")} {
		if err := admin.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.1.0.1",
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}
	if err := admin.Status().Update(ctx, pod); err != nil {
		t.Fatal(err)
	}

	started, err := Start(ctx, Options{Config: cfg, Logger: testLogger(t), KubeRestConfig: env.Config})
	if err != nil {
		t.Fatal(err)
	}
	inst.Store(started)
	stopped := false
	defer func() {
		if !stopped {
			_ = started.Stop(context.Background())
		}
	}()
	status := healthChecker(ctx, t, started.Addrs().Health)
	deadline, _ := ctx.Deadline()
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		waitUntil(t, deadline, what, cond, func() string { return "" })
	}
	waitFor("readiness SERVING", func() bool { return status("readiness") == healthpb.HealthCheckResponse_SERVING })
	if st := started.Pool().Stats(); st.Registered != 1 || st.Candidates != 1 {
		t.Fatalf("pool stats %+v, want vllm-0 registered and a candidate", st)
	}
	peersURL := "http://" + started.Addrs().Selection + "/replica_sync/peers"
	peers := func() []string {
		var out []string
		if code := httpJSON(t, http.MethodGet, peersURL, nil, &out); code != http.StatusOK {
			t.Fatalf("GET /replica_sync/peers = %d", code)
		}
		return out
	}
	var base []string
	if startupPeer != "" {
		base = []string{"tcp://" + net.JoinHostPort(startupPeer, "19092")}
		if n := dumps.Load(); n != 1 || dumpBeforePods.Load() != 0 || dumpWhileReady.Load() != 0 {
			t.Fatalf("startup recovery: %d /dump calls (want 1), %d before the pod was registered, %d while ready",
				n, dumpBeforePods.Load(), dumpWhileReady.Load())
		}
	}
	if got := peers(); len(got)+len(base) > 0 && !slices.Equal(got, base) {
		t.Fatalf("replica peers after startup %v, want %v (POD_IP and other services excluded)", got, base)
	}

	// A second slice of the peer Service appears: its endpoint is registered by the watch.
	late := peerSlice(ns, "kvepp-peers-2", cfg.PeerService, selectionPort, "192.0.2.12")
	if err := admin.Create(ctx, late); err != nil {
		t.Fatal(err)
	}
	withLate := append(slices.Clone(base), "tcp://192.0.2.12:19092")
	slices.Sort(withLate)
	waitFor("the new peer in GET /replica_sync/peers", func() bool { return slices.Equal(peers(), withLate) })
	// It goes away: deregistered, the startup peer stays.
	if err := admin.Delete(ctx, late); err != nil {
		t.Fatal(err)
	}
	waitFor("the peer gone from GET /replica_sync/peers", func() bool { p := peers(); return len(p)+len(base) == 0 || slices.Equal(p, base) })

	stopped = true
	if err := started.Stop(context.Background()); err != nil {
		t.Fatalf("Stop: %v", err)
	}
}

// verifyNoGoroutineLeaks checks, when t ends, that every goroutine started since is gone. Call it
// first, so its check runs after every other cleanup (the test's clients, servers and control
// plane).
func verifyNoGoroutineLeaks(t *testing.T) {
	t.Helper()
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		goleak.VerifyNone(t, before,
			// Idle keep-alive connections of client-go's shared, cached transports (the test's
			// admin client's too): the process-wide connection pool, not the EPP's.
			goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
			goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
			goleak.IgnoreAnyFunction("net/http.(*http2ClientConn).readLoop"),
			goleak.IgnoreAnyFunction("golang.org/x/net/http2.(*ClientConn).readLoop"))
	})
}

// peerSlice is an EndpointSlice of service svc in ns with the named peer ports (replica-agg
// 19092, selection-http selPort) and one ready endpoint per address.
func peerSlice(ns, name, svc string, selPort int32, addrs ...string) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports: []discoveryv1.EndpointPort{{Name: new(discovery.PeerPortReplica), Port: new(int32(19092))},
			{Name: new(discovery.PeerPortSelection), Port: new(selPort)}},
	}
	for _, a := range addrs {
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{Addresses: []string{a}})
	}
	return s
}

// deadKubeconfig points KUBECONFIG at an API server that does not exist, so only
// Options.KubeRestConfig can reach the test's.
func deadKubeconfig(t *testing.T) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	const kc = `apiVersion: v1
kind: Config
clusters: [{name: dead, cluster: {server: "https://127.0.0.1:1"}}]
contexts: [{name: dead, context: {cluster: dead, user: dead}}]
users: [{name: dead, user: {token: nothing}}]
current-context: dead
`
	if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KUBECONFIG", path)
}

// nonLoopbackIPv4 returns a global unicast IPv4 address of this machine, or "".
func nonLoopbackIPv4() string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return ""
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && ipn.IP.IsGlobalUnicast() {
			return ipn.IP.String()
		}
	}
	return ""
}

// fakePeerAPIServer is an API server for one peer Service's EndpointSlices: it answers 403
// Forbidden (a missing RBAC grant) until allowed, then serves list (a plain list, or client-go's
// streaming list over a watch) and holds watches open. It records every request path with its
// query.
type fakePeerAPIServer struct {
	*httptest.Server
	allowed  atomic.Bool
	mu       sync.Mutex
	requests []string
}

func newFakePeerAPIServer(t *testing.T, list *discoveryv1.EndpointSliceList) *fakePeerAPIServer {
	t.Helper()
	list.APIVersion, list.Kind, list.ResourceVersion = "discovery.k8s.io/v1", "EndpointSliceList", "7"
	body, err := json.Marshal(list)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakePeerAPIServer{}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.requests = append(f.requests, r.URL.Path+"?"+r.URL.RawQuery)
		f.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.URL.Path == "/api": // API discovery is open to every user, as on a real server
			_, _ = w.Write([]byte(`{"kind":"APIVersions","versions":["v1"]}`))
		case r.URL.Path == "/apis":
			_, _ = w.Write([]byte(`{"kind":"APIGroupList","apiVersion":"v1","groups":[{"name":"discovery.k8s.io",` +
				`"versions":[{"groupVersion":"discovery.k8s.io/v1","version":"v1"}],"preferredVersion":{"groupVersion":"discovery.k8s.io/v1","version":"v1"}}]}`))
		case r.URL.Path == "/apis/discovery.k8s.io/v1":
			_, _ = w.Write([]byte(`{"kind":"APIResourceList","apiVersion":"v1","groupVersion":"discovery.k8s.io/v1","resources":[` +
				`{"name":"endpointslices","singularName":"endpointslice","namespaced":true,"kind":"EndpointSlice","verbs":["get","list","watch"]}]}`))
		case !f.allowed.Load():
			w.WriteHeader(http.StatusForbidden)
			_, _ = w.Write([]byte(`{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403,` +
				`"message":"endpointslices.discovery.k8s.io is forbidden: User \"system:serviceaccount:ns:kvepp\" cannot list resource \"endpointslices\""}`))
		case r.URL.Query().Get("watch") == "true":
			w.WriteHeader(http.StatusOK)
			if r.URL.Query().Get("sendInitialEvents") == "true" {
				// client-go's streaming list: the items as ADDED events, then the bookmark that
				// ends the initial events.
				enc := json.NewEncoder(w)
				for i := range list.Items {
					it := list.Items[i].DeepCopy()
					it.APIVersion, it.Kind, it.ResourceVersion = "discovery.k8s.io/v1", "EndpointSlice", "7"
					_ = enc.Encode(map[string]any{"type": "ADDED", "object": it})
				}
				_ = enc.Encode(map[string]any{"type": "BOOKMARK", "object": map[string]any{
					"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
					"metadata": map[string]any{"resourceVersion": "7", "annotations": map[string]string{metav1.InitialEventsAnnotationKey: "true"}}}})
			}
			w.(http.Flusher).Flush()
			<-r.Context().Done() // no further events; the client ends the watch
		default:
			_, _ = w.Write(body)
		}
	}))
	t.Cleanup(f.Close)
	return f
}

func (f *fakePeerAPIServer) paths() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.requests)
}

// TestPeerDiscoveryHonoursTheRESTConfigOverride starts a peer-service EPP (no pool) whose
// Options.KubeRestConfig names a fake API server while KUBECONFIG names a dead one: the
// EndpointSlice list goes to the override, narrowed to the peer Service's label; the 403 is logged
// as the missing RBAC grant it is and startup goes on without recovery peers after
// DYN_EPP_RECOVERY_TIMEOUT_SECS; once the grant exists the informer's retry lists the slice and
// its peer is registered.
func TestPeerDiscoveryHonoursTheRESTConfigOverride(t *testing.T) {
	verifyNoGoroutineLeaks(t)
	deadKubeconfig(t)
	api := newFakePeerAPIServer(t, &discoveryv1.EndpointSliceList{Items: []discoveryv1.EndpointSlice{
		*peerSlice("ns", "kvepp-peers-1", "kvepp-peers", 18092, "192.0.2.10", "192.0.2.99"),
	}})
	cfg := replicaConfig(t)
	cfg.PeerService, cfg.PodNamespace, cfg.PodIP = "kvepp-peers", "ns", "192.0.2.99"
	cfg.RecoveryTimeout = Seconds(time.Second)
	logs := &syncbuf.Buffer{}
	log := zerolog.New(logs)
	inst, err := Start(context.Background(), Options{Config: cfg, Logger: &log, KubeRestConfig: &rest.Config{Host: api.URL}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inst.Stop(context.Background()) })
	if !strings.Contains(logs.String(), "peer EndpointSlices not listed in time; starting without recovery peers") {
		t.Fatalf("startup did not say it goes on without recovery peers:\n%s", logs.String())
	}
	deadline := time.Now().Add(30 * time.Second)
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		waitUntil(t, deadline, what, cond, func() string {
			return fmt.Sprintf("; the override API server saw %v; replica peers %v; logs:\n%s", api.paths(), inst.replica.m.Peers(), logs.String())
		})
	}
	const list = "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices?"
	waitFor("a list or watch of the peer Service's EndpointSlices on the override", func() bool {
		return slices.ContainsFunc(api.paths(), func(p string) bool {
			return strings.HasPrefix(p, list) && strings.Contains(p, "labelSelector=kubernetes.io%2Fservice-name%3Dkvepp-peers")
		})
	})
	waitFor("the RBAC problem logged", func() bool {
		return strings.Contains(logs.String(), "RBAC forbids listing or watching *v1.EndpointSlice in namespace ns")
	})
	api.allowed.Store(true)
	waitFor("the slice's peer registered after the grant (POD_IP excluded)", func() bool {
		return slices.Equal(inst.replica.m.Peers(), []string{"tcp://192.0.2.10:19092"})
	})
}

// waitUntil polls cond every 20 ms until it holds, failing t at deadline with what and detail().
func waitUntil(t *testing.T, deadline time.Time, what string, cond func() bool, detail func() string) {
	t.Helper()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s%s", what, detail())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
