package runner

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/internal/zmqtcp/zmqtcptest"
)

// TestAHostileKVEventPublisherIsCountedAndTheEPPStaysUp registers a worker whose KV-event
// endpoint declares a 1 TiB ZMTP frame (the input that made zmq4 abort the process): the EPP keeps
// serving and kvepp_zmq_oversized_frames_total counts the refused frames.
func TestAHostileKVEventPublisherIsCountedAndTheEPPStaysUp(t *testing.T) {
	hostile := zmqtcptest.ServeOversized(t, 1<<40)
	path := filepath.Join(t.TempDir(), "workers.yaml")
	doc := "- worker_id: 1\n  endpoint: http://127.0.0.1:8001\n  block_size: 16\n  kv_events_endpoint: tcp://" + hostile + "\n"
	if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := loopbackConfig(t)
	cfg.WorkersFile = path
	inst := startInstance(t, cfg)
	deadline := time.Now().Add(20 * time.Second)
	for {
		m := scrape(t, inst.Addrs().Metrics)
		if i := strings.Index(m, "\nkvepp_zmq_oversized_frames_total "); i >= 0 && !strings.HasPrefix(m[i:], "\nkvepp_zmq_oversized_frames_total 0\n") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("kvepp_zmq_oversized_frames_total never rose above 0:\n%s", m)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
