package runner

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	inferencev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/picker/discovery"
	"github.com/kvepp/kvepp/picker/discovery/discoverytest"
)

// kubeSidePort is an InferencePool EPP on a real API server (envtest) whose pool has two target
// ports (dp_rank r on targetPorts[r]) and one pod at 127.0.0.1.
type kubeSidePort struct {
	inst   *Instance
	admin  client.Client
	pod    *corev1.Pod
	ports  [2]int
	id     uint64
	client *extproctest.Client
	ctx    context.Context
}

func startKubeSidePort(t *testing.T) *kubeSidePort {
	env := discoverytest.Start(t, true)
	admin, err := client.New(env.Config, client.Options{Scheme: discovery.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(cancel)
	k := &kubeSidePort{admin: admin, ctx: ctx, ports: [2]int{18601, 18602}, id: discovery.HashPodName("vllm-0")}
	cfg := loopbackConfig(t)
	cfg.InferencePoolName, cfg.PodNamespace, cfg.ModelName = "qwen", "kvepp-sideport", e2eModel
	cfg.UseKVEvents = false
	k.inst, err = Start(ctx, Options{Config: cfg, Logger: testLogger(t), KubeRestConfig: env.Config})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k.inst.Stop(context.Background()) })
	pool := &inferencev1.InferencePool{
		ObjectMeta: metav1.ObjectMeta{Name: "qwen", Namespace: cfg.PodNamespace},
		Spec: inferencev1.InferencePoolSpec{
			Selector: inferencev1.LabelSelector{MatchLabels: map[inferencev1.LabelKey]inferencev1.LabelValue{"app": "vllm"}},
			TargetPorts: []inferencev1.Port{{Number: inferencev1.PortNumber(k.ports[0])},
				{Number: inferencev1.PortNumber(k.ports[1])}},
			EndpointPickerRef: &inferencev1.EndpointPickerRef{Name: "kvepp", Port: &inferencev1.Port{Number: 9002}},
		},
	}
	k.pod = &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "vllm-0", Namespace: cfg.PodNamespace, Labels: map[string]string{"app": "vllm"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vllm", Image: "vllm"}}},
	}
	for _, o := range []client.Object{&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: cfg.PodNamespace}}, pool, k.pod} {
		if err := admin.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	k.setPodReady(t, true)
	status := healthChecker(ctx, t, k.inst.Addrs().Health)
	k.waitFor(t, "readiness SERVING", func() bool { return status("readiness") == healthpb.HealthCheckResponse_SERVING })
	// Readiness means the pool was read; the pod's own Ready condition may arrive in a later
	// snapshot: wait until it is a schedulable candidate.
	k.waitFor(t, "the pod a schedulable candidate", func() bool {
		st, ok := k.inst.Service.Worker(k.id)
		return ok && st.Lifecycle == "schedulable" && st.Candidate
	})
	k.client = extproctest.NewClient(dialPlain(t, k.inst.Addrs().GRPC))
	return k
}

// setPodReady sets the pod Running at 127.0.0.1 with its Ready condition.
func (k *kubeSidePort) setPodReady(t *testing.T, ready bool) {
	t.Helper()
	cond := corev1.ConditionFalse
	if ready {
		cond = corev1.ConditionTrue
	}
	k.pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "127.0.0.1",
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: cond}}}
	if err := k.admin.Status().Update(k.ctx, k.pod); err != nil {
		t.Fatal(err)
	}
}

func (k *kubeSidePort) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s; pool %+v", what, k.inst.Pool().Stats())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (k *kubeSidePort) url(path string) string { return "http://" + k.inst.Addrs().Selection + path }

// routedRanks plays chats through ext_proc until both ranks were picked and returns the
// destination of each rank (x-dynamo-dp-rank).
func (k *kubeSidePort) routedRanks(t *testing.T) map[string]string {
	t.Helper()
	dest := map[string]string{}
	for i := 0; i < 60 && len(dest) < 2; i++ {
		ex, err := k.client.Do(k.ctx, extproctest.Request{
			Body:     []byte(fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hello %d"}]}`, e2eModel, i)),
			Response: &extproctest.Response{Chunks: [][]byte{[]byte(`{}`)}}})
		if err != nil || ex.Immediate != nil {
			t.Fatalf("routing: %v %+v", err, ex.Immediate)
		}
		dest[ex.SetHeaders["x-dynamo-dp-rank"]] = ex.Destination
	}
	return dest
}

// reservedEndpoint books rank dpRank over POST /reservations, frees it, and returns the endpoint
// the answer names.
func (k *kubeSidePort) reservedEndpoint(t *testing.T, dpRank int) string {
	t.Helper()
	var out struct {
		Endpoint string `json:"endpoint"`
		DPRank   int    `json:"dp_rank"`
	}
	id := fmt.Sprintf("sideport-%d-%d", dpRank, time.Now().UnixNano())
	if st := httpJSON(t, http.MethodPost, k.url("/reservations"), map[string]any{"model_name": e2eModel, "selection_id": id,
		"worker_id": k.id, "dp_rank": dpRank, "token_ids": []int{1, 2, 3}}, &out); st != http.StatusCreated || out.DPRank != dpRank {
		t.Fatalf("POST /reservations dp_rank %d: %d %+v", dpRank, st, out)
	}
	if st := httpJSON(t, http.MethodDelete, k.url("/reservations/"+id), nil, nil); st != http.StatusOK {
		t.Fatalf("DELETE /reservations/%s: %d", id, st)
	}
	return out.Endpoint
}

// TestInferencePoolSidePortAgreesWithExtProc: the selection API over the same core answers
// what ext_proc routes — rank r of a discovered pod at targetPorts[r] (finding 4), and, after the
// HTTP API rewrites the worker, the API's endpoint on both sides (finding 5).
func TestInferencePoolSidePortAgreesWithExtProc(t *testing.T) {
	k := startKubeSidePort(t)
	rankURL := func(r int) string { return "http://127.0.0.1:" + strconv.Itoa(k.ports[r]) }

	t.Run("rank r is served on targetPorts[r] on both sides", func(t *testing.T) {
		if got := k.routedRanks(t); got["0"] != "127.0.0.1:18601" || got["1"] != "127.0.0.1:18602" {
			t.Fatalf("ext_proc destinations by rank %v", got)
		}
		for r := 0; r < 2; r++ {
			if got := k.reservedEndpoint(t, r); got != rankURL(r) {
				t.Errorf("POST /reservations dp_rank %d answered endpoint %q, want %q", r, got, rankURL(r))
			}
		}
		var sel struct {
			DPRank   int    `json:"dp_rank"`
			Endpoint string `json:"endpoint"`
		}
		for i := 0; i < 40; i++ {
			if st := httpJSON(t, http.MethodPost, k.url("/select"), map[string]any{"model_name": e2eModel, "token_ids": []int{i + 1, 2, 3}}, &sel); st != 200 {
				t.Fatalf("POST /select: %d", st)
			}
			if sel.Endpoint != rankURL(sel.DPRank) {
				t.Fatalf("POST /select answered dp_rank %d at %q, want %q", sel.DPRank, sel.Endpoint, rankURL(sel.DPRank))
			}
		}
		var workers []map[string]any
		if st := httpJSON(t, http.MethodGet, k.url("/workers"), nil, &workers); st != 200 || len(workers) != 1 ||
			fmt.Sprint(workers[0]["dp_rank_endpoints"]) != fmt.Sprintf("map[0:%s 1:%s]", rankURL(0), rankURL(1)) {
			t.Fatalf("GET /workers = %d %v, want dp_rank_endpoints naming both target ports", st, workers)
		}
	})

	t.Run("an endpoint rewritten over the HTTP API is used by ext_proc too", func(t *testing.T) {
		if st := httpJSON(t, http.MethodPatch, k.url("/workers/"+strconv.FormatUint(k.id, 10)),
			map[string]any{"endpoint": "http://127.0.0.2:18699"}, nil); st != http.StatusOK {
			t.Fatalf("PATCH: %d", st)
		}
		if got := k.routedRanks(t); got["0"] != "127.0.0.2:18699" || got["1"] != "127.0.0.2:18699" {
			t.Fatalf("ext_proc destinations by rank after the PATCH: %v", got)
		}
		if got := k.reservedEndpoint(t, 1); got != "http://127.0.0.2:18699" {
			t.Fatalf("POST /reservations dp_rank 1 after the PATCH: %q", got)
		}
	})
}

// TestInferencePoolSidePortShowsPodReadiness (finding 8): a pod that is not Ready is registered
// but not a candidate; the side port says so (candidate false in /workers), counts only
// candidates in schedulable_workers and kvepp_ready_workers, and /ready answers 503 like the
// routing path, until the pod is Ready again.
func TestInferencePoolSidePortShowsPodReadiness(t *testing.T) {
	k := startKubeSidePort(t)
	type ready struct {
		Ready              bool `json:"ready"`
		SchedulableWorkers int  `json:"schedulable_workers"`
		Workers            []struct {
			Lifecycle string `json:"lifecycle"`
			Candidate *bool  `json:"candidate"`
		} `json:"workers"`
	}
	check := func(t *testing.T, candidate bool) {
		t.Helper()
		var r ready
		code := httpJSON(t, http.MethodGet, k.url("/ready"), nil, &r)
		n, wantCode := 0, http.StatusServiceUnavailable
		if candidate {
			n, wantCode = 1, http.StatusOK
		}
		if code != wantCode || r.Ready != candidate || r.SchedulableWorkers != n || len(r.Workers) != 1 ||
			r.Workers[0].Lifecycle != "schedulable" || r.Workers[0].Candidate == nil || *r.Workers[0].Candidate != candidate {
			t.Fatalf("GET /ready = %d %+v, want %d with %d schedulable workers and candidate %t", code, r, wantCode, n, candidate)
		}
		var workers []map[string]any
		if httpJSON(t, http.MethodGet, k.url("/workers"), nil, &workers); len(workers) != 1 || workers[0]["candidate"] != candidate {
			t.Fatalf("GET /workers = %v, want candidate %t", workers, candidate)
		}
		if m := scrape(t, k.inst.Addrs().Metrics); !strings.Contains(m, fmt.Sprintf("kvepp_ready_workers %d\n", n)) {
			t.Fatalf("metrics lack kvepp_ready_workers %d", n)
		}
	}
	check(t, true)
	k.setPodReady(t, false)
	k.waitFor(t, "the pod withheld", func() bool { return !k.inst.Service.IsCandidate(k.id) })
	check(t, false)
	ex, err := k.client.Do(k.ctx, extproctest.Request{Body: []byte(`{"model":"` + e2eModel + `","messages":[{"role":"user","content":"x"}]}`)})
	if err != nil || ex.Immediate == nil || ex.Immediate.Status != http.StatusServiceUnavailable {
		t.Fatalf("ext_proc with no Ready pod: %v %+v, want 503", err, ex.Immediate)
	}
	k.setPodReady(t, true)
	k.waitFor(t, "the pod a candidate again", func() bool { return k.inst.Service.IsCandidate(k.id) })
	check(t, true)
}
