package tokenizer

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// chatWithAssistant is a chat body whose assistant turn has the given content.
func chatWithAssistant(t *testing.T, content string) []byte {
	t.Helper()
	body, err := json.Marshal(map[string]any{"messages": []map[string]string{
		{"role": "user", "content": "q"}, {"role": "assistant", "content": content}, {"role": "user", "content": "more"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	return body
}

// TestTemplateSplitIsBounded: Qwen3's template splits assistant content at '</think>' (audit 7
// R1): a content string of more separators than MaxTemplateSplitValues is refused with a 400
// before rendering instead of becoming a list of millions of values; a few separators render.
func TestTemplateSplitIsBounded(t *testing.T) {
	tk := qwen3(t)
	if n := len(tk.chat.templates["default"].splits.seps); n == 0 {
		t.Fatalf("the Qwen3 template's split('</think>') sites were not found")
	}
	ok := chatWithAssistant(t, strings.Repeat("<think>r</think>", 3)+"answer")
	if _, err := tk.TokenizeChat(ok); err != nil {
		t.Fatalf("a few separators: %v", err)
	}
	big := chatWithAssistant(t, strings.Repeat("</think>", MaxTemplateSplitValues+1))
	_, err := tk.TokenizeChat(big)
	var re *RequestError
	if !errors.As(err, &re) || !strings.Contains(err.Error(), "split('</think>') would build more than 250000 values") {
		t.Fatalf("TokenizeChat(%d separators) = %v, want a RequestError naming the split bound", MaxTemplateSplitValues+1, err)
	}
}

func TestParseSplitBudget(t *testing.T) {
	b := parseSplitBudget(`{{ a.split('</think>')[0] }}{{ b.split("x") }}{{ c.split() }}{{ d.split(sep) }}{{ e . split ( 'y' ) }}`)
	if strings.Join(b.seps, ",") != "</think>,x,y" || b.fields != 1 || b.dynamic != 1 {
		t.Fatalf("parseSplitBudget = %+v", b)
	}
	if err := b.check(&jval{kind: jString, s: strings.Repeat("a b ", MaxTemplateSplitValues)}); err == nil ||
		!strings.Contains(err.Error(), "split()") {
		t.Fatalf("whitespace fields beyond the bound: %v", err)
	}
}
