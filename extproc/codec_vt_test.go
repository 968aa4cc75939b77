//go:build vtprotobuf

package extproc

import (
	"bytes"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"
)

// TestReplyCodecUsesTheGeneratedCode: built with -tags vtprotobuf, every reply is encoded by the
// generated code (its bytes are MarshalVTStrict's, which orders the response oneof before
// dynamic_metadata where proto.Marshal puts it after: field order is free on the wire) and decodes
// to the message sent. The replies' metadata maps have one key per level except the decision
// metadata, left out here so that the bytes are fixed.
func TestReplyCodecUsesTheGeneratedCode(t *testing.T) {
	var _ vtMarshaler = (*extprocv3.ProcessingResponse)(nil)
	c := newReplyCodec()
	for name, m := range codecReplies(t) {
		if name == "routing" {
			m = proto.Clone(m).(*extprocv3.ProcessingResponse)
			delete(m.DynamicMetadata.Fields, DecisionMetadataNamespace)
		}
		data, err := c.Marshal(m)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		want, err := m.MarshalVTStrict()
		if err != nil {
			t.Fatal(err)
		}
		if got := data.Materialize(); !bytes.Equal(got, want) {
			t.Fatalf("%s: codec bytes %x, generated code's %x", name, got, want)
		}
		back := &extprocv3.ProcessingResponse{}
		if err := proto.Unmarshal(want, back); err != nil || !proto.Equal(back, m) {
			t.Fatalf("%s: decodes as %v, %v", name, back, err)
		}
	}
}
