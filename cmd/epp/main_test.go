package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/internal/binarytest"
	"github.com/kvepp/kvepp/internal/sharedtest"
)

// TestMain lets the test binary act as the epp binary (binarytest.Start runs main with the
// arguments given to it).
func TestMain(m *testing.M) { binarytest.Main(m, "epp", main) }

// startEPP runs this test binary as epp with env and args in the repository root.
func startEPP(t *testing.T, env []string, args ...string) *binarytest.Process {
	t.Helper()
	return binarytest.Start(t, sharedtest.RepoRoot(t), env, args...)
}

func TestEPPRunsTheREADMECommandAndStopsOnSIGTERM(t *testing.T) {
	ports := binarytest.FreePorts(t, 4)
	epp := startEPP(t, []string{
		"DYN_EPP_WORKERS_FILE=examples/workers.yaml",
		"DYN_EPP_TOKENIZER_DIR=../shared/models/qwen3",
		"DYN_EPP_SECURE_SERVING=false",
		"DYN_EPP_DRAIN_TIMEOUT_SECS=0.1",
		"DYN_EPP_BIND_ADDRESS=127.0.0.1",
	}, "--grpc-port", strconv.Itoa(ports[0]), "--grpc-health-port", strconv.Itoa(ports[1]),
		"--selection-http-port", strconv.Itoa(ports[2]), "--metrics-port", strconv.Itoa(ports[3]))
	base := fmt.Sprintf("http://127.0.0.1:%d", ports[2])

	var ready struct {
		Ready              bool `json:"ready"`
		SchedulableWorkers int  `json:"schedulable_workers"`
	}
	if err := json.Unmarshal(binarytest.WaitHTTP(t, base+"/ready", http.StatusOK, epp), &ready); err != nil {
		t.Fatal(err)
	}
	if !ready.Ready || ready.SchedulableWorkers != 3 {
		t.Fatalf("/ready = %+v, want 3 schedulable workers", ready)
	}
	var workers []struct {
		WorkerID uint64 `json:"worker_id"`
		Endpoint string `json:"endpoint"`
	}
	if err := json.Unmarshal(binarytest.WaitHTTP(t, base+"/workers", http.StatusOK, epp), &workers); err != nil {
		t.Fatal(err)
	}
	if len(workers) != 3 || workers[1].Endpoint != "http://127.0.0.1:8002" {
		t.Fatalf("/workers = %+v", workers)
	}
	metrics := string(binarytest.WaitHTTP(t, fmt.Sprintf("http://127.0.0.1:%d/metrics", ports[3]), http.StatusOK, epp))
	if !strings.Contains(metrics, "kvepp_ready_workers 3") {
		t.Fatalf("metrics lack kvepp_ready_workers 3")
	}
	// ext_proc comes up once the tokenizer is loaded.
	deadline := time.Now().Add(90 * time.Second)
	for !strings.Contains(epp.Output(), `"message":"kvepp ready"`) {
		if time.Now().After(deadline) {
			t.Fatalf("never became ready; output:\n%s", epp.Output())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", ports[0])); err != nil {
		t.Fatalf("ext_proc port not listening: %v", err)
	} else {
		c.Close()
	}
	epp.Stop(t)
	if !strings.Contains(epp.Output(), "kvepp stopped") {
		t.Fatalf("no shutdown log; output:\n%s", epp.Output())
	}
}

func TestEPPExitsWithAnErrorNamingAnInvalidSetting(t *testing.T) {
	epp := startEPP(t, []string{"DYN_KV_CACHE_BLOCK_SIZE=0", "DYN_EPP_TOKENIZER_DIR=../shared/models/qwen3"})
	err := epp.Wait()
	if err == nil {
		t.Fatal("epp started with DYN_KV_CACHE_BLOCK_SIZE=0")
	}
	if want := `epp: invalid DYN_KV_CACHE_BLOCK_SIZE "0": must be > 0`; !strings.Contains(epp.Output(), want) {
		t.Fatalf("output %q lacks %q", epp.Output(), want)
	}
}

func TestSelectServiceSubcommand(t *testing.T) {
	port := binarytest.FreePorts(t, 1)[0]
	epp := startEPP(t, []string{"DYN_EPP_BIND_ADDRESS=127.0.0.1", "DYN_ROUTER_USE_KV_EVENTS=false"}, "select-service", "--port", strconv.Itoa(port))
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	binarytest.WaitHTTP(t, base+"/health", http.StatusOK, epp)
	binarytest.WaitHTTP(t, base+"/ready", http.StatusServiceUnavailable, epp)
	resp, err := http.Post(base+"/workers", "application/json",
		strings.NewReader(`{"worker_id":7,"model_name":"m","endpoint":"http://w:8000","block_size":4}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST /workers: %d", resp.StatusCode)
	}
	binarytest.WaitHTTP(t, base+"/ready", http.StatusOK, epp)
	epp.Stop(t)
}
