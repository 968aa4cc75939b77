package tokenizer

import (
	"encoding/json"
	"math/rand"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/kvepp/kvepp/internal/benchbody"
	"github.com/kvepp/kvepp/internal/sharedtest"
)

// spliceContents are adversarial message contents: template keywords, the stand-in text itself,
// empty strings, unicode and whitespace at the ends.
var spliceContents = []string{
	"", " ", "\n", "hello", " padded \n", "\n\nleading newlines", "trailing\n\n",
	"<tool_response>", "<tool_response>wrapped</tool_response>", "</tool_response>", "<think>", "</think>",
	"<think>why</think>\n\nanswer", "<|im_start|>assistant\n", "<|im_end|>", "<|endoftext|>",
	standInText(0), standInText(1), standInMark, "\uFDD1", standInText(0) + standInText(1),
	"{{ messages }}", "{% if x %}", "héllo wörld ✓ 你好 🙂", "\u00a0nbsp\u00a0", "\t tabs \t",
	"a\u2028b", "\x00nul",
}

// randomSpliceBody builds a random chat body for Qwen3: system/user/tool messages (sometimes an
// assistant one), random contents, sometimes tools, chat_template_kwargs and
// add_generation_prompt false.
func randomSpliceBody(rng *rand.Rand) []byte {
	n := 1 + rng.Intn(6)
	roles := []string{"system", "user", "user", "tool"}
	var msgs []map[string]any
	for i := 0; i < n; i++ {
		role := roles[rng.Intn(len(roles))]
		if rng.Intn(12) == 0 {
			role = "assistant"
		}
		var content string
		switch rng.Intn(3) {
		case 0:
			content = spliceContents[rng.Intn(len(spliceContents))]
		case 1:
			content = spliceContents[rng.Intn(len(spliceContents))] + strings.Repeat("word ", rng.Intn(40)) + spliceContents[rng.Intn(len(spliceContents))]
		default:
			alphabet := []rune("ab <>|/_\n\t✓\uFDD0\uFDD1-0123456789")
			b := make([]rune, rng.Intn(30))
			for k := range b {
				b[k] = alphabet[rng.Intn(len(alphabet))]
			}
			content = string(b)
		}
		m := map[string]any{"role": role, "content": content}
		if rng.Intn(6) == 0 {
			m["name"] = "n" + string(rune('a'+rng.Intn(3)))
		}
		if role == "tool" && rng.Intn(2) == 0 {
			m["tool_call_id"] = "call_" + string(rune('a'+rng.Intn(26)))
		}
		if rng.Intn(20) == 0 {
			m["content"] = nil
		}
		msgs = append(msgs, m)
	}
	body := map[string]any{"model": "m", "messages": msgs}
	if rng.Intn(4) == 0 {
		body["tools"] = []any{map[string]any{"type": "function", "function": map[string]any{"name": "get", "description": spliceContents[rng.Intn(len(spliceContents))], "parameters": map[string]any{"type": "object"}}}}
	}
	if rng.Intn(4) == 0 {
		body["chat_template_kwargs"] = map[string]any{"enable_thinking": rng.Intn(2) == 0}
	}
	if rng.Intn(3) == 0 {
		body["add_generation_prompt"] = false
	}
	out, err := json.Marshal(body)
	if err != nil {
		panic(err)
	}
	return out
}

// fullAndRendered renders body's conversation both ways: the full jinja render and
// renderConversation (spliced when the proof covers it); spliced tells whether it was.
func fullAndRendered(t *testing.T, tk *Tokenizer, tmpl *chatTemplate, body []byte) (full, got string, spliced bool) {
	t.Helper()
	in, _, err := chatRequest(body)
	if err != nil {
		t.Fatalf("chatRequest(%s): %v", body, err)
	}
	if err := in.decodeMessages(); err != nil {
		t.Fatal(err)
	}
	conv, err := conversation(in.messages.arr, 0, tmpl.openAIContent, in.images)
	if err != nil {
		t.Fatal(err)
	}
	var tools *jval
	if in.tools != nil {
		if tools, err = dumpTools(in.tools); err != nil {
			t.Fatal(err)
		}
	}
	full, err = tk.renderTemplate(tmpl, in, conv, tools, in.addGenerationPrompt)
	if err != nil {
		t.Fatalf("full render of %s: %v", body, err)
	}
	got, err = tk.renderConversation(tmpl, in, conv, in.addGenerationPrompt)
	if err != nil {
		t.Fatalf("renderConversation(%s): %v", body, err)
	}
	// Whether the render was spliced depends on the conversation's shape alone, so asking again
	// says what renderConversation took, whatever other goroutines render meanwhile.
	_, spliced = tk.spliced(tmpl, in, conv, tools, in.addGenerationPrompt)
	return full, got, spliced
}

// TestSplicedRenderMatchesFull is the differential test of splice.go: on random Qwen3
// conversations with adversarial contents, renderConversation (spliced where proven) equals the
// full jinja render byte for byte, and most of the covered conversations are spliced.
func TestSplicedRenderMatchesFull(t *testing.T) {
	tk := qwen3(t)
	tmpl, err := tk.chat.pick(false)
	if err != nil || tmpl.splice == nil {
		t.Fatalf("the Qwen3 template has no splice proof (err %v)", err)
	}
	toolTmpl, _ := tk.chat.pick(true)
	rng := rand.New(rand.NewSource(15))
	total := 2000
	if testing.Short() {
		total = 300
	}
	checkSplicedMatchesFull(t, tk, total, total/4, func() ([]byte, *chatTemplate) {
		body := randomSpliceBody(rng)
		if strings.Contains(string(body), `"tools"`) {
			return body, toolTmpl
		}
		return body, tmpl
	})
}

// checkSplicedMatchesFull renders total bodies from next (each with the template to render it
// with) both ways, fails at the first difference, and fails when fewer than minSpliced were
// spliced.
func checkSplicedMatchesFull(t *testing.T, tk *Tokenizer, total, minSpliced int, next func() ([]byte, *chatTemplate)) {
	t.Helper()
	spliced := 0
	for i := 0; i < total; i++ {
		body, tmpl := next()
		full, got, s := fullAndRendered(t, tk, tmpl, body)
		if got != full {
			t.Fatalf("body %s:\nrendered %q\nfull     %q", body, got, full)
		}
		if s {
			spliced++
		}
	}
	if spliced < minSpliced {
		t.Fatalf("only %d of %d conversations were spliced", spliced, total)
	}
}

// TestSpliceFallbacks checks that what the proof does not cover is rendered in full: an assistant
// message, openai-format (list) content, and decoded tools without their raw bytes (a Responses
// request has neither).
func TestSpliceFallbacks(t *testing.T) {
	tk := qwen3(t)
	tmpl, _ := tk.chat.pick(false)
	for _, body := range []string{
		`{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"<think>x</think>b"},{"role":"user","content":"c"}]}`,
		`{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b","tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}]}`,
	} {
		full, got, s := fullAndRendered(t, tk, tmpl, []byte(body))
		if s || got != full {
			t.Fatalf("%s: spliced %v, equal %v; want a full render", body, s, got == full)
		}
	}
	// A conversation of user/system messages is spliced (the control for the cases above).
	if _, _, s := fullAndRendered(t, tk, tmpl, []byte(`{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}]}`)); !s {
		t.Fatal("a system + user conversation was not spliced")
	}
	// Tools decoded without their raw JSON cannot be keyed.
	in := &chatInput{tools: &jval{kind: jArray}}
	conv := &jval{kind: jArray, arr: []*jval{standIn}}
	if _, ok := spliceKey(in, conv, true); ok {
		t.Fatal("spliceKey keyed decoded tools without their raw bytes")
	}
}

// TestSpliceProofIsNeeded shows that the differential comparison catches an unsound proof: with a
// proof that also accepts assistant messages (whose content Qwen3 splits at '</think>' and strips),
// splicing differs from the full render.
func TestSpliceProofIsNeeded(t *testing.T) {
	src, err := os.ReadFile(filepath.Join(sharedtest.Qwen3TokenizerDir(t), "tokenizer_config.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		ChatTemplate string `json:"chat_template"`
	}
	if err := json.Unmarshal(src, &cfg); err != nil {
		t.Fatal(err)
	}
	tmpl, err := compileChatTemplate("default", cfg.ChatTemplate)
	if err != nil {
		t.Fatal(err)
	}
	if tmpl.splice == nil {
		t.Fatal("the shared Qwen3 template's digest is not in splicedTemplates")
	}
	tmpl.splice = &spliceProof{name: "unsound", ok: func(m *jval) bool { c := m.get("content"); return c != nil && c.kind == jString }}
	body := `{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"<think>why</think>\n\nanswer"}]}`
	full, got, s := fullAndRendered(t, qwen3(t), tmpl, []byte(body))
	if !s || got == full {
		t.Fatalf("unsound proof: spliced %v, equal %v; want a spliced render that differs", s, got == full)
	}
}

// TestSkeletonRejectsStandInInTemplateText checks the skeleton split: a stand-in mark in the
// skeleton besides the stand-ins (here through a tool description, which the template prints)
// makes the render fall back rather than splice at the wrong place.
func TestSkeletonRejectsStandInInTemplateText(t *testing.T) {
	tk := qwen3(t)
	tmpl, _ := tk.chat.pick(true)
	body := `{"messages":[{"role":"user","content":"u"}],"tools":[{"type":"function","function":{"name":"f","description":"` + standInText(0) + `"}}]}`
	built := tmpl.skeletons.built.Load() // the tokenizer is shared with other tests
	for i := 0; i < 3; i++ {
		full, got, s := fullAndRendered(t, tk, tmpl, []byte(body))
		if s || got != full {
			t.Fatalf("request %d: spliced %v, equal %v; want a full render", i, s, got == full)
		}
	}
	// The unusable shape is remembered: its stand-ins are rendered once, not on every request.
	if n := tmpl.skeletons.built.Load() - built; n != 1 {
		t.Fatalf("%d stand-in renders for 3 requests of one unusable shape, want 1", n)
	}
}

// TestChatPromptUniqueAllocs bounds the allocations of BenchmarkChatPromptUnique's request (the
// runner's tokenization of a 12 KB chat whose last message is unique): the spliced render made
// 46 of them where the full jinja render made 123, so a change back to a full render on this path
// fails here.
func TestChatPromptUniqueAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	tk := qwen3(t)
	raw, _ := chatLongBody(t)
	body, err := benchbody.New(raw, "")
	if err != nil {
		t.Fatal(err)
	}
	cache := NewConversationCache(128 << 20)
	buf := make([]byte, 0, len(body.Raw)+64)
	i := uint64(0)
	allocs := testing.AllocsPerRun(20, func() {
		i++
		buf = body.AppendUnique(buf[:0], "allocs", i)
		uniquePrompt(t, tk, cache, buf)
	})
	if allocs > 60 {
		t.Fatalf("%.0f allocations per request, want at most 60", allocs)
	}
}

// TestSplicedRenderConcurrent runs the differential comparison from several goroutines at once on
// one template (its skeleton cache shared; meant for -race).
func TestSplicedRenderConcurrent(t *testing.T) {
	tk := qwen3(t)
	tmpl, _ := tk.chat.pick(false)
	var wg sync.WaitGroup
	errs := make(chan string, 4)
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(seed int64) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(seed))
			for i := 0; i < 100; i++ {
				body := randomSpliceBody(rng)
				if strings.Contains(string(body), `"tools"`) {
					continue
				}
				in, _, _ := chatRequest(body)
				got, err := tk.render(in)
				in2, _, _ := chatRequest(body)
				_ = in2.decodeMessages()
				conv, _ := conversation(in2.messages.arr, 0, false, in2.images)
				full, err2 := tk.renderTemplate(tmpl, in2, conv, nil, in2.addGenerationPrompt)
				if err != nil || err2 != nil || got != full {
					errs <- string(body)
					return
				}
			}
		}(int64(g))
	}
	wg.Wait()
	close(errs)
	for b := range errs {
		t.Errorf("spliced render differs for %s", b)
	}
}

// TestSkeletonCacheBound checks that a skeleton cache never holds more than maxSkeletonBytes and
// refuses a single shape of more than a quarter of it.
func TestSkeletonCacheBound(t *testing.T) {
	var c skeletonCache
	sk := &skeleton{pieces: []string{strings.Repeat("p", 1000)}, size: 1000}
	for i := 0; i < 5000; i++ {
		key := []byte(strings.Repeat("k", 100) + strconv.Itoa(i))
		c.put(key, sk)
		if c.bytes > maxSkeletonBytes {
			t.Fatalf("after %d puts the cache holds %d bytes, more than %d", i+1, c.bytes, maxSkeletonBytes)
		}
		if c.get(key) != sk {
			t.Fatalf("put %d not found right after", i)
		}
	}
	huge := &skeleton{size: maxSkeletonBytes / 2}
	c.put([]byte("huge"), huge)
	if c.get([]byte("huge")) != nil {
		t.Fatal("a skeleton of half the bound was kept")
	}
}

// TestSplicedRenderMatchesFullPhi3 is the differential test for the Phi-3 proof: random
// conversations of all roles (an unknown one, tool, and assistants with tool calls and reasoning
// included) render spliced exactly as in full, and the covered ones are spliced.
func TestSplicedRenderMatchesFullPhi3(t *testing.T) {
	file, special := familySpecial(t, "phi3")
	tk := withTemplate(t, qwen3(t), file, special)
	tmpl, err := tk.chat.pick(false)
	if err != nil || tmpl.splice == nil || tmpl.splice.name != "phi3" {
		t.Fatalf("the Phi-3 template has no splice proof (err %v)", err)
	}
	rng := rand.New(rand.NewSource(3))
	roles := []string{"system", "user", "assistant", "assistant", "tool", "developer"}
	total := 1000
	checkSplicedMatchesFull(t, tk, total, total/2, func() ([]byte, *chatTemplate) {
		var msgs []map[string]any
		for k := 0; k < 1+rng.Intn(5); k++ {
			role := roles[rng.Intn(len(roles)-2)]
			if rng.Intn(15) == 0 {
				role = roles[4+rng.Intn(2)]
			}
			m := map[string]any{"role": role, "content": spliceContents[rng.Intn(len(spliceContents))] + spliceContents[rng.Intn(len(spliceContents))]}
			if role == "assistant" && rng.Intn(3) == 0 {
				m["tool_calls"] = []any{map[string]any{"function": map[string]any{"name": "f", "arguments": `{"a":1}`}}}
				m["reasoning_content"] = "r"
			}
			msgs = append(msgs, m)
		}
		body := map[string]any{"messages": msgs, "add_generation_prompt": rng.Intn(2) == 0}
		raw, _ := json.Marshal(body)
		return raw, tmpl
	})
}
