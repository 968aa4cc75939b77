package extproc

import (
	"bytes"
	"slices"
	"strconv"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kvepp/kvepp/picker"
)

// streamedWant is the plain construction of a streamed body chunk reply.
func streamedWant(request bool, chunk []byte, eos bool) *extprocv3.ProcessingResponse {
	sb := &extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: eos}
	br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: sb}}}}
	if request {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
}

// TestStreamedReplyReuse: one streamedReply rebuilt for every chunk of a stream is, each time,
// exactly the plain construction's message — nothing of the previous chunk (its body, its
// end_of_stream, its request or response phase) survives a rebuild, as the wire bytes show — and
// rebuilding allocates nothing.
func TestStreamedReplyReuse(t *testing.T) {
	var r streamedReply
	steps := []struct {
		request bool
		chunk   []byte
		eos     bool
	}{
		{true, []byte(`{"model":"m","messages":[{"role":"user","content":"first request body"}]}`), true},
		{false, []byte("data: {\"choices\":[]}\n\n"), false},
		{false, nil, true}, // an empty last chunk: no body of the previous one
		{true, []byte("x"), false},
		{false, []byte("data: [DONE]\n\n"), true},
	}
	for i, st := range steps {
		got := r.build(st.request, st.chunk, st.eos)
		want := streamedWant(st.request, st.chunk, st.eos)
		if !proto.Equal(got, want) {
			t.Fatalf("step %d: got %v, want %v", i, got, want)
		}
		gb, err := proto.MarshalOptions{Deterministic: true}.Marshal(got)
		if err != nil {
			t.Fatal(err)
		}
		wb, _ := proto.MarshalOptions{Deterministic: true}.Marshal(want)
		if !bytes.Equal(gb, wb) {
			t.Fatalf("step %d: encodes as %x, want %x", i, gb, wb)
		}
	}
	chunk := []byte("data: {}\n\n")
	for _, request := range []bool{true, false} {
		if n := testing.AllocsPerRun(100, func() { _ = r.build(request, chunk, false) }); n != 0 {
			t.Errorf("request=%v: %v allocations per rebuilt reply, want 0", request, n)
		}
	}
}

// TestResponseHeadersReplyReuse: a rebuilt response_headers reply is the plain construction's
// message, with or without a header mutation — a reply without one keeps none of the previous
// reply's — and rebuilding allocates nothing.
func TestResponseHeadersReplyReuse(t *testing.T) {
	var r responseHeadersReply
	for _, mut := range []*extprocv3.HeaderMutation{{RemoveHeaders: []string{"x"}}, nil, {SetHeaders: []*corev3.HeaderValueOption{setHeader("a", "b")}}, nil} {
		want := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
			ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{HeaderMutation: mut}}}}
		if got := r.build(mut); !proto.Equal(got, want) {
			t.Fatalf("got %v, want %v", got, want)
		}
		if n := testing.AllocsPerRun(100, func() { _ = r.build(mut) }); n != 0 {
			t.Errorf("%v allocations per rebuilt reply, want 0", n)
		}
	}
}

// TestRoutingReply: the routing reply carries the headers of epp.md §5.9 / §5.10 and, as a
// request_body reply, the rewritten body, exactly as the plain construction does, in one
// allocation; a destination list too long for the reply's own bytes is still set in full.
// destinationMetadata shares one unmodified metadata message per destination.
func TestRoutingReply(t *testing.T) {
	s := &Server{}
	const id = "0b7e2c1c-6a43-4c8e-9f7e-1f2a3b4c5d6e"
	long := strings.Repeat("10.0.0.1:8000,", 20) + "10.0.0.2:8000"
	for _, tc := range []struct {
		name string
		st   *stream
		d    *decision
		body bool
	}{
		{"headers", &stream{s: s, dest: "10.0.0.1:8000", generatedID: id}, &decision{sel: picker.Selection{WorkerID: 3, DPRank: 1}, body: make([]byte, 1234)}, false},
		{"rewritten", &stream{s: s, dest: "10.0.0.1:8000", generatedID: id, hdr: requestHeaders{decision: "1"}},
			&decision{sel: picker.Selection{WorkerID: 3, DPRank: 1}, body: []byte(`{"cache_salt":"t"}`), rewritten: true, decoded: true}, false},
		{"buffered", &stream{s: s, dest: "10.0.0.1:8000"}, &decision{sel: picker.Selection{WorkerID: 7}, body: []byte(`{"cache_salt":"t"}`), rewritten: true}, true},
		{"buffered-unchanged", &stream{s: s, dest: "10.0.0.1:8000"}, &decision{sel: picker.Selection{WorkerID: 7}, body: []byte(`{}`)}, true},
		{"long-destination", &stream{s: s, dest: long, generatedID: id}, &decision{sel: picker.Selection{WorkerID: 1}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, d := tc.st, tc.d
			set := []*corev3.HeaderValueOption{setHeader(DestinationHeader, st.dest),
				setHeader("x-dynamo-worker-instance-id", strconv.FormatUint(d.sel.WorkerID, 10)),
				setHeader("x-dynamo-dp-rank", strconv.FormatUint(uint64(d.sel.DPRank), 10)),
				setHeader("x-dynamo-routing-mode", "aggregated")}
			if st.generatedID != "" {
				set = append(set, setHeader("x-request-id", st.generatedID))
			}
			if d.rewritten {
				set = append(set, setHeader("content-length", strconv.Itoa(len(d.body))))
			}
			remove := slices.Clone(removedHeaders)
			if d.decoded {
				remove = append(remove, "content-encoding")
			}
			if st.hdr.decision != "" {
				remove = append(remove, DecisionHeader)
			}
			common := &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set, RemoveHeaders: remove}, ClearRouteCache: true}
			want := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: common}}}
			if tc.body {
				if d.rewritten {
					common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: d.body}}
				}
				want = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: common}}}
			}
			if got := st.routingReply(d, tc.body); !proto.Equal(got, want) {
				t.Fatalf("got %v\nwant %v", got, want)
			}
			if tc.name == "long-destination" {
				return
			}
			allocs := 1.0
			if d.decoded || st.hdr.decision != "" {
				allocs++ // the remove list is then the request's own
			}
			if n := testing.AllocsPerRun(100, func() { _ = st.routingReply(d, tc.body) }); n > allocs {
				t.Errorf("%v allocations per routing reply, want %v", n, allocs)
			}
		})
	}
	md := s.destinationMetadata("10.0.0.1:8000")
	if !proto.Equal(md, lbMetadata("10.0.0.1:8000")) || s.destinationMetadata("10.0.0.1:8000") != md {
		t.Fatalf("destinationMetadata %v is not the shared lbMetadata", md)
	}
	if n := testing.AllocsPerRun(100, func() { _ = s.destinationMetadata("10.0.0.1:8000") }); n != 0 {
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
