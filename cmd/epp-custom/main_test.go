package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/examples/custompolicy"
	"github.com/kvepp/kvepp/policies"
)

// TestMain lets the test binary act as the epp-custom binary: with KVEPP_TEST_RUN_MAIN=1 it runs
// main with the arguments after "--". This also proves that `go build ./cmd/epp-custom` links.
func TestMain(m *testing.M) {
	if os.Getenv("KVEPP_TEST_RUN_MAIN") == "1" {
		for i, a := range os.Args {
			if a == "--" {
				os.Args = append([]string{"epp-custom"}, os.Args[i+1:]...)
				break
			}
		}
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("go.mod not found")
		}
		dir = parent
	}
}

// fakeSource gives every candidate decode cost 10·(worker id) blocks and no overlap.
type fakeSource []policies.Worker

func (s fakeSource) Cache(int) policies.CacheInputs { return policies.CacheInputs{} }
func (s fakeSource) Load(i int) policies.LoadInputs {
	return policies.NewLoadInputs(0, 10*int(s[i].WorkerID), 0)
}
func (s fakeSource) Routing(int) policies.RoutingInputs { return policies.RoutingInputs{} }

func TestTheCustomPolicyIsSelectableByYAMLNextToTheStandardCatalog(t *testing.T) {
	reg := catalog.Builtins()
	if err := custompolicy.Register(reg); err != nil {
		t.Fatal(err)
	}
	fromFile, err := catalog.LoadConfigFile(filepath.Join(repoRoot(t), "examples", "custompolicy", "worker-selection.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	inline, err := catalog.ParseConfig([]byte(`worker_selection: {default: mine, instances: [{name: mine, type: acme-least-kv, parameters: {max_active_requests: 4}}]}`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, wantName string
		cfg            *catalog.Config
	}{
		{"the example worker-selection.yaml selects acme-least-kv", "least-kv", fromFile},
		{"a one-line YAML instance named mine selects acme-least-kv", "mine", inline},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res, err := catalog.Resolve(reg, tc.cfg, "")
			if err != nil {
				t.Fatal(err)
			}
			if res.Name != tc.wantName || res.Type != custompolicy.TypeName || res.Builtin {
				t.Fatalf("resolution %+v", res)
			}
			p, err := res.Factory(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})
			if err != nil {
				t.Fatal(err)
			}
			ws := fakeSource{{WorkerID: 3}, {WorkerID: 1}, {WorkerID: 2}}
			res2, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 16, BlockSize: 16, Rand: rand.New(rand.NewPCG(1, 1))}), ws, ws)
			if err != nil || res2.Worker.WorkerID != 1 || res2.Cost != 10 {
				t.Fatalf("picked %v cost %v, %v; want worker 1 at cost 10", res2.Worker, res2.Cost, err)
			}
		})
	}
	t.Run("DYN_ROUTER_WORKER_SELECTION_POLICY=default still selects the built-in policy", func(t *testing.T) {
		res, err := catalog.Resolve(reg, inline, "default")
		if err != nil || !res.Builtin {
			t.Fatalf("resolution %+v, %v", res, err)
		}
	})
	t.Run("invalid parameters of the custom type stop resolution naming the parameter", func(t *testing.T) {
		bad, err := catalog.ParseConfig([]byte(`worker_selection: {default: mine, instances: [{name: mine, type: acme-least-kv, parameters: {max_active_requests: 0}}]}`))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := catalog.Resolve(reg, bad, ""); err == nil || !strings.Contains(err.Error(), "max_active_requests") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("the standard catalog without the registration does not know the type", func(t *testing.T) {
		if _, err := catalog.Resolve(catalog.Builtins(), inline, ""); err == nil || !strings.Contains(err.Error(), `unknown policy type "acme-least-kv"`) {
			t.Fatalf("err = %v", err)
		}
	})
}

func TestRunRefusesAnInvalidSettingBeforeStarting(t *testing.T) {
	t.Setenv("DYN_KV_CACHE_BLOCK_SIZE", "0")
	err := run(context.Background(), nil)
	if err == nil || !strings.Contains(err.Error(), "DYN_KV_CACHE_BLOCK_SIZE") {
		t.Fatalf("err = %v", err)
	}
}

// lockedBuffer is a concurrency-safe output sink for the child process.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// post sends body to url and returns the status and the decoded JSON object.
func post(t *testing.T, url, body string) (int, map[string]any) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var out map[string]any
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("POST %s: %d %s", url, resp.StatusCode, raw)
	}
	return resp.StatusCode, out
}

// TestEPPCustomServesTheCustomPolicy runs this binary's main as `epp-custom select-service` with
// a policy file selecting acme-least-kv (max_active_requests 1) and shows the custom filter
// deciding: two reservations land on the two workers, a third is refused because every worker is
// at the cap — the built-in policy would have accepted it.
func TestEPPCustomServesTheCustomPolicy(t *testing.T) {
	cfgPath := filepath.Join(t.TempDir(), "worker-selection.yaml")
	if err := os.WriteFile(cfgPath, []byte(`worker_selection: {default: mine, instances: [{name: mine, type: acme-least-kv, parameters: {max_active_requests: 1}}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$", "--", "select-service", "--port", strconv.Itoa(port))
	cmd.Env = append(os.Environ(), "KVEPP_TEST_RUN_MAIN=1", "DYN_EPP_BIND_ADDRESS=127.0.0.1",
		"DYN_ROUTER_USE_KV_EVENTS=false", "DYN_ROUTER_POLICY_CONFIG="+cfgPath)
	out := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get(base + "/health")
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("select-service never answered: %v; output:\n%s", err, out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(out.String(), `"type":"acme-least-kv"`) {
		t.Fatalf("the resolved policy is not acme-least-kv; output:\n%s", out.String())
	}
	for _, id := range []int{1, 2} {
		if code, body := post(t, base+"/workers", fmt.Sprintf(`{"worker_id":%d,"endpoint":"http://w%d:8000","block_size":4}`, id, id)); code != http.StatusCreated {
			t.Fatalf("POST /workers %d: %d %v", id, code, body)
		}
	}
	picked := map[float64]bool{}
	for i := 0; i < 2; i++ {
		code, body := post(t, base+"/select_and_reserve", `{"token_ids":[1,2,3,4,5,6,7,8]}`)
		if code != http.StatusOK {
			t.Fatalf("reservation %d: %d %v", i, code, body)
		}
		picked[body["worker_id"].(float64)] = true
	}
	if len(picked) != 2 {
		t.Fatalf("both reservations went to %v: the cap of one active request was not applied", picked)
	}
	code, body := post(t, base+"/select_and_reserve", `{"token_ids":[1,2,3,4,5,6,7,8]}`)
	if code != http.StatusServiceUnavailable || body["error"] != "all eligible workers were rejected by policy filters" {
		t.Fatalf("third reservation: %d %v", code, body)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("epp-custom exited with %v; output:\n%s", err, out.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("epp-custom did not stop on SIGTERM; output:\n%s", out.String())
	}
}
