package tokenizer

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kvepp/kvepp/internal/benchbody"
	"github.com/kvepp/kvepp/internal/sharedtest"
)

// convPair is a chat template and a tokenizer to check the conversation cache with.
type convPair struct {
	name, family string
	tok          func(t testing.TB) *Tokenizer
}

// withTemplate returns a copy of tk rendering the family template file with its special tokens.
func withTemplate(t testing.TB, tk *Tokenizer, file string, special map[string]string) *Tokenizer {
	t.Helper()
	return &Tokenizer{model: tk.model, addedRaw: tk.addedRaw, addedNorm: tk.addedNorm, norm: tk.norm, pre: tk.pre,
		post: tk.post, cache: tk.cache, chat: familyChatConfig(t, file, special), cacheID: cacheIDs.Add(1), prefixSafe: tk.prefixSafe}
}

var (
	pairMu   sync.Mutex
	pairToks = map[string]*Tokenizer{}
)

// pairTokenizer memoizes withTemplate per pair.
func pairTokenizer(name string, mk func(t testing.TB) *Tokenizer) func(t testing.TB) *Tokenizer {
	return func(t testing.TB) *Tokenizer {
		t.Helper()
		pairMu.Lock()
		defer pairMu.Unlock()
		if tk, ok := pairToks[name]; ok {
			return tk
		}
		tk := mk(t)
		pairToks[name] = tk
		return tk
	}
}

func familySpecial(t testing.TB, family string) (string, map[string]string) {
	t.Helper()
	var g familyGolden
	readJSON(t, filepath.Join("testdata", "family-chat-golden.json"), &g)
	f, ok := g.Families[family]
	if !ok {
		t.Fatalf("no family %s", family)
	}
	return f.Template, f.SpecialTokens
}

// spLayout loads a SentencePiece layout of testdata/sp-layouts; clean drops its added tokens
// with lstrip, rstrip or single_word (which the layouts have for the encoder's goldens and the
// conversation cache refuses).
func spLayout(t testing.TB, name string, clean bool) *Tokenizer {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", "sp-layouts", name+".json"))
	if err != nil {
		t.Fatal(err)
	}
	if clean {
		var doc map[string]any
		if err := json.Unmarshal(data, &doc); err != nil {
			t.Fatal(err)
		}
		var keep []any
		for _, a := range doc["added_tokens"].([]any) {
			m := a.(map[string]any)
			if m["lstrip"] != true && m["rstrip"] != true && m["single_word"] != true {
				keep = append(keep, a)
			}
		}
		doc["added_tokens"] = keep
		data, _ = json.Marshal(doc)
	}
	tk, err := parseTokenizerJSON(data)
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// convPairs are the proven templates with the Qwen3 tokenizer (always present); the Llama 2 and
// Mistral templates with SentencePiece layouts (Llama-legacy, whose [INST] and [/INST] are added
// tokens; Metaspace with prepend_scheme "first", the one layout whose encoding depends on where a
// segment is); and the real Llama 2 and Gemma 3 tokenizers when fetched
// (testdata/fetch_models.sh).
func convPairs() []convPair {
	ps := []convPair{{name: "qwen3", family: "qwen3", tok: qwen3}}
	for _, fam := range []string{"phi3", "gemma2", "gemma3", "mistral-v0.1", "llama2-chat"} {
		ps = append(ps, convPair{name: fam + "+qwen3-tokenizer", family: fam, tok: pairTokenizer(fam+"/qwen3", func(t testing.TB) *Tokenizer {
			file, special := familySpecial(t, fam)
			return withTemplate(t, qwen3(t), file, special)
		})})
	}
	for _, fam := range []string{"mistral-v0.1", "llama2-chat"} {
		for _, layout := range []string{"llama-legacy", "metaspace-first"} {
			ps = append(ps, convPair{name: fam + "+sp-" + layout, family: fam, tok: pairTokenizer(fam+"/"+layout, func(t testing.TB) *Tokenizer {
				file, special := familySpecial(t, fam)
				return withTemplate(t, spLayout(t, layout, true), file, special)
			})})
		}
	}
	for _, fam := range []string{"llama2-chat", "gemma3"} {
		ps = append(ps, convPair{name: fam + "+real", family: fam, tok: pairTokenizer(fam+"/real", func(t testing.TB) *Tokenizer {
			file, special := familySpecial(t, fam)
			model := map[string]string{"llama2-chat": "llama2", "gemma3": "gemma3"}[fam]
			return withTemplate(t, realModel(t, model), file, special)
		})})
	}
	return ps
}

// convPieces are the texts conversation contents are made of: words, whitespace, Unicode, and
// the special tokens and markup of every family, so boundaries meet them on both sides.
var convPieces = []string{"hello", " world", "the", " cache", "\n", "\n\n", " ", "  ", "\t", "é", "日本語", "🙂",
	"123", "4.5", "'s", "{", "}", "\"", "\\", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
	"<tool_response>", "</tool_response>", "<|endoftext|>", "[INST]", "[/INST]", "<s>", "</s>", "<<SYS>>",
	"<|user|>", "<|end|>", "<|assistant|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<|", "|>", "▁x"}

type convGen struct {
	rng    *rand.Rand
	family string
}

func (g *convGen) text() string {
	var sb strings.Builder
	for n := g.rng.IntN(8); n >= 0; n-- {
		sb.WriteString(convPieces[g.rng.IntN(len(convPieces))])
	}
	return sb.String()
}

func (g *convGen) chance(n int) bool { return g.rng.IntN(n) == 0 }

// content is a message content: mostly a string, sometimes text parts.
func (g *convGen) content() any {
	if g.chance(6) {
		return []any{map[string]any{"type": "text", "text": g.text()}, map[string]any{"type": "text", "text": g.text()}}
	}
	return g.text()
}

// history returns a conversation of turns user turns for the family, with the roles its template
// accepts (and now and then one it rejects, so errors are compared too).
func (g *convGen) history(turns int) []map[string]any {
	var ms []map[string]any
	sys := g.chance(2)
	switch g.family {
	case "gemma2", "mistral-v0.1":
		sys = g.chance(20) // raises
	}
	if sys {
		ms = append(ms, map[string]any{"role": "system", "content": g.text()})
	}
	for t := 0; t < turns; t++ {
		user := map[string]any{"role": "user", "content": g.content()}
		if g.family == "qwen3" && g.chance(8) {
			user["content"] = "<tool_response>" + g.text() + "</tool_response>"
		}
		ms = append(ms, user)
		if t == turns-1 {
			break
		}
		a := map[string]any{"role": "assistant", "content": g.content()}
		if g.family == "qwen3" {
			switch g.rng.IntN(5) {
			case 0:
				a["reasoning_content"] = g.text()
			case 1:
				a["content"] = "<think>" + g.text() + "</think>\n" + g.text()
			case 2:
				a["tool_calls"] = []any{map[string]any{"id": "c1", "type": "function",
					"function": map[string]any{"name": "f", "arguments": `{"q":"` + strings.ReplaceAll(g.text(), `"`, "") + `"}`}}}
			}
		}
		ms = append(ms, a)
		switch {
		case g.family == "qwen3" && a["tool_calls"] != nil:
			for n := g.rng.IntN(3); n >= 0; n-- {
				ms = append(ms, map[string]any{"role": "tool", "tool_call_id": "c1", "content": g.text()})
			}
			ms = append(ms, map[string]any{"role": "assistant", "content": g.text()})
		case g.family == "qwen3" && g.chance(10):
			ms = append(ms, map[string]any{"role": "system", "content": g.text()})
		case g.family == "phi3" && g.chance(6):
			ms = append(ms, map[string]any{"role": "tool", "content": g.text()})
		case g.chance(30):
			ms = append(ms, map[string]any{"role": "assistant", "content": g.text()}) // breaks alternation
		}
	}
	return ms
}

// body builds a request over msgs with the conversation's fixed fields and per-request options.
func (g *convGen) body(msgs []map[string]any, fixed map[string]any) []byte {
	b := map[string]any{"model": "m", "messages": msgs}
	for k, v := range fixed {
		b[k] = v
	}
	switch g.rng.IntN(6) {
	case 0:
		b["add_generation_prompt"] = false
	case 1:
		b["add_special_tokens"] = true
	case 2:
		b["continue_final_message"], b["add_generation_prompt"] = true, false
	}
	out, _ := json.Marshal(b)
	return out
}

// checkConversation plays a conversation of the pair's family turn by turn through one cache —
// every turn, a retry, and two branches that replace the last user message — and compares every
// request's ids (or error) with a from-scratch tokenization. It returns the cache's stats.
func checkConversation(t testing.TB, tk *Tokenizer, family string, seed uint64, c *ConversationCache) {
	t.Helper()
	g := &convGen{rng: rand.New(rand.NewPCG(seed, 15)), family: family}
	fixed := map[string]any{}
	if family == "qwen3" && g.chance(3) {
		fixed["tools"] = []any{map[string]any{"type": "function", "function": map[string]any{"name": "f", "description": g.text(),
			"parameters": map[string]any{"type": "object", "properties": map[string]any{"q": map[string]any{"type": "string"}}}}}}
	}
	if g.chance(4) {
		fixed["chat_template_kwargs"] = map[string]any{"enable_thinking": g.chance(2)}
	}
	turns := 1 + g.rng.IntN(5)
	hist := g.history(turns)
	var bodies [][]byte
	for i := range hist {
		if hist[i]["role"] == "user" || i == len(hist)-1 || g.chance(4) {
			bodies = append(bodies, g.body(hist[:i+1], fixed))
		}
	}
	bodies = append(bodies, bodies[len(bodies)-1]) // a retry
	for n := 0; n < 2; n++ {                       // regenerated last turns
		branch := slices.Clone(hist)
		branch[len(branch)-1] = map[string]any{"role": "user", "content": g.text()}
		bodies = append(bodies, g.body(branch, fixed))
	}
	for i, body := range bodies {
		want, wantErr := tk.TokenizeChatPrompt(body, 7)
		r, err := ParseRequest(body)
		if err != nil {
			t.Fatalf("ParseRequest: %v", err)
		}
		got, gotErr := tk.ChatPromptFor(r, ChatOptions{ImageTokens: 7, Cache: c})
		if (wantErr == nil) != (gotErr == nil) || (wantErr != nil && wantErr.Error() != gotErr.Error()) {
			t.Fatalf("seed %d request %d %s: error %v, from scratch %v", seed, i, body, gotErr, wantErr)
		}
		if !slices.Equal(want.TokenIDs, got.TokenIDs) || want.UncachedFrom != got.UncachedFrom {
			t.Fatalf("seed %d request %d %s: ids differ from scratch\n got %v\nwant %v", seed, i, body, got.TokenIDs, want.TokenIDs)
		}
	}
}

// FuzzConversationCache compares the conversation cache with from-scratch tokenization on random
// conversations (checkConversation) for every proven template: seed picks the conversation, pair
// the template and tokenizer. The seed corpus runs in every `go test`; `go test -fuzz
// FuzzConversationCache` explores further.
func FuzzConversationCache(f *testing.F) {
	pairs := convPairs()
	for seed := uint64(0); seed < 12; seed++ {
		for p := range pairs {
			f.Add(seed, uint8(p))
		}
	}
	f.Fuzz(func(t *testing.T, seed uint64, pair uint8) {
		p := pairs[int(pair)%len(pairs)]
		tk := p.tok(t)
		c := NewConversationCache(1 << 20)
		checkConversation(t, tk, p.family, seed, c)
	})
}

// TestConversationCacheServesContinuingConversations plays a conversation growing to 12 turns of
// 2 KB: every turn after the first reuses the previous turn's prefix (a hit), tokenizes only the
// new text, and gives the from-scratch ids.
func TestConversationCacheServesContinuingConversations(t *testing.T) {
	tk := qwen3(t)
	c := NewConversationCache(64 << 20)
	var prev ConversationCacheStats
	for turns := 1; turns <= 12; turns++ {
		body := benchbody.Conversation("m", turns, 2000)
		want, err := tk.TokenizeChat(body)
		if err != nil {
			t.Fatal(err)
		}
		r, err := ParseRequest(body)
		if err != nil {
			t.Fatal(err)
		}
		got, err := tk.ChatPromptFor(r, ChatOptions{Cache: c})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(want, got.TokenIDs) {
			t.Fatalf("turn %d: ids differ from scratch", turns)
		}
		st := c.Stats()
		if turns > 1 {
			if st.Hits != prev.Hits+1 || st.ReusedTokens <= prev.ReusedTokens {
				t.Fatalf("turn %d did not reuse the previous turn: %+v then %+v", turns, prev, st)
			}
			if reused := st.ReusedTokens - prev.ReusedTokens; int(reused) < len(want)*(turns-1)/turns*9/10 {
				t.Fatalf("turn %d reused %d of %d tokens", turns, reused, len(want))
			}
		}
		prev = st
	}
	if prev.Misses != 1 || prev.Bypassed != 0 {
		t.Fatalf("stats %+v: want one miss (the first turn)", prev)
	}
}

// TestConversationCacheKeepsGoldenIDs tokenizes every golden chat vector through a cold and a
// warm cache: the ids are the golden ones.
func TestConversationCacheKeepsGoldenIDs(t *testing.T) {
	tk := qwen3(t)
	c := NewConversationCache(16 << 20)
	for _, v := range sharedtest.RequestVectors(t) {
		if !strings.Contains(v.Path, "chat") {
			continue
		}
		for pass := 0; pass < 2; pass++ {
			r, err := ParseRequest(v.Body)
			if err != nil {
				t.Fatal(err)
			}
			got, err := tk.ChatPromptFor(r, ChatOptions{Cache: c})
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got.TokenIDs, v.TokenIDs) {
				t.Fatalf("%s pass %d: ids differ from the golden", v.Name, pass)
			}
		}
	}
	if st := c.Stats(); st.Hits == 0 {
		t.Fatalf("no hit on the second pass: %+v", st)
	}
}

// TestConversationCacheStaysWithinItsBound fills a small cache with many conversations: its bytes
// never exceed the bound, old entries are evicted and counted, and results stay exact.
func TestConversationCacheStaysWithinItsBound(t *testing.T) {
	tk := qwen3(t)
	const limit = 64 << 10
	c := NewConversationCache(limit)
	for i := 0; i < 40; i++ {
		checkConversation(t, tk, "qwen3", uint64(1000+i), c)
		if st := c.Stats(); st.Bytes > limit || st.Bytes < 0 {
			t.Fatalf("cache holds %d bytes, bound %d", st.Bytes, limit)
		}
	}
	st := c.Stats()
	if st.Evictions == 0 || st.Entries == 0 {
		t.Fatalf("stats %+v: want evictions and a non-empty cache", st)
	}
	var sum int64
	c.mu.Lock()
	n := 0
	for el := c.lru.Front(); el != nil; el = el.Next() {
		sum += el.Value.(*convEntry).size
		n++
	}
	c.mu.Unlock()
	if sum != st.Bytes || n != st.Entries {
		t.Fatalf("LRU list has %d entries of %d bytes, stats say %d and %d", n, sum, st.Entries, st.Bytes)
	}
}

// TestConversationCacheBypassesWhatItCannotProve: a template without a proof, a tokenizer whose
// added tokens strip whitespace, continue_final_message and images are tokenized from scratch.
func TestConversationCacheBypassesWhatItCannotProve(t *testing.T) {
	body := []byte(`{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"},{"role":"user","content":"more"}]}`)
	file, special := familySpecial(t, "deepseek-v3")
	unproven := withTemplate(t, qwen3(t), file, special)
	stripping := withTemplate(t, spLayout(t, "strip-nfkc-eos", false), "phi3.jinja", map[string]string{"eos_token": "</s>"})
	stripping.prefixSafe = stripping.addedRaw.stripFree()
	images := []byte(`{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/a.png"}},{"type":"text","text":"what"}]}]}`)
	cont := []byte(`{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}],"continue_final_message":true,"add_generation_prompt":false}`)
	for _, tc := range []struct {
		name string
		tk   *Tokenizer
		body []byte
	}{
		{"a template without a proof (DeepSeek V3)", unproven, body},
		{"a tokenizer whose added tokens strip whitespace", stripping, body},
		{"continue_final_message", qwen3(t), cont},
		{"a chat with an image", qwen3(t), images},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := NewConversationCache(1 << 20)
			for i := 0; i < 2; i++ {
				want, err := tc.tk.TokenizeChatPrompt(tc.body, 3)
				if err != nil {
					t.Fatal(err)
				}
				r, _ := ParseRequest(tc.body)
				got, err := tc.tk.ChatPromptFor(r, ChatOptions{ImageTokens: 3, Cache: c})
				if err != nil || !slices.Equal(got.TokenIDs, want.TokenIDs) || got.UncachedFrom != want.UncachedFrom {
					t.Fatalf("got %+v %v, want %+v", got, err, want)
				}
			}
			if st := c.Stats(); st.Hits != 0 || st.Entries != 0 {
				t.Fatalf("stats %+v: want nothing cached", st)
			}
		})
	}
	if stripping.prefixSafe {
		t.Fatal("a layout with lstrip/rstrip added tokens is taken as prefix-safe")
	}
}

// TestStraddles checks the junction test of added tokens.
func TestStraddles(t *testing.T) {
	tk := qwen3(t)
	for _, tc := range []struct {
		left, right string
		want        bool
	}{
		{"x<|im_end|>\n", "<|im_start|>user", false},
		{"x<|im_", "end|>", true},
		{"x<", "|im_start|>", true},
		{"x<|im_start|", ">", true},
		{"", "<|im_start|>", false},
		{"abc", "", false},
	} {
		if got := tk.addedRaw.straddles(tc.left, tc.right); got != tc.want {
			t.Errorf("straddles(%q, %q) = %v, want %v", tc.left, tc.right, got, tc.want)
		}
	}
}

// TestConversationCacheIsSafeForConcurrentUse runs conversations from several goroutines over one
// small cache (with -race in CI).
func TestConversationCacheIsSafeForConcurrentUse(t *testing.T) {
	tk := qwen3(t)
	c := NewConversationCache(256 << 10)
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 6; i++ {
				checkConversation(t, tk, "qwen3", uint64(i%3), c) // the same conversations from every goroutine
			}
		}()
	}
	wg.Wait()
	if st := c.Stats(); st.Hits == 0 {
		t.Fatalf("no hits: %+v", st)
	}
}

func ExampleConversationCache() {
	// One cache per process, shared by every tokenizer; 64 MiB here.
	c := NewConversationCache(64 << 20)
	fmt.Println(c.Stats().MaxBytes)
	// Output: 67108864
}

// TestConversationCacheHitsForEveryProvenTemplate checks that the cache serves each proven
// template (with each tokenizer of convPairs) rather than bypassing it: most requests of continuing
// conversations hit, and the ids stay the from-scratch ones.
func TestConversationCacheHitsForEveryProvenTemplate(t *testing.T) {
	for _, p := range convPairs() {
		t.Run(p.name, func(t *testing.T) {
			tk := p.tok(t)
			c := NewConversationCache(8 << 20)
			for seed := uint64(0); seed < 12; seed++ {
				checkConversation(t, tk, p.family, seed, c)
			}
			st := c.Stats()
			if st.Hits < (st.Hits+st.Misses)/3 || st.ReusedTokens == 0 {
				t.Fatalf("stats %+v: want at least a third of the lookups to hit", st)
			}
		})
	}
}

// concatTemplate prints the contents back to back, then "[AB]" as the generation prompt: as a
// concatenation it is trivially prefix-stable and local, which the tests below register as proven.
const concatTemplate = `{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}[AB]{% endif %}`

// withJunctionTokens returns a Qwen3 tokenizer with the extra added tokens "[AB]" and "[AB]C"
// (ids past the vocabulary) and the chat template src, registered as proven for the test.
func withJunctionTokens(t *testing.T, src string) *Tokenizer {
	t.Helper()
	base := qwen3(t)
	var raw []*addedToken
	for _, a := range base.addedByID {
		if !a.normalized {
			raw = append(raw, a)
		}
	}
	next := uint32(base.VocabSize() + 100)
	raw = append(raw, &addedToken{id: next, content: "[AB]", special: true}, &addedToken{id: next + 1, content: "[AB]C", special: true})
	provenTemplates[templateDigest(src)] = &incrementalPlan{name: "test-concat", boundary: userBoundary}
	t.Cleanup(func() { delete(provenTemplates, templateDigest(src)) })
	data, _ := json.Marshal(map[string]any{"chat_template": src})
	cc, err := parseChatConfig(data, nil)
	if err != nil {
		t.Fatal(err)
	}
	cp := withTemplate(t, base, "phi3.jinja", nil)
	cp.addedRaw = newAddedMatcher(raw, func(a *addedToken) string { return a.content })
	cp.chat = cc
	return cp
}

// TestConversationCacheRefusesUnsafeJunctions: where the text after a cached prefix could change
// the tokens before it, the cache falls back to a from-scratch tokenization — an added token that
// would straddle the boundary ("[AB]" cached, "[AB]C" in the full text), and a boundary cached
// before an added token whose continuation starts with text (BPE would join the words).
func TestConversationCacheRefusesUnsafeJunctions(t *testing.T) {
	concat := withJunctionTokens(t, concatTemplate)
	// A template wrongly registered as proven: the last message's render differs from the others'.
	lastMarked := withJunctionTokens(t, `{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}{% endfor %}`)
	msgs := func(contents ...string) []byte {
		var ms []map[string]any
		for i, c := range contents {
			ms = append(ms, map[string]any{"role": []string{"user", "assistant"}[i%2], "content": c})
		}
		b, _ := json.Marshal(map[string]any{"messages": ms})
		return b
	}
	for _, tc := range []struct {
		name        string
		tk          *Tokenizer
		first, next []byte
	}{
		{"a token straddling the boundary", concat, msgs("x[AB]"), msgs("x[AB]", "Cy", "z")},
		{"text after a boundary cached before an added token", concat, msgs("hello"), msgs("hello", "world", "again")},
		{"a tail whose render does not start with the boundary message's", lastMarked, msgs("[AB]hello"), msgs("[AB]hello", "world", "again")},
	} {
		tk := tc.tk
		t.Run(tc.name, func(t *testing.T) {
			c := NewConversationCache(1 << 20)
			for i, body := range [][]byte{tc.first, tc.next} {
				want, err := tk.TokenizeChatPrompt(body, 0)
				if err != nil {
					t.Fatal(err)
				}
				r, _ := ParseRequest(body)
				got, err := tk.ChatPromptFor(r, ChatOptions{Cache: c})
				if err != nil || !slices.Equal(got.TokenIDs, want.TokenIDs) {
					t.Fatalf("request %d: %v %v, want %v", i, got.TokenIDs, err, want.TokenIDs)
				}
			}
			if st := c.Stats(); st.Entries == 0 || st.Hits != 0 || st.Misses != 2 {
				t.Fatalf("stats %+v: want the first request cached and the second refused it", st)
			}
		})
	}
}

// TestPrefixMemoCarriesBlockHashesAcrossTurns: a request's memo stands for a prefix of its ids;
// hashes stored by one turn are loaded by the next (from the prefix it extends), and they count in
// the cache's memory.
func TestPrefixMemoCarriesBlockHashesAcrossTurns(t *testing.T) {
	tk := qwen3(t)
	c := NewConversationCache(64 << 20)
	prompt := func(turns int) ChatPrompt {
		r, err := ParseRequest(benchbody.Conversation("m", turns, 3000))
		if err != nil {
			t.Fatal(err)
		}
		p, err := tk.ChatPromptFor(r, ChatOptions{Cache: c})
		if err != nil {
			t.Fatal(err)
		}
		if p.Memo == nil || p.Memo.Tokens() <= 0 || p.Memo.Tokens() > len(p.TokenIDs) {
			t.Fatalf("turn %d: memo %+v for %d ids", turns, p.Memo, len(p.TokenIDs))
		}
		return p
	}
	p1 := prompt(2)
	n := p1.Memo.Tokens() / 16
	local, seq := make([]uint64, n), make([]uint64, n)
	for i := range local {
		local[i], seq[i] = uint64(i+1), uint64(1000+i)
	}
	before := c.Stats().Bytes
	p1.Memo.StoreBlockHashes(16, 7, local, seq)
	// The turn's own prefix keeps all n blocks, the shorter prefix it filled too its first ones.
	if got := c.Stats().Bytes - before; got < int64(16*n) || got >= int64(32*n) {
		t.Fatalf("storing %d blocks' hashes added %d bytes, want 16 per block kept", n, got)
	}
	p2 := prompt(3)
	if p2.Memo.Tokens() <= p1.Memo.Tokens() {
		t.Fatalf("turn 3's prefix (%d tokens) is not longer than turn 2's (%d)", p2.Memo.Tokens(), p1.Memo.Tokens())
	}
	gl, gs := p2.Memo.LoadBlockHashes(16, 7)
	if !slices.Equal(gl, local) || !slices.Equal(gs, seq) {
		t.Fatalf("turn 3 loads %d hashes, want turn 2's %d", len(gl), len(local))
	}
	if l, _ := p2.Memo.LoadBlockHashes(16, 8); l != nil {
		t.Fatal("hashes of another seed returned")
	}
}
