package tokenizer

import (
	"os"
	"path/filepath"
	"testing"
)

// TestMaxModelLenFollowsVLLM checks max_model_len as vLLM derives it: the smallest context
// length config.json names (max_position_embeddings, n_positions, …; text_config's for multimodal
// models), capped by tokenizer_config.json's model_max_length, transformers' "no limit"
// placeholder (1e30) ignored, and 2048 — vLLM's assumption — when neither file names a length.
func TestMaxModelLenFollowsVLLM(t *testing.T) {
	tj, err := os.ReadFile(filepath.Join("testdata", "sp-layouts", "llama-legacy.json"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, tokenizerConfig, config string // config "" = no config.json
		want                          int
		defaulted                     bool
	}{
		{"the 1e30 placeholder without config.json is vLLM's 2048", `{"model_max_length":1000000000000000019884624838656}`, "", 2048, true},
		{"no length anywhere is 2048", `{}`, "", 2048, true},
		{"config.json without a length key is 2048", `{}`, `{"hidden_size":8}`, 2048, true},
		{"a real model_max_length without config.json is used", `{"model_max_length":4096}`, "", 4096, false},
		{"config.json's max_position_embeddings with the placeholder", `{"model_max_length":1e30}`, `{"max_position_embeddings":4096}`, 4096, false},
		{"the smaller of config.json and model_max_length", `{"model_max_length":32768}`, `{"max_position_embeddings":131072}`, 32768, false},
		{"config.json below model_max_length", `{"model_max_length":131072}`, `{"max_position_embeddings":40960}`, 40960, false},
		{"GPT-2's n_positions", `{}`, `{"n_positions":1024}`, 1024, false},
		{"the smallest of several keys", `{}`, `{"max_position_embeddings":8192,"seq_length":4096}`, 4096, false},
		{"text_config of a multimodal config", `{}`, `{"text_config":{"max_position_embeddings":131072},"vision_config":{"max_position_embeddings":1}}`, 131072, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			write := func(name, data string) {
				if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			write("tokenizer.json", string(tj))
			write("tokenizer_config.json", tc.tokenizerConfig)
			if tc.config != "" {
				write("config.json", tc.config)
			}
			tk, err := Load(dir)
			if err != nil {
				t.Fatal(err)
			}
			if got := tk.MaxModelLen(); got != tc.want || tk.MaxModelLenDefaulted() != tc.defaulted {
				t.Fatalf("MaxModelLen = %d (defaulted %v), want %d (defaulted %v)", got, tk.MaxModelLenDefaulted(), tc.want, tc.defaulted)
			}
		})
	}
	t.Run("Llama 2's fetched files (no config.json)", func(t *testing.T) {
		if got := realModel(t, "llama2").MaxModelLen(); got != DefaultMaxModelLen {
			t.Fatalf("MaxModelLen = %d, want %d", got, DefaultMaxModelLen)
		}
	})
}
