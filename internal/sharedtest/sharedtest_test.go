package sharedtest_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/internal/helpertest"
	"github.com/kvepp/kvepp/internal/sharedtest"
)

// failure runs fn and returns the message it failed the test with ("" if it did not fail).
func failure(t *testing.T, fn func(tb testing.TB)) string {
	return strings.Join(helpertest.Failures(t, fn), "\n")
}

func TestRepoRootAndPath(t *testing.T) {
	t.Run("the repository root is the directory whose go.mod declares the module", func(t *testing.T) {
		mod, err := os.ReadFile(filepath.Join(sharedtest.RepoRoot(t), "go.mod"))
		if err != nil || !strings.HasPrefix(string(mod), "module github.com/kvepp/kvepp\n") {
			t.Fatalf("go.mod at the root: %v %.40q", err, mod)
		}
	})
	t.Run("a shared path is ../shared next to the repository root", func(t *testing.T) {
		want := filepath.Join(sharedtest.RepoRoot(t), "..", "shared", "golden", "hashes.json")
		if got := sharedtest.Path(t, "golden", "hashes.json"); got != want {
			t.Fatalf("Path = %s, want %s", got, want)
		}
		if fi, err := os.Stat(sharedtest.Qwen3TokenizerDir(t)); err != nil || !fi.IsDir() {
			t.Fatalf("tokenizer dir: %v", err)
		}
	})
	t.Run("a missing shared file fails the test naming the path", func(t *testing.T) {
		msg := failure(t, func(tb testing.TB) { sharedtest.Path(tb, "golden", "no-such-file.json") })
		if !strings.Contains(msg, filepath.Join("shared", "golden", "no-such-file.json")) || !strings.Contains(msg, "missing") {
			t.Fatalf("failure message %q", msg)
		}
	})
}

func TestDecodeJSON(t *testing.T) {
	t.Run("a 64-bit hash decoded into an interface value keeps every digit", func(t *testing.T) {
		var typed struct {
			Vectors []struct {
				BlockHashes []uint64 `json:"block_hashes"`
			} `json:"vectors"`
		}
		var loose struct {
			Vectors []struct {
				BlockHashes []any `json:"block_hashes"`
			} `json:"vectors"`
		}
		sharedtest.DecodeJSON(t, &typed, "golden", "hashes.json")
		sharedtest.DecodeJSON(t, &loose, "golden", "hashes.json")
		checked := 0
		for i, v := range typed.Vectors {
			for j, h := range v.BlockHashes {
				n, ok := loose.Vectors[i].BlockHashes[j].(json.Number)
				if !ok || n.String() != fmt.Sprint(h) {
					t.Fatalf("vector %d block %d: %#v, want json.Number %d", i, j, loose.Vectors[i].BlockHashes[j], h)
				}
				if h > 1<<53 {
					checked++
				}
			}
		}
		if checked == 0 {
			t.Fatal("no hash above 2^53 in hashes.json: the test proves nothing")
		}
	})
	t.Run("a file that is not valid JSON for the value fails the test naming the file", func(t *testing.T) {
		msg := failure(t, func(tb testing.TB) {
			var s string
			sharedtest.DecodeJSON(tb, &s, "golden", "kv-events.json")
		})
		if !strings.Contains(msg, "decode") || !strings.Contains(msg, "kv-events.json") {
			t.Fatalf("failure message %q", msg)
		}
	})
}

func TestGoldenVectors(t *testing.T) {
	t.Run("kv-events.json vectors have names and hex payloads", func(t *testing.T) {
		for _, v := range sharedtest.KVEventVectors(t) {
			if v.Name == "" || v.Hex == "" {
				t.Fatalf("vector %+v", v)
			}
		}
	})
	t.Run("the chat-long request vector has its tokens and hashes at block size 16", func(t *testing.T) {
		v := sharedtest.RequestVectorNamed(t, "chat-long")
		if v.BlockSize != 16 || !strings.HasSuffix(v.Path, "/chat/completions") || len(v.Body) == 0 ||
			len(v.BlockHashes) != len(v.TokenIDs)/16 || len(v.SequenceHashes) != len(v.BlockHashes) {
			t.Fatalf("chat-long: block size %d path %q, %d tokens, %d block and %d sequence hashes",
				v.BlockSize, v.Path, len(v.TokenIDs), len(v.BlockHashes), len(v.SequenceHashes))
		}
	})
	t.Run("an unknown request vector name fails the test naming it", func(t *testing.T) {
		msg := failure(t, func(tb testing.TB) { sharedtest.RequestVectorNamed(tb, "no-such-vector") })
		if !strings.Contains(msg, `"no-such-vector" not found`) {
			t.Fatalf("failure message %q", msg)
		}
	})
}
