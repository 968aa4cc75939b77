package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/internal/sharedtest"
	"github.com/kvepp/kvepp/picker"
)

// latencyBatchPolicy is picker/httpapi's acceptance-10 fixture (selection-service.md §20 item 10):
// the explicit class latency busies at any prefill and has no queue room; the default family
// batch busies at 16 × max_num_batched_tokens.
const latencyBatchPolicy = `
default_policy_family: batch
uncached_isl_buckets: [{min_tokens: 0, bucket: all}]
policy_classes:
  - {name: latency, quantum: 1, prefill_busy_threshold: 0, request_queue_limit_per_worker: 0}
  - {name: batch, policy_family: batch, cache_bucket: all, quantum: 1}
`

// writePolicy writes a policy configuration file and returns its path.
func writePolicy(t *testing.T, doc string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// call sends a JSON body (may be "") with headers to url and returns the status and decoded body.
func call(t *testing.T, method, url, body string, headers map[string]string) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	if len(data) > 0 {
		if err := json.Unmarshal(data, &out); err != nil {
			t.Fatalf("%s %s: %d %s: %v", method, url, resp.StatusCode, data, err)
		}
	}
	return resp.StatusCode, out
}

// checkPolicyClassRejection runs acceptance item 10 against a selection API at base: with both
// workers busy, class latency (limit 0) is rejected with the spec's 429 body on /select and
// /select_and_reserve, while the default family batch is still admitted.
func checkPolicyClassRejection(t *testing.T, base string) {
	t.Helper()
	const prompt = `"token_ids":[1,2,3,4]`
	for id := 1; id <= 2; id++ {
		body := fmt.Sprintf(`{"worker_id":%d,"model_name":"model","endpoint":"http://w%d:8000","block_size":4,"max_num_batched_tokens":1024}`, id, id)
		if st, out := call(t, http.MethodPost, base+"/workers", body, nil); st != http.StatusCreated || out["lifecycle"] != "schedulable" {
			t.Fatalf("POST /workers %d = %d %v", id, st, out)
		}
	}
	latency := map[string]string{"x-dynamo-meta-policy-class": " latency "}
	if st, out := call(t, http.MethodPost, base+"/select", `{"model_name":"model",`+prompt+`}`, latency); st != http.StatusOK {
		t.Fatalf("/select on idle workers = %d %v", st, out)
	}
	for id := 1; id <= 2; id++ {
		body := fmt.Sprintf(`{"selection_id":"b%d","model_name":"model","worker_id":%d,"sequence_hashes":[],"isl_tokens":4,"effective_prefill_tokens":4}`, id, id)
		if st, out := call(t, http.MethodPost, base+"/reservations", body, nil); st != http.StatusCreated {
			t.Fatalf("occupying worker %d = %d %v", id, st, out)
		}
	}
	want := map[string]any{
		"error":   `router policy class "latency" queue requests limit reached (current=0, limit=0)`,
		"details": map[string]any{"policy_class": "latency", "limit_kind": "requests", "current": 0.0, "limit": 0.0},
	}
	for _, route := range []string{"/select", "/select_and_reserve"} {
		st, out := call(t, http.MethodPost, base+route, `{"selection_id":"lat","model_name":"model",`+prompt+`}`, latency)
		if diff := cmp.Diff(want, out); st != http.StatusTooManyRequests || diff != "" {
			t.Fatalf("%s = %d (-want +got):\n%s", route, st, diff)
		}
	}
	if st, out := call(t, http.MethodPost, base+"/select_and_reserve", `{"selection_id":"batch","model_name":"model",`+prompt+`}`, nil); st != http.StatusOK {
		t.Fatalf("the default family was not admitted: %d %v", st, out)
	}
}

func TestPolicyClassesFromThePolicyFileGovernAdmission(t *testing.T) {
	policy := writePolicy(t, latencyBatchPolicy)
	t.Run("the EPP side port rejects a full policy class with the spec's 429", func(t *testing.T) {
		cfg := loopbackConfig(t)
		cfg.TokenizerDir = ""
		cfg.UseKVEvents = false
		cfg.PolicyConfig = policy
		inst := startInstance(t, cfg)
		t.Cleanup(inst.Service.BeginShutdown) // fail anything still queued before Stop
		checkPolicyClassRejection(t, "http://"+inst.Addrs().Selection)
	})
	t.Run("epp select-service rejects a full policy class with the spec's 429", func(t *testing.T) {
		base := startSelectService(t, []string{"DYN_ROUTER_POLICY_CONFIG=" + policy})
		checkPolicyClassRejection(t, base)
	})
	t.Run("policy classes make max_num_batched_tokens required", func(t *testing.T) {
		cfg := loopbackConfig(t)
		cfg.TokenizerDir = ""
		cfg.UseKVEvents = false
		cfg.PolicyConfig = policy
		inst := startInstance(t, cfg)
		st, out := call(t, http.MethodPost, "http://"+inst.Addrs().Selection+"/workers",
			`{"worker_id":1,"model_name":"model","endpoint":"http://w1:8000","block_size":4}`, nil)
		reasons, _ := out["not_schedulable_reasons"].([]any)
		if st != http.StatusCreated || out["lifecycle"] != "incomplete" || len(reasons) != 1 ||
			!strings.Contains(reasons[0].(string), "max_num_batched_tokens") {
			t.Fatalf("POST /workers without max_num_batched_tokens = %d %v", st, out)
		}
	})
}

// startSelectService runs `epp select-service` with environ (plus loopback, approximate mode) on
// an ephemeral port and returns its base URL; it is stopped when the test ends.
func startSelectService(t *testing.T, environ []string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	addrCh := make(chan string, 1)
	done := make(chan error, 1)
	env := append([]string{"DYN_EPP_BIND_ADDRESS=127.0.0.1", "DYN_ROUTER_USE_KV_EVENTS=false"}, environ...)
	go func() {
		done <- runSelectService(ctx, nil, env, []string{"--port", "0"}, io.Discard, testLogger(t),
			func(addr string, _ *picker.Service) { addrCh <- addr })
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("select-service returned %v after shutdown", err)
			}
		case <-time.After(20 * time.Second):
			t.Error("select-service did not stop")
		}
	})
	select {
	case addr := <-addrCh:
		return "http://" + addr
	case err := <-done:
		done <- err
		t.Fatalf("select-service exited: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("select-service did not start")
	}
	return ""
}

func TestQueueSettingsReachThePicker(t *testing.T) {
	tests := []struct {
		name        string
		env         []string
		wantPolicy  string
		wantRefresh float64
		wantCache   string
	}{
		{"the defaults are fcfs, a 10 s refresh and the ttl cache policy", nil, "fcfs", 10, picker.ApproxCachePolicyTTL},
		{"wspt and a fractional refresh are passed through",
			[]string{"DYN_ROUTER_QUEUE_POLICY=wspt", "DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS=2.5"}, "wspt", 2.5, picker.ApproxCachePolicyTTL},
		{"lcfs with the refresh disabled and lru without KV events",
			[]string{"DYN_ROUTER_QUEUE_POLICY=lcfs", "DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS=0", "DYN_ROUTER_USE_KV_EVENTS=false", "DYN_ROUTER_APPROXIMATE_CACHE_POLICY=lru"},
			"lcfs", 0, picker.ApproxCachePolicyLRU},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := LoadConfig(append([]string{"DYN_EPP_TOKENIZER_DIR=" + sharedtest.Qwen3TokenizerDir(t)}, tc.env...), nil, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			pc, err := pickerConfig(cfg, catalog.Builtins(), *testLogger(t))
			if err != nil {
				t.Fatal(err)
			}
			r := pc.Router
			if r.QueuePolicy != tc.wantPolicy || r.OverlapRefreshAfterSecs != tc.wantRefresh || r.ApproximateCachePolicy != tc.wantCache {
				t.Fatalf("router settings queue_policy=%q refresh=%v cache_policy=%q, want %q %v %q",
					r.QueuePolicy, r.OverlapRefreshAfterSecs, r.ApproximateCachePolicy, tc.wantPolicy, tc.wantRefresh, tc.wantCache)
			}
			if pc.PolicyProfiles.Configured() {
				t.Fatal("policy profiles configured without DYN_ROUTER_POLICY_CONFIG")
			}
		})
	}
	t.Run("a policy file's classes become the picker's policy profiles", func(t *testing.T) {
		cfg := DefaultConfig()
		cfg.UseKVEvents = false
		cfg.PolicyConfig = writePolicy(t, latencyBatchPolicy)
		pc, err := pickerConfig(cfg, catalog.Builtins(), *testLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		if !pc.PolicyProfiles.Configured() || pc.PolicyProfiles.For("model") == nil {
			t.Fatalf("policy profiles %+v, want the root profile", pc.PolicyProfiles)
		}
	})
}

func TestApproximateLRUPolicyBoundsEachRankByTotalKVBlocks(t *testing.T) {
	// 16 tokens = 4 blocks of 4 booked on a worker with total_kv_blocks 2: lru keeps the first 2
	// blocks (8 tokens), ttl keeps all 16.
	for _, tc := range []struct {
		name   string
		policy string
		want   float64
	}{
		{"with DYN_ROUTER_APPROXIMATE_CACHE_POLICY=lru a booking keeps total_kv_blocks blocks per rank", "lru", 8},
		{"with DYN_ROUTER_APPROXIMATE_CACHE_POLICY=ttl a booking keeps every block", "ttl", 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := loopbackConfig(t)
			cfg.TokenizerDir = ""
			cfg.UseKVEvents = false
			cfg.ApproximateCachePolicy = tc.policy
			base := "http://" + startInstance(t, cfg).Addrs().Selection
			if st, out := call(t, http.MethodPost, base+"/workers", `{"worker_id":1,"model_name":"m","endpoint":"http://w1:8000","block_size":4,"total_kv_blocks":2}`, nil); st != http.StatusCreated {
				t.Fatalf("POST /workers = %d %v", st, out)
			}
			prompt := `{"model_name":"m","token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]}`
			if st, out := call(t, http.MethodPost, base+"/select_and_reserve", prompt, nil); st != http.StatusOK {
				t.Fatalf("select_and_reserve = %d %v", st, out)
			}
			st, out := call(t, http.MethodPost, base+"/select", prompt, nil)
			overlap, _ := out["overlap"].(map[string]any)
			if st != http.StatusOK || overlap["longest_matched"] != tc.want {
				t.Fatalf("/select = %d overlap %v, want longest_matched %v", st, overlap, tc.want)
			}
		})
	}
}
