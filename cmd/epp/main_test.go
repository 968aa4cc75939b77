package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
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
	// The README's next step: one request played through the running EPP with epp route.
	route := startEPP(t, nil, "route", "--addr", fmt.Sprintf("127.0.0.1:%d", ports[0]), "--body", "examples/chat.json")
	if err := route.Wait(); err != nil {
		t.Fatalf("epp route: %v; output:\n%s", err, route.Output())
	}
	for _, want := range []string{"endpoint        127.0.0.1:800", "worker_id       ", "dp_rank         0",
		"matched prefix  0 of ", "decision time   ", "booking         freed"} {
		if !strings.Contains(route.Output(), want) {
			t.Fatalf("epp route output lacks %q:\n%s", want, route.Output())
		}
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

// TestASecondSIGINTExitsAtOnceEvenWhenSIGINTWasIgnored starts epp the way a non-interactive
// shell starts a background job (SIGINT inherited as ignored) with a 60 s drain window: the first
// SIGINT starts the drain, the second ends the process at once.
func TestASecondSIGINTExitsAtOnceEvenWhenSIGINTWasIgnored(t *testing.T) {
	ports := binarytest.FreePorts(t, 4)
	epp := binarytest.StartIgnoringSIGINT(t, sharedtest.RepoRoot(t), []string{
		"DYN_ROUTER_USE_KV_EVENTS=false", "DYN_EPP_TOKENIZER_PROTOCOL=none", "DYN_EPP_SECURE_SERVING=false",
		"DYN_EPP_DRAIN_TIMEOUT_SECS=60", "DYN_EPP_BIND_ADDRESS=127.0.0.1",
	}, "--grpc-port", strconv.Itoa(ports[0]), "--grpc-health-port", strconv.Itoa(ports[1]),
		"--selection-http-port", strconv.Itoa(ports[2]), "--metrics-port", strconv.Itoa(ports[3]))
	waitOutput(t, epp, `"message":"kvepp ready"`)
	if err := epp.Cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	waitOutput(t, epp, "draining")
	start := time.Now()
	if err := epp.Cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- epp.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 130 {
			t.Fatalf("exit %v, want status 130 (128 + SIGINT); output:\n%s", err, epp.Output())
		}
		logged := false
		for _, line := range strings.Split(epp.Output(), "\n") {
			var entry map[string]any
			if strings.Contains(line, "second signal") && json.Unmarshal([]byte(line), &entry) == nil && entry["level"] == "warn" {
				logged = true
			}
		}
		if !logged {
			t.Fatalf("no JSON warn line about the second signal; output:\n%s", epp.Output())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("still running %v after the second SIGINT (the drain window is 60 s); output:\n%s", time.Since(start), epp.Output())
	}
}

// waitOutput waits up to 90 s for p's output to contain s.
func waitOutput(t *testing.T, p *binarytest.Process, s string) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for !strings.Contains(p.Output(), s) {
		if time.Now().After(deadline) {
			t.Fatalf("output never contained %q:\n%s", s, p.Output())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
