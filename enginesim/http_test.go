package enginesim

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// sseEvents splits an SSE body into its data payloads and checks the framing.
func sseEvents(t *testing.T, body []byte) []string {
	t.Helper()
	text := string(body)
	if !strings.HasSuffix(text, "\n\n") {
		t.Fatalf("stream does not end with a blank line: %q", text)
	}
	var out []string
	for _, ev := range strings.Split(strings.TrimSuffix(text, "\n\n"), "\n\n") {
		data, ok := strings.CutPrefix(ev, "data: ")
		if !ok {
			t.Fatalf("SSE event %q does not start with \"data: \"", ev)
		}
		out = append(out, data)
	}
	return out
}

type usageJSON struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

type responseJSON struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index        int     `json:"index"`
		Text         *string `json:"text"`
		FinishReason *string `json:"finish_reason"`
		Message      *struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Delta *struct {
			Role    string  `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *usageJSON `json:"usage"`
}

func decodeResponse(t *testing.T, data string) responseJSON {
	t.Helper()
	var r responseJSON
	dec := json.NewDecoder(strings.NewReader(data))
	if err := dec.Decode(&r); err != nil {
		t.Fatalf("decode %q: %v", data, err)
	}
	return r
}

func usageOf(prompt, completion, cached int) *usageJSON {
	u := &usageJSON{PromptTokens: prompt, CompletionTokens: completion, TotalTokens: prompt + completion}
	u.PromptTokensDetails.CachedTokens = cached
	return u
}

func TestCompletionsNonStreaming(t *testing.T) {
	w := startWorker(t, Config{Name: "w7", Model: "m", TimeScale: 0.001})
	prompt := seqTokens(5, 40)
	for i, wantCached := range []int{0, 32} {
		status, hdr, body := postJSON(t, w.Endpoint()+"/v1/completions", map[string]any{"model": "m", "prompt": prompt, "max_tokens": 3})
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, body)
		}
		if hdr.Get("Content-Type") != "application/json" || hdr.Get("X-Enginesim-Worker") != "w7" {
			t.Errorf("headers %v", hdr)
		}
		r := decodeResponse(t, string(body))
		if !strings.HasPrefix(r.ID, "cmpl-w7-") || r.Object != "text_completion" || r.Model != "m" || r.Created == 0 {
			t.Errorf("request %d: envelope %+v", i, r)
		}
		if len(r.Choices) != 1 || r.Choices[0].Text == nil || *r.Choices[0].Text != " lorem ipsum dolor" ||
			r.Choices[0].FinishReason == nil || *r.Choices[0].FinishReason != "length" {
			t.Errorf("request %d: choices %s", i, body)
		}
		if diff := cmp.Diff(usageOf(40, 3, wantCached), r.Usage); diff != "" {
			t.Errorf("request %d: usage (-want +got):\n%s", i, diff)
		}
	}
}

func TestCompletionsStreaming(t *testing.T) {
	w := startWorker(t, Config{TimeScale: 0.001, DecodePerToken: 1})
	prompt := seqTokens(5, 40)
	postJSON(t, w.Endpoint()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 1}) // warm the cache
	status, hdr, body := postJSON(t, w.Endpoint()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 4, "stream": true})
	if status != http.StatusOK || hdr.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("status %d, content type %q", status, hdr.Get("Content-Type"))
	}
	events := sseEvents(t, body)
	if len(events) != 6 || events[5] != "[DONE]" {
		t.Fatalf("got %d events (last %q), want 4 token chunks, a usage chunk and [DONE]", len(events), events[len(events)-1])
	}
	var text string
	for k, data := range events[:4] {
		c := decodeResponse(t, data)
		if c.Object != "text_completion" || len(c.Choices) != 1 || c.Choices[0].Text == nil || c.Usage != nil {
			t.Fatalf("token chunk %d = %s", k, data)
		}
		text += *c.Choices[0].Text
		if fin := c.Choices[0].FinishReason; (k == 3) != (fin != nil && *fin == "length") {
			t.Errorf("chunk %d finish_reason %v; only the last chunk carries \"length\"", k, fin)
		}
	}
	if text != " lorem ipsum dolor sit" {
		t.Errorf("streamed text %q", text)
	}
	final := decodeResponse(t, events[4])
	if len(final.Choices) != 0 || !strings.Contains(events[4], `"choices":[]`) {
		t.Errorf("usage chunk must have empty choices: %s", events[4])
	}
	if diff := cmp.Diff(usageOf(40, 4, 32), final.Usage); diff != "" {
		t.Errorf("usage (-want +got):\n%s", diff)
	}
}

func TestStreamIntervalGroupsTokensAfterTheFirst(t *testing.T) {
	const decode = 20 * time.Millisecond
	w := startWorker(t, Config{TimeScale: 1, DecodePerToken: decode, StreamInterval: 3})
	start := time.Now()
	status, _, body := postJSON(t, w.Endpoint()+"/v1/completions", map[string]any{"prompt": seqTokens(5, 20), "max_tokens": 8, "stream": true})
	elapsed := time.Since(start)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, body)
	}
	events := sseEvents(t, body)
	// Token 0 alone, then [1,4), [4,7), [7,8): four chunks, the usage chunk and [DONE].
	if len(events) != 6 || events[5] != "[DONE]" {
		t.Fatalf("got %d events %q, want 4 token chunks, a usage chunk and [DONE]", len(events), events)
	}
	wantText := []string{" lorem", " ipsum dolor sit", " amet lorem ipsum", " dolor"}
	for k, want := range wantText {
		c := decodeResponse(t, events[k])
		if c.Choices[0].Text == nil || *c.Choices[0].Text != want {
			t.Errorf("chunk %d = %s, want text %q", k, events[k], want)
		}
		if fin := c.Choices[0].FinishReason; (k == 3) != (fin != nil && *fin == "length") {
			t.Errorf("chunk %d finish_reason %v; only the last chunk carries \"length\"", k, fin)
		}
	}
	if u := decodeResponse(t, events[4]).Usage; u == nil || u.CompletionTokens != 8 {
		t.Errorf("usage chunk %s, want 8 completion tokens", events[4])
	}
	// Grouping changes only how tokens are sent, not when the last one is due: 7 decode steps.
	if elapsed < 7*decode {
		t.Errorf("stream ended after %v, before the last token was due (%v)", elapsed, 7*decode)
	}
}

func TestChatCompletions(t *testing.T) {
	w := startWorker(t, Config{TimeScale: 0.001})
	messages := []map[string]any{
		{"role": "system", "content": "You are terse."},
		{"role": "user", "content": []map[string]any{{"type": "text", "text": "hello there"}, {"type": "image_url"}}},
	}
	wantTokens := len(TokenizeText(RenderChat([]ChatMessage{{"system", "You are terse."}, {"user", "hello there"}})))

	t.Run("a non-streaming chat returns an assistant message and usage", func(t *testing.T) {
		status, _, body := postJSON(t, w.Endpoint()+"/v1/chat/completions", map[string]any{"messages": messages, "max_completion_tokens": 2, "max_tokens": 9})
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, body)
		}
		r := decodeResponse(t, string(body))
		if r.Object != "chat.completion" || !strings.HasPrefix(r.ID, "chatcmpl-") || len(r.Choices) != 1 || r.Choices[0].Message == nil ||
			r.Choices[0].Message.Role != "assistant" || r.Choices[0].Message.Content != " lorem ipsum" {
			t.Fatalf("response %s", body)
		}
		if diff := cmp.Diff(usageOf(wantTokens, 2, 0), r.Usage); diff != "" {
			t.Errorf("usage (-want +got):\n%s", diff)
		}
	})
	t.Run("a streaming chat sends the role first, content deltas, usage and [DONE]", func(t *testing.T) {
		status, _, body := postJSON(t, w.Endpoint()+"/v1/chat/completions", map[string]any{"messages": messages, "max_tokens": 2, "stream": true})
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, body)
		}
		events := sseEvents(t, body)
		if len(events) != 5 || events[4] != "[DONE]" {
			t.Fatalf("events %q", events)
		}
		first := decodeResponse(t, events[0])
		if first.Object != "chat.completion.chunk" || first.Choices[0].Delta == nil || first.Choices[0].Delta.Role != "assistant" {
			t.Errorf("first chunk %s", events[0])
		}
		for i, want := range []string{" lorem", " ipsum"} {
			c := decodeResponse(t, events[1+i])
			if d := c.Choices[0].Delta; d == nil || d.Content == nil || *d.Content != want || d.Role != "" {
				t.Errorf("content chunk %d = %s", i, events[1+i])
			}
		}
		if u := decodeResponse(t, events[3]).Usage; u == nil || u.PromptTokens != wantTokens || u.CompletionTokens != 2 {
			t.Errorf("usage chunk %s", events[3])
		}
	})
	t.Run("prompt_token_ids overrides the messages", func(t *testing.T) {
		status, _, body := postJSON(t, w.Endpoint()+"/v1/chat/completions", map[string]any{"messages": messages, "prompt_token_ids": seqTokens(0, 21), "max_tokens": 1})
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, body)
		}
		if u := decodeResponse(t, string(body)).Usage; u.PromptTokens != 21 {
			t.Errorf("prompt_tokens %d, want 21", u.PromptTokens)
		}
	})
}

func TestPromptForms(t *testing.T) {
	w := startWorker(t, Config{TimeScale: 0.001})
	tests := []struct {
		name       string
		body       map[string]any
		wantTokens int
	}{
		{"a text prompt is one token per whitespace-separated word", map[string]any{"prompt": "the quick  brown\tfox"}, 4},
		{"a one-element list of text is the same as the text", map[string]any{"prompt": []string{"a b c"}}, 3},
		{"a list of token ids is used as given", map[string]any{"prompt": []int{1, 2, 3, 4294967295}}, 4},
		{"a one-element list of token id lists is accepted", map[string]any{"prompt": [][]int{{7, 8}}}, 2},
		{"prompt_token_ids overrides a text prompt", map[string]any{"prompt": "ignored", "prompt_token_ids": []int{1, 2, 3}}, 3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.body["max_tokens"] = 1
			status, _, body := postJSON(t, w.Endpoint()+"/v1/completions", tc.body)
			if status != http.StatusOK {
				t.Fatalf("status %d: %s", status, body)
			}
			if u := decodeResponse(t, string(body)).Usage; u.PromptTokens != tc.wantTokens {
				t.Errorf("prompt_tokens %d, want %d", u.PromptTokens, tc.wantTokens)
			}
		})
	}
}

func TestHTTPErrors(t *testing.T) {
	w := startWorker(t, Config{Model: "m", TimeScale: 0.001})
	tests := []struct {
		name       string
		path       string
		body       string
		wantStatus int
		wantMsg    string
	}{
		{"malformed JSON is a bad request", "/v1/completions", `{"prompt":`, 400, "invalid JSON body"},
		{"a missing prompt is a bad request", "/v1/completions", `{"max_tokens":1}`, 400, "prompt is required"},
		{"an empty prompt is a bad request", "/v1/completions", `{"prompt":""}`, 400, "prompt has no tokens"},
		{"a negative token id is a bad request", "/v1/completions", `{"prompt":[1,-2]}`, 400, "prompt[1] = -2"},
		{"a token id above u32 is a bad request", "/v1/completions", `{"prompt":[4294967296]}`, 400, "prompt[0] = 4294967296"},
		{"a fractional token id is a bad request", "/v1/completions", `{"prompt":[1.5]}`, 400, "token ids must be integers"},
		{"batched prompts are rejected", "/v1/completions", `{"prompt":["a","b"]}`, 400, "batched prompts"},
		{"an object prompt is rejected", "/v1/completions", `{"prompt":{"a":1}}`, 400, "must be a string or an array"},
		{"max_tokens 0 is a bad request", "/v1/completions", `{"prompt":"a","max_tokens":0}`, 400, "max_tokens 0"},
		{"an unknown model is not found", "/v1/completions", `{"model":"other","prompt":"a"}`, 404, "`other` does not exist"},
		{"chat without messages is a bad request", "/v1/chat/completions", `{"messages":[]}`, 400, "messages must be a non-empty array"},
		{"chat content of the wrong type is a bad request", "/v1/chat/completions", `{"messages":[{"role":"user","content":5}]}`, 400, "messages[0].content"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := testClient.Post(w.Endpoint()+tc.path, "application/json", strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var e errorBody
			if err := json.NewDecoder(resp.Body).Decode(&e); err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != tc.wantStatus || e.Object != "error" || e.Code != tc.wantStatus || !strings.Contains(e.Message, tc.wantMsg) {
				t.Errorf("status %d body %+v; want %d with message containing %q", resp.StatusCode, e, tc.wantStatus, tc.wantMsg)
			}
		})
	}
	if st := w.Stats(); st.Requests != 0 || st.Canceled != 0 {
		t.Errorf("rejected requests were counted: %+v", st)
	}
	t.Run("GET on a generation endpoint is not allowed", func(t *testing.T) {
		resp, err := testClient.Get(w.Endpoint() + "/v1/completions")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusMethodNotAllowed {
			t.Errorf("status %d, want 405", resp.StatusCode)
		}
	})
	t.Run("health and models answer", func(t *testing.T) {
		resp, err := testClient.Get(w.Endpoint() + "/health")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("/health status %d", resp.StatusCode)
		}
		resp, err = testClient.Get(w.Endpoint() + "/v1/models")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var buf bytes.Buffer
		_, _ = buf.ReadFrom(resp.Body)
		if !strings.Contains(buf.String(), `"id":"m"`) {
			t.Errorf("/v1/models = %s", buf.String())
		}
	})
}

func TestTokenizeText(t *testing.T) {
	a := TokenizeText("Hello, world  hello")
	if len(a) != 3 || a[0] == a[2] {
		t.Fatalf("tokens %v: want 3, case-sensitive", a)
	}
	if b := TokenizeText(" Hello,\nworld\thello "); !cmp.Equal(a, b) {
		t.Errorf("whitespace must only separate tokens: %v vs %v", a, b)
	}
	for _, id := range a {
		if id >= TextVocabSize {
			t.Errorf("id %d outside the vocabulary", id)
		}
	}
	if got := TokenizeText(" \n\t"); len(got) != 0 {
		t.Errorf("whitespace-only text gave %v", got)
	}
	want := "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
	if got := RenderChat([]ChatMessage{{Role: "user", Content: "hi"}}); got != want {
		t.Errorf("RenderChat = %q, want %q", got, want)
	}
}

func BenchmarkCompletionRoundTrip(b *testing.B) {
	// A 512-token token-id prompt (32 blocks), mostly cached, 1 output token, no simulated delay.
	w := startWorker(b, Config{TimeScale: 0.001})
	body, err := json.Marshal(map[string]any{"prompt": seqTokens(0, 512), "max_tokens": 1})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		resp, err := testClient.Post(w.Endpoint()+"/v1/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		var buf bytes.Buffer
		_, _ = buf.ReadFrom(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("status %d: %s", resp.StatusCode, buf.String())
		}
	}
}

// TestContinuousUsageStatsReportTheTokensSoFar checks vLLM's stream_options.continuous_usage_stats:
// every token chunk carries usage with the completion tokens generated so far (with
// --stream-interval grouping), which lets a router count a running response's output exactly.
func TestContinuousUsageStatsReportTheTokensSoFar(t *testing.T) {
	w := startWorker(t, Config{TimeScale: 0.001, DecodePerToken: 1, StreamInterval: 3})
	status, _, body := postJSON(t, w.Endpoint()+"/v1/completions", map[string]any{"prompt": seqTokens(5, 20), "max_tokens": 8,
		"stream": true, "stream_options": map[string]any{"include_usage": true, "continuous_usage_stats": true}})
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, body)
	}
	events := sseEvents(t, body)
	if len(events) != 6 {
		t.Fatalf("got %d events %q, want 4 token chunks, a usage chunk and [DONE]", len(events), events)
	}
	for k, want := range []int{1, 4, 7, 8} {
		if u := decodeResponse(t, events[k]).Usage; u == nil || u.CompletionTokens != want || u.PromptTokens != 20 {
			t.Errorf("chunk %d = %s, want usage with 20 prompt and %d completion tokens", k, events[k], want)
		}
	}
}
