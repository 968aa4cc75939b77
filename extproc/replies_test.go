package extproc

import (
	"bytes"
	"strconv"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kvepp/kvepp/picker"
)

// TestStreamedReplyIsOneAllocation: a streamed body chunk reply (request or response phase) is
// the protocol's seven nested messages in one allocation, and it is the message the plain
// construction gives.
func TestStreamedReplyIsOneAllocation(t *testing.T) {
	chunk := []byte("data: {}\n\n")
	for _, request := range []bool{true, false} {
		got := newStreamedReply(request, chunk, true)
		sb := &extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: true}
		br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
			Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: sb}}}}
		want := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
		if request {
			want = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
		}
		if !proto.Equal(got, want) {
			t.Fatalf("request=%v: got %v, want %v", request, got, want)
		}
		if n := testing.AllocsPerRun(100, func() { _ = newStreamedReply(request, chunk, false) }); n > 1 {
			t.Errorf("request=%v: %v allocations per reply, want 1", request, n)
		}
	}
}

// TestResponseHeadersReplyIsOneAllocation: the response_headers reply is the plain construction's
// message, with or without a header mutation, in one allocation.
func TestResponseHeadersReplyIsOneAllocation(t *testing.T) {
	for _, mut := range []*extprocv3.HeaderMutation{nil, {RemoveHeaders: []string{"x"}}} {
		want := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
			ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{HeaderMutation: mut}}}}
		if got := newResponseHeadersReply(mut); !proto.Equal(got, want) {
			t.Fatalf("got %v, want %v", got, want)
		}
		if n := testing.AllocsPerRun(100, func() { _ = newResponseHeadersReply(mut) }); n > 1 {
			t.Errorf("%v allocations per reply, want 1", n)
		}
	}
}

// TestRoutingMutationAllocations: the routing reply's header mutation keeps the headers of epp.md
// §5.9 / §5.10 in a handful of allocations (not three per header), and destinationMetadata shares
// one unmodified metadata message per destination.
func TestRoutingMutationAllocations(t *testing.T) {
	s := &Server{}
	st := &stream{s: s, dest: "10.0.0.1:8000", generatedID: "0b7e2c1c-6a43-4c8e-9f7e-1f2a3b4c5d6e"}
	d := &decision{sel: picker.Selection{WorkerID: 3, DPRank: 1}, body: make([]byte, 1234), rewritten: true}
	m := st.routingMutation(d)
	want := map[string]string{DestinationHeader: "10.0.0.1:8000", "x-dynamo-worker-instance-id": "3",
		"x-dynamo-dp-rank": "1", "x-dynamo-routing-mode": "aggregated", "x-request-id": st.generatedID, "content-length": "1234"}
	if len(m.GetSetHeaders()) != len(want) {
		t.Fatalf("set headers %v, want %v", m.GetSetHeaders(), want)
	}
	for _, h := range m.GetSetHeaders() {
		if w, ok := want[h.GetHeader().GetKey()]; !ok || !bytes.Equal(h.GetHeader().GetRawValue(), []byte(w)) ||
			h.GetAppendAction() != corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD {
			t.Fatalf("header %v, want %q", h, w)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _ = st.routingMutation(d) }); n > 5 {
		t.Errorf("%v allocations per routing mutation, want at most 5", n)
	}
	md := s.destinationMetadata(st.dest)
	if !proto.Equal(md, lbMetadata(st.dest)) || s.destinationMetadata(st.dest) != md {
		t.Fatalf("destinationMetadata %v is not the shared lbMetadata", md)
	}
	if n := testing.AllocsPerRun(100, func() { _ = s.destinationMetadata(st.dest) }); n != 0 {
		t.Errorf("%v allocations per cached destination metadata, want 0", n)
	}
}

// TestRankAddressIsMemoized: rankAddress gives endpointHostPort's answer, from the cache without
// allocating once seen; errors are never cached, and past maxCachedKeys keys answers are still
// computed (just not kept).
func TestRankAddressIsMemoized(t *testing.T) {
	s := &Server{}
	for _, ep := range []string{"http://10.0.0.1:8000", "http://[::1]:8001", "https://example.com", "10.0.0.2:9000"} {
		want, _ := endpointHostPort(ep)
		for i := 0; i < 2; i++ {
			if got, err := s.rankAddress(ep); err != nil || got != want {
				t.Fatalf("%q: got %q, %v; want %q", ep, got, err, want)
			}
		}
		if n := testing.AllocsPerRun(100, func() { _, _ = s.rankAddress(ep) }); n != 0 {
			t.Errorf("%q: %v allocations per cached rank address, want 0", ep, n)
		}
	}
	for i := 0; i < 2; i++ {
		if _, err := s.rankAddress("http://:80"); err == nil {
			t.Fatal("an endpoint without a host gave no error")
		}
	}
	for i := 0; i < maxCachedKeys+10; i++ {
		ep := "10.1.0.1:" + strconv.Itoa(10000+i)
		if got, err := s.rankAddress(ep); err != nil || got != ep {
			t.Fatalf("%q: got %q, %v", ep, got, err)
		}
	}
	if n := s.rankAddrs.n.Load(); n != maxCachedKeys {
		t.Fatalf("%d keys cached, want the bound %d", n, maxCachedKeys)
	}
}
