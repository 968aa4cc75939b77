package extproc

import "testing"

// BenchmarkOutputCounterEvent measures the per-event cost DYN_ROUTER_TRACK_OUTPUT_BLOCKS adds to
// a streamed response: one vLLM chat chunk with a one-token delta.
func BenchmarkOutputCounterEvent(b *testing.B) {
	ev := []byte(`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" lorem"},"logprobs":null,"finish_reason":null}]}`)
	c := newOutputCounter()
	b.ReportAllocs()
	for b.Loop() {
		c.event(ev)
	}
	if c.generated() == 0 {
		b.Fatal("nothing counted")
	}
}
