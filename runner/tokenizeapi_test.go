package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
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
	}), cfg, servedModels{e2eModel})
	if set.def != nil || len(set.byModel) > 0 {
		api.set.Store(set)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	return srv
}

// servedModels is an extproc.ModelCatalog serving the listed partition models.
type servedModels []string

func (m servedModels) HasModel(model string) bool { return slices.Contains(m, model) }
func (m servedModels) Models() []string           { return m }

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
		{"a body that is not JSON is a 400", "/tokenize", `{`, 400, "BadRequestError", "", "not valid JSON"},
		{"a body that is not an object is a 400", "/tokenize", `[]`, 400, "BadRequestError", "", "request body must be a JSON object"},
		{"a null body is a 400", "/tokenize", `null`, 400, "BadRequestError", "", "request body must be a JSON object"},
		{"a model that is not a string names the field", "/tokenize", `{"model":123,"prompt":"a"}`, 400, "BadRequestError", "", `"model" must be a string`},
		{"a fractional token id names the field", "/detokenize", `{"tokens":[1.5]}`, 400, "BadRequestError", "tokens", `"tokens" must be a list of integers`},
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
	t.Run("an unknown model is vLLM's 404 without DYN_MODEL_NAME", func(t *testing.T) {
		s := tokenizeServer(t, func(c *Config, _ *tokenizerSet) { c.ModelName = "" })
		code, body := post(t, s.URL+"/tokenize", `{"model":"nope","prompt":"x"}`)
		if code != 404 || body != `{"error":{"message":"The model `+"`nope`"+` does not exist.","type":"NotFoundError","param":"model","code":404}}` {
			t.Fatalf("%d %s", code, body)
		}
	})
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

// TestTokenizeResolvesTheModelAsExtProcDoes plays the same bodies as /v1/completions requests
// through ext_proc and as POST /tokenize on the side port of a real EPP, and requires the same
// outcome class: both refuse with the same status, or ext_proc routes and /tokenize answers 200
// with the partition model's tokens (a LoRA name under DYN_MODEL_NAME tokenizes as the base).
func TestTokenizeResolvesTheModelAsExtProcDoes(t *testing.T) {
	long := strings.Repeat("m", 5000)
	yml := fmt.Sprintf("- {worker_id: 1, model_name: %s, endpoint: 'http://127.0.0.1:18401', block_size: 16}\n"+
		"- {worker_id: 2, model_name: second/model, endpoint: 'http://127.0.0.1:18402', block_size: 16}\n", e2eModel)
	path := filepath.Join(t.TempDir(), "workers.yaml")
	if err := os.WriteFile(path, []byte(yml), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, modelName string
		bodies          map[string]int // body → expected status (200 = routed / tokenized)
	}{
		{"without DYN_MODEL_NAME", "", map[string]int{
			`{"model":"nope","prompt":"hi"}`:                          404,
			`{"model":"` + long + `","prompt":"hi"}`:                  400,
			`{"prompt":"hi"}`:                                         400,
			`{"model":"` + e2eModel + `","prompt":"hi"}`:              200,
			`{"model":"second/model","prompt":"hi"}`:                  200,
			`{"model":"bad\u0001name","prompt":"hi"}`:                 400,
			`{"model":"` + strings.Repeat("é", 200) + `","prompt":1}`: 400,
		}},
		{"with DYN_MODEL_NAME", e2eModel, map[string]int{
			`{"model":"some-lora","prompt":"hi"}`:    200,
			`{"prompt":"hi"}`:                        200,
			`{"model":"` + long + `","prompt":"hi"}`: 400,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := loopbackConfig(t)
			cfg.WorkersFile, cfg.UseKVEvents, cfg.ModelName = path, false, tc.modelName
			inst := startInstance(t, cfg)
			client := extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC))
			for body, want := range tc.bodies {
				ex, err := client.Do(context.Background(), extproctest.Request{Path: "/v1/completions", Body: []byte(body),
					Response: &extproctest.Response{Chunks: [][]byte{[]byte(`{}`)}}})
				if err != nil {
					t.Fatal(err)
				}
				extStatus := 200
				if ex.Immediate != nil {
					extStatus = ex.Immediate.Status
				}
				code, out := post(t, "http://"+inst.Addrs().Selection+"/tokenize", body)
				if extStatus != want || code != want {
					t.Errorf("%.80s: ext_proc %d, /tokenize %d %.300s; want both %d", body, extStatus, code, out, want)
				}
				if len(out) > 1000 {
					t.Errorf("%.80s: /tokenize answered %d bytes", body, len(out))
				}
			}
		})
	}
}

// TestAModelWithoutAChatTemplate: a local tokenizer without a chat template (Llama 2's files as
// fetched) is warned about at startup; a chat request is a 400 saying why, over ext_proc and on
// /tokenize, as vLLM answers; completions still route.
func TestAModelWithoutAChatTemplate(t *testing.T) {
	dir := t.TempDir()
	tj, err := os.ReadFile(filepath.Join("..", "extproc", "tokenizer", "testdata", "sp-layouts", "llama-legacy.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), tj, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte(`{"bos_token":"<s>","eos_token":"</s>","add_bos_token":true}`), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := loopbackConfig(t)
	cfg.TokenizerDir, cfg.UseKVEvents, cfg.ModelName = dir, false, e2eModel
	inst, logs := startLogged(t, cfg)
	if !strings.Contains(logs.String(), `"level":"warn"`) || !strings.Contains(logs.String(), "no chat template") || !strings.Contains(logs.String(), dir) {
		t.Fatalf("no startup warning about the missing chat template:\n%s", logs.String())
	}
	addWorkers(t, inst, 1, 18270)
	client := extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC))
	chat := `{"model":"` + e2eModel + `","messages":[{"role":"user","content":"hi"}]}`
	ex, err := client.Do(context.Background(), extproctest.Request{Body: []byte(chat)})
	if err != nil {
		t.Fatal(err)
	}
	if ex.Immediate == nil || ex.Immediate.Status != 400 || !strings.Contains(string(ex.Immediate.Body), "no chat template") {
		t.Fatalf("chat over ext_proc: %+v, want a 400 saying there is no chat template", ex.Immediate)
	}
	if code, body := post(t, "http://"+inst.Addrs().Selection+"/tokenize", chat); code != 400 || !strings.Contains(body, "no chat template") {
		t.Fatalf("/tokenize chat: %d %s", code, body)
	}
	ex, err = client.Do(context.Background(), extproctest.Request{Path: "/v1/completions", Body: []byte(`{"prompt":"hello"}`),
		Response: &extproctest.Response{Chunks: [][]byte{[]byte(`{}`)}}})
	if err != nil || ex.Immediate != nil {
		t.Fatalf("completion: %v %+v", err, ex.Immediate)
	}
}
