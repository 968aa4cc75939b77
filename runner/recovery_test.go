package runner

import (
	"encoding/json"
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

// TestDumpRecoveryKeepsHostilePartitionsApart registers workers under names that could make two
// partitions share a /dump key ("<model_name>:<routing_group>"), books a different prompt in each
// on one EPP, recovers a second EPP from it with DYN_EPP_INDEXER_PEERS, and requires
// /overlap_scores to answer identically on both for every partition and prompt. A registration
// the API refuses (a routing group with ':') must be a 400 naming the rule.
func TestDumpRecoveryKeepsHostilePartitionsApart(t *testing.T) {
	partitions := []struct{ model, group string }{
		{"a:b", "c"}, {"a", "b:c"}, {"llama3:8b", "default"}, {"x:", "default"}, {":", "g"},
		{"модель ü", "grp one"}, {"a/b%3A", "default"},
	}
	approx := func() Config {
		cfg := loopbackConfig(t)
		cfg.UseKVEvents = false
		cfg.TokenizerDir, cfg.TokenizerProtocol = "", TokenizerProtocolNone
		return cfg
	}
	register := func(selection string) (accepted []int) {
		for i, p := range partitions {
			var out map[string]any
			st := httpJSON(t, http.MethodPost, "http://"+selection+"/workers", map[string]any{
				"worker_id": 44 + i, "model_name": p.model, "routing_group": p.group,
				"endpoint": fmt.Sprintf("http://127.0.0.1:%d", 18200+i), "block_size": 4,
			}, &out)
			switch {
			case st == http.StatusCreated:
				accepted = append(accepted, i)
			case st == http.StatusBadRequest && strings.Contains(fmt.Sprint(out["error"]), "must not contain ':'"):
			default:
				t.Fatalf("POST /workers %+v = %d %v", p, st, out)
			}
		}
		return accepted
	}
	prompt := func(i int) []uint32 {
		return []uint32{uint32(100*i + 1), uint32(100*i + 2), uint32(100*i + 3), uint32(100*i + 4), uint32(100*i + 5), 6, 7, 8}
	}
	first := startInstance(t, approx())
	accepted := register(first.Addrs().Selection)
	if len(accepted) < len(partitions)-1 {
		t.Fatalf("only partitions %v were accepted", accepted)
	}
	for _, i := range accepted {
		p := partitions[i]
		if st := httpJSON(t, http.MethodPost, "http://"+first.Addrs().Selection+"/select_and_reserve",
			map[string]any{"model_name": p.model, "routing_group": p.group, "token_ids": prompt(i)}, nil); st != http.StatusOK {
			t.Fatalf("booking in %+v: %d", p, st)
		}
	}

	cfg := approx()
	cfg.IndexerPeers = []string{"http://" + first.Addrs().Selection}
	cfg.RecoveryTimeout = Seconds(10 * time.Second)
	second := startInstance(t, cfg)
	if got := register(second.Addrs().Selection); fmt.Sprint(got) != fmt.Sprint(accepted) {
		t.Fatalf("the second EPP accepted partitions %v, the first %v", got, accepted)
	}
	overlap := func(selection string, part, q int) string {
		var out any
		p := partitions[part]
		st := httpJSON(t, http.MethodPost, "http://"+selection+"/overlap_scores",
			map[string]any{"model_name": p.model, "routing_group": p.group, "token_ids": prompt(q)}, &out)
		if st != http.StatusOK {
			t.Fatalf("POST /overlap_scores in %+v: %d %v", p, st, out)
		}
		b, _ := json.Marshal(out)
		return string(b)
	}
	for _, part := range accepted {
		for _, q := range accepted {
			want, got := overlap(first.Addrs().Selection, part, q), overlap(second.Addrs().Selection, part, q)
			if got != want {
				t.Errorf("partition %+v, prompt of %+v: recovered overlap %s, original %s", partitions[part], partitions[q], got, want)
			}
			if part == q && !strings.Contains(want, `"device_blocks":2`) {
				t.Errorf("partition %+v does not hold its own booking: %s", partitions[part], want)
			}
		}
	}
}
