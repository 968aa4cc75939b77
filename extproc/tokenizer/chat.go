package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode"

	"github.com/ardanlabs/jinja"
)

// ErrNoChatTemplate is returned by the chat and responses paths when the model directory has no
// chat template (Llama 2's files, say). It is a *RequestError: vLLM answers such a chat request
// with 400 too (transformers refuses to apply a template that is not there), and completions
// still work.
var ErrNoChatTemplate error = &RequestError{Msg: "this model has no chat template (no chat_template in tokenizer_config.json and no chat_template.jinja), so a chat request cannot be rendered; send a completions request with a prompt instead"}

// HasChatTemplate reports whether the model has a chat template, i.e. whether chat and
// Responses requests can be tokenized (else they fail with ErrNoChatTemplate).
func (t *Tokenizer) HasChatTemplate() bool { return t.chat != nil && len(t.chat.templates) > 0 }

// chatTemplate is one compiled chat template.
type chatTemplate struct {
	name  string
	tmpl  *jinja.Template
	texts jinja.Value // the prepared template's text pieces (kvepp_text)
	// openAIContent is vLLM's "openai" content format: the template iterates over message
	// content, so content is passed as a list of {"type":"text","text":…} parts rather than a
	// string (vLLM's auto-detection, approximated from the template source).
	openAIContent bool
	// plan is the template's incremental rendering proof (nil: none, conversations are rendered
	// whole); cacheID tells its entries apart in a ConversationCache.
	plan    *incrementalPlan
	cacheID uint64
	// splits are the template's str.split call sites, checked against MaxTemplateSplitValues
	// before every render.
	splits splitBudget
	// splice is the template's splice proof (nil: none, every render is a full one) and
	// skeletons its memoized stand-in renders (splice.go).
	splice    *spliceProof
	skeletons skeletonCache
}

// chatConfig is the chat part of tokenizer_config.json.
type chatConfig struct {
	templates map[string]*chatTemplate
	// specialTokens are the special_tokens_map entries transformers passes to the template
	// (bos_token, eos_token, pad_token, unk_token) when set.
	specialTokens []struct{ name, value string }
}

// contentLoopRE finds `{% for x in y.content %}` / `{% for x in y['content'] %}`.
var contentLoopRE = regexp.MustCompile(`\{%-?\s*for\s+\w+(?:\s*,\s*\w+)?\s+in\s+\w+\s*(?:\.\s*content\b|\[\s*['"]content['"]\s*\])`)

func compileChatTemplate(name, src string) (*chatTemplate, error) {
	pt := prepareTemplate(src)
	tmpl, err := jinja.Compile(pt.src)
	if err != nil {
		return nil, fmt.Errorf("compile chat template %q: %w", name, err)
	}
	digest := templateDigest(src)
	return &chatTemplate{name: name, tmpl: tmpl, texts: pt.texts, openAIContent: contentLoopRE.MatchString(src),
		plan: provenTemplates[digest], splice: splicedTemplates[digest], cacheID: cacheIDs.Add(1), splits: parseSplitBudget(src)}, nil
}

func parseChatConfig(cfgData, jinjaFile []byte) (*chatConfig, error) {
	var cfg map[string]json.RawMessage
	if cfgData != nil {
		if err := json.Unmarshal(cfgData, &cfg); err != nil {
			return nil, fmt.Errorf("parse tokenizer_config.json: %w", err)
		}
	}
	cc := &chatConfig{templates: map[string]*chatTemplate{}}
	for _, name := range []string{"bos_token", "eos_token", "pad_token", "unk_token"} {
		raw, ok := cfg[name]
		if !ok || isNull(raw) {
			continue
		}
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			var obj struct {
				Content *string `json:"content"`
			}
			if err2 := json.Unmarshal(raw, &obj); err2 != nil || obj.Content == nil {
				return nil, fmt.Errorf("%s: want a string or {\"content\": …}, got %s", name, truncate(string(raw), 80))
			}
			s = *obj.Content
		}
		cc.specialTokens = append(cc.specialTokens, struct{ name, value string }{name, s})
	}
	if jinjaFile != nil {
		t, err := compileChatTemplate("default", string(jinjaFile))
		if err != nil {
			return nil, err
		}
		cc.templates["default"] = t
		return cc, nil
	}
	raw, ok := cfg["chat_template"]
	if !ok || isNull(raw) {
		return cc, nil
	}
	var one string
	if err := json.Unmarshal(raw, &one); err == nil {
		t, err := compileChatTemplate("default", one)
		if err != nil {
			return nil, err
		}
		cc.templates["default"] = t
		return cc, nil
	}
	var list []struct {
		Name     string `json:"name"`
		Template string `json:"template"`
	}
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, fmt.Errorf("chat_template: want a string or a list of {name, template}: %w", err)
	}
	for _, e := range list {
		t, err := compileChatTemplate(e.Name, e.Template)
		if err != nil {
			return nil, err
		}
		cc.templates[e.Name] = t
	}
	return cc, nil
}

// pick chooses the template as transformers does: "tool_use" when tools are given and it exists,
// else "default", else the only one.
func (cc *chatConfig) pick(hasTools bool) (*chatTemplate, error) {
	if hasTools {
		if t, ok := cc.templates["tool_use"]; ok {
			return t, nil
		}
	}
	if t, ok := cc.templates["default"]; ok {
		return t, nil
	}
	if len(cc.templates) == 1 {
		for _, t := range cc.templates {
			return t, nil
		}
	}
	if len(cc.templates) == 0 {
		return nil, ErrNoChatTemplate
	}
	names := make([]string, 0, len(cc.templates))
	for n := range cc.templates {
		names = append(names, n)
	}
	return nil, fmt.Errorf("%w: no \"default\" among named templates %q", ErrNoChatTemplate, names)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// chatInput is a chat request reduced to what the template sees.
type chatInput struct {
	messages *jval // array; nil until decodeMessages when built from a Request
	// messagesRaw is the request's raw messages array (nil for inputs built from decoded values,
	// such as a Responses request's); messageElems its elements' offsets when the caller found
	// them (Member.Elements).
	messagesRaw         []byte
	messageElems        [][2]int
	tools               *jval // array or nil
	addGenerationPrompt bool
	continueFinal       bool
	kwargs              *jval // object or nil (chat_template_kwargs)
	images              imageMode
	// toolsRaw and kwargsRaw are the raw tools and chat_template_kwargs (nil when absent or
	// null): with the template they are what the rendering of a conversation prefix depends on
	// besides its messages (the conversation cache's key).
	toolsRaw, kwargsRaw []byte
}

// decodeMessages decodes the raw messages array once.
func (in *chatInput) decodeMessages() error {
	if in.messages != nil {
		return nil
	}
	v, err := decodeValid(in.messagesRaw)
	if err != nil {
		return &RequestError{Msg: "messages is not valid JSON", Err: err}
	}
	in.messages = v
	return nil
}

// render renders the chat template over in as vLLM + transformers do (tokenizer.md "What the
// engine does"): vLLM's conversation preprocessing, tools as model_dump()s, the special tokens
// map, chat_template_kwargs merged last, and continue_final_message trimming.
func (t *Tokenizer) render(in *chatInput) (string, error) {
	if t.chat == nil {
		return "", ErrNoChatTemplate
	}
	tmpl, err := t.chat.pick(in.tools != nil)
	if err != nil {
		return "", err
	}
	if err := in.decodeMessages(); err != nil {
		return "", err
	}
	conv, err := conversation(in.messages.arr, 0, tmpl.openAIContent, in.images)
	if err != nil {
		return "", err
	}
	out, err := t.renderConversation(tmpl, in, conv, in.addGenerationPrompt)
	if err != nil {
		return "", err
	}
	if in.continueFinal {
		out, err = trimToFinalMessage(out, conv)
		if err != nil {
			return "", err
		}
	}
	return out, nil
}

// renderConversation renders tmpl over the preprocessed conversation conv with in's tools and
// chat_template_kwargs and the given add_generation_prompt (no continue_final_message trimming).
func (t *Tokenizer) renderConversation(tmpl *chatTemplate, in *chatInput, conv *jval, addGenerationPrompt bool) (string, error) {
	var tools *jval
	if in.tools != nil {
		var err error
		if tools, err = dumpTools(in.tools); err != nil {
			return "", err
		}
	}
	if err := tmpl.splits.check(conv, tools, in.kwargs); err != nil {
		return "", err
	}
	if out, ok := t.spliced(tmpl, in, conv, tools, addGenerationPrompt); ok {
		return out, nil
	}
	return t.renderTemplate(tmpl, in, conv, tools, addGenerationPrompt)
}

// renderTemplate is renderConversation's full jinja render, tools already dumped and the split
// budget checked.
func (t *Tokenizer) renderTemplate(tmpl *chatTemplate, in *chatInput, conv, tools *jval, addGenerationPrompt bool) (string, error) {
	vb := &valueBuilder{}
	// Sized for every variable set below: a map grown past its hint rehashes on every render.
	nvars := len(t.chat.specialTokens) + renderVars
	if in.kwargs != nil {
		nvars += len(in.kwargs.keys)
	}
	data := make(map[string]jinja.Value, nvars)
	for _, st := range t.chat.specialTokens {
		data[st.name] = jinja.NewString(st.value)
	}
	data["tools"] = jinja.None()
	if tools != nil {
		data["tools"] = vb.value(tools)
	}
	data["documents"] = jinja.None()
	data["add_generation_prompt"] = jinja.NewBool(addGenerationPrompt)
	if in.kwargs != nil {
		for i, k := range in.kwargs.keys {
			switch k {
			case "messages", "conversation", "chat_template", "tokenize":
				continue // consumed by vLLM/transformers, never template variables
			}
			data[k] = vb.value(in.kwargs.vals[i])
		}
	}
	data["messages"] = vb.value(conv)
	data[tojsonFilterName] = newToJSONFilter(vb.bigInts)
	data[strftimeNowName] = strftimeNow
	data[textVarName] = tmpl.texts
	out, err := renderSafely(tmpl.tmpl, data)
	if err != nil {
		if errors.Is(err, errTemplatePanic) {
			return "", err // an engine defect, not the client's fault
		}
		// The template raised (raise_exception) or failed over this request's content:
		// vLLM answers 400.
		return "", &RequestError{Msg: "chat template rendering failed", Err: err}
	}
	return out, nil
}

// renderVars counts the variables renderConversation sets besides the special tokens and the
// chat_template_kwargs: tools, documents, add_generation_prompt, messages, the tojson filter,
// strftime_now and the template's text table.
const renderVars = 7

// errTemplatePanic marks a panic inside the template engine: a server-side defect (502), unlike a
// template error over the request (400).
var errTemplatePanic = errors.New("chat template engine panicked")

// renderSafely turns a panic inside the template engine into an error wrapping errTemplatePanic:
// bad input never panics.
func renderSafely(tmpl *jinja.Template, data map[string]jinja.Value) (out string, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %v", errTemplatePanic, r)
		}
	}()
	return tmpl.RenderValues(data)
}

// trimToFinalMessage implements transformers' continue_final_message: cut the rendered chat
// right after the final message's content so the model continues it.
func trimToFinalMessage(rendered string, conv *jval) (string, error) {
	if len(conv.arr) == 0 {
		return "", &RequestError{Msg: "continue_final_message is set but there are no messages"}
	}
	content := conv.arr[len(conv.arr)-1].get("content")
	var final string
	switch {
	case content != nil && content.kind == jString:
		final = content.s
	case content != nil && content.kind == jArray:
		found := false
		for i := len(content.arr) - 1; i >= 0; i-- {
			if tx := content.arr[i].get("text"); tx != nil && tx.kind == jString {
				final, found = tx.s, true
				break
			}
		}
		if !found {
			return "", &RequestError{Msg: "continue_final_message is set but we could not find any text to continue in the final message"}
		}
	default:
		return "", &RequestError{Msg: "continue_final_message is set but the final message has no text content"}
	}
	stripped := strings.TrimFunc(final, isPySpace)
	loc := strings.LastIndex(rendered, stripped)
	if loc < 0 {
		return "", &RequestError{Msg: "continue_final_message is set but the final message does not appear in the chat after applying the chat template"}
	}
	left := strings.TrimLeftFunc(final, isPySpace)
	if end := loc + len(left); end <= len(rendered) && rendered[loc:end] == final {
		return rendered[:end], nil
	}
	return rendered[:loc+len(stripped)], nil
}

// isPySpace is Python's str.isspace for one character.
func isPySpace(r rune) bool {
	return unicode.IsSpace(r) || (r >= 0x1c && r <= 0x1f)
}

// textPartTypes are vLLM's text-like content part types and the field holding their text.
var textPartTypes = map[string]string{
	"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking",
}

// conversation converts request messages into vLLM's ConversationMessage list: role, content
// (parts' texts joined by "\n" in string format; [{"type":"text","text":…}] in openai
// format), then for assistants tool_calls (arguments parsed into objects; empty lists dropped)
// and reasoning/reasoning_content, for tools tool_call_id, and name when it is a string. Each
// message is converted on its own (a tail of a conversation converts exactly as it would in the
// whole); first is the index of messages[0] in the request, for error messages.
func conversation(messages []*jval, first int, openAI bool, images imageMode) (*jval, error) {
	out := &jval{kind: jArray, arr: make([]*jval, 0, len(messages))}
	argBudget := MaxJSONValues // values all tool-call arguments of this conversion may build
	for i, m := range messages {
		i += first
		if m.kind != jObject {
			return nil, badRequest("messages[%d] is %s, want an object", i, m.typeName())
		}
		role := m.get("role")
		if role == nil || role.kind != jString {
			return nil, badRequest("messages[%d].role is %s, want a string", i, role.typeName())
		}
		content := m.get("content")
		// A plain string content in vLLM's string format is its own one text part: reused as is.
		plain := !openAI && content != nil && content.kind == jString
		var cparts []contentPart
		if !plain {
			var err error
			if cparts, err = contentParts(content, i, images); err != nil {
				return nil, err
			}
		}
		msg := newObject()
		msg.set("role", role)
		switch {
		case plain:
			msg.set("content", content) // as the join below would make it
		case openAI:
			parts := &jval{kind: jArray}
			for _, cp := range cparts {
				p := newObject()
				switch {
				case !cp.image:
					p.set("type", jstr("text"))
					p.set("text", jstr(cp.text))
				case images == imagesAsParts:
					p.set("type", jstr("image")) // what vLLM hands the template
				default:
					p.set("type", jstr("text"))
					p.set("text", jstr(imageSentinel))
				}
				parts.arr = append(parts.arr, p)
			}
			msg.set("content", parts)
		default:
			// vLLM's string format: the texts joined by "\n", each image's placeholder put in
			// front of them (_get_full_multimodal_text_prompt).
			var texts, marks []string
			for _, cp := range cparts {
				if cp.image {
					marks = append(marks, imageSentinel)
				} else {
					texts = append(texts, cp.text)
				}
			}
			joined := strings.Join(texts, "\n")
			if len(marks) > 0 {
				joined = strings.Join(append(marks, joined), "\n")
			}
			msg.set("content", jstr(joined))
		}
		switch role.s {
		case "assistant":
			if tc := m.get("tool_calls"); tc != nil && tc.kind != jNull {
				if tc.kind != jArray {
					return nil, badRequest("messages[%d].tool_calls is %s, want an array", i, tc.typeName())
				}
				if len(tc.arr) > 0 {
					if err := parseToolArguments(tc, i, &argBudget); err != nil {
						return nil, err
					}
					msg.set("tool_calls", tc)
				}
			}
			reasoning := m.get("reasoning")
			if !reasoning.truthy() {
				reasoning = m.get("reasoning_content")
			}
			if reasoning != nil && reasoning.kind != jNull {
				msg.set("reasoning", reasoning)
				msg.set("reasoning_content", reasoning)
			}
		case "tool":
			if id := m.get("tool_call_id"); id != nil {
				msg.set("tool_call_id", id)
			}
		}
		if name := m.get("name"); name != nil && name.kind == jString {
			msg.set("name", name)
		}
		out.arr = append(out.arr, msg)
	}
	return out, nil
}

// contentPart is one part of a message content: a text, or an image (images != imagesRefused).
type contentPart struct {
	text  string
	image bool
}

// imagePartTypes are the content part types vLLM accepts as images.
var imagePartTypes = map[string]bool{"image_url": true, "input_image": true, "image_pil": true, "image_embeds": true}

// contentParts returns the parts of message msg's content (string, null or parts). Empty texts are
// kept, as vLLM keeps them ("a", "", "b" joins to "a\n\nb"). Image parts are refused (400) when
// images is imagesRefused, else returned as image parts.
func contentParts(c *jval, msg int, images imageMode) ([]contentPart, error) {
	where := func() string { return fmt.Sprintf("messages[%d].content", msg) } // only for errors
	if c == nil || c.kind == jNull {
		return nil, nil
	}
	switch c.kind {
	case jString:
		return []contentPart{{text: c.s}}, nil
	case jArray:
		var parts []contentPart
		for k, p := range c.arr {
			if p.kind == jString {
				parts = append(parts, contentPart{text: p.s})
				continue
			}
			if p.kind != jObject {
				return nil, badRequest("%s[%d] is %s, want an object", where(), k, p.typeName())
			}
			typ := p.get("type")
			field := ""
			switch {
			case typ != nil && typ.kind == jString && imagePartTypes[typ.s]:
				if images == imagesRefused {
					return nil, badRequest("%s[%d] has type %q: kvepp cannot tokenize images exactly (requests with images are routed by the text before the first image)", where(), k, typ.s)
				}
				parts = append(parts, contentPart{image: true})
				continue
			case typ != nil && typ.kind == jString:
				f, ok := textPartTypes[typ.s]
				if !ok {
					// vLLM answers 400 for a part a text-only model cannot take (input_audio,
					// video_url, file …) and for unknown types alike.
					return nil, badRequest("%s[%d] has type %q: only text and image content parts are accepted (text, input_text, output_text, refusal, thinking, image_url, input_image)", where(), k, typ.s)
				}
				field = f
			case typ == nil && p.get("text") != nil:
				field = "text"
			default:
				return nil, badRequest("%s[%d] has no valid type", where(), k)
			}
			tx := p.get(field)
			if tx == nil || tx.kind == jNull {
				continue
			}
			if tx.kind != jString {
				return nil, badRequest("%s[%d].%s is %s, want a string", where(), k, field, tx.typeName())
			}
			parts = append(parts, contentPart{text: tx.s})
		}
		return parts, nil
	}
	return nil, badRequest("%s is %s, want a string, null or an array of parts", where(), c.typeName())
}

// parseToolArguments applies vLLM's _postprocess_messages: a tool call's function.arguments
// string is parsed into an object; falsy arguments, and a string that does not parse to a JSON
// object (invalid JSON, "null", "[1,2]", "42", two concatenated objects), become {}. The calls
// of one conversion share budget (values the parsed arguments may build); exceeding it is a
// *RequestError.
func parseToolArguments(calls *jval, msgIndex int, budget *int) error {
	for k, call := range calls.arr {
		if call.kind != jObject {
			return badRequest("messages[%d].tool_calls[%d] is %s, want an object", msgIndex, k, call.typeName())
		}
		fn := call.get("function")
		if fn == nil || fn.kind != jObject {
			return badRequest("messages[%d].tool_calls[%d].function is %s, want an object", msgIndex, k, fn.typeName())
		}
		args := fn.get("arguments")
		switch {
		case !args.truthy():
			fn.set("arguments", newObject())
		case args.kind == jObject || args.kind == jArray:
		case args.kind == jString:
			// The arguments of all tool calls share one budget of values: strings are not
			// counted by the body's scan, so this is what bounds them.
			parsed, n, err := decodeOrderedLimit([]byte(args.s), max(*budget, 1)) // (a limit of 0 means none)
			*budget -= n
			if *budget < 0 {
				return badRequest("the tool-call arguments hold more than %d JSON values", MaxJSONValues)
			}
			if err != nil || parsed.kind != jObject {
				parsed = newObject()
			}
			fn.set("arguments", parsed)
		default:
			return badRequest("messages[%d].tool_calls[%d].function.arguments is %s, want a JSON string", msgIndex, k, args.typeName())
		}
	}
	return nil
}

// dumpTools reproduces vLLM's [tool.model_dump() for tool in request.tools]: declared fields
// first (type, function{name, description, parameters}) with their defaults, then any extra
// keys in request order.
func dumpTools(tools *jval) (*jval, error) {
	out := &jval{kind: jArray}
	for i, tl := range tools.arr {
		if tl.kind != jObject {
			return nil, badRequest("tools[%d] is %s, want an object", i, tl.typeName())
		}
		typ := tl.get("type")
		if typ == nil {
			typ = jstr("function")
		} else if typ.kind != jString || typ.s != "function" {
			return nil, badRequest("tools[%d].type must be \"function\"", i)
		}
		fn := tl.get("function")
		if fn == nil || fn.kind != jObject {
			return nil, badRequest("tools[%d].function is %s, want an object", i, fn.typeName())
		}
		name := fn.get("name")
		if name == nil || name.kind != jString {
			return nil, badRequest("tools[%d].function.name is %s, want a string", i, name.typeName())
		}
		desc := fn.get("description")
		if desc == nil {
			desc = &jval{kind: jNull}
		} else if desc.kind != jString && desc.kind != jNull {
			return nil, badRequest("tools[%d].function.description is %s, want a string", i, desc.typeName())
		}
		params := fn.get("parameters")
		if params == nil {
			params = &jval{kind: jNull}
		} else if params.kind != jObject && params.kind != jNull {
			return nil, badRequest("tools[%d].function.parameters is %s, want an object", i, params.typeName())
		}
		f := newObject()
		f.set("name", name)
		f.set("description", desc)
		f.set("parameters", params)
		for k, key := range fn.keys {
			if key != "name" && key != "description" && key != "parameters" {
				f.set(key, fn.vals[k])
			}
		}
		t := newObject()
		t.set("type", typ)
		t.set("function", f)
		for k, key := range tl.keys {
			if key != "type" && key != "function" {
				t.set(key, tl.vals[k])
			}
		}
		out.arr = append(out.arr, t)
	}
	return out, nil
}
