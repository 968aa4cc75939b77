package runner

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/tokenizer"
	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/picker"
)

// tokenizeAPI serves POST /tokenize and POST /detokenize on the selection side port, shaped like
// vLLM's own endpoints so an operator can diff kvepp's token ids with the engine's in one command
// (README "Checking tokenization against the engine"):
//
//	/tokenize   {"model", "prompt", "add_special_tokens" (default true), "return_token_strs"}
//	         or {"model", "messages", "tools", "add_generation_prompt" (default true),
//	             "continue_final_message", "add_special_tokens" (default false),
//	             "chat_template_kwargs", "return_token_strs"}
//	         →  {"count": N, "max_model_len": M, "tokens": [...], "token_strs": [...] | null}
//	/detokenize {"model", "tokens": [...]} → {"prompt": "..."}
//
// Errors are vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}} with
// BadRequestError (400), NotFoundError (404, unknown model), and 503 while tokenizers load or
// when the tokenizer protocol has no local tokenizer (vllm-render, none). Everything else goes to
// next (the selection API).
type tokenizeAPI struct {
	next      http.Handler
	set       atomic.Pointer[tokenizerSet]
	models    extproc.ModelCatalog // the served partitions, as ext_proc resolves models in them
	protocol  string
	defModel  string
	maxBody   int64
	localOnly string // why there is no local tokenizer, "" in local mode
}

// newTokenizeAPI serves /tokenize and /detokenize in front of next; a request's model is resolved
// in models exactly as ext_proc resolves it (extproc.ResolveBodyModel).
func newTokenizeAPI(next http.Handler, cfg Config, models extproc.ModelCatalog) *tokenizeAPI {
	a := &tokenizeAPI{next: next, models: models, protocol: cfg.EffectiveTokenizerProtocol(), defModel: cfg.ModelName, maxBody: cfg.MaxRequestBodyBytes}
	if a.protocol != TokenizerProtocolLocal {
		a.localOnly = fmt.Sprintf("/tokenize needs a local tokenizer; DYN_EPP_TOKENIZER_PROTOCOL is %s (the model server's own /tokenize answers for vllm-render)", a.protocol)
	}
	return a
}

// ServeHTTP implements http.Handler.
func (a *tokenizeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/tokenize", "/detokenize":
	default:
		a.next.ServeHTTP(w, r)
		return
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		vllmError(w, http.StatusMethodNotAllowed, "MethodNotAllowed", "", "Method Not Allowed")
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, a.maxBody))
	if err != nil {
		vllmError(w, http.StatusRequestEntityTooLarge, "BadRequestError", "",
			fmt.Sprintf("request body exceeds %d bytes (DYN_EPP_MAX_REQUEST_BODY_BYTES)", a.maxBody))
		return
	}
	if t := bytes.TrimLeft(body, " \t\r\n"); len(t) == 0 || t[0] != '{' {
		vllmError(w, http.StatusBadRequest, "BadRequestError", "", "request body must be a JSON object")
		return
	}
	var head struct {
		Model *string `json:"model"`
	}
	if err := json.Unmarshal(body, &head); err != nil {
		vllmError(w, http.StatusBadRequest, "BadRequestError", "", bodyError(err))
		return
	}
	if a.localOnly != "" {
		vllmError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "", a.localOnly)
		return
	}
	set := a.set.Load()
	if set == nil {
		vllmError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "", "tokenizers are still loading")
		return
	}
	lt, ok := a.resolve(w, set, head.Model)
	if !ok {
		return
	}
	if r.URL.Path == "/detokenize" {
		a.detokenize(r.Context(), w, lt, body)
		return
	}
	release, err := lt.budget.acquire(r.Context(), len(body))
	if err != nil {
		vllmError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "", err.Error())
		return
	}
	defer release()
	a.tokenize(w, lt.Tokenizer.WithContext(r.Context()), body)
}

// resolve finds the tokenizer of the request's model as ext_proc does (epp.md §5.5): the body's
// model resolved to its partition (a LoRA name under DYN_MODEL_NAME to the base model), then that
// partition's tokenizer. Failures are answered in vLLM's shape and ok is false: 404 NotFoundError
// for a model that is not served, 400 for a name over the limits or a request naming no model
// while several are served, 503 while no model is served, 500 when no tokenizer covers the
// partition. Quoted names are bounded (internal/excerpt).
func (a *tokenizeAPI) resolve(w http.ResponseWriter, set *tokenizerSet, model *string) (localTokenizer, bool) {
	name := ""
	if model != nil {
		name = *model
	}
	partition, _, err := extproc.ResolveBodyModel(a.models, a.defModel, name)
	if err == nil {
		var rt extproc.RequestTokenizer
		if rt, err = set.ForModel(partition); err == nil {
			if lt, ok := rt.(localTokenizer); ok {
				return lt, true
			}
			err = picker.Errorf(picker.KindInternal, "model %q has no local tokenizer", excerpt.Of(partition))
		}
	}
	switch picker.KindOf(err) {
	case extproc.KindModelNotFound:
		vllmError(w, http.StatusNotFound, "NotFoundError", "model", fmt.Sprintf("The model `%s` does not exist.", excerpt.Of(name)))
	case picker.KindBadRequest:
		vllmError(w, http.StatusBadRequest, "BadRequestError", "model", err.Error())
	case picker.KindNotReady:
		vllmError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "", err.Error())
	default:
		vllmError(w, http.StatusInternalServerError, "InternalServerError", "", err.Error())
	}
	return localTokenizer{}, false
}

func (a *tokenizeAPI) tokenize(w http.ResponseWriter, tk *tokenizer.Tokenizer, body []byte) {
	var req struct {
		Prompt          json.RawMessage `json:"prompt"`
		Messages        json.RawMessage `json:"messages"`
		ReturnTokenStrs *bool           `json:"return_token_strs"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		vllmError(w, http.StatusBadRequest, "BadRequestError", "", bodyError(err))
		return
	}
	var ids []uint32
	var err error
	switch {
	case req.Messages != nil && req.Prompt != nil:
		vllmError(w, http.StatusBadRequest, "BadRequestError", "", "give either prompt or messages, not both")
		return
	case req.Messages != nil:
		ids, err = tk.TokenizeChatText(body)
	case req.Prompt != nil:
		if bytes.HasPrefix(bytes.TrimSpace(req.Prompt), []byte(`"`)) {
			ids, err = tk.TokenizeCompletion(body)
		} else {
			err = errors.New("prompt must be a string")
		}
	default:
		vllmError(w, http.StatusBadRequest, "BadRequestError", "", "either prompt or messages is required")
		return
	}
	if cerr := tk.Err(); cerr != nil {
		// The client went away and the encode stopped early (audit 8 #3): ids are incomplete.
		vllmError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "", "the request ended while it was tokenized: "+cerr.Error())
		return
	}
	if err != nil {
		status, typ := http.StatusBadRequest, "BadRequestError"
		if !errors.Is(err, tokenizer.ErrBadRequest) && err.Error() != "prompt must be a string" {
			status, typ = http.StatusInternalServerError, "InternalServerError"
		}
		vllmError(w, status, typ, "", err.Error())
		return
	}
	resp := struct {
		Count       int       `json:"count"`
		MaxModelLen int       `json:"max_model_len"`
		Tokens      []uint32  `json:"tokens"`
		TokenStrs   *[]string `json:"token_strs"`
	}{Count: len(ids), MaxModelLen: tk.MaxModelLen(), Tokens: ids}
	if resp.Tokens == nil {
		resp.Tokens = []uint32{}
	}
	if req.ReturnTokenStrs != nil && *req.ReturnTokenStrs {
		strs := make([]string, len(ids))
		for i, id := range ids {
			strs[i], _ = tk.TokenString(id)
		}
		resp.TokenStrs = &strs
	}
	writeJSON(w, http.StatusOK, resp)
}

func (a *tokenizeAPI) detokenize(ctx context.Context, w http.ResponseWriter, lt localTokenizer, body []byte) {
	tk := lt.Tokenizer
	var req struct {
		Tokens *[]int64 `json:"tokens"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		vllmError(w, http.StatusBadRequest, "BadRequestError", "tokens", bodyError(err))
		return
	}
	if req.Tokens == nil {
		vllmError(w, http.StatusBadRequest, "BadRequestError", "tokens", "tokens is required")
		return
	}
	ids := make([]uint32, len(*req.Tokens))
	spelled := 0 // bytes of the ids' spellings: about the answer's size (up to ~18× the body)
	for i, v := range *req.Tokens {
		s, ok := tk.TokenString(uint32(v))
		if v < 0 || v > 1<<32-1 || !ok {
			vllmError(w, http.StatusBadRequest, "BadRequestError", "tokens", "token id "+strconv.FormatInt(v, 10)+" is out of vocabulary")
			return
		}
		ids[i] = uint32(v)
		spelled += len(s)
	}
	// The answer is built in memory, so it counts against DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES
	// like a body being tokenized (audit 8 finding 7: 1.75 MB of ids decode to 32 MB).
	release, err := lt.budget.acquire(ctx, len(body)+spelled)
	if err != nil {
		vllmError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "", err.Error())
		return
	}
	defer release()
	text, err := tk.Decode(ids, false)
	if err != nil {
		vllmError(w, http.StatusInternalServerError, "InternalServerError", "", err.Error())
		return
	}
	writeJSON(w, http.StatusOK, struct {
		Prompt string `json:"prompt"`
	}{text})
}

// vllmErrorBody is vLLM's ErrorResponse.
type vllmErrorBody struct {
	Error vllmErrorInfo `json:"error"`
}

type vllmErrorInfo struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

// vllmError writes vLLM's ErrorResponse.
func vllmError(w http.ResponseWriter, status int, typ, param, msg string) {
	info := vllmErrorInfo{Message: msg, Type: typ, Code: status}
	if param != "" {
		info.Param = &param
	}
	writeJSON(w, status, vllmErrorBody{Error: info})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false) // as Python's json: "<|im_end|>" stays readable
	data := buf.Bytes()
	if err := enc.Encode(v); err != nil {
		status, data = http.StatusInternalServerError, []byte(`{"error":{"message":"internal error","type":"InternalServerError","param":null,"code":500}}`)
	} else {
		data = bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(data)
}

// bodyError words a JSON decoding error of a /tokenize or /detokenize body as the client's
// mistake, naming the field: `"model" must be a string`, `"tokens" must be a list of integers`.
func bodyError(err error) string {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) && te.Field != "" {
		field, _, _ := strings.Cut(te.Field, ".")
		switch te.Type.Kind() {
		case reflect.String:
			return fmt.Sprintf("%q must be a string", field)
		case reflect.Bool:
			return fmt.Sprintf("%q must be a boolean", field)
		case reflect.Int64, reflect.Slice:
			if field == "tokens" {
				return fmt.Sprintf("%q must be a list of integers", field)
			}
		}
		return fmt.Sprintf("%q has the wrong type (%s)", field, te.Value)
	}
	return "request body is not valid JSON: " + err.Error()
}
