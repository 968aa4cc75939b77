package tokenizer

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
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

// parseBody decodes a request body as an order-keeping JSON object and validates `model`.
func parseBody(body []byte) (*jval, error) {
	v, err := decodeOrdered(body)
	if err != nil {
		return nil, &RequestError{Msg: "request body is not valid JSON", Err: err}
	}
	if v.kind != jObject {
		return nil, badRequest("request body is a JSON %s, want an object", v.typeName())
	}
	if m := v.get("model"); m != nil && m.kind != jString {
		return nil, badRequest("model is %s, want a string", m.typeName())
	}
	return v, nil
}

// optBool reads an optional boolean field (absent or null → def).
func optBool(obj *jval, key string, def bool) (bool, bool, error) {
	v := obj.get(key)
	if v == nil || v.kind == jNull {
		return def, false, nil
	}
	if v.kind != jBool {
		return false, false, badRequest("%s is %s, want a boolean", key, v.typeName())
	}
	return v.b, true, nil
}

// chatInputFromBody extracts the template inputs of a chat completions body (epp.md §5.4).
func chatInputFromBody(obj *jval) (*chatInput, bool, error) {
	msgs := obj.get("messages")
	if msgs == nil || msgs.kind != jArray {
		return nil, false, badRequest("messages is %s, want an array", msgs.typeName())
	}
	in := &chatInput{messages: msgs}
	if tools := obj.get("tools"); tools != nil && tools.kind != jNull {
		if tools.kind != jArray {
			return nil, false, badRequest("tools is %s, want an array", tools.typeName())
		}
		in.tools = tools
	}
	if kw := obj.get("chat_template_kwargs"); kw != nil && kw.kind != jNull {
		if kw.kind != jObject {
			return nil, false, badRequest("chat_template_kwargs is %s, want an object", kw.typeName())
		}
		in.kwargs = kw
	}
	agp, agpSet, err := optBool(obj, "add_generation_prompt", true)
	if err != nil {
		return nil, false, err
	}
	cont, _, err := optBool(obj, "continue_final_message", false)
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
	addSpecial, _, err := optBool(obj, "add_special_tokens", false)
	if err != nil {
		return nil, false, err
	}
	return in, addSpecial, nil
}

// RenderChat renders a chat completions request body (epp.md §5.4 `local`, chat) with the
// model's chat template and returns the prompt text: messages preprocessed as vLLM does, tools
// when given, add_generation_prompt (default true; false with continue_final_message),
// chat_template_kwargs merged, bos_token/eos_token. Errors: *RequestError (ErrBadRequest) for a
// malformed body, a non-text content part or a template that raises over the request;
// ErrNoChatTemplate when the model has none; any other error (a template engine failure) is
// server-side.
func (t *Tokenizer) RenderChat(body []byte) (string, error) {
	obj, err := parseBody(body)
	if err != nil {
		return "", err
	}
	in, _, err := chatInputFromBody(obj)
	if err != nil {
		return "", err
	}
	return t.render(in)
}

// TokenizeChat returns the token ids vLLM computes for a chat completions body: the rendered
// prompt (RenderChat) encoded with add_special_tokens=false unless the body sets
// add_special_tokens: true. Errors as RenderChat.
func (t *Tokenizer) TokenizeChat(body []byte) ([]uint32, error) {
	obj, err := parseBody(body)
	if err != nil {
		return nil, err
	}
	in, addSpecial, err := chatInputFromBody(obj)
	if err != nil {
		return nil, err
	}
	prompt, err := t.render(in)
	if err != nil {
		return nil, err
	}
	return t.Encode(prompt, addSpecial), nil
}

// TokenizeCompletion returns the token ids of a completions body's prompt (epp.md §5.3-5.4): a
// string is encoded with add_special_tokens (default true, as vLLM); [string] uses the first
// string; [int] is returned as is; [[int]] returns the first list. Errors: *RequestError for a
// missing, empty or mistyped prompt or a token id outside [0, 2^32).
func (t *Tokenizer) TokenizeCompletion(body []byte) ([]uint32, error) {
	obj, err := parseBody(body)
	if err != nil {
		return nil, err
	}
	addSpecial, _, err := optBool(obj, "add_special_tokens", true)
	if err != nil {
		return nil, err
	}
	p := obj.get("prompt")
	if p == nil {
		return nil, badRequest("prompt is missing")
	}
	switch p.kind {
	case jString:
		return t.Encode(p.s, addSpecial), nil
	case jArray:
		if len(p.arr) == 0 {
			return nil, badRequest("prompt is an empty array")
		}
		first := p.arr[0]
		switch first.kind {
		case jString:
			for i, e := range p.arr {
				if e.kind != jString {
					return nil, badRequest("prompt[%d] is %s, want a string like prompt[0]", i, e.typeName())
				}
			}
			return t.Encode(first.s, addSpecial), nil
		case jNumber:
			return tokenIDs(p, "prompt")
		case jArray:
			for i, e := range p.arr {
				if e.kind != jArray {
					return nil, badRequest("prompt[%d] is %s, want an array of token ids", i, e.typeName())
				}
			}
			return tokenIDs(first, "prompt[0]")
		}
		return nil, badRequest("prompt[0] is %s, want a string, a token id or an array of token ids", first.typeName())
	}
	return nil, badRequest("prompt is %s, want a string, [string], [int] or [[int]]", p.typeName())
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
// malformed body, ErrStateful when previous_response_id is set, ErrNoChatTemplate.
func (t *Tokenizer) TokenizeResponses(body []byte) ([]uint32, error) {
	obj, err := parseBody(body)
	if err != nil {
		return nil, err
	}
	if prev := obj.get("previous_response_id"); prev != nil && prev.kind != jNull {
		return nil, ErrStateful
	}
	msgs := &jval{kind: jArray}
	addMsg := func(role *jval, content string) {
		m := newObject()
		m.set("role", role)
		m.set("content", jstr(content))
		msgs.arr = append(msgs.arr, m)
	}
	if ins := obj.get("instructions"); ins != nil && ins.kind != jNull {
		if ins.kind != jString {
			return nil, badRequest("instructions is %s, want a string", ins.typeName())
		}
		addMsg(jstr("system"), ins.s)
	}
	input := obj.get("input")
	switch {
	case input == nil:
		return nil, badRequest("input is missing")
	case input.kind == jString:
		addMsg(jstr("user"), input.s)
	case input.kind == jArray:
		for i, item := range input.arr {
			if item.kind != jObject {
				return nil, badRequest("input[%d] is %s, want an object", i, item.typeName())
			}
			role := item.get("role")
			if role == nil {
				continue // function_call, reasoning and other non-message items
			}
			if role.kind != jString {
				return nil, badRequest("input[%d].role is %s, want a string", i, role.typeName())
			}
			text, err := responsesText(item.get("content"), i)
			if err != nil {
				return nil, err
			}
			addMsg(role, text)
		}
	default:
		return nil, badRequest("input is %s, want a string or an array", input.typeName())
	}
	prompt, err := t.render(&chatInput{messages: msgs, addGenerationPrompt: true})
	if err != nil {
		return nil, err
	}
	return t.Encode(prompt, false), nil
}

func responsesText(c *jval, i int) (string, error) {
	if c == nil || c.kind == jNull {
		return "", nil
	}
	switch c.kind {
	case jString:
		return c.s, nil
	case jArray:
		var b strings.Builder
		for k, p := range c.arr {
			if p.kind != jObject {
				return "", badRequest("input[%d].content[%d] is %s, want an object", i, k, p.typeName())
			}
			typ := p.get("type")
			if typ == nil || typ.kind != jString || (typ.s != "input_text" && typ.s != "output_text") {
				continue
			}
			tx := p.get("text")
			if tx == nil || tx.kind != jString {
				return "", badRequest("input[%d].content[%d].text is %s, want a string", i, k, tx.typeName())
			}
			b.WriteString(tx.s)
		}
		return b.String(), nil
	}
	return "", badRequest("input[%d].content is %s, want a string or an array of parts", i, c.typeName())
}
