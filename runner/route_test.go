package runner

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestRouteShowsOneDecisionAndFreesItsBooking runs `epp route` against a running EPP: it prints
// the endpoint, worker id, dp rank, matched prefix and decision time, completes the response
// phase so the booking is freed, shows a load-only pick for a header-only request, and fails
// naming the status of a rejected request.
func TestRouteShowsOneDecisionAndFreesItsBooking(t *testing.T) {
	dir := t.TempDir()
	// Approximate mode: the first booking teaches the index its prefix.
	inst, _ := startApproximate(t, "- {worker_id: 1, model_name: '"+e2eModel+"', endpoint: 'http://127.0.0.1:18401', block_size: 16}\n")
	body := filepath.Join(dir, "req.json")
	prompt := strings.Repeat("Tell me about the history of the endpoint picker. ", 8)
	if err := os.WriteFile(body, []byte(`{"model":"`+e2eModel+`","messages":[{"role":"user","content":"`+prompt+`"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	route := func(args ...string) (string, error) {
		var out bytes.Buffer
		err := RunRoute(context.Background(), append([]string{"--addr", inst.Addrs().GRPC}, args...), &out, &out)
		return out.String(), err
	}
	field := func(out, name string) string {
		m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\s+(.+)$`).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("no %q line in:\n%s", name, out)
		}
		return m[1]
	}

	first, err := route("--body", body)
	if err != nil {
		t.Fatalf("route: %v\n%s", err, first)
	}
	if field(first, "endpoint") != "127.0.0.1:18401" || field(first, "worker_id") != "1" || field(first, "dp_rank") != "0" {
		t.Fatalf("decision:\n%s", first)
	}
	if !regexp.MustCompile(`^0 of \d+ prompt tokens`).MatchString(field(first, "matched prefix")) ||
		!regexp.MustCompile(`^\d+(\.\d+)? ms$`).MatchString(field(first, "decision time")) ||
		!strings.Contains(field(first, "booking"), "freed") {
		t.Fatalf("decision:\n%s", first)
	}
	waitNoLoad(t, inst.Addrs().Selection)

	second, err := route("--body", body)
	if err != nil {
		t.Fatalf("route: %v\n%s", err, second)
	}
	m := regexp.MustCompile(`^(\d+) of (\d+) prompt tokens`).FindStringSubmatch(field(second, "matched prefix"))
	if m == nil {
		t.Fatalf("decision:\n%s", second)
	}
	if matched, _ := strconv.Atoi(m[1]); matched < 16 {
		t.Fatalf("the second identical request matched %s tokens, want the first one's prefix:\n%s", m[1], second)
	}
	waitNoLoad(t, inst.Addrs().Selection)

	t.Run("a header-only request is a load-only pick", func(t *testing.T) {
		out, err := route("--method", "GET", "--path", "/v1/models")
		if err != nil || field(out, "endpoint") != "127.0.0.1:18401" || !strings.Contains(field(out, "matched prefix"), "load-only") {
			t.Fatalf("route: %v\n%s", err, out)
		}
	})
	t.Run("a rejected request fails naming the status", func(t *testing.T) {
		bad := filepath.Join(dir, "bad.json")
		if err := os.WriteFile(bad, []byte(`{"model":"nope","messages":[{"role":"user","content":"q"}]}`), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := route("--body", bad)
		if err == nil || !strings.Contains(err.Error(), "404") || !strings.Contains(out, `model \"nope\" is not served`) {
			t.Fatalf("route: %v\n%s", err, out)
		}
	})
	t.Run("the --tls hint comes only with a transport mismatch", func(t *testing.T) {
		_, err := route("--tls", "--body", body) // TLS against the plaintext EPP
		if err == nil || !strings.Contains(err.Error(), "drop --tls") {
			t.Fatalf("TLS to a plaintext EPP: %v, want the hint to drop --tls", err)
		}
		var out bytes.Buffer
		ln, lerr := net.Listen("tcp", "127.0.0.1:0")
		if lerr != nil {
			t.Fatal(lerr)
		}
		free := ln.Addr().String()
		ln.Close()
		err = RunRoute(context.Background(), []string{"--addr", free, "--timeout", "2s", "--body", body}, &out, &out)
		if err == nil || strings.Contains(err.Error(), "--tls") {
			t.Fatalf("nothing listening: %v, want an error without the TLS hint", err)
		}
		if _, err := route("--timeout", "0s"); err == nil || !strings.Contains(err.Error(), "--timeout") {
			t.Fatalf("--timeout 0s: %v", err)
		}
	})
	t.Run("a body file that does not exist is an error naming it", func(t *testing.T) {
		if _, err := route("--body", filepath.Join(dir, "missing.json")); err == nil || !strings.Contains(err.Error(), "missing.json") {
			t.Fatalf("error %v", err)
		}
	})
}
