package pythontest_test

import (
	"bufio"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvepp/kvepp/internal/pythontest"
)

func TestStartRunsAScriptUntilStdinCloses(t *testing.T) {
	if _, err := os.Stat(pythontest.Interpreter); err != nil {
		t.Skipf("%s: %v", pythontest.Interpreter, err)
	}
	script := filepath.Join(t.TempDir(), "echo.py")
	if err := os.WriteFile(script, []byte("import sys\nprint('hello ' + sys.argv[1], flush=True)\nsys.stdin.read()\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	stdin, stdout := pythontest.Start(t, script, "world")
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "hello world\n" {
		t.Fatalf("read %q, %v", line, err)
	}
	if err := stdin.Close(); err != nil {
		t.Fatal(err)
	}
}
