package runner

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestStartupRecoveryFromAPeerDump(t *testing.T) {
	const k = 6
	f := newE2EFixture(t, k, nil)
	broken := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "not ready", http.StatusServiceUnavailable)
	}))
	defer broken.Close()

	// A second EPP on the same pool, without the published history: only recovery from the first
	// EPP's side port (GET /dump) can teach it worker 2's and worker 3's blocks. Its workers file
	// names the same publishers, which are silent now; an unready peer is tried too.
	cfg := loopbackConfig(t)
	cfg.WorkersFile = f.inst.cfg.WorkersFile
	cfg.IndexerPeers = []string{broken.URL, "http://" + f.inst.Addrs().Selection + "/"}
	cfg.RecoveryTimeout = Seconds(10 * time.Second)
	second := startInstance(t, cfg)
	tokens := f.golden.TokenIDs
	want := map[uint64]int{1: 0, 2: k, 3: k - 1}
	if got := deviceOverlap(t, second.Addrs().Selection, e2eModel, tokens); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("recovered device blocks %v, want %v", got, want)
	}
}

func TestStartupRecoveryGivesUpAfterTheTimeout(t *testing.T) {
	cfg := loopbackConfig(t)
	cfg.IndexerPeers = []string{"http://127.0.0.1:1"}
	cfg.RecoveryTimeout = Seconds(500 * time.Millisecond)
	start := time.Now()
	inst := startInstance(t, cfg)
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("startup took %v with a 500 ms recovery timeout", took)
	}
	if len(inst.Service.Dump()) != 0 {
		t.Fatal("index not empty after a failed recovery")
	}
}

func TestIndexerPeersMustBeURLs(t *testing.T) {
	cfg := loopbackConfig(t)
	cfg.IndexerPeers = []string{"peer-1:8092"}
	err := cfg.Validate()
	if err == nil || !strings.Contains(err.Error(), `invalid DYN_EPP_INDEXER_PEERS "peer-1:8092"`) {
		t.Fatalf("error = %v", err)
	}
}
