package runner

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/internal/sharedtest"
)

func qwenLocal(t *testing.T) localTokenizer {
	t.Helper()
	tk, err := loadedTokenizers.load(sharedtest.Qwen3TokenizerDir(t), *testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	return localTokenizer{Tokenizer: tk, imageTokens: 256}
}

func tokenizeServer(t *testing.T, mutate func(*Config, *tokenizerSet)) *httptest.Server {
	cfg := DefaultConfig()
	cfg.ModelName = e2eModel
	cfg.TokenizerDir = "x"
	set := &tokenizerSet{byModel: map[string]extproc.RequestTokenizer{}}
	set.def = qwenLocal(t)
	if mutate != nil {
		mutate(&cfg, set)
	}
	api := newTokenizeAPI(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusTeapot) // stands for the selection API
	}), cfg)
	if set.def != nil || len(set.byModel) > 0 {
		api.set.Store(set)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	return srv
}

func post(t *testing.T, url, body string) (int, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// TestTokenizeEndpointMatchesVLLMShape checks POST /tokenize and /detokenize against vLLM's
// field names, defaults and error shapes, with ids from the shared Qwen3 goldens.
func TestTokenizeEndpointMatchesVLLMShape(t *testing.T) {
	srv := tokenizeServer(t, nil)
	tk := qwenLocal(t)
	t.Run("a prompt gets count, max_model_len, tokens and token_strs in vLLM's order", func(t *testing.T) {
		code, body := post(t, srv.URL+"/tokenize", `{"model":"`+e2eModel+`","prompt":"Hello world"}`)
		want := tk.Encode("Hello world", true)
		wantJSON, _ := json.Marshal(want)
		if code != 200 || body != `{"count":2,"max_model_len":`+itoa(tk.MaxModelLen())+`,"tokens":`+string(wantJSON)+`,"token_strs":null}` {
			t.Fatalf("%d %s", code, body)
		}
	})
	t.Run("return_token_strs gives the vocabulary spellings", func(t *testing.T) {
		code, body := post(t, srv.URL+"/tokenize", `{"prompt":"Hello world","return_token_strs":true}`)
		if code != 200 || !strings.Contains(body, `"token_strs":["Hello","Ġworld"]`) {
			t.Fatalf("%d %s", code, body)
		}
	})
	for _, v := range sharedtest.RequestVectors(t) {
		if !strings.HasSuffix(v.Path, "/chat/completions") {
			continue
		}
		t.Run("messages give the engine's ids for "+v.Name, func(t *testing.T) {
			code, body := post(t, srv.URL+"/tokenize", string(v.Body))
			var got struct {
				Count  int      `json:"count"`
				Tokens []uint32 `json:"tokens"`
			}
			if code != 200 || json.Unmarshal([]byte(body), &got) != nil {
				t.Fatalf("%d %s", code, body)
			}
			if diff := cmp.Diff(v.TokenIDs, got.Tokens); diff != "" || got.Count != len(v.TokenIDs) {
				t.Fatalf("tokens differ (-want +got):\n%s", diff)
			}
		})
	}
	t.Run("detokenize returns the prompt", func(t *testing.T) {
		ids, _ := json.Marshal(tk.Encode("Hello, wörld <|im_end|>", false))
		code, body := post(t, srv.URL+"/detokenize", `{"tokens":`+string(ids)+`}`)
		if code != 200 || body != `{"prompt":"Hello, wörld <|im_end|>"}` {
			t.Fatalf("%d %s", code, body)
		}
	})
	errs := []struct {
		name, path, body string
		code             int
		typ, param, msg  string
	}{
		{"an unknown model is vLLM's 404", "/tokenize", `{"model":"nope","prompt":"x"}`, 404, "NotFoundError", "model", "The model `nope` does not exist."},
		{"a body that is not JSON is a 400", "/tokenize", `{`, 400, "BadRequestError", "", "not a JSON object"},
		{"neither prompt nor messages is a 400", "/tokenize", `{"model":"` + e2eModel + `"}`, 400, "BadRequestError", "", "either prompt or messages"},
		{"both prompt and messages is a 400", "/tokenize", `{"prompt":"a","messages":[]}`, 400, "BadRequestError", "", "not both"},
		{"a prompt that is not a string is a 400", "/tokenize", `{"prompt":[1,2]}`, 400, "BadRequestError", "", "prompt must be a string"},
		{"a malformed message is a 400", "/tokenize", `{"messages":[{"content":"x"}]}`, 400, "BadRequestError", "", "role"},
		{"an image part is a 400 (ids would not be exact)", "/tokenize", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}`, 400, "BadRequestError", "", "image"},
		{"detokenize without tokens is a 400", "/detokenize", `{}`, 400, "BadRequestError", "tokens", "tokens is required"},
		{"detokenize with an id outside the vocabulary is a 400", "/detokenize", `{"tokens":[1, 99999999]}`, 400, "BadRequestError", "tokens", "out of vocabulary"},
		{"detokenize with a negative id is a 400", "/detokenize", `{"tokens":[-1]}`, 400, "BadRequestError", "tokens", "out of vocabulary"},
	}
	for _, tc := range errs {
		t.Run(tc.name, func(t *testing.T) {
			code, body := post(t, srv.URL+tc.path, tc.body)
			var e vllmErrorBody
			if err := json.Unmarshal([]byte(body), &e); err != nil || code != tc.code {
				t.Fatalf("%d %s", code, body)
			}
			param := ""
			if e.Error.Param != nil {
				param = *e.Error.Param
			}
			if e.Error.Type != tc.typ || e.Error.Code != tc.code || param != tc.param || !strings.Contains(e.Error.Message, tc.msg) {
				t.Fatalf("error %+v (param %q), want type %s code %d param %q message containing %q", e.Error, param, tc.typ, tc.code, tc.param, tc.msg)
			}
		})
	}
	t.Run("GET is 405", func(t *testing.T) {
		resp, err := http.Get(srv.URL + "/tokenize")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 405 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	})
	t.Run("other paths reach the selection API", func(t *testing.T) {
		if code, _ := post(t, srv.URL+"/select", `{}`); code != http.StatusTeapot {
			t.Fatalf("status %d", code)
		}
	})
	t.Run("before the tokenizers load it is 503", func(t *testing.T) {
		s := tokenizeServer(t, func(_ *Config, set *tokenizerSet) { set.def = nil })
		if code, body := post(t, s.URL+"/tokenize", `{"prompt":"x"}`); code != 503 || !strings.Contains(body, "still loading") {
			t.Fatalf("%d %s", code, body)
		}
	})
	t.Run("vllm-render mode has no local tokenizer: 503 pointing at the engine's /tokenize", func(t *testing.T) {
		s := tokenizeServer(t, func(c *Config, _ *tokenizerSet) { c.TokenizerDir, c.TokenizerServiceURL = "", "http://x" })
		if code, body := post(t, s.URL+"/tokenize", `{"prompt":"x"}`); code != 503 || !strings.Contains(body, "vllm-render") {
			t.Fatalf("%d %s", code, body)
		}
	})
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }
