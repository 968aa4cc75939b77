package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/internal/binarytest"
	"github.com/kvepp/kvepp/internal/syncbuf"
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

// dumpPeer serves GET /dump with one partition "m:default" (block size 4) holding n chained
// single-block events of worker 1, written as they are generated (the body is never held whole).
func dumpPeer(t *testing.T, n int) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"m:default":{"block_size":4,"events":[`)
		for i := 1; i <= n; i++ {
			parent := "null"
			if i > 1 {
				parent = fmt.Sprint(i - 1)
			}
			sep := ","
			if i == n {
				sep = ""
			}
			if _, err := fmt.Fprintf(w, `{"worker_id":1,"storage_tier":"device","event":{"event_id":%d,"data":{"stored":{"parent_hash":%s,"blocks":[{"block_hash":%d,"tokens_hash":%d}]}},"dp_rank":0}}%s`,
				i, parent, i, i, sep); err != nil {
				return // the client gave up
			}
		}
		fmt.Fprint(w, `]}}`)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// startLogged starts the runner with cfg, its log (zerolog JSON at every level) captured in the
// returned buffer, and stops it when the test ends.
func startLogged(t *testing.T, cfg Config) (*Instance, *syncbuf.Buffer) {
	t.Helper()
	logs := &syncbuf.Buffer{}
	l := zerolog.New(logs)
	inst, err := Start(context.Background(), Options{Config: cfg, Logger: &l})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inst.Stop(context.Background()) })
	return inst, logs
}

// approxEnv is the environment of an EPP in approximate mode without a tokenizer on loopback
// ephemeral ports, plus extra.
func approxEnv(extra ...string) []string {
	return append([]string{
		"DYN_EPP_BIND_ADDRESS=127.0.0.1", "DYN_EPP_GRPC_PORT=0", "DYN_EPP_GRPC_HEALTH_PORT=0",
		"DYN_EPP_SELECTION_HTTP_PORT=0", "DYN_EPP_METRICS_PORT=0", "DYN_EPP_SECURE_SERVING=false",
		"DYN_ROUTER_USE_KV_EVENTS=false", "DYN_EPP_TOKENIZER_PROTOCOL=none", "DYN_EPP_DRAIN_TIMEOUT_SECS=0.05",
	}, extra...)
}

// TestStartupRecoveryRefusesADumpOverTheEventBound: a peer whose dump holds more events than
// DYN_EPP_RECOVERY_MAX_EVENTS is refused whole (logged, naming the setting) and the next peer is
// tried; a peer within the bound is recovered.
func TestStartupRecoveryRefusesADumpOverTheEventBound(t *testing.T) {
	big, small := dumpPeer(t, 5000), dumpPeer(t, 50)
	for _, tc := range []struct {
		name    string
		peers   []string
		events  int  // recovered events of m:default
		refusal bool // the log must name the refused peer (peers are tried in random order)
	}{
		{"the only peer is over the bound: empty index", []string{big.URL}, 0, true},
		{"the next peer within the bound is recovered", []string{big.URL, small.URL}, 50, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := LoadConfig(approxEnv("DYN_EPP_RECOVERY_MAX_EVENTS=1000", "DYN_EPP_RECOVERY_TIMEOUT_SECS=3",
				"DYN_EPP_INDEXER_PEERS="+strings.Join(tc.peers, ",")), nil, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			inst, logs := startLogged(t, cfg)
			dump := inst.Service.Dump()
			if got := len(dump["m:default"].Events); got != tc.events {
				t.Fatalf("recovered %d events, want %d; logs:\n%s", got, tc.events, logs.String())
			}
			if tc.refusal && (!strings.Contains(logs.String(), "DYN_EPP_RECOVERY_MAX_EVENTS") || !strings.Contains(logs.String(), big.URL)) {
				t.Fatalf("no log line names the refused peer and the bound:\n%s", logs.String())
			}
		})
	}
}

// TestStartupRecoverySkipsABadPartitionAndKeepsTheRest: one undecodable event (worker_id a
// string) costs only its own partition, which is reported; the other partitions are recovered.
func TestStartupRecoverySkipsABadPartitionAndKeepsTheRest(t *testing.T) {
	ev := func(h int) string {
		return fmt.Sprintf(`{"worker_id":1,"storage_tier":"device","event":{"event_id":0,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":%d,"tokens_hash":%d}]}},"dp_rank":0}}`, h, h)
	}
	longKey := strings.Repeat("x", 1000) + ":default"
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, `{"bad/model:default":{"block_size":4,"events":[%s,{"worker_id":"str"}]},"good/model:default":{"block_size":4,"events":[%s]},%q:{"block_size":4,"events":[%s]}}`,
			ev(1), ev(2), longKey, ev(3))
	}))
	defer peer.Close()
	cfg, err := LoadConfig(approxEnv("DYN_EPP_RECOVERY_TIMEOUT_SECS=3", "DYN_EPP_INDEXER_PEERS="+peer.URL), nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	inst, logs := startLogged(t, cfg)
	dump := inst.Service.Dump()
	if len(dump["good/model:default"].Events) != 1 || len(dump) != 1 {
		t.Fatalf("recovered %v, want only good/model:default; logs:\n%s", dump, logs.String())
	}
	if !strings.Contains(logs.String(), `"partition":"bad/model:default"`) {
		t.Fatalf("the skipped partition is not reported:\n%s", logs.String())
	}
	for _, line := range strings.Split(logs.String(), "\n") {
		if len(line) > 2000 {
			t.Fatalf("log line of %d bytes (unbounded value):\n%s", len(line), line)
		}
	}
}

// TestSidePortReadyAgreesWithReadinessDuringRecovery (finding 8): while startup recovers the
// index from a peer, gRPC readiness is NOT_SERVING, and so is the side port's /ready (503, ready
// false) although the workers file is applied; once startup is done both are ready.
func TestSidePortReadyAgreesWithReadinessDuringRecovery(t *testing.T) {
	asked, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		once.Do(func() { close(asked) })
		<-release
		fmt.Fprint(w, `{}`)
	}))
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	defer peer.Close()
	defer unblock() // before Close, which waits for the handler
	ports := binarytest.FreePorts(t, 1)
	path := filepath.Join(t.TempDir(), "workers.yaml")
	if err := os.WriteFile(path, []byte("- {worker_id: 1, model_name: m, endpoint: 'http://127.0.0.1:18501', block_size: 16}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(approxEnv("DYN_EPP_INDEXER_PEERS="+peer.URL, "DYN_EPP_RECOVERY_TIMEOUT_SECS=30",
		"DYN_EPP_WORKERS_FILE="+path, fmt.Sprintf("DYN_EPP_SELECTION_HTTP_PORT=%d", ports[0])), nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan *Instance, 1)
	go func() {
		inst, err := Start(context.Background(), Options{Config: cfg, Logger: testLogger(t)})
		if err != nil {
			t.Error(err)
		}
		started <- inst
	}()
	var inst *Instance
	t.Cleanup(func() { // also when an assertion below fails while Start still waits on the peer
		unblock()
		if inst == nil {
			inst = <-started
		}
		if inst != nil {
			_ = inst.Stop(context.Background())
		}
	})
	select {
	case <-asked:
	case <-time.After(30 * time.Second):
		t.Fatal("recovery never asked the peer")
	}
	url := fmt.Sprintf("http://127.0.0.1:%d/ready", ports[0])
	var r struct {
		Ready              bool `json:"ready"`
		SchedulableWorkers int  `json:"schedulable_workers"`
	}
	if code := httpJSON(t, http.MethodGet, url, nil, &r); code != http.StatusServiceUnavailable || r.Ready {
		t.Fatalf("GET /ready during recovery = %d %+v, want 503 ready false", code, r)
	}
	unblock()
	if inst = <-started; inst == nil {
		t.FailNow()
	}
	if code := httpJSON(t, http.MethodGet, url, nil, &r); code != http.StatusOK || !r.Ready || r.SchedulableWorkers != 1 {
		t.Fatalf("GET /ready after startup = %d %+v", code, r)
	}
}
