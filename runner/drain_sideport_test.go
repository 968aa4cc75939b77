package runner

import (
	"context"
	"net/http"
	"testing"
	"time"
)

// TestSidePortReflectsTheDrain checks the wiring of httpapi.Options.Draining: once Stop starts the
// drain (gRPC readiness NOT_SERVING), the selection side port answers /ready and selecting or
// mutating calls with 503 while reads keep working (selection-service.md §2, epp.md §9).
func TestSidePortReflectsTheDrain(t *testing.T) {
	cfg := loopbackConfig(t)
	cfg.UseKVEvents = false
	cfg.DrainTimeout = Seconds(time.Minute) // cut short by cancelling Stop's context
	inst := startInstance(t, cfg)
	base := "http://" + inst.Addrs().Selection
	worker := map[string]any{"worker_id": 7, "model_name": "m", "endpoint": "http://w:8000", "block_size": 4}
	if st := httpJSON(t, http.MethodPost, base+"/workers", worker, nil); st != http.StatusCreated {
		t.Fatalf("POST /workers before the drain = %d", st)
	}
	if st := httpJSON(t, http.MethodGet, base+"/ready", nil, nil); st != http.StatusOK {
		t.Fatalf("GET /ready before the drain = %d", st)
	}

	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- inst.Stop(ctx) }()
	deadline := time.Now().Add(5 * time.Second)
	for !inst.Health.Draining() {
		if time.Now().After(deadline) {
			t.Fatal("Stop did not start the drain")
		}
		time.Sleep(5 * time.Millisecond)
	}

	sel := map[string]any{"model_name": "m", "token_ids": []int{1, 2, 3, 4}}
	for _, c := range []struct {
		method, path string
		body         any
		want         int
	}{
		{http.MethodGet, "/ready", nil, http.StatusServiceUnavailable},
		{http.MethodPost, "/select", sel, http.StatusServiceUnavailable},
		{http.MethodPost, "/select_and_reserve", sel, http.StatusServiceUnavailable},
		{http.MethodPost, "/workers", worker, http.StatusServiceUnavailable},
		{http.MethodGet, "/workers", nil, http.StatusOK},
		{http.MethodGet, "/loads", nil, http.StatusOK},
		{http.MethodGet, "/health", nil, http.StatusOK},
	} {
		if st := httpJSON(t, c.method, base+c.path, c.body, nil); st != c.want {
			t.Errorf("%s %s during the drain = %d, want %d", c.method, c.path, st, c.want)
		}
	}
	cancel()
	if err := <-stopped; err != nil {
		t.Fatalf("Stop: %v", err)
	}
}
