package extproc_test

import (
	"bytes"
	"testing"

	"github.com/kvepp/kvepp/extproc/extproctest"
)

// TestReusedMessagesCarryNothingOver: the server decodes every request message of a stream into
// one message and rebuilds one streamed reply and one response_headers reply per stream (Process,
// replies.go). A message of one stream, or of the stream before on the same connection, must never
// show through in the next: each re-streamed and echoed chunk is its own message's body and
// end_of_stream, the response_headers reply carries no routing header mutation, and a second
// request's routing reply carries its own x-request-id and body.
func TestReusedMessagesCarryNothingOver(t *testing.T) {
	h := newHarness(t, nil)
	for i, body := range [][]byte{chatBody(300), chatBody(120)} {
		// The first request has no x-request-id (its routing reply sets a generated one), the
		// second its own (its routing reply sets none).
		var extra []extproctest.Header
		if i == 1 {
			extra = append(extra, extproctest.Header{Key: "x-request-id", Value: "req-1"})
		}
		ps := openStream(t, h)
		send(t, ps, postHeaders("/v1/chat/completions", extra...))
		// Two chunks, the second shorter than the first: a chunk decoded over the first one
		// would show its tail.
		send(t, ps, extproctest.RequestBody(body[:len(body)-20], false), extproctest.RequestBody(body[len(body)-20:], true))
		routing := recv(t, ps).GetRequestHeaders().GetResponse()
		if routing == nil {
			t.Fatalf("request %d: no routing reply", i)
		}
		var gotID string
		for _, hv := range routing.GetHeaderMutation().GetSetHeaders() {
			if hv.GetHeader().GetKey() == "x-request-id" {
				gotID = string(hv.GetHeader().GetRawValue())
			}
		}
		if (i == 0) != (len(gotID) == 36) || (i == 1 && gotID != "") {
			t.Fatalf("request %d: the routing reply sets x-request-id %q (the client sent one: %v)", i, gotID, i == 1)
		}
		var restreamed []byte
		for {
			c := recv(t, ps).GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			if c == nil {
				t.Fatalf("request %d: a re-streamed chunk is not a streamed_response", i)
			}
			restreamed = append(restreamed, c.GetBody()...)
			if c.GetEndOfStream() {
				break
			}
		}
		if !bytes.Equal(restreamed, body) {
			t.Fatalf("request %d: re-streamed body %q, want %q", i, restreamed, body)
		}
		send(t, ps, extproctest.ResponseHeaders(false, extproctest.Header{Key: ":status", Value: "200"},
			extproctest.Header{Key: "content-type", Value: "text/event-stream"}))
		if rh := recv(t, ps).GetResponseHeaders(); rh == nil || rh.GetResponse().GetHeaderMutation() != nil {
			t.Fatalf("request %d: response_headers reply %v, want one without a header mutation", i, rh)
		}
		chunks := []struct {
			b   []byte
			eos bool
		}{
			{[]byte("data: {\"choices\":[{\"delta\":{\"content\":\"a long first event\"}}]}\n\n"), false},
			{[]byte("data: [DONE]\n\n"), false},
			{nil, true},
		}
		for j, c := range chunks {
			send(t, ps, extproctest.ResponseBody(c.b, c.eos))
			echo := recv(t, ps).GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			if echo == nil || !bytes.Equal(echo.GetBody(), c.b) || echo.GetEndOfStream() != c.eos {
				t.Fatalf("request %d chunk %d: echo %v, want body %q end_of_stream %v", i, j, echo, c.b, c.eos)
			}
		}
		if err := ps.CloseSend(); err != nil {
			t.Fatal(err)
		}
		if m, err := ps.Recv(); err == nil {
			t.Fatalf("request %d: unexpected message after the response: %v", i, m)
		}
	}
	calls := h.tok.snapshot()
	if len(calls) != 2 || calls[0].body != string(chatBody(300)) || calls[1].body != string(chatBody(120)) {
		t.Fatalf("tokenized bodies %+v, want each request's own", calls)
	}
	h.pk.waitSettled(t)
}
