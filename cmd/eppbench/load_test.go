package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"

	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/internal/benchbody"
	"github.com/kvepp/kvepp/internal/sharedtest"
)

// fakeEPP is a minimal ext_proc server that routes every request to one endpoint at the end of
// its body and answers the body the way a kind of EPP does: echo re-streams it (kvepp, and what
// Envoy's FULL_DUPLEX_STREAMED mode expects), continueBody answers each chunk with a CONTINUE
// (the Gateway API Inference Extension's lightweight EPP). reject answers 503 instead of routing.
type fakeEPP struct {
	extprocv3.UnimplementedExternalProcessorServer
	echo, reject bool
}

func (f *fakeEPP) Process(ps extprocv3.ExternalProcessor_ProcessServer) error {
	for {
		req, err := ps.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		var out []*extprocv3.ProcessingResponse
		switch r := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestBody:
			if r.RequestBody.GetEndOfStream() {
				if f.reject {
					return ps.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
						ImmediateResponse: &extprocv3.ImmediateResponse{Body: []byte("no workers")}}})
				}
				out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
					RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
						HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
							Header: &corev3.HeaderValue{Key: extproctest.DestinationKey, RawValue: []byte("10.0.0.1:8000")}}}},
					}}}})
			}
			body := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}
			if f.echo {
				body.Response.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
					StreamedResponse: &extprocv3.StreamedBodyResponse{Body: r.RequestBody.GetBody(), EndOfStream: r.RequestBody.GetEndOfStream()}}}
			}
			out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: body}})
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
				ResponseHeaders: &extprocv3.HeadersResponse{}}})
		case *extprocv3.ProcessingRequest_ResponseBody:
			out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
				ResponseBody: &extprocv3.BodyResponse{}}})
		}
		for _, m := range out {
			if err := ps.Send(m); err != nil {
				return err
			}
		}
	}
}

func serveFake(t testing.TB, f *fakeEPP) extprocv3.ExternalProcessorClient {
	conn := extproctest.Serve(t, func(g *grpc.Server) { extprocv3.RegisterExternalProcessorServer(g, f) })
	return extprocv3.NewExternalProcessorClient(conn)
}

// TestExchangeWorksWithBothBodyReplyStyles plays a multi-chunk body against an echoing and a
// continuing server: both exchanges complete with a decision time, and a rejecting server is an
// error naming the status.
func TestExchangeWorksWithBothBodyReplyStyles(t *testing.T) {
	body := benchbody.Conversation("m", 6, 8000) // about 48 KB: three chunks
	ctx := context.Background()
	for _, f := range []*fakeEPP{{echo: true}, {echo: false}} {
		c := serveFake(t, f)
		tm, err := doExchange(ctx, c, loadRequest{Path: "/v1/chat/completions", Body: body, RequestID: "r1"})
		if err != nil || tm.Decision <= 0 || tm.Total < tm.Decision {
			t.Fatalf("echo=%v: %+v %v", f.echo, tm, err)
		}
	}
	_, err := doExchange(ctx, serveFake(t, &fakeEPP{reject: true}), loadRequest{Path: "/v1/chat/completions", Body: body, RequestID: "r2"})
	if err == nil || !strings.Contains(err.Error(), "immediate response") {
		t.Fatalf("rejected exchange: %v", err)
	}
}

// TestLoadBodiesAreUniquePerRequest: the marker makes the last message of every request
// differ, at its start, and the body stays valid JSON of the same shape.
func TestLoadBodiesAreUniquePerRequest(t *testing.T) {
	shared := sharedtest.Path(t)
	for _, spec := range []string{"chat-long", "conv:turns=3,turn-bytes=400", "completion-plain"} {
		b, err := parseLoadBody(spec, shared)
		if err != nil {
			t.Fatal(err)
		}
		a1, a2 := b.bytesFor(true, "r1", 1), b.bytesFor(true, "r1", 2)
		if bytes.Equal(a1, a2) || bytes.Equal(a1, b.Raw) || !bytes.Equal(b.bytesFor(false, "r1", 1), b.Raw) {
			t.Fatalf("%s: bodies not unique per request", spec)
		}
		if _, err := benchbody.New(a1, ""); err != nil {
			t.Fatalf("%s: marked body invalid: %v", spec, err)
		}
	}
	if _, err := parseLoadBody("conv:turns=0", shared); err == nil {
		t.Fatal("conv:turns=0 accepted")
	}
	if _, err := parseLoadBody("no-such-vector", shared); err == nil || !strings.Contains(err.Error(), "chat-long") {
		t.Fatalf("unknown vector: %v", err)
	}
}

// TestLoadRunsSideBySideAndPrintsTheTable runs the command against two fake servers and checks
// the table's rows, ratios and that a failing target fails the run.
func TestLoadRunsSideBySideAndPrintsTheTable(t *testing.T) {
	echo := extproctest.Serve(t, func(g *grpc.Server) { extprocv3.RegisterExternalProcessorServer(g, &fakeEPP{echo: true}) })
	cont := extproctest.Serve(t, func(g *grpc.Server) { extprocv3.RegisterExternalProcessorServer(g, &fakeEPP{}) })
	var out, errOut bytes.Buffer
	args := []string{"--target", "a=" + echo.Target(), "--target", "b=" + cont.Target(),
		"--body", "conv:turns=2,turn-bytes=300", "--concurrency", "1,2", "--duration", "150ms", "--warmup", "20ms",
		"--rounds", "2", "--shared", sharedtest.Path(t)}
	if code := runLoadCommand(context.Background(), args, &out, &errOut); code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 4 || !strings.Contains(lines[0], "a/b exch/s") || !strings.Contains(lines[2], "| 1 |") || !strings.Contains(lines[3], "| 2 |") {
		t.Fatalf("table:\n%s", out.String())
	}
	rej := extproctest.Serve(t, func(g *grpc.Server) { extprocv3.RegisterExternalProcessorServer(g, &fakeEPP{reject: true}) })
	args[1] = "a=" + rej.Target()
	errOut.Reset()
	if code := runLoadCommand(context.Background(), args, io.Discard, &errOut); code != 1 || !strings.Contains(errOut.String(), "first exchange failed") {
		t.Fatalf("a rejecting target: exit %d, %s", code, errOut.String())
	}
	if code := runLoadCommand(context.Background(), []string{"--body", "chat-long"}, io.Discard, io.Discard); code != 2 {
		t.Fatalf("no --target: exit %d", code)
	}
}

// BenchmarkLoadClient measures the load generator's exchange against an in-process fake EPP that
// does nothing but answer (so the figures are the transport and the client): doExchange against
// an echoing and a continuing server, and extproctest's Envoy emulator against the echoing one,
// for the 12 KB golden chat-long body. Compare their ns/op and allocations to see what the
// emulator would add to `eppbench load` and what re-streaming the body costs the transport.
func BenchmarkLoadClient(b *testing.B) {
	body := sharedtest.RequestVectorNamed(b, "chat-long").Body
	ctx := context.Background()
	req := loadRequest{Path: "/v1/chat/completions", Body: body, RequestID: "bench"}
	for _, tc := range []struct {
		name string
		echo bool
	}{{"doExchange-echo", true}, {"doExchange-continue", false}} {
		c := serveFake(b, &fakeEPP{echo: tc.echo})
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := doExchange(ctx, c, req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	conn := extproctest.Serve(b, func(g *grpc.Server) { extprocv3.RegisterExternalProcessorServer(g, &fakeEPP{echo: true}) })
	em := extproctest.NewClient(conn)
	b.Run("emulator-echo", func(b *testing.B) {
		r := extproctest.Request{Body: body, Response: &extproctest.Response{ContentType: "text/event-stream", Chunks: loadResponseChunks}}
		b.ReportAllocs()
		for b.Loop() {
			if ex, err := em.Do(ctx, r); err != nil || ex.Destination == "" {
				b.Fatal(err)
			}
		}
	})
}

func TestLoadFlagsRefuseAmbiguousTargets(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--target", "kvepp=127.0.0.1:1", "--target", "kvepp=127.0.0.1:2"}, `the name "kvepp" is given twice`},
		{[]string{"--pid", "kvepp=1", "--target", "kvepp=127.0.0.1:1"}, `no --target named "kvepp" before it`},
	} {
		if _, err := parseLoadFlags(tc.args, io.Discard); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: error %v, want %q", tc.args, err, tc.want)
		}
	}
}

// A target whose every exchange failed has no latencies: its row shows "-" there, not 0.000 ms
// that reads like a measurement.
func TestLoadTableShowsNoLatencyWithoutExchanges(t *testing.T) {
	targets := []loadTarget{{Name: "kvepp"}, {Name: "lwepp"}}
	cells := []*loadCell{
		{Body: "chat-long", Turns: 1, BodyBytes: 12000, Concurrency: 8, Target: "kvepp", Errors: 40},
		{Body: "chat-long", Turns: 1, BodyBytes: 12000, Concurrency: 8, Target: "lwepp", Exchanges: 100,
			PerSecond: 50, DecisionP50Ms: 0.4, DecisionP99Ms: 1.5, ExchangeP50Ms: 2, ExchangeP99Ms: 7},
	}
	var out strings.Builder
	writeLoadTable(&out, cells, targets)
	rows := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(rows) != 3 {
		t.Fatalf("table has %d lines, want 3:\n%s", len(rows), out.String())
	}
	row := rows[2]
	if !strings.Contains(row, "| 0 (40 errors) | - | - | 50 | 0.400 / 1.500 | 2.000 / 7.000 |") {
		t.Errorf("row %q: the failed target must show no latencies, the other its own", row)
	}
	// Nor a decision-time ratio: 0 ms against the floor's 0.4 ms would read as 0.00×.
	if !strings.Contains(row, "| 0.00× | - |") {
		t.Errorf("row %q: the failed target's decision p50 ratio must be -", row)
	}
}
