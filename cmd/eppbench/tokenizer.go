package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// writeStubTokenizer writes a minimal byte-level BPE tokenizer.json (256 byte tokens, no merges)
// and an empty tokenizer_config.json into dir and returns dir.
//
// kvepp refuses to start in KV-event mode without a local tokenizer (epp.md §2: "none" is only
// allowed with approximate indexing), but the benchmark sends /v1/completions requests whose
// prompt is a list of token ids, which kvepp hashes as given without calling any tokenizer
// (epp.md §5.4, "completion, token prompt: no call"). The stub satisfies the startup check in
// milliseconds instead of loading an 11 MB vocabulary that would never be used; --tokenizer-dir
// replaces it with a real one.
func writeStubTokenizer(dir string) (string, error) {
	vocab := make(map[string]int, 256)
	for b, r := range byteLevelAlphabet() {
		vocab[string(r)] = b
	}
	doc := map[string]any{
		"version":        "1.0",
		"truncation":     nil,
		"padding":        nil,
		"added_tokens":   []any{},
		"normalizer":     nil,
		"pre_tokenizer":  map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
		"post_processor": nil,
		"decoder":        map[string]any{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
		"model": map[string]any{
			"type": "BPE", "dropout": nil, "unk_token": nil, "continuing_subword_prefix": nil,
			"end_of_word_suffix": nil, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
			"vocab": vocab, "merges": []any{},
		},
	}
	data, err := json.Marshal(doc)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("create tokenizer dir %q: %w", dir, err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), data, 0o644); err != nil {
		return "", fmt.Errorf("write stub tokenizer: %w", err)
	}
	// No chat template: chat requests would be refused, and the benchmark sends none.
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte("{}\n"), 0o644); err != nil {
		return "", fmt.Errorf("write stub tokenizer config: %w", err)
	}
	return dir, nil
}

// byteLevelAlphabet is GPT-2's byte-to-unicode table: printable bytes map to themselves, the
// others to U+0100 upwards, in byte order.
func byteLevelAlphabet() [256]rune {
	var out [256]rune
	n := 0
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			out[b] = rune(b)
		} else {
			out[b] = rune(256 + n)
			n++
		}
	}
	return out
}
