package extproc_test

import (
	"sync"
	"testing"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/extproc/tokenizer"
	"github.com/kvepp/kvepp/internal/sharedtest"
	"github.com/kvepp/kvepp/picker"
)

const qwenModel = "Qwen/Qwen3-0.6B"

var (
	qwenOnce sync.Once
	qwenTok  *tokenizer.Tokenizer
	qwenErr  error
)

// localTokenizers serves the shared Qwen3 tokenizer (epp.md §5.4 `local`) for every model, as the
// runner does with DYN_EPP_TOKENIZER_DIR.
type localTokenizers struct{ tok *tokenizer.Tokenizer }

func (l localTokenizers) ForModel(string) (extproc.RequestTokenizer, error) { return l.tok, nil }

func qwen3Tokenizers(t *testing.T) localTokenizers {
	t.Helper()
	dir := sharedtest.Qwen3TokenizerDir(t)
	qwenOnce.Do(func() { qwenTok, qwenErr = tokenizer.Load(dir) })
	if qwenErr != nil {
		t.Fatalf("tokenizer.Load(%s): %v", dir, qwenErr)
	}
	return localTokenizers{qwenTok}
}

// TestMalformedChatFieldsWithTheLocalTokenizerAre400 plays the fresh-user QA bodies through
// ext_proc with the in-process tokenizer: a chat field of the wrong type or shape, invalid tool-call
// arguments or a content part a text-only model cannot take is the client's error, 400
// invalid_request_error (epp.md §5.3, §8), not a 502 tokenizer_error; nothing is booked.
func TestMalformedChatFieldsWithTheLocalTokenizerAre400(t *testing.T) {
	const user = `{"role":"user","content":"hi"}`
	tests := []struct{ name, fields, wantInMsg string }{
		{"a number in messages", `"messages":[1]`, "messages[0]"},
		{"an empty message object", `"messages":[{}]`, "role"},
		{"a numeric role", `"messages":[{"role":5,"content":"hi"}]`, "role"},
		{"a numeric content", `"messages":[{"role":"user","content":5}]`, "content"},
		{"an object content", `"messages":[{"role":"user","content":{}}]`, "content"},
		{"tools that are not a list", `"messages":[` + user + `],"tools":"notalist"`, "tools"},
		{"chat_template_kwargs that are not an object", `"messages":[` + user + `],"chat_template_kwargs":"x"`, "chat_template_kwargs"},
		{"add_generation_prompt that is not a boolean", `"messages":[` + user + `],"add_generation_prompt":"yes"`, "add_generation_prompt"},
		{"an input_audio content part", `"messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"AA==","format":"wav"}}]}]`, "input_audio"},
		{"an image_url content part", `"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/y.png"}}]}]`, "image_url"},
	}
	newLocalHarness := func(t *testing.T) *harness {
		toks := qwen3Tokenizers(t)
		h := newHarness(t, func(c *extproc.Config) { c.Tokenizers = toks })
		h.pk.models = []string{qwenModel}
		h.pk.workers[qwenModel] = []picker.WorkerState{worker(7, qwenModel, "http://10.0.0.7:8000")}
		return h
	}
	for _, tc := range tests {
		t.Run(tc.name+" is a 400 invalid_request_error", func(t *testing.T) {
			h := newLocalHarness(t)
			ex := h.do(t, extproctest.Request{Body: []byte(`{"model":"` + qwenModel + `",` + tc.fields + `}`), Response: okResponse()})
			checkImmediate(t, ex, 400, "invalid_request_error", tc.wantInMsg)
			if selects, _, _, _, _ := h.pk.snapshot(); len(selects) != 0 {
				t.Fatalf("a rejected request reached the picker: %+v", selects)
			}
		})
	}
	t.Run("a well-formed chat body is still routed", func(t *testing.T) {
		h := newLocalHarness(t)
		ex := h.do(t, extproctest.Request{Body: []byte(`{"model":"` + qwenModel + `","messages":[` + user + `]}`), Response: okResponse()})
		if ex.Immediate != nil || ex.Destination != "10.0.0.7:8000" {
			t.Fatalf("immediate %+v, destination %q", ex.Immediate, ex.Destination)
		}
	})
}
