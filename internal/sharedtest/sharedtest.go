// Package sharedtest locates the repository root and the project's shared test data — golden
// vectors, the Qwen3 tokenizer and request traces in ../shared next to the repository root
// (contracts.md: shared data is read in place, never copied into the repo) — and decodes the
// golden files that several packages' tests read.
//
// Every helper takes the calling test (or benchmark) and fails it with a message naming the
// missing or malformed path instead of returning an error.
package sharedtest

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// RepoRoot returns the directory holding go.mod, found by walking up from the working directory
// (the package directory under `go test`). It fails t when no go.mod is found above it.
func RepoRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatalf("sharedtest: working directory: %v", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("sharedtest: go.mod not found above the test directory")
		}
		dir = parent
	}
}

// Path returns the path of elem inside the shared data directory, RepoRoot/../shared (Path(t)
// alone is that directory; Path(t, "golden", "hashes.json") a golden file). It fails t, naming
// the path, when the file or directory does not exist.
func Path(t testing.TB, elem ...string) string {
	t.Helper()
	p := filepath.Join(append([]string{RepoRoot(t), "..", "shared"}, elem...)...)
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("sharedtest: shared test data %s is missing (expected ../shared next to the repository root): %v", p, err)
	}
	return p
}

// DecodeJSON decodes the one JSON document in the shared file elem (see Path) into v. Numbers
// decoded into interface values become json.Number (Decoder.UseNumber), so 64-bit block and
// sequence hashes never pass through float64; typed uint64 fields are exact either way. It fails
// t, naming the file, when the file cannot be read, is not valid JSON for v, or holds more than
// one document.
func DecodeJSON(t testing.TB, v any, elem ...string) {
	t.Helper()
	p := Path(t, elem...)
	f, err := os.Open(p)
	if err != nil {
		t.Fatalf("sharedtest: %v", err)
	}
	defer f.Close()
	dec := json.NewDecoder(f)
	dec.UseNumber()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("sharedtest: decode %s: %v", p, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		t.Fatalf("sharedtest: %s holds data after its JSON document", p)
	}
}

// KVEventVector is one vector of golden/kv-events.json: a KV event batch as vLLM publishes it
// (kv-events-index.md §7), hex-encoded MessagePack.
type KVEventVector struct {
	Name string `json:"name"`
	Hex  string `json:"hex"`
}

// KVEventVectors returns the vectors of golden/kv-events.json in file order. It fails t when the
// file is missing, malformed or has no vectors.
func KVEventVectors(t testing.TB) []KVEventVector {
	t.Helper()
	return goldenVectors[KVEventVector](t, "kv-events.json")
}

// goldenVectors decodes the "vectors" array of golden/file, failing t when it is empty.
func goldenVectors[V any](t testing.TB, file string) []V {
	t.Helper()
	var doc struct {
		Vectors []V `json:"vectors"`
	}
	DecodeJSON(t, &doc, "golden", file)
	if len(doc.Vectors) == 0 {
		t.Fatalf("sharedtest: golden/%s has no vectors", file)
	}
	return doc.Vectors
}

// RequestVector is one vector of golden/qwen3-requests.json: an OpenAI-style request (path and
// raw body), the prompt the Qwen3 chat template renders for it, its token ids, and the block and
// sequence hashes of those tokens at BlockSize tokens per block (kv-events-index.md §1-§3).
type RequestVector struct {
	Name           string          `json:"name"`
	Path           string          `json:"path"`
	Body           json.RawMessage `json:"body"`
	RenderedPrompt string          `json:"rendered_prompt"`
	TokenIDs       []uint32        `json:"token_ids"`
	BlockSize      int             `json:"block_size"`
	BlockHashes    []uint64        `json:"block_hashes"`
	SequenceHashes []uint64        `json:"sequence_hashes"`
}

// RequestVectors returns the vectors of golden/qwen3-requests.json in file order. It fails t
// when the file is missing, malformed or has no vectors.
func RequestVectors(t testing.TB) []RequestVector {
	t.Helper()
	return goldenVectors[RequestVector](t, "qwen3-requests.json")
}

// RequestVectorNamed returns the vector of golden/qwen3-requests.json called name (for example
// "chat-long"). It fails t when there is none.
func RequestVectorNamed(t testing.TB, name string) RequestVector {
	t.Helper()
	for _, v := range RequestVectors(t) {
		if v.Name == name {
			return v
		}
	}
	t.Fatalf("sharedtest: golden vector %q not found in golden/qwen3-requests.json", name)
	return RequestVector{}
}

// Qwen3TokenizerDir returns the shared Qwen3 tokenizer directory (models/qwen3: tokenizer.json
// and tokenizer_config.json). It fails t when the directory is missing.
func Qwen3TokenizerDir(t testing.TB) string {
	t.Helper()
	return Path(t, "models", "qwen3")
}
