package runner

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/internal/syncbuf"
	"github.com/kvepp/kvepp/picker"
)

func TestStartRejectsBadSetupNamingTheSetting(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	busyPort := busy.Addr().(*net.TCPAddr).Port

	dir := t.TempDir()
	badWorkers := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(badWorkers, []byte("- endpoint: http://a:1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	badPolicy := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(badPolicy, []byte("worker_selection:\n  default: missing\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name    string
		tweak   func(*Config)
		wantErr string
	}{
		{"a missing workers file", func(c *Config) { c.WorkersFile = filepath.Join(dir, "nope.yaml") }, `invalid DYN_EPP_WORKERS_FILE`},
		{"a workers file with a record lacking worker_id", func(c *Config) { c.WorkersFile = badWorkers }, `worker_id is required`},
		{"an ext_proc port already in use", func(c *Config) { c.GRPCPort = busyPort }, `listen on DYN_EPP_GRPC_PORT ` + strconv.Itoa(busyPort)},
		{"a metrics port already in use", func(c *Config) { c.MetricsPort = busyPort }, `listen on DYN_EPP_METRICS_PORT`},
		{"a policy file naming an unknown instance", func(c *Config) { c.PolicyConfig = badPolicy }, `DYN_ROUTER_POLICY_CONFIG`},
		{"a missing policy file", func(c *Config) { c.PolicyConfig = filepath.Join(dir, "none.yaml") }, `DYN_ROUTER_POLICY_CONFIG`},
		{"an unknown policy instance name", func(c *Config) { c.WorkerSelectionPolicy = "no-such-policy" }, `DYN_ROUTER_WORKER_SELECTION_POLICY`},
		{"a tokenizer directory without tokenizer.json", func(c *Config) { c.TokenizerDir = dir }, `invalid DYN_EPP_TOKENIZER_DIR`},
		{"an invalid setting", func(c *Config) { c.BlockSize = 0 }, `invalid DYN_KV_CACHE_BLOCK_SIZE "0": must be > 0`},
		{"an unknown queue policy", func(c *Config) { c.QueuePolicy = "priority" }, `invalid DYN_ROUTER_QUEUE_POLICY "priority": must be fcfs, lcfs or wspt`},
		{"a negative overlap refresh", func(c *Config) { c.OverlapRefreshAfter = Seconds(-time.Second) }, `invalid DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS "-1": must be >= 0`},
	}
	for _, tc := range tests {
		t.Run("startup fails on "+tc.name, func(t *testing.T) {
			cfg := loopbackConfig(t)
			tc.tweak(&cfg)
			inst, err := Start(context.Background(), Options{Config: cfg, Logger: testLogger(t)})
			if err == nil {
				_ = inst.Stop(context.Background())
				t.Fatal("Start succeeded")
			}
			if !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error = %v, want it to contain %q", err, tc.wantErr)
			}
		})
	}
}

// TestTheNoTokenizerWarningComesOnlyWithAStartedEPP: the DYN_EPP_TOKENIZER_PROTOCOL=none warning
// appears once the EPP is up, never ahead of an unrelated startup error.
func TestTheNoTokenizerWarningComesOnlyWithAStartedEPP(t *testing.T) {
	noTokenizer := func(c *Config) {
		c.UseKVEvents = false
		c.TokenizerDir, c.TokenizerProtocol = "", TokenizerProtocolNone
	}
	start := func(tweak func(*Config)) (string, error) {
		var logs syncbuf.Buffer
		l := zerolog.New(&logs)
		cfg := loopbackConfig(t)
		noTokenizer(&cfg)
		tweak(&cfg)
		inst, err := Start(context.Background(), Options{Config: cfg, Logger: &l})
		if inst != nil {
			_ = inst.Stop(context.Background())
		}
		return logs.String(), err
	}
	if logs, err := start(func(c *Config) { c.WorkersFile = filepath.Join(t.TempDir(), "missing.yaml") }); err == nil ||
		strings.Contains(logs, "DYN_EPP_TOKENIZER_PROTOCOL=none") {
		t.Fatalf("a failed start (%v) logged the tokenizer warning:\n%s", err, logs)
	}
	if logs, err := start(func(*Config) {}); err != nil || !strings.Contains(logs, "DYN_EPP_TOKENIZER_PROTOCOL=none") {
		t.Fatalf("a started EPP (%v) did not warn about DYN_EPP_TOKENIZER_PROTOCOL=none:\n%s", err, logs)
	}
}

func TestFailedStartReleasesItsPorts(t *testing.T) {
	// Reserve a free port, then fail a start that binds it before failing later (missing workers
	// file): the port must be free again.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	cfg := loopbackConfig(t)
	cfg.SelectionHTTPPort = port
	cfg.WorkersFile = filepath.Join(t.TempDir(), "missing.yaml")
	if _, err := Start(context.Background(), Options{Config: cfg, Logger: testLogger(t)}); err == nil {
		t.Fatal("Start succeeded")
	}
	ln, err = net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		t.Fatalf("port %d still bound after a failed start: %v", port, err)
	}
	ln.Close()
}

func TestWorkersFileChangesReachTheRunningEPP(t *testing.T) {
	path := filepath.Join(t.TempDir(), "workers.yaml")
	write := func(s string) {
		if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// Approximate mode: no KV-event endpoints needed.
	write("- worker_id: 1\n  endpoint: http://127.0.0.1:18101\n")
	cfg := loopbackConfig(t)
	cfg.UseKVEvents = false
	cfg.WorkersFile = path
	cfg.ModelName = e2eModel
	inst := startInstance(t, cfg)
	sel := "http://" + inst.Addrs().Selection

	var ready struct {
		Ready   bool `json:"ready"`
		Workers []struct {
			WorkerID  uint64  `json:"worker_id"`
			ModelName string  `json:"model_name"`
			BlockSize *uint32 `json:"block_size"`
			Lifecycle string  `json:"lifecycle"`
		} `json:"workers"`
	}
	if st := httpJSON(t, http.MethodGet, sel+"/ready", nil, &ready); st != http.StatusOK || !ready.Ready {
		t.Fatalf("/ready %d %+v", st, ready)
	}
	w := ready.Workers[0]
	if w.ModelName != e2eModel || w.BlockSize == nil || *w.BlockSize != 16 || w.Lifecycle != "schedulable" {
		t.Fatalf("worker from the file: %+v (want model %s from DYN_MODEL_NAME, block_size 16)", w, e2eModel)
	}

	conn := dialPlain(t, inst.Addrs().GRPC)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	route := func() string {
		ex, err := extproctest.NewClient(conn).Do(ctx, extproctest.Request{
			Path:     "/v1/chat/completions",
			Body:     []byte(`{"model":"Qwen/Qwen3-0.6B","messages":[{"role":"user","content":"hello there"}]}`),
			Response: &extproctest.Response{Status: 200, Chunks: [][]byte{[]byte(`{"choices":[]}`)}},
		})
		if err != nil {
			t.Fatal(err)
		}
		if ex.Immediate != nil {
			return "immediate " + strconv.Itoa(ex.Immediate.Status)
		}
		return ex.Destination
	}
	if got := route(); got != "127.0.0.1:18101" {
		t.Fatalf("routed to %q", got)
	}

	// Replace worker 1 by worker 2: traffic follows the file.
	write("- worker_id: 2\n  endpoint: http://127.0.0.1:18102\n")
	deadline := time.Now().Add(5 * time.Second)
	for {
		got := route()
		if got == "127.0.0.1:18102" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("still routed to %q after the workers file changed", got)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestSessionAffinitySettingPinsASessionToOneWorker(t *testing.T) {
	for _, withTTL := range []bool{true, false} {
		name := "with DYN_ROUTER_SESSION_AFFINITY_TTL_SECS a session stays on one worker"
		if !withTTL {
			name = "without the TTL the session header does not pin placement"
		}
		t.Run(name, func(t *testing.T) {
			cfg := loopbackConfig(t)
			cfg.TokenizerDir = ""
			cfg.UseKVEvents = false
			if withTTL {
				cfg.SessionAffinityTTL = OptFloat{Set: true, Value: 60}
			}
			inst := startInstance(t, cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			for id := uint64(1); id <= 4; id++ {
				// 32-byte blocks: the shared JSON text before each prompt's content ends inside the
				// first block, so no two prompts share a block.
				bs := uint32(32)
				rec := picker.WorkerRecord{WorkerID: id, ModelName: "m", Endpoint: "http://127.0.0.1:1820" + strconv.FormatUint(id, 10), BlockSize: &bs}
				if _, err := inst.Service.UpsertWorker(ctx, rec, picker.SourceAPI); err != nil {
					t.Fatal(err)
				}
			}
			client := extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC))
			seen := map[string]bool{}
			for i := 0; i < 12; i++ {
				body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%04d: a question with its own words"}]}`, i)
				ex, err := client.Do(ctx, extproctest.Request{
					Body:     []byte(body),
					Headers:  []extproctest.Header{{Key: "x-dynamo-session-id", Value: "s1"}},
					Response: &extproctest.Response{Status: 200, Chunks: [][]byte{[]byte("{}")}},
				})
				if err != nil || ex.Immediate != nil {
					t.Fatalf("request %d: err=%v immediate=%+v", i, err, ex.Immediate)
				}
				seen[ex.Destination] = true
			}
			if withTTL && len(seen) != 1 {
				t.Fatalf("session s1 went to %d workers: %v", len(seen), seen)
			}
			if !withTTL && len(seen) < 2 {
				t.Fatalf("without affinity 12 tied requests all went to %v", seen)
			}
		})
	}
}
