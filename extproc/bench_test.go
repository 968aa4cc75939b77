package extproc_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/kvepp/kvepp/extproc/extproctest"
)

// benchRequest is one full request: headers, a 10 KB chat body in one chunk, the routing reply and
// re-streamed body, response headers, three SSE response chunks (the last with usage), end.
func benchRequest() extproctest.Request {
	return extproctest.Request{
		Body:      chatBody(10 << 10),
		ChunkSize: 16 << 10,
		Headers:   []extproctest.Header{{Key: "x-request-id", Value: "bench"}},
		Response: &extproctest.Response{ContentType: "text/event-stream", Chunks: [][]byte{
			[]byte("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n"),
			[]byte("data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n"),
			[]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2500,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n"),
		}},
	}
}

func benchHarness(b *testing.B) *harness {
	h := newHarness(b, nil)
	h.pk.noRecord = true
	h.tok.empty = false
	return h
}

// BenchmarkFullRequest measures one complete request through the Envoy emulator over loopback gRPC
// (client and server in one process) with a fake picker and tokenizer.
func BenchmarkFullRequest(b *testing.B) {
	h := benchHarness(b)
	req := benchRequest()
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		ex, err := h.client.Do(ctx, req)
		if err != nil || ex.Destination == "" {
			b.Fatalf("err %v", err)
		}
	}
}

// BenchmarkFullRequestLatency records per-request latency and reports p50 and p99 in microseconds.
func BenchmarkFullRequestLatency(b *testing.B) {
	h := benchHarness(b)
	req := benchRequest()
	ctx := context.Background()
	lat := make([]time.Duration, 0, 4096)
	for b.Loop() {
		start := time.Now()
		ex, err := h.client.Do(ctx, req)
		lat = append(lat, time.Since(start))
		if err != nil || ex.Destination == "" {
			b.Fatalf("err %v", err)
		}
	}
	slices.Sort(lat)
	pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Nanoseconds()) / 1e3 }
	b.ReportMetric(pct(0.50), "p50-µs")
	b.ReportMetric(pct(0.99), "p99-µs")
}

// BenchmarkFullRequestParallel runs full requests from GOMAXPROCS×4 concurrent streams.
func BenchmarkFullRequestParallel(b *testing.B) {
	h := benchHarness(b)
	req := benchRequest()
	b.SetParallelism(4)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		for pb.Next() {
			if _, err := h.client.Do(ctx, req); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
