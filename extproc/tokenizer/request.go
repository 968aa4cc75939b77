package tokenizer

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/kvepp/kvepp/internal/jsonscan"
)

// ErrBadRequest matches (errors.Is) every *RequestError: the request body is malformed and the
// caller should answer 400 (epp.md §5.3).
var ErrBadRequest = errors.New("bad request")

// ErrStateful is returned by TokenizeResponses for a Responses request with
// previous_response_id: its prompt depends on server-side state, so the caller does a load-only
// pick (epp.md §5.4, §5.7).
var ErrStateful = errors.New("stateful responses request (previous_response_id) cannot be tokenized locally")

// RequestError describes a request the client got wrong (epp.md §5.3, §8: 400
// invalid_request_error, as vLLM answers): not JSON, not an object, model not a string, a prompt
// field missing or of the wrong type (messages, a message or its role/content, tools,
// chat_template_kwargs, add_generation_prompt …), invalid tool-call arguments, a content part
// this text-only tokenizer cannot take (image_url, input_audio, an unknown type), or a chat
// template that raises over the request (raise_exception). It matches ErrBadRequest with
// errors.Is and reports BadRequest() == true, which is how extproc.ClassifyTokenizerError
// recognises a client error; Err, when set, is the cause.
type RequestError struct {
	Msg string
	Err error
}

// Error returns the message, followed by the cause when there is one.
func (e *RequestError) Error() string {
	if e.Err != nil {
		return e.Msg + ": " + e.Err.Error()
	}
	return e.Msg
}

// Unwrap returns the cause (may be nil).
func (e *RequestError) Unwrap() error { return e.Err }

// Is reports whether target is ErrBadRequest.
func (e *RequestError) Is(target error) bool { return target == ErrBadRequest }

// BadRequest reports true: the request, not the tokenizer, is at fault (the 400 marker that
// extproc.ClassifyTokenizerError looks for, epp.md §8).
func (e *RequestError) BadRequest() bool { return true }

func badRequest(format string, args ...any) *RequestError {
	return &RequestError{Msg: fmt.Sprintf(format, args...)}
}

// Member is one top-level member of a request body: its key (unescaped) and its raw JSON value.
type Member struct {
	Key, Value []byte
	// Elements, when the caller split an array value already (extproc does for messages), are the
	// [start, end) offsets in Value of its elements; nil means not split.
	Elements [][2]int
}

// Request is a request body split into its top-level members, validated JSON. Only the members a
// tokenization reads are decoded (the messages of a continuing conversation only from the first
// one the conversation cache does not hold), so a body that a caller has already scanned is never
// parsed twice (epp.md §13.5). A Request aliases the bytes it was made from and is valid as long as
// they are.
type Request struct {
	members []Member
}

// ParseRequest validates body as one JSON object and splits it into its members. Errors are
// *RequestError: not valid JSON, not an object, or a model that is not a string.
func ParseRequest(body []byte) (*Request, error) {
	r := &Request{}
	err := jsonscan.Object(body, func(key []byte, s, e int) {
		r.members = append(r.members, Member{Key: key, Value: body[s:e]})
	})
	switch err {
	case nil:
	case jsonscan.ErrNotObject:
		return nil, badRequest("request body is a JSON %s, want an object", jsonscan.TypeName(bytes.TrimLeft(body, " \t\r\n")))
	default:
		cause := err
		if _, derr := decodeOrdered(body); derr != nil {
			cause = derr // names the offset
		}
		return nil, &RequestError{Msg: "request body is not valid JSON", Err: cause}
	}
	return r, r.checkModel()
}

// RequestFromMembers builds a Request from members a caller already validated and scanned in
// document order (extproc's TokenizeCall.Members); the last of a repeated key counts. The error is
// a *RequestError for a model that is not a string. The members must be valid JSON values: they
// are decoded without further checks of the surrounding object.
func RequestFromMembers(members []Member) (*Request, error) {
	r := &Request{members: members}
	return r, r.checkModel()
}

func (r *Request) checkModel() error {
	if m := r.get("model"); m != nil && m[0] != '"' {
		return badRequest("model is %s, want a string", jsonscan.TypeName(m))
	}
	return nil
}

// get returns the raw value of the last member named key, or nil.
func (r *Request) get(key string) []byte {
	if m := r.member(key); m != nil {
		return m.Value
	}
	return nil
}

// member returns the last member named key, or nil.
func (r *Request) member(key string) *Member {
	for i := len(r.members) - 1; i >= 0; i-- {
		if string(r.members[i].Key) == key {
			return &r.members[i]
		}
	}
	return nil
}

// decode decodes the raw value of member key (nil when absent).
func (r *Request) decode(key string) (*jval, error) {
	raw := r.get(key)
	if raw == nil {
		return nil, nil
	}
	v, err := decodeValid(raw)
	if err != nil {
		return nil, &RequestError{Msg: key + " is not valid JSON", Err: err}
	}
	return v, nil
}

// optBool reads an optional boolean member (absent or null → def) and whether it was set.
func (r *Request) optBool(key string, def bool) (bool, bool, error) {
	switch v := r.get(key); {
	case v == nil || v[0] == 'n':
		return def, false, nil
	case v[0] == 't':
		return true, true, nil
	case v[0] == 'f':
		return false, true, nil
	default:
		return false, false, badRequest("%s is %s, want a boolean", key, jsonscan.TypeName(v))
	}
}

// optContainer decodes the optional member key, which must be an array (open '[') or an object
// ('{') when present and not null; it returns the value and its raw JSON (nil, nil when absent or
// null) or a *RequestError naming the member.
func (r *Request) optContainer(key string, open byte) (*jval, []byte, error) {
	raw := r.get(key)
	if raw == nil || raw[0] == 'n' {
		return nil, nil, nil
	}
	if raw[0] != open {
		want := "an object"
		if open == '[' {
			want = "an array"
		}
		return nil, nil, badRequest("%s is %s, want %s", key, jsonscan.TypeName(raw), want)
	}
	v, err := decodeValid(raw)
	if err != nil {
		return nil, nil, &RequestError{Msg: key + " is not valid JSON", Err: err}
	}
	return v, raw, nil
}

// chatInputFromRequest extracts the template inputs of a chat completions request (epp.md §5.4):
// the messages are checked to be an array but decoded later (chatInput.decodeMessages), so a
// conversation-cache hit decodes only its new messages.
func chatInputFromRequest(r *Request) (*chatInput, bool, error) {
	var msgs []byte
	var elems [][2]int
	if m := r.member("messages"); m != nil {
		msgs, elems = m.Value, m.Elements
	}
	if msgs == nil || msgs[0] != '[' {
		return nil, false, badRequest("messages is %s, want an array", jsonscan.TypeName(msgs))
	}
	in := &chatInput{messagesRaw: msgs, messageElems: elems}
	var err error
	if in.tools, in.toolsRaw, err = r.optContainer("tools", '['); err != nil {
		return nil, false, err
	}
	if in.kwargs, in.kwargsRaw, err = r.optContainer("chat_template_kwargs", '{'); err != nil {
		return nil, false, err
	}
	agp, agpSet, err := r.optBool("add_generation_prompt", true)
	if err != nil {
		return nil, false, err
	}
	cont, _, err := r.optBool("continue_final_message", false)
	if err != nil {
		return nil, false, err
	}
	if cont {
		if agpSet && agp {
			return nil, false, badRequest("cannot set both continue_final_message and add_generation_prompt to true")
		}
		agp = false
	}
	in.addGenerationPrompt = agp
	in.continueFinal = cont
	addSpecial, _, err := r.optBool("add_special_tokens", false)
	if err != nil {
		return nil, false, err
	}
	return in, addSpecial, nil
}

// chatRequest parses a chat completions body into its template inputs.
func chatRequest(body []byte) (*chatInput, bool, error) {
	r, err := ParseRequest(body)
	if err != nil {
		return nil, false, err
	}
	return chatInputFromRequest(r)
}

// RenderChat renders a chat completions request body (epp.md §5.4 `local`, chat) with the
// model's chat template and returns the prompt text: messages preprocessed as vLLM does, tools
// when given, add_generation_prompt (default true; false with continue_final_message),
// chat_template_kwargs merged, bos_token/eos_token. Errors: *RequestError (ErrBadRequest) for a
// malformed body, a non-text content part or a template that raises over the request;
// ErrNoChatTemplate when the model has none; any other error (a template engine failure) is
// server-side.
func (t *Tokenizer) RenderChat(body []byte) (string, error) {
	in, _, err := chatRequest(body)
	if err != nil {
		return "", err
	}
	return t.render(in)
}

// TokenizeChat returns the token ids vLLM computes for a chat completions body: the rendered
// prompt (RenderChat) encoded with add_special_tokens=false unless the body sets
// add_special_tokens: true. Errors as RenderChat, and a *RequestError for a prompt of more than
// MaxPromptTokens tokens or with a piece longer than MaxExactPieceBytes (longpiece.go).
func (t *Tokenizer) TokenizeChat(body []byte) ([]uint32, error) {
	in, addSpecial, err := chatRequest(body)
	if err != nil {
		return nil, err
	}
	prompt, err := t.render(in)
	if err != nil {
		return nil, err
	}
	before := InexactPieces()
	return exactPrompt(t.encode(prompt, addSpecial), before)
}

// TokenizeCompletion returns the token ids of a completions body's prompt (epp.md §5.3-5.4): a
// string is encoded with add_special_tokens (default true, as vLLM); [string] uses the first
// string; [int] is returned as is; [[int]] returns the first list. Errors: *RequestError for a
// missing, empty or mistyped prompt or a token id outside [0, 2^32).
func (t *Tokenizer) TokenizeCompletion(body []byte) ([]uint32, error) {
	r, err := ParseRequest(body)
	if err != nil {
		return nil, err
	}
	return t.CompletionIDs(r)
}

// CompletionIDs is TokenizeCompletion for a Request. Besides TokenizeCompletion's errors, a
// prompt with a piece longer than MaxExactPieceBytes or of more than MaxPromptTokens tokens is a
// *RequestError (CompletionPromptFor routes the former).
func (t *Tokenizer) CompletionIDs(r *Request) ([]uint32, error) {
	before := InexactPieces()
	ids, encoded, err := t.completionIDs(r)
	if err != nil || !encoded {
		return ids, err
	}
	return exactPrompt(ids, before)
}

// completionIDs is CompletionIDs with estimated pieces left as inexactID; encoded is false for a
// prompt of token ids (returned as they are).
func (t *Tokenizer) completionIDs(r *Request) (ids []uint32, encoded bool, err error) {
	addSpecial, _, err := r.optBool("add_special_tokens", true)
	if err != nil {
		return nil, false, err
	}
	p, err := r.decode("prompt")
	if err != nil {
		return nil, false, err
	}
	if p == nil {
		return nil, false, badRequest("prompt is missing")
	}
	switch p.kind {
	case jString:
		return t.encode(p.s, addSpecial), true, nil
	case jArray:
		if len(p.arr) == 0 {
			return nil, false, badRequest("prompt is an empty array")
		}
		first := p.arr[0]
		switch first.kind {
		case jString:
			for i, e := range p.arr {
				if e.kind != jString {
					return nil, false, badRequest("prompt[%d] is %s, want a string like prompt[0]", i, e.typeName())
				}
			}
			return t.encode(first.s, addSpecial), true, nil
		case jNumber:
			ids, err := tokenIDs(p, "prompt")
			return ids, false, err
		case jArray:
			for i, e := range p.arr {
				if e.kind != jArray {
					return nil, false, badRequest("prompt[%d] is %s, want an array of token ids", i, e.typeName())
				}
			}
			ids, err := tokenIDs(first, "prompt[0]")
			return ids, false, err
		}
		return nil, false, badRequest("prompt[0] is %s, want a string, a token id or an array of token ids", first.typeName())
	}
	return nil, false, badRequest("prompt is %s, want a string, [string], [int] or [[int]]", p.typeName())
}

func tokenIDs(arr *jval, where string) ([]uint32, error) {
	out := make([]uint32, len(arr.arr))
	for i, e := range arr.arr {
		if e.kind != jNumber || strings.ContainsAny(e.s, ".eE") {
			return nil, badRequest("%s[%d] is %s, want an integer token id", where, i, describe(e))
		}
		n, err := strconv.ParseUint(e.s, 10, 32)
		if err != nil {
			return nil, badRequest("%s[%d] = %s is not a token id in [0, 2^32)", where, i, e.s)
		}
		out[i] = uint32(n)
	}
	return out, nil
}

func describe(v *jval) string {
	if v != nil && v.kind == jNumber {
		return "the number " + v.s
	}
	return v.typeName()
}

// TokenizeResponses returns the token ids of a Responses API body (epp.md §5.4 `local`,
// responses): instructions become a leading system message; a string input one user message;
// array items with a role become {role, content} with the concatenated text of their
// input_text/output_text parts; other items are skipped; the result is rendered and encoded as
// a chat (add_generation_prompt true, add_special_tokens false). Errors: *RequestError for a
// malformed body or a prompt beyond TokenizeChat's bounds, ErrStateful when previous_response_id
// is set, ErrNoChatTemplate.
func (t *Tokenizer) TokenizeResponses(body []byte) ([]uint32, error) {
	r, err := ParseRequest(body)
	if err != nil {
		return nil, err
	}
	return t.ResponsesIDs(r)
}

// ResponsesIDs is TokenizeResponses for a Request.
func (t *Tokenizer) ResponsesIDs(r *Request) ([]uint32, error) {
	prompt, _, err := t.responsesPrompt(r, false)
	if err != nil {
		return nil, err
	}
	before := InexactPieces()
	return exactPrompt(t.encode(prompt, false), before)
}

// ResponsesPromptFor tokenizes a stateless Responses body for routing, as ResponsesIDs does for
// text, except that image parts (input_image, image_url) are not skipped: as in
// TokenizeChatPrompt, the text before the first image is encoded exactly (minus backOffTokens,
// since the engine's placeholder there is model-specific) and everything from it on — the
// remaining text plus imageTokens ids per image — comes after UncachedFrom. Errors as
// TokenizeResponses.
func (t *Tokenizer) ResponsesPromptFor(r *Request, imageTokens int) (ChatPrompt, error) {
	prompt, images, err := t.responsesPrompt(r, true)
	if err != nil {
		return ChatPrompt{}, err
	}
	return t.splitAtImages(prompt, images, false, imageTokens, nil)
}

// responsesPrompt renders a Responses body as a chat; with sentinels, each image part is written
// as imageSentinel into its message's text.
func (t *Tokenizer) responsesPrompt(r *Request, sentinels bool) (prompt string, images int, err error) {
	if prev := r.get("previous_response_id"); prev != nil && prev[0] != 'n' {
		return "", 0, ErrStateful
	}
	msgs := &jval{kind: jArray}
	addMsg := func(role *jval, content string) {
		m := newObject()
		m.set("role", role)
		m.set("content", jstr(content))
		msgs.arr = append(msgs.arr, m)
	}
	ins, err := r.decode("instructions")
	if err != nil {
		return "", 0, err
	}
	if ins != nil && ins.kind != jNull {
		if ins.kind != jString {
			return "", 0, badRequest("instructions is %s, want a string", ins.typeName())
		}
		addMsg(jstr("system"), ins.s)
	}
	input, err := r.decode("input")
	if err != nil {
		return "", 0, err
	}
	switch {
	case input == nil:
		return "", 0, badRequest("input is missing")
	case input.kind == jString:
		addMsg(jstr("user"), input.s)
	case input.kind == jArray:
		for i, item := range input.arr {
			if item.kind != jObject {
				return "", 0, badRequest("input[%d] is %s, want an object", i, item.typeName())
			}
			role := item.get("role")
			if role == nil {
				continue // function_call, reasoning and other non-message items
			}
			if role.kind != jString {
				return "", 0, badRequest("input[%d].role is %s, want a string", i, role.typeName())
			}
			text, n, err := responsesText(item.get("content"), i, sentinels)
			if err != nil {
				return "", 0, err
			}
			images += n
			addMsg(role, text)
		}
	default:
		return "", 0, badRequest("input is %s, want a string or an array", input.typeName())
	}
	prompt, err = t.render(&chatInput{messages: msgs, addGenerationPrompt: true})
	return prompt, images, err
}

func responsesText(c *jval, i int, sentinels bool) (text string, images int, err error) {
	if c == nil || c.kind == jNull {
		return "", 0, nil
	}
	switch c.kind {
	case jString:
		return c.s, 0, nil
	case jArray:
		var b strings.Builder
		for k, p := range c.arr {
			if p.kind != jObject {
				return "", 0, badRequest("input[%d].content[%d] is %s, want an object", i, k, p.typeName())
			}
			typ := p.get("type")
			if sentinels && typ != nil && typ.kind == jString && imagePartTypes[typ.s] {
				b.WriteString(imageSentinel)
				images++
				continue
			}
			if typ == nil || typ.kind != jString || (typ.s != "input_text" && typ.s != "output_text") {
				continue
			}
			tx := p.get("text")
			if tx == nil || tx.kind != jString {
				return "", 0, badRequest("input[%d].content[%d].text is %s, want a string", i, k, tx.typeName())
			}
			b.WriteString(tx.s)
		}
		return b.String(), images, nil
	}
	return "", 0, badRequest("input[%d].content is %s, want a string or an array of parts", i, c.typeName())
}
