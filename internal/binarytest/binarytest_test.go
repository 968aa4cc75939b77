package binarytest_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/kvepp/kvepp/internal/binarytest"
)

func TestMain(m *testing.M) { binarytest.Main(m, "fakecmd", fakeMain) }

// fakeMain is the command the tests run: `serve PORT` answers HTTP until SIGTERM, `fail` exits 3.
func fakeMain() {
	switch {
	case len(os.Args) == 3 && os.Args[1] == "serve":
		ln, err := net.Listen("tcp", "127.0.0.1:"+os.Args[2])
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
		defer stop()
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprintf(w, "%s %s", os.Args[0], os.Getenv("FAKECMD_GREETING"))
		})}
		go srv.Serve(ln)
		fmt.Println("serving")
		<-ctx.Done()
		srv.Close()
		fmt.Println("stopped")
	case len(os.Args) == 2 && os.Args[1] == "fail":
		fmt.Fprintln(os.Stderr, "fakecmd: bad setting")
		os.Exit(3)
	default:
		fmt.Fprintf(os.Stderr, "fakecmd: unknown arguments %q\n", os.Args)
		os.Exit(2)
	}
}

func TestAChildRunsMainWithTheGivenArgumentsAndEnvironment(t *testing.T) {
	port := binarytest.FreePorts(t, 1)[0]
	p := binarytest.Start(t, "", []string{"FAKECMD_GREETING=hello"}, "serve", strconv.Itoa(port))
	body := binarytest.WaitHTTP(t, fmt.Sprintf("http://127.0.0.1:%d/", port), http.StatusOK, p)
	if string(body) != "fakecmd hello" {
		t.Fatalf("body %q, want the command name and the environment variable", body)
	}
	p.Stop(t)
	if out := p.Output(); out != "serving\nstopped\n" {
		t.Fatalf("output %q, want a clean shutdown on SIGTERM", out)
	}
}

func TestAFailingChildReportsItsExitStatusAndOutput(t *testing.T) {
	p := binarytest.Start(t, "", nil, "fail")
	err := p.Wait()
	if err == nil || !strings.Contains(err.Error(), "exit status 3") {
		t.Fatalf("Wait = %v, want exit status 3", err)
	}
	if !strings.Contains(p.Output(), "fakecmd: bad setting") {
		t.Fatalf("output %q lacks the child's stderr", p.Output())
	}
}

func TestFreePortsAreDistinctAndBindable(t *testing.T) {
	ports := binarytest.FreePorts(t, 8)
	seen := map[int]bool{}
	for _, p := range ports {
		if p <= 0 || seen[p] {
			t.Fatalf("ports %v are not distinct positive ports", ports)
		}
		seen[p] = true
	}
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", ports[0]))
	if err != nil {
		t.Fatalf("port %d was not released: %v", ports[0], err)
	}
	ln.Close()
}
