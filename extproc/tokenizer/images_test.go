package tokenizer

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestTokenizeChatPromptRoutesImagesByTheirTextPrefix checks the image boundary: a text-only
// request is exact; with an image the ids before UncachedFrom are the ids of the same chat
// without the image, the rest is booked (remaining text plus imageTokens per image).
func TestTokenizeChatPromptRoutesImagesByTheirTextPrefix(t *testing.T) {
	const history = `{"role":"system","content":"You describe pictures."},{"role":"user","content":"Hello"},{"role":"assistant","content":"Hi! Send a picture."},`
	textOnly := []byte(`{"messages":[` + history + `{"role":"user","content":[{"type":"text","text":"What is this?"}]}]}`)
	withImage := []byte(`{"messages":[` + history + `{"role":"user","content":[{"type":"text","text":"What is this?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"input_image","image_url":"x"}]}]}`)

	t.Run("a text-only chat is exact (Qwen3)", func(t *testing.T) {
		tk := qwen3(t)
		want, err := tk.TokenizeChat(textOnly)
		if err != nil {
			t.Fatal(err)
		}
		got, err := tk.TokenizeChatPrompt(textOnly, 256)
		if err != nil || !cmp.Equal(got, ChatPrompt{TokenIDs: want, UncachedFrom: len(want)}) {
			t.Fatalf("TokenizeChatPrompt = %+v, %v; want the exact ids", got, err)
		}
	})
	t.Run("string content format: the prefix is exact up to the back-off before the image (Qwen3)", func(t *testing.T) {
		tk := qwen3(t)
		exact, err := tk.TokenizeChat(textOnly)
		if err != nil {
			t.Fatal(err)
		}
		got, err := tk.TokenizeChatPrompt(withImage, 100)
		if err != nil {
			t.Fatal(err)
		}
		if got.UncachedFrom < 20 || got.UncachedFrom >= len(exact) {
			t.Fatalf("UncachedFrom = %d of %d exact tokens", got.UncachedFrom, len(exact))
		}
		if !cmp.Equal(got.TokenIDs[:got.UncachedFrom], exact[:got.UncachedFrom]) {
			t.Fatalf("prefix before the image differs from the text-only chat's ids")
		}
		if len(got.TokenIDs) < len(exact)+200 {
			t.Fatalf("%d ids booked, want the text plus 2 images x 100 tokens (> %d)", len(got.TokenIDs), len(exact)+200)
		}
	})
	t.Run("the exact path still refuses images", func(t *testing.T) {
		if _, err := qwen3(t).TokenizeChatText(withImage); err == nil {
			t.Fatal("TokenizeChatText accepted an image")
		}
	})
	t.Run("openai content format with an added image token: the prefix is exact to the image (Gemma 3)", func(t *testing.T) {
		tk := realModel(t, "gemma3")
		img := []byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"Look:"},{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":"what is it?"}]}]}`)
		txt := []byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"Look:"},{"type":"text","text":"<start_of_image>"},{"type":"text","text":"what is it?"}]}]}`)
		exact, err := tk.TokenizeChat(txt)
		if err != nil {
			t.Fatal(err)
		}
		got, err := tk.TokenizeChatPrompt(img, 256)
		if err != nil {
			t.Fatal(err)
		}
		boi, _ := tk.TokenID("<start_of_image>")
		k := -1
		for i, id := range exact {
			if id == boi {
				k = i
				break
			}
		}
		if k < 0 || got.UncachedFrom != k || !cmp.Equal(got.TokenIDs[:k], exact[:k]) {
			t.Fatalf("UncachedFrom = %d, want %d (the <start_of_image> position) with the same ids before it", got.UncachedFrom, k)
		}
	})
}

// TestResponsesPromptRoutesImagesByTheirTextPrefix: a Responses body's input_image parts end the
// cacheable prefix and are booked like a chat's; a text-only body is exactly ResponsesIDs.
func TestResponsesPromptRoutesImagesByTheirTextPrefix(t *testing.T) {
	tk := qwen3(t)
	const history = `{"role":"user","content":[{"type":"input_text","text":"Hello, here is some context for you to keep."}]},{"role":"assistant","content":[{"type":"output_text","text":"Thanks, noted."}]},`
	textOnly, err := ParseRequest([]byte(`{"model":"m","input":[` + history + `{"role":"user","content":[{"type":"input_text","text":"What is this?"}]}]}`))
	if err != nil {
		t.Fatal(err)
	}
	withImage, err := ParseRequest([]byte(`{"model":"m","input":[` + history + `{"role":"user","content":[{"type":"input_text","text":"What is this?"},{"type":"input_image","image_url":"data:image/png;base64,AAAA"}]}]}`))
	if err != nil {
		t.Fatal(err)
	}
	exact, err := tk.ResponsesIDs(textOnly)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tk.ResponsesPromptFor(textOnly, 64)
	if err != nil || !cmp.Equal(got, ChatPrompt{TokenIDs: exact, UncachedFrom: len(exact)}) {
		t.Fatalf("text-only ResponsesPromptFor = %+v, %v; want ResponsesIDs' ids", got, err)
	}
	img, err := tk.ResponsesPromptFor(withImage, 64)
	if err != nil {
		t.Fatal(err)
	}
	if img.UncachedFrom < 10 || img.UncachedFrom >= len(exact) {
		t.Fatalf("UncachedFrom = %d of %d text ids", img.UncachedFrom, len(exact))
	}
	if !cmp.Equal(img.TokenIDs[:img.UncachedFrom], exact[:img.UncachedFrom]) {
		t.Fatal("the ids before the image differ from the text-only body's")
	}
	if len(img.TokenIDs) < len(exact)+64 {
		t.Fatalf("%d ids booked, want the text plus 64 image tokens (> %d)", len(img.TokenIDs), len(exact)+64)
	}
}

// TestImageRoutingIsBounded: more than MaxImagesPerRequest image parts, or request text carrying
// the image marker itself, is a 400 — not millions of booked tokens.
func TestImageRoutingIsBounded(t *testing.T) {
	tk := qwen3(t)
	many := func(n int, typ, part string) string {
		return `{"type":"input_text","text":"look"}` + strings.Repeat(`,{"type":"`+typ+`",`+part+`}`, n)
	}
	for _, tc := range []struct {
		name, body string
		responses  bool
		want       string
	}{
		{"a chat with too many images", `{"messages":[{"role":"user","content":[` + many(MaxImagesPerRequest+1, "image_url", `"image_url":{"url":"u"}`) + `]}]}`, false, "at most 128"},
		{"a Responses body with too many images", `{"input":[{"role":"user","content":[` + many(MaxImagesPerRequest+1, "input_image", `"image_url":"u"`) + `]}]}`, true, "at most 128"},
		{"chat text carrying the marker", `{"messages":[{"role":"user","content":"hi \ue000kvepp-image\ue001 there"}]}`, false, "reserves to mark images"},
		{"Responses text carrying the marker", `{"input":[{"role":"user","content":[{"type":"input_text","text":"\ue000kvepp-image\ue001"}]}]}`, true, "reserves to mark images"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := ParseRequest([]byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if tc.responses {
				_, err = tk.ResponsesPromptFor(r, 256)
			} else {
				_, err = tk.ChatPromptFor(r, ChatOptions{ImageTokens: 256, Cache: NewConversationCache(1 << 20)})
			}
			var re *RequestError
			if !errors.As(err, &re) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want a request error containing %q", err, tc.want)
			}
		})
	}
	t.Run("exactly the limit is routed", func(t *testing.T) {
		r, err := ParseRequest([]byte(`{"messages":[{"role":"user","content":[` + many(MaxImagesPerRequest, "image_url", `"image_url":{"url":"u"}`) + `]}]}`))
		if err != nil {
			t.Fatal(err)
		}
		p, err := tk.ChatPromptFor(r, ChatOptions{ImageTokens: 256})
		if err != nil || len(p.TokenIDs) < MaxImagesPerRequest*256 {
			t.Fatalf("%d ids, %v", len(p.TokenIDs), err)
		}
	})
}

// TestDecodingIsBoundedInValues: one decode builds at most MaxJSONValues values, and the
// tool-call arguments of a conversation (strings, which the body scan does not count) share one
// such budget.
func TestDecodingIsBoundedInValues(t *testing.T) {
	if _, n, err := decodeOrderedLimit([]byte(`[`+strings.Repeat("0,", 99)+`0]`), 101); err != nil || n != 101 {
		t.Fatalf("101 values under a limit of 101: %d, %v", n, err)
	}
	if _, _, err := decodeOrderedLimit([]byte(`[`+strings.Repeat("0,", 100)+`0]`), 101); err == nil || !strings.Contains(err.Error(), "more than 101 JSON values") {
		t.Fatalf("102 values under a limit of 101: %v", err)
	}
	tk := qwen3(t)
	args := `{\"a\":[` + strings.Repeat("{},", MaxJSONValues/2) + `{}]}`
	call := `{"id":"c%d","type":"function","function":{"name":"f","arguments":"` + args + `"}}`
	body := `{"messages":[{"role":"user","content":"q"},{"role":"assistant","tool_calls":[` +
		strings.ReplaceAll(call, "%d", "1") + `,` + strings.ReplaceAll(call, "%d", "2") + `]},{"role":"tool","tool_call_id":"c1","content":"r"}]}`
	r, err := ParseRequest([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	_, err = tk.ChatPromptFor(r, ChatOptions{ImageTokens: 256})
	var re *RequestError
	if !errors.As(err, &re) || !strings.Contains(err.Error(), "tool-call arguments hold more than 250000 JSON values") {
		t.Fatalf("two calls of %d values each: %v", MaxJSONValues/2+2, err)
	}
}
