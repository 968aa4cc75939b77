package tokenizer

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
)

// DefaultMaxModelLen is the context length in tokens vLLM assumes for a model whose config names
// none (and kvepp, when neither config.json nor tokenizer_config.json names one).
const DefaultMaxModelLen = 2048

// MaxModelLen returns the context length vLLM would report as max_model_len, in tokens, by
// vLLM's rule: the smallest length config.json names (maxLengthKeys, read from text_config for a
// multimodal config), capped by tokenizer_config.json's model_max_length (transformers' 1e30 "no
// limit" placeholder ignored); DefaultMaxModelLen when neither names one (Llama 2's tokenizer
// files without config.json: MaxModelLenDefaulted). vLLM may lower it with --max-model-len;
// kvepp cannot see that.
func (t *Tokenizer) MaxModelLen() int {
	n := t.maxPositions
	if t.modelMaxLength > 0 && (n == 0 || t.modelMaxLength < n) {
		n = t.modelMaxLength
	}
	if n == 0 {
		return DefaultMaxModelLen
	}
	return n
}

// MaxModelLenDefaulted reports that MaxModelLen is DefaultMaxModelLen because no file named a
// context length (the tokenizer directory lacks config.json, say).
func (t *Tokenizer) MaxModelLenDefaulted() bool { return t.maxPositions == 0 && t.modelMaxLength == 0 }

// maxLengthKeys are the config.json keys vLLM reads a model's context length from; the smallest
// present wins.
var maxLengthKeys = []string{"max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length", "max_seq_length", "seq_len"}

// readMaxPositions reads the context length in tokens from dir/config.json (0 when absent): the
// smallest of maxLengthKeys in text_config when that names one, else at the top level.
func readMaxPositions(dir string) int {
	data, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		return 0
	}
	var top map[string]json.RawMessage
	if json.Unmarshal(data, &top) != nil {
		return 0
	}
	var text map[string]json.RawMessage
	if raw, ok := top["text_config"]; ok && json.Unmarshal(raw, &text) == nil {
		if n := smallestLength(text); n > 0 {
			return n
		}
	}
	return smallestLength(top)
}

// smallestLength is the smallest whole positive length (below 1e9) among cfg's maxLengthKeys, 0
// for none.
func smallestLength(cfg map[string]json.RawMessage) int {
	best := 0
	for _, k := range maxLengthKeys {
		raw, ok := cfg[k]
		var v float64
		if !ok || json.Unmarshal(raw, &v) != nil || v < 1 || v >= 1e9 || v != math.Trunc(v) {
			continue
		}
		if best == 0 || int(v) < best {
			best = int(v)
		}
	}
	return best
}
