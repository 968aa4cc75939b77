package runner

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
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
		{"replica sync port 0", nil, []string{"--replica-sync-port", "0"}, "--replica-sync-port must be in 1..65535, got 0"},
		{"replica peers without a port", nil, []string{"--replica-sync-peers", "tcp://a:9092"}, "--replica-sync-peers requires --replica-sync-port"},
		{"an invalid replica peer", nil, []string{"--replica-sync-port", "9092", "--replica-sync-peers", "a:9092"}, `--replica-sync-peers: invalid endpoint "a:9092"`},
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

// TestSelectServiceReplicaSync runs two select-services with --replica-sync-port and
// --replica-sync-peers pointing at each other: a booking on one shows on the other's /loads.
func TestSelectServiceReplicaSync(t *testing.T) {
	ports := freePorts(t, 2)
	type svc struct {
		base string
		done chan error
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := func(own, peer int) svc {
		addrCh := make(chan string, 1)
		s := svc{done: make(chan error, 1)}
		go func() {
			s.done <- runSelectService(ctx, nil, []string{"DYN_EPP_BIND_ADDRESS=127.0.0.1", "DYN_ROUTER_USE_KV_EVENTS=false"},
				[]string{"--port", "0", "--replica-sync-port", strconv.Itoa(own), "--replica-sync-peers", fmt.Sprintf("tcp://127.0.0.1:%d", peer)},
				io.Discard, testLogger(t), func(addr string, _ *picker.Service) { addrCh <- addr })
		}()
		select {
		case addr := <-addrCh:
			s.base = "http://" + addr
		case err := <-s.done:
			t.Fatalf("select-service exited: %v", err)
		case <-time.After(20 * time.Second):
			t.Fatal("select-service did not start")
		}
		return s
	}
	a, b := start(ports[0], ports[1]), start(ports[1], ports[0])
	for _, s := range []svc{a, b} {
		if st := httpJSON(t, http.MethodPost, s.base+"/workers", map[string]any{"worker_id": 7, "model_name": "m", "endpoint": "http://w:8000", "block_size": 4}, nil); st != http.StatusCreated {
			t.Fatalf("POST /workers: %d", st)
		}
		var peers []string
		httpJSON(t, http.MethodGet, s.base+"/replica_sync/peers", nil, &peers)
		if len(peers) != 1 {
			t.Fatalf("peers %v", peers)
		}
	}
	end := time.Now().Add(20 * time.Second)
	for i := 0; ; i++ {
		id := "r" + strconv.Itoa(i)
		if st := httpJSON(t, http.MethodPost, a.base+"/select_and_reserve", map[string]any{"model_name": "m", "selection_id": id, "token_ids": []uint32{1, 2, 3, 4}}, nil); st != http.StatusOK {
			t.Fatalf("select_and_reserve: %d", st)
		}
		seen := false
		for wait := time.Now().Add(200 * time.Millisecond); !seen && time.Now().Before(wait); time.Sleep(5 * time.Millisecond) {
			var pl partitionLoads
			httpJSON(t, http.MethodGet, b.base+"/loads", nil, &pl)
			seen = len(pl) == 1 && len(pl[0].Loads) == 1 && pl[0].Loads[0].ActiveRequests > 0
		}
		if seen {
			break
		}
		if time.Now().After(end) {
			t.Fatal("a's booking never reached b")
		}
	}
	cancel()
	for _, s := range []svc{a, b} {
		if err := <-s.done; err != nil {
			t.Fatal(err)
		}
	}
}

// freePorts returns n TCP ports that were free a moment ago.
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	var out []int
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, ln.Addr().(*net.TCPAddr).Port)
		defer ln.Close()
	}
	return out
}
