package tokenizer

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ardanlabs/jinja"
	"github.com/google/go-cmp/cmp"
)

type chatGolden struct {
	Cases []struct {
		Name           string   `json:"name"`
		Path           string   `json:"path"`
		Body           string   `json:"body"` // JSON text, kept verbatim (number literals matter)
		RenderedPrompt string   `json:"rendered_prompt"`
		TokenIDs       []uint32 `json:"token_ids"`
	} `json:"cases"`
	ToJSON []struct {
		Name     string `json:"name"`
		Template string `json:"template"`
		Data     string `json:"data"`
		Output   string `json:"output"`
	} `json:"tojson"`
}

// TestChatMatchesPythonJinja2 compares rendering and tokenization with Python jinja2 configured
// as transformers does over vLLM-preprocessed requests (testdata/gen_chat_golden.py): tools with
// floats, big integers and unicode, tool-call round trips, reasoning, enable_thinking,
// continue_final_message, content parts, Responses bodies.
func TestChatMatchesPythonJinja2(t *testing.T) {
	tk := qwen3(t)
	var g chatGolden
	readJSON(t, filepath.Join("testdata", "qwen3-chat-golden.json"), &g)
	if len(g.Cases) < 10 {
		t.Fatalf("only %d cases", len(g.Cases))
	}
	for _, c := range g.Cases {
		t.Run(c.Name+" renders and tokenizes like the reference", func(t *testing.T) {
			var ids []uint32
			var err error
			if strings.HasSuffix(c.Path, "/responses") {
				ids, err = tk.TokenizeResponses([]byte(c.Body))
			} else {
				prompt, err := tk.RenderChat([]byte(c.Body))
				if err != nil {
					t.Fatalf("RenderChat: %v", err)
				}
				if diff := cmp.Diff(c.RenderedPrompt, prompt); diff != "" {
					t.Fatalf("prompt differs (-want +got):\n%s", diff)
				}
				ids, err = tk.TokenizeChat([]byte(c.Body))
			}
			if err != nil {
				t.Fatalf("tokenize: %v", err)
			}
			if diff := cmp.Diff(c.TokenIDs, ids); diff != "" {
				t.Fatalf("token ids differ (-want +got):\n%s", diff)
			}
		})
	}
}

// TestTemplatesMatchJinja2 renders small templates (tojson variants, whitespace control) and
// compares with Python jinja2 configured as transformers does, json.dumps for tojson.
func TestTemplatesMatchJinja2(t *testing.T) {
	var g chatGolden
	readJSON(t, filepath.Join("testdata", "qwen3-chat-golden.json"), &g)
	if len(g.ToJSON) == 0 {
		t.Fatal("no tojson cases")
	}
	for _, c := range g.ToJSON {
		t.Run("template "+c.Name+" renders like jinja2", func(t *testing.T) {
			ct, err := compileChatTemplate(c.Name, c.Template)
			if err != nil {
				t.Fatal(err)
			}
			data, err := decodeOrdered([]byte(c.Data))
			if err != nil {
				t.Fatal(err)
			}
			vb := &valueBuilder{}
			vals := map[string]jinja.Value{}
			for i, k := range data.keys {
				vals[k] = vb.value(data.vals[i])
			}
			vals[tojsonFilterName] = newToJSONFilter(vb.bigInts)
			vals[textVarName] = ct.texts
			got, err := ct.tmpl.RenderValues(vals)
			if err != nil {
				t.Fatal(err)
			}
			if got != c.Output {
				t.Fatalf("got  %q\nwant %q", got, c.Output)
			}
		})
	}
}

func TestPyFloatRepr(t *testing.T) {
	tests := []struct {
		in   float64
		want string
	}{
		{1, "1.0"}, {-0.0 * -1, "0.0"}, {1e21, "1e+21"}, {1.5e-7, "1.5e-07"}, {1e16, "1e+16"}, {1e15, "1000000000000000.0"},
		{0.0001, "0.0001"}, {0.00001, "1e-05"}, {123.456, "123.456"}, {-2.5, "-2.5"}, {5e-324, "5e-324"}, {1.7976931348623157e308, "1.7976931348623157e+308"},
	}
	for _, tc := range tests {
		t.Run("formats "+tc.want+" like Python repr", func(t *testing.T) {
			if got := pyFloatRepr(tc.in); got != tc.want {
				t.Fatalf("pyFloatRepr(%v) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
	t.Run("negative zero keeps its sign", func(t *testing.T) {
		negZero := -1 * 0.0
		negZero = negZero * -1 * -1
		if got := pyFloatRepr(negZero); got != "-0.0" && got != "0.0" {
			t.Fatalf("got %q", got)
		}
		v, _ := decodeOrdered([]byte(`-0.0`))
		if got, _ := pyToJSON((&valueBuilder{}).value(v), nil); got != "-0.0" {
			t.Fatalf("tojson(-0.0) = %q", got)
		}
	})
}

// TestPrepareTemplateRenamesToJSON checks the template-source rewrite renames the filter only.
func TestPrepareTemplateRenamesToJSON(t *testing.T) {
	tests := []struct{ name, in, want string }{
		{"a filter in an expression is renamed", "{{ x | tojson }}", "{{ x | kvepp_tojson }}"},
		{"a filter without spaces is renamed", "{{x|tojson(indent=2)}}", "{{x|kvepp_tojson(indent=2)}}"},
		{"a filter in a statement is renamed", "{% set y = x|tojson %}", "{% set y = x|kvepp_tojson %}"},
		{"text outside tags is untouched", "a|tojson{{ 1 }}", "a|tojson{{ 1 }}"},
		{"text ending in a space is passed as a variable", "a {{ 1 }}", "{{ kvepp_text[0] }}{{ 1 }}"},
		{"string literals are untouched", `{{ "|tojson" ~ '|tojson' }}`, `{{ "|tojson" ~ '|tojson' }}`},
		{"comments are dropped", "{# x|tojson #}", ""},
		{"raw blocks become literal text", "{% raw %}{{ x|tojson }}{% endraw %}", "{{ kvepp_text[0] }}"},
		{"a longer identifier is not the filter", "{{ x|tojsonish }}", "{{ x|tojsonish }}"},
		{"nested braces do not end an expression", "{{ {'a': {'b': 1}}|tojson }}", "{{ {'a': {'b': 1} }|kvepp_tojson }}"},
		{"whitespace markers are removed", "{{- x -}}{%- if y -%}{%+ endif +%}", "{{ x }}{% if y %}{% endif %}"},
		{"an unterminated tag does not panic", "{{ x|tojson", "{{ x|kvepp_tojson"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := prepareTemplate(tc.in).src; got != tc.want {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
		})
	}
}

// TestRequestErrors checks that malformed bodies fail with typed errors and never panic.
func TestRequestErrors(t *testing.T) {
	tk := qwen3(t)
	type call func([]byte) ([]uint32, error)
	chat, comp, resp := call(tk.TokenizeChat), call(tk.TokenizeCompletion), call(tk.TokenizeResponses)
	tests := []struct {
		name   string
		fn     call
		body   string
		target error
	}{
		{"a non-JSON chat body is a bad request", chat, `{"messages":`, ErrBadRequest},
		{"a JSON array body is a bad request", chat, `[1]`, ErrBadRequest},
		{"trailing data after the object is a bad request", chat, `{"messages":[]} x`, ErrBadRequest},
		{"a non-string model is a bad request", chat, `{"model":1,"messages":[]}`, ErrBadRequest},
		{"missing messages is a bad request", chat, `{"model":"m"}`, ErrBadRequest},
		{"messages as a string is a bad request", chat, `{"messages":"hi"}`, ErrBadRequest},
		{"a message without a role is a bad request", chat, `{"messages":[{"content":"x"}]}`, ErrBadRequest},
		{"a tool without a name is a bad request", chat, `{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{}}]}`, ErrBadRequest},
		{"chat_template_kwargs as a list is a bad request", chat, `{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":[]}`, ErrBadRequest},
		{"both continue_final_message and add_generation_prompt is a bad request", chat, `{"messages":[{"role":"assistant","content":"x"}],"continue_final_message":true,"add_generation_prompt":true}`, ErrBadRequest},
		{"an image part is a bad request for a text-only tokenizer", chat, `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`, ErrBadRequest},
		{"a missing prompt is a bad request", comp, `{"model":"m"}`, ErrBadRequest},
		{"an empty prompt list is a bad request", comp, `{"prompt":[]}`, ErrBadRequest},
		{"a mixed prompt list is a bad request", comp, `{"prompt":["a",1]}`, ErrBadRequest},
		{"a negative token id is a bad request", comp, `{"prompt":[1,-2]}`, ErrBadRequest},
		{"a fractional token id is a bad request", comp, `{"prompt":[1.5]}`, ErrBadRequest},
		{"a token id above 2^32 is a bad request", comp, `{"prompt":[[4294967296]]}`, ErrBadRequest},
		{"a prompt object is a bad request", comp, `{"prompt":{}}`, ErrBadRequest},
		{"responses without input is a bad request", resp, `{"instructions":"x"}`, ErrBadRequest},
		{"responses input as a number is a bad request", resp, `{"input":3}`, ErrBadRequest},
		{"responses with previous_response_id is stateful", resp, `{"input":"x","previous_response_id":"r1"}`, ErrStateful},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.fn([]byte(tc.body))
			if !errors.Is(err, tc.target) {
				t.Fatalf("err = %v, want errors.Is %v", err, tc.target)
			}
			var re *RequestError
			if tc.target == ErrBadRequest && !errors.As(err, &re) {
				t.Fatalf("err %T is not a *RequestError", err)
			}
		})
	}
}

// TestMalformedChatFieldsAreClientErrors checks the fresh-user QA bodies: every chat field of the
// wrong type or shape and a content part a text-only model cannot take fail with a *RequestError that reports BadRequest() (the marker extproc maps to 400
// invalid_request_error, epp.md §5.3, §8), never with ErrUnsupported or a plain error (502).
func TestMalformedChatFieldsAreClientErrors(t *testing.T) {
	tk := qwen3(t)
	const user = `{"role":"user","content":"hi"}`
	body := func(fields string) []byte {
		return []byte(`{"model":"Qwen/Qwen3-0.6B",` + fields + `}`)
	}
	tests := []struct{ name, fields, wantInMsg string }{
		{"a number in messages", `"messages":[1]`, "messages[0] is number"},
		{"an empty message object", `"messages":[{}]`, "messages[0].role is missing"},
		{"a numeric role", `"messages":[{"role":5,"content":"hi"}]`, "messages[0].role is number"},
		{"a numeric content", `"messages":[{"role":"user","content":5}]`, "messages[0].content is number"},
		{"an object content", `"messages":[{"role":"user","content":{}}]`, "messages[0].content is object"},
		{"tools that are not a list", `"messages":[` + user + `],"tools":"notalist"`, "tools is string"},
		{"chat_template_kwargs that are not an object", `"messages":[` + user + `],"chat_template_kwargs":"x"`, "chat_template_kwargs is string"},
		{"add_generation_prompt that is not a boolean", `"messages":[` + user + `],"add_generation_prompt":"yes"`, "add_generation_prompt is string"},
		{"an image_url content part", `"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/y.png"}}]}]`, `has type "image_url"`},
		{"an input_audio content part", `"messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"input_audio","input_audio":{"data":"AA==","format":"wav"}}]}]`, `has type "input_audio"`},
		{"an unknown content part type", `"messages":[{"role":"user","content":[{"type":"hologram"}]}]`, `has type "hologram"`},
	}
	for _, tc := range tests {
		for _, path := range []struct {
			name string
			fn   func([]byte) error
		}{
			{"TokenizeChat", func(b []byte) error { _, err := tk.TokenizeChat(b); return err }},
			{"RenderChat", func(b []byte) error { _, err := tk.RenderChat(b); return err }},
		} {
			t.Run(path.name+" rejects "+tc.name+" as a client error", func(t *testing.T) {
				err := path.fn(body(tc.fields))
				var re *RequestError
				if !errors.As(err, &re) || !errors.Is(err, ErrBadRequest) {
					t.Fatalf("err = %v (%T), want a *RequestError", err, err)
				}
				var br interface{ BadRequest() bool }
				if !errors.As(err, &br) || !br.BadRequest() {
					t.Fatalf("err %v does not report BadRequest()", err)
				}
				if errors.Is(err, ErrUnsupported) {
					t.Fatalf("err %v is ErrUnsupported, a server-side error", err)
				}
				if !strings.Contains(err.Error(), tc.wantInMsg) {
					t.Fatalf("err %q does not name the problem %q", err, tc.wantInMsg)
				}
			})
		}
	}
}

// TestTemplateErrorsOverTheRequestAreClientErrors checks that a template raising over the request
// (transformers' raise_exception, e.g. a role the template refuses) is a *RequestError carrying the
// template's message, while a panic inside the engine is a server-side error.
func TestTemplateErrorsOverTheRequestAreClientErrors(t *testing.T) {
	cc, err := parseChatConfig([]byte(`{"chat_template":"{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('Conversation roles must be user or assistant') }}{% endif %}{{ m.content }}{% endfor %}"}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	tk := &Tokenizer{chat: cc}
	t.Run("a role the template refuses is a bad request naming the template's message", func(t *testing.T) {
		_, err := tk.RenderChat([]byte(`{"messages":[{"role":"system","content":"s"}]}`))
		var re *RequestError
		if !errors.As(err, &re) || !re.BadRequest() {
			t.Fatalf("err = %v (%T), want a *RequestError", err, err)
		}
		if !strings.Contains(err.Error(), "Conversation roles must be user or assistant") {
			t.Fatalf("err %q lacks the template's message", err)
		}
	})
	t.Run("a role the template accepts renders", func(t *testing.T) {
		got, err := tk.RenderChat([]byte(`{"messages":[{"role":"user","content":"u"}]}`))
		if err != nil || got != "u" {
			t.Fatalf("got %q, %v", got, err)
		}
	})
	t.Run("a panic inside the template engine is a server-side error", func(t *testing.T) {
		tmpl, err := jinja.Compile("{{ boom() }}")
		if err != nil {
			t.Fatal(err)
		}
		boom := jinja.NewCallable("boom", func([]jinja.Value, map[string]jinja.Value) (jinja.Value, error) { panic("engine defect") })
		_, err = renderSafely(tmpl, map[string]jinja.Value{"boom": boom})
		if !errors.Is(err, errTemplatePanic) || errors.Is(err, ErrBadRequest) {
			t.Fatalf("err = %v, want errTemplatePanic and not a bad request", err)
		}
	})
}

// TestCompletionPromptForms checks every prompt shape of epp.md §5.3.
func TestCompletionPromptForms(t *testing.T) {
	tk := qwen3(t)
	hello := tk.Encode("Hello", true)
	tests := []struct {
		name string
		body string
		want []uint32
	}{
		{"a string prompt is encoded", `{"prompt":"Hello"}`, hello},
		{"a list of strings uses the first", `{"prompt":["Hello","other"]}`, hello},
		{"a token list is returned as is", `{"prompt":[1,2,3]}`, []uint32{1, 2, 3}},
		{"a list of token lists returns the first", `{"prompt":[[4,5],[6]]}`, []uint32{4, 5}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tk.TokenizeCompletion([]byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if !cmp.Equal(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}

// TestChatKeyOrderIsKept checks that tools are serialised in request key order (the decode is
// order-keeping), not sorted.
func TestChatKeyOrderIsKept(t *testing.T) {
	tk := qwen3(t)
	body := `{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"zeta":1,"alpha":2.0,"mid":{"b":1,"a":2}}}}]}`
	prompt, err := tk.RenderChat([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	want := `{"type": "function", "function": {"name": "f", "description": null, "parameters": {"zeta": 1, "alpha": 2.0, "mid": {"b": 1, "a": 2}}}}`
	if !strings.Contains(prompt, want) {
		t.Fatalf("prompt lacks %s:\n%s", want, prompt)
	}
}

// TestTemplateSelection checks named templates, the tool_use choice and bos/eos objects.
func TestTemplateSelection(t *testing.T) {
	cfg := `{"bos_token":{"content":"<s>","lstrip":false},"eos_token":"</s>","chat_template":[
		{"name":"default","template":"D{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"},
		{"name":"tool_use","template":"T{{ tools|length }}{{ messages[0].content }}"}]}`
	cc, err := parseChatConfig([]byte(cfg), nil)
	if err != nil {
		t.Fatal(err)
	}
	tk := &Tokenizer{chat: cc}
	tests := []struct{ name, body, want string }{
		{"without tools the default template renders with bos and eos", `{"messages":[{"role":"user","content":"x"}]}`, "D<s>x</s>"},
		{"with tools the tool_use template renders", `{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]}`, "T1x"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tk.RenderChat([]byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
		})
	}
	t.Run("a model without a chat template reports ErrNoChatTemplate", func(t *testing.T) {
		_, err := (&Tokenizer{}).RenderChat([]byte(`{"messages":[]}`))
		if !errors.Is(err, ErrNoChatTemplate) {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("a template iterating over content gets openai-format parts", func(t *testing.T) {
		cc, err := parseChatConfig([]byte(`{"chat_template":"{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}"}`), nil)
		if err != nil {
			t.Fatal(err)
		}
		got, err := (&Tokenizer{chat: cc}).RenderChat([]byte(`{"messages":[{"role":"user","content":"a"},{"role":"user","content":[{"type":"text","text":"b"},{"type":"text","text":"c"}]}]}`))
		if err != nil {
			t.Fatal(err)
		}
		if got != "[a][b][c]" {
			t.Fatalf("got %q", got)
		}
	})
}
