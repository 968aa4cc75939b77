package extproc_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/picker"
)

// immediateError decodes an ImmediateResponse body.
type immediateError struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	} `json:"error"`
}

// checkImmediate asserts the ImmediateResponse status, type, body shape and headers of epp.md §8.
func checkImmediate(t *testing.T, ex *extproctest.Exchange, wantStatus int, wantType, wantMsgPart string) {
	t.Helper()
	if ex.Immediate == nil {
		t.Fatalf("want ImmediateResponse %d, got routing reply (destination %q)", wantStatus, ex.Destination)
	}
	im := ex.Immediate
	if im.Status != wantStatus {
		t.Fatalf("status = %d, want %d (body %s)", im.Status, wantStatus, im.Body)
	}
	var body immediateError
	if err := json.Unmarshal(im.Body, &body); err != nil {
		t.Fatalf("body %q is not the error JSON: %v", im.Body, err)
	}
	if body.Error.Type != wantType || body.Error.Code != wantStatus {
		t.Fatalf("error = %+v, want type %q code %d", body.Error, wantType, wantStatus)
	}
	if !strings.Contains(body.Error.Message, wantMsgPart) {
		t.Fatalf("message %q does not contain %q", body.Error.Message, wantMsgPart)
	}
	if got := im.Headers["content-type"]; got != "application/json" {
		t.Fatalf("content-type = %q", got)
	}
	if got := im.Headers[extproc.RejectReasonHeader]; got != wantType {
		t.Fatalf("%s = %q, want %q", extproc.RejectReasonHeader, got, wantType)
	}
	if _, has := im.Headers["retry-after"]; has != (wantStatus == 429) {
		t.Fatalf("retry-after present = %v for status %d", has, wantStatus)
	}
	if wantStatus == 429 && im.Headers["retry-after"] != "1" {
		t.Fatalf("retry-after = %q, want 1", im.Headers["retry-after"])
	}
	if ex.Routing != nil || len(ex.BodyChunks) > 0 {
		t.Fatalf("a routing reply or body followed the ImmediateResponse")
	}
}

func TestARoutedChatRequestGetsTheFullRoutingReply(t *testing.T) {
	h := newHarness(t, nil)
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hello"}],"stream":true}`)
	ex := h.do(t, extproctest.Request{
		Body:     body,
		Headers:  []extproctest.Header{{Key: "x-request-id", Value: "client-id"}, {Key: "x-gateway-destination-endpoint", Value: "10.0.0.99:8000"}},
		Response: okResponse(),
	})
	if ex.Immediate != nil {
		t.Fatalf("unexpected ImmediateResponse %d %s", ex.Immediate.Status, ex.Immediate.Body)
	}
	want := map[string]string{
		"x-gateway-destination-endpoint": "10.0.0.1:8000",
		"x-dynamo-worker-instance-id":    "1",
		"x-dynamo-dp-rank":               "0",
		"x-dynamo-routing-mode":          "aggregated",
	}
	for k, v := range want {
		if ex.SetHeaders[k] != v {
			t.Errorf("header %s = %q, want %q", k, ex.SetHeaders[k], v)
		}
		if ex.SetHeaderActions[k] != corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD {
			t.Errorf("header %s append action = %v", k, ex.SetHeaderActions[k])
		}
	}
	if _, ok := ex.SetHeaders["x-request-id"]; ok {
		t.Errorf("x-request-id set although the client sent one")
	}
	if ex.MetadataDestination != ex.Destination {
		t.Errorf("metadata destination %q != header %q", ex.MetadataDestination, ex.Destination)
	}
	if !ex.ClearRouteCache {
		t.Errorf("clear_route_cache not set")
	}
	wantRemoved := []string{"x-gateway-destination-endpoint-subset", "x-gateway-destination-endpoint-served",
		"x-gateway-inference-fairness-id", "x-gateway-inference-objective", "x-gateway-model-name-rewrite",
		"x-prefiller-host-port", "x-worker-instance-id", "x-dynamo-prefill-instance-id", "x-dynamo-prefill-dp-rank"}
	if !slices.Equal(ex.RemovedHeaders, wantRemoved) {
		t.Errorf("remove_headers = %v", ex.RemovedHeaders)
	}
	if !bytes.Equal(ex.Body, body) || len(ex.BodyChunks) != 1 || !ex.BodyChunks[0].EndOfStream {
		t.Errorf("re-streamed body = %q in %d chunks", ex.Body, len(ex.BodyChunks))
	}
	var wantEcho []byte
	for _, c := range okResponse().Chunks {
		wantEcho = append(wantEcho, c...)
	}
	if !bytes.Equal(ex.ResponseEcho, wantEcho) || !ex.ResponseChunks[len(ex.ResponseChunks)-1].EndOfStream {
		t.Errorf("response echo = %q", ex.ResponseEcho)
	}
	selects, _, events, _, _ := h.pk.snapshot()
	if len(selects) != 1 {
		t.Fatalf("%d selects", len(selects))
	}
	id := selects[0].SelectionID
	if id == "client-id" || len(id) != 36 || id[14] != '4' {
		t.Errorf("selection id %q is not a fresh UUIDv4", id)
	}
	if want := []string{"select " + id, "prefill " + id, "free " + id}; !slices.Equal(events, want) {
		t.Errorf("events = %v, want %v", events, want)
	}
	h.pk.waitSettled(t)
	m := h.srv.Metrics().Snapshot()
	if m.Requests["success"] != 1 || m.UsagePromptTokens != 10 || m.UsageCompletionTokens != 2 {
		t.Errorf("metrics = %+v", m)
	}
}

func TestKnownBadInputs(t *testing.T) {
	type expect struct {
		routed   bool // booked pick
		loadOnly bool
		status   int // ImmediateResponse status, 0 when routed
		typ, msg string
	}
	cases := []struct {
		name string
		req  extproctest.Request
		want expect
	}{
		{"row 1: a chat body with messages and no prompt is routed",
			extproctest.Request{Body: []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)}, expect{routed: true}},
		{"row 1: a responses body with input is routed",
			extproctest.Request{Path: "/v1/responses", Body: []byte(`{"model":"m","input":"x"}`)}, expect{routed: true}},
		{"row 1: a responses body with input items and instructions is routed",
			extproctest.Request{Path: "/v1/responses", Body: []byte(`{"model":"m","instructions":"be brief","input":[{"role":"user","content":"x"}]}`)}, expect{routed: true}},
		{"row 1: a completion body with a prompt is routed",
			extproctest.Request{Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":"x"}`)}, expect{routed: true}},
		{"row 1: an embeddings body is load-only routed, not a 400",
			extproctest.Request{Path: "/v1/embeddings", Body: []byte(`{"model":"m","input":"x"}`)}, expect{loadOnly: true}},
		{"row 1: a conversations body is load-only routed, not a 400",
			extproctest.Request{Path: "/v1/conversations", Body: []byte(`{"items":[]}`)}, expect{loadOnly: true}},
		{"a GET on the chat path is load-only",
			extproctest.Request{Method: "GET", Path: "/v1/chat/completions", HeaderOnly: true}, expect{loadOnly: true}},
		{"a chat body in an encoding kvepp cannot read is load-only and not parsed",
			extproctest.Request{Body: []byte{0x1f, 0x8b, 0x08}, Headers: []extproctest.Header{{Key: "content-encoding", Value: "br"}}}, expect{loadOnly: true}},
		{"a chat body that does not decode as its gzip encoding is a 400",
			extproctest.Request{Body: []byte{0x1f, 0x8b, 0x08}, Headers: []extproctest.Header{{Key: "content-encoding", Value: "gzip"}}}, expect{status: 400, typ: "invalid_request_error", msg: "does not decode as its content-encoding gzip"}},
		{"an identity-encoded chat body is routed",
			extproctest.Request{Body: []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`), Headers: []extproctest.Header{{Key: "content-encoding", Value: "identity"}}}, expect{routed: true}},
		{"row 17: a header-only POST gets a load-only header reply",
			extproctest.Request{HeaderOnly: true}, expect{loadOnly: true}},
		{"row 18: a numeric model is a 400",
			extproctest.Request{Body: []byte(`{"model":123,"messages":[{"role":"user","content":"x"}]}`)}, expect{status: 400, typ: "invalid_request_error", msg: `"model" must be a string`}},
		{"row 21: an empty object on the chat path is a 400",
			extproctest.Request{Body: []byte(`{}`)}, expect{status: 400, typ: "invalid_request_error", msg: `"messages" is required`}},
		{"row 21: a non-JSON body on the chat path is a 400",
			extproctest.Request{Body: []byte(`hello`)}, expect{status: 400, typ: "invalid_request_error", msg: "not valid JSON"}},
		{"row 21: a JSON array on the chat path is a 400",
			extproctest.Request{Body: []byte(`[{"model":"m"}]`)}, expect{status: 400, typ: "invalid_request_error", msg: "must be a JSON object"}},
		{"an empty body on the chat path is a 400",
			extproctest.Request{Body: nil}, expect{status: 400, typ: "invalid_request_error", msg: "not valid JSON"}},
		{"empty messages are a 400",
			extproctest.Request{Body: []byte(`{"model":"m","messages":[]}`)}, expect{status: 400, typ: "invalid_request_error", msg: "must not be empty"}},
		{"messages that are not an array are a 400",
			extproctest.Request{Body: []byte(`{"model":"m","messages":"hi"}`)}, expect{status: 400, typ: "invalid_request_error", msg: "must be an array"}},
		{"a completion without prompt is a 400",
			extproctest.Request{Path: "/v1/completions", Body: []byte(`{"model":"m"}`)}, expect{status: 400, typ: "invalid_request_error", msg: `"prompt" is required`}},
		{"a completion prompt of mixed types is a 400",
			extproctest.Request{Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":["a",1]}`)}, expect{status: 400, typ: "invalid_request_error", msg: `"prompt" must be`}},
		{"a responses body with an object input is a 400",
			extproctest.Request{Path: "/v1/responses", Body: []byte(`{"model":"m","input":{}}`)}, expect{status: 400, typ: "invalid_request_error", msg: `"input" must be`}},
		{"an unknown model is a 404",
			extproctest.Request{Body: []byte(`{"model":"nope","messages":[{"role":"user","content":"x"}]}`)}, expect{status: 404, typ: "model_not_found", msg: `model "nope" is not served`}},
		{"a non-boolean stream is forwarded, not rejected",
			extproctest.Request{Body: []byte(`{"model":"m","stream":"true","temperature":99,"x":1,"messages":[{"role":"user","content":"x"}]}`)}, expect{routed: true}},
		{"row 25: a stateful responses request is load-only",
			extproctest.Request{Path: "/v1/responses", Body: []byte(`{"model":"m","previous_response_id":"resp_1","input":"more"}`)}, expect{loadOnly: true}},
		{"an over-long session id is a 400",
			extproctest.Request{Body: []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`), Headers: []extproctest.Header{{Key: "x-dynamo-session-id", Value: strings.Repeat("s", 257)}}}, expect{status: 400, typ: "invalid_request_error", msg: "256 bytes"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			tc.req.Response = okResponse()
			ex := h.do(t, tc.req)
			selects, loads, _, _, _ := h.pk.snapshot()
			switch {
			case tc.want.status != 0:
				checkImmediate(t, ex, tc.want.status, tc.want.typ, tc.want.msg)
				if len(selects)+len(loads) != 0 {
					t.Fatalf("a rejected request reached the picker: %d selects, %d load-only", len(selects), len(loads))
				}
			case tc.want.routed:
				if ex.Immediate != nil {
					t.Fatalf("ImmediateResponse %d %s", ex.Immediate.Status, ex.Immediate.Body)
				}
				if len(selects) != 1 || len(loads) != 0 || ex.Destination != "10.0.0.1:8000" {
					t.Fatalf("%d selects, %d load-only, destination %q", len(selects), len(loads), ex.Destination)
				}
			case tc.want.loadOnly:
				if ex.Immediate != nil {
					t.Fatalf("ImmediateResponse %d %s", ex.Immediate.Status, ex.Immediate.Body)
				}
				if len(selects) != 0 || len(loads) != 1 || ex.Destination != "10.0.0.1:8000" {
					t.Fatalf("%d selects, %d load-only, destination %q", len(selects), len(loads), ex.Destination)
				}
				if !tc.req.HeaderOnly && !bytes.Equal(ex.Body, tc.req.Body) {
					t.Fatalf("load-only body changed: %q", ex.Body)
				}
				if tc.req.HeaderOnly && len(ex.BodyChunks) != 0 {
					t.Fatalf("a header-only request got body chunks")
				}
				if len(h.tok.snapshot()) != 0 {
					t.Fatalf("a load-only request was tokenized")
				}
				if h.pk.count("prefill")+h.pk.count("free") != 0 {
					t.Fatalf("a load-only request made prefill/free calls")
				}
			}
			h.pk.waitSettled(t)
		})
	}
}

func TestTheReStreamedBodyIsChunkedAt62000Bytes(t *testing.T) {
	cases := []struct {
		size   int
		chunks []int
	}{
		{0, []int{0}},
		{100, []int{100}},
		{61999, []int{61999}},
		{62000, []int{62000}},
		{62001, []int{62000, 1}},
		{65536, []int{62000, 3536}},
		{124000, []int{62000, 62000}},
		{124001, []int{62000, 62000, 1}},
	}
	for _, tc := range cases {
		for _, inSize := range []int{16 << 10, 1 << 20} {
			t.Run(fmt.Sprintf("a %d-byte body sent in %d-byte chunks comes back as %v", tc.size, inSize, tc.chunks), func(t *testing.T) {
				h := newHarness(t, nil)
				req := extproctest.Request{ChunkSize: inSize, Response: okResponse()}
				if tc.size == 0 {
					req.Path = "/v1/embeddings" // an empty chat body would be a 400
				} else {
					req.Body = chatBody(tc.size)
				}
				ex := h.do(t, req)
				if ex.Immediate != nil {
					t.Fatalf("ImmediateResponse %d %s", ex.Immediate.Status, ex.Immediate.Body)
				}
				var got []int
				for i, c := range ex.BodyChunks {
					got = append(got, len(c.Body))
					if c.EndOfStream != (i == len(ex.BodyChunks)-1) {
						t.Fatalf("chunk %d end_of_stream = %v", i, c.EndOfStream)
					}
				}
				if !slices.Equal(got, tc.chunks) {
					t.Fatalf("chunks = %v, want %v", got, tc.chunks)
				}
				if !bytes.Equal(ex.Body, req.Body) {
					t.Fatalf("re-streamed body differs from the original")
				}
				h.pk.waitSettled(t)
			})
		}
	}
}

// responsesBody builds a multi-turn Responses-API body of about n bytes.
func responsesBody(n int) []byte {
	var b bytes.Buffer
	b.WriteString(`{"model":"m","instructions":"You are helpful.","input":[`)
	for i := 0; b.Len() < n; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		fmt.Fprintf(&b, `{"role":%q,"content":[{"type":"input_text","text":"turn %d %s"}]}`, role, i, strings.Repeat("lorem ipsum ", 40))
	}
	b.WriteString(`]}`)
	return b.Bytes()
}

func TestRow3ADuplicatedFinalChunkIsIgnored(t *testing.T) {
	h := newHarness(t, nil)
	body := responsesBody(1_200_000)
	ex := h.do(t, extproctest.Request{Path: "/v1/responses", Body: body, ChunkSize: 64 << 10, DuplicateEOS: true, Response: okResponse()})
	if ex.Immediate != nil {
		t.Fatalf("ImmediateResponse %d %s", ex.Immediate.Status, ex.Immediate.Body)
	}
	if !bytes.Equal(ex.Body, body) {
		t.Fatalf("re-streamed body (%d bytes) is not byte-identical to the original (%d bytes)", len(ex.Body), len(body))
	}
	if n := h.pk.count("select"); n != 1 {
		t.Fatalf("routed %d times, want once", n)
	}
	calls := h.tok.snapshot()
	if len(calls) != 1 || calls[0].kind != "responses" || calls[0].body != string(body) {
		t.Fatalf("tokenizer calls = %d", len(calls))
	}
	if got := h.srv.Metrics().Snapshot().DuplicateEOS; got != 1 {
		t.Fatalf("duplicate_eos_total = %d, want 1", got)
	}
	h.pk.waitSettled(t)
}

func TestRow12AClientDestinationHeaderIsOverwritten(t *testing.T) {
	h := newHarness(t, nil)
	ex := h.do(t, extproctest.Request{
		Body:     []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`),
		Headers:  []extproctest.Header{{Key: "x-gateway-destination-endpoint", Value: "10.0.0.99:8000"}, {Key: "x-gateway-destination-endpoint-subset", Value: "10.0.0.99:8000"}},
		Response: okResponse(),
	})
	if ex.Destination != "10.0.0.1:8000" || ex.SetHeaderActions["x-gateway-destination-endpoint"] != corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD {
		t.Fatalf("destination = %q (%v)", ex.Destination, ex.SetHeaderActions["x-gateway-destination-endpoint"])
	}
	if !slices.Contains(ex.RemovedHeaders, "x-gateway-destination-endpoint-subset") {
		t.Fatalf("client subset header not removed")
	}
	_, loads, _, _, _ := h.pk.snapshot()
	selects, _, _, _, _ := h.pk.snapshot()
	if len(loads) != 0 || selects[0].AllowedSet {
		t.Fatalf("the client subset header was used as a hint")
	}
	h.pk.waitSettled(t)
}

func TestRow16SubsetHints(t *testing.T) {
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	cases := []struct {
		name    string
		hint    any
		allowed []uint64 // nil → 503
	}{
		{"an empty list leaves no candidate", []string{}, nil},
		{"an empty string leaves no candidate", "", nil},
		{"entries with another port match by IP", []string{"10.0.0.2:9999"}, []uint64{2}},
		{"only unknown IPs leave no candidate", []string{"10.9.9.9:8000", "10.9.9.8:8000"}, nil},
		{"non-string entries are ignored", []any{1.0, true, "10.0.0.2:8000", nil}, []uint64{2}},
		{"the CSV string form is accepted", " 10.0.0.2:8000 , 10.0.0.1:8000 ", []uint64{1, 2}},
		{"a bare IP entry is accepted", []string{"10.0.0.2"}, []uint64{2}},
		{"an IPv6 entry matches the bracketed endpoint", []string{"[fd00:0::3]:8000"}, []uint64{3}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			ex := h.do(t, extproctest.Request{Body: chat, SubsetHint: tc.hint, Response: okResponse()})
			selects, _, _, _, _ := h.pk.snapshot()
			if tc.allowed == nil {
				checkImmediate(t, ex, 503, "service_unavailable", "subset hint")
				if len(selects) != 0 {
					t.Fatalf("picker called")
				}
				return
			}
			if ex.Immediate != nil {
				t.Fatalf("ImmediateResponse %d %s", ex.Immediate.Status, ex.Immediate.Body)
			}
			got := slices.Clone(selects[0].AllowedWorkerIDs)
			slices.Sort(got)
			if !selects[0].AllowedSet || !slices.Equal(got, tc.allowed) {
				t.Fatalf("allowed = %v (set %v), want %v", got, selects[0].AllowedSet, tc.allowed)
			}
			h.pk.waitSettled(t)
		})
	}
	t.Run("a hint restricts a header-only load-only pick", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{HeaderOnly: true, SubsetHint: []string{"10.0.0.2:8000"}})
		_, loads, _, _, _ := h.pk.snapshot()
		if ex.Destination != "10.0.0.2:8000" || len(loads) != 1 || !loads[0].allowedSet || !slices.Equal(loads[0].allowed, []uint64{2}) {
			t.Fatalf("destination %q, load-only calls %+v", ex.Destination, loads)
		}
	})
}

func TestRow20ACancelMidResponseFreesExactlyOnce(t *testing.T) {
	for _, tc := range []struct {
		name string
		resp extproctest.Response
	}{
		{"cancel after two response chunks", extproctest.Response{ContentType: "text/event-stream", CancelAfterChunks: 2,
			Chunks: [][]byte{[]byte("data: {}\n\n"), []byte("data: {}\n\n"), []byte("data: {}\n\n")}}},
		{"cancel after the response headers", extproctest.Response{CancelAfterHeaders: true, Chunks: [][]byte{[]byte("x")}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			resp := tc.resp
			ex := h.do(t, extproctest.Request{Body: []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`), Response: &resp})
			if !ex.Cancelled {
				t.Fatalf("emulator did not cancel")
			}
			h.pk.waitSettled(t)
			if h.pk.count("free") != 1 {
				t.Fatalf("free called %d times", h.pk.count("free"))
			}
			waitFor(t, func() bool { return h.srv.Metrics().Snapshot().Requests["cancelled"] == 1 })
			if got := h.srv.Metrics().Snapshot().ActiveReservations; got != 0 {
				t.Fatalf("active reservations = %d", got)
			}
		})
	}
	t.Run("a stream closed before any response frees the booking", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{Body: []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)})
		if !ex.Cancelled || ex.Destination == "" {
			t.Fatalf("exchange = %+v", ex)
		}
		h.pk.waitSettled(t)
		if h.pk.count("prefill") != 0 || h.pk.count("free") != 1 {
			t.Fatalf("prefill %d free %d", h.pk.count("prefill"), h.pk.count("free"))
		}
	})
	t.Run("a stream closed while the pick is in flight frees the late booking", func(t *testing.T) {
		h := newHarness(t, nil)
		started := make(chan struct{})
		h.pk.bookDespiteCancel = true
		h.pk.selectHook = func(ctx context.Context, _ picker.SelectRequest) {
			close(started)
			<-ctx.Done()
		}
		ctx, cancel := context.WithCancel(context.Background())
		go func() { <-started; cancel() }()
		_, _ = h.client.Do(ctx, extproctest.Request{Body: []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`), Response: okResponse()})
		waitFor(t, func() bool { return h.pk.count("select") == 1 })
		h.pk.waitSettled(t)
		if h.pk.count("select") != 1 || h.pk.count("free") != 1 || h.pk.count("prefill") != 0 {
			_, _, ev, _, _ := h.pk.snapshot()
			t.Fatalf("events = %v", ev)
		}
	})
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within 5s")
		}
		time.Sleep(time.Millisecond)
	}
}

func TestRow22TrailersInFullDuplexMode(t *testing.T) {
	h := newHarness(t, nil)
	body := chatBody(70000)
	ex := h.do(t, extproctest.Request{Body: body, Trailers: []extproctest.Header{{Key: "x-trailer", Value: "1"}}, Response: okResponse()})
	if ex.Immediate != nil {
		t.Fatalf("ImmediateResponse %d %s", ex.Immediate.Status, ex.Immediate.Body)
	}
	for i, c := range ex.BodyChunks {
		if c.EndOfStream {
			t.Fatalf("chunk %d sets end_of_stream although the request had trailers", i)
		}
	}
	if len(ex.BodyChunks) != 2 || !bytes.Equal(ex.Body, body) || !ex.RequestTrailersReplied {
		t.Fatalf("%d chunks, body equal %v, trailers replied %v", len(ex.BodyChunks), bytes.Equal(ex.Body, body), ex.RequestTrailersReplied)
	}
	h.pk.waitSettled(t)
}

func TestRow23AnOverLimitBodyIs413AsSoonAsTheCapIsCrossed(t *testing.T) {
	h := newHarness(t, func(c *extproc.Config) { c.MaxRequestBodyBytes = 1000 })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ps, err := h.client.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	send := func(m *extprocv3.ProcessingRequest) {
		t.Helper()
		if err := ps.Send(m); err != nil {
			t.Fatalf("send: %v", err)
		}
	}
	send(extproctest.RequestHeaders(false, extproctest.Header{Key: ":method", Value: "POST"}, extproctest.Header{Key: ":path", Value: "/v1/chat/completions"}))
	send(extproctest.RequestBody(bytes.Repeat([]byte("a"), 600), false))
	send(extproctest.RequestBody(bytes.Repeat([]byte("a"), 600), false)) // crosses 1000: no end_of_stream yet
	m, err := ps.Recv()
	if err != nil {
		t.Fatalf("recv: %v", err)
	}
	ir := m.GetImmediateResponse()
	if ir == nil || ir.GetStatus().GetCode() != 413 {
		t.Fatalf("want an immediate 413 before end of stream, got %v", m)
	}
	// The rest of the request is ignored: no further answers.
	send(extproctest.RequestBody(bytes.Repeat([]byte("a"), 600), true))
	send(extproctest.RequestBody(nil, true))
	if err := ps.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if m, err := ps.Recv(); err == nil {
		t.Fatalf("unexpected message after the 413: %v", m)
	}
	if h.pk.count("select") != 0 || len(h.tok.snapshot()) != 0 {
		t.Fatalf("an over-limit body was routed")
	}
	t.Run("through the emulator the 413 has the error body", func(t *testing.T) {
		ex := h.do(t, extproctest.Request{Body: chatBody(5000), ChunkSize: 512})
		checkImmediate(t, ex, 413, "request_too_large", "exceeds 1000 bytes")
	})
	t.Run("a body of exactly the cap is accepted", func(t *testing.T) {
		ex := h.do(t, extproctest.Request{Body: chatBody(1000), ChunkSize: 300, Response: okResponse()})
		if ex.Immediate != nil {
			t.Fatalf("ImmediateResponse %d", ex.Immediate.Status)
		}
	})
	h.pk.waitSettled(t)
}

func TestRow26TenantIDNamespacesTheQueryAndRewritesTheBody(t *testing.T) {
	cases := []struct {
		name, path, body, wantBody string
		rewritten                  bool
	}{
		{"a chat body's cache_salt is replaced", "/v1/chat/completions",
			`{"model":"m","cache_salt":"x","messages":[{"role":"user","content":"q"}]}`,
			`{"model":"m","cache_salt":"t1","messages":[{"role":"user","content":"q"}]}`, true},
		{"a chat body without cache_salt gets one appended", "/v1/chat/completions",
			`{"model":"m", "messages":[{"role":"user","content":"q"}] }`,
			`{"model":"m", "messages":[{"role":"user","content":"q"}],"cache_salt":"t1" }`, true},
		{"a completion body's non-string cache_salt is replaced", "/v1/completions",
			`{"cache_salt":{"a":1},"model":"m","prompt":"q"}`,
			`{"cache_salt":"t1","model":"m","prompt":"q"}`, true},
		{"a body already salted with the tenant is not rewritten", "/v1/chat/completions",
			`{"model":"m","cache_salt":"t1","messages":[{"role":"user","content":"q"}]}`,
			`{"model":"m","cache_salt":"t1","messages":[{"role":"user","content":"q"}]}`, false},
		{"a responses body is not rewritten", "/v1/responses",
			`{"model":"m","cache_salt":"x","input":"q"}`,
			`{"model":"m","cache_salt":"x","input":"q"}`, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			ex := h.do(t, extproctest.Request{Path: tc.path, Body: []byte(tc.body),
				Headers: []extproctest.Header{{Key: "x-tenant-id", Value: " t1 "}}, Response: okResponse()})
			if ex.Immediate != nil {
				t.Fatalf("ImmediateResponse %d %s", ex.Immediate.Status, ex.Immediate.Body)
			}
			if string(ex.Body) != tc.wantBody {
				t.Fatalf("forwarded body = %s\nwant %s", ex.Body, tc.wantBody)
			}
			cl, has := ex.SetHeaders["content-length"]
			if has != tc.rewritten || (has && cl != strconv.Itoa(len(tc.wantBody))) {
				t.Fatalf("content-length = %q (set %v), want %d", cl, has, len(tc.wantBody))
			}
			selects, _, _, _, _ := h.pk.snapshot()
			if selects[0].Prompt.CacheSalt != "t1" {
				t.Fatalf("query namespace = %q, want t1", selects[0].Prompt.CacheSalt)
			}
			if calls := h.tok.snapshot(); calls[0].body != tc.wantBody {
				t.Fatalf("tokenizer saw %s, want the forwarded body", calls[0].body)
			}
			h.pk.waitSettled(t)
		})
	}
	t.Run("without x-tenant-id the body cache_salt is the namespace", func(t *testing.T) {
		h := newHarness(t, nil)
		h.do(t, extproctest.Request{Body: []byte(`{"model":"m","cache_salt":"x","messages":[{"role":"user","content":"q"}]}`), Response: okResponse()})
		selects, _, _, _, _ := h.pk.snapshot()
		if selects[0].Prompt.CacheSalt != "x" {
			t.Fatalf("namespace = %q", selects[0].Prompt.CacheSalt)
		}
	})
}

func TestRequestAttributesReachTheSelectRequest(t *testing.T) {
	h := newHarness(t, func(c *extproc.Config) { c.MaxDestinations = 3 })
	h.do(t, extproctest.Request{
		Body: []byte(`{"model":"m","messages":[{"role":"user","content":"q"}],"nvext":{"do_not_queue":true,"agent_hints":{"priority":-3,"latency_sensitivity":2,"strict_priority":7,"osl":128}}}`),
		Headers: []extproctest.Header{
			{Key: "x-dynamo-session-id", Value: "s1"}, {Key: "x-dynamo-parent-session-id", Value: "p0"},
			{Key: "x-dynamo-meta-policy-class", Value: "gold"}, {Key: "x-dynamo-strict-priority", Value: "bad"},
		},
		Response: okResponse(),
	})
	selects, _, _, _, _ := h.pk.snapshot()
	r := selects[0]
	if r.ModelName != "m" || r.RoutingGroup != "default" || r.Prompt.LoraName != "" || len(r.Prompt.TokenIDs) == 0 {
		t.Errorf("partition/prompt = %q %q %q %d tokens", r.ModelName, r.RoutingGroup, r.Prompt.LoraName, len(r.Prompt.TokenIDs))
	}
	if r.PriorityJump != 0 { // agent_hints.priority -3 wins over latency_sensitivity and is clamped to 0
		t.Errorf("priority_jump = %v, want 0", r.PriorityJump)
	}
	if r.StrictPriority != 7 || r.ExpectedOutputTokens == nil || *r.ExpectedOutputTokens != 128 || !r.DoNotQueue {
		t.Errorf("strict %d osl %v dnq %v", r.StrictPriority, r.ExpectedOutputTokens, r.DoNotQueue)
	}
	if r.Session == nil || r.Session.SessionID != "s1" || r.Session.ParentSessionID != "p0" || r.PolicyClass != "gold" {
		t.Errorf("session %+v class %q", r.Session, r.PolicyClass)
	}
	if r.Fallbacks != 2 {
		t.Errorf("fallbacks = %d, want 2", r.Fallbacks)
	}

	t.Run("the priority header wins over agent hints", func(t *testing.T) {
		h := newHarness(t, nil)
		h.do(t, extproctest.Request{
			Body:     []byte(`{"model":"m","messages":[{"role":"user","content":"q"}],"nvext":{"agent_hints":{"priority":9}}}`),
			Headers:  []extproctest.Header{{Key: "x-dynamo-request-priority", Value: "2.5"}, {Key: "x-dynamo-strict-priority", Value: "4"}},
			Response: okResponse(),
		})
		selects, _, _, _, _ := h.pk.snapshot()
		if selects[0].PriorityJump != 2.5 || selects[0].StrictPriority != 4 {
			t.Fatalf("priority %v strict %d", selects[0].PriorityJump, selects[0].StrictPriority)
		}
	})
	t.Run("an unparseable priority header falls back to latency_sensitivity", func(t *testing.T) {
		h := newHarness(t, nil)
		h.do(t, extproctest.Request{
			Body:     []byte(`{"model":"m","messages":[{"role":"user","content":"q"}],"nvext":{"agent_hints":{"priority":"hi","latency_sensitivity":1.5}}}`),
			Headers:  []extproctest.Header{{Key: "x-dynamo-request-priority", Value: "NaN"}},
			Response: okResponse(),
		})
		selects, _, _, _, _ := h.pk.snapshot()
		if selects[0].PriorityJump != 1.5 {
			t.Fatalf("priority %v", selects[0].PriorityJump)
		}
	})
}

func TestPartitionResolution(t *testing.T) {
	msgs := `"messages":[{"role":"user","content":"q"}]`
	cases := []struct {
		name            string
		models          []string
		modelName       string
		body            string
		wantModel, lora string
		wantStatus      int
	}{
		{"a served body model is its own partition", []string{"m", "n"}, "m", `{"model":"n",` + msgs + `}`, "n", "", 0},
		{"an unserved body model is a LoRA on DYN_MODEL_NAME", []string{"m"}, "m", `{"model":"adapter-1",` + msgs + `}`, "m", "adapter-1", 0},
		{"an absent model with one partition uses it", []string{"m"}, "", `{` + msgs + `}`, "m", "", 0},
		{"an absent model with DYN_MODEL_NAME uses it", []string{"m", "n"}, "n", `{` + msgs + `}`, "n", "", 0},
		{"an absent model with two partitions is a 400", []string{"m", "n"}, "", `{` + msgs + `}`, "", "", 400},
		{"a null model counts as absent", []string{"m"}, "", `{"model":null,` + msgs + `}`, "m", "", 0},
		{"an unknown model without DYN_MODEL_NAME is a 404", []string{"m"}, "", `{"model":"x",` + msgs + `}`, "", "", 404},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(c *extproc.Config) { c.ModelName = tc.modelName })
			h.pk.models = tc.models
			h.pk.workers["n"] = []picker.WorkerState{worker(9, "n", "http://10.0.0.9:8000")}
			ex := h.do(t, extproctest.Request{Body: []byte(tc.body), Response: okResponse()})
			switch tc.wantStatus {
			case 404:
				checkImmediate(t, ex, tc.wantStatus, "model_not_found", "is not served")
				return
			case 400:
				checkImmediate(t, ex, tc.wantStatus, "invalid_request_error", "the request names no model and 2 models are served")
				return
			}
			selects, _, _, _, _ := h.pk.snapshot()
			if len(selects) != 1 || selects[0].ModelName != tc.wantModel || selects[0].Prompt.LoraName != tc.lora {
				t.Fatalf("selects = %+v", selects)
			}
			if calls := h.tok.snapshot(); calls[0].model != tc.wantModel {
				t.Fatalf("tokenizer model = %q", calls[0].model)
			}
		})
	}
}

// TestLoadOnlyPicksStayInTheRequestsPartition checks epp.md §5.5/§5.7: a load-only pick (gzip
// body, request body mode NONE, header-only request) chooses among the workers of the partition
// the request would have — DYN_MODEL_NAME's when set, else the only served model's, else any model
// — and only in the server's routing group; never a worker of another partition.
func TestLoadOnlyPicksStayInTheRequestsPartition(t *testing.T) {
	// Model "m": worker 4 in routing group "prefill" (listed first, so a pick that ignores the
	// group lands on it), workers 1-3 in the default group. Model "n": worker 9 (default group).
	otherGroup := worker(4, "m", "http://10.0.0.4:8000")
	otherGroup.RoutingGroup = "prefill"
	requests := []struct {
		name string
		req  extproctest.Request
	}{
		{"a body in an unsupported encoding", extproctest.Request{Body: []byte{0x1f, 0x8b, 0x08}, Headers: []extproctest.Header{{Key: "content-encoding", Value: "zstd"}}}},
		{"request body mode NONE", extproctest.Request{Body: []byte(`{"model":"m","messages":[]}`), ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode: filterv3.ProcessingMode_NONE, ResponseBodyMode: filterv3.ProcessingMode_NONE}}},
		{"a header-only request", extproctest.Request{HeaderOnly: true}},
	}
	setups := []struct {
		name, modelName string
		models          []string
		wantModel       string
		wantAllowed     []uint64
	}{
		{"DYN_MODEL_NAME's partition when set", "m", []string{"m", "n"}, "m", []uint64{1, 2, 3}},
		{"DYN_MODEL_NAME's partition even when it is not listed first", "m", []string{"n", "m"}, "m", []uint64{1, 2, 3}},
		{"the only partition without DYN_MODEL_NAME", "", []string{"m"}, "m", []uint64{1, 2, 3}},
		{"any model of the routing group when several are served", "", []string{"m", "n"}, "", []uint64{1, 2, 3, 9}},
	}
	for _, st := range setups {
		for _, rq := range requests {
			t.Run(rq.name+" picks in "+st.name, func(t *testing.T) {
				h := newHarness(t, func(c *extproc.Config) { c.ModelName = st.modelName })
				h.pk.models = st.models
				h.pk.workers["m"] = append([]picker.WorkerState{otherGroup}, h.pk.workers["m"]...)
				h.pk.workers["n"] = []picker.WorkerState{worker(9, "n", "http://10.0.0.9:8000")}
				ex := h.do(t, rq.req)
				_, loads, _, _, _ := h.pk.snapshot()
				if ex.Immediate != nil || len(loads) != 1 {
					t.Fatalf("immediate %+v, load-only calls %+v", ex.Immediate, loads)
				}
				got := slices.Clone(loads[0].allowed)
				slices.Sort(got)
				if loads[0].model != st.wantModel || !loads[0].allowedSet || !slices.Equal(got, st.wantAllowed) {
					t.Fatalf("load-only call %+v, want model %q over workers %v", loads[0], st.wantModel, st.wantAllowed)
				}
				if ex.Destination == "10.0.0.4:8000" {
					t.Fatalf("routed to worker 4 of routing group \"prefill\"")
				}
			})
		}
	}
	t.Run("a partition without workers in the routing group is a 503", func(t *testing.T) {
		h := newHarness(t, func(c *extproc.Config) { c.RoutingGroup = "decode" })
		ex := h.do(t, extproctest.Request{HeaderOnly: true})
		checkImmediate(t, ex, 503, "service_unavailable", "no ready worker")
	})
}

func TestCompletionTokenPromptsSkipTheTokenizer(t *testing.T) {
	for _, tc := range []struct {
		name, prompt string
		want         []uint32
	}{
		{"a flat token list is used as is", `[5,6,7]`, []uint32{5, 6, 7}},
		{"a list of token lists uses the first", `[[1,2],[3]]`, []uint32{1, 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.do(t, extproctest.Request{Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":` + tc.prompt + `}`), Response: okResponse()})
			selects, _, _, _, _ := h.pk.snapshot()
			if !slices.Equal(selects[0].Prompt.TokenIDs, tc.want) || len(h.tok.snapshot()) != 0 {
				t.Fatalf("tokens %v, tokenizer calls %d", selects[0].Prompt.TokenIDs, len(h.tok.snapshot()))
			}
		})
	}
	t.Run("an empty token list is a 400", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":[[]]}`)})
		checkImmediate(t, ex, 400, "invalid_request_error", "empty token list")
	})
	t.Run("a negative token id is a 400", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":[1,-2]}`)})
		checkImmediate(t, ex, 400, "invalid_request_error", `"prompt" must be`)
	})
}

// badRequestErr implements BadRequest() bool.
type badRequestErr struct{}

func (badRequestErr) Error() string    { return "messages[0].role is invalid" }
func (badRequestErr) BadRequest() bool { return true }

func TestErrorsMapToImmediateResponses(t *testing.T) {
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	cases := []struct {
		name      string
		selectErr error
		tokErr    error
		tokEmpty  bool
		status    int
		typ, msg  string
	}{
		{"a picker bad request is a 400", picker.Errorf(picker.KindBadRequest, "pinned worker not allowed"), nil, false, 400, "invalid_request_error", "pinned"},
		{"no ready worker is a 503", picker.Errorf(picker.KindNotReady, "no schedulable worker"), nil, false, 503, "service_unavailable", "no schedulable"},
		{"overload is a 429 with retry-after", picker.Errorf(picker.KindOverloaded, "queue full"), nil, false, 429, "overloaded", "queue full"},
		{"a booking conflict is a 500", picker.Errorf(picker.KindConflict, "reservation exists"), nil, false, 500, "internal_error", "reservation"},
		{"a policy failure is a 500", picker.Errorf(picker.KindPolicy, "policy broke"), nil, false, 500, "internal_error", "policy broke"},
		{"a plain error is a 500", errors.New("boom"), nil, false, 500, "internal_error", "boom"},
		{"a tokenizer bad request is a 400 with its message", nil, fmt.Errorf("render: %w", extproc.ErrTokenizerBadRequest), false, 400, "invalid_request_error", "render"},
		{"a BadRequest() tokenizer error is a 400", nil, badRequestErr{}, false, 400, "invalid_request_error", "role is invalid"},
		{"a tokenizer timeout is a 504", nil, fmt.Errorf("call: %w", context.DeadlineExceeded), false, 504, "tokenizer_timeout", "tokenizer"},
		{"an unreachable tokenizer is a 503", nil, &net.OpError{Op: "dial", Err: errors.New("connection refused")}, false, 503, "service_unavailable", "refused"},
		{"an unavailable tokenizer sentinel is a 503", nil, fmt.Errorf("x: %w", extproc.ErrTokenizerUnavailable), false, 503, "service_unavailable", "unavailable"},
		{"a tokenizer 5xx is a 502", nil, fmt.Errorf("status 500: %w", extproc.ErrTokenizerUpstream), false, 502, "tokenizer_error", "status 500"},
		{"an unclassified tokenizer error is a 502", nil, errors.New("weird"), false, 502, "tokenizer_error", "weird"},
		{"an empty token list is a 400", nil, nil, true, 400, "invalid_request_error", "empty token list"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.pk.selectErr, h.tok.err, h.tok.empty = tc.selectErr, tc.tokErr, tc.tokEmpty
			ex := h.do(t, extproctest.Request{Body: chat, Response: okResponse()})
			checkImmediate(t, ex, tc.status, tc.typ, tc.msg)
			h.pk.waitSettled(t)
			m := h.srv.Metrics().Snapshot()
			if m.ImmediateResponses[tc.status] != 1 || m.Requests["rejected"] != 1 {
				t.Fatalf("metrics = %+v", m)
			}
		})
	}
	t.Run("a not-ready EPP answers 503", func(t *testing.T) {
		h := newHarness(t, func(c *extproc.Config) { c.Ready = func() bool { return false } })
		ex := h.do(t, extproctest.Request{Body: chat})
		checkImmediate(t, ex, 503, "service_unavailable", "not ready")
	})
	t.Run("a destination that cannot be formatted frees the booking and is a 500", func(t *testing.T) {
		h := newHarness(t, nil)
		h.pk.workers["m"][0].Endpoint = "not a url"
		ex := h.do(t, extproctest.Request{Body: chat})
		checkImmediate(t, ex, 500, "internal_error", "not a url")
		h.pk.waitSettled(t)
		if h.pk.count("free") != 1 {
			t.Fatalf("booking not freed")
		}
	})
}

func TestRoutingConcurrencyAboveTheCapIs429(t *testing.T) {
	h := newHarness(t, func(c *extproc.Config) { c.MaxInflight = 1 })
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	h.pk.selectHook = func(ctx context.Context, _ picker.SelectRequest) {
		select {
		case entered <- struct{}{}:
			<-release
		default:
		}
	}
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	var wg sync.WaitGroup
	wg.Add(1)
	var first *extproctest.Exchange
	go func() {
		defer wg.Done()
		first, _ = h.client.Do(context.Background(), extproctest.Request{Body: chat, Response: okResponse()})
	}()
	<-entered
	ex := h.do(t, extproctest.Request{Body: chat})
	checkImmediate(t, ex, 429, "overloaded", "limit 1")
	close(release)
	wg.Wait()
	if first == nil || first.Immediate != nil || first.Destination == "" {
		t.Fatalf("the first request was not routed: %+v", first)
	}
	h.pk.waitSettled(t)
}

func TestMultipleDestinationsAndIPv6(t *testing.T) {
	h := newHarness(t, func(c *extproc.Config) { c.MaxDestinations = 3 })
	ex := h.do(t, extproctest.Request{Body: []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`), Response: okResponse()})
	want := "10.0.0.1:8000,10.0.0.2:8000,[fd00::3]:8000"
	if ex.Destination != want || ex.MetadataDestination != want {
		t.Fatalf("header %q metadata %q, want %q", ex.Destination, ex.MetadataDestination, want)
	}
	h.pk.waitSettled(t)
}

func TestXRequestIDIsGeneratedOnlyWhenAbsent(t *testing.T) {
	h := newHarness(t, nil)
	ex := h.do(t, extproctest.Request{Body: []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`), Response: okResponse()})
	id := ex.SetHeaders["x-request-id"]
	selects, _, _, _, _ := h.pk.snapshot()
	if len(id) != 36 || id == selects[0].SelectionID {
		t.Fatalf("generated x-request-id %q (selection id %q)", id, selects[0].SelectionID)
	}
}

func TestProcessingModes(t *testing.T) {
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	pc := func(req, resp filterv3.ProcessingMode_BodySendMode) *extprocv3.ProtocolConfiguration {
		return &extprocv3.ProtocolConfiguration{RequestBodyMode: req, ResponseBodyMode: resp}
	}
	for _, tc := range []struct {
		name string
		mode filterv3.ProcessingMode_BodySendMode
	}{
		{"STREAMED request bodies are a protocol error", filterv3.ProcessingMode_STREAMED},
		{"BUFFERED_PARTIAL request bodies are a protocol error", filterv3.ProcessingMode_BUFFERED_PARTIAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			_, err := h.client.Do(context.Background(), extproctest.Request{Body: chat, ProtocolConfig: pc(tc.mode, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)})
			if status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("err = %v, want FAILED_PRECONDITION", err)
			}
			if h.pk.count("select") != 0 {
				t.Fatalf("picker called")
			}
		})
	}
	t.Run("observability mode is a protocol error", func(t *testing.T) {
		h := newHarness(t, nil)
		_, err := h.client.Do(context.Background(), extproctest.Request{Body: chat, ObservabilityMode: true})
		if status.Code(err) != codes.FailedPrecondition {
			t.Fatalf("err = %v, want FAILED_PRECONDITION", err)
		}
	})
	t.Run("an explicit FULL_DUPLEX_STREAMED config behaves as the default", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{Body: chat, ProtocolConfig: pc(filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED), Response: okResponse()})
		if ex.Destination != "10.0.0.1:8000" || !bytes.Equal(ex.Body, chat) {
			t.Fatalf("exchange %+v", ex)
		}
		h.pk.waitSettled(t)
	})
	t.Run("BUFFERED mode routes on the body reply and mutates the body when rewritten", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{Body: chat, ProtocolConfig: pc(filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED),
			Headers: []extproctest.Header{{Key: "x-tenant-id", Value: "t9"}}, Response: okResponse()})
		if ex.Immediate != nil {
			t.Fatalf("ImmediateResponse %d %s", ex.Immediate.Status, ex.Immediate.Body)
		}
		if _, ok := ex.Messages[0].GetResponse().(*extprocv3.ProcessingResponse_RequestHeaders); !ok || ex.Messages[0].GetRequestHeaders().GetResponse().GetHeaderMutation() != nil {
			t.Fatalf("first reply is not a plain CONTINUE headers response: %v", ex.Messages[0])
		}
		if ex.Destination != "10.0.0.1:8000" || ex.MetadataDestination != ex.Destination || !ex.ClearRouteCache {
			t.Fatalf("routing reply: %q %q %v", ex.Destination, ex.MetadataDestination, ex.ClearRouteCache)
		}
		if !ex.BodyMutated || !bytes.Contains(ex.Body, []byte(`"cache_salt":"t9"`)) {
			t.Fatalf("body %s mutated %v", ex.Body, ex.BodyMutated)
		}
		if ex.ResponseBodyReplies != 1 || len(ex.ResponseChunks) != 0 {
			t.Fatalf("BUFFERED response: %d replies, %d streamed", ex.ResponseBodyReplies, len(ex.ResponseChunks))
		}
		h.pk.waitSettled(t)
		if h.pk.count("prefill") != 1 {
			t.Fatalf("prefill %d", h.pk.count("prefill"))
		}
	})
	t.Run("BUFFERED mode without a rewrite leaves the body alone", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{Body: chat, ProtocolConfig: pc(filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_STREAMED), Response: okResponse()})
		if ex.BodyMutated || ex.Destination == "" {
			t.Fatalf("mutated %v destination %q", ex.BodyMutated, ex.Destination)
		}
		if ex.ResponseBodyReplies != 2 || len(ex.ResponseChunks) != 0 {
			t.Fatalf("STREAMED response: %d replies, %d streamed", ex.ResponseBodyReplies, len(ex.ResponseChunks))
		}
		h.pk.waitSettled(t)
	})
	t.Run("BUFFERED mode rejects an over-limit body with 413", func(t *testing.T) {
		h := newHarness(t, func(c *extproc.Config) { c.MaxRequestBodyBytes = 100 })
		ex := h.do(t, extproctest.Request{Body: chatBody(200), ProtocolConfig: pc(filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED)})
		checkImmediate(t, ex, 413, "request_too_large", "100 bytes")
	})
	t.Run("NONE request mode routes load-only at the headers", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{Body: chat, ProtocolConfig: pc(filterv3.ProcessingMode_NONE, filterv3.ProcessingMode_NONE), Response: okResponse()})
		_, loads, _, _, _ := h.pk.snapshot()
		if ex.Destination != "10.0.0.1:8000" || len(loads) != 1 || h.pk.count("select") != 0 {
			t.Fatalf("destination %q loads %d", ex.Destination, len(loads))
		}
		if got := h.srv.Metrics().Snapshot().Requests["load_only"]; got != 1 {
			t.Fatalf("load_only outcomes = %d", got)
		}
	})
	t.Run("NONE response mode completes prefill at the headers and frees at stream end", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{Body: chat, ProtocolConfig: pc(filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_NONE), Response: okResponse()})
		if ex.ResponseBodyReplies != 0 || !ex.ResponseHeadersReplied {
			t.Fatalf("response replies: headers %v body %d", ex.ResponseHeadersReplied, ex.ResponseBodyReplies)
		}
		h.pk.waitSettled(t)
		if h.pk.count("prefill") != 1 || h.pk.count("free") != 1 {
			t.Fatalf("prefill %d free %d", h.pk.count("prefill"), h.pk.count("free"))
		}
		if got := h.srv.Metrics().Snapshot().Requests["success"]; got != 1 {
			t.Fatalf("success outcomes = %d", got)
		}
	})
}

func TestResponseLifecycle(t *testing.T) {
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	cases := []struct {
		name        string
		resp        extproctest.Response
		wantPrefill int
		outcome     string
	}{
		{"a response ending with trailers is freed at the trailers (row 19)",
			extproctest.Response{Chunks: [][]byte{[]byte("a"), []byte("b")}, Trailers: []extproctest.Header{{Key: "grpc-status", Value: "0"}}}, 1, "success"},
		{"a header-only response is freed at the headers", extproctest.Response{Status: 204}, 0, "success"},
		{"an error response never completes prefill", extproctest.Response{Status: 500, Chunks: [][]byte{[]byte(`{"error":"x"}`)}}, 0, "error"},
		{"empty chunks do not complete prefill", extproctest.Response{Chunks: [][]byte{{}, {}, []byte("x")}}, 1, "success"},
		{"only empty chunks never complete prefill", extproctest.Response{Chunks: [][]byte{{}, {}}}, 0, "success"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			resp := tc.resp
			ex := h.do(t, extproctest.Request{Body: chat, Response: &resp})
			if tc.resp.Trailers != nil && !ex.ResponseTrailersReplied {
				t.Fatalf("no trailers reply")
			}
			h.pk.waitSettled(t)
			if h.pk.count("prefill") != tc.wantPrefill || h.pk.count("free") != 1 {
				t.Fatalf("prefill %d (want %d) free %d", h.pk.count("prefill"), tc.wantPrefill, h.pk.count("free"))
			}
			_, _, events, _, _ := h.pk.snapshot()
			if !strings.HasPrefix(events[len(events)-1], "free ") {
				t.Fatalf("free is not the last call: %v", events)
			}
			if got := h.srv.Metrics().Snapshot().Requests[tc.outcome]; got != 1 {
				t.Fatalf("%s outcomes = %d", tc.outcome, got)
			}
		})
	}
	t.Run("a differing served endpoint is counted and the booking moved, each booking freed once", func(t *testing.T) {
		h := newHarness(t, nil)
		resp := okResponse()
		resp.ServedEndpoint = "10.0.0.2:8000"
		h.do(t, extproctest.Request{Body: chat, Response: resp})
		h.pk.waitSettled(t)
		if s := h.srv.Metrics().Snapshot(); s.ServedEndpointMismatch != 1 || s.ServedEndpointMoves != 1 {
			t.Fatalf("mismatch = %d moves = %d", s.ServedEndpointMismatch, s.ServedEndpointMoves)
		}
		_, _, events, violations, live := h.pk.snapshot()
		if len(violations) != 0 || live != 0 {
			t.Fatalf("violations %v, live %d; events %v", violations, live, events)
		}
	})
}

func TestRow2AndRow4UsageReachesTheMetrics(t *testing.T) {
	h := newHarness(t, nil)
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	h.do(t, extproctest.Request{Body: body, Response: &extproctest.Response{Chunks: [][]byte{
		[]byte(`{"id":"x","usage":{"prompt_tokens":100,"prompt_`), []byte(`tokens_details":{"cached_tokens":64},"completion_tokens":5}}`),
	}}})
	h.do(t, extproctest.Request{Path: "/v1/responses", Body: []byte(`{"model":"m","input":"x","stream":true}`), Response: &extproctest.Response{ContentType: "-", Chunks: [][]byte{
		[]byte("event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":{\"input_tokens\":40}}}\n\nda"),
		[]byte("ta: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"output_tokens\":7}}}\n\n"),
	}}})
	m := h.srv.Metrics().Snapshot()
	if m.UsageCachedTokens != 64 || m.UsagePromptTokens != 140 || m.UsageCompletionTokens != 12 {
		t.Fatalf("usage metrics = %+v", m)
	}
	h.pk.waitSettled(t)
}

func TestProtocolViolationsAreGRPCErrors(t *testing.T) {
	h := newHarness(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ps, err := h.client.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_ = ps.Send(extproctest.RequestBody([]byte("x"), true))
	if _, err := ps.Recv(); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("body before headers: err = %v", err)
	}
}

// TestEmptyProcessingRequestIsAGRPCError: a message that sets no request (nor one this build
// knows) cannot be answered; it ends the stream with InvalidArgument instead of leaving the
// proxy waiting for a reply, before the request headers and after a routed request alike, and
// the routed request's booking is freed.
func TestEmptyProcessingRequestIsAGRPCError(t *testing.T) {
	h := newHarness(t, nil)
	for _, routed := range []bool{false, true} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		ps, err := h.client.Open(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if routed {
			_ = ps.Send(extproctest.RequestHeaders(false, extproctest.Header{Key: ":method", Value: "POST"},
				extproctest.Header{Key: ":path", Value: "/v1/chat/completions"}))
			_ = ps.Send(extproctest.RequestBody(chatBody(100), true))
			for range 2 { // the routing reply and the re-streamed body
				if _, err := ps.Recv(); err != nil {
					t.Fatalf("routing: %v", err)
				}
			}
		}
		_ = ps.Send(&extprocv3.ProcessingRequest{})
		if _, err := ps.Recv(); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("routed %v: empty message: err = %v, want InvalidArgument", routed, err)
		}
		cancel()
	}
	h.pk.waitSettled(t)
}

func TestNewServerValidatesItsConfig(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  extproc.Config
	}{
		{"a missing picker is an error", extproc.Config{Tokenizers: &fakeTokenizers{}}},
		{"missing tokenizers are an error", extproc.Config{Picker: newFakePicker()}},
		{"a negative body cap is an error", extproc.Config{Picker: newFakePicker(), Tokenizers: &fakeTokenizers{}, MaxRequestBodyBytes: -1}},
		{"a negative inflight cap is an error", extproc.Config{Picker: newFakePicker(), Tokenizers: &fakeTokenizers{}, MaxInflight: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := extproc.NewServer(tc.cfg); err == nil {
				t.Fatalf("NewServer accepted %+v", tc.cfg)
			}
		})
	}
}

func TestManyConcurrentStreamsLeaveNoBooking(t *testing.T) {
	h := newHarness(t, nil)
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := extproctest.Request{Body: chatBody(2000 + i), ChunkSize: 512, Response: okResponse()}
			switch i % 4 {
			case 1:
				req.Response = &extproctest.Response{CancelAfterChunks: 1, Chunks: [][]byte{[]byte("a"), []byte("b")}}
			case 2:
				req.Body = []byte(`{}`)
			case 3:
				req.Response = nil
			}
			ex, err := h.client.Do(context.Background(), req)
			if err != nil {
				errs <- err
				return
			}
			if i%4 == 0 && !bytes.Equal(ex.Body, req.Body) {
				errs <- fmt.Errorf("stream %d: body differs", i)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	h.pk.waitSettled(t)
	waitFor(t, func() bool { return h.srv.Metrics().Snapshot().ActiveReservations == 0 })
}
