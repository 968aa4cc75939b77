package discovery

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/rs/zerolog"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/kvepp/kvepp/internal/syncbuf"
	"github.com/kvepp/kvepp/picker/discovery/discoverytest"
)

// envHarness runs the production wiring (NewKube → WatchInferencePool → PoolSource) against a real
// API server: every snapshot is triggered by informer events, never by the test.
type envHarness struct {
	*poolHarness
	admin client.Client
	kube  *Kube
	ctx   context.Context // ends when the test does
}

func startEnvDiscovery(t *testing.T, cfg *rest.Config, admin client.Client, ns string, kubeOpts ...func(*KubeConfig)) *envHarness {
	t.Helper()
	logBuf := &syncbuf.Buffer{}
	log := zerolog.New(logBuf)
	kc := KubeConfig{RestConfig: cfg, Namespace: ns, Logger: log}
	for _, o := range kubeOpts {
		o(&kc)
	}
	kube, err := NewKube(kc)
	if err != nil {
		t.Fatal(err)
	}
	cat, ev := newCountingCatalog(t)
	src, err := NewPoolSource(PoolConfig{
		Namespace: ns, Name: "qwen", ModelName: "Qwen/Qwen3-0.6B", BlockSize: 16,
		RetryInterval: 100 * time.Millisecond, ReadRetryMin: 50 * time.Millisecond, ReadRetryMax: 200 * time.Millisecond,
		Logger: log,
	}, kube.Reader(), cat)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	kubeDone := make(chan error, 1)
	go func() { kubeDone <- kube.Start(ctx) }()
	kube.WatchInferencePool(ctx, src)
	if err := src.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = src.Close()
		if err := <-kubeDone; err != nil {
			t.Errorf("kube.Start: %v", err)
		}
	})
	return &envHarness{poolHarness: &poolHarness{t: t, cat: cat, ev: ev, src: src, log: logBuf}, admin: admin, kube: kube, ctx: ctx}
}

// create makes obj through the admin client; pods get their status written like a kubelet would.
func (h *envHarness) create(obj client.Object) {
	h.t.Helper()
	ctx := context.Background()
	status := obj.DeepCopyObject().(client.Object)
	if err := h.admin.Create(ctx, obj); err != nil {
		h.t.Fatalf("create %s: %v", obj.GetName(), err)
	}
	if p, ok := status.(*corev1.Pod); ok {
		h.setPodStatus(obj.GetName(), p.Status)
	}
}

func (h *envHarness) setPodStatus(name string, st corev1.PodStatus) {
	h.t.Helper()
	ctx := context.Background()
	var cur corev1.Pod
	if err := h.admin.Get(ctx, client.ObjectKey{Namespace: h.src.cfg.Namespace, Name: name}, &cur); err != nil {
		h.t.Fatal(err)
	}
	cur.Status = st
	for i := range cur.Status.ContainerStatuses {
		cur.Status.ContainerStatuses[i].Image = "vllm"
		cur.Status.ContainerStatuses[i].ImageID = "vllm"
	}
	if err := h.admin.Status().Update(ctx, &cur); err != nil {
		h.t.Fatalf("update status of %s: %v", name, err)
	}
}

// envPod is pod() in namespace ns (UID and creation time are set by the API server).
func envPod(ns, name, app, ip string, mods ...func(*corev1.Pod)) *corev1.Pod {
	p := pod(name, app, ip, mods...)
	p.Namespace, p.UID, p.CreationTimestamp = ns, "", metav1.Time{}
	return p
}

func TestEnvtestInferencePoolDiscovery(t *testing.T) {
	env := discoverytest.Start(t, false)
	admin, err := client.New(env.Config, client.Options{Scheme: Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	newNS := func(name string) string {
		if err := admin.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}); err != nil {
			t.Fatal(err)
		}
		return name
	}
	// Runs first, before the CRD exists.
	t.Run("a missing InferencePool CRD is a clear log line and not ready until it is installed", func(t *testing.T) {
		ns := newNS("crd")
		h := startEnvDiscovery(t, env.Config, admin, ns)
		h.waitFor("the missing CRD reported", func() bool {
			return strings.Contains(h.log.String(), "InferencePool CRD (inference.networking.k8s.io/v1) is not installed")
		})
		if st := h.src.Stats(); st.Ready || !strings.Contains(st.Problem, "CRD") {
			t.Fatalf("stats %+v", st)
		}
		if _, err := envtest.InstallCRDs(env.Config, envtest.CRDInstallOptions{Paths: []string{discoverytest.InferencePoolCRDDir(t)}, ErrorIfPathMissing: true}); err != nil {
			t.Fatalf("install CRDs: %v", err)
		}
		h.waitFor("the pool reported missing once the CRD exists", func() bool { return strings.Contains(h.src.Stats().Problem, "InferencePool crd/qwen not found") })
		p := pool("vllm", 8000)
		p.Namespace = ns
		h.create(p)
		h.create(envPod(ns, "vllm-0", "vllm", "10.1.0.1"))
		if err := h.src.WaitReady(ctxTimeout(t)); err != nil {
			t.Fatalf("not ready: %v %+v", err, h.src.Stats())
		}
		h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.1.0.1:8000"})
	})
	t.Run("pods and the pool are followed through informer events", func(t *testing.T) {
		ns := newNS("pool")
		h := startEnvDiscovery(t, env.Config, admin, ns)
		h.waitFor("the missing pool reported", func() bool { return strings.Contains(h.src.Stats().Problem, "InferencePool pool/qwen not found") })
		p := pool("vllm", 8000, 8001)
		p.Namespace = ns
		h.create(p)
		h.create(envPod(ns, "vllm-0", "vllm", "10.1.0.1"))
		h.create(envPod(ns, "vllm-1", "vllm", "10.1.0.2", notReady))
		h.create(envPod(ns, "other-0", "other", "10.1.0.9"))
		h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.1.0.1:8000", id("vllm-1"): "http://10.1.0.2:8000"})
		h.waitFor("vllm-1 withheld, vllm-0 candidate", func() bool { return h.cat.IsCandidate(id("vllm-0")) && !h.cat.IsCandidate(id("vllm-1")) })
		if st, _ := h.cat.Worker(id("vllm-1")); st.RankEndpoint(1) != "http://10.1.0.2:8001" {
			t.Errorf("rank 1 endpoint %q", st.RankEndpoint(1))
		}

		// Readiness flap: candidacy only.
		h.setPodStatus("vllm-1", pod("vllm-1", "vllm", "10.1.0.2").Status)
		h.waitFor("vllm-1 candidate", func() bool { return h.cat.IsCandidate(id("vllm-1")) })
		if _, d := h.cat.counts(id("vllm-1")); d != 0 {
			t.Errorf("readiness flap deleted the worker %d times", d)
		}
		// Container restart: delete + register again.
		h.setPodStatus("vllm-1", pod("vllm-1", "vllm", "10.1.0.2", func(p *corev1.Pod) { p.Status.ContainerStatuses[0].RestartCount = 1 }).Status)
		h.waitFor("re-registration after a restart", func() bool { u, d := h.cat.counts(id("vllm-1")); return d == 1 && u == 2 })
		// New IP: delete + register again.
		h.setPodStatus("vllm-0", pod("vllm-0", "vllm", "10.1.0.7").Status)
		h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.1.0.7:8000", id("vllm-1"): "http://10.1.0.2:8000"})
		if _, d := h.cat.counts(id("vllm-0")); d != 1 {
			t.Errorf("re-IPed pod deleted %d times, want 1", d)
		}
		// Selector change.
		var cur = pool("other", 8000)
		if err := admin.Get(ctx, client.ObjectKey{Namespace: ns, Name: "qwen"}, cur); err != nil {
			t.Fatal(err)
		}
		cur.Spec = pool("other", 8000).Spec
		if err := admin.Update(ctx, cur); err != nil {
			t.Fatal(err)
		}
		h.waitEndpoints(map[uint64]string{id("other-0"): "http://10.1.0.9:8000"})
		// Pod deleted.
		if err := admin.Delete(ctx, envPod(ns, "other-0", "other", "")); err != nil {
			t.Fatal(err)
		}
		h.waitEndpoints(map[uint64]string{})
		// Pool deleted: not ready.
		if err := admin.Delete(ctx, cur); err != nil {
			t.Fatal(err)
		}
		h.waitFor("not ready after the pool was deleted", func() bool { return !h.src.Ready() })
	})
	t.Run("RBACRules are enough, and without them discovery is not ready and says why", func(t *testing.T) {
		ns := newNS("rbac")
		sa, user := serviceAccountUser(t, env, ns)
		p := pool("vllm", 8000)
		p.Namespace = ns
		if err := admin.Create(ctx, p); err != nil {
			t.Fatal(err)
		}
		h := startEnvDiscovery(t, user.Config(), admin, ns)
		h.create(envPod(ns, "vllm-0", "vllm", "10.1.0.1"))
		h.waitFor("the RBAC problem logged", func() bool {
			return strings.Contains(h.log.String(), "RBAC forbids listing or watching") && strings.Contains(h.src.Stats().Problem, "RBAC")
		})
		if h.src.Ready() {
			t.Fatal("ready without RBAC")
		}
		bindRole(t, admin, ns, sa, "discovery", RBACRules())
		if err := h.src.WaitReady(ctxTimeout60(t)); err != nil {
			t.Fatalf("not ready with RBACRules bound: %v %+v\n%s", err, h.src.Stats(), h.log.String())
		}
		h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.1.0.1:8000"})
		if diff := cmp.Diff(map[string][]string{"pods": {"get", "list", "watch"}, "inferencepools": {"get", "list", "watch"}, "endpointslices": {"get", "list", "watch"}}, rulesByResource(RBACRules())); diff != "" {
			t.Errorf("RBACRules (-want +got):\n%s", diff)
		}
	})
	t.Run("peer EndpointSlices share the pool's cache: narrowed to the peer Service, their RBAC problem reported apart", func(t *testing.T) {
		ns := newNS("peers")
		sa, user := serviceAccountUser(t, env, ns)
		// Pods and pools may be read, EndpointSlices not yet.
		var poolRules []rbacv1.PolicyRule
		for _, r := range RBACRules() {
			if r.Resources[0] != "endpointslices" {
				poolRules = append(poolRules, r)
			}
		}
		bindRole(t, admin, ns, sa, "pool", poolRules)
		p := pool("vllm", 8000)
		p.Namespace = ns
		for _, o := range []client.Object{p, envSlice(ns, "kvepp-peers-1", "kvepp-peers", "10.2.0.1", "10.2.0.99"), envSlice(ns, "other-1", "other", "10.2.0.9")} {
			if err := admin.Create(ctx, o); err != nil {
				t.Fatal(err)
			}
		}
		h := startEnvDiscovery(t, user.Config(), admin, ns, func(c *KubeConfig) { c.PeerService = "kvepp-peers" })
		sink := &peerSet{peers: map[string]bool{}}
		w, err := NewPeerWatcher(PeerConfig{Namespace: ns, Service: "kvepp-peers", PodIP: "10.2.0.99", ReplicaPort: 9092, SelectionPort: 8092,
			RetryInterval: 50 * time.Millisecond, Logger: zerolog.New(h.log)}, h.kube.Reader(), sink)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Start(h.ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = w.Close() })
		if err := h.kube.WatchPeers(h.ctx, w); err != nil {
			t.Fatal(err)
		}
		other, _ := NewPeerWatcher(PeerConfig{Namespace: ns, Service: "other"}, h.kube.Reader(), sink)
		if err := h.kube.WatchPeers(h.ctx, other); err == nil {
			t.Fatal("WatchPeers accepted a Service the EndpointSlice cache is not narrowed to")
		}
		h.create(envPod(ns, "vllm-0", "vllm", "10.1.0.1"))
		if err := h.src.WaitReady(ctxTimeout60(t)); err != nil {
			t.Fatalf("the pool is not ready while only EndpointSlices are forbidden: %v %+v", err, h.src.Stats())
		}
		h.waitFor("the EndpointSlice RBAC problem logged and reported by the peer watcher", func() bool {
			return strings.Contains(h.log.String(), "RBAC forbids listing or watching *v1.EndpointSlice in namespace peers") &&
				strings.Contains(w.Problem(), "RBAC forbids listing or watching *v1.EndpointSlice")
		})
		if st := h.src.Stats(); strings.Contains(st.Problem, "EndpointSlice") {
			t.Fatalf("the pool reports the peers' problem: %+v", st)
		}

		bindRole(t, admin, ns, sa, "peers", RBACRules())
		peers, err := w.WaitSynced(ctxTimeout60(t))
		if err != nil {
			t.Fatalf("peer watcher not synced once RBACRules are bound: %v; %s\n%s", err, w.Problem(), h.log.String())
		}
		want := Peers{Replica: []string{"tcp://10.2.0.1:9092"}, Selection: []string{"http://10.2.0.1:8092"}}
		if d := cmp.Diff(want, peers); d != "" {
			t.Fatalf("first sync (-want +got):\n%s", d)
		}
		h.waitFor("the peer registered", func() bool { return cmp.Equal(sink.list(), want.Replica) })
		// The cache holds the peer Service's slices only.
		var cached discoveryv1.EndpointSliceList
		if err := h.kube.Reader().List(ctx, &cached, client.InNamespace(ns)); err != nil {
			t.Fatal(err)
		}
		if len(cached.Items) != 1 || cached.Items[0].Name != "kvepp-peers-1" {
			t.Fatalf("the EndpointSlice cache holds %d slices, want kvepp-peers-1 only", len(cached.Items))
		}
		// A slice event reaches the watcher through the shared informer.
		if err := admin.Create(ctx, envSlice(ns, "kvepp-peers-2", "kvepp-peers", "10.2.0.2")); err != nil {
			t.Fatal(err)
		}
		h.waitFor("the second peer registered", func() bool {
			return cmp.Equal(sink.list(), []string{"tcp://10.2.0.1:9092", "tcp://10.2.0.2:9092"})
		})
	})
}

// serviceAccountUser is an API server user authenticated as the kvepp ServiceAccount of ns,
// with no permissions of its own; it returns the user name and the user.
func serviceAccountUser(t *testing.T, env *envtest.Environment, ns string) (string, *envtest.AuthenticatedUser) {
	t.Helper()
	name := "system:serviceaccount:" + ns + ":kvepp"
	user, err := env.AddUser(envtest.User{Name: name, Groups: []string{"system:serviceaccounts", "system:authenticated"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return name, user
}

// bindRole grants user the rules in ns through Role and RoleBinding kvepp-<name>.
func bindRole(t *testing.T, admin client.Client, ns, user, name string, rules []rbacv1.PolicyRule) {
	t.Helper()
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "kvepp-" + name, Namespace: ns}, Rules: rules}
	bind := &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "kvepp-" + name, Namespace: ns},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: role.Name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}},
	}
	for _, o := range []client.Object{role, bind} {
		if err := admin.Create(context.Background(), o); err != nil {
			t.Fatal(err)
		}
	}
}

// envSlice is an EndpointSlice of service svc in ns with one endpoint per address and no named
// ports (the watcher's configured ports apply).
func envSlice(ns, name, svc string, addrs ...string) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for _, a := range addrs {
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{Addresses: []string{a}})
	}
	return s
}

// peerSet is a PeerSink that records membership.
type peerSet struct {
	mu    sync.Mutex
	peers map[string]bool
}

func (s *peerSet) RegisterPeer(ep string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	added := !s.peers[ep]
	s.peers[ep] = true
	return added, nil
}

func (s *peerSet) DeregisterPeer(ep string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.peers, ep)
	return nil
}

func (s *peerSet) list() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return sortedKeys(s.peers)
}

// rulesByResource flattens rules to resource → verbs.
func rulesByResource(rules []rbacv1.PolicyRule) map[string][]string {
	out := map[string][]string{}
	for _, r := range rules {
		for _, res := range r.Resources {
			out[res] = append(out[res], r.Verbs...)
		}
	}
	return out
}

func ctxTimeout60(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}
