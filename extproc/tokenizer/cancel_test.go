package tokenizer

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// TestEncodeStopsWhenTheContextEnds (audit 8 finding 3): a WithContext view stops encoding within
// about 64 KiB of text once its context has ended, says so (Err), and keeps the incomplete ids
// out of the conversation cache; a live context changes nothing.
func TestEncodeStopsWhenTheContextEnds(t *testing.T) {
	tk := qwen3(t)
	text := strings.Repeat("the quick brown fox jumps over the lazy dog ", 1<<15) // 1.4 MB
	full, err := tk.WithContext(context.Background()).CompletionPromptFor(mustRequest(t, completionBody(t, text)))
	if err != nil {
		t.Fatal(err)
	}
	live, cancel := context.WithCancel(context.Background())
	v := tk.WithContext(live)
	if p, err := v.CompletionPromptFor(mustRequest(t, completionBody(t, text))); err != nil || len(p.TokenIDs) != len(full.TokenIDs) || v.Err() != nil {
		t.Fatalf("live context: %d ids (want %d), err %v, Err %v", len(p.TokenIDs), len(full.TokenIDs), err, v.Err())
	}
	cancel()
	v = tk.WithContext(live)
	p, _ := v.CompletionPromptFor(mustRequest(t, completionBody(t, text)))
	if !errors.Is(v.Err(), context.Canceled) {
		t.Fatalf("Err() = %v after the context ended, want context.Canceled", v.Err())
	}
	if len(p.TokenIDs) > len(full.TokenIDs)/10 {
		t.Fatalf("%d of %d ids encoded after the context ended, want it to stop within ~64 KiB", len(p.TokenIDs), len(full.TokenIDs))
	}
	// A chat that stops early is not cached: the next call with a live context encodes it whole.
	cache := NewConversationCache(64 << 20)
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":"` + text + `"}]}`)
	v = tk.WithContext(live)
	if _, err := v.ChatPromptFor(mustRequest(t, chat), ChatOptions{Cache: cache}); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
	if v.Err() == nil {
		t.Fatal("the chat was not stopped")
	}
	want, err := tk.ChatPromptFor(mustRequest(t, chat), ChatOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := tk.ChatPromptFor(mustRequest(t, chat), ChatOptions{Cache: cache})
	if err != nil || len(got.TokenIDs) != len(want.TokenIDs) {
		t.Fatalf("after a stopped chat: %d ids (want %d), err %v", len(got.TokenIDs), len(want.TokenIDs), err)
	}
}
