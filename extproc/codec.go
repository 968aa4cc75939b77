package extproc

import (
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
)

// vtMarshaler is the generated marshalling code go-control-plane ships for every ext_proc message
// when built with the vtprotobuf build tag (its *_vtproto.pb.go files, github.com/planetscale/vtprotobuf):
// the same wire encoding as proto.Marshal, fields in number order, without the reflection of the
// generic marshaller — 4× faster for a routing reply, 8× for a streamed chunk reply.
type vtMarshaler interface {
	SizeVT() int
	MarshalToSizedBufferVTStrict(dst []byte) (int, error)
}

// replyCodec is the ext_proc server's gRPC codec: gRPC's proto codec, except that messages with
// vtMarshaler methods (every ProcessingResponse of a binary built with -tags vtprotobuf, as the
// Dockerfile builds cmd/epp) are encoded by them. Without the tag it is gRPC's proto codec exactly.
// Decoding is always gRPC's: go-control-plane generates no vtprotobuf decoders.
type replyCodec struct{ proto encoding.CodecV2 }

// newReplyCodec returns the codec over gRPC's registered proto codec.
func newReplyCodec() replyCodec {
	return replyCodec{proto: encoding.GetCodecV2(grpcproto.Name)}
}

// Marshal encodes v into a buffer from gRPC's default pool, as gRPC's proto codec does.
func (c replyCodec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(vtMarshaler)
	if !ok {
		return c.proto.Marshal(v)
	}
	size := m.SizeVT()
	if mem.IsBelowBufferPoolingThreshold(size) {
		buf := make([]byte, size)
		if err := marshalVT(m, buf); err != nil {
			return nil, err
		}
		return mem.BufferSlice{mem.SliceBuffer(buf)}, nil
	}
	pool := mem.DefaultBufferPool()
	buf := pool.Get(size)
	if err := marshalVT(m, *buf); err != nil {
		pool.Put(buf)
		return nil, err
	}
	return mem.BufferSlice{mem.NewBuffer(buf, pool)}, nil
}

// marshalVT encodes m into buf, which is exactly m.SizeVT() bytes long.
func marshalVT(m vtMarshaler, buf []byte) error {
	n, err := m.MarshalToSizedBufferVTStrict(buf)
	if err != nil {
		return fmt.Errorf("extproc: marshal %T: %w", m, err)
	}
	if n != len(buf) {
		return fmt.Errorf("extproc: marshal %T: %d bytes written, %d sized (modified while sent?)", m, n, len(buf))
	}
	return nil
}

// Unmarshal is gRPC's proto codec's.
func (c replyCodec) Unmarshal(data mem.BufferSlice, v any) error { return c.proto.Unmarshal(data, v) }

// Name is "proto": the codec speaks the same content-subtype.
func (replyCodec) Name() string { return grpcproto.Name }

// codecOption is the server option installing replyCodec.
func codecOption() grpc.ServerOption { return grpc.ForceServerCodecV2(newReplyCodec()) }
