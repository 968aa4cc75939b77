// Package binarytest runs a command's main function as a child process of its own test binary,
// so a cmd package's tests exercise the real binary — flags, environment, listeners, signal
// handling and exit status — without a separate `go build`.
//
// A cmd package's TestMain hands over to Main; a test then calls Start with the command's
// arguments and environment, polls its HTTP endpoints with WaitHTTP, reads its combined output
// with Output and stops it with Stop (SIGTERM, then a clean exit within 30 s):
//
//	func TestMain(m *testing.M) { binarytest.Main(m, "epp", main) }
//
//	p := binarytest.Start(t, "", []string{"DYN_EPP_BIND_ADDRESS=127.0.0.1"}, "select-service", "--port", port)
//	binarytest.WaitHTTP(t, "http://127.0.0.1:"+port+"/health", http.StatusOK, p)
//	p.Stop(t)
package binarytest

import (
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/kvepp/kvepp/internal/syncbuf"
)

// childEnv marks a test binary started by Start: it runs main instead of the tests.
const childEnv = "KVEPP_TEST_RUN_MAIN"

// commandName is the name given to Main, used in Start's children and failure messages.
var commandName = "the command"

// WaitHTTPTimeout bounds WaitHTTP; StopTimeout bounds the exit after SIGTERM in Stop.
const (
	WaitHTTPTimeout = 90 * time.Second
	StopTimeout     = 30 * time.Second
)

// Main is a cmd package's TestMain. In a child started by Start it runs main with os.Args set to
// name followed by the arguments given to Start, then exits with status 0 (main exits non-zero
// itself on failure); otherwise it runs the tests and exits with their status.
func Main(m *testing.M, name string, main func()) {
	commandName = name
	if os.Getenv(childEnv) == "1" {
		for i, a := range os.Args {
			if a == "--" {
				os.Args = append([]string{name}, os.Args[i+1:]...)
				break
			}
		}
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// Process is a running child started by Start. Cmd is the underlying command (for a signal of
// the test's choosing).
type Process struct {
	Cmd *exec.Cmd
	out *syncbuf.Buffer
}

// Start runs this test binary as the command (see Main) with args, in dir (the package
// directory when dir is ""), with the test's environment plus env ("KEY=value" entries, later
// ones winning). Standard output and standard error are collected for Output. The child is
// killed when the test ends unless it has already been waited for. Start fails t when the child
// cannot be started.
func Start(t testing.TB, dir string, env []string, args ...string) *Process {
	t.Helper()
	return start(t, false, dir, env, args)
}

// StartIgnoringSIGINT is Start for a child that inherits SIGINT as ignored, as a background job of
// a non-interactive shell does: /bin/sh sets the disposition and execs the command.
func StartIgnoringSIGINT(t testing.TB, dir string, env []string, args ...string) *Process {
	t.Helper()
	return start(t, true, dir, env, args)
}

func start(t testing.TB, ignoreSIGINT bool, dir string, env []string, args []string) *Process {
	t.Helper()
	argv := append([]string{os.Args[0], "-test.run=^$", "--"}, args...)
	if ignoreSIGINT {
		argv = append([]string{"/bin/sh", "-c", `trap "" INT; exec "$@"`, "sh"}, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = dir
	cmd.Env = append(append(os.Environ(), childEnv+"=1"), env...)
	p := &Process{Cmd: cmd, out: &syncbuf.Buffer{}}
	cmd.Stdout, cmd.Stderr = p.out, p.out
	if err := cmd.Start(); err != nil {
		t.Fatalf("binarytest: start %s: %v", commandName, err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return p
}

// Output returns everything the child has written to standard output and standard error so far.
func (p *Process) Output() string { return p.out.String() }

// Wait waits for the child to exit and returns its exit error (nil on status 0).
func (p *Process) Wait() error { return p.Cmd.Wait() }

// Stop sends SIGTERM and waits up to StopTimeout for the child to exit. It fails t, quoting the
// child's output, when the child exits non-zero or does not exit in time.
func (p *Process) Stop(t testing.TB) {
	t.Helper()
	if err := p.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("binarytest: SIGTERM %s: %v", commandName, err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("%s exited with %v; output:\n%s", commandName, err, p.Output())
		}
	case <-time.After(StopTimeout):
		t.Fatalf("%s did not exit within %v of SIGTERM; output:\n%s", commandName, StopTimeout, p.Output())
	}
}

// WaitHTTP polls GET url every 50 ms until it answers with status want and returns that
// response's body. It fails t, quoting the last error and p's output, after WaitHTTPTimeout.
func WaitHTTP(t testing.TB, url string, want int, p *Process) []byte {
	t.Helper()
	deadline := time.Now().Add(WaitHTTPTimeout)
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
			t.Fatalf("%s never answered %d (last error %v); output:\n%s", url, want, err, p.Output())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// FreePorts returns n distinct loopback TCP ports that were free when it returned (all n are
// held open together, then released, so they differ from each other). It fails t when the
// system has no free port.
func FreePorts(t testing.TB, n int) []int {
	t.Helper()
	ports := make([]int, 0, n)
	lns := make([]net.Listener, 0, n)
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	for i := 0; i < n; i++ {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("binarytest: free port: %v", err)
		}
		lns = append(lns, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports
}
