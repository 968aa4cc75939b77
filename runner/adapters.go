package runner

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/tokenizer"
	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	"github.com/kvepp/kvepp/picker"
)

// kvEventSource adapts *kvevents.Manager to picker.KVEventSource: the core attaches a worker's
// listeners with the partition index as the sink and detaches them on removal.
type kvEventSource struct{ m *kvevents.Manager }

var _ picker.KVEventSource = kvEventSource{}

// AttachWorker implements picker.KVEventSource.
func (a kvEventSource) AttachWorker(spec picker.WorkerEventSpec, idx *kvindex.Index) error {
	return a.m.Attach(kvevents.WorkerSpec{
		WorkerID:       spec.WorkerID,
		BlockSize:      spec.BlockSize,
		IsEagle:        spec.IsEagle,
		DPStartRank:    spec.DPStartRank,
		DPSize:         spec.DPSize,
		Endpoints:      spec.Endpoints,
		ReplayEndpoint: spec.ReplayEndpoint,
	}, idx)
}

// DetachWorker implements picker.KVEventSource.
func (a kvEventSource) DetachWorker(workerID uint64) { a.m.Detach(workerID) }

// tokenizerSet implements extproc.Tokenizers over tokenizers loaded once per directory and shared
// by every model and stream that uses them (epp.md §5.4 "load once per model").
type tokenizerSet struct {
	// convCache is the local tokenizers' conversation cache (nil unless local mode with
	// DYN_EPP_CONVERSATION_CACHE_BYTES > 0), shared by all of them.
	convCache *tokenizer.ConversationCache
	// budget bounds the body bytes the local tokenizers work on at once (nil: unbounded).
	budget *tokenizeBudget

	byModel map[string]extproc.RequestTokenizer
	def     extproc.RequestTokenizer // DYN_EPP_TOKENIZER_DIR's, or the byte fallback; may be nil
	// protocol is DYN_EPP_TOKENIZER_PROTOCOL's effective value: it decides which settings the
	// error for a model without a tokenizer names.
	protocol string
}

var _ extproc.Tokenizers = (*tokenizerSet)(nil)

// ForModel implements extproc.Tokenizers: the model's own tokenizer (DYN_EPP_TOKENIZERS, or its
// render URL from DYN_EPP_TOKENIZER_SERVICE_URLS), else the default one (DYN_EPP_TOKENIZER_DIR,
// DYN_EPP_TOKENIZER_SERVICE_URL). A model with neither is an internal error (a deployment
// mistake, 500) naming the settings of the protocol in use — never the other models configured,
// which are the operator's business, not the client's.
func (s *tokenizerSet) ForModel(model string) (extproc.RequestTokenizer, error) {
	if t, ok := s.byModel[model]; ok {
		return t, nil
	}
	if s.def != nil {
		return s.def, nil
	}
	if s.protocol == TokenizerProtocolVLLMRender {
		return nil, picker.Errorf(picker.KindInternal, "no render URL is configured for model %q: set DYN_EPP_TOKENIZER_SERVICE_URL (for every model) or add the model to DYN_EPP_TOKENIZER_SERVICE_URLS", excerpt.Of(model))
	}
	return nil, picker.Errorf(picker.KindInternal, "no tokenizer is configured for model %q: set DYN_EPP_TOKENIZER_DIR (for every model) or add the model to DYN_EPP_TOKENIZERS", excerpt.Of(model))
}

// loadTokenizers builds the Tokenizers of the configured protocol: local loads every distinct
// directory once (errors name the setting); none uses the byte-level fallback.
func loadTokenizers(cfg Config, log zerolog.Logger) (*tokenizerSet, error) {
	set := &tokenizerSet{byModel: map[string]extproc.RequestTokenizer{}, protocol: cfg.EffectiveTokenizerProtocol()}
	switch cfg.EffectiveTokenizerProtocol() {
	case TokenizerProtocolNone:
		// Start warns about this mode once it is up, so the warning never precedes an
		// unrelated startup error.
		set.def = byteTokenizer{}
		return set, nil
	case TokenizerProtocolVLLMRender:
		if err := loadRenderTokenizers(cfg, set, log); err != nil {
			return nil, err
		}
		return set, nil
	case TokenizerProtocolLocal:
	default:
		return nil, fmt.Errorf("invalid %s %q: not supported", cfg.name("DYN_EPP_TOKENIZER_PROTOCOL"), cfg.EffectiveTokenizerProtocol())
	}
	if cfg.ConversationCacheBytes > 0 {
		set.convCache = tokenizer.NewConversationCache(cfg.ConversationCacheBytes)
	}
	set.budget = newTokenizeBudget(cfg.TokenizeMaxInflightBytes, cfg.TokenizationTimeout.Duration())
	load := func(setting, dir, model string) (*tokenizer.Tokenizer, error) {
		resolved, err := tokenizer.ResolveDir(dir, model)
		if err != nil {
			return nil, fmt.Errorf("invalid %s %q: %w", setting, dir, err)
		}
		t, err := loadedTokenizers.load(resolved, log)
		if err != nil {
			return nil, fmt.Errorf("invalid %s %q: %w", setting, dir, err)
		}
		if !t.HasChatTemplate() {
			log.Warn().Str("setting", setting).Str("dir", resolved).Str("model", model).
				Msg("tokenizer has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja): chat and Responses requests for this model get 400; completions work. Add the model's chat template file, or use DYN_EPP_TOKENIZER_PROTOCOL=vllm-render")
		}
		if t.MaxModelLenDefaulted() {
			log.Info().Str("setting", setting).Str("dir", resolved).Int("max_model_len", t.MaxModelLen()).
				Msg("neither config.json nor tokenizer_config.json names the model's context length: /tokenize reports vLLM's default max_model_len; add the model's config.json for the real one")
		}
		return t, nil
	}
	if cfg.TokenizerDir != "" {
		t, err := load(cfg.name("DYN_EPP_TOKENIZER_DIR"), cfg.TokenizerDir, cfg.ModelName)
		if err != nil {
			return nil, err
		}
		set.def = localTokenizer{t, cfg.ImageTokens, set.convCache, set.budget}
	}
	models := make([]string, 0, len(cfg.Tokenizers))
	for m := range cfg.Tokenizers {
		models = append(models, m)
	}
	sort.Strings(models)
	for _, m := range models {
		t, err := load(cfg.name("DYN_EPP_TOKENIZERS")+"["+strconv.Quote(m)+"]", cfg.Tokenizers[m], m)
		if err != nil {
			return nil, err
		}
		set.byModel[m] = localTokenizer{t, cfg.ImageTokens, set.convCache, set.budget}
	}
	return set, nil
}

// tokenizerCache shares loaded tokenizers process-wide: a directory is loaded once and reused by
// every model that names it and by later Starts in the same process (tests, custom binaries that
// restart an Instance) as long as its tokenizer.json and tokenizer_config.json are unchanged
// (same size and modification time). Loading the 11 MB Qwen3 file takes seconds.
type tokenizerCache struct {
	mu      sync.Mutex
	entries map[string]cachedTokenizer
}

type cachedTokenizer struct {
	stamp string
	tok   *tokenizer.Tokenizer
}

var loadedTokenizers = &tokenizerCache{entries: map[string]cachedTokenizer{}}

// load returns the tokenizer of dir, loading it when it is not cached or its files changed.
func (c *tokenizerCache) load(dir string, log zerolog.Logger) (*tokenizer.Tokenizer, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	stamp := ""
	for _, name := range []string{"tokenizer.json", "tokenizer_config.json"} {
		st, err := os.Stat(filepath.Join(abs, name))
		if err != nil {
			return nil, err
		}
		stamp += fmt.Sprintf("%s:%d:%d;", name, st.Size(), st.ModTime().UnixNano())
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.entries[abs]; ok && e.stamp == stamp {
		return e.tok, nil
	}
	start := time.Now()
	t, err := tokenizer.Load(abs)
	if err != nil {
		return nil, err
	}
	log.Info().Str("dir", abs).Int64("took_ms", time.Since(start).Milliseconds()).Msg("tokenizer loaded")
	c.entries[abs] = cachedTokenizer{stamp: stamp, tok: t}
	return t, nil
}

// byteTokenizer is the fallback of DYN_EPP_TOKENIZER_PROTOCOL=none (approximate mode only): the
// "tokens" are the bytes of the prompt field's JSON text (messages for chat, prompt for
// completions, instructions followed by input for responses), one token id per byte. Two requests
// that share a conversation prefix share a byte prefix, so the approximate index — which learns from
// kvepp's own bookings, never from engine events — still finds their common blocks.
type byteTokenizer struct{}

var _ extproc.RequestTokenizer = byteTokenizer{}

// TokenizeChat implements extproc.RequestTokenizer.
func (byteTokenizer) TokenizeChat(body []byte) ([]uint32, error) {
	var b struct {
		Messages json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		return nil, fmt.Errorf("%w: %v", extproc.ErrTokenizerBadRequest, err)
	}
	return bytesToIDs(nil, b.Messages), nil
}

// TokenizeCompletion implements extproc.RequestTokenizer: a string prompt contributes its text;
// any other prompt form its JSON text.
func (byteTokenizer) TokenizeCompletion(body []byte) ([]uint32, error) {
	var b struct {
		Prompt json.RawMessage `json:"prompt"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		return nil, fmt.Errorf("%w: %v", extproc.ErrTokenizerBadRequest, err)
	}
	var s string
	if json.Unmarshal(b.Prompt, &s) == nil {
		return bytesToIDs(nil, []byte(s)), nil
	}
	return bytesToIDs(nil, b.Prompt), nil
}

// TokenizeResponses implements extproc.RequestTokenizer.
func (byteTokenizer) TokenizeResponses(body []byte) ([]uint32, error) {
	var b struct {
		Instructions json.RawMessage `json:"instructions"`
		Input        json.RawMessage `json:"input"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		return nil, fmt.Errorf("%w: %v", extproc.ErrTokenizerBadRequest, err)
	}
	return bytesToIDs(bytesToIDs(nil, b.Instructions), b.Input), nil
}

func bytesToIDs(dst []uint32, b []byte) []uint32 {
	for _, c := range b {
		dst = append(dst, uint32(c))
	}
	return dst
}
