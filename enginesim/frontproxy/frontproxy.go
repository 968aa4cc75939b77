// Package frontproxy is an HTTP reverse proxy that consults an Envoy external processor
// (ext_proc v3) for every request exactly the way Envoy's ext_proc HTTP filter does with the
// processing mode kvepp's reference configuration uses (epp.md §3, §4): request and response
// headers SEND, request and response bodies FULL_DUPLEX_STREAMED. It stands in for Envoy in
// benchmarks and tests (cmd/eppbench), so a picker can be measured end to end without an Envoy
// binary, next to the simulated vLLM workers of package enginesim.
//
// # One request
//
// For each HTTP request the proxy opens one Process stream and
//
//  1. sends request_headers (pseudo-headers :method, :path, :authority, :scheme, then every client
//     header lower-cased, repeated keys as repeated entries, values in raw_value) with
//     protocol_config FULL_DUPLEX_STREAMED for both directions;
//  2. sends the client body as request_body chunks of at most Config.RequestChunkSize bytes, the
//     last with end_of_stream (an empty body is one empty chunk with end_of_stream);
//  3. waits for the routing reply: an ImmediateResponse is returned to the client as is (status,
//     headers, body) and ends the exchange; otherwise the request_headers HeadersResponse carries
//     the header mutation (x-gateway-destination-endpoint and friends), and the re-streamed body
//     follows as request_body streamed_response chunks up to end_of_stream. The time from sending
//     the body's end_of_stream to receiving the HeadersResponse is the picker's decision latency
//     ([Exchange.Decision]);
//  4. forwards the (mutated) request to the first reachable entry of
//     x-gateway-destination-endpoint ("ip:port[,ip:port…]", like Envoy's ORIGINAL_DST cluster with
//     use_http_header), walking the list on connection failure; with no reachable entry the client
//     gets 503 and the ext_proc stream sees a 503 response;
//  5. sends response_headers (:status plus the upstream headers, and the served endpoint as
//     response-phase metadata envoy.lb x-gateway-destination-endpoint-served), then streams the
//     upstream body: each read of at most Config.ResponseChunkSize bytes is sent as one
//     response_body chunk and the echoed streamed_response bytes are written and flushed to the
//     client before the next read (stop-and-wait: while the proxy waits, the upstream keeps
//     writing into the socket, so a fast token stream is coalesced into larger chunks, as Envoy's
//     read buffers do). The upstream end of body is end_of_stream on the last chunk (an empty chunk
//     when the end arrives on its own);
//  6. half-closes the stream and waits for the server to end it.
//
// Config.ResponseCoalesce optionally paces step 5 (at most one response_body message per
// interval after the first), which cuts the per-token message rate of long token streams in
// benchmarks without delaying the first chunk.
//
// A client that goes away cancels the stream (the picker then frees its booking, epp.md §7) and the
// upstream request. Differences from Envoy, none of which kvepp observes: the re-streamed request
// body is buffered whole before the upstream request starts; upstream trailers are not forwarded;
// request trailers are never sent.
package frontproxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"
)

// Header and metadata names of the Gateway API Inference Extension protocol (epp.md §5.9, §6.1).
const (
	// DestinationHeader is the routing header the picker sets: "ip:port" or a comma list.
	DestinationHeader = "x-gateway-destination-endpoint"
	// WorkerIDHeader is the chosen worker_id (decimal) the picker sets.
	WorkerIDHeader = "x-dynamo-worker-instance-id"
	// LBNamespace is the filter-metadata namespace of the destination and served endpoint.
	LBNamespace = "envoy.lb"
	// ServedEndpointKey is the response-phase metadata key naming the endpoint actually used.
	ServedEndpointKey = "x-gateway-destination-endpoint-served"
)

// Response headers the proxy adds to every answer it gives the client, like Envoy's
// x-envoy-upstream-service-time.
const (
	// DecisionHeader carries the picker's decision latency in microseconds.
	DecisionHeader = "X-Frontproxy-Decision-Us"
	// ServedHeader carries the endpoint ("ip:port") the request was served by.
	ServedHeader = "X-Frontproxy-Served-Endpoint"
)

// Defaults applied by [New] to zero-valued [Config] fields.
const (
	DefaultRequestChunkSize  = 16 << 10           // bytes per request_body message (Envoy's 16 KiB)
	DefaultResponseChunkSize = 64 << 10           // bytes per upstream read / response_body message
	DefaultMaxRequestBody    = 64 << 20           // bytes of client body accepted
	DefaultMessageTimeout    = 1000 * time.Second // epp.md §3 reference message_timeout
	DefaultUpstreamDial      = 2 * time.Second    // connect timeout per destination entry
)

// maxGRPCMessage bounds gRPC messages in both directions (a 62,000-byte re-streamed chunk or a
// large ImmediateResponse fit easily).
const maxGRPCMessage = 256 << 20

// Config configures a [Proxy]. Zero values take the defaults named on each field; negative sizes
// or durations make [New] fail.
type Config struct {
	// ExtProc is the connection to the ext_proc server (required); see [Dial]. The caller owns it.
	ExtProc grpc.ClientConnInterface
	// Upstream sends requests to the model servers. nil = a client tuned for loopback benchmarks
	// (no proxy from the environment, no compression, up to 4096 idle connections per host).
	Upstream *http.Client
	// RequestChunkSize is the largest request_body message, bytes. Default 16 KiB.
	RequestChunkSize int
	// ResponseChunkSize is the largest upstream read sent as one response_body message, bytes.
	// Default 64 KiB.
	ResponseChunkSize int
	// MaxRequestBody caps the client body, bytes; larger bodies get 413 without contacting the
	// picker. Default 64 MiB.
	MaxRequestBody int64
	// MessageTimeout bounds the wait for each ext_proc reply (the routing reply, each body echo).
	// Default 1000 s, the reference message_timeout of epp.md §3.
	MessageTimeout time.Duration
	// ResponseCoalesce, when > 0, is the least time between two response_body messages of one
	// exchange: after each echoed chunk the proxy waits that long before reading the upstream
	// again, so a token-per-event SSE stream reaches the ext_proc server (and the client) in
	// fewer, larger chunks. The first chunk (which tells the picker that prefill is complete) is
	// never delayed. Default 0: stop-and-wait only, as Envoy. A benchmark economy; see the package
	// documentation.
	ResponseCoalesce time.Duration
	// Observe, when non-nil, is called once per request after the exchange ended, from the
	// request's goroutine. It must be safe for concurrent use.
	Observe func(Exchange)
}

// Exchange describes one proxied request. Durations are wall-clock time.
type Exchange struct {
	// RequestID is the client's x-request-id header ("" when absent).
	RequestID string
	// Method and Path are the client's request line.
	Method, Path string
	// Start is when the proxy received the request headers.
	Start time.Time
	// Decision is the picker's decision latency: from sending the request body's end_of_stream to
	// receiving the routing HeadersResponse (or the ImmediateResponse). 0 when the picker never
	// answered.
	Decision time.Duration
	// Destination is the x-gateway-destination-endpoint value the picker set ("" without a pick).
	Destination string
	// WorkerID is the x-dynamo-worker-instance-id value the picker set ("" without a pick).
	WorkerID string
	// Served is the destination entry the request was sent to ("" when none was reachable).
	Served string
	// Immediate is the status of the picker's ImmediateResponse, 0 when it routed the request.
	Immediate int
	// Status is the status the client received.
	Status int
	// ResponseBytes is the number of response body bytes written to the client.
	ResponseBytes int64
	// FirstByte is the time from Start to the first response body byte written to the client
	// (0 when none was written).
	FirstByte time.Duration
	// Duration is the time from Start to the end of the exchange.
	Duration time.Duration
	// Err is why the exchange failed: an ext_proc stream error or protocol violation, an
	// unreachable upstream, or the client going away. nil for a completed exchange (including one
	// the picker rejected with an ImmediateResponse).
	Err error
}

// Proxy is the HTTP handler that routes every request through the ext_proc server. It is safe for
// concurrent use.
type Proxy struct {
	cfg    Config
	client extprocv3.ExternalProcessorClient
}

var _ http.Handler = (*Proxy)(nil)

// New validates cfg, fills in defaults and returns a Proxy. It fails when ExtProc is nil or a size
// or duration is negative.
func New(cfg Config) (*Proxy, error) {
	if cfg.ExtProc == nil {
		return nil, errors.New("frontproxy: Config.ExtProc is required")
	}
	for _, f := range []struct {
		name string
		v    int64
	}{
		{"RequestChunkSize", int64(cfg.RequestChunkSize)},
		{"ResponseChunkSize", int64(cfg.ResponseChunkSize)},
		{"MaxRequestBody", cfg.MaxRequestBody},
		{"MessageTimeout", int64(cfg.MessageTimeout)},
		{"ResponseCoalesce", int64(cfg.ResponseCoalesce)},
	} {
		if f.v < 0 {
			return nil, fmt.Errorf("frontproxy: %s %d is negative", f.name, f.v)
		}
	}
	if cfg.RequestChunkSize == 0 {
		cfg.RequestChunkSize = DefaultRequestChunkSize
	}
	if cfg.ResponseChunkSize == 0 {
		cfg.ResponseChunkSize = DefaultResponseChunkSize
	}
	if cfg.MaxRequestBody == 0 {
		cfg.MaxRequestBody = DefaultMaxRequestBody
	}
	if cfg.MessageTimeout == 0 {
		cfg.MessageTimeout = DefaultMessageTimeout
	}
	if cfg.Upstream == nil {
		cfg.Upstream = NewUpstreamClient()
	}
	return &Proxy{cfg: cfg, client: extprocv3.NewExternalProcessorClient(cfg.ExtProc)}, nil
}

// NewUpstreamClient returns the HTTP client the proxy uses by default: no proxy from the
// environment, no transparent compression, a 2 s connect timeout, up to 4096 idle connections
// per host and 64 KiB read buffers (so one read can return many buffered SSE events), suited to
// many concurrent streams over loopback.
func NewUpstreamClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		ReadBufferSize:      64 << 10,
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: DefaultUpstreamDial, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        0,
		MaxIdleConnsPerHost: 4096,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
		ForceAttemptHTTP2:   false,
	}}
}

// Dial connects to an ext_proc server at addr ("host:port"). With useTLS the connection uses TLS
// without verifying the certificate (kvepp's default self-signed certificate, epp.md §3);
// otherwise plaintext h2c. Message size limits are raised to 256 MiB both ways.
func Dial(addr string, useTLS bool) (*grpc.ClientConn, error) {
	creds := insecure.NewCredentials()
	if useTLS {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}}) //nolint:gosec // self-signed EPP certificate, as Envoy is configured
	}
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxGRPCMessage), grpc.MaxCallSendMsgSize(maxGRPCMessage)))
	if err != nil {
		return nil, fmt.Errorf("frontproxy: dial ext_proc %q: %w", addr, err)
	}
	return conn, nil
}

// hopHeaders are connection-level headers never forwarded (RFC 9110 §7.6.1), plus those the
// proxy recomputes.
var hopHeaders = map[string]bool{
	"connection": true, "keep-alive": true, "proxy-connection": true, "te": true, "trailer": true,
	"transfer-encoding": true, "upgrade": true, "host": true, "content-length": true,
}

// ServeHTTP proxies one request through the ext_proc server (see the package documentation).
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ex := Exchange{RequestID: r.Header.Get("X-Request-Id"), Method: r.Method, Path: r.URL.RequestURI(), Start: time.Now()}
	rw := &countingWriter{w: w, start: ex.Start}
	ex.Err = p.serve(rw, r, &ex)
	ex.Status, ex.ResponseBytes, ex.FirstByte = rw.status, rw.n, rw.firstByte
	ex.Duration = time.Since(ex.Start)
	if p.cfg.Observe != nil {
		p.cfg.Observe(ex)
	}
}

// serve runs the exchange; the returned error is recorded in Exchange.Err.
func (p *Proxy) serve(w *countingWriter, r *http.Request, ex *Exchange) error {
	body, err := io.ReadAll(io.LimitReader(r.Body, p.cfg.MaxRequestBody+1))
	if err != nil {
		localReply(w, http.StatusBadRequest, "cannot read request body: "+err.Error())
		return fmt.Errorf("read client body: %w", err)
	}
	if int64(len(body)) > p.cfg.MaxRequestBody {
		localReply(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds %d bytes", p.cfg.MaxRequestBody))
		return nil
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	st := &stream{p: p, ctx: ctx, cancel: cancel}
	st.ps, err = p.client.Process(ctx)
	if err != nil {
		localReply(w, http.StatusInternalServerError, "ext_proc stream: "+err.Error())
		return fmt.Errorf("open ext_proc stream: %w", err)
	}
	defer st.stopTimer()

	// 1-2. Request headers and body.
	if err := st.sendRequest(r, body); err != nil {
		return st.fail(w, fmt.Errorf("send request: %w", err))
	}
	eosAt := time.Now()
	// 3. Routing reply.
	m, err := st.recv()
	if err != nil {
		return st.fail(w, fmt.Errorf("routing reply: %w", err))
	}
	ex.Decision = time.Since(eosAt)
	if ir := m.GetImmediateResponse(); ir != nil {
		ex.Immediate = int(ir.GetStatus().GetCode())
		writeImmediate(w, ir)
		return st.finish()
	}
	hr := m.GetRequestHeaders()
	if hr == nil {
		return st.fail(w, fmt.Errorf("routing reply: expected request_headers, got %T", m.GetResponse()))
	}
	out := r.Header.Clone()
	path := r.URL.RequestURI()
	applyMutation(out, &path, hr.GetResponse().GetHeaderMutation())
	ex.Destination = out.Get(DestinationHeader)
	ex.WorkerID = out.Get(WorkerIDHeader)
	fwdBody, err := st.restreamedBody(len(body))
	if err != nil {
		return st.fail(w, fmt.Errorf("re-streamed body: %w", err))
	}
	if ir := st.immediate; ir != nil {
		ex.Immediate = int(ir.GetStatus().GetCode())
		writeImmediate(w, ir)
		return st.finish()
	}

	// 4. Upstream.
	w.Header().Set(DecisionHeader, strconv.FormatInt(ex.Decision.Microseconds(), 10))
	resp, served, upErr := p.forward(ctx, r.Method, path, out, fwdBody, ex.Destination)
	ex.Served = served
	if upErr != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("client went away: %w", context.Cause(ctx))
		}
		// Envoy's local reply goes through the response path of the filter too.
		hdr := http.Header{"Content-Type": {"text/plain"}}
		msg := []byte("upstream connect error: " + upErr.Error())
		if err := st.respond(w, http.StatusServiceUnavailable, hdr, "", bytes.NewReader(msg)); err != nil {
			return err
		}
		return fmt.Errorf("upstream %q: %w", ex.Destination, upErr)
	}
	defer resp.Body.Close()
	w.Header().Set(ServedHeader, served)
	// 5-6. Response.
	if err := st.respond(w, resp.StatusCode, resp.Header, served, resp.Body); err != nil {
		return err
	}
	return nil
}

// forward sends the request to the first reachable entry of dest (a comma list). It returns the
// response and the entry used.
func (p *Proxy) forward(ctx context.Context, method, path string, h http.Header, body []byte, dest string) (*http.Response, string, error) {
	if strings.TrimSpace(dest) == "" {
		return nil, "", fmt.Errorf("the picker set no %s header", DestinationHeader)
	}
	var errs []error
	for _, entry := range strings.Split(dest, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		req, err := http.NewRequestWithContext(ctx, method, "http://"+entry+path, bytes.NewReader(body))
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", entry, err))
			continue
		}
		for k, vs := range h {
			if !hopHeaders[strings.ToLower(k)] {
				req.Header[k] = vs
			}
		}
		req.ContentLength = int64(len(body))
		resp, err := p.cfg.Upstream.Do(req)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", entry, err))
			if ctx.Err() != nil {
				break
			}
			continue
		}
		return resp, entry, nil
	}
	return nil, "", errors.Join(errs...)
}

// stream is the client side of one Process stream.
type stream struct {
	p         *Proxy
	ctx       context.Context
	ps        extprocv3.ExternalProcessor_ProcessClient
	cancel    context.CancelFunc
	timer     *time.Timer
	timerMu   sync.Mutex
	immediate *extprocv3.ImmediateResponse // received while reading the re-streamed body
}

// recv receives one message, cancelling the stream when MessageTimeout passes first.
func (s *stream) recv() (*extprocv3.ProcessingResponse, error) {
	s.timerMu.Lock()
	if s.timer == nil {
		s.timer = time.AfterFunc(s.p.cfg.MessageTimeout, s.cancel)
	} else {
		s.timer.Reset(s.p.cfg.MessageTimeout)
	}
	s.timerMu.Unlock()
	m, err := s.ps.Recv()
	s.timerMu.Lock()
	s.timer.Stop()
	s.timerMu.Unlock()
	return m, err
}

func (s *stream) stopTimer() {
	s.timerMu.Lock()
	defer s.timerMu.Unlock()
	if s.timer != nil {
		s.timer.Stop()
	}
}

// send sends one message; when the server already ended the stream (io.EOF) the stream's final
// status is returned instead.
func (s *stream) send(m *extprocv3.ProcessingRequest) error {
	if err := s.ps.Send(m); err != nil {
		if errors.Is(err, io.EOF) {
			return errServerEnded
		}
		return err
	}
	return nil
}

// errServerEnded marks a Send that found the stream already ended by the server; the caller reads
// the reason (often an ImmediateResponse) with recv.
var errServerEnded = errors.New("the ext_proc server ended the stream")

// sendRequest sends request_headers and the body chunks.
func (s *stream) sendRequest(r *http.Request, body []byte) error {
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	hs := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(r.Method)},
		{Key: ":path", RawValue: []byte(r.URL.RequestURI())},
		{Key: ":authority", RawValue: []byte(r.Host)},
		{Key: ":scheme", RawValue: []byte(scheme)},
		{Key: "content-length", RawValue: []byte(strconv.Itoa(len(body)))},
	}
	for k, vs := range r.Header {
		lk := strings.ToLower(k)
		if hopHeaders[lk] {
			continue
		}
		for _, v := range vs {
			hs = append(hs, &corev3.HeaderValue{Key: lk, RawValue: []byte(v)})
		}
	}
	first := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: hs},
		}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		},
	}
	if err := s.send(first); err != nil {
		return err
	}
	size := s.p.cfg.RequestChunkSize
	for {
		n := min(size, len(body))
		chunk := body[:n]
		body = body[n:]
		end := len(body) == 0
		if err := s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: chunk, EndOfStream: end},
		}}); err != nil {
			return err
		}
		if end {
			return nil
		}
	}
}

// restreamedBody reads the request_body streamed_response chunks up to end_of_stream. An
// ImmediateResponse instead ends the read (kept in s.immediate, nil body returned). want is the original body
// length, used as the buffer's initial capacity.
func (s *stream) restreamedBody(want int) ([]byte, error) {
	out := make([]byte, 0, want)
	for {
		m, err := s.recv()
		if err != nil {
			return nil, err
		}
		switch r := m.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_RequestBody:
			sr := r.RequestBody.GetResponse().GetBodyMutation().GetStreamedResponse()
			if sr == nil {
				return nil, errors.New("request_body reply without streamed_response in FULL_DUPLEX_STREAMED mode")
			}
			out = append(out, sr.GetBody()...)
			if sr.GetEndOfStream() {
				return out, nil
			}
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			s.immediate = r.ImmediateResponse
			return nil, nil
		default:
			return nil, fmt.Errorf("unexpected %T while reading the re-streamed body", r)
		}
	}
}

// respond plays the response phase: response_headers, then the body in echoed chunks, writing to
// the client as the echoes arrive; then it ends the stream.
func (s *stream) respond(w *countingWriter, status int, h http.Header, served string, body io.Reader) error {
	hs := []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(strconv.Itoa(status))}}
	for k, vs := range h {
		lk := strings.ToLower(k)
		if hopHeaders[lk] {
			continue
		}
		for _, v := range vs {
			hs = append(hs, &corev3.HeaderValue{Key: lk, RawValue: []byte(v)})
		}
	}
	msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hs}},
	}}
	if served != "" {
		msg.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			LBNamespace: {Fields: map[string]*structpb.Value{ServedEndpointKey: structpb.NewStringValue(served)}},
		}}
	}
	if err := s.send(msg); err != nil {
		return s.fail(w, fmt.Errorf("send response headers: %w", err))
	}
	m, err := s.recv()
	if err != nil {
		return s.fail(w, fmt.Errorf("response headers reply: %w", err))
	}
	if ir := m.GetImmediateResponse(); ir != nil {
		writeImmediate(w, ir)
		return s.finish()
	}
	rh := m.GetResponseHeaders()
	if rh == nil {
		return s.fail(w, fmt.Errorf("response headers reply: expected response_headers, got %T", m.GetResponse()))
	}
	out := w.Header()
	for k, vs := range h {
		if !hopHeaders[strings.ToLower(k)] {
			out[k] = vs
		}
	}
	var ignored string
	applyMutation(out, &ignored, rh.GetResponse().GetHeaderMutation())
	w.WriteHeader(status)
	w.Flush()

	buf := make([]byte, s.p.cfg.ResponseChunkSize)
	for chunks, done := 0, false; !done; chunks++ {
		if d := s.p.cfg.ResponseCoalesce; d > 0 && chunks > 0 {
			t := time.NewTimer(d)
			select {
			case <-t.C:
			case <-s.ctx.Done():
				t.Stop()
			}
		}
		n, rerr := body.Read(buf)
		if rerr != nil && !errors.Is(rerr, io.EOF) {
			// The upstream broke mid-body: Envoy resets the downstream stream and the ext_proc
			// stream. Cancelling the stream lets the picker free the booking.
			s.cancel()
			return fmt.Errorf("upstream body: %w", rerr)
		}
		done = rerr != nil
		if n == 0 && !done {
			continue
		}
		chunk := buf[:n]
		if err := s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: chunk, EndOfStream: done},
		}}); err != nil {
			s.cancel()
			return fmt.Errorf("send response body: %w", err)
		}
		m, err := s.recv()
		if err != nil {
			s.cancel()
			return fmt.Errorf("response body reply: %w", err)
		}
		rb := m.GetResponseBody()
		if rb == nil {
			s.cancel()
			return fmt.Errorf("response body reply: expected response_body, got %T", m.GetResponse())
		}
		echo := chunk
		if sr := rb.GetResponse().GetBodyMutation().GetStreamedResponse(); sr != nil {
			echo = sr.GetBody()
		}
		if len(echo) > 0 {
			if _, err := w.Write(echo); err != nil {
				s.cancel()
				return fmt.Errorf("client went away: %w", err)
			}
			w.Flush()
		}
	}
	return s.finish()
}

// finish half-closes the stream and waits for the server to end it.
func (s *stream) finish() error {
	if err := s.ps.CloseSend(); err != nil {
		return fmt.Errorf("close ext_proc stream: %w", err)
	}
	for {
		if _, err := s.recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("ext_proc stream ended with: %w", err)
		}
	}
}

// fail handles an ext_proc failure before the response started: when the server ended the stream
// with an ImmediateResponse that is returned to the client, otherwise the client gets 500 (Envoy's
// failure_mode_allow=false behaviour) and the stream is cancelled.
func (s *stream) fail(w *countingWriter, err error) error {
	if errors.Is(err, errServerEnded) {
		for {
			m, rerr := s.recv()
			if rerr != nil {
				if !errors.Is(rerr, io.EOF) {
					err = fmt.Errorf("%w: %w", err, rerr)
				}
				break
			}
			if ir := m.GetImmediateResponse(); ir != nil {
				writeImmediate(w, ir)
				s.cancel()
				return nil
			}
		}
	}
	s.cancel()
	if !w.wrote {
		localReply(w, http.StatusInternalServerError, "ext_proc: "+err.Error())
	}
	return err
}

// applyMutation applies a HeaderMutation to h; a ":path" entry rewrites *path.
func applyMutation(h http.Header, path *string, mut *extprocv3.HeaderMutation) {
	if mut == nil {
		return
	}
	for _, k := range mut.GetRemoveHeaders() {
		h.Del(k)
	}
	for _, o := range mut.GetSetHeaders() {
		key := o.GetHeader().GetKey()
		v := o.GetHeader().GetValue()
		if raw := o.GetHeader().GetRawValue(); len(raw) > 0 {
			v = string(raw)
		}
		if key == ":path" {
			*path = v
			continue
		}
		if strings.HasPrefix(key, ":") {
			continue
		}
		switch o.GetAppendAction() {
		case corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD:
			h.Add(key, v)
		case corev3.HeaderValueOption_ADD_IF_ABSENT:
			if h.Get(key) == "" {
				h.Set(key, v)
			}
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS:
			if h.Get(key) != "" {
				h.Set(key, v)
			}
		default:
			h.Set(key, v)
		}
	}
}

// writeImmediate writes an ImmediateResponse to the client.
func writeImmediate(w *countingWriter, ir *extprocv3.ImmediateResponse) {
	var ignored string
	applyMutation(w.Header(), &ignored, ir.GetHeaders())
	code := int(ir.GetStatus().GetCode())
	if code < 100 || code > 999 {
		code = http.StatusOK // Envoy's default when the status is unset
	}
	w.WriteHeader(code)
	_, _ = w.Write(ir.GetBody())
}

// localReply writes a proxy-generated error.
func localReply(w *countingWriter, status int, msg string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, msg+"\n")
}

// countingWriter records what was written to the client.
type countingWriter struct {
	w         http.ResponseWriter
	start     time.Time
	status    int
	wrote     bool
	n         int64
	firstByte time.Duration
}

// Header returns the client response's header map.
func (c *countingWriter) Header() http.Header { return c.w.Header() }

// WriteHeader writes the status once.
func (c *countingWriter) WriteHeader(status int) {
	if c.wrote {
		return
	}
	c.wrote, c.status = true, status
	c.w.WriteHeader(status)
}

// Write writes body bytes, recording the first byte's time.
func (c *countingWriter) Write(b []byte) (int, error) {
	if !c.wrote {
		c.WriteHeader(http.StatusOK)
	}
	if len(b) > 0 && c.n == 0 {
		c.firstByte = time.Since(c.start)
	}
	n, err := c.w.Write(b)
	c.n += int64(n)
	return n, err
}

// Flush flushes the client response.
func (c *countingWriter) Flush() {
	if f, ok := c.w.(http.Flusher); ok {
		f.Flush()
	}
}
