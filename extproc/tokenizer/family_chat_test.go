package tokenizer

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

type familyGolden struct {
	PinnedNow string `json:"pinned_now"`
	Families  map[string]struct {
		Template      string            `json:"template"`
		Tokenizer     string            `json:"tokenizer"`
		SpecialTokens map[string]string `json:"special_tokens"`
		Cases         []struct {
			Name           string   `json:"name"`
			Body           string   `json:"body"`
			RenderedPrompt *string  `json:"rendered_prompt"`
			Error          string   `json:"error"`
			TokenIDs       []uint32 `json:"token_ids"`
		} `json:"cases"`
	} `json:"families"`
}

// familyChatConfig builds the chat configuration of one family from its template file and
// special tokens, as tokenizer_config.json would carry them.
func familyChatConfig(t testing.TB, file string, special map[string]string) *chatConfig {
	t.Helper()
	src, err := os.ReadFile(filepath.Join("testdata", "templates", file))
	if err != nil {
		t.Fatal(err)
	}
	cfg := map[string]any{"chat_template": string(src)}
	for k, v := range special {
		cfg[k] = v
	}
	data, _ := json.Marshal(cfg)
	cc, err := parseChatConfig(data, nil)
	if err != nil {
		t.Fatalf("parseChatConfig(%s): %v", file, err)
	}
	return cc
}

// pinClock makes strftime_now render the given instant for the rest of the test.
func pinClock(t *testing.T, iso string) {
	t.Helper()
	at, err := time.ParseInLocation("2006-01-02T15:04:05", iso, time.Local)
	if err != nil {
		t.Fatal(err)
	}
	old := timeNow
	timeNow = func() time.Time { return at }
	t.Cleanup(func() { timeNow = old })
}

// TestFamilyChatTemplatesMatchPythonJinja2 renders the chat templates of Llama 2, Mistral v0.1,
// Phi-3, Gemma 2, Gemma 3, DeepSeek V3 and kvepp's features template (strftime_now, namespace,
// string methods, tojson, tool calls, reasoning, raise_exception) over vLLM-preprocessed requests
// and compares with Python jinja2 configured as transformers configures it
// (testdata/gen_family_chat_golden.py): the same prompt, or an error where Python raised. With
// the real tokenizers fetched (testdata/fetch_models.sh) the token ids are compared too.
func TestFamilyChatTemplatesMatchPythonJinja2(t *testing.T) {
	var g familyGolden
	readJSON(t, filepath.Join("testdata", "family-chat-golden.json"), &g)
	pinClock(t, g.PinnedNow)
	fams := make([]string, 0, len(g.Families))
	for f := range g.Families {
		fams = append(fams, f)
	}
	sort.Strings(fams)
	if len(fams) < 7 {
		t.Fatalf("only %d families", len(fams))
	}
	for _, fam := range fams {
		f := g.Families[fam]
		cc := familyChatConfig(t, f.Template, f.SpecialTokens)
		renderer := &Tokenizer{chat: cc}
		for _, c := range f.Cases {
			t.Run(fam+" "+c.Name+" renders like Python jinja2", func(t *testing.T) {
				prompt, err := renderer.RenderChat([]byte(c.Body))
				if c.RenderedPrompt == nil {
					if err == nil {
						t.Fatalf("rendered %q, want an error like Python's %q", prompt, c.Error)
					}
					if !errors.Is(err, ErrBadRequest) {
						t.Fatalf("error %v is not a bad request (vLLM answers 400)", err)
					}
					return
				}
				if err != nil {
					t.Fatalf("RenderChat: %v", err)
				}
				if diff := cmp.Diff(*c.RenderedPrompt, prompt); diff != "" {
					t.Fatalf("prompt differs (-want +got):\n%s", diff)
				}
			})
		}
	}
	for _, fam := range fams {
		f := g.Families[fam]
		t.Run(fam+" chats tokenize like the reference", func(t *testing.T) {
			tk := realModel(t, f.Tokenizer)
			saved := tk.chat
			tk.chat = familyChatConfig(t, f.Template, f.SpecialTokens)
			defer func() { tk.chat = saved }()
			for _, c := range f.Cases {
				if c.RenderedPrompt == nil {
					continue
				}
				ids, err := tk.TokenizeChat([]byte(c.Body))
				if err != nil {
					t.Fatalf("%s: TokenizeChat: %v", c.Name, err)
				}
				if diff := cmp.Diff(c.TokenIDs, ids, cmpEmpty); diff != "" {
					t.Errorf("%s: token ids differ (-want +got):\n%s", c.Name, diff)
				}
			}
		})
	}
}
