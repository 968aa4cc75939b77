package runner

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/picker"
)

func TestSelectServiceServesTheHTTPAPIAndStops(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	addrCh := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- runSelectService(ctx, nil,
			[]string{"DYN_EPP_BIND_ADDRESS=127.0.0.1", "DYN_ROUTER_USE_KV_EVENTS=false"},
			[]string{"--port", "0", "--threads", "2"}, io.Discard, testLogger(t),
			func(addr string, _ *picker.Service) { addrCh <- addr })
	}()
	var base string
	select {
	case addr := <-addrCh:
		base = "http://" + addr
	case err := <-done:
		t.Fatalf("select-service exited: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("select-service did not start")
	}
	if st := httpJSON(t, http.MethodGet, base+"/ready", nil, nil); st != http.StatusServiceUnavailable {
		t.Fatalf("/ready without workers: %d, want 503", st)
	}
	if st := httpJSON(t, http.MethodPost, base+"/workers", map[string]any{"worker_id": 7, "model_name": "m", "endpoint": "http://w:8000", "block_size": 4}, nil); st != http.StatusCreated {
		t.Fatalf("POST /workers: %d", st)
	}
	var sel struct {
		WorkerID uint64 `json:"worker_id"`
	}
	if st := httpJSON(t, http.MethodPost, base+"/select", map[string]any{"model_name": "m", "token_ids": []uint32{1, 2, 3, 4}}, &sel); st != http.StatusOK || sel.WorkerID != 7 {
		t.Fatalf("POST /select: %d %+v", st, sel)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("select-service returned %v after a clean shutdown", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("select-service did not stop")
	}
}

func TestSelectServiceRejectsBadSettings(t *testing.T) {
	tests := []struct {
		name    string
		env     []string
		args    []string
		wantErr string
	}{
		{"a negative temperature in the environment", []string{"DYN_ROUTER_TEMPERATURE=-1"}, nil, `invalid DYN_ROUTER_TEMPERATURE "-1"`},
		{"zero threads", nil, []string{"--threads", "0"}, "--threads must be >= 1"},
		{"an unknown flag", nil, []string{"--grpc-port", "1"}, "flag provided but not defined: -grpc-port"},
		{"a positional argument", nil, []string{"extra"}, `unexpected argument "extra"`},
		{"an unknown policy instance", []string{"DYN_ROUTER_WORKER_SELECTION_POLICY=nope"}, nil, `invalid DYN_ROUTER_WORKER_SELECTION_POLICY "nope"`},
		{"an unknown queue policy", []string{"DYN_ROUTER_QUEUE_POLICY=sjf"}, nil, `invalid DYN_ROUTER_QUEUE_POLICY "sjf": must be fcfs, lcfs or wspt`},
		{"lru with KV events", []string{"DYN_ROUTER_APPROXIMATE_CACHE_POLICY=lru"}, nil, `invalid DYN_ROUTER_APPROXIMATE_CACHE_POLICY "lru": lru is not allowed with DYN_ROUTER_USE_KV_EVENTS=true`},
	}
	for _, tc := range tests {
		t.Run("select-service fails on "+tc.name, func(t *testing.T) {
			err := runSelectService(context.Background(), nil, tc.env, tc.args, io.Discard, testLogger(t), nil)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error = %v, want it to contain %q", err, tc.wantErr)
			}
		})
	}
}
