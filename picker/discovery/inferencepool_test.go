package discovery

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/rs/zerolog"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	inferencev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/kvepp/kvepp/internal/syncbuf"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
)

const testNS = "llm"

// countingCatalog is a real selection core with per-worker operation counts and injectable upsert
// failures, so tests can tell an upsert from a delete-and-re-register.
type countingCatalog struct {
	*picker.Service
	mu       sync.Mutex
	upserts  map[uint64]int
	deletes  map[uint64]int
	failNext int // upserts to fail
}

func newCountingCatalog(t *testing.T) (*countingCatalog, *pickertest.EventSource) {
	t.Helper()
	ev := pickertest.NewEventSource()
	cfg := pickertest.Config(1, 7)
	cfg.Router.UseKVEvents = true
	cfg.EventSource = ev
	svc, err := picker.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &countingCatalog{Service: svc, upserts: map[uint64]int{}, deletes: map[uint64]int{}}, ev
}

func (c *countingCatalog) UpsertWorker(ctx context.Context, rec picker.WorkerRecord, src picker.Source) (picker.WorkerState, error) {
	c.mu.Lock()
	if c.failNext > 0 {
		c.failNext--
		c.mu.Unlock()
		return picker.WorkerState{}, picker.Errorf(picker.KindNotReady, "injected upsert failure")
	}
	c.upserts[rec.WorkerID]++
	c.mu.Unlock()
	return c.Service.UpsertWorker(ctx, rec, src)
}

func (c *countingCatalog) DeleteWorker(ctx context.Context, id uint64) (picker.WorkerState, error) {
	c.mu.Lock()
	c.deletes[id]++
	c.mu.Unlock()
	return c.Service.DeleteWorker(ctx, id)
}

func (c *countingCatalog) counts(id uint64) (upserts, deletes int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.upserts[id], c.deletes[id]
}

func (c *countingCatalog) setFail(n int) {
	c.mu.Lock()
	c.failNext = n
	c.mu.Unlock()
}

// pool is an InferencePool selecting app=<app> on the given target ports.
func pool(app string, ports ...int32) *inferencev1.InferencePool {
	p := &inferencev1.InferencePool{
		ObjectMeta: metav1.ObjectMeta{Name: "qwen", Namespace: testNS},
		Spec: inferencev1.InferencePoolSpec{
			Selector: inferencev1.LabelSelector{MatchLabels: map[inferencev1.LabelKey]inferencev1.LabelValue{"app": inferencev1.LabelValue(app)}},
		},
	}
	for _, n := range ports {
		p.Spec.TargetPorts = append(p.Spec.TargetPorts, inferencev1.Port{Number: inferencev1.PortNumber(n)})
	}
	return p
}

// pod is a Running, Ready pod labelled app=<app> at ip, created at minute age.
func pod(name, app, ip string, mods ...func(*corev1.Pod)) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: testNS, Labels: map[string]string{"app": app},
			UID:               types.UID("uid-" + name),
			CreationTimestamp: metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)),
		},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vllm", Image: "vllm"}}},
		Status: corev1.PodStatus{
			Phase: corev1.PodRunning, PodIP: ip,
			Conditions:        []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}},
			ContainerStatuses: []corev1.ContainerStatus{{Name: "vllm", RestartCount: 0}},
		},
	}
	for _, m := range mods {
		m(p)
	}
	return p
}

func notReady(p *corev1.Pod) { p.Status.Conditions[0].Status = corev1.ConditionFalse }

// poolHarness runs a PoolSource on a fake client.
type poolHarness struct {
	t   *testing.T
	c   client.WithWatch
	cat *countingCatalog
	ev  *pickertest.EventSource
	src *PoolSource
	log *syncbuf.Buffer
}

type harnessOpt func(*PoolConfig, *fake.ClientBuilder)

func newPoolHarness(t *testing.T, objs []client.Object, opts ...harnessOpt) *poolHarness {
	t.Helper()
	b := fake.NewClientBuilder().WithScheme(Scheme()).WithObjects(objs...)
	cat, ev := newCountingCatalog(t)
	logBuf := &syncbuf.Buffer{}
	cfg := PoolConfig{
		Namespace: testNS, Name: "qwen", ModelName: "Qwen/Qwen3-0.6B", BlockSize: 16,
		RetryInterval: 50 * time.Millisecond, ReadRetryMin: 20 * time.Millisecond, ReadRetryMax: 100 * time.Millisecond,
		Logger: zerolog.New(logBuf),
	}
	for _, o := range opts {
		o(&cfg, b)
	}
	h := &poolHarness{t: t, c: b.Build(), cat: cat, ev: ev, log: logBuf}
	src, err := NewPoolSource(cfg, h.c, cat)
	if err != nil {
		t.Fatal(err)
	}
	h.src = src
	if err := src.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = src.Close() })
	src.Trigger() // as the informers do once synced
	return h
}

// apply creates or replaces obj (status included) and triggers the source, as an informer event would.
func (h *poolHarness) apply(obj client.Object) {
	h.t.Helper()
	ctx := context.Background()
	cur := obj.DeepCopyObject().(client.Object)
	err := h.c.Get(ctx, client.ObjectKeyFromObject(obj), cur)
	switch {
	case apierrors.IsNotFound(err):
		err = h.c.Create(ctx, obj)
	case err == nil:
		obj.SetResourceVersion(cur.GetResourceVersion())
		status := obj.DeepCopyObject().(client.Object)
		if err = h.c.Update(ctx, obj); err == nil {
			// Status is a subresource: written separately, as the kubelet does.
			if _, isPod := obj.(*corev1.Pod); isPod {
				status.SetResourceVersion(obj.GetResourceVersion())
				err = h.c.Status().Update(ctx, status)
			}
		}
	}
	if err != nil {
		h.t.Fatalf("apply %s: %v", obj.GetName(), err)
	}
	h.src.Trigger()
}

// remove deletes obj and triggers the source.
func (h *poolHarness) remove(obj client.Object) {
	h.t.Helper()
	if err := h.c.Delete(context.Background(), obj); err != nil {
		h.t.Fatalf("delete %s: %v", obj.GetName(), err)
	}
	h.src.Trigger()
}

// in returns the harness reporting to t (a subtest).
func (h *poolHarness) in(t *testing.T) *poolHarness {
	c := *h
	c.t = t
	return &c
}

func (h *poolHarness) waitFor(what string, cond func() bool) {
	h.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			h.t.Fatalf("timed out waiting for %s; stats %+v; catalog %v; log:\n%s", what, h.src.Stats(), h.endpoints(), h.log.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// endpoints maps worker id → endpoint of the catalog.
func (h *poolHarness) endpoints() map[uint64]string {
	out := map[uint64]string{}
	for _, w := range h.cat.Workers("", "") {
		out[w.WorkerID] = w.Endpoint
	}
	return out
}

func (h *poolHarness) waitEndpoints(want map[uint64]string) {
	h.t.Helper()
	h.waitFor(fmt.Sprintf("catalog %v", want), func() bool { return cmp.Equal(h.endpoints(), want) })
}

func id(name string) uint64 { return HashPodName(name) }

func TestPoolSourceRegistersPods(t *testing.T) {
	h := newPoolHarness(t, []client.Object{
		pool("vllm", 8000, 8001),
		pod("vllm-0", "vllm", "10.0.0.1"),
		pod("vllm-1", "vllm", "10.0.0.2", notReady),
		pod("vllm-2", "vllm", "10.0.0.3", func(p *corev1.Pod) { p.Status.Phase = corev1.PodPending }),
		pod("vllm-3", "vllm", "", func(p *corev1.Pod) { p.Status.PodIP = "" }),
		pod("other-0", "other", "10.0.0.9"),
	}, func(c *PoolConfig, _ *fake.ClientBuilder) { c.MaxNumBatchedTokens = 8192; c.TotalKVBlocks = 1000 })
	if err := h.src.WaitReady(ctxTimeout(t)); err != nil {
		t.Fatalf("not ready: %v; %+v", err, h.src.Stats())
	}
	h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.0.0.1:8000", id("vllm-1"): "http://10.0.0.2:8000"})

	st, _ := h.cat.Worker(id("vllm-0"))
	want := picker.WorkerRecord{
		WorkerID: id("vllm-0"), ModelName: "Qwen/Qwen3-0.6B", RoutingGroup: "default", Endpoint: "http://10.0.0.1:8000",
		BlockSize: u32(16), DataParallelStartRank: u32(0), DataParallelSize: u32(2),
		KVEventsEndpoints:   map[string]string{"0": "tcp://10.0.0.1:5557", "1": "tcp://10.0.0.1:5558"},
		MaxNumBatchedTokens: u64(8192), TotalKVBlocks: u64(1000),
		RankEndpoints: []string{"http://10.0.0.1:8000", "http://10.0.0.1:8001"},
	}
	if diff := cmp.Diff(want, st.WorkerRecord); diff != "" {
		t.Errorf("worker record (-want +got):\n%s", diff)
	}
	if st.Source != picker.SourceDiscovery || st.Lifecycle != picker.LifecycleSchedulable {
		t.Errorf("source %q lifecycle %q", st.Source, st.Lifecycle)
	}
	if !h.cat.IsCandidate(id("vllm-0")) || h.cat.IsCandidate(id("vllm-1")) {
		t.Errorf("candidacy: vllm-0 %t vllm-1 %t, want true false", h.cat.IsCandidate(id("vllm-0")), h.cat.IsCandidate(id("vllm-1")))
	}
	if s := h.src.Stats(); !s.Ready || s.Registered != 2 || s.Candidates != 1 || s.Ranks != 4 || s.Problem != "" {
		t.Errorf("stats %+v", s)
	}
	// One dp_rank per target port, in the catalog record: the destination ext_proc and the
	// selection API both name.
	if st, _ := h.cat.Worker(id("vllm-1")); st.RankEndpoint(1) != "http://10.0.0.2:8001" ||
		st.DPRankEndpoints["1"] != "http://10.0.0.2:8001" {
		t.Errorf("vllm-1 rank 1 at %q (dp_rank_endpoints %v)", st.RankEndpoint(1), st.DPRankEndpoints)
	}
	if sel, err := h.cat.Reserve(context.Background(), picker.ReservationRequest{ModelName: "Qwen/Qwen3-0.6B", SelectionID: "r1",
		WorkerID: u64(id("vllm-0")), DPRank: u32(1), Prompt: picker.Prompt{TokenIDs: []uint32{1, 2, 3}}}); err != nil ||
		sel.Endpoint != "http://10.0.0.1:8001" {
		t.Errorf("reservation on vllm-0 rank 1: %+v %v", sel, err)
	} else if err := h.cat.Free(context.Background(), "r1"); err != nil {
		t.Error(err)
	}
	// Picks only reach candidates.
	for i := 0; i < 20; i++ {
		sel, err := h.cat.LoadOnlyPick(context.Background(), "Qwen/Qwen3-0.6B", nil, false)
		if err != nil || sel.WorkerID != id("vllm-0") {
			t.Fatalf("load-only pick %+v %v", sel, err)
		}
	}
}

func TestPoolSourcePodLifecycle(t *testing.T) {
	h := newPoolHarness(t, []client.Object{pool("vllm", 8000), pod("vllm-0", "vllm", "10.0.0.1"), pod("vllm-1", "vllm", "10.0.0.2")})
	h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.0.0.1:8000", id("vllm-1"): "http://10.0.0.2:8000"})
	v0 := id("vllm-0")

	t.Run("readiness flaps change only candidacy", func(t *testing.T) {
		h := h.in(t)
		idx := h.ev.Index(v0)
		h.apply(pod("vllm-0", "vllm", "10.0.0.1", notReady))
		h.waitFor("vllm-0 withheld", func() bool { return !h.cat.IsCandidate(v0) })
		h.apply(pod("vllm-0", "vllm", "10.0.0.1"))
		h.waitFor("vllm-0 candidate", func() bool { return h.cat.IsCandidate(v0) })
		if ups, dels := h.cat.counts(v0); ups != 1 || dels != 0 {
			t.Errorf("flapping pod: %d upserts %d deletes, want 1 0 (listeners and index rows kept)", ups, dels)
		}
		if _, attached := h.ev.Attached(v0); !attached || h.ev.Index(v0) != idx {
			t.Error("flapping pod lost its KV listener")
		}
	})
	t.Run("a re-addressed pod is deleted and registered again", func(t *testing.T) {
		h := h.in(t)
		h.apply(pod("vllm-0", "vllm", "10.0.0.7"))
		h.waitEndpoints(map[uint64]string{v0: "http://10.0.0.7:8000", id("vllm-1"): "http://10.0.0.2:8000"})
		if ups, dels := h.cat.counts(v0); ups != 2 || dels != 1 {
			t.Errorf("re-IPed pod: %d upserts %d deletes, want 2 1", ups, dels)
		}
		if spec, _ := h.ev.Attached(v0); spec.Endpoints[0] != "tcp://10.0.0.7:5557" {
			t.Errorf("KV listener endpoint %v", spec.Endpoints)
		}
	})
	t.Run("a container restart re-registers the worker", func(t *testing.T) {
		h := h.in(t)
		h.apply(pod("vllm-0", "vllm", "10.0.0.7", func(p *corev1.Pod) { p.Status.ContainerStatuses[0].RestartCount = 1 }))
		h.waitFor("re-registration after restart", func() bool { _, d := h.cat.counts(v0); return d == 2 })
		h.waitFor("registered again", func() bool { u, _ := h.cat.counts(v0); return u == 3 })
	})
	t.Run("a pod recreated under the same name re-registers the worker", func(t *testing.T) {
		h := h.in(t)
		h.remove(pod("vllm-0", "vllm", "10.0.0.7"))
		h.waitEndpoints(map[uint64]string{id("vllm-1"): "http://10.0.0.2:8000"})
		h.apply(pod("vllm-0", "vllm", "10.0.0.7", func(p *corev1.Pod) { p.UID = "uid-new" }))
		h.waitEndpoints(map[uint64]string{v0: "http://10.0.0.7:8000", id("vllm-1"): "http://10.0.0.2:8000"})
		// Same name, same IP, new UID while registered: delete + register again.
		before, _ := h.cat.counts(v0)
		h.apply(pod("vllm-0", "vllm", "10.0.0.7", func(p *corev1.Pod) { p.UID = "uid-newer" }))
		h.waitFor("re-registration after UID change", func() bool { u, _ := h.cat.counts(v0); return u == before+1 })
		if _, d := h.cat.counts(v0); d != 4 {
			t.Errorf("deletes %d, want 4 (IP, restart, removal, UID)", d)
		}
	})
	t.Run("terminating and failed pods are deleted", func(t *testing.T) {
		h := h.in(t)
		h.apply(pod("vllm-1", "vllm", "10.0.0.2", func(p *corev1.Pod) {
			p.Finalizers = []string{"kvepp.io/test"} // keeps the fake object while it terminates
		}))
		// The fake client sets deletionTimestamp on Delete when finalizers are present.
		if err := h.c.Delete(context.Background(), pod("vllm-1", "vllm", "10.0.0.2")); err != nil {
			t.Fatal(err)
		}
		h.src.Trigger()
		h.waitEndpoints(map[uint64]string{v0: "http://10.0.0.7:8000"})
		var p corev1.Pod
		if err := h.c.Get(context.Background(), client.ObjectKey{Namespace: testNS, Name: "vllm-1"}, &p); err != nil || p.DeletionTimestamp == nil {
			t.Fatalf("fake client did not keep a terminating pod: %v %+v", err, p.DeletionTimestamp)
		}
		h.apply(pod("vllm-0", "vllm", "10.0.0.7", func(p *corev1.Pod) { p.UID = "uid-newer"; p.Status.Phase = corev1.PodFailed }))
		h.waitEndpoints(map[uint64]string{})
	})
}

func TestPoolSourcePoolChanges(t *testing.T) {
	h := newPoolHarness(t, []client.Object{
		pool("a", 8000), pod("a-0", "a", "10.0.1.1"), pod("b-0", "b", "10.0.2.1"),
	})
	h.waitEndpoints(map[uint64]string{id("a-0"): "http://10.0.1.1:8000"})

	t.Run("a selector change re-evaluates every pod", func(t *testing.T) {
		h := h.in(t)
		h.apply(pool("b", 8000))
		h.waitEndpoints(map[uint64]string{id("b-0"): "http://10.0.2.1:8000"})
	})
	t.Run("a target port change updates endpoints and ranks in place", func(t *testing.T) {
		h := h.in(t)
		h.apply(pool("b", 9000, 9001, 9002))
		h.waitEndpoints(map[uint64]string{id("b-0"): "http://10.0.2.1:9000"})
		st, _ := h.cat.Worker(id("b-0"))
		if *st.DataParallelSize != 3 || st.KVEventsEndpoints["2"] != "tcp://10.0.2.1:5559" {
			t.Errorf("record after port change: size %d kv %v", *st.DataParallelSize, st.KVEventsEndpoints)
		}
		if _, d := h.cat.counts(id("b-0")); d != 0 {
			t.Errorf("a port change deleted the worker %d times", d)
		}
		if a := st.RankEndpoint(2); a != "http://10.0.2.1:9002" {
			t.Errorf("rank 2 endpoint %q", a)
		}
	})
	t.Run("an invalid pool spec makes the source not ready and removes its workers", func(t *testing.T) {
		h := h.in(t)
		bad := pool("b")
		h.apply(bad)
		h.waitFor("not ready", func() bool { return !h.src.Ready() })
		h.waitEndpoints(map[uint64]string{})
		if p := h.src.Stats().Problem; !strings.Contains(p, "spec.targetPorts has 0 entries") {
			t.Errorf("problem %q", p)
		}
		h.apply(pool("b", 8000))
		h.waitFor("ready again", h.src.Ready)
	})
	t.Run("a deleted pool deregisters every pod and the source is not ready", func(t *testing.T) {
		h := h.in(t)
		h.remove(pool("b", 8000))
		h.waitFor("not ready", func() bool { return !h.src.Ready() })
		h.waitEndpoints(map[uint64]string{})
		if p := h.src.Stats().Problem; !strings.Contains(p, "InferencePool llm/qwen not found") {
			t.Errorf("problem %q", p)
		}
	})
}

func TestPoolSourceMissingPoolAtStartup(t *testing.T) {
	var mu sync.Mutex
	var changes []bool
	h := newPoolHarness(t, []client.Object{pod("vllm-0", "vllm", "10.0.0.1")}, func(c *PoolConfig, _ *fake.ClientBuilder) {
		c.OnReadyChange = func(r bool) { mu.Lock(); changes = append(changes, r); mu.Unlock() }
	})
	h.waitFor("the missing pool logged", func() bool { return strings.Contains(h.log.String(), "InferencePool llm/qwen not found") })
	if h.src.Ready() || len(h.endpoints()) != 0 {
		t.Fatalf("ready %t with workers %v before the pool exists", h.src.Ready(), h.endpoints())
	}
	// The source polls with backoff, so the pool is found even without an event.
	if err := h.c.Create(context.Background(), pool("vllm", 8000)); err != nil {
		t.Fatal(err)
	}
	if err := h.src.WaitReady(ctxTimeout(t)); err != nil {
		t.Fatalf("pool created but source not ready: %v", err)
	}
	h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.0.0.1:8000"})
	h.remove(pool("vllm", 8000))
	h.waitFor("not ready after the pool was deleted", func() bool { return !h.src.Ready() })
	mu.Lock()
	defer mu.Unlock()
	if !cmp.Equal(changes, []bool{true, false}) {
		t.Errorf("OnReadyChange calls %v, want [true false]", changes)
	}
}

func TestPoolSourceForbidden(t *testing.T) {
	var mu sync.Mutex
	forbid := true
	h := newPoolHarness(t, []client.Object{pool("vllm", 8000), pod("vllm-0", "vllm", "10.0.0.1")}, func(_ *PoolConfig, b *fake.ClientBuilder) {
		b.WithInterceptorFuncs(interceptor.Funcs{
			List: func(ctx context.Context, c client.WithWatch, list client.ObjectList, opts ...client.ListOption) error {
				mu.Lock()
				f := forbid
				mu.Unlock()
				if f {
					return apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "", errors.New(`User "system:serviceaccount:llm:kvepp" cannot list resource "pods"`))
				}
				return c.List(ctx, list, opts...)
			},
		})
	})
	h.waitFor("read failures", func() bool { return h.src.Stats().ReadFailures >= 2 })
	st := h.src.Stats()
	if st.Ready || !strings.Contains(st.Problem, "RBAC forbids") || !strings.Contains(h.log.String(), "needs get, list and watch on pods") {
		t.Fatalf("stats %+v; log:\n%s", st, h.log.String())
	}
	mu.Lock()
	forbid = false
	mu.Unlock()
	if err := h.src.WaitReady(ctxTimeout(t)); err != nil {
		t.Fatalf("not ready after RBAC was fixed: %v", err)
	}
	h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.0.0.1:8000"})
}

func TestPoolSourceIDCollision(t *testing.T) {
	older := func(p *corev1.Pod) { p.CreationTimestamp = metav1.NewTime(time.Date(2025, 6, 1, 0, 0, 0, 0, time.UTC)) }
	h := newPoolHarness(t, []client.Object{
		pool("vllm", 8000), pod("vllm-a", "vllm", "10.0.0.1"), pod("vllm-b", "vllm", "10.0.0.2", older), pod("vllm-c", "vllm", "10.0.0.3"),
	}, func(c *PoolConfig, _ *fake.ClientBuilder) {
		c.WorkerID = func(name string) uint64 {
			if name == "vllm-c" {
				return 2
			}
			return 1 // vllm-a and vllm-b collide
		}
	})
	h.waitEndpoints(map[uint64]string{1: "http://10.0.0.2:8000", 2: "http://10.0.0.3:8000"})
	if st := h.src.Stats(); st.IDCollisions != 1 {
		t.Errorf("IDCollisions %d, want 1", st.IDCollisions)
	}
	if !strings.Contains(h.log.String(), `"kept_pod":"vllm-b","ignored_pod":"vllm-a"`) {
		t.Errorf("collision not logged with the kept (older) pod:\n%s", h.log.String())
	}
	// The older pod goes away: the younger one takes the id (a new incarnation).
	h.remove(pod("vllm-b", "vllm", "10.0.0.2", older))
	h.waitEndpoints(map[uint64]string{1: "http://10.0.0.1:8000", 2: "http://10.0.0.3:8000"})
}

func TestPoolSourceAnnotations(t *testing.T) {
	ann := func(kv ...string) func(*corev1.Pod) {
		return func(p *corev1.Pod) {
			p.Annotations = map[string]string{}
			for i := 0; i < len(kv); i += 2 {
				p.Annotations[kv[i]] = kv[i+1]
			}
		}
	}
	h := newPoolHarness(t, []client.Object{
		pool("vllm", 8000),
		pod("h100-0", "vllm", "10.0.0.1", ann(AnnotationTotalKVBlocks, "40000", AnnotationMaxNumBatchedTokens, "16384", AnnotationKVEventPort, "6000")),
		pod("a10-0", "vllm", "10.0.0.2", ann(AnnotationTotalKVBlocks, "lots", AnnotationKVEventPort, "70000")),
	}, func(c *PoolConfig, _ *fake.ClientBuilder) {
		c.TotalKVBlocks, c.MaxNumBatchedTokens, c.KVEventReplayPort = 5000, 4096, 5560
	})
	h.waitFor("two workers", func() bool { return len(h.endpoints()) == 2 })
	h100, _ := h.cat.Worker(id("h100-0"))
	if *h100.TotalKVBlocks != 40000 || *h100.MaxNumBatchedTokens != 16384 || h100.KVEventsEndpoints["0"] != "tcp://10.0.0.1:6000" ||
		h100.ReplayEndpoint != "tcp://10.0.0.1:5560" {
		t.Errorf("annotated pod record %+v", h100.WorkerRecord)
	}
	a10, _ := h.cat.Worker(id("a10-0"))
	if *a10.TotalKVBlocks != 5000 || *a10.MaxNumBatchedTokens != 4096 || a10.KVEventsEndpoints["0"] != "tcp://10.0.0.2:5557" {
		t.Errorf("invalid annotations not replaced by the pool-wide settings: %+v", a10.WorkerRecord)
	}
	if st := h.src.Stats(); st.InvalidAnnotations != 2 {
		t.Errorf("InvalidAnnotations %d, want 2", st.InvalidAnnotations)
	}
	if !strings.Contains(h.log.String(), AnnotationTotalKVBlocks) {
		t.Errorf("invalid annotation not logged:\n%s", h.log.String())
	}
	// An annotation edit is a record change: upserted in place.
	h.apply(pod("a10-0", "vllm", "10.0.0.2", ann(AnnotationTotalKVBlocks, "8000")))
	h.waitFor("annotation applied", func() bool { w, _ := h.cat.Worker(id("a10-0")); return *w.TotalKVBlocks == 8000 })
	if _, d := h.cat.counts(id("a10-0")); d != 0 {
		t.Errorf("annotation change re-registered the worker")
	}
}

// TestPoolSourceKVEventPortNearTheTop: with two ranks a port annotation of 65535 is refused
// (rank 1 would publish on 65536) and the pool-wide setting is used; when the setting itself
// overflows, one pool-level message names the setting, not an annotation.
func TestPoolSourceKVEventPortNearTheTop(t *testing.T) {
	h := newPoolHarness(t, []client.Object{
		pool("vllm", 8000, 8001),
		pod("annotated", "vllm", "10.0.0.1", func(p *corev1.Pod) { p.Annotations = map[string]string{AnnotationKVEventPort: "65535"} }),
	})
	h.waitFor("one worker", func() bool { return len(h.endpoints()) == 1 })
	w, _ := h.cat.Worker(id("annotated"))
	if w.KVEventsEndpoints["1"] != "tcp://10.0.0.1:5558" {
		t.Errorf("rank endpoints %v, want the pool-wide 5557 and 5558", w.KVEventsEndpoints)
	}
	if st := h.src.Stats(); st.InvalidAnnotations != 1 || !strings.Contains(h.log.String(), "would publish above port 65535") {
		t.Errorf("InvalidAnnotations %d, log:\n%s", st.InvalidAnnotations, h.log.String())
	}

	h2 := newPoolHarness(t, []client.Object{pool("vllm", 8000, 8001), pod("plain", "vllm", "10.0.0.2")},
		func(c *PoolConfig, _ *fake.ClientBuilder) { c.KVEventPort = 65535 })
	h2.waitFor("one worker", func() bool { return len(h2.endpoints()) == 1 })
	logs := h2.log.String()
	if h2.src.Stats().InvalidAnnotations != 0 || strings.Contains(logs, "invalid pod annotation") {
		t.Errorf("a pod without annotations was blamed for the setting:\n%s", logs)
	}
	if strings.Count(logs, "DYN_EPP_KV_EVENT_PORT plus the pool's rank count exceeds port 65535") != 1 {
		t.Errorf("want one message naming the setting:\n%s", logs)
	}
}

func TestPoolSourceRetry(t *testing.T) {
	t.Run("a failed apply is retried after the retry interval", func(t *testing.T) {
		h := newPoolHarness(t, nil, func(c *PoolConfig, _ *fake.ClientBuilder) { c.RetryInterval = 30 * time.Millisecond })
		h.cat.setFail(1)
		h.apply(pool("vllm", 8000))
		h.apply(pod("vllm-0", "vllm", "10.0.0.1"))
		h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.0.0.1:8000"})
		h.waitFor("the retry applied", func() bool { st := h.src.Stats(); return st.ApplyFailures >= 1 && !st.Pending && st.Ready })
		if !strings.Contains(h.log.String(), "will retry") {
			t.Errorf("failed apply not logged:\n%s", h.log.String())
		}
	})
	t.Run("a newer snapshot supersedes the pending retry", func(t *testing.T) {
		h := newPoolHarness(t, []client.Object{pool("vllm", 8000)}, func(c *PoolConfig, _ *fake.ClientBuilder) { c.RetryInterval = time.Hour })
		if err := h.src.WaitReady(ctxTimeout(t)); err != nil {
			t.Fatal(err)
		}
		h.cat.setFail(1)
		h.apply(pod("vllm-0", "vllm", "10.0.0.1"))
		h.waitFor("a pending retry", func() bool { return h.src.Stats().Pending })
		// Within the hour-long retry interval, the next event applies at once.
		h.apply(pod("vllm-1", "vllm", "10.0.0.2"))
		h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.0.0.1:8000", id("vllm-1"): "http://10.0.0.2:8000"})
		// The stats follow the catalog once the apply returns.
		h.waitFor("the pending retry dropped", func() bool { return !h.src.Stats().Pending })
	})
}

func TestPoolSourceCoexistsWithAPIWorkers(t *testing.T) {
	h := newPoolHarness(t, []client.Object{pool("vllm", 8000), pod("vllm-0", "vllm", "10.0.0.1")})
	h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.0.0.1:8000"})
	ctx := context.Background()
	bs := uint32(16)
	if _, err := h.cat.Service.UpsertWorker(ctx, picker.WorkerRecord{WorkerID: 42, ModelName: "Qwen/Qwen3-0.6B", Endpoint: "http://ray-worker:8000",
		BlockSize: &bs, KVEventsEndpoint: "tcp://ray-worker:5557"}, picker.SourceAPI); err != nil {
		t.Fatal(err)
	}
	// The API edits a discovery worker; discovery re-applies its view on the next snapshot.
	if _, err := h.cat.PatchWorker(ctx, id("vllm-0"), picker.WorkerPatch{Endpoint: ptr("http://10.9.9.9:1")}); err != nil {
		t.Fatal(err)
	}
	h.apply(pod("vllm-1", "vllm", "10.0.0.2"))
	h.waitEndpoints(map[uint64]string{id("vllm-0"): "http://10.0.0.1:8000", id("vllm-1"): "http://10.0.0.2:8000", 42: "http://ray-worker:8000"})
	// The API deletes a discovery worker whose pod is not Ready: the next snapshot registers it
	// again, still withheld from picks.
	h.apply(pod("vllm-1", "vllm", "10.0.0.2", notReady))
	h.waitFor("vllm-1 withheld", func() bool { return !h.cat.IsCandidate(id("vllm-1")) })
	if _, err := h.cat.Service.DeleteWorker(ctx, id("vllm-1")); err != nil {
		t.Fatal(err)
	}
	h.src.Trigger()
	h.waitFor("vllm-1 registered again and withheld", func() bool {
		_, registered := h.cat.Worker(id("vllm-1"))
		return registered && !h.cat.IsCandidate(id("vllm-1"))
	})
	h.remove(pod("vllm-1", "vllm", "10.0.0.2"))
	h.remove(pool("vllm", 8000))
	h.waitEndpoints(map[uint64]string{42: "http://ray-worker:8000"})
	if st, _ := h.cat.Worker(42); st.Source != picker.SourceAPI {
		t.Errorf("API worker source %q", st.Source)
	}
}

func TestNewPoolSourceValidates(t *testing.T) {
	c := fake.NewClientBuilder().WithScheme(Scheme()).Build()
	cat, _ := newCountingCatalog(t)
	ok := PoolConfig{Namespace: "ns", Name: "p", ModelName: "m", BlockSize: 16}
	for _, tc := range []struct {
		mod  func(*PoolConfig)
		want string
	}{
		{func(c *PoolConfig) { c.Name = "" }, "DYN_EPP_INFERENCE_POOL_NAME"},
		{func(c *PoolConfig) { c.Namespace = "" }, "POD_NAMESPACE"},
		{func(c *PoolConfig) { c.ModelName = "" }, "DYN_MODEL_NAME"},
		{func(c *PoolConfig) { c.BlockSize = 0 }, "DYN_KV_CACHE_BLOCK_SIZE"},
		{func(c *PoolConfig) { c.KVEventPort = 70000 }, "DYN_EPP_KV_EVENT_PORT"},
		{func(c *PoolConfig) { c.KVEventReplayPort = -1 }, "DYN_EPP_KV_EVENT_REPLAY_PORT"},
	} {
		cfg := ok
		tc.mod(&cfg)
		if _, err := NewPoolSource(cfg, c, cat); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("config %+v: error %v, want one naming %s", cfg, err, tc.want)
		}
	}
	src, err := NewPoolSource(ok, c, cat)
	if err != nil {
		t.Fatalf("valid config: %v", err)
	}
	if src.cfg.RetryInterval != 5*time.Second || src.cfg.KVEventPort != 5557 {
		t.Errorf("defaults: retry %v, KV event port %d; want 5s and 5557 (epp.md §2, §10.2)", src.cfg.RetryInterval, src.cfg.KVEventPort)
	}
}

func ctxTimeout(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}
