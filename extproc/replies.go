package extproc

import (
	"sync"
	"sync/atomic"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// The replies of every exchange are built with as few allocations as the protocol's nesting
// allows: each message is new (gRPC may read a sent message after Send returns, so nothing is
// reused), but the messages of one reply share one allocation.

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

// newStreamedReply returns the reply that streams b (end_of_stream eos) back to Envoy: a
// request_body reply when request is true, else a response_body reply. b is not copied.
func newStreamedReply(request bool, b []byte, eos bool) *extprocv3.ProcessingResponse {
	r := &streamedReply{}
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

// newResponseHeadersReply returns the response_headers reply carrying header mutation mut (nil
// for none).
func newResponseHeadersReply(mut *extprocv3.HeaderMutation) *extprocv3.ProcessingResponse {
	r := &responseHeadersReply{}
	r.common.HeaderMutation = mut
	r.hdrs.Response = &r.common
	r.oneof.ResponseHeaders = &r.hdrs
	r.resp.Response = &r.oneof
	return &r.resp
}

// headerSetter builds the set_headers of a header mutation: every HeaderValueOption, HeaderValue
// and raw value in three allocations sized for n headers.
type headerSetter struct {
	opts []corev3.HeaderValueOption
	vals []corev3.HeaderValue
	raw  []byte
	out  []*corev3.HeaderValueOption
}

func newHeaderSetter(n, rawBytes int) *headerSetter {
	return &headerSetter{
		opts: make([]corev3.HeaderValueOption, 0, n), vals: make([]corev3.HeaderValue, 0, n),
		raw: make([]byte, 0, rawBytes), out: make([]*corev3.HeaderValueOption, 0, n),
	}
}

// set adds key: value (OVERWRITE_IF_EXISTS_OR_ADD, the value as raw_value, as setHeader). More
// headers than the setter was sized for are allocated one by one.
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
