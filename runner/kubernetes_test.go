package runner

import (
	"context"
	"io"
	"net"
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

// TestInferencePoolEPP runs the whole EPP against a real API server (envtest): it starts with
// no InferencePool and stays up but NOT_SERVING, becomes ready when the pool and a Ready pod
// appear, routes ext_proc traffic to the pod (with the conformance hooks on), exports the
// InferencePool metrics, and goes NOT_SERVING again when the pool is deleted.
func TestInferencePoolEPP(t *testing.T) {
	env := discoverytest.Start(t, true)
	admin, err := client.New(env.Config, client.Options{Scheme: discovery.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// The "model server": any listening port; ext_proc only names it as the destination.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port

	cfg := loopbackConfig(t)
	cfg.InferencePoolName, cfg.PodNamespace, cfg.ModelName = "qwen", "kvepp-e2e", "Qwen/Qwen3-0.6B"
	cfg.UseKVEvents = false
	cfg.ConformanceTestHooks = true
	inst, err := Start(ctx, Options{Config: cfg, Logger: testLogger(t), KubeRestConfig: env.Config})
	if err != nil {
		t.Fatalf("Start without a pool must not fail: %v", err)
	}
	t.Cleanup(func() { _ = inst.Stop(context.Background()) })

	status := healthChecker(ctx, t, inst.Addrs().Health)
	waitStatus := func(svc string, want healthpb.HealthCheckResponse_ServingStatus) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for status(svc) != want {
			if time.Now().After(deadline) {
				t.Fatalf("%q is not %v; pool %+v", svc, want, inst.Pool().Stats())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	if status("readiness") != healthpb.HealthCheckResponse_NOT_SERVING || status("liveness") != healthpb.HealthCheckResponse_SERVING {
		t.Fatal("want liveness SERVING and readiness NOT_SERVING while the pool does not exist")
	}
	select {
	case <-inst.Failed():
		t.Fatalf("the EPP failed without a pool: %v", inst.Err())
	case <-time.After(300 * time.Millisecond):
	}

	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: cfg.PodNamespace}}
	pool := &inferencev1.InferencePool{
		ObjectMeta: metav1.ObjectMeta{Name: "qwen", Namespace: cfg.PodNamespace},
		Spec: inferencev1.InferencePoolSpec{
			Selector:          inferencev1.LabelSelector{MatchLabels: map[inferencev1.LabelKey]inferencev1.LabelValue{"app": "vllm"}},
			TargetPorts:       []inferencev1.Port{{Number: inferencev1.PortNumber(port)}},
			EndpointPickerRef: &inferencev1.EndpointPickerRef{Name: "kvepp", Port: &inferencev1.Port{Number: 9002}},
		},
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "vllm-0", Namespace: cfg.PodNamespace, Labels: map[string]string{"app": "vllm"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vllm", Image: "vllm"}}},
	}
	for _, o := range []client.Object{ns, pool, pod} {
		if err := admin.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "127.0.0.1",
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}
	if err := admin.Status().Update(ctx, pod); err != nil {
		t.Fatal(err)
	}
	waitStatus("readiness", healthpb.HealthCheckResponse_SERVING)
	waitStatus("envoy.service.ext_proc.v3.ExternalProcessor", healthpb.HealthCheckResponse_SERVING)

	var workers []struct {
		WorkerID  uint64 `json:"worker_id"`
		ModelName string `json:"model_name"`
		Endpoint  string `json:"endpoint"`
	}
	// Readiness may turn on before the pod's Running status reaches the cache (a pool with no
	// registered pod is ready, epp.md §9), so wait for the pod to be registered.
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		workers = nil
		code := httpJSON(t, "GET", "http://"+inst.Addrs().Selection+"/workers", nil, &workers)
		if code == 200 && len(workers) == 1 && workers[0].WorkerID == discovery.HashPodName("vllm-0") &&
			workers[0].Endpoint == "http://127.0.0.1:"+strconv.Itoa(port) && workers[0].ModelName == cfg.ModelName {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET /workers = %d %+v", code, workers)
		}
	}

	c := extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC))
	want := "127.0.0.1:" + strconv.Itoa(port)
	ex, err := c.Do(ctx, extproctest.Request{
		Body:    []byte(`{"model":"Qwen/Qwen3-0.6B","messages":[{"role":"user","content":"hello"}]}`),
		Headers: []extproctest.Header{{Key: "test-epp-endpoint-selection", Value: "127.0.0.1"}},
		Response: &extproctest.Response{Status: 200, ContentType: "text/event-stream", ServedEndpoint: want,
			Chunks: [][]byte{[]byte("data: {\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n")}},
	})
	if err != nil || ex.Immediate != nil || ex.Destination != want {
		t.Fatalf("routing: %v immediate %+v destination %q", err, ex.Immediate, ex.Destination)
	}
	if got := ex.ResponseSetHeaders["x-conformance-test-served-endpoint"]; got != want {
		t.Errorf("x-conformance-test-served-endpoint = %q", got)
	}
	if got := ex.ResponseSetHeaders["x-conformance-test-epp-pool"]; got != "kvepp-e2e/qwen" {
		t.Errorf("x-conformance-test-epp-pool = %q", got)
	}

	metrics := scrape(t, inst.Addrs().Metrics)
	for _, line := range []string{
		`inference_pool_ready_pods{name="qwen"} 1`,
		`inference_pool_per_pod_queue_size{model_server_pod="vllm-0-rank-0",name="qwen"} 0`,
		`inference_pool_average_queue_size{name="qwen"} 0`,
		`kvepp_inference_pool_synced 1`,
		`kvepp_inference_pool_registered_pods 1`,
		`inference_objective_request_total{model_name="Qwen/Qwen3-0.6B",target_model_name="Qwen/Qwen3-0.6B"} 1`,
		`inference_extension_scheduler_attempts_total{status="success"} 1`,
	} {
		if !strings.Contains(metrics, line+"\n") {
			t.Errorf("metrics lack %q", line)
		}
	}

	if err := admin.Delete(ctx, pool); err != nil {
		t.Fatal(err)
	}
	waitStatus("readiness", healthpb.HealthCheckResponse_NOT_SERVING)
	if st := status("liveness"); st != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("liveness %v after the pool was deleted", st)
	}
}

// scrape returns the Prometheus text of the metrics port.
func scrape(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
