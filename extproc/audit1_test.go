package extproc_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/internal/syncbuf"
)

// Tests of the second fresh-user audit (audit 1, finding 14) on the ext_proc side.

func TestSessionIDLimitNamesTheHeaderAndTheLength(t *testing.T) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hello"}]}`)
	for _, header := range []string{"x-dynamo-session-id", "x-dynamo-parent-session-id"} {
		t.Run(header, func(t *testing.T) {
			h := newHarness(t, nil)
			hs := []extproctest.Header{{Key: "x-dynamo-session-id", Value: "s"}, {Key: header, Value: strings.Repeat("s", 300)}}
			ex := h.do(t, extproctest.Request{Body: body, Headers: hs[len(hs)-1:]})
			if header != "x-dynamo-session-id" {
				ex = h.do(t, extproctest.Request{Body: body, Headers: hs})
			}
			checkImmediate(t, ex, 400, "invalid_request_error", header+" is 300 bytes long; the limit is 256 bytes")
		})
	}
}

// headerRouted plays request headers (FULL_DUPLEX_STREAMED, no end of stream) and requires the
// next reply — well before the 3 s body timeout — to be the routing reply (at the headers) or, with
// status, an ImmediateResponse of that status.
func headerRouted(t *testing.T, h *harness, status int, headers ...extproctest.Header) *extprocv3.ProcessingResponse {
	t.Helper()
	ps := openStream(t, h)
	send(t, ps, extproctest.RequestHeaders(false, headers...))
	start := time.Now()
	m := recv(t, ps)
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("the reply took %v: it waited for the body", took)
	}
	if status != 0 {
		if ir := m.GetImmediateResponse(); ir == nil || int(ir.GetStatus().GetCode()) != status {
			t.Fatalf("reply %v, want an ImmediateResponse %d", m, status)
		}
		return m
	}
	if hr := m.GetRequestHeaders(); hr == nil || hr.GetResponse().GetHeaderMutation() == nil {
		t.Fatalf("reply %v, want the routing reply at the headers", m)
	}
	// Whatever body message follows is the request's own and is passed through.
	send(t, ps, extproctest.RequestBody(nil, true))
	if sr := recv(t, ps).GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse(); len(sr.GetBody()) != 0 || !sr.GetEndOfStream() {
		t.Fatalf("the end of stream was not passed through: %v", sr)
	}
	_ = ps.CloseSend()
	return m
}

func TestRequestsDecidedAtTheirHeaders(t *testing.T) {
	slow := func(c *extproc.Config) { c.RequestBodyTimeout = 3 * time.Second; c.MaxRequestBodyBytes = 1000 }
	post := func(path string, extra ...extproctest.Header) []extproctest.Header {
		return append([]extproctest.Header{{Key: ":method", Value: "POST"}, {Key: ":path", Value: path},
			{Key: "content-type", Value: "application/json"}}, extra...)
	}
	t.Run("content-length 0 without end of stream on another path is routed at once (a load-only pick)", func(t *testing.T) {
		h := newHarness(t, slow)
		headerRouted(t, h, 0, post("/v1/files", extproctest.Header{Key: "content-length", Value: "0"})...)
		if _, loads, _, _, _ := h.pk.snapshot(); len(loads) != 1 {
			t.Fatalf("load-only picks %v", loads)
		}
	})
	t.Run("content-length 0 without end of stream on an inference path is the empty body's 400 at once", func(t *testing.T) {
		h := newHarness(t, slow)
		ir := headerRouted(t, h, 400, post("/v1/chat/completions", extproctest.Header{Key: "content-length", Value: "0"})...).GetImmediateResponse()
		if !strings.Contains(string(ir.GetBody()), "invalid_request_error") {
			t.Fatalf("400 body %s", ir.GetBody())
		}
	})
	t.Run("a declared content-length over the body limit is an immediate 413", func(t *testing.T) {
		h := newHarness(t, slow)
		headerRouted(t, h, 413, post("/v1/chat/completions", extproctest.Header{Key: "content-length", Value: strconv.Itoa(1001)})...)
		ir := headerRouted(t, h, 413, post("/v1/completions", extproctest.Header{Key: "content-length", Value: "5000000000"})...).GetImmediateResponse()
		if !strings.Contains(string(ir.GetBody()), "request body exceeds 1000 bytes: its content-length is 5000000000") {
			t.Fatalf("413 body %s", ir.GetBody())
		}
		if selects, loads, _, _, _ := h.pk.snapshot(); len(selects)+len(loads) != 0 {
			t.Fatal("an oversized request was picked")
		}
	})
	t.Run("CONNECT is routed at its headers and its stream passed through", func(t *testing.T) {
		h := newHarness(t, slow)
		headerRouted(t, h, 0, extproctest.Header{Key: ":method", Value: "CONNECT"}, extproctest.Header{Key: ":authority", Value: "upstream:443"})
	})
	t.Run("an extended CONNECT (a tunnel) is routed at its headers whatever its path", func(t *testing.T) {
		h := newHarness(t, slow)
		headerRouted(t, h, 0, extproctest.Header{Key: ":method", Value: "CONNECT"}, extproctest.Header{Key: ":path", Value: "/v1/chat/completions"},
			extproctest.Header{Key: ":protocol", Value: "websocket"})
	})
}

func TestCorruptCompressedBodiesOfInferenceRequestsAre400(t *testing.T) {
	plain := []byte(`{"model":"m","messages":[{"role":"user","content":"hello"}]}`)
	gz := compress(t, "gzip", plain)
	for _, tc := range []struct{ name, enc string }{{"gzip", "gzip"}, {"deflate", "deflate"}} {
		for _, body := range []struct {
			what string
			b    []byte
		}{{"truncated", compress(t, tc.enc, plain)[:12]}, {"corrupt", append([]byte{0x1f, 0x8b, 0x08, 0, 9, 9, 9, 9}, plain...)}} {
			t.Run("a "+body.what+" "+tc.name+" chat body", func(t *testing.T) {
				h := newHarness(t, nil)
				ex := h.do(t, extproctest.Request{Body: body.b, Headers: []extproctest.Header{{Key: "content-encoding", Value: tc.enc}}})
				checkImmediate(t, ex, 400, "invalid_request_error", "content-encoding "+tc.enc)
				if selects, loads, _, _, _ := h.pk.snapshot(); len(selects)+len(loads) != 0 {
					t.Fatal("an undecodable body was picked")
				}
			})
		}
	}
	t.Run("another path keeps its load-only pick", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{Path: "/v1/embeddings", Body: gz[:12], Headers: []extproctest.Header{{Key: "content-encoding", Value: "gzip"}}})
		if _, loads, _, _, _ := h.pk.snapshot(); ex.Immediate != nil || len(loads) != 1 {
			t.Fatalf("immediate %+v, load-only picks %v", ex.Immediate, loads)
		}
	})
}

// TestLogLinesQuoteClientValuesBounded (finding 16): a 5 KB served-endpoint value and a 5 KB path
// reach the logs as bounded excerpts.
func TestLogLinesQuoteClientValuesBounded(t *testing.T) {
	var logs syncbuf.Buffer
	h := newCoreHarness(t, func(c *extproc.Config) { c.Logger = zerolog.New(&logs).Level(zerolog.DebugLevel) })
	ctx := context.Background()
	ps, _ := h.openRouted(t, ctx)
	rh := extproctest.ResponseHeaders(false, extproctest.Header{Key: ":status", Value: "200"})
	rh.MetadataContext = servedMetadata("10.9.9.9:8000" + strings.Repeat("x", 5000))
	sendAll(t, ps, rh)
	recvN(t, ps, 1)
	sendAll(t, ps, extproctest.ResponseBody(nil, true))
	recvN(t, ps, 1)
	_ = ps.CloseSend()
	h.waitIdle(t)
	long := "/v1/" + strings.Repeat("p", 5000) + "/chat/completions"
	if _, err := h.client.Do(ctx, extproctest.Request{Path: long, Body: []byte(`{"model":"m"}`)}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "served endpoint") || !strings.Contains(logs.String(), "request rejected") {
		t.Fatalf("the lines under test were not logged:\n%.2000s", logs.String())
	}
	for _, line := range strings.Split(logs.String(), "\n") {
		if len(line) > 1500 {
			t.Fatalf("log line of %d bytes: %.300s…", len(line), line)
		}
	}
}
