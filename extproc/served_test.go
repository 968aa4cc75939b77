package extproc_test

import (
	"context"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
)

// coreHarness is an ext_proc server over the real selection core (approximate mode) with
// workers 1 (10.0.0.1:8000) and 2 (10.0.0.2:8000) of model "m".
type coreHarness struct {
	svc    *picker.Service
	srv    *extproc.Server
	client *extproctest.Client
}

func newCoreHarness(t *testing.T, mutate func(*extproc.Config), records ...picker.WorkerRecord) *coreHarness {
	t.Helper()
	pc := pickertest.Config(3, 9)
	pc.Router.OverlapScoreCredit = 0 // ranks tie on cost, so picks spread over them
	svc, err := picker.New(pc)
	if err != nil {
		t.Fatal(err)
	}
	bs := uint32(4)
	if len(records) == 0 {
		records = []picker.WorkerRecord{
			{WorkerID: 1, ModelName: "m", Endpoint: "http://10.0.0.1:8000", BlockSize: &bs},
			{WorkerID: 2, ModelName: "m", Endpoint: "http://10.0.0.2:8000", BlockSize: &bs},
		}
	}
	for _, r := range records {
		if _, err := svc.UpsertWorker(context.Background(), r, picker.SourceAPI); err != nil {
			t.Fatal(err)
		}
	}
	cfg := extproc.Config{Picker: svc, Tokenizers: &fakeTokenizers{}}
	if mutate != nil {
		mutate(&cfg)
	}
	srv, err := extproc.NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	conn := extproctest.Serve(t, srv.Register, srv.GRPCServerOptions()...)
	return &coreHarness{svc: svc, srv: srv, client: extproctest.NewClient(conn)}
}

// rankLoads maps worker/rank → (active requests, potential prefill tokens).
func (h *coreHarness) rankLoads() map[picker.WorkerRank][2]uint64 {
	out := map[picker.WorkerRank][2]uint64{}
	for _, pl := range h.svc.Loads("", "") {
		for _, l := range pl.Loads {
			out[picker.WorkerRank{WorkerID: l.WorkerID, DPRank: l.DPRank}] = [2]uint64{l.ActiveRequests, l.PotentialPrefillTokens}
		}
	}
	return out
}

func (h *coreHarness) waitIdle(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		busy := false
		for wr, l := range h.rankLoads() {
			if l[0] != 0 || l[1] != 0 {
				busy = wr.WorkerID != 0
			}
		}
		if !busy {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("bookings leaked: %v", h.rankLoads())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// servedMetadata is response-phase envoy.lb metadata naming the served endpoint.
func servedMetadata(served string) *corev3.Metadata {
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		extproc.LBMetadataNamespace: {Fields: map[string]*structpb.Value{extproc.ServedEndpointKey: structpb.NewStringValue(served)}},
	}}
}

// openRouted opens a stream, sends a chat request and reads the routing reply and re-streamed
// body; it returns the stream and the primary destination.
func (h *coreHarness) openRouted(t *testing.T, ctx context.Context, extra ...extproctest.Header) (extprocv3.ExternalProcessor_ProcessClient, string) {
	t.Helper()
	ps, err := h.client.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	hdrs := append([]extproctest.Header{{Key: ":method", Value: "POST"}, {Key: ":path", Value: "/v1/chat/completions"},
		{Key: "content-type", Value: "application/json"}}, extra...)
	sendAll(t, ps, extproctest.RequestHeaders(false, hdrs...), extproctest.RequestBody(chatBody(400), true))
	first, err := ps.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if im := first.GetImmediateResponse(); im != nil {
		t.Fatalf("immediate response %v", im)
	}
	var dest string
	for _, hv := range first.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if hv.GetHeader().GetKey() == extproc.DestinationHeader {
			dest = string(hv.GetHeader().GetRawValue())
		}
	}
	if _, err := ps.Recv(); err != nil { // the re-streamed body
		t.Fatal(err)
	}
	return ps, dest
}

func sendAll(t *testing.T, ps extprocv3.ExternalProcessor_ProcessClient, msgs ...*extprocv3.ProcessingRequest) {
	t.Helper()
	for _, m := range msgs {
		if err := ps.Send(m); err != nil {
			t.Fatal(err)
		}
	}
}

func recvN(t *testing.T, ps extprocv3.ExternalProcessor_ProcessClient, n int) []*extprocv3.ProcessingResponse {
	t.Helper()
	var out []*extprocv3.ProcessingResponse
	for i := 0; i < n; i++ {
		m, err := ps.Recv()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

func otherOf(dest string) (string, picker.WorkerRank) {
	if dest == "10.0.0.1:8000" {
		return "10.0.0.2:8000", picker.WorkerRank{WorkerID: 2}
	}
	return "10.0.0.1:8000", picker.WorkerRank{WorkerID: 1}
}

func primaryOf(dest string) picker.WorkerRank {
	if dest == "10.0.0.1:8000" {
		return picker.WorkerRank{WorkerID: 1}
	}
	return picker.WorkerRank{WorkerID: 2}
}

func TestServedEndpointMovesTheBooking(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	t.Run("the booking moves to the served worker exactly once and is freed at the end", func(t *testing.T) {
		h := newCoreHarness(t, nil)
		ps, dest := h.openRouted(t, ctx)
		served, to := otherOf(dest)
		from := primaryOf(dest)
		before := h.rankLoads()[from]
		if before[0] != 1 || before[1] == 0 {
			t.Fatalf("primary load before the response %v", before)
		}
		rh := extproctest.ResponseHeaders(false, extproctest.Header{Key: ":status", Value: "200"})
		rh.MetadataContext = servedMetadata(served)
		sendAll(t, ps, rh)
		recvN(t, ps, 1)
		loads := h.rankLoads()
		if loads[from] != [2]uint64{0, 0} || loads[to][0] != 1 || loads[to][1] == 0 {
			t.Fatalf("after the served endpoint %s: loads %v, want the booking (with prefill) on %v only", served, loads, to)
		}
		// The served metadata repeated on the body does not move it again.
		b := extproctest.ResponseBody([]byte("data: {}\n\n"), false)
		b.MetadataContext = servedMetadata(served)
		sendAll(t, ps, b)
		recvN(t, ps, 1)
		if l := h.rankLoads()[to]; l[0] != 1 || l[1] != 0 {
			t.Fatalf("after the first chunk: %v, want one request, prefill complete", l)
		}
		sendAll(t, ps, extproctest.ResponseBody(nil, true))
		recvN(t, ps, 1)
		_ = ps.CloseSend()
		h.waitIdle(t)
		if s := h.srv.Metrics().Snapshot(); s.ServedEndpointMoves != 1 || s.ServedEndpointMismatch != 1 || s.ActiveReservations != 0 {
			t.Fatalf("metrics %+v", s)
		}
	})
	t.Run("a move after the first chunk keeps prefill complete, and a cancel frees the moved booking", func(t *testing.T) {
		h := newCoreHarness(t, nil)
		sctx, scancel := context.WithCancel(ctx)
		ps, dest := h.openRouted(t, sctx)
		served, to := otherOf(dest)
		sendAll(t, ps, extproctest.ResponseHeaders(false, extproctest.Header{Key: ":status", Value: "200"}))
		recvN(t, ps, 1)
		b := extproctest.ResponseBody([]byte("data: {}\n\n"), false)
		sendAll(t, ps, b)
		recvN(t, ps, 1)
		b2 := extproctest.ResponseBody([]byte("data: {}\n\n"), false)
		b2.MetadataContext = servedMetadata(served)
		sendAll(t, ps, b2)
		recvN(t, ps, 1)
		if l := h.rankLoads()[to]; l != [2]uint64{1, 0} {
			t.Fatalf("moved booking %v, want one request without prefill", l)
		}
		scancel()
		h.waitIdle(t)
		if s := h.srv.Metrics().Snapshot(); s.ServedEndpointMoves != 1 || s.ActiveReservations != 0 {
			t.Fatalf("metrics %+v", s)
		}
	})
	t.Run("an unknown served endpoint keeps the booking on the primary", func(t *testing.T) {
		h := newCoreHarness(t, nil)
		ps, dest := h.openRouted(t, ctx)
		rh := extproctest.ResponseHeaders(false, extproctest.Header{Key: ":status", Value: "200"})
		rh.MetadataContext = servedMetadata("10.9.9.9:8000")
		sendAll(t, ps, rh)
		recvN(t, ps, 1)
		if l := h.rankLoads()[primaryOf(dest)]; l[0] != 1 {
			t.Fatalf("primary load %v after an unknown served endpoint", l)
		}
		sendAll(t, ps, extproctest.ResponseBody(nil, true))
		recvN(t, ps, 1)
		_ = ps.CloseSend()
		h.waitIdle(t)
		if s := h.srv.Metrics().Snapshot(); s.ServedEndpointMoves != 0 || s.ServedEndpointMismatch != 1 {
			t.Fatalf("metrics %+v", s)
		}
	})
	t.Run("ranks on their own ports: destinations and served endpoints use the rank addresses", func(t *testing.T) {
		bs, size := uint32(4), uint32(2)
		h := newCoreHarness(t, nil, picker.WorkerRecord{WorkerID: 5, ModelName: "m", Endpoint: "http://10.0.0.5:8000",
			BlockSize: &bs, DataParallelSize: &size, RankEndpoints: []string{"http://10.0.0.5:8000", "http://10.0.0.5:8001"}})
		seen := map[string]bool{}
		for i := 0; i < 40 && len(seen) < 2; i++ {
			ex, err := h.client.Do(ctx, extproctest.Request{Body: chatBody(200), Response: okResponse()})
			if err != nil || ex.Immediate != nil {
				t.Fatalf("%v %+v", err, ex.Immediate)
			}
			seen[ex.Destination] = true
		}
		if !seen["10.0.0.5:8000"] || !seen["10.0.0.5:8001"] {
			t.Fatalf("destinations %v, want both rank ports", seen)
		}
		ps, dest := h.openRouted(t, ctx)
		other := map[string]string{"10.0.0.5:8000": "10.0.0.5:8001", "10.0.0.5:8001": "10.0.0.5:8000"}[dest]
		rh := extproctest.ResponseHeaders(false, extproctest.Header{Key: ":status", Value: "200"})
		rh.MetadataContext = servedMetadata(other)
		sendAll(t, ps, rh)
		recvN(t, ps, 1)
		toRank := uint32(1)
		if other == "10.0.0.5:8000" {
			toRank = 0
		}
		if l := h.rankLoads()[picker.WorkerRank{WorkerID: 5, DPRank: toRank}]; l[0] != 1 {
			t.Fatalf("served rank %d load %v (loads %v)", toRank, l, h.rankLoads())
		}
		sendAll(t, ps, extproctest.ResponseBody(nil, true))
		recvN(t, ps, 1)
		_ = ps.CloseSend()
		h.waitIdle(t)
	})
}

// chatRequest is a small valid chat body for model "m".
var chatRequest = []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)

func TestConformanceHooks(t *testing.T) {
	chat := chatRequest
	hooks := func(c *extproc.Config) { c.ConformanceTestHooks = true; c.PoolName = "default/vllm" }
	sel := func(v string) []extproctest.Header {
		return []extproctest.Header{{Key: extproc.TestEndpointSelectionHeader, Value: v}}
	}
	t.Run("the test-epp-endpoint-selection header steers the pick", func(t *testing.T) {
		h := newHarness(t, hooks)
		for _, tc := range []struct{ header, want string }{
			{"10.0.0.2", "10.0.0.2:8000"},
			{" 10.0.0.9:8000 , 10.0.0.2:9999 ", "10.0.0.2:8000"}, // unknown IPs ignored, ports ignored
			{"fd00::3", "[fd00::3]:8000"},
		} {
			ex := h.do(t, extproctest.Request{Body: chat, Headers: sel(tc.header), Response: okResponse()})
			if ex.Immediate != nil || ex.Destination != tc.want {
				t.Errorf("header %q: destination %q immediate %+v, want %s", tc.header, ex.Destination, ex.Immediate, tc.want)
			}
		}
		ex := h.do(t, extproctest.Request{Body: chat, Headers: sel("10.9.9.9"), Response: okResponse()})
		checkImmediate(t, ex, 503, "service_unavailable", "test-epp-endpoint-selection")
		// Intersected with the gateway's subset hint.
		ex = h.do(t, extproctest.Request{Body: chat, Headers: sel("10.0.0.1,10.0.0.2"), SubsetHint: []string{"10.0.0.2:8000"}, Response: okResponse()})
		if ex.Destination != "10.0.0.2:8000" {
			t.Errorf("header ∩ subset hint: destination %q", ex.Destination)
		}
		ex = h.do(t, extproctest.Request{Body: chat, Headers: sel("10.0.0.1"), SubsetHint: []string{"10.0.0.2:8000"}, Response: okResponse()})
		checkImmediate(t, ex, 503, "service_unavailable", "")
		// Load-only picks honour it too.
		ex = h.do(t, extproctest.Request{Method: "GET", Path: "/v1/models", HeaderOnly: true, Headers: sel("10.0.0.2"), Response: okResponse()})
		if ex.Destination != "10.0.0.2:8000" {
			t.Errorf("load-only destination %q", ex.Destination)
		}
	})
	t.Run("responses report the served endpoint, the selected endpoint and the pool", func(t *testing.T) {
		h := newHarness(t, hooks)
		for _, tc := range []struct {
			name string
			resp func(*extproctest.Response)
			want string
		}{
			{"served metadata", func(r *extproctest.Response) { r.ServedEndpoint = "10.0.0.1:8000" }, "10.0.0.1:8000"},
			{"no envoy.lb metadata", func(*extproctest.Response) {}, "fail: missing envoy lb metadata"},
			{"envoy.lb without the served key", func(r *extproctest.Response) { r.LBMetadataWithoutServed = true }, "fail: missing destination endpoint served metadata"},
		} {
			resp := okResponse()
			tc.resp(resp)
			ex := h.do(t, extproctest.Request{Body: chat, Response: resp})
			got := ex.ResponseSetHeaders
			if got[extproc.ConformanceServedHeader] != tc.want || got[extproc.ConformanceSelectedHeader] != ex.Destination ||
				got[extproc.ConformancePoolHeader] != "default/vllm" {
				t.Errorf("%s: response headers %v (destination %q)", tc.name, got, ex.Destination)
			}
		}
	})
	t.Run("without the flag the header is ignored and responses are untouched", func(t *testing.T) {
		h := newHarness(t, nil)
		ex := h.do(t, extproctest.Request{Body: chat, Headers: sel("10.0.0.2"), Response: func() *extproctest.Response {
			r := okResponse()
			r.ServedEndpoint = "10.0.0.1:8000"
			return r
		}()})
		if ex.Destination != "10.0.0.1:8000" || len(ex.ResponseSetHeaders) != 0 {
			t.Fatalf("destination %q, response headers %v", ex.Destination, ex.ResponseSetHeaders)
		}
	})
}

// gather returns the registry's metric families by name.
func gather(t *testing.T, c prometheus.Collector) map[string]*dto.MetricFamily {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

// metricValue returns the value (counter, gauge) or sample count (histogram) of the series of
// family name whose labels include want.
func metricValue(mfs map[string]*dto.MetricFamily, name string, want map[string]string) (float64, bool) {
	mf := mfs[name]
	if mf == nil {
		return 0, false
	}
	for _, m := range mf.GetMetric() {
		match := true
		for k, v := range want {
			found := false
			for _, lp := range m.GetLabel() {
				if lp.GetName() == k && lp.GetValue() == v {
					found = true
				}
			}
			match = match && found
		}
		if !match {
			continue
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), true
		}
	}
	return 0, false
}

func TestInferenceExtensionMetricsAfterTraffic(t *testing.T) {
	chat := chatRequest
	h := newHarness(t, nil)
	for i := 0; i < 3; i++ {
		h.do(t, extproctest.Request{Body: chat, Response: okResponse()})
	}
	h.do(t, extproctest.Request{Body: chat, Response: &extproctest.Response{Status: 500, Chunks: [][]byte{[]byte(`{"error":"boom"}`)}}})
	checkImmediate(t, h.do(t, extproctest.Request{Body: []byte(`{"model":"m"}`)}), 400, "invalid_request_error", "")
	h.pk.waitSettled(t)
	mfs := gather(t, h.srv.Metrics())
	m := map[string]string{"model_name": "m", "target_model_name": "m"}
	for _, tc := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"inference_objective_request_total", m, 4},
		{"inference_objective_request_duration_seconds", m, 4},
		{"inference_objective_request_sizes", m, 4},
		{"inference_objective_response_sizes", m, 4},
		{"inference_objective_input_tokens", m, 3},
		{"inference_objective_output_tokens", m, 3},
		{"inference_objective_normalized_time_per_output_token_seconds", m, 3},
		{"inference_objective_running_requests", map[string]string{"model_name": "m"}, 0},
		{"inference_objective_request_error_total", map[string]string{"model_name": "m", "error_code": "ModelServerError"}, 1},
		{"inference_objective_request_error_total", map[string]string{"model_name": "m", "error_code": "BadRequest"}, 1},
		{"inference_extension_scheduler_e2e_duration_seconds", nil, 4},
		{"inference_extension_scheduler_attempts_total", map[string]string{"status": "success"}, 4},
		{"kvepp_requests_total", map[string]string{"outcome": "success"}, 3},
	} {
		got, ok := metricValue(mfs, tc.name, tc.labels)
		if !ok || got != tc.want {
			t.Errorf("%s%v = %v (present %t), want %v", tc.name, tc.labels, got, ok, tc.want)
		}
	}
	// The GIE histograms keep the Inference Extension's buckets, so its dashboard quantiles agree.
	if b := mfs["inference_objective_request_duration_seconds"].GetMetric()[0].GetHistogram().GetBucket(); len(b) != 35 || b[0].GetUpperBound() != 0.005 || b[34].GetUpperBound() != 3600 {
		t.Errorf("request duration buckets %d, first %v", len(b), b[0].GetUpperBound())
	}
	if b := mfs["inference_extension_scheduler_e2e_duration_seconds"].GetMetric()[0].GetHistogram().GetBucket(); len(b) != 10 || b[0].GetUpperBound() != 0.0001 {
		t.Errorf("scheduler buckets %v", b)
	}
	if b := mfs["inference_objective_request_sizes"].GetMetric()[0].GetHistogram().GetBucket(); len(b) != 25 || b[24].GetUpperBound() != 1<<30 {
		t.Errorf("request size buckets %d", len(b))
	}
	var names []string
	for n := range mfs {
		if strings.HasPrefix(n, "inference_") {
			names = append(names, n)
		}
	}
	t.Logf("GIE metric families: %v", names)
}
