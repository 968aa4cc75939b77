package runner

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/internal/sharedtest"
	"github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
	"github.com/kvepp/kvepp/picker"
)

// testLogger writes the runner's logs to the test log.
func testLogger(t testing.TB) *zerolog.Logger {
	l := zerolog.New(zerolog.ConsoleWriter{Out: testWriter{t}, NoColor: true}).Level(zerolog.WarnLevel).With().Timestamp().Logger()
	return &l
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// loopbackConfig is a plaintext configuration on ephemeral loopback ports with the Qwen3 tokenizer.
func loopbackConfig(t testing.TB) Config {
	cfg := DefaultConfig()
	cfg.BindAddress = "127.0.0.1"
	cfg.GRPCPort, cfg.GRPCHealthPort, cfg.SelectionHTTPPort, cfg.MetricsPort = 0, 0, 0, 0
	cfg.SecureServing = false
	cfg.TokenizerDir = sharedtest.Qwen3TokenizerDir(t)
	cfg.DrainTimeout = Seconds(50 * time.Millisecond)
	return cfg
}

// startInstance starts the runner and stops it when the test ends.
func startInstance(t testing.TB, cfg Config) *Instance {
	t.Helper()
	inst, err := Start(context.Background(), Options{Config: cfg, Logger: testLogger(t), WorkersFileDebounce: 20 * time.Millisecond})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		if err := inst.Stop(context.Background()); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
	return inst
}

// dialPlain connects to the ext_proc port without TLS.
func dialPlain(t testing.TB, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// httpJSON performs a request on the side port and decodes the JSON answer into out.
func httpJSON(t testing.TB, method, url string, body any, out any) int {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
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
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			t.Fatalf("%s %s: %d %s: %v", method, url, resp.StatusCode, data, err)
		}
	}
	return resp.StatusCode
}

// partitionLoads is the GET /loads body (selection-service.md §14.1).
type partitionLoads []struct {
	ModelName    string `json:"model_name"`
	RoutingGroup string `json:"routing_group"`
	Loads        []struct {
		WorkerID               uint64 `json:"worker_id"`
		DPRank                 uint32 `json:"dp_rank"`
		PotentialPrefillTokens uint64 `json:"potential_prefill_tokens"`
		PotentialDecodeBlocks  uint64 `json:"potential_decode_blocks"`
		ActiveRequests         uint64 `json:"active_requests"`
	} `json:"loads"`
}

// activeLoad sums every load figure of GET /loads; zero means no booking anywhere.
func activeLoad(t testing.TB, selection string) (uint64, string) {
	t.Helper()
	var pl partitionLoads
	if st := httpJSON(t, http.MethodGet, "http://"+selection+"/loads", nil, &pl); st != http.StatusOK {
		t.Fatalf("GET /loads: %d", st)
	}
	var sum uint64
	for _, p := range pl {
		for _, l := range p.Loads {
			sum += l.PotentialPrefillTokens + l.PotentialDecodeBlocks + l.ActiveRequests
		}
	}
	b, _ := json.Marshal(pl)
	return sum, string(b)
}

// waitNoLoad polls GET /loads until no worker carries load.
func waitNoLoad(t testing.TB, selection string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		sum, body := activeLoad(t, selection)
		if sum == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("load still active after 5 s: %s", body)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// deviceOverlap returns worker id → device overlap blocks of tokens (POST /overlap_scores on the
// side port; nothing is selected or booked).
func deviceOverlap(t testing.TB, selection, model string, tokens []uint32) map[uint64]int {
	t.Helper()
	var resp struct {
		Workers []struct {
			WorkerID     uint64 `json:"worker_id"`
			DeviceBlocks int    `json:"device_blocks"`
		} `json:"workers"`
	}
	st := httpJSON(t, http.MethodPost, "http://"+selection+"/overlap_scores",
		map[string]any{"model_name": model, "token_ids": tokens}, &resp)
	if st != http.StatusOK {
		t.Fatalf("POST /overlap_scores: %d", st)
	}
	out := map[uint64]int{}
	for _, w := range resp.Workers {
		out[w.WorkerID] = w.DeviceBlocks
	}
	return out
}

const e2eModel = "Qwen/Qwen3-0.6B"

// e2eFixture is a running kvepp with three workers fed by three KV-event publishers.
type e2eFixture struct {
	inst   *Instance
	client *extproctest.Client
	golden sharedtest.RequestVector
	pubs   []*kveventstest.Publisher
	k      int
}

// newE2EFixture starts kvepp on a workers file of three workers whose KV events come from three
// publishers; worker 2 then stores the first k blocks of the golden chat-long prompt and worker 3
// the first k−1, and the fixture waits until the index shows both.
func newE2EFixture(t *testing.T, k int, tweak func(*Config)) *e2eFixture {
	t.Helper()
	f := &e2eFixture{golden: sharedtest.RequestVectorNamed(t, "chat-long"), k: k}
	if f.golden.BlockSize != 16 || len(f.golden.TokenIDs) < 16*k {
		t.Fatalf("golden chat-long: block size %d, %d tokens", f.golden.BlockSize, len(f.golden.TokenIDs))
	}
	var yml strings.Builder
	for i := 1; i <= 3; i++ {
		pub := kveventstest.New(t, kveventstest.Options{})
		f.pubs = append(f.pubs, pub)
		fmt.Fprintf(&yml, "- worker_id: %d\n  model_name: %s\n  endpoint: http://127.0.0.1:%d\n  block_size: 16\n  kv_events_endpoint: %s\n",
			i, e2eModel, 18000+i, pub.Endpoint())
	}
	path := filepath.Join(t.TempDir(), "workers.yaml")
	if err := os.WriteFile(path, []byte(yml.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := loopbackConfig(t)
	cfg.WorkersFile = path
	if tweak != nil {
		tweak(&cfg)
	}
	f.inst = startInstance(t, cfg)
	f.client = extproctest.NewClient(dialPlain(t, f.inst.Addrs().GRPC))

	for _, pub := range f.pubs {
		pub.WaitForSubscriber()
	}
	tokens := f.golden.TokenIDs
	engineHashes := func(worker, n int) []uint64 {
		hs := make([]uint64, n)
		for i := range hs {
			hs[i] = uint64(worker)<<32 | uint64(i+1)
		}
		return hs
	}
	f.pubs[1].Publish(kveventstest.Stored(nil, engineHashes(2, k), tokens[:16*k], 16))
	f.pubs[2].Publish(kveventstest.Stored(nil, engineHashes(3, k-1), tokens[:16*(k-1)], 16))

	want := map[uint64]int{1: 0, 2: k, 3: k - 1}
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := deviceOverlap(t, f.inst.Addrs().Selection, e2eModel, tokens)
		if fmt.Sprint(got) == fmt.Sprint(want) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("index never showed the published blocks: device blocks %v, want %v", got, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return f
}

// sseChunks is a small streamed chat completion.
func sseChunks() [][]byte {
	return [][]byte{
		[]byte("data: {\"choices\":[{\"delta\":{\"content\":\"Sum\"}}]}\n\n"),
		[]byte("data: {\"choices\":[{\"delta\":{\"content\":\"mary\"}}]}\n\n"),
		[]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3011,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n"),
	}
}

func TestEndToEnd(t *testing.T) {
	start := time.Now()
	const k = 120
	f := newE2EFixture(t, k, func(c *Config) { c.MaxRequestBodyBytes = 64 << 10 })
	t.Logf("fixture ready in %v", time.Since(start))
	sel := f.inst.Addrs().Selection
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	t.Run("ten chat requests all go to the worker holding the longest prefix and leave no load", func(t *testing.T) {
		began := time.Now()
		for i := 0; i < 10; i++ {
			ex, err := f.client.Do(ctx, extproctest.Request{
				Path:     f.golden.Path,
				Body:     f.golden.Body,
				Response: &extproctest.Response{Status: 200, ContentType: "text/event-stream", Chunks: sseChunks()},
			})
			if err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
			if ex.Immediate != nil {
				t.Fatalf("request %d: ImmediateResponse %d %s", i, ex.Immediate.Status, ex.Immediate.Body)
			}
			if ex.Destination != "127.0.0.1:18002" || ex.MetadataDestination != ex.Destination {
				t.Fatalf("request %d: destination %q (metadata %q), want 127.0.0.1:18002", i, ex.Destination, ex.MetadataDestination)
			}
			if got := ex.SetHeaders["x-dynamo-worker-instance-id"]; got != "2" {
				t.Fatalf("request %d: x-dynamo-worker-instance-id %q, want 2", i, got)
			}
			if !bytes.Equal(ex.Body, f.golden.Body) {
				t.Fatalf("request %d: forwarded body differs from the original", i)
			}
			if want := bytes.Join(sseChunks(), nil); !bytes.Equal(ex.ResponseEcho, want) {
				t.Fatalf("request %d: response echo %q", i, ex.ResponseEcho)
			}
			waitNoLoad(t, sel)
		}
		t.Logf("10 routed requests in %v", time.Since(began))
	})

	t.Run("clients that cancel mid-response leak no booking", func(t *testing.T) {
		cases := []extproctest.Response{
			{Status: 200, ContentType: "text/event-stream", Chunks: sseChunks(), CancelAfterChunks: 1},
			{Status: 200, ContentType: "text/event-stream", Chunks: sseChunks(), CancelAfterHeaders: true},
		}
		for i := 0; i < 10; i++ {
			resp := cases[i%len(cases)]
			ex, err := f.client.Do(ctx, extproctest.Request{Path: f.golden.Path, Body: f.golden.Body, Response: &resp})
			if err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
			if !ex.Cancelled || ex.Destination != "127.0.0.1:18002" {
				t.Fatalf("request %d: cancelled=%v destination=%q", i, ex.Cancelled, ex.Destination)
			}
			waitNoLoad(t, sel)
		}
		// The downstream leaves before any response at all.
		ex, err := f.client.Do(ctx, extproctest.Request{Path: f.golden.Path, Body: f.golden.Body})
		if err != nil || !ex.Cancelled {
			t.Fatalf("cancel before response: err=%v cancelled=%v", err, ex.Cancelled)
		}
		waitNoLoad(t, sel)
	})

	t.Run("concurrent requests that complete or cancel leave no load", func(t *testing.T) {
		var wg sync.WaitGroup
		errs := make(chan error, 20)
		for i := 0; i < 20; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				resp := &extproctest.Response{Status: 200, ContentType: "text/event-stream", Chunks: sseChunks()}
				if i%2 == 1 {
					resp.CancelAfterChunks = 1
				}
				ex, err := f.client.Do(ctx, extproctest.Request{Path: f.golden.Path, Body: f.golden.Body, Response: resp})
				if err != nil {
					errs <- err
					return
				}
				if ex.Immediate != nil {
					errs <- fmt.Errorf("request %d: ImmediateResponse %d %s", i, ex.Immediate.Status, ex.Immediate.Body)
				}
			}(i)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		waitNoLoad(t, sel)
	})

	rejections := []struct {
		name       string
		body       []byte
		wantStatus int
		wantType   string
		wantText   string
	}{
		{"a malformed JSON body gets 400", []byte(`{"model": "Qwen/Qwen3-0.6B", "messages": [`), 400, "invalid_request_error", ""},
		{"an unknown model gets 404", []byte(`{"model":"no-such-model","messages":[{"role":"user","content":"hi"}]}`), 404, "", `model \"no-such-model\" is not served`},
		{"empty messages get 400", []byte(`{"model":"Qwen/Qwen3-0.6B","messages":[]}`), 400, "invalid_request_error", "messages"},
		{"a body over DYN_EPP_MAX_REQUEST_BODY_BYTES gets 413", append(append([]byte(`{"model":"Qwen/Qwen3-0.6B","messages":[{"role":"user","content":"`), bytes.Repeat([]byte("a"), 70<<10)...), []byte(`"}]}`)...), 413, "request_too_large", ""},
	}
	for _, tc := range rejections {
		t.Run(tc.name+" and leaves no booking", func(t *testing.T) {
			ex, err := f.client.Do(ctx, extproctest.Request{Path: "/v1/chat/completions", Body: tc.body,
				Response: &extproctest.Response{Status: 200}})
			if err != nil {
				t.Fatal(err)
			}
			if ex.Immediate == nil {
				t.Fatalf("routed to %q, want ImmediateResponse %d", ex.Destination, tc.wantStatus)
			}
			if ex.Immediate.Status != tc.wantStatus {
				t.Fatalf("status %d, want %d; body %s", ex.Immediate.Status, tc.wantStatus, ex.Immediate.Body)
			}
			var body struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal(ex.Immediate.Body, &body); err != nil {
				t.Fatalf("body %q: %v", ex.Immediate.Body, err)
			}
			if body.Error.Code != tc.wantStatus || (tc.wantType != "" && body.Error.Type != tc.wantType) {
				t.Fatalf("error body %s", ex.Immediate.Body)
			}
			if tc.wantText != "" && !strings.Contains(string(ex.Immediate.Body), tc.wantText) {
				t.Fatalf("error body %s lacks %q", ex.Immediate.Body, tc.wantText)
			}
			waitNoLoad(t, sel)
		})
	}

	t.Run("the metrics port exports kv events, ready workers and request outcomes", func(t *testing.T) {
		text := scrape(t, f.inst.Addrs().Metrics)
		for _, want := range []string{
			`kvepp_kv_events_total{result="applied"} 2`,
			`kvepp_kv_events_total{result="rejected"} 0`,
			`kvepp_ready_workers 3`,
			`kvepp_requests_total{outcome="success"}`,
			`kvepp_requests_total{outcome="cancelled"}`,
			`kvepp_immediate_responses_total{status="413"} 1`,
			`kvepp_active_reservations 0`,
			`kvepp_selection_active_requests 0`,
		} {
			if !strings.Contains(text, want) {
				t.Errorf("metrics lack %q", want)
			}
		}
	})
	t.Logf("end-to-end test took %v", time.Since(start))
}

func TestReadinessAndGracefulShutdown(t *testing.T) {
	const drain = 2 * time.Second
	f := newE2EFixture(t, 8, func(c *Config) { c.DrainTimeout = Seconds(drain) })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	check := healthChecker(ctx, t, f.inst.Addrs().Health)
	for _, svc := range []string{"", "readiness", "liveness", "envoy.service.ext_proc.v3.ExternalProcessor", "inference-extension"} {
		if st := check(svc); st != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("%q is %v after start, want SERVING", svc, st)
		}
	}
	extHealth := healthpb.NewHealthClient(dialPlain(t, f.inst.Addrs().GRPC))
	if r, err := extHealth.Check(ctx, &healthpb.HealthCheckRequest{Service: "envoy.service.ext_proc.v3.ExternalProcessor"}); err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health on the ext_proc port: %v %v", r, err)
	}

	// Open a stream that is mid-response (booked) when shutdown begins.
	ps, err := f.client.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sendAll(t, ps,
		extproctest.RequestHeaders(false, extproctest.Header{Key: ":method", Value: "POST"}, extproctest.Header{Key: ":path", Value: "/v1/chat/completions"}, extproctest.Header{Key: "content-type", Value: "application/json"}),
		extproctest.RequestBody(f.golden.Body, true),
	)
	// header reply + one re-streamed body chunk (the golden body is below 62,000 bytes)
	for i := 0; i < 2; i++ {
		if _, err := ps.Recv(); err != nil {
			t.Fatalf("routing reply %d: %v", i, err)
		}
	}
	sendAll(t, ps, extproctest.ResponseHeaders(false, extproctest.Header{Key: ":status", Value: "200"}))
	if _, err := ps.Recv(); err != nil {
		t.Fatal(err)
	}
	if sum, body := activeLoad(t, f.inst.Addrs().Selection); sum == 0 {
		t.Fatalf("no load while a stream is open: %s", body)
	}

	stopped := make(chan error, 1)
	stopStart := time.Now()
	go func() { stopped <- f.inst.Stop(context.Background()) }()
	deadline := time.Now().Add(drain / 2)
	for check("readiness") != healthpb.HealthCheckResponse_NOT_SERVING {
		if time.Now().After(deadline) {
			t.Fatal("readiness still SERVING during the drain window")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if st := check("liveness"); st != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("liveness %v during drain, want SERVING", st)
	}
	// New streams are still served during the drain window (the open stream's booking may send
	// this one to another worker).
	ex, err := f.client.Do(ctx, extproctest.Request{Path: f.golden.Path, Body: f.golden.Body,
		Response: &extproctest.Response{Status: 200, Chunks: sseChunks()}})
	if err != nil || ex.Immediate != nil || !strings.HasPrefix(ex.Destination, "127.0.0.1:1800") {
		t.Fatalf("request during drain: err=%v destination=%q immediate=%+v", err, ex.Destination, ex.Immediate)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if took := time.Since(stopStart); took < drain {
		t.Fatalf("Stop returned after %v, before the %v drain window ended", took, drain)
	} else {
		t.Logf("Stop took %v (drain %v)", took, drain)
	}
	if _, err := ps.Recv(); err == nil {
		t.Fatal("the open stream survived shutdown")
	}
	for _, l := range f.inst.Service.Loads("", "") {
		for _, w := range l.Loads {
			if w.ActiveRequests != 0 || w.PotentialPrefillTokens != 0 || w.PotentialDecodeBlocks != 0 {
				t.Fatalf("booking leaked by shutdown: %+v", w)
			}
		}
	}
	if _, err := http.Get("http://" + f.inst.Addrs().Selection + "/health"); err == nil {
		t.Fatal("side port still open after Stop")
	}
}

// healthChecker returns a function that asks the gRPC health service at addr for a service's
// status, failing t on errors.
func healthChecker(ctx context.Context, t testing.TB, addr string) func(service string) healthpb.HealthCheckResponse_ServingStatus {
	health := healthpb.NewHealthClient(dialPlain(t, addr))
	return func(service string) healthpb.HealthCheckResponse_ServingStatus {
		t.Helper()
		r, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		if err != nil {
			t.Fatalf("Check(%q): %v", service, err)
		}
		return r.Status
	}
}

// sendAll sends messages on a raw Process stream.
func sendAll(t testing.TB, ps extprocv3.ExternalProcessor_ProcessClient, msgs ...*extprocv3.ProcessingRequest) {
	t.Helper()
	for _, m := range msgs {
		if err := ps.Send(m); err != nil {
			t.Fatal(err)
		}
	}
}

// BenchmarkRoutedChatRequest measures one golden chat-long request (3,011 tokens) through the
// real runner over loopback gRPC: emulator → ext_proc → tokenizer → selection and booking →
// routing reply → streamed response → free.
func BenchmarkRoutedChatRequest(b *testing.B) {
	golden := sharedtest.RequestVectorNamed(b, "chat-long")
	cfg := loopbackConfig(b)
	cfg.UseKVEvents = false
	inst := startInstance(b, cfg)
	ctx := context.Background()
	for id := uint64(1); id <= 3; id++ {
		bs := uint32(16)
		rec := picker.WorkerRecord{WorkerID: id, ModelName: e2eModel, Endpoint: fmt.Sprintf("http://127.0.0.1:%d", 18000+id), BlockSize: &bs}
		if _, err := inst.Service.UpsertWorker(ctx, rec, picker.SourceAPI); err != nil {
			b.Fatal(err)
		}
	}
	client := extproctest.NewClient(dialPlain(b, inst.Addrs().GRPC))
	req := extproctest.Request{Path: golden.Path, Body: golden.Body,
		Response: &extproctest.Response{Status: 200, ContentType: "text/event-stream", Chunks: sseChunks()}}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		ex, err := client.Do(ctx, req)
		if err != nil || ex.Immediate != nil {
			b.Fatalf("err=%v immediate=%+v", err, ex.Immediate)
		}
	}
}
