package tokenizer

import (
	"syscall"
	"testing"
	"time"

	"github.com/kvepp/kvepp/internal/sharedtest"
)

// cpuTime returns the process's user+system CPU time. The benchmarks report tokens per CPU
// second next to tokens per wall second because the shared 2-core machine is often
// oversubscribed, which inflates wall time but not CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func reportTokens(b *testing.B, tokens int, cpu0 time.Duration) {
	total := float64(tokens) * float64(b.N)
	b.ReportMetric(total/b.Elapsed().Seconds(), "tokens/s")
	if cpu := (cpuTime() - cpu0).Seconds(); cpu > 0 {
		b.ReportMetric(total/cpu, "tokens/cpu-s")
	}
}

func chatLongBody(b *testing.B) ([]byte, int) {
	b.Helper()
	for _, v := range sharedtest.RequestVectors(b) {
		if v.Name == "chat-long" {
			return v.Body, len(v.TokenIDs)
		}
	}
	b.Fatal("chat-long vector not found")
	return nil, 0
}

// BenchmarkTokenizeChatLong measures warm TokenizeChat (parse, render, encode) on the 3,011-token
// chat-long golden vector; the goal is ≥ 5 M tokens/s on one core.
func BenchmarkTokenizeChatLong(b *testing.B) {
	tk := qwen3(b)
	body, n := chatLongBody(b)
	if _, err := tk.TokenizeChat(body); err != nil { // warm the piece cache
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	for i := 0; i < b.N; i++ {
		ids, err := tk.TokenizeChat(body)
		if err != nil || len(ids) != n {
			b.Fatalf("TokenizeChat: %d ids, %v", len(ids), err)
		}
	}
	reportTokens(b, n, cpu0)
}

// BenchmarkEncodeChatLongPrompt isolates Encode of the rendered chat-long prompt (warm).
func BenchmarkEncodeChatLongPrompt(b *testing.B) {
	tk := qwen3(b)
	var prompt string
	var n int
	for _, v := range sharedtest.RequestVectors(b) {
		if v.Name == "chat-long" {
			prompt, n = v.RenderedPrompt, len(v.TokenIDs)
		}
	}
	tk.Encode(prompt, false)
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	for i := 0; i < b.N; i++ {
		tk.Encode(prompt, false)
	}
	reportTokens(b, n, cpu0)
}

// BenchmarkLoad measures Load of the 11 MB Qwen3 tokenizer.json plus its config.
func BenchmarkLoad(b *testing.B) {
	dir := sharedtest.Qwen3TokenizerDir(b)
	b.ReportAllocs()
	cpu0 := cpuTime()
	for i := 0; i < b.N; i++ {
		if _, err := Load(dir); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric((cpuTime()-cpu0).Seconds()/float64(b.N)*1e3, "cpu-ms/op")
}
