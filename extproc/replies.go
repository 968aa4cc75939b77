package extproc

import (
	"sync"
	"sync/atomic"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// The replies of every exchange are built with as few allocations as the protocol's nesting
// allows: the messages of one reply share one allocation, and the replies a stream sends many of
// (streamed body chunks, response headers) are one per stream, rebuilt from zero for every Send.
// Reusing a sent message is safe because grpc-go encodes it within SendMsg (prepareMsg; a binary
// log records the encoded bytes) and the ext_proc server installs no stats handler, the one part
// of gRPC handed the message itself; every Send of a stream happens under stream.mu, so no two
// builds of one stream's reply overlap. Zeroing the whole reply before building it keeps nothing of the previous message (its
// chunk, end_of_stream, header mutation or cached sizes).

// streamedReply is a request_body or response_body reply carrying a streamed_response chunk, its
// seven nested messages in one allocation.
type streamedReply struct {
	resp    extprocv3.ProcessingResponse
	reqBody extprocv3.ProcessingResponse_RequestBody
	rspBody extprocv3.ProcessingResponse_ResponseBody
	body    extprocv3.BodyResponse
	common  extprocv3.CommonResponse
	mut     extprocv3.BodyMutation
	oneof   extprocv3.BodyMutation_StreamedResponse
	chunk   extprocv3.StreamedBodyResponse
}

// build makes r the reply that streams b (end_of_stream eos) back to Envoy — a request_body reply
// when request is true, else a response_body reply — discarding whatever r held, and returns it.
// b is not copied.
func (r *streamedReply) build(request bool, b []byte, eos bool) *extprocv3.ProcessingResponse {
	*r = streamedReply{}
	r.chunk.Body, r.chunk.EndOfStream = b, eos
	r.oneof.StreamedResponse = &r.chunk
	r.mut.Mutation = &r.oneof
	r.common.BodyMutation = &r.mut
	r.body.Response = &r.common
	if request {
		r.reqBody.RequestBody = &r.body
		r.resp.Response = &r.reqBody
	} else {
		r.rspBody.ResponseBody = &r.body
		r.resp.Response = &r.rspBody
	}
	return &r.resp
}

// responseHeadersReply is the response_headers reply, its four nested messages in one allocation.
type responseHeadersReply struct {
	resp   extprocv3.ProcessingResponse
	oneof  extprocv3.ProcessingResponse_ResponseHeaders
	hdrs   extprocv3.HeadersResponse
	common extprocv3.CommonResponse
}

// build makes r the response_headers reply carrying header mutation mut (nil for none),
// discarding whatever r held, and returns it.
func (r *responseHeadersReply) build(mut *extprocv3.HeaderMutation) *extprocv3.ProcessingResponse {
	*r = responseHeadersReply{}
	r.common.HeaderMutation = mut
	r.hdrs.Response = &r.common
	r.oneof.ResponseHeaders = &r.hdrs
	r.resp.Response = &r.oneof
	return &r.resp
}

// routingHeaders and routingRawBytes size the set headers a routingReply holds: the headers of
// epp.md §5.9 / §5.10 (destination, worker instance id, dp rank, routing mode, a generated
// x-request-id, a rewritten content-length) and their values — a destination list with a few
// fallbacks, a UUID and numbers. A reply that needs more allocates the rest (headerSetter.set).
const (
	routingHeaders  = 6
	routingRawBytes = 192
)

// routingReply is the routing reply (epp.md §4.1–§4.3): the request_headers reply (or, for a
// BUFFERED body, the request_body reply) with its header mutation, optional body mutation and set
// headers, all in one allocation. A stream sends one, so it is not reused.
type routingReply struct {
	resp    extprocv3.ProcessingResponse
	reqHdrs extprocv3.ProcessingResponse_RequestHeaders
	reqBody extprocv3.ProcessingResponse_RequestBody
	hdrs    extprocv3.HeadersResponse
	body    extprocv3.BodyResponse
	common  extprocv3.CommonResponse
	mut     extprocv3.HeaderMutation
	bodyMut extprocv3.BodyMutation
	bodyRep extprocv3.BodyMutation_Body

	opts [routingHeaders]corev3.HeaderValueOption
	vals [routingHeaders]corev3.HeaderValue
	out  [routingHeaders]*corev3.HeaderValueOption
	raw  [routingRawBytes]byte
}

// setter returns a headerSetter backed by r's header arrays.
func (r *routingReply) setter() headerSetter {
	return headerSetter{opts: r.opts[:0], vals: r.vals[:0], raw: r.raw[:0], out: r.out[:0]}
}

// headerSetter builds the set_headers of a header mutation in the backing arrays it is given.
type headerSetter struct {
	opts []corev3.HeaderValueOption
	vals []corev3.HeaderValue
	raw  []byte
	out  []*corev3.HeaderValueOption
}

// set adds key: value (OVERWRITE_IF_EXISTS_OR_ADD, the value as raw_value, as setHeader). Headers
// beyond the backing arrays' capacity (or values beyond the raw bytes') are allocated one by one.
func (h *headerSetter) set(key, value string) {
	if len(h.opts) == cap(h.opts) || len(h.raw)+len(value) > cap(h.raw) {
		h.out = append(h.out, setHeader(key, value))
		return
	}
	start := len(h.raw)
	h.raw = append(h.raw, value...)
	h.vals = append(h.vals, corev3.HeaderValue{Key: key})
	v := &h.vals[len(h.vals)-1]
	v.RawValue = h.raw[start:len(h.raw):len(h.raw)]
	h.opts = append(h.opts, corev3.HeaderValueOption{AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD})
	o := &h.opts[len(h.opts)-1]
	o.Header = v
	h.out = append(h.out, o)
}

// maxCachedKeys bounds a keyCache: its keys are worker endpoints, or destination lists of them
// with fallbacks.
const maxCachedKeys = 4096

// keyCache memoizes a pure function of a string (worker endpoint → host:port, destination →
// its routing metadata) for up to maxCachedKeys keys; results with an error are not kept. Values
// are shared between streams and never modified.
type keyCache[V any] struct {
	m sync.Map
	n atomic.Int64
}

// get returns f(k), computed once per key while the cache has room.
func (c *keyCache[V]) get(k string, f func(string) (V, error)) (V, error) {
	if v, ok := c.m.Load(k); ok {
		return v.(V), nil
	}
	v, err := f(k)
	if err == nil {
		if c.n.Add(1) <= maxCachedKeys {
			c.m.Store(k, v)
		} else {
			c.n.Add(-1)
		}
	}
	return v, err
}

// destinationMetadata returns lbMetadata(dest), shared between the streams routed to dest: a
// message that is never modified can be marshalled by any number of streams at once. The caller
// must not modify it (decision metadata gets a fresh one).
func (s *Server) destinationMetadata(dest string) *structpb.Struct {
	md, _ := s.destMD.get(dest, func(d string) (*structpb.Struct, error) { return lbMetadata(d), nil })
	return md
}
