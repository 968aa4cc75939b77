package tokenizer

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestTokenizerClassRewritesThePostProcessor checks transformers' update_post_processor per
// tokenizer class on the synthetic Llama-legacy layout, whose tokenizer.json adds BOS <s> (id 1).
func TestTokenizerClassRewritesThePostProcessor(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("testdata", "sp-layouts", "llama-legacy.json"))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, config string
		want         []uint32 // ids of "hi" with special tokens, around the plain ids
		err          string
	}{
		{"a Llama class with add_bos_token false drops the file's BOS", `{"tokenizer_class":"LlamaTokenizerFast","add_bos_token":false,"bos_token":"<s>"}`, nil, ""},
		{"a Llama class with add_eos_token adds EOS", `{"tokenizer_class":"LlamaTokenizer","add_eos_token":true,"bos_token":"<s>","eos_token":{"content":"</s>"}}`, []uint32{1, 0, 2}, ""},
		{"a Gemma class without flags takes the class defaults (BOS only)", `{"tokenizer_class":"GemmaTokenizer","bos_token":"<s>"}`, []uint32{1, 0}, ""},
		{"GPTNeoX defaults to nothing", `{"tokenizer_class":"GPTNeoXTokenizerFast","bos_token":"<s>"}`, nil, ""},
		{"another class keeps tokenizer.json's post-processor", `{"tokenizer_class":"PreTrainedTokenizerFast","add_bos_token":false}`, []uint32{1, 0}, ""},
		{"add_bos_token without a bos_token is an error", `{"tokenizer_class":"LlamaTokenizerFast","add_bos_token":true}`, nil, "bos_token is not set"},
		{"a bos_token outside the vocabulary is an error", `{"tokenizer_class":"LlamaTokenizerFast","bos_token":"<nope>"}`, nil, "not in the vocabulary"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tk, err := parseTokenizerJSON(data)
			if err != nil {
				t.Fatal(err)
			}
			err = tk.applyConfig([]byte(tc.config))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			plain := tk.Encode("hi", false)
			var want []uint32
			for _, id := range tc.want {
				if id == 0 {
					want = append(want, plain...)
				} else {
					want = append(want, id)
				}
			}
			if tc.want == nil {
				want = plain
			}
			if got := tk.Encode("hi", true); !cmp.Equal(got, want) {
				t.Fatalf("Encode(\"hi\", true) = %v, want %v", got, want)
			}
		})
	}
}
