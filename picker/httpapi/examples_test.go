package httpapi_test

import (
	"math"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/policies/defaultcost"
)

// Every example request of standalone-selection-service.txt and selection-service.md, checked
// for status and response shape.

func TestReferenceWorkerRegistrationExamples(t *testing.T) {
	e := newEnv(t, kvEvents)
	t.Run("POST /workers with two DP ranks and their event endpoints", func(t *testing.T) {
		v := e.ok(201, "POST", "/workers", `{
  "worker_id": 1,
  "model_name": "model",
  "routing_group": "default",
  "endpoint": "http://worker:8000",
  "block_size": 16,
  "data_parallel_start_rank": 0,
  "data_parallel_size": 2,
  "kv_events_endpoints": {
    "0": "tcp://worker:5557",
    "1": "tcp://worker:5558"
  }
}`)
		want := map[string]any{"worker_id": 1.0, "model_name": "model", "routing_group": "default", "endpoint": "http://worker:8000",
			"block_size": 16.0, "data_parallel_start_rank": 0.0, "data_parallel_size": 2.0,
			"kv_events_endpoints": map[string]any{"0": "tcp://worker:5557", "1": "tcp://worker:5558"}, "lifecycle": "schedulable", "candidate": true}
		if diff := cmp.Diff(want, v); diff != "" {
			t.Fatalf("record (-want +got):\n%s", diff)
		}
		if !e.attached(1) {
			t.Fatal("no listeners attached")
		}
	})
	t.Run("a hint-capable worker record", func(t *testing.T) {
		v := obj(t, e.ok(201, "POST", "/workers", `{
  "worker_id": 1,
  "router_hint_worker_type": "decode",
  "router_hint_source_control_endpoints": { "0": "tcp://worker:5600", "1": "tcp://worker:5601" }
}`))
		if v["lifecycle"] != "incomplete" || v["model_name"] != "default" || v["router_hint_worker_type"] != "decode" ||
			!cmp.Equal(v["not_schedulable_reasons"], []any{"endpoint is required", "block_size must be greater than 0", "kv_events endpoint is required for dp_rank 0"}) {
			t.Fatalf("record %v", v)
		}
	})
	t.Run("a state-agent worker record", func(t *testing.T) {
		v := obj(t, e.ok(201, "POST", "/workers", `{"worker_id":2,"model_name":"model","endpoint":"http://w2","block_size":16,"kv_events_endpoint":"tcp://w2:5557","kv_event_source_mode":"state_agent_v2"}`))
		if v["lifecycle"] != "schedulable" || v["kv_event_source_mode"] != "state_agent_v2" {
			t.Fatalf("record %v", v)
		}
	})
	t.Run("PATCH, GET with filters, DELETE", func(t *testing.T) {
		if v := obj(t, e.ok(200, "PATCH", "/workers/2", `{"total_kv_blocks":4096}`)); v["total_kv_blocks"] != 4096.0 {
			t.Fatalf("PATCH %v", v)
		}
		if ws := e.ok(200, "GET", "/workers?model_name=model&routing_group=default", "").([]any); len(ws) != 1 {
			t.Fatalf("GET /workers filtered = %v", ws)
		}
		if v := obj(t, e.ok(200, "DELETE", "/workers/2", "")); v["lifecycle"] != "unschedulable" {
			t.Fatalf("DELETE %v", v)
		}
		e.fails(400, "invalid worker_id", "DELETE", "/workers/two", "")
		e.fails(404, "worker 2 not found", "PATCH", "/workers/2", `{}`)
	})
	t.Run("health and ready", func(t *testing.T) {
		if v := e.ok(200, "GET", "/health", ""); !cmp.Equal(v, map[string]any{"status": "ok"}) {
			t.Fatalf("/health %v", v)
		}
		st, v := e.do("GET", "/ready", "")
		if st != 503 || !cmp.Equal(keys(obj(t, v)), set("ready", "schedulable_workers", "workers")) {
			t.Fatalf("/ready = %d %v", st, v)
		}
	})
}

// referenceFixture reproduces the state behind the reference select_and_reserve response: one
// worker, block size 16, ranks 0-1; rank 0 holds device 4 / host ext 2 / disk ext 2 of the
// request's blocks 11..18 and 180 active blocks, rank 1 holds device 2 and 200 active blocks;
// host and disk weights 1.0; decode-busy threshold 0.9 of 4096 blocks.
func referenceFixture(t *testing.T) *env {
	th := 0.9
	e := newEnv(t, kvEvents, func(c *picker.Config) {
		c.Router.HostCacheHitWeight, c.Router.DiskCacheHitWeight = 1, 1
		c.Router.ConditionalDisaggDecodeBusyThreshold = &th
	})
	e.ok(201, "POST", "/workers", `{"worker_id":1,"model_name":"model","endpoint":"http://worker:8000","block_size":16,
		"data_parallel_size":2,"total_kv_blocks":4096,"kv_events_endpoints":{"0":"tcp://worker:5557","1":"tcp://worker:5558"}}`)
	e.ev.Store(t, 1, 0, kvindex.TierDevice, nil, 11, 12, 13, 14)
	p := uint64(15)
	e.ev.Store(t, 1, 0, kvindex.TierHostPinned, &p, 15, 16)
	p = 17
	e.ev.Store(t, 1, 0, kvindex.TierDisk, &p, 17, 18)
	e.ev.Store(t, 1, 1, kvindex.TierDevice, nil, 11, 12)
	for rank, n := range map[int]int{0: 180, 1: 200} {
		hs := make([]string, n)
		for i := range hs {
			hs[i] = f("%d", 1000*(rank+1)+i)
		}
		id := f("bg%d", rank)
		e.ok(201, "POST", "/reservations", f(`{"selection_id":%q,"model_name":"model","worker_id":1,"dp_rank":%d,"sequence_hashes":[%s],"isl_tokens":%d,"track_prefill_tokens":false}`,
			id, rank, strings.Join(hs, ","), n*16))
	}
	return e
}

const referenceSelectBody = `{
  "selection_id": "select-123",
  "model_name": "model",
  "routing_group": "default",
  "block_hashes": [11, 12, 13, 14, 15, 16, 17, 18],
  "sequence_hashes": [21, 22, 23, 24, 25, 26, 27, 28],
  "isl_tokens": 512,
  "session_id": "session-abc"
}`

func TestReferenceSelectionExamples(t *testing.T) {
	overlap := map[string]any{"longest_matched": 128.0, "gpu": 64.0, "dp": map[string]any{"0": 64.0, "1": 32.0}, "cpu": 96.0, "disk": 128.0}
	t.Run("POST /select_and_reserve returns the documented response", func(t *testing.T) {
		e := referenceFixture(t)
		v := e.ok(200, "POST", "/select_and_reserve", referenceSelectBody)
		want := map[string]any{
			"selection_id":    "select-123",
			"sequence_hashes": []any{21.0, 22.0, 23.0, 24.0, 25.0, 26.0, 27.0, 28.0},
			"isl_tokens":      512.0, "track_prefill_tokens": true, "model_name": "model", "routing_group": "default",
			"worker_id": 1.0, "dp_rank": 0.0, "endpoint": "http://worker:8000", "block_size": 16.0,
			"overlap": overlap, "effective_prefill_tokens": 384.0, "potential_decode_blocks": 212.0, "decode_busy": false,
		}
		if diff := cmp.Diff(want, v); diff != "" {
			t.Fatalf("select_and_reserve (-want +got):\n%s", diff)
		}
	})
	t.Run("POST /select returns the same selection without booking fields", func(t *testing.T) {
		e := referenceFixture(t)
		v := e.ok(200, "POST", "/select", referenceSelectBody)
		want := map[string]any{
			"selection_id": "select-123", "model_name": "model", "routing_group": "default",
			"worker_id": 1.0, "dp_rank": 0.0, "endpoint": "http://worker:8000", "block_size": 16.0,
			"overlap": overlap, "effective_prefill_tokens": 384.0, "potential_decode_blocks": 212.0, "decode_busy": false,
		}
		if diff := cmp.Diff(want, v); diff != "" {
			t.Fatalf("select (-want +got):\n%s", diff)
		}
		t.Run("and the minimal reservation replays it", func(t *testing.T) {
			v := e.ok(201, "POST", "/reservations", `{
  "selection_id": "select-123",
  "model_name": "model",
  "routing_group": "default"
}`)
			want := map[string]any{"selection_id": "select-123", "model_name": "model", "routing_group": "default",
				"worker_id": 1.0, "dp_rank": 0.0, "endpoint": "http://worker:8000"}
			if diff := cmp.Diff(want, v); diff != "" {
				t.Fatalf("replay (-want +got):\n%s", diff)
			}
			l := e.load("model", "", 1, 0)
			if l["potential_prefill_tokens"] != 384.0 || l["active_requests"] != 2.0 || l["potential_decode_blocks"] != 188.0 {
				t.Fatalf("loads after replay %v", l)
			}
		})
	})
	t.Run("advisory select adds worker_load", func(t *testing.T) {
		half := 0.5
		e := newEnv(t, func(c *picker.Config) { c.Router.ConditionalDisaggPrefillBusyThreshold = &half })
		e.worker(1, `,"max_num_batched_tokens":8192,"total_kv_blocks":4096`)
		e.ok(201, "POST", "/reservations", `{"selection_id":"bg","model_name":"model","worker_id":1,"sequence_hashes":[],"isl_tokens":2048,"effective_prefill_tokens":2048}`)
		v := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model","advisory":true,`+prompt+`}`))
		want := map[string]any{"active_prefill_tokens": 2048.0, "prefill_token_capacity": 8192.0, "total_kv_blocks": 4096.0, "prefill_busy": false}
		if diff := cmp.Diff(want, v["worker_load"]); diff != "" {
			t.Fatalf("worker_load (-want +got):\n%s", diff)
		}
	})
	t.Run("the session_context example is accepted by both routes", func(t *testing.T) {
		e := newEnv(t)
		e.worker(1, `,"model_name":"default"`)
		body := `{
  "token_ids": [1, 2, 3, 4],
  "session_context": {
    "session_id": "child-session",
    "parent_session_id": "root-session",
    "session_final": false,
    "input_trigger": "tool_result",
    "agent_headers": {
      "x-claude-code-request-class": ["subagent"]
    }
  }
}`
		e.ok(200, "POST", "/select", body)
		e.ok(200, "POST", "/select_and_reserve", body)
	})
	t.Run("the kv_hint envelope", func(t *testing.T) {
		e := newEnv(t, kvEvents)
		e.worker(1, `,"kv_events_endpoint":"tcp://w1:1","router_hint_worker_type":"decode","router_hint_source_control_endpoints":{"0":"tcp://worker-1:5600"}`)
		e.worker(2, `,"kv_events_endpoint":"tcp://w2:1","router_hint_worker_type":"decode"`)
		h := local(8, 4)
		idx := e.ev.Index(1)
		if err := idx.Apply(kvindex.Event{WorkerID: 1, Kind: kvindex.EventStored, Blocks: []kvindex.StoredBlock{
			{BlockHash: 8713492873, TokensHash: h[0]}, {BlockHash: 1928374650, TokensHash: h[1]}}}); err != nil {
			t.Fatal(err)
		}
		v := obj(t, e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"select-123","model_name":"model",`+tokJSON(8)+`,"pinned_worker":{"worker_id":2,"dp_rank":0}}`))
		wantHint(t, v["kv_hint"], "select-123", "tcp://worker-1:5600", 8713492873, 1928374650)
	})
}

func TestReferenceReservationExamples(t *testing.T) {
	e := newEnv(t)
	e.ok(201, "POST", "/workers", `{"worker_id":1,"model_name":"model","endpoint":"http://worker:8000","block_size":16}`)
	v := e.ok(201, "POST", "/reservations", `{
  "selection_id": "request-123",
  "model_name": "model",
  "routing_group": "default",
  "worker_id": 1,
  "dp_rank": 0,
  "sequence_hashes": [21, 22, 23, 24, 25, 26, 27, 28],
  "isl_tokens": 512,
  "effective_prefill_tokens": 384,
  "track_prefill_tokens": true
}`)
	want := map[string]any{"selection_id": "request-123", "model_name": "model", "routing_group": "default",
		"worker_id": 1.0, "dp_rank": 0.0, "endpoint": "http://worker:8000"}
	if diff := cmp.Diff(want, v); diff != "" {
		t.Fatalf("explicit reservation (-want +got):\n%s", diff)
	}
	e.wantLoad(1, 0, 384, 8, 1)
	for _, step := range []struct{ method, path, body string }{
		{"POST", "/reservations/request-123/prefill_complete", ""},
		{"POST", "/reservations/request-123/output_block", `{"decay_fraction":0.5}`},
		{"DELETE", "/reservations/request-123", ""},
	} {
		if v := e.ok(200, step.method, step.path, step.body); !cmp.Equal(v, map[string]any{"status": "ok"}) {
			t.Fatalf("%s %s body %v", step.method, step.path, v)
		}
	}
	e.wantLoad(1, 0, 0, 0, 0)
	t.Run("track_prefill_tokens false books no prefill even with effective_prefill_tokens", func(t *testing.T) {
		e.ok(201, "POST", "/reservations", `{"selection_id":"nt","model_name":"model","worker_id":1,"sequence_hashes":[1],"isl_tokens":16,"effective_prefill_tokens":8,"track_prefill_tokens":false}`)
		e.wantLoad(1, 0, 0, 1, 1)
		e.ok(200, "DELETE", "/reservations/nt", "")
	})
	t.Run("without effective_prefill_tokens tracking books the full isl", func(t *testing.T) {
		e.ok(201, "POST", "/reservations", `{"selection_id":"full","model_name":"model","worker_id":1,"sequence_hashes":[1],"isl_tokens":20}`)
		e.wantLoad(1, 0, 20, 1, 1)
		e.ok(200, "DELETE", "/reservations/full", "")
	})
	t.Run("peer registration is refused without replica sync", func(t *testing.T) {
		e.fails(409, "replica sync is disabled", "POST", "/replica_sync/register_peer", `{"endpoint":"tcp://selector-b:9092"}`)
	})
}

func TestInspectionRoutes(t *testing.T) {
	e := newEnv(t, kvEvents)
	e.worker(1, `,"kv_events_endpoint":"tcp://w1:1"`)
	e.worker(2, `,"data_parallel_start_rank":4,"data_parallel_size":2,"kv_events_endpoints":{"4":"tcp://w2:1","5":"tcp://w2:2"}`)
	h := local(12, 4)
	e.ev.Store(t, 1, 0, kvindex.TierDevice, nil, h[:2]...)
	// A live booking on worker 1 holding the prompt's first block (tracked sequence hash).
	seq := kvindex.SequenceHashes(h)
	e.ok(201, "POST", "/reservations", f(`{"selection_id":"bg","model_name":"model","worker_id":1,"sequence_hashes":[%d],"isl_tokens":4,"effective_prefill_tokens":3}`, int64(seq[0])))
	t.Run("POST /potential_loads projects every schedulable rank", func(t *testing.T) {
		v := e.ok(200, "POST", "/potential_loads", `{"model_name":"model",`+tokJSON(14)+`}`)
		want := []any{
			map[string]any{"worker_id": 1.0, "dp_rank": 0.0, "potential_prefill_tokens": 3.0 + 14 - 8, "potential_decode_blocks": 1.0 + 2, "active_requests": 1.0},
			map[string]any{"worker_id": 2.0, "dp_rank": 4.0, "potential_prefill_tokens": 14.0, "potential_decode_blocks": 3.0, "active_requests": 0.0},
			map[string]any{"worker_id": 2.0, "dp_rank": 5.0, "potential_prefill_tokens": 14.0, "potential_decode_blocks": 3.0, "active_requests": 0.0},
		}
		if diff := cmp.Diff(want, v); diff != "" {
			t.Fatalf("/potential_loads (-want +got):\n%s", diff)
		}
		v = e.ok(200, "POST", "/potential_loads", `{"model_name":"model",`+tokJSON(14)+`,"router_config_override":{"track_prefill_tokens":false}}`)
		if got := obj(t, v.([]any)[1])["potential_prefill_tokens"]; got != 0.0 {
			t.Fatalf("prefill without tracking %v", got)
		}
		e.wantLoad(1, 0, 3, 1, 1) // books nothing
	})
	t.Run("the inspection routes validate like selection", func(t *testing.T) {
		for _, route := range []string{"/potential_loads", "/overlap_scores"} {
			e.fails(503, "no schedulable workers for nope:default", "POST", route, `{"model_name":"nope",`+prompt+`}`)
			e.fails(400, "token_ids must not be empty", "POST", route, `{"model_name":"model","token_ids":[]}`)
			e.fails(422, "router_config_override", "POST", route, `{"model_name":"model",`+prompt+`,"router_config_override":{"prefill_load_scale":-1}}`)
			e.fails(415, "Content-Type", "POST", route, "")
			e.fails(405, "method not allowed", "GET", route, "")
		}
	})
	t.Run("the §9.1 cached-token example", func(t *testing.T) {
		s := newEnv(t, kvEvents, func(c *picker.Config) { c.Router.HostCacheHitWeight, c.Router.DiskCacheHitWeight = 0.5, 0.25 })
		s.worker(1, `,"block_size":16,"kv_events_endpoint":"tcp://w1:1"`)
		hs := local(224, 16) // 14 blocks: device 2, host 3, disk 4, external 5
		s.ev.Store(t, 1, 0, kvindex.TierDevice, nil, hs[:2]...)
		for _, seg := range []struct {
			tier     kvindex.Tier
			from, to int
		}{{kvindex.TierHostPinned, 2, 5}, {kvindex.TierDisk, 5, 9}, {kvindex.TierExternal, 9, 14}} {
			p := hs[seg.from-1] + 1
			s.ev.Store(t, 1, 0, seg.tier, &p, hs[seg.from:seg.to]...)
		}
		v := obj(t, s.ok(200, "POST", "/select", `{"model_name":"model",`+tokJSON(224)+`}`))
		// weighted 2 + 0.5×3 + 0.25×(4+5) = 5.75 blocks → 92 tokens; 224 − 92 = 132.
		if v["effective_prefill_tokens"] != 132.0 {
			t.Fatalf("effective_prefill_tokens %v, want 132", v["effective_prefill_tokens"])
		}
		if diff := cmp.Diff(map[string]any{"longest_matched": 224.0, "gpu": 32.0, "dp": map[string]any{"0": 32.0}, "cpu": 80.0, "disk": 224.0}, v["overlap"]); diff != "" {
			t.Fatalf("overlap (-want +got):\n%s", diff)
		}
		row := obj(t, obj(t, s.ok(200, "POST", "/overlap_scores", `{"model_name":"model",`+tokJSON(224)+`}`))["workers"].([]any)[0])
		if row["host_pinned_blocks"] != 5.0 || row["disk_blocks"] != 14.0 || row["disk_extension_blocks"] != 9.0 || row["router_credit_blocks"] != 5.75 {
			t.Fatalf("overlap row %v", row)
		}
	})
	t.Run("GET /loads filters and sorts partitions", func(t *testing.T) {
		e.worker(3, `,"model_name":"a-model","kv_events_endpoint":"tcp://w3:1"`)
		v := e.ok(200, "GET", "/loads", "").([]any)
		if len(v) != 2 || obj(t, v[0])["model_name"] != "a-model" || !cmp.Equal(keys(obj(t, v[1])), set("model_name", "routing_group", "loads", "pending_count", "pending_isl_tokens")) {
			t.Fatalf("/loads %v", v)
		}
		if v := e.ok(200, "GET", "/loads?model_name=a-model", "").([]any); len(v) != 1 {
			t.Fatalf("filtered /loads %v", v)
		}
		if v := e.ok(200, "GET", "/loads?routing_group=none", "").([]any); len(v) != 0 {
			t.Fatalf("empty filter %v", v)
		}
	})
}

func TestSpecSelectionExamples(t *testing.T) {
	t.Run("§9.4 softmax probabilities of costs 10/20/30", func(t *testing.T) {
		for _, tc := range []struct {
			temp float64
			want []float64
		}{{1, []float64{0.5065, 0.3072, 0.1863}}, {0.5, []float64{0.6652, 0.2447, 0.0900}}} {
			got := defaultcost.SoftmaxProbabilities([]float64{10, 20, 30}, tc.temp, nil)
			for i := range got {
				if math.Abs(got[i]-tc.want[i]) > 5e-5 {
					t.Errorf("T=%v: probabilities %v, want %v", tc.temp, got, tc.want)
					break
				}
			}
		}
	})
	t.Run("§8 required taints filter and §9.3 preferred taints scale cost", func(t *testing.T) {
		e := newEnv(t)
		e.worker(1, `,"taints":["slow"]`)
		e.worker(2, `,"taints":["fast","gpu"]`)
		for i := 0; i < 20; i++ {
			v := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`,"routing_constraints":{"preferred_taints":{"fast":0.5}}}`))
			if v["worker_id"] != 2.0 {
				t.Fatalf("preferred taint ignored: %v", v)
			}
			v = obj(t, e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`,"routing_constraints":{"required_taints":["slow"]}}`))
			if v["worker_id"] != 1.0 {
				t.Fatalf("required taint ignored: %v", v)
			}
		}
		e.fails(503, "no endpoints available to route work", "POST", "/select", `{"model_name":"model",`+prompt+`,"routing_constraints":{"required_taints":["tpu"]}}`)
		e.fails(503, "no endpoints available to route work", "POST", "/select", `{"model_name":"model",`+prompt+`,"allowed_worker_ids":[]}`)
		e.fails(400, "pinned worker 2 is not in allowed_worker_ids", "POST", "/select", `{"model_name":"model",`+prompt+`,"allowed_worker_ids":[1],"pinned_worker":{"worker_id":2,"dp_rank":0}}`)
		e.fails(503, "no endpoints available to route work", "POST", "/select", `{"model_name":"model",`+prompt+`,"pinned_worker":{"worker_id":2,"dp_rank":7}}`)
	})
	t.Run("§2 hashes ≥ 2^63 are the same 64 bits as their int64", func(t *testing.T) {
		e := newEnv(t)
		e.worker(1, "")
		e.ok(200, "POST", "/select_and_reserve", `{"model_name":"model",`+prompt+`}`)
		v := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model","block_hashes":[14643705804678351452],"sequence_hashes":[1],"isl_tokens":4}`))
		if longest(t, v) != 4.0 {
			t.Fatalf("unsigned form of the block hash did not match: %v", v)
		}
		e.fails(422, "block_hashes", "POST", "/select", `{"model_name":"model","block_hashes":[18446744073709551616],"sequence_hashes":[1],"isl_tokens":4}`)
		e.fails(422, "block_hashes", "POST", "/select", `{"model_name":"model","block_hashes":[1.5],"sequence_hashes":[1],"isl_tokens":4}`)
	})
	t.Run("token_ids decode as u32 integers only", func(t *testing.T) {
		e := newEnv(t)
		e.worker(1, "")
		for bad, want := range map[string]string{
			`[4294967296]`: "token_ids[0]: expected an integer in [0, 4294967295], got JSON number 4294967296",
			`[-1]`:         "token_ids[0]: expected an integer",
			`[1.5]`:        "token_ids[0]: expected an integer",
			`["1"]`:        `token_ids[0]: expected an integer in [0, 4294967295], got JSON string "1"`,
			`[1e3]`:        "token_ids[0]: expected an integer",
			`{"a":1}`:      "token_ids: expected an array of integers",
			`7`:            "token_ids: expected an array of integers",
			`[[1]]`:        "token_ids[0]: expected an integer in [0, 4294967295], got JSON array",
			`[1,null]`:     "token_ids[1]: expected an integer in [0, 4294967295], got JSON null",
		} {
			e.fails(422, want, "POST", "/select", `{"model_name":"model","token_ids":`+bad+`}`)
		}
		v := obj(t, e.ok(200, "POST", "/select_and_reserve", `{"model_name":"model","token_ids":[ 1 ,2,	3
			, 4294967295 ]}`))
		if v["isl_tokens"] != 4.0 {
			t.Fatalf("spaced token list: %v", v)
		}
		e.fails(400, "block_hashes is required without token_ids", "POST", "/select", `{"model_name":"model","token_ids":null}`)
		e.fails(400, "token_ids must not be empty", "POST", "/select", `{"model_name":"model","token_ids":[ ]}`)
	})
	t.Run("§2 conventions on the new routes", func(t *testing.T) {
		e := newEnv(t)
		e.worker(1, "")
		for _, route := range []string{"/reservations", "/potential_loads", "/overlap_scores"} {
			e.fails(415, "Content-Type", "POST", route, "")
			if st, raw := callRaw(t, e.srv, "POST", route, `{}`, "text/plain"); st != 415 {
				t.Errorf("%s text/plain = %d %s", route, st, raw)
			}
			e.fails(400, "malformed JSON", "POST", route, `{"model_name":`)
			e.fails(422, "model_name: expected a string", "POST", route, `{"model_name":5}`)
			e.fails(422, "request body: expected an object", "POST", route, `[1]`)
			e.fails(405, "method not allowed", "PUT", route, `{}`)
		}
		e.fails(404, "route not found", "GET", "/reservations/x/y/z", "")
		e.fails(404, "route not found", "GET", "/workers/1/extra", "")
		e.fails(405, "method not allowed", "GET", "/reservations", "")
		e.fails(405, "method not allowed", "GET", "/reservations/x", "")
		e.fails(405, "method not allowed", "GET", "/reservations/x/prefill_complete", "")
	})
}
