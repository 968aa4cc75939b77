package runner

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/picker"
)

// renderStub is a vLLM render server whose answer the test switches.
type renderStub struct {
	srv    *httptest.Server
	mu     sync.Mutex
	answer func(w http.ResponseWriter, r *http.Request)
	calls  []string // path and x-request-id of every call
}

func newRenderStub(t testing.TB) *renderStub {
	rs := &renderStub{}
	rs.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		rs.mu.Lock()
		rs.calls = append(rs.calls, r.URL.Path+" "+r.Header.Get("x-request-id"))
		a := rs.answer
		rs.mu.Unlock()
		a(w, r)
	}))
	t.Cleanup(rs.srv.Close)
	rs.set(200, `{"token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`)
	return rs
}

func (rs *renderStub) set(status int, body string) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.answer = func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(status)
		io.WriteString(w, body)
	}
}

// renderInstance starts kvepp with DYN_EPP_TOKENIZER_PROTOCOL=vllm-render against url and two
// workers of the served model.
func renderInstance(t testing.TB, url string, timeout time.Duration) (*Instance, *extproctest.Client) {
	cfg := loopbackConfig(t)
	cfg.TokenizerDir = ""
	cfg.TokenizerServiceURL = url
	cfg.TokenizationTimeout = Millis(timeout)
	cfg.UseKVEvents = false
	inst := startInstance(t, cfg)
	addWorkers(t, inst, 2, 18200)
	return inst, extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC))
}

// addWorkers registers n workers of the served model (block size 16) at 127.0.0.1:basePort+id.
func addWorkers(t testing.TB, inst *Instance, n int, basePort int) {
	t.Helper()
	for id := uint64(1); id <= uint64(n); id++ {
		bs := uint32(16)
		rec := picker.WorkerRecord{WorkerID: id, ModelName: e2eModel, Endpoint: fmt.Sprintf("http://127.0.0.1:%d", basePort+int(id)), BlockSize: &bs}
		if _, err := inst.Service.UpsertWorker(context.Background(), rec, picker.SourceAPI); err != nil {
			t.Fatal(err)
		}
	}
}

// TestVLLMRenderThroughExtProc routes through the render endpoint (epp.md §5.4 vllm-render):
// the call carries x-request-id, a token prompt makes no call, and every render failure is the
// mapped ImmediateResponse — timeout 504, 5xx/malformed 502, 4xx 400, unreachable 503.
func TestVLLMRenderThroughExtProc(t *testing.T) {
	rs := newRenderStub(t)
	_, client := renderInstance(t, rs.srv.URL, 300*time.Millisecond)
	chat := []byte(`{"model":"` + e2eModel + `","messages":[{"role":"user","content":"hi"}]}`)
	do := func(path string, body []byte) *extproctest.Exchange {
		t.Helper()
		ex, err := client.Do(context.Background(), extproctest.Request{Path: path, Body: body,
			Headers:  []extproctest.Header{{Key: "x-request-id", Value: "rid-7"}},
			Response: &extproctest.Response{Status: 200, ContentType: "application/json", Chunks: [][]byte{[]byte(`{}`)}}})
		if err != nil {
			t.Fatal(err)
		}
		return ex
	}
	t.Run("a chat is routed with the engine's token ids", func(t *testing.T) {
		ex := do("/v1/chat/completions", chat)
		if ex.Immediate != nil || ex.Destination == "" {
			t.Fatalf("immediate %+v, destination %q", ex.Immediate, ex.Destination)
		}
		rs.mu.Lock()
		last := rs.calls[len(rs.calls)-1]
		rs.mu.Unlock()
		if last != "/v1/chat/completions/render rid-7" {
			t.Fatalf("render call %q", last)
		}
	})
	t.Run("a token prompt makes no render call", func(t *testing.T) {
		rs.mu.Lock()
		n := len(rs.calls)
		rs.mu.Unlock()
		if ex := do("/v1/completions", []byte(`{"prompt":[1,2,3]}`)); ex.Immediate != nil {
			t.Fatalf("immediate %+v", ex.Immediate)
		}
		rs.mu.Lock()
		defer rs.mu.Unlock()
		if len(rs.calls) != n {
			t.Fatalf("render was called for a token prompt: %v", rs.calls[n:])
		}
	})
	for _, tc := range []struct {
		name, body string
		status     int
		want       int
	}{
		{"a render 5xx is a 502", `{"error":{"message":"boom"}}`, 500, 502},
		{"a malformed render response is a 502", `not json`, 200, 502},
		{"a render 4xx is a 400", `{"error":{"message":"bad messages"}}`, 400, 400},
		{"an empty token list is a 400", `{"token_ids":[]}`, 200, 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rs.set(tc.status, tc.body)
			ex := do("/v1/chat/completions", chat)
			if ex.Immediate == nil || ex.Immediate.Status != tc.want {
				t.Fatalf("immediate %+v, want status %d", ex.Immediate, tc.want)
			}
		})
	}
	t.Run("a render call past DYN_EPP_TOKENIZATION_TIMEOUT_MS is a 504", func(t *testing.T) {
		rs.mu.Lock()
		rs.answer = func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }
		rs.mu.Unlock()
		ex := do("/v1/chat/completions", chat)
		if ex.Immediate == nil || ex.Immediate.Status != 504 {
			t.Fatalf("immediate %+v, want 504", ex.Immediate)
		}
	})
	t.Run("an unreachable render server is a 503", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close()
		_, c2 := renderInstance(t, "http://"+addr, time.Second)
		ex, err := c2.Do(context.Background(), extproctest.Request{Path: "/v1/chat/completions", Body: chat})
		if err != nil {
			t.Fatal(err)
		}
		if ex.Immediate == nil || ex.Immediate.Status != 503 || !strings.Contains(string(ex.Immediate.Body), "unreachable") {
			t.Fatalf("immediate %+v, want 503 naming the unreachable tokenizer", ex.Immediate)
		}
	})
}

// BenchmarkVLLMRenderDecision is the routing decision through a local render server (a loopback
// httptest server answering a fixed 3,000-token render): compare with BenchmarkRoutedChatRequest
// for the latency vllm-render adds.
func BenchmarkVLLMRenderDecision(b *testing.B) {
	rs := newRenderStub(b)
	ids := make([]string, 3000)
	for i := range ids {
		ids[i] = fmt.Sprint(100 + i%5000)
	}
	rs.set(200, `{"token_ids":[`+strings.Join(ids, ",")+`]}`)
	_, client := renderInstance(b, rs.srv.URL, 5*time.Second)
	req := extproctest.Request{Path: "/v1/chat/completions", Body: []byte(`{"model":"` + e2eModel + `","messages":[{"role":"user","content":"hi"}]}`),
		Response: &extproctest.Response{Status: 200, ContentType: "text/event-stream", Chunks: sseChunks()}}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		ex, err := client.Do(context.Background(), req)
		if err != nil || ex.Immediate != nil {
			b.Fatalf("err=%v immediate=%+v", err, ex.Immediate)
		}
	}
}

// TestRenderURLsPerModel checks DYN_EPP_TOKENIZER_SERVICE_URLS: a listed model calls its own
// render server, every other model the default one.
func TestRenderURLsPerModel(t *testing.T) {
	a, b := newRenderStub(t), newRenderStub(t)
	cfg := DefaultConfig()
	cfg.TokenizerServiceURL = a.srv.URL
	cfg.TokenizerServiceURLs = ModelDirs{"vision": b.srv.URL}
	set, err := loadTokenizers(cfg, *testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	for model, stub := range map[string]*renderStub{"vision": b, "text": a} {
		tk, err := set.ForModel(model)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tk.TokenizeChat([]byte(`{"messages":[]}`)); err != nil {
			t.Fatal(err)
		}
		stub.mu.Lock()
		n := len(stub.calls)
		stub.mu.Unlock()
		if n != 1 {
			t.Fatalf("model %q: its render server saw %d calls, want 1", model, n)
		}
	}
}

// TestRenderFailuresAreLoggedWithTheURLTheClientDoesNotSee: a render 5xx, an unreachable render
// server and a 404 (a wrong render URL) are each logged at warn with the render URL and status;
// the client's error body never names the render URL.
func TestRenderFailuresAreLoggedWithTheURLTheClientDoesNotSee(t *testing.T) {
	rs := newRenderStub(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	ln.Close()
	chat := []byte(`{"model":"` + e2eModel + `","messages":[{"role":"user","content":"hi"}]}`)
	for _, tc := range []struct {
		name, url  string
		status     int
		body       string
		wantStatus int
	}{
		{"a render 5xx", rs.srv.URL, 500, `{"error":{"message":"engine died"}}`, 502},
		{"a render 404", rs.srv.URL, 404, `{"detail":"Not Found"}`, 400},
		{"an unreachable render server", dead, 0, "", 503},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.status != 0 {
				rs.set(tc.status, tc.body)
			}
			cfg := loopbackConfig(t)
			cfg.TokenizerDir, cfg.TokenizerServiceURL, cfg.UseKVEvents = "", tc.url, false
			inst, logs := startLogged(t, cfg)
			addWorkers(t, inst, 1, 18250)
			ex, err := extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC)).Do(context.Background(),
				extproctest.Request{Body: chat, Headers: []extproctest.Header{{Key: "x-request-id", Value: "rid-9"}}})
			if err != nil {
				t.Fatal(err)
			}
			if ex.Immediate == nil || ex.Immediate.Status != tc.wantStatus || strings.Contains(string(ex.Immediate.Body), strings.TrimPrefix(tc.url, "http://")) {
				t.Fatalf("immediate %+v: want %d without the render URL", ex.Immediate, tc.wantStatus)
			}
			var logged bool
			for _, line := range strings.Split(logs.String(), "\n") {
				if strings.Contains(line, `"level":"warn"`) && strings.Contains(line, tc.url+"/v1/chat/completions/render") &&
					strings.Contains(line, `"request_id":"rid-9"`) {
					logged = true
				}
			}
			if !logged {
				t.Fatalf("no warn line names the render URL and the request id:\n%s", logs.String())
			}
		})
	}
}

// TestAModelWithoutARenderURLNamesTheRenderSettings: with DYN_EPP_TOKENIZER_SERVICE_URLS covering
// one model only, a request for another served model is a 500 that names the render settings to
// set — not the local-mode ones — and does not list the configured models.
func TestAModelWithoutARenderURLNamesTheRenderSettings(t *testing.T) {
	rs := newRenderStub(t)
	cfg := loopbackConfig(t)
	cfg.TokenizerDir, cfg.UseKVEvents = "", false
	cfg.TokenizerServiceURLs = ModelDirs{e2eModel: rs.srv.URL, "secret/other": rs.srv.URL}
	inst := startInstance(t, cfg)
	bs := uint32(16)
	if _, err := inst.Service.UpsertWorker(context.Background(), picker.WorkerRecord{WorkerID: 1, ModelName: "unlisted/model",
		Endpoint: "http://127.0.0.1:18261", BlockSize: &bs}, picker.SourceAPI); err != nil {
		t.Fatal(err)
	}
	ex, err := extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC)).Do(context.Background(), extproctest.Request{
		Body: []byte(`{"model":"unlisted/model","messages":[{"role":"user","content":"hi"}]}`)})
	if err != nil {
		t.Fatal(err)
	}
	body := ""
	if ex.Immediate != nil {
		body = string(ex.Immediate.Body)
	}
	if ex.Immediate == nil || ex.Immediate.Status != 500 || !strings.Contains(body, "DYN_EPP_TOKENIZER_SERVICE_URL") ||
		strings.Contains(body, "DYN_EPP_TOKENIZERS") || strings.Contains(body, "DYN_EPP_TOKENIZER_DIR") ||
		strings.Contains(body, "secret/other") || strings.Count(body, "unlisted/model") != 1 {
		t.Fatalf("immediate %v %s: want a 500 naming the render settings once, without the configured models", ex.Immediate, body)
	}
}
