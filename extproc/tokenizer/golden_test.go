package tokenizer

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/internal/sharedtest"
)

// TestGoldenQwen3Requests checks every vector of shared/golden/qwen3-requests.json: rendered
// prompt, token ids, block hashes and sequence hashes at the vector's block size.
func TestGoldenQwen3Requests(t *testing.T) {
	tk := qwen3(t)
	for _, v := range sharedtest.RequestVectors(t) {
		t.Run(v.Name+" reproduces the reference prompt, tokens and hashes", func(t *testing.T) {
			var ids []uint32
			var err error
			switch {
			case strings.HasSuffix(v.Path, "/chat/completions"):
				prompt, err := tk.RenderChat(v.Body)
				if err != nil {
					t.Fatalf("RenderChat: %v", err)
				}
				if diff := cmp.Diff(v.RenderedPrompt, prompt); diff != "" {
					t.Fatalf("rendered prompt differs (-want +got):\n%s", diff)
				}
				ids, err = tk.TokenizeChat(v.Body)
			case strings.HasSuffix(v.Path, "/completions"):
				ids, err = tk.TokenizeCompletion(v.Body)
				if got := tk.Encode(v.RenderedPrompt, true); !cmp.Equal(got, v.TokenIDs) {
					t.Errorf("Encode(rendered_prompt) differs from token_ids")
				}
			case strings.HasSuffix(v.Path, "/responses"):
				ids, err = tk.TokenizeResponses(v.Body)
			default:
				t.Fatalf("unknown path %q", v.Path)
			}
			if err != nil {
				t.Fatalf("tokenize: %v", err)
			}
			if diff := cmp.Diff(v.TokenIDs, ids); diff != "" {
				t.Fatalf("token ids differ (-want +got):\n%s", diff)
			}
			bh := blockHashes(ids, v.BlockSize)
			if diff := cmp.Diff(v.BlockHashes, bh, cmp.Comparer(func(a, b []uint64) bool {
				return len(a) == len(b) && (len(a) == 0 || cmp.Equal(a, b))
			})); diff != "" {
				t.Fatalf("block hashes differ (-want +got):\n%s", diff)
			}
			sh := sequenceHashes(bh)
			if len(sh) != len(v.SequenceHashes) || (len(sh) > 0 && !cmp.Equal(sh, v.SequenceHashes)) {
				t.Fatalf("sequence hashes differ: want %v, got %v", v.SequenceHashes, sh)
			}
			if got := mustDecode(t, tk, ids); got != v.RenderedPrompt {
				t.Errorf("Decode(token ids) = %q, want the rendered prompt", got)
			}
		})
	}
}
