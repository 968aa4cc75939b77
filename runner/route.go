package runner

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
)

// RouteCommand is the subcommand that plays Envoy for one request against a running EPP.
const RouteCommand = "route"

// routeResponse is the upstream response `epp route` plays after the routing reply, so the EPP
// sees a complete response phase (prefill complete, then the end that frees the booking).
var routeResponse = &extproctest.Response{Status: 200, Chunks: [][]byte{[]byte(`{"object":"epp-route"}`)}}

// headerFlags collects repeated --header "name: value" flags.
type headerFlags []extproctest.Header

// String implements flag.Value.
func (h *headerFlags) String() string { return fmt.Sprint(*h) }

// Set implements flag.Value: "name: value", the name lower-cased as Envoy sends it.
func (h *headerFlags) Set(s string) error {
	name, value, ok := strings.Cut(s, ":")
	if !ok || strings.TrimSpace(name) == "" {
		return fmt.Errorf("header %q is not name: value", s)
	}
	*h = append(*h, extproctest.Header{Key: strings.ToLower(strings.TrimSpace(name)), Value: strings.TrimSpace(value)})
	return nil
}

// RunRoute is `epp route`: it plays Envoy's ext_proc filter for one HTTP request against a
// running EPP (extproctest's emulator), prints the routing decision — endpoint, worker id, dp rank,
// matched prefix (tokens of the prompt already cached on the chosen worker) and decision time
// (the request's end to the routing reply) — then plays a short 200 response so the EPP completes
// the response phase and frees the booking. Without --body the request is header-only (a
// load-only pick). The decision goes to stdout, usage to stderr. A request the EPP rejects is
// printed and returned as an error naming its status; -h returns nil.
func RunRoute(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("epp route", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", "127.0.0.1:9002", "ext_proc address (host:port) of the running EPP")
	path := fs.String("path", "/v1/chat/completions", "request :path")
	method := fs.String("method", "POST", "request :method")
	bodyFile := fs.String("body", "", "file with the request body (- for standard input); none sends a header-only request")
	useTLS := fs.Bool("tls", false, "TLS without certificate verification, for an EPP with DYN_EPP_SECURE_SERVING=true (its default self-signed certificate)")
	timeout := fs.Duration("timeout", 30*time.Second, "bound on the whole exchange")
	var headers headerFlags
	fs.Var(&headers, "header", `extra request header "name: value" (repeatable), e.g. "x-tenant-id: t1"`)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "Usage: epp route [flags]\n\nPlays Envoy for one request against a running EPP and prints the routing decision.\n\nFlags:")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("route: unexpected argument %q", fs.Arg(0))
	}
	if *timeout <= 0 {
		return fmt.Errorf("route: --timeout %v must be > 0", *timeout)
	}
	headers = append(headers, extproctest.Header{Key: extproc.DecisionHeader, Value: "1"}) // ask for the decision metadata
	req := extproctest.Request{Method: *method, Path: *path, Headers: headers, HeaderOnly: *bodyFile == "", Response: routeResponse}
	if *bodyFile != "" {
		var err error
		if *bodyFile == "-" {
			req.Body, err = io.ReadAll(os.Stdin)
		} else {
			req.Body, err = os.ReadFile(*bodyFile)
		}
		if err != nil {
			return fmt.Errorf("route: --body: %w", err)
		}
	}
	creds := insecure.NewCredentials()
	if *useTLS {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) // the EPP's self-signed certificate, as Envoy is configured
	}
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return fmt.Errorf("route: --addr %q: %w", *addr, err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	ex, err := extproctest.NewClient(conn).Do(ctx, req)
	if err != nil {
		if !transportMismatch(err) {
			return fmt.Errorf("route: ext_proc exchange with %s: %w", *addr, err)
		}
		hint := "is --addr the EPP's ext_proc port (DYN_EPP_GRPC_PORT, 9002), not its HTTP or sync port? is the EPP serving TLS (DYN_EPP_SECURE_SERVING=true, the default)? then add --tls"
		if *useTLS {
			hint = "is --addr the EPP's ext_proc port (DYN_EPP_GRPC_PORT, 9002)? is the EPP serving plaintext (DYN_EPP_SECURE_SERVING=false)? then drop --tls"
		}
		return fmt.Errorf("route: ext_proc exchange with %s: %w (%s)", *addr, err, hint)
	}
	if im := ex.Immediate; im != nil {
		fmt.Fprintf(stdout, "%-15s %d %s\n", "rejected", im.Status, im.Body)
		return fmt.Errorf("route: the EPP answered %d (%s)", im.Status, im.Headers[extproc.RejectReasonHeader])
	}
	printDecision(stdout, ex)
	return nil
}

// printDecision writes the routing decision of ex, one "name  value" line per field.
func printDecision(w io.Writer, ex *extproctest.Exchange) {
	line := func(name, format string, args ...any) {
		fmt.Fprintf(w, "%-15s "+format+"\n", append([]any{name}, args...)...)
	}
	line("endpoint", "%s", ex.Destination)
	line("worker_id", "%s", ex.SetHeaders["x-dynamo-worker-instance-id"])
	line("dp_rank", "%s", ex.SetHeaders["x-dynamo-dp-rank"])
	d := ex.DynamicMetadata.GetFields()[extproc.DecisionMetadataNamespace].GetStructValue().GetFields()
	booked := d["booked"].GetBoolValue()
	if booked {
		line("matched prefix", "%.0f of %.0f prompt tokens already cached on this worker",
			d["matched_tokens"].GetNumberValue(), d["prompt_tokens"].GetNumberValue())
	} else {
		line("matched prefix", "none: a load-only pick (no prompt was read: a header-only request, another path, or an unreadable body)")
	}
	line("decision time", "%.1f ms", float64(ex.RoutingLatency.Microseconds())/1000)
	if booked {
		line("booking", "freed: a 200 response was played to its end")
	} else {
		line("booking", "none (load-only picks book nothing)")
	}
}

// transportMismatch reports whether err looks like a plaintext client talking to a TLS server or
// the reverse (a broken HTTP/2 preface or TLS handshake), the one case the --tls hint is for; a
// refused connection or a timeout is not.
func transportMismatch(err error) bool {
	msg := err.Error()
	for _, s := range []string{"server preface", "tls:", "unknown service envoy.service.ext_proc", "first record does not look like a TLS handshake", "http2: frame too large", "connection reset by peer"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}
