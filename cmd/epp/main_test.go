package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestMain lets the test binary act as the epp binary: with KVEPP_TEST_RUN_MAIN=1 it runs main
// with the arguments after "--".
func TestMain(m *testing.M) {
	if os.Getenv("KVEPP_TEST_RUN_MAIN") == "1" {
		for i, a := range os.Args {
			if a == "--" {
				os.Args = append([]string{"epp"}, os.Args[i+1:]...)
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

// freePorts returns n distinct free loopback ports.
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	var ports []int
	var lns []net.Listener
	for i := 0; i < n; i++ {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	for _, ln := range lns {
		ln.Close()
	}
	return ports
}

// safeBuffer is a concurrency-safe output sink for the child process.
type safeBuffer struct {
	mu chan struct{}
	b  bytes.Buffer
}

func newSafeBuffer() *safeBuffer { return &safeBuffer{mu: make(chan struct{}, 1)} }

func (s *safeBuffer) Write(p []byte) (int, error) {
	s.mu <- struct{}{}
	defer func() { <-s.mu }()
	return s.b.Write(p)
}

func (s *safeBuffer) String() string {
	s.mu <- struct{}{}
	defer func() { <-s.mu }()
	return s.b.String()
}

// startEPP runs this test binary as epp with env and args in the repository root.
func startEPP(t *testing.T, env []string, args ...string) (*exec.Cmd, *safeBuffer) {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"-test.run=^$", "--"}, args...)...)
	cmd.Dir = repoRoot(t)
	cmd.Env = append(append(os.Environ(), "KVEPP_TEST_RUN_MAIN=1"), env...)
	out := newSafeBuffer()
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return cmd, out
}

// waitHTTP polls url until it answers want, returning the body.
func waitHTTP(t *testing.T, url string, want int, out *safeBuffer) []byte {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		resp, err := http.Get(url)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == want {
				return body
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never answered %d (last error %v); output:\n%s", url, want, err, out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stopEPP sends SIGTERM and waits for a clean exit.
func stopEPP(t *testing.T, cmd *exec.Cmd, out *safeBuffer) {
	t.Helper()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("epp exited with %v; output:\n%s", err, out.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("epp did not exit after SIGTERM; output:\n%s", out.String())
	}
}

func TestEPPRunsTheREADMECommandAndStopsOnSIGTERM(t *testing.T) {
	ports := freePorts(t, 4)
	cmd, out := startEPP(t, []string{
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
	if err := json.Unmarshal(waitHTTP(t, base+"/ready", http.StatusOK, out), &ready); err != nil {
		t.Fatal(err)
	}
	if !ready.Ready || ready.SchedulableWorkers != 3 {
		t.Fatalf("/ready = %+v, want 3 schedulable workers", ready)
	}
	var workers []struct {
		WorkerID uint64 `json:"worker_id"`
		Endpoint string `json:"endpoint"`
	}
	if err := json.Unmarshal(waitHTTP(t, base+"/workers", http.StatusOK, out), &workers); err != nil {
		t.Fatal(err)
	}
	if len(workers) != 3 || workers[1].Endpoint != "http://127.0.0.1:8002" {
		t.Fatalf("/workers = %+v", workers)
	}
	metrics := string(waitHTTP(t, fmt.Sprintf("http://127.0.0.1:%d/metrics", ports[3]), http.StatusOK, out))
	if !strings.Contains(metrics, "kvepp_ready_workers 3") {
		t.Fatalf("metrics lack kvepp_ready_workers 3")
	}
	// ext_proc comes up once the tokenizer is loaded.
	deadline := time.Now().Add(90 * time.Second)
	for !strings.Contains(out.String(), `"message":"kvepp ready"`) {
		if time.Now().After(deadline) {
			t.Fatalf("never became ready; output:\n%s", out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", ports[0])); err != nil {
		t.Fatalf("ext_proc port not listening: %v", err)
	} else {
		c.Close()
	}
	stopEPP(t, cmd, out)
	if !strings.Contains(out.String(), "kvepp stopped") {
		t.Fatalf("no shutdown log; output:\n%s", out.String())
	}
}

func TestEPPExitsWithAnErrorNamingAnInvalidSetting(t *testing.T) {
	cmd, out := startEPP(t, []string{"DYN_KV_CACHE_BLOCK_SIZE=0", "DYN_EPP_TOKENIZER_DIR=../shared/models/qwen3"})
	err := cmd.Wait()
	if err == nil {
		t.Fatal("epp started with DYN_KV_CACHE_BLOCK_SIZE=0")
	}
	if want := `epp: invalid DYN_KV_CACHE_BLOCK_SIZE "0": must be > 0`; !strings.Contains(out.String(), want) {
		t.Fatalf("output %q lacks %q", out.String(), want)
	}
}

func TestSelectServiceSubcommand(t *testing.T) {
	port := freePorts(t, 1)[0]
	cmd, out := startEPP(t, []string{"DYN_EPP_BIND_ADDRESS=127.0.0.1", "DYN_ROUTER_USE_KV_EVENTS=false"}, "select-service", "--port", strconv.Itoa(port))
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	waitHTTP(t, base+"/health", http.StatusOK, out)
	waitHTTP(t, base+"/ready", http.StatusServiceUnavailable, out)
	resp, err := http.Post(base+"/workers", "application/json",
		strings.NewReader(`{"worker_id":7,"model_name":"m","endpoint":"http://w:8000","block_size":4}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST /workers: %d", resp.StatusCode)
	}
	waitHTTP(t, base+"/ready", http.StatusOK, out)
	stopEPP(t, cmd, out)
}
