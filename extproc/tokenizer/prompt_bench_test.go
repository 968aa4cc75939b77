package tokenizer

import (
	"fmt"
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
	tk := qwen3(b)
	raw, n := chatLongBody(b)
	body, err := benchbody.New(raw, "")
	if err != nil {
		b.Fatal(err)
	}
	cache := NewConversationCache(128 << 20)
	run := fmt.Sprintf("bench-%p", cache)
	buf := make([]byte, 0, len(raw)+64)
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

// uniquePrompt tokenizes body as the runner does (members split by the caller).
func uniquePrompt(tb testing.TB, tk *Tokenizer, cache *ConversationCache, body []byte) ChatPrompt {
	r, err := ParseRequest(body)
	if err != nil {
		tb.Fatal(err)
	}
	r, err = RequestFromMembers(r.members)
	if err != nil {
		tb.Fatal(err)
	}
	p, err := tk.ChatPromptFor(r, ChatOptions{Cache: cache})
	if err != nil {
		tb.Fatal(err)
	}
	return p
}
