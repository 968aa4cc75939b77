package runner

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"
)

// startWithTimeouts starts a runner whose HTTP servers use timeouts.
func startWithTimeouts(t *testing.T, timeouts HTTPTimeouts) *Instance {
	t.Helper()
	inst, err := Start(context.Background(), Options{Config: loopbackConfig(t), Logger: testLogger(t), HTTPTimeouts: timeouts})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		if err := inst.Stop(context.Background()); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
	return inst
}

// waitClosed reads conn until the server closes it; it fails the test when the connection is
// still open at start+limit.
func waitClosed(t *testing.T, conn net.Conn, start time.Time, limit time.Duration) {
	t.Helper()
	if err := conn.SetReadDeadline(start.Add(limit)); err != nil {
		t.Fatal(err)
	}
	_, err := io.Copy(io.Discard, conn)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the server still holds the connection after %v", limit)
	}
}

// TestHTTPServersDropSlowAndIdleClients checks that the selection side port and the metrics port
// bound how long a client may take to send its request and how long a keep-alive connection may
// idle: a POST announcing Content-Length 100 that sends 1 byte, headers that never finish, and an
// idle connection are all closed soon after the configured timeouts instead of being held.
func TestHTTPServersDropSlowAndIdleClients(t *testing.T) {
	timeouts := HTTPTimeouts{ReadHeader: 200 * time.Millisecond, Read: 300 * time.Millisecond, Idle: 300 * time.Millisecond}
	inst := startWithTimeouts(t, timeouts)
	const limit = 3 * time.Second // far above the timeouts, far below the unbounded behaviour
	ports := []struct{ name, addr, path string }{
		{"the selection side port", inst.Addrs().Selection, "/select"},
		{"the metrics port", inst.Addrs().Metrics, "/metrics"},
	}
	for _, p := range ports {
		t.Run(p.name+" drops a client that stalls in the middle of its body", func(t *testing.T) {
			conn, err := net.Dial("tcp", p.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			start := time.Now()
			if _, err := io.WriteString(conn, "POST "+p.path+" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"); err != nil {
				t.Fatal(err)
			}
			waitClosed(t, conn, start, limit)
		})
		t.Run(p.name+" drops a client that never finishes its headers", func(t *testing.T) {
			conn, err := net.Dial("tcp", p.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			start := time.Now()
			if _, err := io.WriteString(conn, "GET "+p.path+" HTTP/1.1\r\nHost: x\r\n"); err != nil {
				t.Fatal(err)
			}
			waitClosed(t, conn, start, limit)
		})
		t.Run(p.name+" closes an idle keep-alive connection", func(t *testing.T) {
			conn, err := net.Dial("tcp", p.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := io.WriteString(conn, "GET "+p.path+" HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			waitClosed(t, conn, time.Now(), limit)
		})
	}
	t.Run("a request sent in time is still served", func(t *testing.T) {
		resp, err := http.Get("http://" + inst.Addrs().Metrics + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /metrics: %d", resp.StatusCode)
		}
	})
}

// TestHTTPServersGetDefaultTimeouts checks that without Options.HTTPTimeouts every HTTP server the
// runner starts has the default bounds (30 s for a whole request), and that a partial setting
// keeps the defaults of the fields it leaves zero.
func TestHTTPServersGetDefaultTimeouts(t *testing.T) {
	tests := []struct {
		name string
		in   HTTPTimeouts
		want HTTPTimeouts
	}{
		{"no setting gives the defaults", HTTPTimeouts{}, HTTPTimeouts{10 * time.Second, 30 * time.Second, 120 * time.Second}},
		{"a read timeout alone keeps the other defaults", HTTPTimeouts{Read: 5 * time.Second}, HTTPTimeouts{10 * time.Second, 5 * time.Second, 120 * time.Second}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			inst := startWithTimeouts(t, tc.in)
			for name, s := range map[string]*http.Server{"selection": inst.httpSrv, "metrics": inst.metricsSrv} {
				got := HTTPTimeouts{ReadHeader: s.ReadHeaderTimeout, Read: s.ReadTimeout, Idle: s.IdleTimeout}
				if got != tc.want {
					t.Fatalf("%s server timeouts %+v, want %+v", name, got, tc.want)
				}
			}
		})
	}
}

// TestOversizedHeadersGetAJSONError (finding 21): request headers over the side port's 1 MiB
// limit are answered 431 with the API's JSON error body, up to the 8 MiB net/http reads at all;
// below the limit they pass.
func TestOversizedHeadersGetAJSONError(t *testing.T) {
	cfg := loopbackConfig(t)
	cfg.TokenizerDir, cfg.TokenizerProtocol, cfg.UseKVEvents = "", TokenizerProtocolNone, false
	inst := startInstance(t, cfg)
	for _, tc := range []struct {
		name string
		size int
		code int
		json bool
	}{
		{"headers below the limit pass", 900 << 10, http.StatusOK, true},
		{"1.5 MiB of headers", 1536 << 10, http.StatusRequestHeaderFieldsTooLarge, true},
		{"6 MiB of headers", 6 << 20, http.StatusRequestHeaderFieldsTooLarge, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", inst.Addrs().Selection)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			w := bufio.NewWriter(conn)
			fmt.Fprintf(w, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n", strings.Repeat("a", tc.size))
			if err := w.Flush(); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var e struct {
				Error string `json:"error"`
			}
			if resp.StatusCode != tc.code || (json.Unmarshal(body, &e) != nil) == tc.json {
				t.Fatalf("status %d %q (content-type %q), want %d with a JSON body", resp.StatusCode, body, resp.Header.Get("Content-Type"), tc.code)
			}
			if tc.code == http.StatusRequestHeaderFieldsTooLarge && !strings.Contains(e.Error, "the limit is 1048576 bytes") {
				t.Fatalf("error %q", e.Error)
			}
		})
	}
}
