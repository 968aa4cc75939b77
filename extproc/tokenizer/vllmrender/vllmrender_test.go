package vllmrender_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/tokenizer/vllmrender"
	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
)

// renderServer is an httptest render server whose answer per path the test sets.
type renderServer struct {
	*httptest.Server
	mu      sync.Mutex
	answer  func(w http.ResponseWriter, r *http.Request, body []byte)
	got     []seen
	newConn atomic.Int64
}

type seen struct {
	path, contentType, requestID, body string
}

func newRenderServer(t *testing.T) *renderServer {
	rs := &renderServer{}
	rs.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		rs.mu.Lock()
		rs.got = append(rs.got, seen{r.URL.Path, r.Header.Get("Content-Type"), r.Header.Get("x-request-id"), string(body)})
		answer := rs.answer
		rs.mu.Unlock()
		answer(w, r, body)
	}))
	rs.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			rs.newConn.Add(1)
		}
	}
	rs.Start()
	t.Cleanup(rs.Close)
	return rs
}

func (rs *renderServer) set(f func(w http.ResponseWriter, r *http.Request, body []byte)) {
	rs.mu.Lock()
	rs.answer = f
	rs.mu.Unlock()
}

func reply(status int, body string) func(http.ResponseWriter, *http.Request, []byte) {
	return func(w http.ResponseWriter, _ *http.Request, _ []byte) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		io.WriteString(w, body)
	}
}

func newClient(t *testing.T, url string, timeout time.Duration) *vllmrender.Client {
	t.Helper()
	c, err := vllmrender.New(vllmrender.Config{BaseURL: url, Timeout: timeout, MaxResponseBytes: 1 << 10})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// statusOf maps a render error as the ext_proc server does (epp.md §8).
func statusOf(err error) int {
	status, _ := extproc.StatusFor(&picker.Error{Kind: extproc.ClassifyTokenizerError(err), Message: err.Error(), Err: err})
	return status
}

func TestRenderSendsTheBodyUnchangedAndReadsTokenIDs(t *testing.T) {
	rs := newRenderServer(t)
	c := newClient(t, rs.URL+"/", 5*time.Second)
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}], "x": 1.0}`
	tests := []struct {
		name, path, answer string
		kind               vllmrender.Kind
		want               vllmrender.Result
	}{
		{"chat reads the object's token_ids", "/v1/chat/completions/render", `{"request_id":"r","token_ids":[1,2,3]}`, vllmrender.Chat, vllmrender.Result{TokenIDs: []uint32{1, 2, 3}}},
		{"completion reads element 0 of the array", "/v1/completions/render", `[{"token_ids":[7]},{"token_ids":[8]}]`, vllmrender.Completion, vllmrender.Result{TokenIDs: []uint32{7}}},
		{"responses reads the object's token_ids", "/v1/responses/render", `{"token_ids":[4,5]}`, vllmrender.Responses, vllmrender.Result{TokenIDs: []uint32{4, 5}}},
		{"multimodal placeholders become hashed items", "/v1/chat/completions/render",
			`{"token_ids":[1,2,3,4],"features":{"mm_hashes":{"image":["img-0"]},"mm_placeholders":{"image":[{"offset":1,"length":2}]}}}`, vllmrender.Chat,
			vllmrender.Result{TokenIDs: []uint32{1, 2, 3, 4}, MM: []vllmrender.MMItem{{Offset: 1, Length: 2, Hash: kvindex.HashMMIdentifier("img-0")}}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rs.set(reply(200, tc.answer))
			got, err := c.Render(context.Background(), tc.kind, []byte(body), "req-1")
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Fatalf("result differs (-want +got):\n%s", diff)
			}
			rs.mu.Lock()
			last := rs.got[len(rs.got)-1]
			rs.mu.Unlock()
			if want := (seen{tc.path, "application/json", "req-1", body}); last != want {
				t.Fatalf("server saw %+v, want %+v", last, want)
			}
		})
	}
	t.Run("connections are reused across calls", func(t *testing.T) {
		rs.set(reply(200, `{"token_ids":[1]}`))
		before := rs.newConn.Load()
		for i := 0; i < 20; i++ {
			if _, err := c.Render(context.Background(), vllmrender.Chat, []byte(body), ""); err != nil {
				t.Fatal(err)
			}
		}
		if n := rs.newConn.Load() - before; n > 1 {
			t.Fatalf("%d new connections for 20 sequential calls, want at most 1", n)
		}
	})
}

func TestRenderErrorsMapToStatuses(t *testing.T) {
	rs := newRenderServer(t)
	c := newClient(t, rs.URL, 5*time.Second)
	tests := []struct {
		name   string
		answer func(http.ResponseWriter, *http.Request, []byte)
		status int
		msg    string
	}{
		{"a 4xx is a 400 carrying the tokenizer's message", reply(400, `{"error":{"message":"messages: field required","type":"BadRequestError","code":400}}`), 400, "render server answered 400: messages: field required"},
		{"a 422 with a FastAPI detail is a 400", reply(422, `{"detail":"bad body"}`), 400, "render server answered 422: bad body"},
		{"a 404 (a wrong render URL) is a 400 that says it came from the render server", reply(404, `{"detail":"Not Found"}`), 400, "render server answered 404: Not Found"},
		{"a 401 without a body names its status", reply(401, ``), 400, "render server answered 401: Unauthorized"},
		{"a 5xx is a 502", reply(500, `{"error":{"message":"engine died"}}`), 502, "engine died"},
		{"a body that is not JSON is a 502", reply(200, `<html>`), 502, "render response"},
		{"missing token_ids is a 502", reply(200, `{"tokens":[1]}`), 502, "missing token_ids"},
		{"token ids outside uint32 are a 502", reply(200, `{"token_ids":[-1]}`), 502, "render response"},
		{"a response over the size bound is a 502", reply(200, `{"token_ids":[`+strings.Repeat("1,", 1000)+`1]}`), 502, "larger than 1024 bytes"},
		{"mismatched multimodal features are a 502", reply(200, `{"token_ids":[1],"features":{"mm_hashes":["a","b"],"mm_placeholders":[{"offset":0,"length":1}]}}`), 502, "2 mm_hashes but 1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rs.set(tc.answer)
			_, err := c.Render(context.Background(), vllmrender.Chat, []byte(`{}`), "")
			if err == nil {
				t.Fatal("want an error")
			}
			if got := statusOf(err); got != tc.status || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("status %d, error %q; want %d containing %q", got, err, tc.status, tc.msg)
			}
			var re *vllmrender.Error
			if errors.As(err, &re) {
				if msg := err.Error(); len(msg) > 40 && strings.Count(re.Detail(), msg[len(msg)-40:]) > 1 {
					t.Fatalf("Detail repeats the cause: %q", re.Detail())
				}
			}
		})
	}
	t.Run("an upstream message is bounded and stripped of control characters", func(t *testing.T) {
		for _, status := range []int{400, 500} {
			msg := strings.Repeat("x\u0000y\u001b[2Jz", 2000) // 24,000 bytes with NUL and ESC
			rs.set(reply(status, `{"error":{"message":"`+msg+`"}}`))
			big, err := vllmrender.New(vllmrender.Config{BaseURL: rs.URL, Timeout: 5 * time.Second, MaxResponseBytes: 1 << 20})
			if err != nil {
				t.Fatal(err)
			}
			_, err = big.Render(context.Background(), vllmrender.Chat, []byte(`{}`), "")
			if err == nil {
				t.Fatal("want an error")
			}
			if len(err.Error()) > 600 || strings.ContainsAny(err.Error(), "\x00\x1b") || !strings.Contains(err.Error(), "xy[2Jz") {
				t.Fatalf("status %d: error of %d bytes: %q", status, len(err.Error()), err)
			}
		}
		rs.set(reply(400, "plain \xff\x00text"))
		_, err := c.Render(context.Background(), vllmrender.Chat, []byte(`{}`), "")
		if err == nil || err.Error() != "render server answered 400: plain text" {
			t.Fatalf("error %q", err)
		}
	})
	t.Run("a render call past the timeout is a 504", func(t *testing.T) {
		release := make(chan struct{})
		defer close(release)
		rs.set(func(w http.ResponseWriter, r *http.Request, _ []byte) {
			select {
			case <-release:
			case <-r.Context().Done():
			}
		})
		slow := newClient(t, rs.URL, 50*time.Millisecond)
		_, err := slow.Render(context.Background(), vllmrender.Chat, []byte(`{}`), "")
		if err == nil || statusOf(err) != 504 {
			t.Fatalf("err %v → status %d, want 504", err, statusOf(err))
		}
	})
	t.Run("an unreachable render server is a 503", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close() // nothing listens there now: connection refused
		_, err = newClient(t, "http://"+addr, 5*time.Second).Render(context.Background(), vllmrender.Chat, []byte(`{}`), "")
		if err == nil || statusOf(err) != 503 {
			t.Fatalf("err %v → status %d, want 503", err, statusOf(err))
		}
		// The client sees the kind of failure, the log (Detail) where it happened.
		var re *vllmrender.Error
		if !errors.As(err, &re) || strings.Contains(err.Error(), addr) || !strings.Contains(re.Detail(), addr) ||
			re.URL != "http://"+addr+"/v1/chat/completions/render" {
			t.Fatalf("message %q must not name the render URL; Detail %q and URL %q must", err, re.Detail(), re.URL)
		}
	})
	t.Run("a stream that ends first returns its context error, not a tokenizer status", func(t *testing.T) {
		rs.set(func(w http.ResponseWriter, r *http.Request, _ []byte) { <-r.Context().Done() })
		ctx, cancel := context.WithCancel(context.Background())
		go func() { time.Sleep(20 * time.Millisecond); cancel() }()
		_, err := c.Render(ctx, vllmrender.Chat, []byte(`{}`), "")
		if err != context.Canceled {
			t.Fatalf("err = %v, want context.Canceled", err)
		}
	})
}

func TestNewRejectsBadConfig(t *testing.T) {
	for _, cfg := range []vllmrender.Config{
		{BaseURL: "tokenizer:8000", Timeout: time.Second, MaxResponseBytes: 1},
		{BaseURL: "http://x", Timeout: 0, MaxResponseBytes: 1},
		{BaseURL: "http://x", Timeout: time.Second, MaxResponseBytes: 0},
	} {
		if _, err := vllmrender.New(cfg); err == nil {
			t.Errorf("New(%+v) accepted", cfg)
		}
	}
}
