package enginesim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"time"

	"github.com/kvepp/kvepp/internal/tokenjson"
)

const maxOutputTokens = 1 << 20

// routes returns the worker's OpenAI-compatible HTTP API.
func (w *Worker) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", func(rw http.ResponseWriter, r *http.Request) {
		w.serveGenerate(rw, r, false)
	})
	mux.HandleFunc("POST /v1/chat/completions", func(rw http.ResponseWriter, r *http.Request) {
		w.serveGenerate(rw, r, true)
	})
	mux.HandleFunc("GET /health", func(rw http.ResponseWriter, r *http.Request) {
		rw.Header().Set(workerHeader, w.cfg.Name)
		rw.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("GET /v1/models", w.serveModels)
	return mux
}

// requestBody is the subset of the OpenAI completions and chat request bodies
// the simulator reads; unknown fields are ignored.
type requestBody struct {
	Model               string          `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            []chatMessageIn `json:"messages"`
	PromptTokenIDs      []int64         `json:"prompt_token_ids"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	Stream              bool            `json:"stream"`
	StreamOptions       *streamOptions  `json:"stream_options"`
}

// streamOptions is the request's stream_options. The final usage chunk is always sent;
// continuous_usage_stats (vLLM) adds usage with the completion tokens so far to every chunk.
type streamOptions struct {
	ContinuousUsageStats bool `json:"continuous_usage_stats"`
}

type chatMessageIn struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// badRequest is a client error reported as HTTP 400.
type badRequest struct{ msg string }

func (e *badRequest) Error() string { return e.msg }

func badf(format string, args ...any) error {
	return &badRequest{msg: fmt.Sprintf(format, args...)}
}

// promptTokens resolves the prompt's token ids (see the package documentation,
// "Token scheme").
func (b *requestBody) promptTokens(chat bool) ([]uint32, error) {
	if b.PromptTokenIDs != nil {
		return checkTokenIDs(b.PromptTokenIDs, "prompt_token_ids")
	}
	if chat {
		if len(b.Messages) == 0 {
			return nil, badf("messages must be a non-empty array")
		}
		msgs := make([]ChatMessage, len(b.Messages))
		for i, m := range b.Messages {
			text, err := contentText(m.Content)
			if err != nil {
				return nil, badf("messages[%d].content: %v", i, err)
			}
			msgs[i] = ChatMessage{Role: m.Role, Content: text}
		}
		return TokenizeText(RenderChat(msgs)), nil
	}
	raw := bytes.TrimSpace(b.Prompt)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, badf("prompt is required")
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, badf("prompt: %v", err)
		}
		return TokenizeText(s), nil
	case '[':
		if ids, ok := fastTokenIDs(raw); ok {
			return ids, nil
		}
		var elems []json.RawMessage
		if err := json.Unmarshal(raw, &elems); err != nil {
			return nil, badf("prompt: %v", err)
		}
		if len(elems) == 0 {
			return nil, badf("prompt must not be an empty array")
		}
		first := bytes.TrimSpace(elems[0])
		if len(first) > 0 && (first[0] == '"' || first[0] == '[') {
			if len(elems) != 1 {
				return nil, badf("prompt has %d entries: batched prompts are not supported", len(elems))
			}
			if first[0] == '"' {
				var s string
				if err := json.Unmarshal(first, &s); err != nil {
					return nil, badf("prompt[0]: %v", err)
				}
				return TokenizeText(s), nil
			}
			raw = first
		}
		var ids []int64
		if err := json.Unmarshal(raw, &ids); err != nil {
			return nil, badf("prompt: token ids must be integers: %v", err)
		}
		return checkTokenIDs(ids, "prompt")
	}
	return nil, badf("prompt must be a string or an array of token ids")
}

// fastTokenIDs decodes the common token prompts, [int] and [[int]] with a single list, without
// encoding/json: decoding them into []json.RawMessage and then []int64 was a quarter of the
// worker's CPU on long prompts. raw is valid JSON starting with '['. ok is false for every other
// input (text prompts, batches, empty prompts, invalid or out-of-range ids, too many ids), and the
// caller then takes the encoding/json path, so those keep exactly the errors they always had. When
// ok is true that path would have returned the same ids: tokenjson accepts what encoding/json
// accepts for []uint32 (a null id is 0 in both), which is what decoding into []int64 followed by
// checkTokenIDs accepts.
func fastTokenIDs(raw []byte) (ids []uint32, ok bool) {
	i := tokenjson.SkipSpace(raw, 1)
	if i >= len(raw) {
		return nil, false
	}
	var err error
	switch raw[i] {
	case '"':
		return nil, false
	case '[':
		var lists int
		ids, lists, err = tokenjson.AppendFirstList(nil, raw)
		if lists != 1 {
			return nil, false
		}
	default:
		ids, err = tokenjson.AppendIDs(nil, raw)
	}
	if err != nil || len(ids) == 0 || len(ids) > maxPromptTokens {
		return nil, false
	}
	return ids, true
}

func checkTokenIDs(ids []int64, field string) ([]uint32, error) {
	if len(ids) > maxPromptTokens {
		return nil, badf("%s has %d tokens, more than the limit %d", field, len(ids), maxPromptTokens)
	}
	out := make([]uint32, len(ids))
	for i, id := range ids {
		if id < 0 || id > math.MaxUint32 {
			return nil, badf("%s[%d] = %d is not a token id (0..4294967295)", field, i, id)
		}
		out[i] = uint32(id)
	}
	return out, nil
}

// contentText returns a chat message content's text: a string as is, the
// "text" fields of an array of parts joined with "\n", null as "".
func contentText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", nil
	}
	if raw[0] == '"' {
		var s string
		err := json.Unmarshal(raw, &s)
		return s, err
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", errors.New("must be a string or an array of content parts")
	}
	var texts []string
	for _, p := range parts {
		if p.Type == "text" || (p.Type == "" && p.Text != "") {
			texts = append(texts, p.Text)
		}
	}
	return strings.Join(texts, "\n"), nil
}

func (b *requestBody) outputTokens(chat bool, def int) (int, error) {
	v := b.MaxTokens
	name := "max_tokens"
	if chat && b.MaxCompletionTokens != nil {
		v, name = b.MaxCompletionTokens, "max_completion_tokens"
	}
	if v == nil {
		return def, nil
	}
	if *v < 1 || *v > maxOutputTokens {
		return 0, badf("%s %d must be between 1 and %d", name, *v, maxOutputTokens)
	}
	return int(*v), nil
}

// Response shapes (OpenAI / vLLM).

type usage struct {
	PromptTokens        int          `json:"prompt_tokens"`
	TotalTokens         int          `json:"total_tokens"`
	CompletionTokens    int          `json:"completion_tokens"`
	PromptTokensDetails tokenDetails `json:"prompt_tokens_details"`
}

type tokenDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

type completionChoice struct {
	Index        int     `json:"index"`
	Text         string  `json:"text"`
	Logprobs     any     `json:"logprobs"`
	FinishReason *string `json:"finish_reason"`
	StopReason   any     `json:"stop_reason"`
}

type chatMessageOut struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chatDelta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type chatChoice struct {
	Index        int             `json:"index"`
	Message      *chatMessageOut `json:"message,omitempty"`
	Delta        *chatDelta      `json:"delta,omitempty"`
	Logprobs     any             `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
	StopReason   any             `json:"stop_reason"`
}

type response struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices any    `json:"choices"`
	Usage   *usage `json:"usage,omitempty"`
}

type errorBody struct {
	Object  string `json:"object"`
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   any    `json:"param"`
	Code    int    `json:"code"`
}

func writeError(rw http.ResponseWriter, status int, msg string) {
	typ := map[int]string{
		http.StatusBadRequest:            "BadRequestError",
		http.StatusNotFound:              "NotFoundError",
		http.StatusServiceUnavailable:    "ServiceUnavailableError",
		http.StatusRequestEntityTooLarge: "BadRequestError",
	}[status]
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	_ = json.NewEncoder(rw).Encode(errorBody{Object: "error", Message: msg, Type: typ, Code: status})
}

func (w *Worker) serveModels(rw http.ResponseWriter, r *http.Request) {
	rw.Header().Set("Content-Type", "application/json")
	rw.Header().Set(workerHeader, w.cfg.Name)
	_ = json.NewEncoder(rw).Encode(map[string]any{
		"object": "list",
		"data": []map[string]any{{
			"id": w.cfg.Model, "object": "model", "created": time.Now().Unix(), "owned_by": "enginesim",
		}},
	})
}

var finishLength = "length"

// serveGenerate handles POST /v1/completions (chat false) and
// POST /v1/chat/completions (chat true).
func (w *Worker) serveGenerate(rw http.ResponseWriter, r *http.Request, chat bool) {
	arrival := time.Now()
	rw.Header().Set(workerHeader, w.cfg.Name)
	var body requestBody
	dec := json.NewDecoder(http.MaxBytesReader(rw, r.Body, maxRequestBodyBytes))
	if err := dec.Decode(&body); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(rw, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds %d bytes", tooBig.Limit))
			return
		}
		writeError(rw, http.StatusBadRequest, fmt.Sprintf("invalid JSON body: %v", err))
		return
	}
	if body.Model != "" && body.Model != w.cfg.Model {
		writeError(rw, http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", body.Model))
		return
	}
	tokens, err := body.promptTokens(chat)
	if err == nil && len(tokens) == 0 {
		err = badf("prompt has no tokens")
	}
	if err != nil {
		writeError(rw, http.StatusBadRequest, err.Error())
		return
	}
	maxTokens, err := body.outputTokens(chat, w.cfg.DefaultMaxTokens)
	if err == nil {
		err = w.fits(len(tokens), maxTokens)
	}
	if err != nil {
		writeError(rw, http.StatusBadRequest, err.Error())
		return
	}
	path := "/v1/completions"
	prefix, object := "cmpl-", "text_completion"
	if chat {
		path = "/v1/chat/completions"
		prefix, object = "chatcmpl-", "chat.completion"
	}
	req := &genRequest{
		id:        w.newID(r.Header.Get(requestIDHeader)),
		path:      path,
		tokens:    tokens,
		maxTokens: maxTokens,
		arrival:   arrival,
	}
	base := response{ID: prefix + req.id, Object: object, Created: arrival.Unix(), Model: w.cfg.Model}

	if !body.Stream {
		rec, err := w.execute(r.Context(), req, nil)
		if err != nil {
			writeError(rw, http.StatusServiceUnavailable, fmt.Sprintf("request %s did not complete: %v", req.id, err))
			return
		}
		text := outputText(0, rec.OutputTokens)
		if chat {
			base.Choices = []chatChoice{{Message: &chatMessageOut{Role: "assistant", Content: text}, FinishReason: &finishLength}}
		} else {
			base.Choices = []completionChoice{{Text: text, FinishReason: &finishLength}}
		}
		base.Usage = recordUsage(rec)
		rw.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(rw).Encode(base)
		return
	}

	flusher, _ := rw.(http.Flusher)
	rw.Header().Set("Content-Type", "text/event-stream")
	rw.Header().Set("Cache-Control", "no-cache")
	rw.WriteHeader(http.StatusOK)
	if flusher != nil {
		flusher.Flush()
	}
	if chat {
		base.Object = "chat.completion.chunk"
	}
	send := func(v any) error {
		b, err := json.Marshal(v)
		if err != nil {
			return err
		}
		if _, err := fmt.Fprintf(rw, "data: %s\n\n", b); err != nil {
			return err
		}
		if flusher != nil {
			flusher.Flush()
		}
		return nil
	}
	rec, err := w.execute(r.Context(), req, func(from, to int) error {
		var fin *string
		if to == maxTokens {
			fin = &finishLength
		}
		chunk := base
		text := outputText(from, to)
		if chat {
			if from == 0 {
				empty := ""
				chunk.Choices = []chatChoice{{Delta: &chatDelta{Role: "assistant", Content: &empty}}}
				if err := send(chunk); err != nil {
					return err
				}
			}
			chunk.Choices = []chatChoice{{Delta: &chatDelta{Content: &text}, FinishReason: fin}}
		} else {
			chunk.Choices = []completionChoice{{Text: text, FinishReason: fin}}
		}
		if o := body.StreamOptions; o != nil && o.ContinuousUsageStats {
			chunk.Usage = &usage{PromptTokens: len(tokens), CompletionTokens: to, TotalTokens: len(tokens) + to}
		}
		return send(chunk)
	})
	if err != nil {
		return // client gone or worker closing: the stream ends without [DONE]
	}
	final := base
	final.Choices = []struct{}{}
	final.Usage = recordUsage(rec)
	if send(final) == nil {
		_, _ = fmt.Fprint(rw, "data: [DONE]\n\n")
		if flusher != nil {
			flusher.Flush()
		}
	}
}

func recordUsage(rec RequestRecord) *usage {
	return &usage{
		PromptTokens:        rec.PromptTokens,
		CompletionTokens:    rec.OutputTokens,
		TotalTokens:         rec.PromptTokens + rec.OutputTokens,
		PromptTokensDetails: tokenDetails{CachedTokens: rec.CachedTokens},
	}
}
