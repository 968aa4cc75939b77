package extproc_test

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/picker"
)

// Tests of the fresh-user audit (issue 10) on the ext_proc side.

func compress(t *testing.T, enc string, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	var w interface {
		Write([]byte) (int, error)
		Close() error
	}
	switch enc {
	case "gzip":
		w = gzip.NewWriter(&buf)
	case "deflate":
		w = zlib.NewWriter(&buf)
	case "raw-deflate":
		fw, err := flate.NewWriter(&buf, flate.DefaultCompression)
		if err != nil {
			t.Fatal(err)
		}
		w = fw
	}
	if _, err := w.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// twoModels is a harness serving model "m" (workers 1-3) and "n" (worker 9), without DYN_MODEL_NAME.
func twoModels(t *testing.T, mutate func(*extproc.Config)) *harness {
	h := newHarness(t, mutate)
	h.pk.models = []string{"m", "n"}
	h.pk.workers["n"] = []picker.WorkerState{worker(9, "n", "http://10.0.0.9:8000")}
	return h
}

func TestLoadOnlyPicksUseTheRequestsModel(t *testing.T) {
	none := &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_NONE, ResponseBodyMode: filterv3.ProcessingMode_NONE}
	modelHeader := []extproctest.Header{{Key: "x-gateway-model-name", Value: "n"}}
	for _, tc := range []struct {
		name string
		req  extproctest.Request
	}{
		{"a header-only GET /v1/models with x-gateway-model-name", extproctest.Request{Method: "GET", Path: "/v1/models", HeaderOnly: true, Headers: modelHeader}},
		{"request body mode NONE with x-gateway-model-name", extproctest.Request{Body: []byte(`{"model":"m","messages":[]}`), ProtocolConfig: none, Headers: modelHeader}},
		{"an undecodable gzip body of another path with x-gateway-model-name", extproctest.Request{Path: "/v1/embeddings", Body: []byte{0x1f, 0x8b, 0x08},
			Headers: append([]extproctest.Header{{Key: "content-encoding", Value: "gzip"}}, modelHeader...)}},
		{"a body in an unsupported encoding with x-gateway-model-name", extproctest.Request{Body: []byte("??"),
			Headers: append([]extproctest.Header{{Key: "content-encoding", Value: "br"}}, modelHeader...)}},
		{"the header wins over the body's model", extproctest.Request{Path: "/v1/embeddings", Body: []byte(`{"model":"m","input":"x"}`), Headers: modelHeader}},
		{"a gzip body of another path names its model", extproctest.Request{Path: "/v1/embeddings",
			Body: compress(t, "gzip", []byte(`{"model":"n","input":"x"}`)), Headers: []extproctest.Header{{Key: "content-encoding", Value: "gzip"}}}},
	} {
		t.Run(tc.name+" picks among that model's workers", func(t *testing.T) {
			h := twoModels(t, nil)
			ex := h.do(t, tc.req)
			_, loads, _, _, _ := h.pk.snapshot()
			if ex.Immediate != nil || len(loads) != 1 {
				t.Fatalf("immediate %+v, load-only calls %+v", ex.Immediate, loads)
			}
			if loads[0].model != "n" || !slices.Equal(loads[0].allowed, []uint64{9}) || ex.Destination != "10.0.0.9:8000" {
				t.Fatalf("load-only call %+v → %q, want model n's worker 9", loads[0], ex.Destination)
			}
		})
	}
	t.Run("DYN_MODEL_NAME is the fallback when the request names no model", func(t *testing.T) {
		h := twoModels(t, func(c *extproc.Config) { c.ModelName = "n" })
		h.do(t, extproctest.Request{Method: "GET", Path: "/v1/models", HeaderOnly: true})
		if _, loads, _, _, _ := h.pk.snapshot(); len(loads) != 1 || loads[0].model != "n" {
			t.Fatalf("load-only calls %+v", loads)
		}
	})
	t.Run("a named model that is not served is a 404, not a pick among every model", func(t *testing.T) {
		h := twoModels(t, nil)
		ex := h.do(t, extproctest.Request{Method: "GET", Path: "/v1/models", HeaderOnly: true,
			Headers: []extproctest.Header{{Key: "x-gateway-model-name", Value: "x"}}})
		checkImmediate(t, ex, 404, "model_not_found", `model "x" is not served`)
	})
}

func TestCompressedBodiesAreRoutedLikePlainOnes(t *testing.T) {
	plain := []byte(`{"model":"n","messages":[{"role":"user","content":"hello"}]}`)
	for _, enc := range []string{"gzip", "deflate", "raw-deflate"} {
		t.Run(enc+" is decoded, tokenized and booked in the body's partition", func(t *testing.T) {
			h := twoModels(t, nil)
			header := enc
			if enc == "raw-deflate" {
				header = "deflate"
			}
			body := compress(t, enc, plain)
			ex := h.do(t, extproctest.Request{Body: body, Headers: []extproctest.Header{{Key: "content-encoding", Value: header}}, Response: okResponse()})
			selects, loads, _, _, _ := h.pk.snapshot()
			if ex.Immediate != nil || len(loads) != 0 || len(selects) != 1 || selects[0].ModelName != "n" {
				t.Fatalf("immediate %+v, selects %+v, load-only %+v", ex.Immediate, selects, loads)
			}
			if calls := h.tok.snapshot(); len(calls) != 1 || calls[0].body != string(plain) {
				t.Fatalf("tokenizer calls %+v, want the decoded body", calls)
			}
			if !bytes.Equal(ex.Body, body) {
				t.Fatalf("forwarded body %q, want the original compressed bytes", ex.Body)
			}
			h.pk.waitSettled(t)
		})
	}
	t.Run("a tenant rewrite of a gzip body forwards it decoded without content-encoding", func(t *testing.T) {
		h := twoModels(t, nil)
		ex := h.do(t, extproctest.Request{Body: compress(t, "gzip", plain), Response: okResponse(), Headers: []extproctest.Header{
			{Key: "content-encoding", Value: "gzip"}, {Key: "x-tenant-id", Value: "t1"}}})
		if ex.Immediate != nil || !bytes.Contains(ex.Body, []byte(`"cache_salt":"t1"`)) || !slices.Contains(ex.RemovedHeaders, "content-encoding") {
			t.Fatalf("immediate %+v, body %q, removed %v", ex.Immediate, ex.Body, ex.RemovedHeaders)
		}
		if ex.SetHeaders["content-length"] != "" && ex.SetHeaders["content-length"] != strconv.Itoa(len(ex.Body)) {
			t.Fatalf("content-length %q for %d bytes", ex.SetHeaders["content-length"], len(ex.Body))
		}
		h.pk.waitSettled(t)
	})
	t.Run("a body that decodes beyond the body limit is a 413", func(t *testing.T) {
		h := twoModels(t, func(c *extproc.Config) { c.MaxRequestBodyBytes = 4096 })
		bomb := compress(t, "gzip", append([]byte(`{"model":"n","messages":[{"role":"user","content":"`), bytes.Repeat([]byte("a"), 1<<20)...))
		ex := h.do(t, extproctest.Request{Body: bomb, Headers: []extproctest.Header{{Key: "content-encoding", Value: "gzip"}}})
		checkImmediate(t, ex, 413, "request_too_large", "decoded request body exceeds 4096 bytes")
	})
}

func TestAChatBodyWithoutAModelAmongSeveralIsA400(t *testing.T) {
	h := twoModels(t, nil)
	ex := h.do(t, extproctest.Request{Body: []byte(`{"messages":[{"role":"user","content":"q"}]}`)})
	checkImmediate(t, ex, 400, "invalid_request_error",
		`the request names no model and 2 models are served; set "model" (or DYN_MODEL_NAME)`)
	t.Run("x-gateway-model-name names it when the body does not", func(t *testing.T) {
		h := twoModels(t, nil)
		h.do(t, extproctest.Request{Body: []byte(`{"messages":[{"role":"user","content":"q"}]}`), Response: okResponse(),
			Headers: []extproctest.Header{{Key: "x-gateway-model-name", Value: "n"}}})
		if selects, _, _, _, _ := h.pk.snapshot(); len(selects) != 1 || selects[0].ModelName != "n" {
			t.Fatalf("selects %+v", selects)
		}
	})
}

func TestBodyModelNamesAreValidated(t *testing.T) {
	for _, tc := range []struct{ name, model, want string }{
		{"a NUL", `m\u0000`, "control character U+0000"},
		{"a 1 MB name", strings.Repeat("x", 1<<20), "the limit is 256 bytes"},
		{"a lone surrogate", `m\udc80`, "UTF-8"},
	} {
		t.Run("a model with "+tc.name+" is a 400", func(t *testing.T) {
			h := newHarness(t, func(c *extproc.Config) { c.ModelName = "m" })
			ex := h.do(t, extproctest.Request{Body: []byte(`{"model":"` + tc.model + `","messages":[{"role":"user","content":"q"}]}`)})
			checkImmediate(t, ex, 400, "invalid_request_error", tc.want)
			if len(ex.Immediate.Body) > 600 {
				t.Fatalf("error body of %d bytes echoes the model", len(ex.Immediate.Body))
			}
		})
	}
}

func TestDeeplyNestedJSONIsReportedAsTooDeep(t *testing.T) {
	h := newHarness(t, nil)
	deep := `{"model":"m","messages":[{"role":"user","content":"q"}],"x":` + strings.Repeat("[", 10001) + strings.Repeat("]", 10001) + `}`
	ex := h.do(t, extproctest.Request{Body: []byte(deep)})
	checkImmediate(t, ex, 400, "invalid_request_error", "request body nests JSON deeper than 10000 levels")
}

func TestABodyOfTooManyValuesIsRefused(t *testing.T) {
	h := newHarness(t, nil)
	for name, junk := range map[string]string{
		"content parts":                     strings.Repeat(`{"type":"text","text":"x"},`, extproc.MaxBodyValues/2) + `{"type":"text","text":"x"}`,
		"numbers in a field no one renders": `{"type":"text","text":"x","junk":[` + strings.Repeat("0,", extproc.MaxBodyValues) + `0]}`,
	} {
		t.Run(name, func(t *testing.T) {
			body := `{"model":"m","messages":[{"role":"user","content":[` + junk + `]}]}`
			ex := h.do(t, extproctest.Request{Body: []byte(body)})
			checkImmediate(t, ex, 400, "invalid_request_error", "request body has more than 250000 JSON values")
		})
	}
}

func TestTheRoutingReplyCarriesTheDecisionOnRequest(t *testing.T) {
	h := newHarness(t, nil)
	ask := []extproctest.Header{{Key: extproc.DecisionHeader, Value: "1"}}
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":"hello"}]}`)
	ex := h.do(t, extproctest.Request{Body: chat, Headers: ask, Response: okResponse()})
	d := ex.DynamicMetadata.GetFields()[extproc.DecisionMetadataNamespace].GetStructValue().GetFields()
	if d["matched_tokens"].GetNumberValue() != 32 || d["booked"].GetBoolValue() != true || d["prompt_tokens"] == nil {
		t.Fatalf("decision metadata %v", d)
	}
	if !slices.Contains(ex.RemovedHeaders, extproc.DecisionHeader) {
		t.Fatalf("%s is forwarded: removed %v", extproc.DecisionHeader, ex.RemovedHeaders)
	}
	if ex.RoutingLatency <= 0 {
		t.Fatalf("routing latency %v", ex.RoutingLatency)
	}
	load := h.do(t, extproctest.Request{Method: "GET", Path: "/v1/models", HeaderOnly: true, Headers: ask})
	if d := load.DynamicMetadata.GetFields()[extproc.DecisionMetadataNamespace].GetStructValue().GetFields(); d == nil || d["booked"].GetBoolValue() {
		t.Fatalf("load-only decision metadata %v", d)
	}
	plain := h.do(t, extproctest.Request{Body: chat, Response: okResponse()})
	if _, ok := plain.DynamicMetadata.GetFields()[extproc.DecisionMetadataNamespace]; ok {
		t.Fatal("the decision metadata was sent unasked")
	}
}

// openStream opens a raw Process stream on h.
func openStream(t *testing.T, h *harness) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	ps, err := h.client.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return ps
}

func send(t *testing.T, ps extprocv3.ExternalProcessor_ProcessClient, msgs ...*extprocv3.ProcessingRequest) {
	t.Helper()
	for _, m := range msgs {
		if err := ps.Send(m); err != nil {
			t.Fatal(err)
		}
	}
}

func recv(t *testing.T, ps extprocv3.ExternalProcessor_ProcessClient) *extprocv3.ProcessingResponse {
	t.Helper()
	m, err := ps.Recv()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	return m
}

func postHeaders(path string, extra ...extproctest.Header) *extprocv3.ProcessingRequest {
	return extproctest.RequestHeaders(false, append([]extproctest.Header{
		{Key: ":method", Value: "POST"}, {Key: ":path", Value: path}, {Key: "content-type", Value: "application/json"}}, extra...)...)
}

func TestBodiesThatNeverReachEndOfStream(t *testing.T) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hello"}]}`)
	t.Run("a body that reaches its declared content-length is routed without end_of_stream", func(t *testing.T) {
		h := newHarness(t, nil)
		ps := openStream(t, h)
		send(t, ps, postHeaders("/v1/chat/completions", extproctest.Header{Key: "content-length", Value: strconv.Itoa(len(body))}),
			extproctest.RequestBody(body[:10], false), extproctest.RequestBody(body[10:], false))
		if hr := recv(t, ps).GetRequestHeaders(); hr == nil || hr.GetResponse().GetHeaderMutation() == nil {
			t.Fatal("no routing reply")
		}
		sr := recv(t, ps).GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if !bytes.Equal(sr.GetBody(), body) || sr.GetEndOfStream() {
			t.Fatalf("re-streamed body %q eos %v; the end of stream is the request's own", sr.GetBody(), sr.GetEndOfStream())
		}
		// The end of stream Envoy may still send is the body's natural end, passed on, not a duplicate.
		send(t, ps, extproctest.RequestBody(nil, true))
		if sr := recv(t, ps).GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse(); len(sr.GetBody()) != 0 || !sr.GetEndOfStream() {
			t.Fatalf("the request's end of stream was not passed on: %v", sr)
		}
		send(t, ps, extproctest.ResponseHeaders(true, extproctest.Header{Key: ":status", Value: "200"}))
		if recv(t, ps).GetResponseHeaders() == nil {
			t.Fatal("no response headers reply")
		}
		_ = ps.CloseSend()
		h.pk.waitSettled(t)
		if n := h.srv.Metrics().Snapshot().DuplicateEOS; n != 0 {
			t.Fatalf("duplicate EOS counted %d times", n)
		}
	})
	t.Run("an upgrade request on an inference path is a 400", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{Body: body, Headers: []extproctest.Header{{Key: "connection", Value: "keep-alive, Upgrade"}, {Key: "upgrade", Value: "websocket"}}})
		checkImmediate(t, ex, 400, "invalid_request_error", "upgrade")
		if selects, loads, _, _, _ := h.pk.snapshot(); len(selects)+len(loads) != 0 {
			t.Fatal("an upgrade request was picked")
		}
	})
	t.Run("an upgrade request on another path is picked at its headers and its stream is echoed", func(t *testing.T) {
		h := newHarness(t, nil)
		ps := openStream(t, h)
		send(t, ps, extproctest.RequestHeaders(false, extproctest.Header{Key: ":method", Value: "GET"}, extproctest.Header{Key: ":path", Value: "/ws"},
			extproctest.Header{Key: "connection", Value: "upgrade"}, extproctest.Header{Key: "upgrade", Value: "websocket"}))
		if hr := recv(t, ps).GetRequestHeaders(); hr == nil || hr.GetResponse().GetHeaderMutation() == nil {
			t.Fatal("no routing reply at the headers")
		}
		send(t, ps, extproctest.RequestBody([]byte("frame"), false))
		if sr := recv(t, ps).GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse(); string(sr.GetBody()) != "frame" || sr.GetEndOfStream() {
			t.Fatalf("echo %q eos %v", sr.GetBody(), sr.GetEndOfStream())
		}
		_ = ps.CloseSend()
	})
	t.Run("a body without end of stream or length is a 408 after the bound", func(t *testing.T) {
		h := newHarness(t, func(c *extproc.Config) { c.RequestBodyTimeout = 100 * time.Millisecond })
		ps := openStream(t, h)
		send(t, ps, postHeaders("/v1/chat/completions"), extproctest.RequestBody(body, false))
		ir := recv(t, ps).GetImmediateResponse()
		if ir == nil || ir.GetStatus().GetCode() != 408 || !strings.Contains(string(ir.GetBody()), "DYN_EPP_REQUEST_BODY_TIMEOUT_SECS") {
			t.Fatalf("immediate response %v", ir)
		}
		if selects, _, _, _, _ := h.pk.snapshot(); len(selects) != 0 {
			t.Fatal("a timed-out body was picked")
		}
	})
}
