package tokenizer

import (
	"encoding/json"
	"fmt"
	"math"
	"strings"
)

// What the engine adds beyond tokenizer.json (epp.md §5.4 `local`): vLLM loads tokenizers through
// transformers, whose tokenizer class may rewrite the post-processor from tokenizer_config.json.

// postProcessorClasses are the transformers fast tokenizer classes whose __init__ calls
// update_post_processor(): the post-processor becomes TemplateProcessing
// "[bos:0 ]$A:0[ eos:0]" from add_bos_token / add_eos_token (absent flags take the class
// defaults given here), replacing whatever tokenizer.json declares. Other classes
// (PreTrainedTokenizerFast, Qwen2TokenizerFast, …) use tokenizer.json's post-processor as is.
var postProcessorClasses = map[string]struct{ addBOS, addEOS bool }{
	"LlamaTokenizer":     {true, false},
	"CodeLlamaTokenizer": {true, false},
	"GemmaTokenizer":     {true, false},
	"CohereTokenizer":    {true, false},
	"GPTNeoXTokenizer":   {false, false},
}

// tokenizerConfig is the part of tokenizer_config.json the encoder needs.
type tokenizerConfig struct {
	TokenizerClass           string          `json:"tokenizer_class"`
	AddBOSToken              *bool           `json:"add_bos_token"`
	AddEOSToken              *bool           `json:"add_eos_token"`
	BOSToken                 json.RawMessage `json:"bos_token"`
	EOSToken                 json.RawMessage `json:"eos_token"`
	CleanUpTokenizationSpace *bool           `json:"clean_up_tokenization_spaces"`
	ModelMaxLength           *float64        `json:"model_max_length"`
}

// tokenContent reads a special token given as a string or as {"content": …} (AddedToken).
func tokenContent(raw json.RawMessage) (string, bool, error) {
	if isNull(raw) {
		return "", false, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, true, nil
	}
	var obj struct {
		Content *string `json:"content"`
	}
	if err := json.Unmarshal(raw, &obj); err != nil || obj.Content == nil {
		return "", false, fmt.Errorf("want a string or {\"content\": …}, got %s", truncate(string(raw), 80))
	}
	return *obj.Content, true, nil
}

// applyConfig applies tokenizer_config.json to a tokenizer parsed from tokenizer.json: the
// class's post-processor rewrite (postProcessorClasses), clean_up_tokenization_spaces for
// decoding, and model_max_length. Errors name the field.
func (t *Tokenizer) applyConfig(data []byte) error {
	if data == nil {
		return nil
	}
	var cfg tokenizerConfig
	if err := json.Unmarshal(data, &cfg); err != nil {
		return fmt.Errorf("parse tokenizer_config.json: %w", err)
	}
	if cfg.CleanUpTokenizationSpace != nil {
		t.cleanUpSpaces = *cfg.CleanUpTokenizationSpace
	}
	if m := cfg.ModelMaxLength; m != nil && *m > 0 && *m < 1e9 && *m == math.Trunc(*m) {
		t.modelMaxLength = int(*m) // transformers' "no limit" is 1e30
	}
	class := strings.TrimSuffix(cfg.TokenizerClass, "Fast")
	defaults, ok := postProcessorClasses[class]
	if !ok {
		return nil
	}
	addBOS, addEOS := defaults.addBOS, defaults.addEOS
	if cfg.AddBOSToken != nil {
		addBOS = *cfg.AddBOSToken
	}
	if cfg.AddEOSToken != nil {
		addEOS = *cfg.AddEOSToken
	}
	var pp postProcessor
	for _, x := range []struct {
		on    bool
		field string
		raw   json.RawMessage
		dst   *[]uint32
	}{{addBOS, "bos_token", cfg.BOSToken, &pp.prefix}, {addEOS, "eos_token", cfg.EOSToken, &pp.suffix}} {
		if !x.on {
			continue
		}
		content, set, err := tokenContent(x.raw)
		if err != nil {
			return fmt.Errorf("tokenizer_config.json %s: %w", x.field, err)
		}
		if !set {
			return fmt.Errorf("tokenizer_config.json: add_%s is true but %s is not set (transformers refuses this too)", x.field, x.field)
		}
		id, ok := t.TokenID(content)
		if !ok {
			return fmt.Errorf("tokenizer_config.json %s %q is not in the vocabulary", x.field, content)
		}
		*x.dst = []uint32{id}
	}
	t.post = pp
	return nil
}

// TokenID returns the id of a token spelling (an added token's content or a vocabulary entry),
// as transformers' convert_tokens_to_ids does for known tokens.
func (t *Tokenizer) TokenID(token string) (uint32, bool) {
	for id, a := range t.addedByID {
		if a.content == token {
			return id, true
		}
	}
	if t.model == nil {
		return 0, false
	}
	id, ok := t.model.vocab[token]
	return id, ok
}

// ModelMaxLength returns tokenizer_config.json's model_max_length in tokens, or 0 when it is
// absent or transformers' "unlimited" placeholder.
func (t *Tokenizer) ModelMaxLength() int { return t.modelMaxLength }

// cleanUpTokenization is transformers' clean_up_tokenization: spaces before punctuation and
// English contractions removed (the same replacements, in the same order), applied by Decode
// when tokenizer_config.json sets clean_up_tokenization_spaces.
func cleanUpTokenization(s string) string {
	for _, r := range cleanUpPairs {
		s = strings.ReplaceAll(s, r[0], r[1])
	}
	return s
}

var cleanUpPairs = [][2]string{
	{" .", "."}, {" ?", "?"}, {" !", "!"}, {" ,", ","}, {" ' ", "'"}, {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"},
}
