package extproc

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/kvepp/kvepp/picker"
)

// codecReplies are replies of every kind the server sends: a routing reply with its metadata
// (decision metadata too), a small and a pooled-size streamed chunk, a response_headers reply
// and an ImmediateResponse.
func codecReplies(t *testing.T) map[string]*extprocv3.ProcessingResponse {
	t.Helper()
	st := &stream{s: &Server{}, dest: "10.0.0.1:8000,10.0.0.2:8000", generatedID: "0b7e2c1c-6a43-4c8e-9f7e-1f2a3b4c5d6e"}
	d := &decision{sel: picker.Selection{WorkerID: 3, DPRank: 1, ISLTokens: 2800, Booked: true}, booked: true,
		body: []byte(`{"cache_salt":"t"}`), rewritten: true}
	routing := st.routingReply(d, false)
	routing.DynamicMetadata = lbMetadata(st.dest)
	routing.DynamicMetadata.Fields[DecisionMetadataNamespace] = decisionMetadata(d)
	var big, small streamedReply
	var hdrs responseHeadersReply
	imm, _ := immediateResponse(picker.Errorf(picker.KindBadRequest, "bad"))
	return map[string]*extprocv3.ProcessingResponse{
		"routing":          routing,
		"buffered-routing": st.routingReply(d, true),
		"chunk":            small.build(false, []byte("data: {\"choices\":[]}\n\n"), false),
		"body":             big.build(true, bytes.Repeat([]byte("x"), 12<<10), true),
		"response-headers": hdrs.build(nil),
		"immediate":        imm,
	}
}

// TestReplyCodecEncodesAsProto: every reply encoded by the server's codec decodes to the message
// sent, in this build's path (the generated vtprotobuf code with -tags vtprotobuf, gRPC's proto
// codec without), and decoding is gRPC's.
func TestReplyCodecEncodesAsProto(t *testing.T) {
	c := newReplyCodec()
	if c.Name() != "proto" {
		t.Fatalf("codec name %q", c.Name())
	}
	for name, m := range codecReplies(t) {
		data, err := c.Marshal(m)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		got := &extprocv3.ProcessingResponse{}
		if err := proto.Unmarshal(data.Materialize(), got); err != nil {
			t.Fatalf("%s: the encoding does not decode: %v", name, err)
		}
		if !proto.Equal(got, m) {
			t.Fatalf("%s: decodes as %v, want %v", name, got, m)
		}
		back := &extprocv3.ProcessingResponse{}
		if err := c.Unmarshal(data, back); err != nil || !proto.Equal(back, m) {
			t.Fatalf("%s: codec Unmarshal %v, %v", name, back, err)
		}
		data.Free()
	}
	if _, err := c.Marshal("not a message"); err == nil {
		t.Fatal("marshalling a non-message gave no error")
	}
}

// fakeVT is a vtMarshaler encoding msg with proto.Marshal, written at the end of the buffer as
// the generated code writes; short makes it write one byte fewer than it sized.
type fakeVT struct {
	msg   proto.Message
	short bool
	err   error
}

func (f *fakeVT) SizeVT() int { return proto.Size(f.msg) }

func (f *fakeVT) MarshalToSizedBufferVTStrict(dst []byte) (int, error) {
	if f.err != nil {
		return 0, f.err
	}
	b, _ := proto.Marshal(f.msg)
	if f.short {
		b = b[1:]
	}
	return copy(dst[len(dst)-len(b):], b), nil
}

// TestReplyCodecVTPath: a message with vtMarshaler methods is encoded by them, into a pooled
// buffer above gRPC's pooling threshold and a plain one below it, and a marshaller that fails or
// writes other than it sized is an error, not a corrupt message.
func TestReplyCodecVTPath(t *testing.T) {
	c := newReplyCodec()
	for _, n := range []int{10, 20 << 10} {
		var r streamedReply
		m := r.build(false, bytes.Repeat([]byte("y"), n), true)
		data, err := c.Marshal(&fakeVT{msg: m})
		if err != nil {
			t.Fatal(err)
		}
		want, _ := proto.Marshal(m)
		if !bytes.Equal(data.Materialize(), want) {
			t.Fatalf("%d-byte chunk: the codec's bytes differ from the marshaller's", n)
		}
		if pooled := !mem.IsBelowBufferPoolingThreshold(len(want)); pooled != (n > 1000) {
			t.Fatalf("%d-byte chunk: pooled %v", n, pooled)
		}
		data.Free()
		if _, err := c.Marshal(&fakeVT{msg: m, short: true}); err == nil || !strings.Contains(err.Error(), "sized") {
			t.Fatalf("%d-byte chunk: a short write gave %v", n, err)
		}
		boom := errors.New("boom")
		if _, err := c.Marshal(&fakeVT{msg: m, err: boom}); !errors.Is(err, boom) {
			t.Fatalf("%d-byte chunk: a failing marshaller gave %v", n, err)
		}
	}
}
