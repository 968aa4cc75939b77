package extproc_test

import (
	"bytes"
	"fmt"
	"runtime"
	"testing"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
)

// TestUsageParserLeadingWhitespaceIsNotBuffered feeds 8 MiB of whitespace before the body in
// 1 MiB chunks: the parser allocates (far) less than one chunk for it — it counts the whitespace
// instead of keeping it — and still decides streaming from the first non-whitespace bytes, and
// counts the whitespace toward the 1 MiB a non-streaming body may have (epp.md §6.4).
func TestUsageParserLeadingWhitespaceIsNotBuffered(t *testing.T) {
	ws := bytes.Repeat([]byte(" \r\n\t"), 1<<18) // 1 MiB
	feed := func(p *extproc.UsageParser, n int) uint64 {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		for range n {
			p.Write(ws)
		}
		runtime.ReadMemStats(&after)
		return after.TotalAlloc - before.TotalAlloc
	}
	p := extproc.NewUsageParser("application/json", false)
	if got := feed(p, 8); got > 64<<10 {
		t.Fatalf("8 MiB of leading whitespace allocated %d bytes, want < 64 KiB", got)
	}
	p.Write([]byte("dat"))
	p.Write([]byte("a: {\"usage\":{\"prompt_tokens\":5}}\n\n"))
	if u := p.Finish(); u.PromptTokens == nil || *u.PromptTokens != 5 {
		t.Fatalf("SSE after 8 MiB of whitespace: %+v", u)
	}

	body := []byte(`{"usage":{"completion_tokens":7}}`)
	small := extproc.NewUsageParser("application/json", false)
	small.Write(ws[:1000])
	small.Write(body)
	if u := small.Finish(); u.CompletionTokens == nil || *u.CompletionTokens != 7 {
		t.Fatalf("JSON after 1000 bytes of whitespace: %+v", u)
	}
	long := extproc.NewUsageParser("application/json", false)
	feed(long, 1)
	long.Write(body)
	if u := long.Finish(); u.CompletionTokens != nil {
		t.Fatalf("a body longer than MaxUsageBufferBytes (with its whitespace) was parsed: %+v", u)
	}
}

// TestUsageParserLineEndingsAndBOM checks the SSE line endings CRLF, LF and a lone CR (WHATWG
// HTML §9.2.6), a CRLF split between chunks (one line end, not an extra blank line), and a leading
// UTF-8 byte order mark, whole or split, before an SSE or a JSON body.
func TestUsageParserLineEndingsAndBOM(t *testing.T) {
	cases := []struct {
		name, contentType string
		chunks            []string
	}{
		{"CR-only line endings", "text/event-stream", []string{"data: {\"usage\":\rdata: {\"prompt_tokens\":8}}\r\rdata: [DONE]\r\r"}},
		{"CR-only, split after the CR", "text/event-stream", []string{"data: {\"usage\":{\"prompt_tokens\":8}}\r", "\r"}},
		{"CRLF split between CR and LF is one line end", "text/event-stream", []string{"data: {\"usage\":\r", "\ndata: {\"prompt_tokens\":8}}\r\n\r\n"}},
		{"BOM before SSE detected from the body", "application/json", []string{"\xef\xbb\xbfdata: {\"usage\":{\"prompt_tokens\":8}}\n\n"}},
		{"BOM split across chunks before SSE", "text/event-stream", []string{"\xef", "\xbb", "\xbfdata: {\"usage\":{\"prompt_tokens\":8}}\n\n"}},
		{"BOM before a JSON body", "application/json", []string{"\xef\xbb\xbf", `{"usage":{"prompt_tokens":8}}`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := extproc.NewUsageParser(tc.contentType, false)
			for _, c := range tc.chunks {
				p.Write([]byte(c))
			}
			if u := p.Finish(); u.PromptTokens == nil || *u.PromptTokens != 8 {
				t.Fatalf("usage %+v, want prompt_tokens 8", u)
			}
		})
	}
}

// TestStreamedOutputTokensAfterEarlyUsage checks that usage reported early (even 0) does not stop
// the count from the events after it, and that the Responses API's final usage (under "response")
// is read as the exact count.
func TestStreamedOutputTokensAfterEarlyUsage(t *testing.T) {
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}`)
	tok := `{"choices":[{"delta":{"content":"ab"}}]}`
	cases := []struct {
		name   string
		chunks [][]byte
		want   []uint64
	}{
		{"usage 0 in the role chunk, then text events", [][]byte{
			sse(`{"choices":[{"delta":{"role":"assistant"}}],"usage":{"completion_tokens":0}}`),
			sse(tok, tok, tok), sse(tok, tok),
		}, []uint64{3, 5}},
		{"usage once, then text events add to it", [][]byte{
			sse(`{"choices":[{"delta":{"content":"a"}}],"usage":{"completion_tokens":10}}`),
			sse(tok, tok),
		}, []uint64{10, 12}},
		{"Responses API response.completed usage is exact", [][]byte{
			sse(`{"type":"response.output_text.delta","delta":"Hello"}`),
			sse(`{"type":"response.completed","response":{"usage":{"input_tokens":3,"output_tokens":9}}}`),
		}, []uint64{2, 9}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h, tp := newTrackingHarness(t, true)
			h.do(t, extproctest.Request{Body: chat, Response: &extproctest.Response{ContentType: "text/event-stream", Chunks: tc.chunks}})
			h.pk.waitSettled(t)
			got, _ := tp.reported()
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("reported totals %v, want %v", got, tc.want)
			}
		})
	}
}
