package frontproxy_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"

	"github.com/kvepp/kvepp/enginesim/frontproxy"
)

// script is a scripted ext_proc server: it records what the proxy sent and answers as told.
type script struct {
	extprocv3.UnimplementedExternalProcessorServer

	// routing answers the request phase: either an ImmediateResponse or a header mutation.
	immediate   *extprocv3.ImmediateResponse
	destination func() string
	setHeaders  map[string]string
	restreamAs  [][]byte // the re-streamed body chunks (nil = the received body in one chunk)

	mu           sync.Mutex
	reqHeaders   map[string]string
	protocol     *extprocv3.ProtocolConfiguration
	body         []byte
	bodyMsgs     int
	respStatus   string
	served       string
	respChunks   [][]byte
	respEOS      bool
	cancelled    bool
	streamEnded  chan struct{}
	streamEndErr error
}

func newScript() *script { return &script{streamEnded: make(chan struct{}, 16)} }

func headerValue(h *corev3.HeaderValue) string {
	if raw := h.GetRawValue(); len(raw) > 0 {
		return string(raw)
	}
	return h.GetValue()
}

func (s *script) Process(ps extprocv3.ExternalProcessor_ProcessServer) error {
	defer func() {
		select {
		case s.streamEnded <- struct{}{}:
		default: // nobody is waiting (benchmarks run many streams)
		}
	}()
	send := func(r *extprocv3.ProcessingResponse) error { return ps.Send(r) }
	for {
		req, err := ps.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			s.mu.Lock()
			s.cancelled = ps.Context().Err() != nil
			s.streamEndErr = err
			s.mu.Unlock()
			return err
		}
		s.mu.Lock()
		if req.GetProtocolConfig() != nil && s.protocol == nil {
			s.protocol = req.GetProtocolConfig()
		}
		s.mu.Unlock()
		switch r := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			s.mu.Lock()
			s.body, s.bodyMsgs, s.respChunks, s.respEOS = nil, 0, nil, false // a new exchange
			s.reqHeaders = map[string]string{}
			for _, h := range r.RequestHeaders.GetHeaders().GetHeaders() {
				s.reqHeaders[h.GetKey()] = headerValue(h)
			}
			s.mu.Unlock()
		case *extprocv3.ProcessingRequest_RequestBody:
			s.mu.Lock()
			s.body = append(s.body, r.RequestBody.GetBody()...)
			s.bodyMsgs++
			body := append([]byte(nil), s.body...)
			s.mu.Unlock()
			if !r.RequestBody.GetEndOfStream() {
				continue
			}
			if s.immediate != nil {
				return send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: s.immediate}})
			}
			var set []*corev3.HeaderValueOption
			if s.destination != nil {
				set = append(set, &corev3.HeaderValueOption{
					Header:       &corev3.HeaderValue{Key: frontproxy.DestinationHeader, RawValue: []byte(s.destination())},
					AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
				})
			}
			for k, v := range s.setHeaders {
				set = append(set, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)}})
			}
			if err := send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
				RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
					HeaderMutation:  &extprocv3.HeaderMutation{SetHeaders: set, RemoveHeaders: []string{"x-remove-me"}},
					ClearRouteCache: true,
				}},
			}}); err != nil {
				return err
			}
			chunks := s.restreamAs
			if chunks == nil {
				chunks = [][]byte{body}
			}
			for i, c := range chunks {
				if err := send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
					RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
						BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
							StreamedResponse: &extprocv3.StreamedBodyResponse{Body: c, EndOfStream: i == len(chunks)-1},
						}},
					}},
				}}); err != nil {
					return err
				}
			}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			s.mu.Lock()
			for _, h := range r.ResponseHeaders.GetHeaders().GetHeaders() {
				if h.GetKey() == ":status" {
					s.respStatus = headerValue(h)
				}
			}
			s.served = req.GetMetadataContext().GetFilterMetadata()[frontproxy.LBNamespace].GetFields()[frontproxy.ServedEndpointKey].GetStringValue()
			s.mu.Unlock()
			if err := send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
				ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}},
			}}); err != nil {
				return err
			}
		case *extprocv3.ProcessingRequest_ResponseBody:
			b := r.ResponseBody
			s.mu.Lock()
			s.respChunks = append(s.respChunks, append([]byte(nil), b.GetBody()...))
			s.respEOS = s.respEOS || b.GetEndOfStream()
			s.mu.Unlock()
			if err := send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
				ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
					BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
						StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b.GetBody(), EndOfStream: b.GetEndOfStream()},
					}},
				}},
			}}); err != nil {
				return err
			}
		}
	}
}

// fixture is a proxy in front of a scripted ext_proc server.
type fixture struct {
	script    *script
	srv       *frontproxy.Server
	exchanges chan frontproxy.Exchange
}

func newFixture(t testing.TB, s *script, tweak func(*frontproxy.Config)) *fixture {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(g, s)
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)
	conn, err := frontproxy.Dial(ln.Addr().String(), false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	f := &fixture{script: s, exchanges: make(chan frontproxy.Exchange, 16)}
	cfg := frontproxy.Config{ExtProc: conn, RequestChunkSize: 1000, Observe: func(ex frontproxy.Exchange) { f.exchanges <- ex }}
	if tweak != nil {
		tweak(&cfg)
	}
	p, err := frontproxy.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	f.srv, err = frontproxy.Start("", p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.srv.Close() })
	return f
}

func (f *fixture) exchange(t *testing.T) frontproxy.Exchange {
	t.Helper()
	select {
	case ex := <-f.exchanges:
		return ex
	case <-time.After(10 * time.Second):
		t.Fatal("no exchange observed")
		return frontproxy.Exchange{}
	}
}

// sseUpstream answers with n SSE events, flushing each, pausing gap between them, and records
// the request it saw.
type sseUpstream struct {
	n    int
	gap  time.Duration
	mu   sync.Mutex
	hdr  http.Header
	body []byte
	hits int
}

func (u *sseUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	u.mu.Lock()
	u.hdr, u.body = r.Header.Clone(), body
	u.hits++
	u.mu.Unlock()
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("X-Upstream", "yes")
	w.WriteHeader(http.StatusOK)
	for i := 0; i < u.n; i++ {
		if _, err := fmt.Fprintf(w, "data: {\"token\":%d}\n\n", i); err != nil {
			return
		}
		w.(http.Flusher).Flush()
		if u.gap > 0 {
			select {
			case <-time.After(u.gap):
			case <-r.Context().Done():
				return
			}
		}
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
}

func startUpstream(t testing.TB, u *sseUpstream) string {
	t.Helper()
	ts := httptest.NewServer(u)
	t.Cleanup(ts.Close)
	return strings.TrimPrefix(ts.URL, "http://")
}

func post(t *testing.T, url string, body []byte, hdr map[string]string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, data
}

func wantSSE(n int) string {
	var b strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "data: {\"token\":%d}\n\n", i)
	}
	b.WriteString("data: [DONE]\n\n")
	return b.String()
}

func TestProxyRoutesThroughExtProc(t *testing.T) {
	up := &sseUpstream{n: 5}
	upAddr := startUpstream(t, up)
	s := newScript()
	s.destination = func() string { return upAddr }
	s.setHeaders = map[string]string{"x-dynamo-worker-instance-id": "7", "x-routed": "1"}
	s.restreamAs = nil
	f := newFixture(t, s, nil)
	body := bytes.Repeat([]byte(`{"prompt":[1,2,3]}`), 150) // 2,700 bytes: three request_body messages of ≤ 1,000

	resp, got := post(t, f.srv.URL()+"/v1/completions?x=1", body, map[string]string{"X-Request-Id": "req-1", "X-Remove-Me": "secret"})
	ex := f.exchange(t)

	t.Run("the client receives the upstream stream unchanged", func(t *testing.T) {
		if resp.StatusCode != 200 || string(got) != wantSSE(5) {
			t.Fatalf("status %d body %q", resp.StatusCode, got)
		}
		if resp.Header.Get("X-Upstream") != "yes" || resp.Header.Get(frontproxy.ServedHeader) != upAddr {
			t.Fatalf("response headers %v", resp.Header)
		}
	})
	t.Run("ext_proc sees Envoy's request headers, protocol and chunked body", func(t *testing.T) {
		s.mu.Lock()
		defer s.mu.Unlock()
		for k, want := range map[string]string{":method": "POST", ":path": "/v1/completions?x=1", "content-type": "application/json",
			"content-length": "2700", "x-request-id": "req-1"} {
			if s.reqHeaders[k] != want {
				t.Errorf("request header %s = %q, want %q", k, s.reqHeaders[k], want)
			}
		}
		if s.protocol.GetRequestBodyMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED ||
			s.protocol.GetResponseBodyMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
			t.Errorf("protocol config %v", s.protocol)
		}
		if !bytes.Equal(s.body, body) || s.bodyMsgs != 3 {
			t.Errorf("ext_proc got %d bytes in %d messages", len(s.body), s.bodyMsgs)
		}
	})
	t.Run("the upstream gets the mutated headers and the re-streamed body", func(t *testing.T) {
		up.mu.Lock()
		defer up.mu.Unlock()
		if !bytes.Equal(up.body, body) {
			t.Errorf("upstream body differs (%d bytes)", len(up.body))
		}
		if up.hdr.Get("X-Routed") != "1" || up.hdr.Get("X-Remove-Me") != "" || up.hdr.Get(frontproxy.DestinationHeader) != upAddr {
			t.Errorf("upstream headers %v", up.hdr)
		}
	})
	t.Run("the response phase reports status, served endpoint and every byte with end_of_stream", func(t *testing.T) {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.respStatus != "200" || s.served != upAddr || !s.respEOS || string(bytes.Join(s.respChunks, nil)) != wantSSE(5) {
			t.Errorf("status %q served %q eos %v chunks %q", s.respStatus, s.served, s.respEOS, s.respChunks)
		}
	})
	t.Run("the exchange records the decision and the destination", func(t *testing.T) {
		if ex.RequestID != "req-1" || ex.Destination != upAddr || ex.Served != upAddr || ex.WorkerID != "7" ||
			ex.Status != 200 || ex.Immediate != 0 || ex.Err != nil || ex.Decision <= 0 || ex.ResponseBytes != int64(len(wantSSE(5))) ||
			ex.FirstByte <= 0 || ex.Duration < ex.FirstByte {
			t.Errorf("exchange %+v", ex)
		}
	})
}

func TestProxyImmediateResponse(t *testing.T) {
	up := &sseUpstream{n: 1}
	upAddr := startUpstream(t, up)
	s := newScript()
	s.destination = func() string { return upAddr }
	s.immediate = &extprocv3.ImmediateResponse{
		Status: &typev3.HttpStatus{Code: typev3.StatusCode_TooManyRequests},
		Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
			{Header: &corev3.HeaderValue{Key: "retry-after", RawValue: []byte("1")}},
		}},
		Body: []byte(`{"error":{"type":"overloaded"}}`),
	}
	f := newFixture(t, s, nil)
	resp, got := post(t, f.srv.URL()+"/v1/completions", []byte(`{"prompt":[1]}`), nil)
	ex := f.exchange(t)
	if resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "1" || string(got) != `{"error":{"type":"overloaded"}}` {
		t.Fatalf("client got %d %v %q", resp.StatusCode, resp.Header, got)
	}
	if ex.Immediate != 429 || ex.Status != 429 || ex.Err != nil || ex.Served != "" || ex.Decision <= 0 {
		t.Fatalf("exchange %+v", ex)
	}
	up.mu.Lock()
	defer up.mu.Unlock()
	if up.hits != 0 {
		t.Fatalf("the upstream was called %d times after an ImmediateResponse", up.hits)
	}
}

// deadAddr returns a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func TestProxyDestinationList(t *testing.T) {
	up := &sseUpstream{n: 2}
	upAddr := startUpstream(t, up)
	dead := deadAddr(t)
	cases := []struct {
		name       string
		dest       string
		wantStatus int
		wantServed string
		wantErr    bool
	}{
		{"an unreachable primary falls back to the next entry", dead + "," + upAddr, 200, upAddr, false},
		{"no reachable entry gives the client 503", dead, 503, "", true},
		{"an empty destination gives the client 503", "", 503, "", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newScript()
			s.destination = func() string { return tc.dest }
			f := newFixture(t, s, nil)
			resp, _ := post(t, f.srv.URL()+"/v1/completions", []byte(`{}`), nil)
			ex := f.exchange(t)
			if resp.StatusCode != tc.wantStatus || ex.Served != tc.wantServed || (ex.Err != nil) != tc.wantErr {
				t.Fatalf("status %d served %q err %v", resp.StatusCode, ex.Served, ex.Err)
			}
			s.mu.Lock()
			defer s.mu.Unlock()
			if want := fmt.Sprint(tc.wantStatus); s.respStatus != want || !s.respEOS {
				t.Fatalf("ext_proc saw response status %q (eos %v), want %s", s.respStatus, s.respEOS, want)
			}
		})
	}
}

func TestProxyClientCancelEndsTheStream(t *testing.T) {
	up := &sseUpstream{n: 1000, gap: 20 * time.Millisecond}
	upAddr := startUpstream(t, up)
	s := newScript()
	s.destination = func() string { return upAddr }
	f := newFixture(t, s, nil)
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, f.srv.URL()+"/v1/completions", strings.NewReader(`{}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	ex := f.exchange(t)
	if ex.Err == nil {
		t.Fatalf("a cancelled exchange reports no error: %+v", ex)
	}
	select {
	case <-s.streamEnded:
	case <-time.After(5 * time.Second):
		t.Fatal("the ext_proc stream outlived the client")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.respEOS {
		t.Fatal("a cancelled response reached end_of_stream")
	}
}

func TestProxyResponseCoalesce(t *testing.T) {
	cases := []struct {
		name     string
		coalesce time.Duration
		maxMsgs  int
	}{
		{"without coalescing every event is its own chunk", 0, 1000},
		{"coalescing batches a fast token stream into a few chunks", 150 * time.Millisecond, 6},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			up := &sseUpstream{n: 40, gap: 5 * time.Millisecond}
			upAddr := startUpstream(t, up)
			s := newScript()
			s.destination = func() string { return upAddr }
			f := newFixture(t, s, func(c *frontproxy.Config) { c.ResponseCoalesce = tc.coalesce })
			resp, got := post(t, f.srv.URL()+"/v1/completions", []byte(`{}`), nil)
			f.exchange(t)
			if resp.StatusCode != 200 || string(got) != wantSSE(40) {
				t.Fatalf("status %d body %q", resp.StatusCode, got)
			}
			s.mu.Lock()
			defer s.mu.Unlock()
			if n := len(s.respChunks); n > tc.maxMsgs || (tc.coalesce == 0 && n < 20) {
				t.Fatalf("%d response_body messages", n)
			}
			if first := string(s.respChunks[0]); first != "data: {\"token\":0}\n\n" {
				t.Fatalf("the first chunk was held back and merged: %q", first)
			}
		})
	}
}

func TestProxyRejectsOversizeBodiesLocally(t *testing.T) {
	s := newScript()
	s.destination = func() string { return "127.0.0.1:1" }
	f := newFixture(t, s, func(c *frontproxy.Config) { c.MaxRequestBody = 10 })
	resp, _ := post(t, f.srv.URL()+"/v1/completions", bytes.Repeat([]byte("x"), 11), nil)
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("status %d, want 413", resp.StatusCode)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.reqHeaders != nil {
		t.Fatal("the picker was consulted for a body over the cap")
	}
}

func TestNewValidatesConfig(t *testing.T) {
	conn, err := frontproxy.Dial("127.0.0.1:1", false)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	cases := []struct {
		name string
		cfg  frontproxy.Config
	}{
		{"a missing ext_proc connection is refused", frontproxy.Config{}},
		{"a negative chunk size is refused", frontproxy.Config{ExtProc: conn, RequestChunkSize: -1}},
		{"a negative coalescing interval is refused", frontproxy.Config{ExtProc: conn, ResponseCoalesce: -time.Second}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := frontproxy.New(tc.cfg); err == nil {
				t.Fatal("New accepted an invalid config")
			}
		})
	}
}
