package tokenizer

import (
	"encoding/json"
	"testing"
	"unicode/utf8"
)

// FuzzEncode checks that Encode never panics and that, for valid UTF-8, decoding the ids gives
// back the input with NFC applied between added tokens (tokenizer.md steps 2-3), byte for byte.
// Seed corpus: testdata/fuzz/FuzzEncode.
func FuzzEncode(f *testing.F) {
	tk := qwen3(f)
	for _, s := range []string{"", "Hello, world!", "a<|im_end|>\u0338", "cafe\u0301 \u3000x", "  \r\n\t 123 🚀", "x'S 'll"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		ids := tk.Encode(s, true)
		if !utf8.ValidString(s) {
			return
		}
		if got, want := mustDecode(t, tk, ids), nfcBetweenAdded(tk, s); got != want {
			t.Fatalf("Decode(Encode(%q)) = %q, want %q", s, got, want)
		}
	})
}

// FuzzRequests checks that the request-level API never panics on arbitrary bodies and that
// every failure on a body that is not a JSON object is a bad request.
func FuzzRequests(f *testing.F) {
	tk := qwen3(f)
	for _, s := range []string{
		`{"messages":[{"role":"user","content":"hi"}]}`,
		`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f","arguments":"{\"a\":1.0}"}}]}],"tools":[{"type":"function","function":{"name":"f","parameters":{"x":1e400}}}]}`,
		`{"prompt":[[1,2],[3]]}`, `{"input":[{"role":"user","content":[{"type":"input_text","text":"x"}]}],"instructions":"s"}`,
		`[`, `{"messages":"x"}`, `{"prompt":"\ud800"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		_, err1 := tk.TokenizeChat(body)
		_, err2 := tk.TokenizeCompletion(body)
		_, err3 := tk.TokenizeResponses(body)
		if !json.Valid(body) {
			for _, err := range []error{err1, err2, err3} {
				if err == nil {
					t.Fatalf("invalid JSON %q accepted", body)
				}
			}
		}
	})
}
