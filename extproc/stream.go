package extproc

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/picker"
)

// phase is the per-stream state of epp.md §4.4.
type phase uint8

const (
	phaseStart         phase = iota // nothing received
	phaseHeaders                    // HeadersReceived
	phaseAccumulating               // body chunks arriving
	phaseForwarded                  // routing reply sent
	phaseResponding                 // response headers seen
	phaseRejected                   // ImmediateResponse sent (terminal; later messages ignored)
	phaseProtocolError              // gRPC error returned
)

// removedHeaders are stripped from every forwarded request (epp.md §5.10).
var removedHeaders = []string{
	"x-gateway-destination-endpoint-subset",
	"x-gateway-destination-endpoint-served",
	"x-gateway-inference-fairness-id",
	"x-gateway-inference-objective",
	"x-gateway-model-name-rewrite",
	"x-prefiller-host-port",
	"x-worker-instance-id",
	"x-dynamo-prefill-instance-id",
	"x-dynamo-prefill-dp-rank",
}

// requestHeaders are the request headers captured for routing (epp.md §5.1). Repeated keys are
// joined with ",".
type requestHeaders struct {
	method, path, contentType, contentEncoding  string
	tenant, priority, strictPriority, requestID string
	sessionID, parentSessionID, policyClass     string
	// modelName is x-gateway-model-name, which the Gateway API Inference Extension's body-based
	// routing sets from the body's model.
	modelName string
	// contentLength, connection and upgrade detect complete and upgraded bodies (epp.md §4.1).
	contentLength, connection, upgrade string
	// decision is DecisionHeader: non-empty asks for the decision metadata.
	decision string
	// testSelection is the conformance suite's test-epp-endpoint-selection header.
	testSelection string
}

// declaredLength is the content-length header as bytes, or -1 when absent or not a number.
func (h *requestHeaders) declaredLength() int64 {
	n, err := strconv.ParseInt(strings.TrimSpace(h.contentLength), 10, 64)
	if err != nil || n < 0 {
		return -1
	}
	return n
}

// upgrading reports a request that asks for a protocol upgrade (connection: upgrade, or an
// upgrade header) or a tunnel (CONNECT): Envoy then streams its body without ever ending it
// (envoyproxy/envoy#47081).
func (h *requestHeaders) upgrading() bool {
	if strings.TrimSpace(h.upgrade) != "" || strings.EqualFold(h.method, "CONNECT") {
		return true
	}
	for _, tok := range strings.Split(h.connection, ",") {
		if strings.EqualFold(strings.TrimSpace(tok), "upgrade") {
			return true
		}
	}
	return false
}

func (h *requestHeaders) capture(m *corev3.HeaderMap) {
	for _, hv := range m.GetHeaders() {
		var dst *string
		switch hv.GetKey() {
		case ":method":
			dst = &h.method
		case ":path":
			dst = &h.path
		case "content-type":
			dst = &h.contentType
		case "content-encoding":
			dst = &h.contentEncoding
		case "x-tenant-id":
			dst = &h.tenant
		case "x-dynamo-request-priority":
			dst = &h.priority
		case "x-dynamo-strict-priority":
			dst = &h.strictPriority
		case "x-dynamo-session-id":
			dst = &h.sessionID
		case "x-dynamo-parent-session-id":
			dst = &h.parentSessionID
		case "x-dynamo-meta-policy-class":
			dst = &h.policyClass
		case "x-request-id":
			dst = &h.requestID
		case "x-gateway-model-name":
			dst = &h.modelName
		case "content-length":
			dst = &h.contentLength
		case "connection":
			dst = &h.connection
		case "upgrade":
			dst = &h.upgrade
		case DecisionHeader:
			dst = &h.decision
		case TestEndpointSelectionHeader:
			dst = &h.testSelection
		default:
			continue
		}
		v := hv.GetValue()
		if raw := hv.GetRawValue(); len(raw) > 0 {
			v = string(raw)
		}
		if *dst == "" {
			*dst = v
		} else {
			*dst += "," + v
		}
	}
}

// booking is the reservation owned by a stream, with the exactly-once free guard of epp.md §7.
type booking struct {
	id    string
	state atomic.Int32 // 0 none, 1 live, 2 prefill-complete sent, 3 freed
}

const (
	bookingNone int32 = iota
	bookingLive
	bookingPrefilled
	bookingFreed
)

// stream is one Process call.
type stream struct {
	s   *Server
	ps  extprocv3.ExternalProcessor_ProcessServer
	ctx context.Context

	// mu serializes message handling with the body timer (bodyTimer), the only other goroutine
	// that touches the stream.
	mu sync.Mutex
	// bodyTimer answers 408 when the body has not ended within RequestBodyTimeout.
	bodyTimer *time.Timer
	// eosByLength marks a body routed when it reached its declared content-length (its re-stream
	// then leaves end_of_stream to the request's own end); passthrough marks an upgraded request on
	// a non-inference path, routed at its headers. The request messages that follow either are
	// echoed.
	eosByLength, passthrough bool

	first             bool
	reqMode, respMode filterv3.ProcessingMode_BodySendMode
	phase             phase

	hdr         requestHeaders
	generatedID string // x-request-id we generated ("" when the client sent one)

	body     []byte  // request body so far (aliases buf or a received chunk)
	buf      *[]byte // pooled buffer backing body, when chunks were concatenated
	eos      bool    // request end of stream seen (body EoS, trailers, header EoS, NONE mode)
	trailers bool    // the request ended with trailers
	md       map[string]*structpb.Struct
	eosAt    time.Time
	// hashMemo is the tokenizer's block-hash memo of the prompt (TokenizedPrompt.HashMemo).
	hashMemo picker.BlockHashMemo

	reqStream bool // the request body had "stream": true
	loadOnly  bool
	dest      string // header value sent
	primary   string // first entry of dest
	bk        booking

	respStatus      int
	respContentType string
	usage           *UsageParser
	completed       bool
	servedChecked   bool

	// booked is the selection of the live booking (epp.md §6.3 moves it to the served rank).
	booked picker.Selection
	// model is the partition model of the request once resolved (GIE metric labels); routed
	// marks a request counted in inference_objective_request_total / running_requests.
	model  string
	routed bool
	// startedAt is when the stream opened; respBytes the response body bytes seen; usageSeen the
	// usage parsed at completion (GIE request metrics).
	startedAt time.Time
	respBytes int
	usageSeen Usage
	// lbSeen, servedKey and servedValue are the response-headers message's envoy.lb metadata
	// (conformance hooks).
	lbSeen, servedKey bool
	servedValue       string

	// outputs counts a streamed response's generated tokens for the picker's output blocks
	// (outputtokens.go); nil unless the picker tracks them.
	outputs *outputCounter

	// streamed and respHeaders are the stream's streamed body chunk and response_headers replies,
	// rebuilt for every Send (replies.go says why that is safe).
	streamed    streamedReply
	respHeaders responseHeadersReply
}

func newStream(s *Server, ps extprocv3.ExternalProcessor_ProcessServer) *stream {
	return &stream{
		s: s, ps: ps, ctx: ps.Context(), first: true, startedAt: time.Now(),
		reqMode:  filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		respMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
	}
}

// handle dispatches one ProcessingRequest. A non-nil error ends the stream (gRPC error).
func (st *stream) handle(req *extprocv3.ProcessingRequest) error {
	if req.GetObservabilityMode() {
		st.phase = phaseProtocolError
		return status.Error(codes.FailedPrecondition, "observability_mode is not supported: the endpoint picker must answer every message")
	}
	if st.first {
		st.first = false
		if pc := req.GetProtocolConfig(); pc != nil {
			st.reqMode, st.respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
		}
		switch st.reqMode {
		case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_NONE:
		default:
			st.phase = phaseProtocolError
			return status.Errorf(codes.FailedPrecondition,
				"request body mode %s is not supported: use FULL_DUPLEX_STREAMED (or BUFFERED / NONE)", st.reqMode)
		}
	}
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		st.noteRequestMetadata(req)
		return st.onRequestHeaders(r.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		st.noteRequestMetadata(req)
		return st.onRequestBody(r.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		st.noteRequestMetadata(req)
		return st.onRequestTrailers()
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		if st.s.cfg.ConformanceTestHooks {
			st.noteConformanceMetadata(req)
		}
		st.noteResponseMetadata(req)
		return st.onResponseHeaders(r.ResponseHeaders)
	case *extprocv3.ProcessingRequest_ResponseBody:
		st.noteResponseMetadata(req)
		return st.onResponseBody(r.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		st.noteResponseMetadata(req)
		return st.onResponseTrailers()
	}
	// No request message set (or one this build does not know): Envoy waits for a reply to every
	// message it sends, and there is nothing to reply to, so end the stream with an error rather
	// than leave it (and Envoy) waiting for good.
	st.phase = phaseProtocolError
	return status.Error(codes.InvalidArgument, "ProcessingRequest carries none of request_headers, request_body, request_trailers, response_headers, response_body, response_trailers")
}

// noteRequestMetadata keeps the last request-phase filter metadata seen before routing (epp.md §5.1).
func (st *stream) noteRequestMetadata(req *extprocv3.ProcessingRequest) {
	if st.eos {
		return
	}
	if fm := req.GetMetadataContext().GetFilterMetadata(); fm != nil {
		st.md = fm
	}
}

// noteResponseMetadata compares the served endpoint with the primary once (epp.md §6.3). A
// difference is counted in served_endpoint_mismatch_total and the booking moves to the served rank
// (moveBooking); a served endpoint that is not a known rank leaves it on the primary, logged.
func (st *stream) noteResponseMetadata(req *extprocv3.ProcessingRequest) {
	if st.servedChecked || st.primary == "" {
		return
	}
	ns := req.GetMetadataContext().GetFilterMetadata()[LBMetadataNamespace]
	v, ok := ns.GetFields()[ServedEndpointKey]
	if !ok {
		return
	}
	st.servedChecked = true
	served := strings.TrimSpace(v.GetStringValue())
	if first, _, _ := strings.Cut(served, ","); served != "" && hintHost(first) != "" {
		if normalizeEndpoint(first) != normalizeEndpoint(st.primary) {
			st.s.metrics.servedEndpointMismatch.Add(1)
			if st.moveBooking(first) {
				st.s.log.Debug().Str("request_id", excerpt.Of(st.requestID())).Str("primary", st.primary).Str("served", excerpt.Of(served)).
					Msg("served endpoint differs from the primary; booking moved to the served endpoint")
			} else if st.bk.state.Load() != bookingNone {
				st.s.log.Warn().Str("request_id", excerpt.Of(st.requestID())).Str("primary", st.primary).Str("served", excerpt.Of(served)).
					Msg("served endpoint differs from the primary and is not a known worker rank; booking kept on the primary")
			}
		}
	}
}

func normalizeEndpoint(hp string) string {
	hp = strings.TrimSpace(hp)
	host, port, err := splitHostPort(hp)
	if err != nil {
		return normalizeHost(hp)
	}
	return normalizeHost(host) + ":" + port
}

func (st *stream) requestID() string {
	if st.generatedID != "" {
		return st.generatedID
	}
	return st.hdr.requestID
}

// ---- request path ----

func (st *stream) onRequestHeaders(h *extprocv3.HttpHeaders) error {
	if st.phase != phaseStart {
		st.phase = phaseProtocolError
		return status.Error(codes.FailedPrecondition, "request_headers received twice on one stream")
	}
	st.phase = phaseHeaders
	st.hdr.capture(h.GetHeaders())
	if strings.TrimSpace(st.hdr.requestID) == "" {
		st.generatedID = uuid.NewString()
	}
	if st.hdr.upgrading() {
		st.endBody()
		if classify(st.hdr.method, st.hdr.path) != kindOther {
			return st.reject(errUpgrade)
		}
		// Another path (a WebSocket, say): route at the headers and echo the upgraded stream.
		st.passthrough = true
		return st.routeAndReply(true)
	}
	if h.GetEndOfStream() || st.reqMode == filterv3.ProcessingMode_NONE {
		// Header-only request (epp.md §4.3) or body mode NONE: load-only pick, immediate reply.
		st.endBody()
		return st.routeAndReply(true)
	}
	if n := st.hdr.declaredLength(); n > st.s.cfg.MaxRequestBodyBytes {
		// The body cannot fit: answer now rather than after buffering up to the limit.
		st.endBody()
		return st.reject(picker.Errorf(KindRequestTooLarge,
			"request body exceeds %d bytes: its content-length is %d", st.s.cfg.MaxRequestBodyBytes, n))
	}
	if st.hdr.declaredLength() == 0 && st.reqMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		// An empty body is complete at the headers: decided now as if it had arrived (a 400 on
		// an inference path, a load-only pick elsewhere); its end of stream, if it ever comes,
		// is passed through (eosByLength).
		st.endBody()
		st.eosByLength = true
		return st.routeAndReply(classify(st.hdr.method, st.hdr.path) == kindOther)
	}
	if d := st.s.cfg.RequestBodyTimeout; d > 0 {
		st.bodyTimer = time.AfterFunc(d, st.bodyTimedOut)
	}
	if st.reqMode == filterv3.ProcessingMode_BUFFERED {
		return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}},
		}})
	}
	return nil // FULL_DUPLEX_STREAMED: the header reply is deferred until the body is complete
}

func (st *stream) onRequestBody(b *extprocv3.HttpBody) error {
	switch {
	case st.phase == phaseRejected:
		return nil // after a 413 (or any rejection) the rest of the request is ignored
	case st.passthrough || st.eosByLength:
		// An upgraded stream, or what follows a body routed at its content-length (its end of
		// stream, if it ever comes): passed through as it arrives.
		return st.echoRequestBody(b)
	case st.eos:
		st.s.metrics.duplicateEOS.Add(1)
		st.s.log.Debug().Str("request_id", excerpt.Of(st.requestID())).Int("bytes", len(b.GetBody())).
			Msg("request_body after end of stream ignored")
		return nil
	case st.phase == phaseStart:
		st.phase = phaseProtocolError
		return status.Error(codes.FailedPrecondition, "request_body received before request_headers")
	}
	st.phase = phaseAccumulating
	chunk := b.GetBody()
	if int64(len(st.body))+int64(len(chunk)) > st.s.cfg.MaxRequestBodyBytes {
		return st.reject(picker.Errorf(KindRequestTooLarge,
			"request body exceeds %d bytes", st.s.cfg.MaxRequestBodyBytes))
	}
	last := b.GetEndOfStream() || st.reqMode == filterv3.ProcessingMode_BUFFERED
	st.appendBody(chunk, last)
	if !last && st.reqMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		// A body that reached its declared length is complete, even if its end of stream never
		// comes (an upgraded connection, envoyproxy/envoy#47081).
		if n := st.hdr.declaredLength(); n >= 0 && int64(len(st.body)) >= n {
			last, st.eosByLength = true, true
		}
	}
	if !last {
		return nil
	}
	st.endBody()
	return st.routeAndReply(false)
}

// endBody records the end of the request body (end of stream, trailers, declared length, or no
// body at all) and stops the body timer.
func (st *stream) endBody() {
	st.eos, st.eosAt = true, time.Now()
	if st.bodyTimer != nil {
		st.bodyTimer.Stop()
	}
}

// errUpgrade is the 400 for an upgrade request on an inference path.
var errUpgrade = picker.Errorf(picker.KindBadRequest,
	"upgrade requests (connection: upgrade) are not supported on inference paths: the body of an upgraded request never ends, so its prompt cannot be read; send the request without the upgrade headers")

// bodyTimedOut runs on the body timer's goroutine: a request whose body has not ended within
// RequestBodyTimeout (DYN_EPP_REQUEST_BODY_TIMEOUT_SECS) is answered 408.
func (st *stream) bodyTimedOut() {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.eos || (st.phase != phaseHeaders && st.phase != phaseAccumulating) {
		return
	}
	st.eos = true
	_ = st.reject(picker.Errorf(KindRequestTimeout,
		"the request body did not end within %s (DYN_EPP_REQUEST_BODY_TIMEOUT_SECS): %d bytes arrived without end of stream",
		st.s.cfg.RequestBodyTimeout, len(st.body)))
}

// echoRequestBody passes a request body message through unchanged (the request was already
// routed: an upgraded stream, or the rest of a body routed at its content-length).
func (st *stream) echoRequestBody(b *extprocv3.HttpBody) error {
	if st.reqMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		return st.send(st.streamedBody(b.GetBody(), b.GetEndOfStream()))
	}
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}},
	}})
}

// preallocBodyBytes bounds the body buffer allocated from a declared content-length, bytes.
const preallocBodyBytes = 1 << 20

// appendBody adds chunk to the request body. A body that arrives as one final chunk is used in place;
// otherwise chunks are concatenated in a pooled buffer.
func (st *stream) appendBody(chunk []byte, last bool) {
	if len(chunk) == 0 {
		return
	}
	if st.buf == nil {
		if st.body == nil && last {
			st.body = chunk
			return
		}
		st.buf = st.s.getBuf()
		// The declared length sizes the buffer once, instead of growing it by doubling (and
		// copying) as a prompt-sized body arrives chunk by chunk; up to preallocBodyBytes, so a
		// declared length alone cannot make the server allocate much.
		if n := min(st.hdr.declaredLength(), preallocBodyBytes, st.s.cfg.MaxRequestBodyBytes); n > int64(cap(*st.buf)) {
			*st.buf = slices.Grow(*st.buf, int(n))
		}
		*st.buf = append(*st.buf, st.body...)
	}
	*st.buf = append(*st.buf, chunk...)
	st.body = *st.buf
}

func (st *stream) onRequestTrailers() error {
	if st.phase == phaseRejected {
		return nil
	}
	if !st.eos && st.reqMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED &&
		(st.phase == phaseHeaders || st.phase == phaseAccumulating) {
		st.trailers = true
		st.endBody()
		return st.routeAndReply(false)
	}
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{},
	}})
}

// decision is the outcome of routing a request.
type decision struct {
	sel       picker.Selection
	booked    bool
	body      []byte // forwarded body
	rewritten bool
	// decoded marks a rewritten body that was decoded from a content coding: it is forwarded
	// plain, so content-encoding is removed.
	decoded bool
}

// routeAndReply routes the complete request and sends the routing reply, or an ImmediateResponse.
// headerOnly is true when no body follows (the reply is the HeadersResponse alone).
func (st *stream) routeAndReply(headerOnly bool) error {
	d, err := st.route(headerOnly)
	if err != nil {
		if st.ctx.Err() != nil {
			return status.FromContextError(st.ctx.Err()).Err() // stream gone: nothing to answer
		}
		return st.reject(err)
	}
	dest, err := st.s.destinationValue(&d.sel)
	if err != nil {
		return st.reject(&picker.Error{Kind: picker.KindInternal, Message: err.Error(), Err: err})
	}
	st.dest = dest
	st.primary, _, _ = strings.Cut(dest, ",")
	st.loadOnly = !d.booked
	if d.booked {
		st.booked = d.sel
	}
	if st.model == "" {
		st.model = d.sel.ModelName
	}
	st.routed = true
	st.s.metrics.gie.routed(st.model, len(st.body))
	if err := st.sendRouting(d, headerOnly); err != nil {
		return err
	}
	st.phase = phaseForwarded
	st.releaseBody()
	return nil
}

// route implements epp.md §5: concurrency cap, readiness, classification, validation, partition,
// subset hint, tokenization and the pick. On success with booked == true the stream owns the booking.
func (st *stream) route(headerOnly bool) (decision, error) {
	m := st.s.metrics
	if n := st.s.inflight.Add(1); n > int64(st.s.cfg.MaxInflight) {
		st.s.inflight.Add(-1)
		return decision{}, picker.Errorf(picker.KindOverloaded,
			"too many requests in the routing phase (limit %d)", st.s.cfg.MaxInflight)
	}
	m.inflightPicks.Add(1)
	defer func() { st.s.inflight.Add(-1); m.inflightPicks.Add(-1) }()

	if st.s.cfg.Ready != nil && !st.s.cfg.Ready() {
		return decision{}, picker.Errorf(picker.KindNotReady, "the endpoint picker is not ready")
	}
	kind := classify(st.hdr.method, st.hdr.path)
	plain, readable := []byte(nil), false
	if !headerOnly {
		var err error
		if plain, readable, err = st.readableBody(); err != nil {
			return decision{}, err
		}
	}
	if headerOnly || kind == kindOther || !readable {
		model, err := st.loadOnlyModel(plain, readable)
		if err != nil {
			return decision{}, err
		}
		return st.loadOnlyPick(model)
	}
	pb, err := parseBody(plain)
	if err != nil {
		return decision{}, err
	}
	if m, _, err := st.resolveModel(st.requestModel(pb), true); err == nil {
		st.model = m // a served model: the GIE metric label, even for a 400
	}
	st.reqStream = pb.stream
	src, err := pb.validatePrompt(kind)
	if err != nil {
		return decision{}, err
	}
	if kind == kindResponses && pb.previousResponseID {
		model, _, err := st.resolveModel(st.requestModel(pb), true)
		if err != nil {
			return decision{}, err
		}
		return st.loadOnlyPick(model)
	}
	partition, lora, err := st.resolveModel(st.requestModel(pb), false)
	if err != nil {
		return decision{}, err
	}
	st.model = partition

	sess, err := st.session()
	if err != nil {
		return decision{}, err
	}
	hints := parseNvext(pb.nvext)
	d := decision{body: st.body}
	namespace := pb.cacheSalt
	if tenant := strings.TrimSpace(st.hdr.tenant); tenant != "" {
		namespace = tenant
		if kind != kindResponses && !(len(pb.saltValues) == 1 && pb.cacheSalt == tenant) {
			nb, err := pb.withCacheSalt(plain, tenant)
			if err != nil {
				return decision{}, &picker.Error{Kind: picker.KindInternal, Message: err.Error(), Err: err}
			}
			d.body, d.rewritten, d.decoded = nb, true, contentCoding(st.hdr.contentEncoding) != codingIdentity
			plain = nb
		}
	}
	allowed, allowedSet, err := st.allowed(partition)
	if err != nil {
		return decision{}, err
	}
	tokens, mmItems, err := st.tokenize(kind, partition, plain, pb.members, src)
	if err != nil {
		return decision{}, err
	}
	req := picker.SelectRequest{
		ModelName:    partition,
		RoutingGroup: st.s.group,
		SelectionID:  uuid.NewString(),
		Prompt: picker.Prompt{
			TokenIDs:  tokens,
			MMItems:   mmItems,
			LoraName:  lora,
			CacheSalt: namespace,
			HashMemo:  st.hashMemo,
		},
		ExpectedOutputTokens: hints.osl,
		PriorityJump:         st.priority(hints),
		StrictPriority:       st.strictPriority(hints),
		Session:              sess,
		AllowedWorkerIDs:     allowed,
		AllowedSet:           allowedSet,
		PolicyClass:          st.hdr.policyClass,
		DoNotQueue:           hints.doNotQueue,
		Fallbacks:            st.s.cfg.MaxDestinations - 1,
		// A response that is not streamed arrives whole, long after the prefill: the picker
		// releases its prefill part on an estimate instead (epp.md §7, kvepp extension).
		PrefillUnobserved: !pb.stream,
	}
	start := time.Now()
	sel, err := st.s.cfg.Picker.SelectAndReserve(st.ctx, req)
	m.gie.scheduled(time.Since(start), err)
	if err != nil {
		return decision{}, err
	}
	st.own(req.SelectionID)
	if st.ctx.Err() != nil { // the stream closed while the pick was in flight (epp.md §7)
		st.free()
		return decision{}, st.ctx.Err()
	}
	m.overlapTokens.Observe(float64(sel.Overlap.LongestMatched))
	d.sel, d.booked = sel, true
	return d, nil
}

// readableBody returns the request body as routing reads it: the body itself when it has no
// content coding, the decoded body for gzip and deflate (decodeBody: more than
// MaxRequestBodyBytes decoded is a 413), and readable false for any other coding or bytes that do
// not decode (the request then gets a load-only pick, epp.md §5.7).
func (st *stream) readableBody() (body []byte, readable bool, err error) {
	switch coding := contentCoding(st.hdr.contentEncoding); coding {
	case codingIdentity:
		return st.body, true, nil
	case codingUnsupported:
		return nil, false, nil
	default:
		plain, err := decodeBody(coding, st.body, st.s.cfg.MaxRequestBodyBytes)
		if errors.Is(err, errUndecodable) {
			if classify(st.hdr.method, st.hdr.path) != kindOther {
				// The model server cannot read it either: the client's mistake, said now.
				return nil, false, &picker.Error{Kind: picker.KindBadRequest,
					Message: fmt.Sprintf("the request body does not decode as its content-encoding %s: %s", coding,
						strings.TrimPrefix(err.Error(), errUndecodable.Error()+": ")), Err: err}
			}
			st.s.log.Debug().Err(err).Str("request_id", excerpt.Of(st.requestID())).Msg("request body does not decode; load-only pick")
			return nil, false, nil
		}
		return plain, err == nil, err
	}
}

// namedModel is the model a request names and where it was read.
type namedModel struct {
	name string
	// field is where it came from ("model" for the body, the header name otherwise), for errors.
	field string
	// fromBody marks the body's model, which alone can name a LoRA adapter (epp.md §5.5).
	fromBody bool
}

// requestModel is the model a parsed request names: the body's model, else the
// x-gateway-model-name header.
func (st *stream) requestModel(pb *parsedBody) namedModel {
	if pb.hasModel {
		return namedModel{name: pb.model, field: "model", fromBody: true}
	}
	return st.headerModel()
}

// headerModel is the x-gateway-model-name header's model (name "" when absent).
func (st *stream) headerModel() namedModel {
	return namedModel{name: strings.TrimSpace(st.hdr.modelName), field: "x-gateway-model-name"}
}

// loadOnlyModel is the model of a load-only pick: the x-gateway-model-name header when present
// (the Gateway API Inference Extension's body-based routing sets it), else the model of a
// readable JSON body, resolved by resolveModel.
func (st *stream) loadOnlyModel(body []byte, readable bool) (string, error) {
	m := st.headerModel()
	if m.name == "" && readable && len(body) > 0 {
		if pb, err := parseBody(body); err == nil && pb.hasModel {
			m = namedModel{name: pb.model, field: "model", fromBody: true}
		}
	}
	model, _, err := st.resolveModel(m, true)
	return model, err
}

// resolveModel resolves the model m the request names (resolveModel of model.go, shared with
// ResolveBodyModel).
func (st *stream) resolveModel(m namedModel, loadOnly bool) (partition, lora string, err error) {
	return resolveModel(st.s.cfg.Picker, st.s.cfg.ModelName, m, loadOnly)
}

// loadOnlyPick is epp.md §5.7: no booking. The candidates are the workers of the partition the
// request would have — (model, the server's routing group), model "" meaning every model of that
// group (loadOnlyModel) — intersected with the subset hint; the picker's LoadOnlyPick knows only
// the model, so the partition is passed as the allowed worker ids. An empty partition → 503.
func (st *stream) loadOnlyPick(model string) (decision, error) {
	allowed, allowedSet, err := st.allowed(model)
	if err != nil {
		return decision{}, err
	}
	if !allowedSet { // a subset hint is already resolved against the partition's workers
		ws := st.s.cfg.Picker.Workers(model, st.s.group)
		allowed = make([]uint64, len(ws))
		for i, w := range ws {
			allowed[i] = w.WorkerID
		}
		allowedSet = true
	}
	st.model = model
	start := time.Now()
	sel, err := st.s.cfg.Picker.LoadOnlyPick(st.ctx, model, allowed, allowedSet)
	st.s.metrics.gie.scheduled(time.Since(start), err)
	if err != nil {
		return decision{}, err
	}
	return decision{sel: sel, body: st.body}, nil
}

// allowed resolves the subset hint (epp.md §5.8) against the workers of model ("" = every served
// model) into allowed worker ids, narrowed further by the conformance suite's
// test-epp-endpoint-selection header when the hooks are on. No restriction → allowedSet false.
// A hint that matches no worker → 503.
func (st *stream) allowed(model string) ([]uint64, bool, error) {
	ids, set, err := st.subsetAllowed(model)
	if err != nil || !st.s.cfg.ConformanceTestHooks || strings.TrimSpace(st.hdr.testSelection) == "" {
		return ids, set, err
	}
	return st.testSelectionAllowed(model, ids, set)
}

// subsetAllowed is allowed for the subset hint alone.
func (st *stream) subsetAllowed(model string) ([]uint64, bool, error) {
	hosts, present := subsetHint(st.md)
	if !present {
		return nil, false, nil
	}
	var ids []uint64
	if len(hosts) > 0 {
		ids = allowedWorkers(hosts, st.s.cfg.Picker.Workers(model, st.s.group))
	}
	if len(ids) == 0 {
		return nil, true, picker.Errorf(picker.KindNotReady, "the subset hint leaves no candidate worker")
	}
	return ids, true, nil
}

// session builds session_context from the session headers (epp.md §5.5); ids over 256 bytes → 400.
func (st *stream) session() (*picker.SessionContext, error) {
	id := strings.TrimSpace(st.hdr.sessionID)
	if id == "" {
		return nil, nil
	}
	parent := strings.TrimSpace(st.hdr.parentSessionID)
	for _, h := range [...]struct{ name, v string }{{"x-dynamo-session-id", id}, {"x-dynamo-parent-session-id", parent}} {
		if len(h.v) > MaxSessionIDBytes {
			return nil, picker.Errorf(picker.KindBadRequest, "%s is %d bytes long; the limit is %d bytes", h.name, len(h.v), MaxSessionIDBytes)
		}
	}
	return &picker.SessionContext{SessionID: id, ParentSessionID: parent}, nil
}

// priority is priority_jump: header x-dynamo-request-priority, else agent_hints.priority, else
// agent_hints.latency_sensitivity; clamped to ≥ 0; unparseable or non-finite sources are skipped.
func (st *stream) priority(h agentHints) float64 {
	if v := strings.TrimSpace(st.hdr.priority); v != "" {
		if f, err := strconv.ParseFloat(v, 64); err == nil && !math.IsNaN(f) && !math.IsInf(f, 0) {
			return math.Max(f, 0)
		}
	}
	for _, f := range []*float64{h.priority, h.latencySensitivity} {
		if f != nil {
			return math.Max(*f, 0)
		}
	}
	return 0
}

// strictPriority is header x-dynamo-strict-priority (u32), else agent_hints.strict_priority.
func (st *stream) strictPriority(h agentHints) uint32 {
	if v := strings.TrimSpace(st.hdr.strictPriority); v != "" {
		if u, err := strconv.ParseUint(v, 10, 32); err == nil {
			return uint32(u)
		}
	}
	if h.strictPriority != nil {
		return *h.strictPriority
	}
	return 0
}

// tokenize returns the prompt's token ids and multimodal items (epp.md §5.4), and keeps the
// tokenizer's hash memo in st.hashMemo. Token prompts are used directly. members are body's
// top-level members as parseBody found them, for a PromptTokenizer that reads them instead of
// parsing the body again.
func (st *stream) tokenize(kind requestKind, model string, body []byte, members []BodyMember, src promptSource) (tokens []uint32, mm []picker.MMItem, err error) {
	if src.tokens != nil {
		if len(src.tokens) == 0 {
			return nil, nil, errEmptyTokens
		}
		return src.tokens, nil, nil
	}
	t, err := st.s.cfg.Tokenizers.ForModel(model)
	if err != nil {
		var pe *picker.Error
		if errors.As(err, &pe) {
			return nil, nil, err // it says what is missing itself
		}
		return nil, nil, &picker.Error{Kind: picker.KindInternal, Message: fmt.Sprintf("no tokenizer for model %q: %v", model, err), Err: err}
	}
	start := time.Now()
	defer func() {
		if r := recover(); r != nil {
			tokens, mm, err = nil, nil, picker.Errorf(picker.KindInternal, "tokenizer panicked: %v", r)
		}
		st.s.metrics.tokenizeDuration.Observe(time.Since(start).Seconds())
	}()
	if pt, ok := t.(PromptTokenizer); ok {
		pk := PromptResponses
		switch kind {
		case kindChat:
			pk = PromptChat
		case kindCompletion:
			pk = PromptCompletion
		}
		var p TokenizedPrompt
		p, err = pt.TokenizePrompt(st.ctx, TokenizeCall{Kind: pk, Body: body, RequestID: st.requestID(), Members: members})
		tokens, mm, st.hashMemo = p.TokenIDs, p.MMItems, p.HashMemo
	} else {
		switch kind {
		case kindChat:
			tokens, err = t.TokenizeChat(body)
		case kindCompletion:
			tokens, err = t.TokenizeCompletion(body)
		default:
			tokens, err = t.TokenizeResponses(body)
		}
	}
	if err != nil {
		if st.ctx.Err() != nil && errors.Is(err, st.ctx.Err()) {
			return nil, nil, err // the stream ended while the tokenizer was called
		}
		k := ClassifyTokenizerError(err)
		msg := err.Error()
		if k != picker.KindBadRequest {
			msg = "tokenizer: " + msg
		}
		return nil, nil, &picker.Error{Kind: k, Message: msg, Err: err}
	}
	if len(tokens) == 0 {
		return nil, nil, errEmptyTokens
	}
	return tokens, mm, nil
}

// own records the live booking id.
func (st *stream) own(id string) {
	st.bk.id = id
	st.bk.state.Store(bookingLive)
	st.s.metrics.activeReservations.Add(1)
}

// prefillComplete signals prefill completion at most once and never after free (epp.md §7).
func (st *stream) prefillComplete() {
	if !st.bk.state.CompareAndSwap(bookingLive, bookingPrefilled) {
		return
	}
	ctx, cancel := st.s.releaseCtx(st.ctx)
	defer cancel()
	if err := st.s.cfg.Picker.PrefillComplete(ctx, st.bk.id); err != nil {
		st.s.log.Debug().Err(err).Str("selection_id", st.bk.id).Msg("prefill_complete failed")
	}
}

// free releases the booking exactly once (epp.md §7).
func (st *stream) free() {
	for {
		s := st.bk.state.Load()
		if s != bookingLive && s != bookingPrefilled {
			return
		}
		if st.bk.state.CompareAndSwap(s, bookingFreed) {
			break
		}
	}
	st.s.metrics.activeReservations.Add(-1)
	ctx, cancel := st.s.releaseCtx(st.ctx)
	defer cancel()
	if err := st.s.cfg.Picker.Free(ctx, st.bk.id); err != nil {
		st.s.log.Debug().Err(err).Str("selection_id", st.bk.id).Msg("free failed")
	}
}

// releaseBody returns the pooled request buffer.
func (st *stream) releaseBody() {
	if st.buf != nil {
		st.s.putBuf(st.buf)
		st.buf = nil
	}
	st.body = nil
}

// reject sends the ImmediateResponse for err (epp.md §8), frees any booking and enters phaseRejected.
func (st *stream) reject(err error) error {
	st.free()
	st.releaseBody()
	resp, code := immediateResponse(err)
	st.phase = phaseRejected
	st.s.metrics.countImmediate(code)
	st.s.metrics.gie.rejected(st.model, code)
	st.s.log.Debug().Str("request_id", excerpt.Of(st.requestID())).Int("status", code).Str("path", excerpt.Of(st.hdr.path)).
		Str("reason", err.Error()).Msg("request rejected")
	return st.send(resp)
}

func (st *stream) send(r *extprocv3.ProcessingResponse) error { return st.ps.Send(r) }

// routingReply builds the routing reply of epp.md §4.1–§4.3 with the header mutation of §5.9 /
// §5.10: a request_headers reply, or a request_body reply (carrying a rewritten body) when body
// is true. Its messages share one allocation (routingReply).
func (st *stream) routingReply(d *decision, body bool) *extprocv3.ProcessingResponse {
	r := &routingReply{}
	set := r.setter()
	var num [20]byte
	set.set(DestinationHeader, st.dest)
	set.set("x-dynamo-worker-instance-id", string(strconv.AppendUint(num[:0], d.sel.WorkerID, 10)))
	set.set("x-dynamo-dp-rank", string(strconv.AppendUint(num[:0], uint64(d.sel.DPRank), 10)))
	set.set("x-dynamo-routing-mode", "aggregated")
	if st.generatedID != "" {
		set.set("x-request-id", st.generatedID)
	}
	if d.rewritten {
		set.set("content-length", string(strconv.AppendInt(num[:0], int64(len(d.body)), 10)))
	}
	remove := removedHeaders
	if d.decoded || st.hdr.decision != "" {
		remove = append(make([]string, 0, len(removedHeaders)+2), removedHeaders...) // never the shared one
		if d.decoded {
			remove = append(remove, "content-encoding") // the rewritten body is forwarded plain
		}
		if st.hdr.decision != "" {
			remove = append(remove, DecisionHeader)
		}
	}
	r.mut.SetHeaders, r.mut.RemoveHeaders = set.out, remove
	r.common.HeaderMutation, r.common.ClearRouteCache = &r.mut, true
	if !body {
		r.hdrs.Response = &r.common
		r.reqHdrs.RequestHeaders = &r.hdrs
		r.resp.Response = &r.reqHdrs
		return &r.resp
	}
	if d.rewritten {
		r.bodyRep.Body = d.body
		r.bodyMut.Mutation = &r.bodyRep
		r.common.BodyMutation = &r.bodyMut
	}
	r.body.Response = &r.common
	r.reqBody.RequestBody = &r.body
	r.resp.Response = &r.reqBody
	return &r.resp
}

// sendRouting sends the routing reply for the request's body mode (epp.md §4.1, §4.2, §4.3).
func (st *stream) sendRouting(d decision, headerOnly bool) error {
	md := st.s.destinationMetadata(st.dest)
	if st.hdr.decision != "" {
		md = lbMetadata(st.dest) // its own: the shared one is never modified
		md.Fields[DecisionMetadataNamespace] = decisionMetadata(&d)
	}
	buffered := !headerOnly && st.reqMode == filterv3.ProcessingMode_BUFFERED
	reply := st.routingReply(&d, buffered)
	reply.DynamicMetadata = md
	err := st.send(reply)
	if buffered {
		st.s.metrics.pickDuration.Observe(time.Since(st.eosAt).Seconds())
		return err
	}
	if err != nil {
		return err
	}
	st.s.metrics.pickDuration.Observe(time.Since(st.eosAt).Seconds())
	if headerOnly {
		return nil
	}
	body := d.body
	for {
		n := min(len(body), MaxStreamedChunkBytes)
		last := n == len(body)
		if err := st.send(st.streamedBody(body[:n], last && !st.trailers && !st.eosByLength)); err != nil {
			return err
		}
		body = body[n:]
		if last {
			break
		}
	}
	if st.trailers {
		return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
			RequestTrailers: &extprocv3.TrailersResponse{},
		}})
	}
	return nil
}

// streamedBody is the stream's request_body reply carrying streamed_response chunk b (its reused
// streamed reply: valid until the next reply is built).
func (st *stream) streamedBody(b []byte, eos bool) *extprocv3.ProcessingResponse {
	return st.streamed.build(true, b, eos)
}

// ---- response path ----

func (st *stream) onResponseHeaders(h *extprocv3.HttpHeaders) error {
	for _, hv := range h.GetHeaders().GetHeaders() {
		key := hv.GetKey()
		if key != ":status" && key != "status" && key != "content-type" {
			continue // only these are read: no string made of the others' values
		}
		v := hv.GetValue()
		if raw := hv.GetRawValue(); len(raw) > 0 {
			v = string(raw)
		}
		switch key {
		case ":status":
			if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
				st.respStatus = n
			}
		case "status":
			if st.respStatus == 0 {
				if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
					st.respStatus = n
				}
			}
		case "content-type":
			st.respContentType = v
		}
	}
	if st.phase == phaseForwarded {
		st.phase = phaseResponding
	}
	var mut *extprocv3.HeaderMutation
	if st.s.cfg.ConformanceTestHooks {
		mut = st.conformanceResponseHeaders()
	}
	if err := st.send(st.respHeaders.build(mut)); err != nil {
		return err
	}
	if st.respMode == filterv3.ProcessingMode_NONE && st.respStatus < 400 {
		st.prefillComplete()
	}
	if h.GetEndOfStream() {
		st.complete()
	}
	return nil
}

func (st *stream) onResponseBody(b *extprocv3.HttpBody) error {
	chunk := b.GetBody()
	st.respBytes += len(chunk)
	var reply *extprocv3.ProcessingResponse
	if st.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		reply = st.streamed.build(false, chunk, b.GetEndOfStream())
	} else {
		reply = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}},
		}}
	}
	if err := st.send(reply); err != nil {
		return err
	}
	if len(chunk) > 0 {
		if st.respStatus < 400 {
			st.prefillComplete()
		}
		if !st.completed {
			if st.usage == nil {
				st.usage = NewUsageParser(st.respContentType, st.reqStream)
				st.trackOutput()
			}
			st.usage.Write(chunk)
			st.reportOutput()
		}
	}
	if b.GetEndOfStream() {
		st.complete()
	}
	return nil
}

func (st *stream) onResponseTrailers() error {
	if err := st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
		ResponseTrailers: &extprocv3.TrailersResponse{},
	}}); err != nil {
		return err
	}
	st.complete()
	return nil
}

// complete ends the response (epp.md §6.2): free the booking and record usage.
func (st *stream) complete() {
	if st.completed {
		return
	}
	st.completed = true
	st.free()
	if st.usage != nil {
		st.usageSeen = st.usage.Finish()
		st.s.metrics.addUsage(st.usageSeen)
		st.usage = nil
	}
}

// finish runs when Process returns: free any booking still held and record the outcome.
// cleanClose is true when Envoy closed the stream (io.EOF).
func (st *stream) finish(cleanClose bool) {
	if st.bodyTimer != nil {
		st.bodyTimer.Stop()
	}
	if cleanClose && !st.completed && st.phase == phaseResponding && st.respMode == filterv3.ProcessingMode_NONE {
		st.complete() // no body events: the response ends with the stream
	}
	st.free()
	st.releaseBody()
	if st.routed {
		st.s.metrics.gie.finished(st, st.completed)
	}
	var o Outcome
	switch {
	case st.phase == phaseRejected || st.phase == phaseProtocolError:
		o = OutcomeRejected
	case st.loadOnly && (st.phase == phaseForwarded || st.phase == phaseResponding):
		o = OutcomeLoadOnly
	case st.completed && st.respStatus >= 400:
		o = OutcomeError
	case st.completed:
		o = OutcomeSuccess
	default:
		o = OutcomeCancelled
	}
	st.s.metrics.requests[o].Add(1)
}
