// Package pythontest runs Python helper scripts for interop tests against real libzmq and
// msgpack-python peers: Debian's /usr/bin/python3 with python3-zmq and python3-msgpack (the
// python3 on PATH may be another installation without them; scripts/test.sh installs the
// packages).
package pythontest

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// Interpreter is Debian's Python, which has python3-zmq and python3-msgpack.
const Interpreter = "/usr/bin/python3"

// RequireZMQ skips the test when the interpreter or its zmq and msgpack modules are missing,
// unless CI=true, where their absence fails the test.
func RequireZMQ(t testing.TB) {
	t.Helper()
	out, err := exec.Command(Interpreter, "-c", "import zmq, msgpack").CombinedOutput()
	if err == nil {
		return
	}
	msg := fmt.Sprintf("%s with zmq and msgpack is unavailable (%v: %s); install python3-zmq python3-msgpack", Interpreter, err, strings.TrimSpace(string(out)))
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// Start runs script with args, its stderr on the test's stderr, and returns its stdin and stdout.
// When the test ends stdin is closed (scripts stop on EOF) and the process is killed if it has not
// exited 5 s later.
func Start(t testing.TB, script string, args ...string) (stdin io.WriteCloser, stdout io.Reader) {
	t.Helper()
	cmd := exec.Command(Interpreter, append([]string{script}, args...)...)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = in.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	return in, out
}
