// Package extproctest is an Envoy emulator for testing ext_proc v3 servers, in the spirit of
// net/http/httptest: it speaks envoy.service.ext_proc.v3.ExternalProcessor/Process the way Envoy's
// ext_proc HTTP filter does (epp.md §3, §4) and reports everything the server answered.
//
// A test starts its server with Serve (gRPC on 127.0.0.1:0), wraps the connection with NewClient and
// runs one HTTP request per Do call:
//
//	conn := extproctest.Serve(t, srv.Register)
//	ex, err := extproctest.NewClient(conn).Do(ctx, extproctest.Request{
//		Path: "/v1/chat/completions",
//		Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`),
//		Response: &extproctest.Response{Chunks: [][]byte{[]byte(`data: {}` + "\n\n")}},
//	})
//	// ex.Destination, ex.Body, ex.Immediate, ex.ResponseEcho …
//
// Do sends the request headers (with :method, :path, content-type and extra headers, the protocol
// configuration and request-phase metadata), the body in chunks with end_of_stream on the last
// (optionally a duplicate end-of-stream chunk or trailers), reads the routing reply or the
// ImmediateResponse and the re-streamed body, then plays the upstream response (response headers,
// body chunks, optional trailers, optional cancellation) and closes the stream. The package does not
// depend on any kvepp package, so any package's tests can use it.
package extproctest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"
)

// DefaultChunkSize is the request body chunk size Do uses when Request.ChunkSize is 0, bytes.
const DefaultChunkSize = 16 << 10

// Metadata namespaces and keys the emulator sends and reads (Gateway API Inference Extension).
const (
	LBNamespace         = "envoy.lb"
	SubsetHintNamespace = "envoy.lb.subset_hint"
	SubsetHintKey       = "x-gateway-destination-endpoint-subset"
	DestinationKey      = "x-gateway-destination-endpoint"
	ServedEndpointKey   = "x-gateway-destination-endpoint-served"
)

// Header is one HTTP header; keys are lower-case as Envoy sends them.
type Header struct {
	// Key is the lower-case header name (pseudo-headers start with ':').
	Key string
	// Value is sent as raw_value.
	Value string
}

// Request describes one HTTP request played through the ext_proc stream.
type Request struct {
	// Method is :method (default "POST").
	Method string
	// Path is :path (default "/v1/chat/completions").
	Path string
	// ContentType is content-type (default "application/json"; "-" sends none).
	ContentType string
	// Headers are extra request headers, sent in order (repeated keys allowed).
	Headers []Header
	// Body is the request body. Empty (and not HeaderOnly) sends one empty chunk with end_of_stream.
	Body []byte
	// HeaderOnly sets end_of_stream on the request headers and sends no body (GET, HEAD, body-less POST).
	HeaderOnly bool
	// ChunkSize is the size of request body chunks in bytes (default DefaultChunkSize).
	ChunkSize int
	// DuplicateEOS re-sends the final body chunk, again with end_of_stream, right after it.
	DuplicateEOS bool
	// Trailers, when non-nil, end the request with request_trailers: no body chunk sets end_of_stream.
	Trailers []Header
	// SubsetHint, when non-nil, is sent as request-phase metadata_context
	// filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]: a string, a
	// []string, or a []any (non-string entries allowed, to test tolerance).
	SubsetHint any
	// ProtocolConfig, when non-nil, is sent on the first message (nil: absent, which the server must
	// treat as FULL_DUPLEX_STREAMED for both directions). It also selects how the emulator behaves:
	// BUFFERED request bodies are sent whole after the header reply; NONE sends no body.
	ProtocolConfig *extprocv3.ProtocolConfiguration
	// ObservabilityMode sets observability_mode on the first message.
	ObservabilityMode bool
	// Response, when non-nil, is the upstream response played after a routed request. Nil ends the
	// exchange after the request phase by cancelling the stream, as Envoy does when the downstream
	// client goes away before the upstream answers (Exchange.Cancelled is then true).
	Response *Response
}

// Response describes the upstream response played back through the stream.
type Response struct {
	// Status is :status (default 200).
	Status int
	// ContentType is content-type (default "application/json"; "-" sends none).
	ContentType string
	// Headers are extra response headers.
	Headers []Header
	// Chunks are the response body chunks. None: the response headers carry end_of_stream (unless
	// Trailers are set).
	Chunks [][]byte
	// Trailers, when non-nil, end the response with response_trailers instead of a body end_of_stream.
	Trailers []Header
	// ServedEndpoint, when set, is sent as response-phase metadata
	// filter_metadata["envoy.lb"]["x-gateway-destination-endpoint-served"].
	ServedEndpoint string
	// LBMetadataWithoutServed sends filter_metadata["envoy.lb"] without the served key (when
	// ServedEndpoint is empty), as a gateway that reports other load-balancing metadata.
	LBMetadataWithoutServed bool
	// CancelAfterHeaders cancels the stream right after the response headers reply (client disconnect).
	CancelAfterHeaders bool
	// CancelAfterChunks > 0 cancels the stream after that many response chunks were sent and answered.
	CancelAfterChunks int
}

// Chunk is one body chunk the server returned in a streamed_response.
type Chunk struct {
	// Body is the chunk's bytes.
	Body []byte
	// EndOfStream is the chunk's end_of_stream flag.
	EndOfStream bool
}

// Immediate is an ImmediateResponse the server sent instead of routing.
type Immediate struct {
	// Status is the HTTP status code.
	Status int
	// Headers are the response headers set by the server (key → raw value, last wins).
	Headers map[string]string
	// Body is the response body.
	Body []byte
	// Details is the ImmediateResponse details string.
	Details string
}

// Exchange is everything observed during one Do.
type Exchange struct {
	// Immediate is non-nil when the server answered with an ImmediateResponse.
	Immediate *Immediate
	// Routing is the CommonResponse carrying the routing header mutation: of the request_headers
	// reply (FULL_DUPLEX_STREAMED, NONE, header-only) or of the request_body reply (BUFFERED).
	Routing *extprocv3.CommonResponse
	// SetHeaders are the routing mutation's set_headers (key → raw value, last wins).
	SetHeaders map[string]string
	// SetHeaderActions are the append actions of SetHeaders, by key.
	SetHeaderActions map[string]corev3.HeaderValueOption_HeaderAppendAction
	// RemovedHeaders are the routing mutation's remove_headers.
	RemovedHeaders []string
	// ClearRouteCache is the routing reply's clear_route_cache.
	ClearRouteCache bool
	// Destination is the x-gateway-destination-endpoint header value ("" when not set).
	Destination string
	// DynamicMetadata is the dynamic_metadata sent with the routing reply.
	DynamicMetadata *structpb.Struct
	// RoutingLatency is the time from sending the request's last message (the end of stream, the
	// trailers, or the headers of a header-only request) to receiving the routing reply: the
	// routing decision as the proxy waits for it.
	RoutingLatency time.Duration
	// MetadataDestination is DynamicMetadata's envoy.lb x-gateway-destination-endpoint value.
	MetadataDestination string
	// BodyChunks are the re-streamed request body chunks in order (FULL_DUPLEX_STREAMED).
	BodyChunks []Chunk
	// Body is the request body as the upstream would receive it: the re-streamed chunks
	// concatenated, or in BUFFERED mode the body mutation (or the original body when none).
	Body []byte
	// BodyMutated reports a BUFFERED body_mutation.body.
	BodyMutated bool
	// RequestTrailersReplied reports that a request_trailers reply arrived.
	RequestTrailersReplied bool
	// ResponseHeadersReplied reports that the response_headers reply arrived.
	ResponseHeadersReplied bool
	// ResponseSetHeaders are the response_headers reply's set_headers (key → raw value, last wins).
	ResponseSetHeaders map[string]string
	// ResponseChunks are the streamed_response echoes of response body chunks (FULL_DUPLEX_STREAMED).
	ResponseChunks []Chunk
	// ResponseEcho is the concatenation of ResponseChunks' bodies.
	ResponseEcho []byte
	// ResponseBodyReplies counts response_body replies of any kind (echo or CONTINUE).
	ResponseBodyReplies int
	// ResponseTrailersReplied reports that a response_trailers reply arrived.
	ResponseTrailersReplied bool
	// Cancelled reports that the emulator cancelled the stream mid-response.
	Cancelled bool
	// Messages are all ProcessingResponses received, in order.
	Messages []*extprocv3.ProcessingResponse
}

// Client plays HTTP requests through an ext_proc server, as Envoy does.
type Client struct {
	c extprocv3.ExternalProcessorClient
}

// NewClient returns a Client over conn.
func NewClient(conn *grpc.ClientConn) *Client {
	return &Client{c: extprocv3.NewExternalProcessorClient(conn)}
}

// Open opens a raw Process stream for tests that script messages by hand (see the message builders
// RequestHeaders, RequestBody, ResponseHeaders, ResponseBody).
func (c *Client) Open(ctx context.Context) (extprocv3.ExternalProcessor_ProcessClient, error) {
	return c.c.Process(ctx)
}

// Do plays req through one Process stream and returns what the server answered. The error is
// non-nil when the stream failed (a gRPC status from the server, e.g. FAILED_PRECONDITION, or a
// transport error) or the server broke the protocol (an unexpected message); the Exchange then holds
// what was observed up to that point.
func (c *Client) Do(ctx context.Context, req Request) (*Exchange, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ps, err := c.c.Process(ctx)
	if err != nil {
		return nil, fmt.Errorf("open Process stream: %w", err)
	}
	e := &emulator{ps: ps, req: req, ex: &Exchange{}, cancel: cancel}
	e.reqMode = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	e.respMode = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	if pc := req.ProtocolConfig; pc != nil {
		e.reqMode, e.respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
	}
	err = e.run()
	return e.ex, err
}

// emulator is the state of one Do.
type emulator struct {
	ps                extprocv3.ExternalProcessor_ProcessClient
	req               Request
	ex                *Exchange
	cancel            context.CancelFunc
	reqMode, respMode filterv3.ProcessingMode_BodySendMode
	sentFirst         bool
	// requestSent is when the request's last message was sent (RoutingLatency's start).
	requestSent time.Time
}

// send sends one message, adding the first-message fields. io.EOF (the server ended the stream) is
// returned as is so the caller can fetch the real status with recv.
func (e *emulator) send(m *extprocv3.ProcessingRequest) error {
	if !e.sentFirst {
		e.sentFirst = true
		m.ProtocolConfig = e.req.ProtocolConfig
		m.ObservabilityMode = e.req.ObservabilityMode
	}
	return e.ps.Send(m)
}

// recv receives one message and records it.
func (e *emulator) recv() (*extprocv3.ProcessingResponse, error) {
	m, err := e.ps.Recv()
	if err != nil {
		return nil, err
	}
	e.ex.Messages = append(e.ex.Messages, m)
	if ir := m.GetImmediateResponse(); ir != nil {
		e.ex.Immediate = immediate(ir)
	}
	return m, nil
}

// finalStatus drains the stream after the server ended it and returns its status (nil for OK).
func (e *emulator) finalStatus() error {
	for {
		if _, err := e.recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

// sendOrStatus sends m; when the server already ended the stream it returns the stream's status
// (or errStopped for a clean end).
func (e *emulator) sendOrStatus(m *extprocv3.ProcessingRequest) error {
	if err := e.send(m); err != nil {
		if errors.Is(err, io.EOF) {
			if st := e.finalStatus(); st != nil {
				return st
			}
			return errStopped
		}
		return err
	}
	return nil
}

var errStopped = errors.New("server ended the stream")

func (e *emulator) run() error {
	err := e.request()
	if errors.Is(err, errStopped) {
		if e.ex.Immediate != nil {
			return nil
		}
		return errors.New("server ended the stream without answering the request")
	}
	if err != nil || e.ex.Immediate != nil {
		if err == nil {
			_ = e.ps.CloseSend()
			err = e.finalStatus()
		}
		return err
	}
	if e.req.Response == nil {
		e.cancel() // the downstream went away before any response
		e.ex.Cancelled = true
		return nil
	}
	if err := e.response(); err != nil || e.ex.Cancelled {
		if errors.Is(err, errStopped) {
			return errors.New("server ended the stream during the response")
		}
		return err
	}
	if err := e.ps.CloseSend(); err != nil {
		return err
	}
	return e.finalStatus()
}

// request plays the request phase.
func (e *emulator) request() error {
	r := e.req
	method, path, ct := r.Method, r.Path, r.ContentType
	if method == "" {
		method = "POST"
	}
	if path == "" {
		path = "/v1/chat/completions"
	}
	if ct == "" {
		ct = "application/json"
	}
	hs := []Header{{":method", method}, {":path", path}, {":authority", "gateway.test"}, {":scheme", "http"}}
	if ct != "-" {
		hs = append(hs, Header{"content-type", ct})
	}
	if !r.HeaderOnly {
		hs = append(hs, Header{"content-length", strconv.Itoa(len(r.Body))})
	}
	hs = append(hs, r.Headers...)
	headerEOS := r.HeaderOnly
	hm := RequestHeaders(headerEOS, hs...)
	if r.SubsetHint != nil {
		md, err := SubsetHintMetadata(r.SubsetHint)
		if err != nil {
			return err
		}
		hm.MetadataContext = md
	}
	e.requestSent = time.Now()
	if err := e.sendOrStatus(hm); err != nil {
		return err
	}
	if headerEOS || e.reqMode == filterv3.ProcessingMode_NONE {
		return e.readRouting(false, false)
	}
	if e.reqMode == filterv3.ProcessingMode_BUFFERED {
		return e.bufferedRequest()
	}
	// FULL_DUPLEX_STREAMED: stream every chunk without waiting, then read the replies.
	if err := e.sendBody(); err != nil {
		return err
	}
	return e.readRouting(true, r.Trailers != nil)
}

// sendBody streams the request body in chunks (plus the duplicate end-of-stream chunk and trailers).
func (e *emulator) sendBody() error {
	r := e.req
	size := r.ChunkSize
	if size <= 0 {
		size = DefaultChunkSize
	}
	hasTrailers := r.Trailers != nil
	body := r.Body
	var last []byte
	for {
		n := min(size, len(body))
		chunk := body[:n]
		body = body[n:]
		end := len(body) == 0
		last = chunk
		e.requestSent = time.Now()
		if err := e.sendOrStatus(RequestBody(chunk, end && !hasTrailers)); err != nil {
			return err
		}
		if end {
			break
		}
	}
	if r.DuplicateEOS {
		if err := e.sendOrStatus(RequestBody(last, true)); err != nil {
			return err
		}
	}
	if hasTrailers {
		e.requestSent = time.Now()
		if err := e.sendOrStatus(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{
			RequestTrailers: &extprocv3.HttpTrailers{Trailers: headerMap(r.Trailers)},
		}}); err != nil {
			return err
		}
	}
	return nil
}

// bufferedRequest plays BUFFERED mode: headers reply first, then the whole body in one message.
func (e *emulator) bufferedRequest() error {
	m, err := e.recvOrStop()
	if err != nil {
		return err
	}
	if m.GetImmediateResponse() != nil {
		return nil
	}
	if m.GetRequestHeaders() == nil {
		return fmt.Errorf("BUFFERED: expected a request_headers reply, got %T", m.GetResponse())
	}
	hasTrailers := e.req.Trailers != nil
	e.requestSent = time.Now()
	if err := e.sendOrStatus(RequestBody(e.req.Body, !hasTrailers)); err != nil {
		return err
	}
	if hasTrailers {
		e.requestSent = time.Now()
		if err := e.sendOrStatus(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{
			RequestTrailers: &extprocv3.HttpTrailers{Trailers: headerMap(e.req.Trailers)},
		}}); err != nil {
			return err
		}
	}
	m, err = e.recvOrStop()
	if err != nil {
		return err
	}
	if m.GetImmediateResponse() != nil {
		return nil
	}
	br := m.GetRequestBody()
	if br == nil {
		return fmt.Errorf("BUFFERED: expected a request_body reply, got %T", m.GetResponse())
	}
	e.routing(br.GetResponse(), m.GetDynamicMetadata())
	e.ex.Body = e.req.Body
	if b, ok := br.GetResponse().GetBodyMutation().GetMutation().(*extprocv3.BodyMutation_Body); ok {
		e.ex.Body, e.ex.BodyMutated = b.Body, true
	}
	if hasTrailers {
		m, err = e.recvOrStop()
		if err != nil {
			return err
		}
		if m.GetRequestTrailers() == nil {
			return fmt.Errorf("BUFFERED: expected a request_trailers reply, got %T", m.GetResponse())
		}
		e.ex.RequestTrailersReplied = true
	}
	return nil
}

// recvOrStop receives one message; a clean end of stream becomes errStopped.
func (e *emulator) recvOrStop() (*extprocv3.ProcessingResponse, error) {
	m, err := e.recv()
	if errors.Is(err, io.EOF) {
		return nil, errStopped
	}
	return m, err
}

// readRouting reads the routing HeadersResponse (or an ImmediateResponse) and, when withBody, the
// re-streamed body up to its end_of_stream (or the trailers reply when the request had trailers).
func (e *emulator) readRouting(withBody, trailers bool) error {
	m, err := e.recvOrStop()
	if err != nil {
		return err
	}
	if m.GetImmediateResponse() != nil {
		return nil
	}
	hr := m.GetRequestHeaders()
	if hr == nil {
		return fmt.Errorf("expected the request_headers reply first, got %T", m.GetResponse())
	}
	e.routing(hr.GetResponse(), m.GetDynamicMetadata())
	if !withBody {
		return nil
	}
	for {
		m, err := e.recvOrStop()
		if err != nil {
			return err
		}
		switch r := m.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_RequestBody:
			sr := r.RequestBody.GetResponse().GetBodyMutation().GetStreamedResponse()
			if sr == nil {
				return errors.New("FULL_DUPLEX_STREAMED: request_body reply without streamed_response")
			}
			e.ex.BodyChunks = append(e.ex.BodyChunks, Chunk{Body: sr.GetBody(), EndOfStream: sr.GetEndOfStream()})
			e.ex.Body = append(e.ex.Body, sr.GetBody()...)
			if sr.GetEndOfStream() {
				if trailers {
					return errors.New("a re-streamed chunk set end_of_stream although the request had trailers")
				}
				return nil
			}
		case *extprocv3.ProcessingResponse_RequestTrailers:
			e.ex.RequestTrailersReplied = true
			if !trailers {
				return errors.New("unexpected request_trailers reply")
			}
			return nil
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			return nil
		default:
			return fmt.Errorf("unexpected %T while reading the re-streamed body", r)
		}
	}
}

// routing records the routing reply.
func (e *emulator) routing(c *extprocv3.CommonResponse, md *structpb.Struct) {
	e.ex.RoutingLatency = time.Since(e.requestSent)
	e.ex.Routing = c
	e.ex.ClearRouteCache = c.GetClearRouteCache()
	e.ex.SetHeaders = map[string]string{}
	e.ex.SetHeaderActions = map[string]corev3.HeaderValueOption_HeaderAppendAction{}
	for _, h := range c.GetHeaderMutation().GetSetHeaders() {
		v := h.GetHeader().GetValue()
		if raw := h.GetHeader().GetRawValue(); len(raw) > 0 {
			v = string(raw)
		}
		e.ex.SetHeaders[h.GetHeader().GetKey()] = v
		e.ex.SetHeaderActions[h.GetHeader().GetKey()] = h.GetAppendAction()
	}
	e.ex.RemovedHeaders = c.GetHeaderMutation().GetRemoveHeaders()
	e.ex.Destination = e.ex.SetHeaders[DestinationKey]
	e.ex.DynamicMetadata = md
	e.ex.MetadataDestination = md.GetFields()[LBNamespace].GetStructValue().GetFields()[DestinationKey].GetStringValue()
}

// response plays the upstream response.
func (e *emulator) response() error {
	r := e.req.Response
	st := r.Status
	if st == 0 {
		st = 200
	}
	ct := r.ContentType
	if ct == "" {
		ct = "application/json"
	}
	hs := []Header{{":status", strconv.Itoa(st)}}
	if ct != "-" {
		hs = append(hs, Header{"content-type", ct})
	}
	hs = append(hs, r.Headers...)
	bodyMsgs := len(r.Chunks) > 0 && e.respMode != filterv3.ProcessingMode_NONE
	hm := ResponseHeaders(!bodyMsgs && r.Trailers == nil, hs...)
	if r.ServedEndpoint != "" {
		hm.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			LBNamespace: {Fields: map[string]*structpb.Value{ServedEndpointKey: structpb.NewStringValue(r.ServedEndpoint)}},
		}}
	} else if r.LBMetadataWithoutServed {
		hm.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			LBNamespace: {Fields: map[string]*structpb.Value{"x-other": structpb.NewStringValue("1")}},
		}}
	}
	if err := e.sendOrStatus(hm); err != nil {
		return err
	}
	m, err := e.recvOrStop()
	if err != nil {
		return err
	}
	if m.GetResponseHeaders() == nil {
		return fmt.Errorf("expected a response_headers reply, got %T", m.GetResponse())
	}
	e.ex.ResponseHeadersReplied = true
	for _, h := range m.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if e.ex.ResponseSetHeaders == nil {
			e.ex.ResponseSetHeaders = map[string]string{}
		}
		v := string(h.GetHeader().GetRawValue())
		if v == "" {
			v = h.GetHeader().GetValue()
		}
		e.ex.ResponseSetHeaders[h.GetHeader().GetKey()] = v
	}
	if r.CancelAfterHeaders {
		e.cancel()
		e.ex.Cancelled = true
		return nil
	}
	if bodyMsgs {
		chunks := r.Chunks
		if e.respMode == filterv3.ProcessingMode_BUFFERED {
			var whole []byte
			for _, c := range chunks {
				whole = append(whole, c...)
			}
			chunks = [][]byte{whole}
		}
		for i, c := range chunks {
			end := i == len(chunks)-1 && r.Trailers == nil
			if err := e.sendOrStatus(ResponseBody(c, end)); err != nil {
				return err
			}
			m, err := e.recvOrStop()
			if err != nil {
				return err
			}
			rb := m.GetResponseBody()
			if rb == nil {
				return fmt.Errorf("expected a response_body reply, got %T", m.GetResponse())
			}
			e.ex.ResponseBodyReplies++
			if sr := rb.GetResponse().GetBodyMutation().GetStreamedResponse(); sr != nil {
				e.ex.ResponseChunks = append(e.ex.ResponseChunks, Chunk{Body: sr.GetBody(), EndOfStream: sr.GetEndOfStream()})
				e.ex.ResponseEcho = append(e.ex.ResponseEcho, sr.GetBody()...)
			}
			if r.CancelAfterChunks > 0 && i+1 == r.CancelAfterChunks {
				e.cancel()
				e.ex.Cancelled = true
				return nil
			}
		}
	}
	if r.Trailers != nil {
		if err := e.sendOrStatus(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{
			ResponseTrailers: &extprocv3.HttpTrailers{Trailers: headerMap(r.Trailers)},
		}}); err != nil {
			return err
		}
		m, err := e.recvOrStop()
		if err != nil {
			return err
		}
		if m.GetResponseTrailers() == nil {
			return fmt.Errorf("expected a response_trailers reply, got %T", m.GetResponse())
		}
		e.ex.ResponseTrailersReplied = true
	}
	return nil
}

// immediate converts an ImmediateResponse.
func immediate(ir *extprocv3.ImmediateResponse) *Immediate {
	im := &Immediate{Status: int(ir.GetStatus().GetCode()), Headers: map[string]string{}, Body: ir.GetBody(), Details: ir.GetDetails()}
	for _, h := range ir.GetHeaders().GetSetHeaders() {
		v := h.GetHeader().GetValue()
		if raw := h.GetHeader().GetRawValue(); len(raw) > 0 {
			v = string(raw)
		}
		im.Headers[h.GetHeader().GetKey()] = v
	}
	return im
}

// headerMap builds a HeaderMap with raw_value set, as Envoy sends headers.
func headerMap(hs []Header) *corev3.HeaderMap {
	m := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, 0, len(hs))}
	for _, h := range hs {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: h.Key, RawValue: []byte(h.Value)})
	}
	return m
}

// RequestHeaders builds a request_headers message (raw_value headers, as Envoy sends them).
func RequestHeaders(endOfStream bool, headers ...Header) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: headerMap(headers), EndOfStream: endOfStream},
	}}
}

// RequestBody builds a request_body message.
func RequestBody(body []byte, endOfStream bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: endOfStream},
	}}
}

// ResponseHeaders builds a response_headers message.
func ResponseHeaders(endOfStream bool, headers ...Header) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: headerMap(headers), EndOfStream: endOfStream},
	}}
}

// ResponseBody builds a response_body message.
func ResponseBody(body []byte, endOfStream bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: body, EndOfStream: endOfStream},
	}}
}

// SubsetHintMetadata builds request-phase metadata carrying a subset hint: v is a string (one
// comma-separated value), a []string, or a []any whose entries become list values (non-strings
// included). Other types are an error.
func SubsetHintMetadata(v any) (*corev3.Metadata, error) {
	var val *structpb.Value
	switch x := v.(type) {
	case string:
		val = structpb.NewStringValue(x)
	case []string:
		l := &structpb.ListValue{}
		for _, s := range x {
			l.Values = append(l.Values, structpb.NewStringValue(s))
		}
		val = structpb.NewListValue(l)
	case []any:
		lv, err := structpb.NewList(x)
		if err != nil {
			return nil, fmt.Errorf("subset hint %v: %w", v, err)
		}
		val = structpb.NewListValue(lv)
	default:
		return nil, fmt.Errorf("subset hint of type %T: want string, []string or []any", v)
	}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		SubsetHintNamespace: {Fields: map[string]*structpb.Value{SubsetHintKey: val}},
	}}, nil
}

// TB is the part of testing.TB that Serve uses. Declaring it here keeps the testing package (and
// its flags) out of binaries that use the emulator as a client, such as `epp route`.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
	Cleanup(func())
}

// Serve starts a gRPC server on 127.0.0.1:0 with the given options, lets register add its services,
// and returns a plaintext client connection to it. The server and connection are stopped by
// tb.Cleanup; a listen or dial failure fails tb (pass the test's *testing.T or *testing.B).
func Serve(tb TB, register func(*grpc.Server), opts ...grpc.ServerOption) *grpc.ClientConn {
	tb.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("listen on loopback: %v", err)
	}
	g := grpc.NewServer(opts...)
	register(g)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = g.Serve(lis)
	}()
	conn, err := grpc.NewClient(lis.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(256<<20), grpc.MaxCallSendMsgSize(256<<20)))
	if err != nil {
		g.Stop()
		tb.Fatalf("dial %s: %v", lis.Addr(), err)
	}
	tb.Cleanup(func() {
		_ = conn.Close()
		g.Stop()
		<-done
	})
	return conn
}
