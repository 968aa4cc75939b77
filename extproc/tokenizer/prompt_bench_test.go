package tokenizer

import (
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/kvepp/kvepp/internal/benchbody"
)

// BenchmarkChatPromptUnique is the tokenizer's share of one ext_proc exchange of the 12 KB
// chat-long request whose last message is unique (benchbody.Body.Unique), as the runner calls it:
// the members already split (RequestFromMembers), the conversation cache on (which misses, and
// fills at the last user message for the conversation's next turn). It reports allocations per
// request; TestChatPromptUniqueAllocs bounds them.
//
//	go test ./extproc/tokenizer -run '^$' -bench ChatPromptUnique -benchmem
func BenchmarkChatPromptUnique(b *testing.B) {
	tk, body, cache, run, n := uniqueBench(b)
	buf := make([]byte, 0, len(body.Raw)+64)
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	for i := 0; i < b.N; i++ {
		buf = body.AppendUnique(buf[:0], run, uint64(i))
		p := uniquePrompt(b, tk, cache, buf)
		if len(p.TokenIDs) < n {
			b.Fatalf("%d ids, want more than %d", len(p.TokenIDs), n)
		}
	}
	reportTokens(b, n, cpu0)
}

// BenchmarkChatPromptUniqueParallel is BenchmarkChatPromptUnique with 8 requests at a time (4
// goroutines per GOMAXPROCS, 8 on the 2-core benchmark machine), as kvepp serves the load
// benchmark's concurrency 8: the requests share the tokenizer's piece cache and the conversation
// cache, and every one's last message is unique. ns/op is wall time per request over all
// goroutines; tokens/cpu-s counts the process's CPU.
//
//	go test ./extproc/tokenizer -run '^$' -bench ChatPromptUniqueParallel -benchmem
func BenchmarkChatPromptUniqueParallel(b *testing.B) {
	tk, body, cache, run, n := uniqueBench(b)
	var next atomic.Uint64
	b.SetParallelism(4)
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	b.RunParallel(func(pb *testing.PB) {
		buf := make([]byte, 0, len(body.Raw)+64)
		for pb.Next() {
			buf = body.AppendUnique(buf[:0], run, next.Add(1))
			p, err := runnerPrompt(tk, cache, buf)
			if err != nil || len(p.TokenIDs) < n {
				b.Errorf("%d ids, want more than %d: %v", len(p.TokenIDs), n, err)
				return
			}
		}
	})
	reportTokens(b, n, cpu0)
}

// uniqueBench sets up the unique chat-long benchmarks: the Qwen3 tokenizer, the chat-long body to
// make unique, a conversation cache, a run name for Unique and the body's token count.
func uniqueBench(b *testing.B) (*Tokenizer, *benchbody.Body, *ConversationCache, string, int) {
	tk := qwen3(b)
	raw, n := chatLongBody(b)
	body, err := benchbody.New(raw, "")
	if err != nil {
		b.Fatal(err)
	}
	cache := NewConversationCache(128 << 20)
	return tk, body, cache, fmt.Sprintf("bench-%p", cache), n
}

// uniquePrompt tokenizes body as the runner does (members split by the caller).
func uniquePrompt(tb testing.TB, tk *Tokenizer, cache *ConversationCache, body []byte) ChatPrompt {
	p, err := runnerPrompt(tk, cache, body)
	if err != nil {
		tb.Fatal(err)
	}
	return p
}

// runnerPrompt is uniquePrompt returning its error (for goroutines, which must not call Fatal).
func runnerPrompt(tk *Tokenizer, cache *ConversationCache, body []byte) (ChatPrompt, error) {
	r, err := ParseRequest(body)
	if err != nil {
		return ChatPrompt{}, err
	}
	if r, err = RequestFromMembers(r.members); err != nil {
		return ChatPrompt{}, err
	}
	return tk.ChatPromptFor(r, ChatOptions{Cache: cache})
}
