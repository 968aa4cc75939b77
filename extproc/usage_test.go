package extproc_test

import (
	"bytes"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/extproc"
)

func u64(v uint64) *uint64 { return &v }

// parseAll feeds chunks and finishes.
func parseAll(contentType string, reqStream bool, chunks ...[]byte) extproc.Usage {
	p := extproc.NewUsageParser(contentType, reqStream)
	for _, c := range chunks {
		p.Write(c)
	}
	return p.Finish()
}

func TestUsageParser(t *testing.T) {
	cases := []struct {
		name        string
		contentType string
		reqStream   bool
		body        string
		want        extproc.Usage
	}{
		{"row 2: prompt_tokens_details.cached_tokens is read", "application/json", false,
			`{"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":64}}}`,
			extproc.Usage{PromptTokens: u64(100), PromptCachedTokens: u64(64)}},
		{"row 4: usage over two SSE events is merged", "text/event-stream", false,
			"data: {\"usage\":{\"prompt_tokens\":100}}\n\ndata: {\"usage\":{\"completion_tokens\":20,\"total_tokens\":120}}\n\ndata: [DONE]\n\n",
			extproc.Usage{PromptTokens: u64(100), CompletionTokens: u64(20), TotalTokens: u64(120)}},
		{"a later event overrides only the fields it carries", "text/event-stream", false,
			"data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\ndata: {\"usage\":{\"completion_tokens\":9}}\n\n",
			extproc.Usage{PromptTokens: u64(1), CompletionTokens: u64(9)}},
		{"Responses API usage under response.usage is read", "text/event-stream", false,
			"event: response.completed\r\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":12,\"output_tokens\":3,\"input_tokens_details\":{\"cached_tokens\":8}}}}\r\n\r\n",
			extproc.Usage{InputTokens: u64(12), OutputTokens: u64(3), InputCachedTokens: u64(8)}},
		{"non-integral, negative and non-number values are ignored", "application/json", false,
			`{"usage":{"prompt_tokens":"100","completion_tokens":1.5,"total_tokens":-1,"input_tokens":{},"output_tokens":[1],"prompt_tokens_details":{"cached_tokens":true}}}`,
			extproc.Usage{}},
		{"an integral float value counts", "application/json", false,
			`{"usage":{"prompt_tokens":100.0,"completion_tokens":2e1}}`,
			extproc.Usage{PromptTokens: u64(100), CompletionTokens: u64(20)}},
		{"streaming is detected from a leading data: line", "application/json", false,
			"\r\n\ndata: {\"usage\":{\"prompt_tokens\":5}}\n\n",
			extproc.Usage{PromptTokens: u64(5)}},
		{"streaming is assumed when the request set stream true", "", true,
			"data: {\"usage\":{\"prompt_tokens\":6}}",
			extproc.Usage{PromptTokens: u64(6)}},
		{"a pending event without a blank line is flushed at the end", "text/event-stream", false,
			"data: {\"usage\":{\"prompt_tokens\":7}}\n",
			extproc.Usage{PromptTokens: u64(7)}},
		{"multi-line data fields join with a newline", "text/event-stream", false,
			"data: {\"usage\":\ndata: {\"prompt_tokens\":8}}\n\n",
			extproc.Usage{PromptTokens: u64(8)}},
		{"a malformed event is skipped and later events still count", "text/event-stream", false,
			"data: {\"usage\": nope}\n\ndata: {\"usage\":{\"prompt_tokens\":9}}\n\n",
			extproc.Usage{PromptTokens: u64(9)}},
		{"a non-JSON body yields nothing", "application/json", false, "<html>", extproc.Usage{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := parseAll(tc.contentType, tc.reqStream, []byte(tc.body))
			if d := cmp.Diff(tc.want, got); d != "" {
				t.Fatalf("usage (-want +got):\n%s", d)
			}
			// Every split point, and byte-by-byte, must parse exactly as unsplit.
			for i := 0; i <= len(tc.body); i++ {
				got := parseAll(tc.contentType, tc.reqStream, []byte(tc.body[:i]), []byte(tc.body[i:]))
				if d := cmp.Diff(tc.want, got); d != "" {
					t.Fatalf("split at %d (-want +got):\n%s", i, d)
				}
			}
			var bytesOne [][]byte
			for i := range len(tc.body) {
				bytesOne = append(bytesOne, []byte{tc.body[i]})
			}
			if d := cmp.Diff(tc.want, parseAll(tc.contentType, tc.reqStream, bytesOne...)); d != "" {
				t.Fatalf("byte by byte (-want +got):\n%s", d)
			}
		})
	}
}

func TestUsageParserDoneInItsOwnChunk(t *testing.T) {
	got := parseAll("text/event-stream", false,
		[]byte("data: {\"usage\":{\"prompt_tokens\":3}}\n"), []byte("\n"), []byte("data: [DONE]\n\n"))
	if got.PromptTokens == nil || *got.PromptTokens != 3 {
		t.Fatalf("usage = %+v", got)
	}
}

func TestUsageParserBoundsItsMemory(t *testing.T) {
	t.Run("an oversize SSE event is discarded and the next one parsed", func(t *testing.T) {
		big := "data: {\"usage\":{\"prompt_tokens\":1},\"pad\":\"" + strings.Repeat("x", extproc.MaxUsageBufferBytes) + "\"}\n\n"
		small := "data: {\"usage\":{\"completion_tokens\":2}}\n\n"
		p := extproc.NewUsageParser("text/event-stream", false)
		for c := range slicesChunk([]byte(big+small), 4096) {
			p.Write(c)
		}
		got := p.Finish()
		if got.PromptTokens != nil || got.CompletionTokens == nil || *got.CompletionTokens != 2 {
			t.Fatalf("usage = %+v", got)
		}
	})
	t.Run("a non-streaming body over the cap is not parsed", func(t *testing.T) {
		body := `{"usage":{"prompt_tokens":1},"pad":"` + strings.Repeat("x", extproc.MaxUsageBufferBytes) + `"}`
		if got := parseAll("application/json", false, []byte(body)); got.PromptTokens != nil {
			t.Fatalf("usage = %+v", got)
		}
	})
}

// slicesChunk yields b in pieces of n bytes.
func slicesChunk(b []byte, n int) func(func([]byte) bool) {
	return func(yield func([]byte) bool) {
		for len(b) > 0 {
			k := min(n, len(b))
			if !yield(bytes.Clone(b[:k])) {
				return
			}
			b = b[k:]
		}
	}
}

func BenchmarkUsageParserSSE(b *testing.B) {
	chunk := []byte("data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hello\"}}]}\n\n")
	last := []byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":200}}\n\ndata: [DONE]\n\n")
	b.ReportAllocs()
	for b.Loop() {
		p := extproc.NewUsageParser("text/event-stream", true)
		for range 200 {
			p.Write(chunk)
		}
		p.Write(last)
		if u := p.Finish(); u.CompletionTokens == nil {
			b.Fatal("no usage")
		}
	}
}
