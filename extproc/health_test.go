package extproc_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
)

func TestHealth(t *testing.T) {
	h := extproc.NewHealth()
	srv, err := extproc.NewServer(extproc.Config{Picker: newFakePicker(), Tokenizers: &fakeTokenizers{}, Ready: h.Ready})
	if err != nil {
		t.Fatal(err)
	}
	// The same Health on the ext_proc port, as the runner does.
	conn := extproctest.Serve(t, func(g *grpc.Server) { srv.Register(g); h.Register(g) })
	hc := healthpb.NewHealthClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	check := func(t *testing.T, service string) healthpb.HealthCheckResponse_ServingStatus {
		t.Helper()
		r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		if err != nil {
			t.Fatalf("Check(%q): %v", service, err)
		}
		return r.GetStatus()
	}
	readiness := []string{"readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor", "inference-extension"}
	expect := func(t *testing.T, live, ready healthpb.HealthCheckResponse_ServingStatus) {
		t.Helper()
		if got := check(t, "liveness"); got != live {
			t.Fatalf("liveness = %v, want %v", got, live)
		}
		for _, s := range readiness {
			if got := check(t, s); got != ready {
				t.Fatalf("%q = %v, want %v", s, got, ready)
			}
		}
	}
	const serving, notServing = healthpb.HealthCheckResponse_SERVING, healthpb.HealthCheckResponse_NOT_SERVING

	t.Run("before ready only liveness is serving and requests get 503", func(t *testing.T) {
		expect(t, serving, notServing)
		ex, err := extproctest.NewClient(conn).Do(ctx, extproctest.Request{Body: []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)})
		if err != nil || ex.Immediate == nil || ex.Immediate.Status != 503 {
			t.Fatalf("err %v exchange %+v", err, ex)
		}
	})
	watch, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{Service: "readiness"})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := watch.Recv(); err != nil || r.GetStatus() != notServing {
		t.Fatalf("first watch update %v %v", r, err)
	}
	t.Run("ready makes every readiness name serving and watchers see it", func(t *testing.T) {
		h.SetReady(true)
		expect(t, serving, serving)
		if r, err := watch.Recv(); err != nil || r.GetStatus() != serving {
			t.Fatalf("watch update %v %v", r, err)
		}
	})
	t.Run("drain turns readiness off, keeps liveness and keeps serving requests", func(t *testing.T) {
		h.Drain()
		expect(t, serving, notServing)
		if !h.Draining() || !h.Ready() {
			t.Fatalf("draining %v ready %v", h.Draining(), h.Ready())
		}
		ex, err := extproctest.NewClient(conn).Do(ctx, extproctest.Request{Body: []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`), Response: okResponse()})
		if err != nil || ex.Immediate != nil || ex.Destination == "" {
			t.Fatalf("a draining EPP must still route: err %v exchange %+v", err, ex)
		}
		h.SetReady(true)
		expect(t, serving, notServing)
	})
	t.Run("an unknown service is NOT_FOUND on Check and SERVICE_UNKNOWN on Watch", func(t *testing.T) {
		if _, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "nope"}); status.Code(err) != codes.NotFound {
			t.Fatalf("Check err = %v", err)
		}
		w, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{Service: "nope"})
		if err != nil {
			t.Fatal(err)
		}
		if r, err := w.Recv(); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVICE_UNKNOWN {
			t.Fatalf("Watch = %v %v", r, err)
		}
	})
}
