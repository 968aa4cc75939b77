package benchbody

import (
	"encoding/json"
	"strings"
	"testing"
)

type chat struct {
	Messages []struct {
		Role    string `json:"role"`
		Content any    `json:"content"`
	} `json:"messages"`
	Prompt any `json:"prompt"`
}

func decode(t *testing.T, b []byte) chat {
	t.Helper()
	var c chat
	if err := json.Unmarshal(b, &c); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	return c
}

// TestUniqueMarksTheStartOfTheLastMessage: every request's last message starts with its own
// marker, the rest of the body is unchanged, for string content, text parts and prompts.
func TestUniqueMarksTheStartOfTheLastMessage(t *testing.T) {
	for _, raw := range []string{
		`{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"a"},{"role":"user","content":"a"}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"tail"}]}]}`,
		`{"prompt":"tell me"}`,
	} {
		b, err := New([]byte(raw), "")
		if err != nil || !b.Markable() {
			t.Fatalf("%s: %v", raw, err)
		}
		got := string(b.Unique("run", 7))
		if !strings.Contains(got, "[run 7] ") || strings.Replace(got, "[run 7] ", "", 1) != raw {
			t.Fatalf("%s marked as %s", raw, got)
		}
		c := decode(t, []byte(got))
		if c.Prompt == nil {
			last := c.Messages[len(c.Messages)-1].Content
			s, ok := last.(string)
			if !ok {
				parts := last.([]any)
				s = parts[len(parts)-1].(map[string]any)["text"].(string)
			}
			if !strings.HasPrefix(s, "[run 7] ") {
				t.Fatalf("%s: the marker is not at the start of the last message: %q", raw, s)
			}
		}
	}
	if _, err := New([]byte(`[1]`), ""); err == nil {
		t.Fatal("an array accepted")
	}
}

// TestConversationContinues: a conversation of k turns is the first 2k-1 messages of one of n
// turns (plus the system message), so a longer one continues it; sizes follow turnBytes.
func TestConversationContinues(t *testing.T) {
	short, long := decode(t, Conversation("m", 3, 800)), decode(t, Conversation("m", 6, 800))
	if len(short.Messages) != 1+2*3-1 || len(long.Messages) != 1+2*6-1 {
		t.Fatalf("%d and %d messages", len(short.Messages), len(long.Messages))
	}
	for i := range short.Messages {
		if short.Messages[i] != long.Messages[i] {
			t.Fatalf("message %d differs", i)
		}
	}
	if n := len(Conversation("m", 30, DefaultTurnBytes)); n < 200<<10 || n > 260<<10 {
		t.Fatalf("30 turns of the default size are %d bytes", n)
	}
	b, _ := New(Conversation("m", 4, 500), "")
	if b.Turns != 4 || b.Path != "/v1/chat/completions" {
		t.Fatalf("turns %d path %s", b.Turns, b.Path)
	}
}
