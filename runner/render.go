package runner

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sort"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/tokenizer"
	"github.com/kvepp/kvepp/extproc/tokenizer/vllmrender"
	"github.com/kvepp/kvepp/picker"
)

// renderTokenizer adapts a vllmrender.Client to the ext_proc tokenizer interfaces
// (DYN_EPP_TOKENIZER_PROTOCOL=vllm-render, epp.md §5.4): the server calls TokenizePrompt with the
// stream's context and x-request-id; the per-kind methods exist for callers without a stream.
type renderTokenizer struct {
	c *vllmrender.Client
	// log receives the render failures the client cannot diagnose (renderFailed); nil logs
	// nothing.
	log *zerolog.Logger
}

// renderLogBurst and renderLogPeriod bound the render-failure warnings of one render server: a
// server that is down fails every request, and the first few lines say all there is to say.
const (
	renderLogBurst  = 5
	renderLogPeriod = 10 * time.Second
)

// renderFailed logs a failed render call with what the client is not told: the render URL and
// the underlying cause. Timeouts, unreachable servers, 5xx and malformed answers (504, 503, 502)
// are warnings, and so are 4xx other than 400 and 422 — a 404, 401 or 405 usually means a wrong
// DYN_EPP_TOKENIZER_SERVICE_URL(S) or credentials, not a bad request; 400 and 422 (the request's
// own fault) are logged at debug.
func (r renderTokenizer) renderFailed(err error, requestID string) {
	var re *vllmrender.Error
	if r.log == nil || !errors.As(err, &re) {
		return
	}
	ev := r.log.Warn()
	if re.Status == http.StatusBadRequest || re.Status == http.StatusUnprocessableEntity {
		ev = r.log.Debug()
	}
	ev.Str("url", re.URL).Int("status", re.Status).Str("request_id", requestID).Str("error", re.Detail()).
		Msg("render call failed (DYN_EPP_TOKENIZER_PROTOCOL=vllm-render)")
}

var (
	_ extproc.RequestTokenizer = renderTokenizer{}
	_ extproc.PromptTokenizer  = renderTokenizer{}
)

var renderKinds = map[extproc.PromptKind]vllmrender.Kind{
	extproc.PromptChat: vllmrender.Chat, extproc.PromptCompletion: vllmrender.Completion, extproc.PromptResponses: vllmrender.Responses,
}

// TokenizePrompt implements extproc.PromptTokenizer: one render call; multimodal placeholders
// become picker.MMItems.
func (r renderTokenizer) TokenizePrompt(ctx context.Context, call extproc.TokenizeCall) (extproc.TokenizedPrompt, error) {
	kind, ok := renderKinds[call.Kind]
	if !ok {
		return extproc.TokenizedPrompt{}, fmt.Errorf("unknown prompt kind %d", call.Kind)
	}
	res, err := r.c.Render(ctx, kind, call.Body, call.RequestID)
	if err != nil {
		r.renderFailed(err, call.RequestID)
		return extproc.TokenizedPrompt{}, err
	}
	p := extproc.TokenizedPrompt{TokenIDs: res.TokenIDs}
	for _, m := range res.MM {
		p.MMItems = append(p.MMItems, picker.MMItem{Start: m.Offset, End: m.Offset + m.Length, Hash: m.Hash})
	}
	return p, nil
}

func (r renderTokenizer) tokenize(kind extproc.PromptKind, body []byte) ([]uint32, error) {
	p, err := r.TokenizePrompt(context.Background(), extproc.TokenizeCall{Kind: kind, Body: body})
	return p.TokenIDs, err
}

// TokenizeChat implements extproc.RequestTokenizer.
func (r renderTokenizer) TokenizeChat(body []byte) ([]uint32, error) {
	return r.tokenize(extproc.PromptChat, body)
}

// TokenizeCompletion implements extproc.RequestTokenizer.
func (r renderTokenizer) TokenizeCompletion(body []byte) ([]uint32, error) {
	return r.tokenize(extproc.PromptCompletion, body)
}

// TokenizeResponses implements extproc.RequestTokenizer.
func (r renderTokenizer) TokenizeResponses(body []byte) ([]uint32, error) {
	return r.tokenize(extproc.PromptResponses, body)
}

// loadRenderTokenizers builds one render client per distinct URL: DYN_EPP_TOKENIZER_SERVICE_URL
// for every model, DYN_EPP_TOKENIZER_SERVICE_URLS for the models it names.
func loadRenderTokenizers(cfg Config, set *tokenizerSet, log zerolog.Logger) error {
	clients := map[string]renderTokenizer{}
	client := func(setting, u string) (renderTokenizer, error) {
		if c, ok := clients[u]; ok {
			return c, nil
		}
		c, err := vllmrender.New(vllmrender.Config{BaseURL: u, Timeout: cfg.TokenizationTimeout.Duration(), MaxResponseBytes: cfg.TokenizerMaxResponseBytes})
		if err != nil {
			return renderTokenizer{}, fmt.Errorf("invalid %s %q: %w", setting, u, err)
		}
		sampled := log.With().Str("component", "vllm-render").Logger().
			Sample(&zerolog.BurstSampler{Burst: renderLogBurst, Period: renderLogPeriod})
		clients[u] = renderTokenizer{c: c, log: &sampled}
		return clients[u], nil
	}
	if cfg.TokenizerServiceURL != "" {
		c, err := client(cfg.name("DYN_EPP_TOKENIZER_SERVICE_URL"), cfg.TokenizerServiceURL)
		if err != nil {
			return err
		}
		set.def = c
	}
	models := make([]string, 0, len(cfg.TokenizerServiceURLs))
	for m := range cfg.TokenizerServiceURLs {
		models = append(models, m)
	}
	sort.Strings(models)
	for _, m := range models {
		c, err := client(cfg.name("DYN_EPP_TOKENIZER_SERVICE_URLS")+"["+m+"]", cfg.TokenizerServiceURLs[m])
		if err != nil {
			return err
		}
		set.byModel[m] = c
	}
	return nil
}

// localTokenizer is the in-process tokenizer of DYN_EPP_TOKENIZER_PROTOCOL=local as the ext_proc
// server uses it: chats with images are routed by the exact text before the first image and the
// rest is booked as uncached (a request-unique mm hash on every block from there on, so those
// blocks never match and are never shared); everything else is tokenizer.Tokenizer's.
type localTokenizer struct {
	*tokenizer.Tokenizer
	imageTokens int                          // DYN_EPP_IMAGE_TOKENS
	convCache   *tokenizer.ConversationCache // nil: every chat is tokenized from scratch
	budget      *tokenizeBudget              // DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES; nil: unbounded
}

var (
	_ extproc.RequestTokenizer = localTokenizer{}
	_ extproc.PromptTokenizer  = localTokenizer{}
)

// TokenizePrompt implements extproc.PromptTokenizer.
func (l localTokenizer) TokenizePrompt(ctx context.Context, call extproc.TokenizeCall) (extproc.TokenizedPrompt, error) {
	release, err := l.budget.acquire(ctx, len(call.Body))
	if err != nil {
		return extproc.TokenizedPrompt{}, err
	}
	defer release()
	lv := l.withContext(ctx)
	p, err := lv.tokenizePrompt(call)
	if cerr := lv.Err(); cerr != nil {
		return extproc.TokenizedPrompt{}, cerr // the client went away: stopped early (audit 8 #3)
	}
	return p, err
}

// withContext is l with a tokenizer view whose encodes stop when ctx ends (Tokenizer.WithContext).
func (l localTokenizer) withContext(ctx context.Context) localTokenizer {
	l.Tokenizer = l.Tokenizer.WithContext(ctx)
	return l
}

// tokenizePrompt is TokenizePrompt after the budget is acquired.
func (l localTokenizer) tokenizePrompt(call extproc.TokenizeCall) (extproc.TokenizedPrompt, error) {
	req, err := l.request(call)
	if err != nil {
		return extproc.TokenizedPrompt{}, err
	}
	switch call.Kind {
	case extproc.PromptChat:
		p, err := l.ChatPromptFor(req, tokenizer.ChatOptions{ImageTokens: l.imageTokens, Cache: l.convCache})
		return routedPrompt(p), err
	case extproc.PromptCompletion:
		p, err := l.CompletionPromptFor(req)
		return routedPrompt(p), err
	default:
		p, err := l.ResponsesPromptFor(req, l.imageTokens)
		return routedPrompt(p), err
	}
}

// routedPrompt is a chat-shaped prompt as ext_proc routes it: the ids from the first image on
// are booked under a request-unique multimodal hash, so they never match a cached block.
func routedPrompt(p tokenizer.ChatPrompt) extproc.TokenizedPrompt {
	out := extproc.TokenizedPrompt{TokenIDs: p.TokenIDs}
	if p.Memo != nil {
		out.HashMemo = hashMemo{p.Memo}
	}
	if p.UncachedFrom < len(p.TokenIDs) {
		out.MMItems = []picker.MMItem{{Start: p.UncachedFrom, End: len(p.TokenIDs), Hash: rand.Uint64()}}
	}
	return out
}

// request is the call's body as the tokenizer reads it: the members the ext_proc server already
// scanned (one parse per request, epp.md §13.5), or the body parsed when there are none.
func (l localTokenizer) request(call extproc.TokenizeCall) (*tokenizer.Request, error) {
	if call.Members == nil {
		return tokenizer.ParseRequest(call.Body)
	}
	ms := make([]tokenizer.Member, len(call.Members))
	for i, m := range call.Members {
		ms[i] = tokenizer.Member{Key: m.Key, Value: m.Value, Elements: m.Elements}
	}
	return tokenizer.RequestFromMembers(ms)
}

// hashMemo adapts a conversation-cache prefix to picker.BlockHashMemo, so the block hashes of a
// continuing conversation's cached prefix are computed once.
type hashMemo struct{ m *tokenizer.PrefixMemo }

var _ picker.BlockHashMemo = hashMemo{}

// Tokens implements picker.BlockHashMemo.
func (h hashMemo) Tokens() int { return h.m.Tokens() }

// LoadBlockHashes implements picker.BlockHashMemo.
func (h hashMemo) LoadBlockHashes(k picker.BlockHashKey) (local, seq []uint64) {
	return h.m.LoadBlockHashes(k.BlockSize, k.Seed)
}

// StoreBlockHashes implements picker.BlockHashMemo.
func (h hashMemo) StoreBlockHashes(k picker.BlockHashKey, local, seq []uint64) {
	h.m.StoreBlockHashes(k.BlockSize, k.Seed, local, seq)
}
