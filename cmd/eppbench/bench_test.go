package main

import "testing"

// BenchmarkCompletionBody measures rendering one request body of the default chat workload
// (≈ 3k token ids) as the load generator does before every send.
func BenchmarkCompletionBody(b *testing.B) {
	w, err := SyntheticChat(DefaultChat, 1, 0)
	if err != nil {
		b.Fatal(err)
	}
	r := &w.Requests[len(w.Requests)/2]
	var buf []byte
	b.SetBytes(int64(len(completionBody(nil, "m", r, w.Seed, true))))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		buf = completionBody(buf[:0], "m", r, w.Seed, true)
	}
}

// BenchmarkIdealReuse measures the ideal-reuse computation over the default chat workload
// (≈ 380 requests, 1.1M prompt tokens, 16-token blocks).
func BenchmarkIdealReuse(b *testing.B) {
	w, err := SyntheticChat(DefaultChat, 1, 0)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		IdealReuse(w, 16)
	}
}

// BenchmarkPooledLRUReuse measures the pooled-LRU reference over the default chat workload with
// 4 × 2048 blocks.
func BenchmarkPooledLRUReuse(b *testing.B) {
	w, err := SyntheticChat(DefaultChat, 1, 0)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		PooledLRUReuse(w, 16, 4*2048)
	}
}
