package extproctest_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"slices"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvepp/kvepp/extproc/extproctest"
)

// recorder is a minimal FULL_DUPLEX ext_proc server: it records every message, answers the request at
// body end of stream (or trailers) with a fixed destination and the body re-streamed in one chunk,
// echoes response chunks, and rejects bodies containing "reject" with a 400.
type recorder struct {
	extprocv3.UnimplementedExternalProcessorServer
	mu     sync.Mutex
	msgs   []*extprocv3.ProcessingRequest
	closed chan error
}

func (r *recorder) Process(ps extprocv3.ExternalProcessor_ProcessServer) error {
	var body []byte
	trailers := false
	for {
		m, err := ps.Recv()
		if err != nil {
			r.closed <- err
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		r.mu.Lock()
		r.msgs = append(r.msgs, m)
		r.mu.Unlock()
		route := false
		switch x := m.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestBody:
			if len(body) > 0 && x.RequestBody.GetEndOfStream() && bytes.HasSuffix(body, x.RequestBody.GetBody()) && r.sawEOS() > 1 {
				continue // duplicate end of stream
			}
			body = append(body, x.RequestBody.GetBody()...)
			route = x.RequestBody.GetEndOfStream()
		case *extprocv3.ProcessingRequest_RequestTrailers:
			route, trailers = true, true
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			_ = ps.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}})
		case *extprocv3.ProcessingRequest_ResponseBody:
			_ = ps.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
				Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
					StreamedResponse: &extprocv3.StreamedBodyResponse{Body: x.ResponseBody.GetBody(), EndOfStream: x.ResponseBody.GetEndOfStream()}}}}}}})
		case *extprocv3.ProcessingRequest_ResponseTrailers:
			_ = ps.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}})
		}
		if !route {
			continue
		}
		if bytes.Contains(body, []byte("reject")) {
			_ = ps.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
				Status: &typev3.HttpStatus{Code: 400}, Body: []byte(`{"error":{}}`),
				Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "content-type", RawValue: []byte("application/json")}}}},
			}}})
			continue
		}
		_ = ps.Send(&extprocv3.ProcessingResponse{
			Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
				ClearRouteCache: true,
				HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
					Header: &corev3.HeaderValue{Key: extproctest.DestinationKey, RawValue: []byte("10.1.1.1:80")}, AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}}},
			}}},
			DynamicMetadata: &structpb.Struct{Fields: map[string]*structpb.Value{extproctest.LBNamespace: structpb.NewStructValue(&structpb.Struct{
				Fields: map[string]*structpb.Value{extproctest.DestinationKey: structpb.NewStringValue("10.1.1.1:80")}})}},
		})
		_ = ps.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
			BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: !trailers}}}}}}})
		if trailers {
			_ = ps.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}})
		}
	}
}

// sawEOS counts request_body messages with end_of_stream so far.
func (r *recorder) sawEOS() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, m := range r.msgs {
		if m.GetRequestBody().GetEndOfStream() {
			n++
		}
	}
	return n
}

func (r *recorder) messages() []*extprocv3.ProcessingRequest {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.msgs)
}

func setup(t *testing.T) (*recorder, *extproctest.Client) {
	r := &recorder{closed: make(chan error, 16)}
	conn := extproctest.Serve(t, func(g *grpc.Server) { extprocv3.RegisterExternalProcessorServer(g, r) })
	return r, extproctest.NewClient(conn)
}

func header(m *extprocv3.HttpHeaders, key string) string {
	for _, h := range m.GetHeaders().GetHeaders() {
		if h.GetKey() == key {
			return string(h.GetRawValue())
		}
	}
	return ""
}

func TestDoPlaysARequestTheWayEnvoyDoes(t *testing.T) {
	r, c := setup(t)
	body := bytes.Repeat([]byte("b"), 10)
	ex, err := c.Do(context.Background(), extproctest.Request{
		Path: "/v1/completions", Body: body, ChunkSize: 4, DuplicateEOS: true,
		Headers:    []extproctest.Header{{Key: "x-tenant-id", Value: "t"}},
		SubsetHint: []string{"10.0.0.1:80"},
		Response:   &extproctest.Response{Status: 201, Chunks: [][]byte{[]byte("r1"), []byte("r2")}, ServedEndpoint: "10.1.1.1:80"},
	})
	if err != nil {
		t.Fatal(err)
	}
	msgs := r.messages()
	hs := msgs[0].GetRequestHeaders()
	if header(hs, ":method") != "POST" || header(hs, ":path") != "/v1/completions" || header(hs, "content-type") != "application/json" ||
		header(hs, "x-tenant-id") != "t" || header(hs, "content-length") != "10" || hs.GetEndOfStream() {
		t.Fatalf("request headers = %v", hs)
	}
	hint := msgs[0].GetMetadataContext().GetFilterMetadata()[extproctest.SubsetHintNamespace].GetFields()[extproctest.SubsetHintKey]
	if hint.GetListValue().GetValues()[0].GetStringValue() != "10.0.0.1:80" {
		t.Fatalf("subset hint = %v", hint)
	}
	if msgs[0].GetProtocolConfig() != nil {
		t.Fatalf("protocol_config sent although not configured")
	}
	var sizes []int
	var eos []bool
	for _, m := range msgs[1:] {
		if b := m.GetRequestBody(); b != nil {
			sizes, eos = append(sizes, len(b.GetBody())), append(eos, b.GetEndOfStream())
		}
	}
	if !slices.Equal(sizes, []int{4, 4, 2, 2}) || !slices.Equal(eos, []bool{false, false, true, true}) {
		t.Fatalf("body chunks %v eos %v, want 4,4,2 plus a duplicate final chunk", sizes, eos)
	}
	if ex.Destination != "10.1.1.1:80" || ex.MetadataDestination != "10.1.1.1:80" || !ex.ClearRouteCache || !bytes.Equal(ex.Body, body) {
		t.Fatalf("exchange = %+v", ex)
	}
	if string(ex.ResponseEcho) != "r1r2" || len(ex.ResponseChunks) != 2 || !ex.ResponseChunks[1].EndOfStream {
		t.Fatalf("response echo %q chunks %+v", ex.ResponseEcho, ex.ResponseChunks)
	}
	var rh *extprocv3.ProcessingRequest
	for _, m := range msgs {
		if m.GetResponseHeaders() != nil {
			rh = m
		}
	}
	if header(rh.GetResponseHeaders(), ":status") != "201" ||
		rh.GetMetadataContext().GetFilterMetadata()[extproctest.LBNamespace].GetFields()[extproctest.ServedEndpointKey].GetStringValue() != "10.1.1.1:80" {
		t.Fatalf("response headers = %v", rh)
	}
	if err := <-r.closed; !errors.Is(err, io.EOF) {
		t.Fatalf("the stream was not half-closed cleanly: %v", err)
	}
}

func TestDoWithTrailersSetsNoEndOfStream(t *testing.T) {
	r, c := setup(t)
	ex, err := c.Do(context.Background(), extproctest.Request{Body: []byte("abc"), Trailers: []extproctest.Header{{Key: "t", Value: "1"}},
		Response: &extproctest.Response{Chunks: [][]byte{[]byte("x")}, Trailers: []extproctest.Header{{Key: "grpc-status", Value: "0"}}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range r.messages() {
		if m.GetRequestBody().GetEndOfStream() || m.GetResponseBody().GetEndOfStream() {
			t.Fatalf("end_of_stream set despite trailers: %v", m)
		}
	}
	if !ex.RequestTrailersReplied || !ex.ResponseTrailersReplied || string(ex.Body) != "abc" {
		t.Fatalf("exchange = %+v", ex)
	}
}

func TestDoReportsAnImmediateResponse(t *testing.T) {
	_, c := setup(t)
	ex, err := c.Do(context.Background(), extproctest.Request{Body: []byte("please reject"), Response: &extproctest.Response{}})
	if err != nil {
		t.Fatal(err)
	}
	if ex.Immediate == nil || ex.Immediate.Status != 400 || ex.Immediate.Headers["content-type"] != "application/json" || ex.Routing != nil {
		t.Fatalf("exchange = %+v", ex)
	}
}

func TestDoCancelsMidResponse(t *testing.T) {
	r, c := setup(t)
	ex, err := c.Do(context.Background(), extproctest.Request{Body: []byte("{}"),
		Response: &extproctest.Response{Chunks: [][]byte{[]byte("1"), []byte("2"), []byte("3")}, CancelAfterChunks: 1}})
	if err != nil || !ex.Cancelled || string(ex.ResponseEcho) != "1" {
		t.Fatalf("err %v exchange %+v", err, ex)
	}
	select {
	case err := <-r.closed:
		if errors.Is(err, io.EOF) {
			t.Fatalf("a cancel must reset the stream, not half-close it")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("server never saw the cancellation")
	}
}

func TestSubsetHintMetadataForms(t *testing.T) {
	for _, tc := range []struct {
		name string
		v    any
		ok   bool
	}{
		{"a CSV string is one string value", "a:1,b:2", true},
		{"a string slice is a list", []string{"a:1"}, true},
		{"a mixed list keeps non-strings", []any{"a:1", 2.0, nil}, true},
		{"an int is rejected", 5, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			md, err := extproctest.SubsetHintMetadata(tc.v)
			if (err == nil) != tc.ok {
				t.Fatalf("err = %v", err)
			}
			if tc.ok && md.GetFilterMetadata()[extproctest.SubsetHintNamespace].GetFields()[extproctest.SubsetHintKey] == nil {
				t.Fatalf("metadata = %v", md)
			}
		})
	}
}
