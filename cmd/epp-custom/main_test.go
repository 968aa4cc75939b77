package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/examples/custompolicy"
	"github.com/kvepp/kvepp/internal/binarytest"
	"github.com/kvepp/kvepp/internal/sharedtest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
)

// TestMain lets the test binary act as the epp-custom binary (binarytest.Start runs main with
// the arguments given to it). This also proves that `go build ./cmd/epp-custom` links.
func TestMain(m *testing.M) { binarytest.Main(m, "epp-custom", main) }

func TestTheCustomPolicyIsSelectableByYAMLNextToTheStandardCatalog(t *testing.T) {
	reg := catalog.Builtins()
	if err := custompolicy.Register(reg); err != nil {
		t.Fatal(err)
	}
	fromFile, err := catalog.LoadConfigFile(filepath.Join(sharedtest.RepoRoot(t), "examples", "custompolicy", "worker-selection.yaml"))
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
			// Decode cost 10·(worker id) blocks and no overlap.
			src := policytest.Source{{Worker: policytest.W(3, 0), DecodeCost: 30}, {Worker: policytest.W(1, 0), DecodeCost: 10}, {Worker: policytest.W(2, 0), DecodeCost: 20}}
			res2, err := p.Select(policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 16, BlockSize: 16, Rand: rand.New(rand.NewPCG(1, 1))}), src.Workers(), src)
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
	port := binarytest.FreePorts(t, 1)[0]
	epp := binarytest.Start(t, "", []string{"DYN_EPP_BIND_ADDRESS=127.0.0.1",
		"DYN_ROUTER_USE_KV_EVENTS=false", "DYN_ROUTER_POLICY_CONFIG=" + cfgPath}, "select-service", "--port", strconv.Itoa(port))
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	binarytest.WaitHTTP(t, base+"/health", http.StatusOK, epp)
	if !strings.Contains(epp.Output(), `"type":"acme-least-kv"`) {
		t.Fatalf("the resolved policy is not acme-least-kv; output:\n%s", epp.Output())
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

	epp.Stop(t)
}
