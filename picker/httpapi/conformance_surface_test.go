package httpapi_test

import (
	"context"
	"net"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/httpapi"
)

// Conformance suite, selection-service.md §20 "HTTP surface" (items 1-28). Fixture unless stated:
// KV events off, workers {worker_id N, model_name "model", endpoint http://worker-N:8000,
// block_size 4}, prompt token_ids [1,2,3,4].

func TestAcceptance01ReplicaSyncRoutesAnswerAsDisabled(t *testing.T) {
	e := newEnv(t)
	if v := e.ok(200, "GET", "/replica_sync/peers", ""); !cmp.Equal(v, []any{}) {
		t.Fatalf("GET /replica_sync/peers = %v, want []", v)
	}
	for _, route := range []string{"/replica_sync/register_peer", "/replica_sync/deregister_peer"} {
		t.Run(route+" validates the endpoint before answering disabled", func(t *testing.T) {
			e.fails(409, "replica sync is disabled", "POST", route, `{"endpoint":"tcp://selector-b:9092"}`)
			e.fails(400, "invalid endpoint", "POST", route, `{"endpoint":"udp://selector-b:9092"}`)
			e.fails(422, "endpoint", "POST", route, `{}`)
			e.fails(400, "malformed JSON", "POST", route, `{"endpoint":`)
			if st, _ := callRaw(t, e.srv, "POST", route, `{"endpoint":"tcp://a:1"}`, "text/plain"); st != 415 {
				t.Errorf("text/plain body = %d, want 415", st)
			}
			e.fails(405, "method not allowed", "GET", route, "")
		})
	}
	e.fails(405, "method not allowed", "POST", "/replica_sync/peers", `{}`)
}

func TestAcceptance02RoutingTokensAndSaltsDriveTheHashes(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	book := func(extra string) (seq []any, isl float64) {
		t.Helper()
		v := obj(t, e.ok(200, "POST", "/select_and_reserve", `{"model_name":"model",`+prompt+extra+`}`))
		e.ok(200, "DELETE", "/reservations/"+v["selection_id"].(string), "")
		return v["sequence_hashes"].([]any), v["isl_tokens"].(float64)
	}
	routing := `,"mm_routing_info":{"routing_token_ids":[1,2,3,4,5,6,7,8]}`
	base, isl := book(routing)
	if isl != 8 || len(base) != 2 {
		t.Fatalf("routing tokens: isl %v, %d sequence hashes; want 8 and 2", isl, len(base))
	}
	plain, _ := book("")
	if len(plain) != 1 {
		t.Fatalf("token_ids alone: %d hashes", len(plain))
	}
	for _, tc := range []struct{ name, extra string }{
		{"mm info", `,"mm_routing_info":{"routing_token_ids":[1,2,3,4,5,6,7,8],"block_mm_infos":[{"mm_objects":[{"mm_hash":42}]},null]}`},
		{"lora_name", routing + `,"lora_name":"adapter-a"`},
		{"cache_salt", routing + `,"cache_salt":"tenant-a"`},
		{"is_eagle", routing + `,"is_eagle":true`},
	} {
		t.Run("the hashes change when "+tc.name+" changes", func(t *testing.T) {
			got, isl := book(tc.extra)
			if isl != 8 {
				t.Errorf("isl %v", isl)
			}
			if cmp.Equal(got, base) {
				t.Errorf("sequence hashes unchanged: %v", got)
			}
		})
	}
}

func TestAcceptance03CacheSaltChangesBlockAndSequenceHashes(t *testing.T) {
	e := newEnv(t) // approximate mode: bookings record their block hashes
	e.worker(1, "")
	v := obj(t, e.ok(200, "POST", "/select_and_reserve", `{"model_name":"model",`+prompt+`,"cache_salt":"tenant-a"}`))
	if !cmp.Equal(v["sequence_hashes"], []any{5738685477468498325.0}) {
		t.Fatalf("salted sequence hashes %v, want [5738685477468498325]", v["sequence_hashes"])
	}
	_, raw := e.raw("POST", "/select_and_reserve", `{"model_name":"model",`+prompt+`}`)
	if !strings.Contains(string(raw), `"sequence_hashes":[-3803038269031200164]`) {
		t.Fatalf("unsalted booking %s", raw)
	}
	// Block hashes: the salted booking recorded the salted block; only a salted prompt (or its
	// precomputed block hash) matches it.
	for _, tc := range []struct {
		name, body string
		want       float64
	}{
		{"salted tokens match the salted block", prompt + `,"cache_salt":"tenant-a"`, 4},
		{"the salted block hash matches in hash form", `"block_hashes":[5738685477468498325],"sequence_hashes":[1],"isl_tokens":4`, 4},
		{"another salt matches nothing", prompt + `,"cache_salt":"tenant-b"`, 4 * 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e.ok(200, "DELETE", "/reservations/"+v["selection_id"].(string), "")
			v = obj(t, e.ok(200, "POST", "/select_and_reserve", `{"model_name":"model",`+prompt+`,"cache_salt":"tenant-a"}`))
			s := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model",`+tc.body+`}`))
			if got := obj(t, s["overlap"])["longest_matched"]; got != tc.want {
				t.Errorf("longest_matched %v, want %v", got, tc.want)
			}
		})
	}
}

func TestAcceptance04OverlapScoresTiers(t *testing.T) {
	e := newEnv(t, kvEvents)
	e.worker(1, `,"kv_events_endpoint":"tcp://w1:5557"`)
	e.worker(2, `,"kv_events_endpoint":"tcp://w2:5557"`)
	h := local(12, 4)
	e.ev.Store(t, 1, 0, kvindex.TierDevice, nil, h[:2]...)
	parent := h[1] + 1
	e.ev.Store(t, 1, 0, kvindex.TierHostPinned, &parent, h[2])
	v := obj(t, e.ok(200, "POST", "/overlap_scores",
		`{"model_name":"model",`+tokJSON(12)+`,"router_config_override":{"overlap_score_credit":0.5}}`))
	want := map[string]any{
		"block_size": 4.0, "num_blocks": 3.0,
		"workers": []any{
			map[string]any{"worker_id": 1.0, "dp_rank": 0.0, "device_blocks": 2.0, "host_pinned_blocks": 3.0, "disk_blocks": 3.0,
				"host_pinned_extension_blocks": 1.0, "disk_extension_blocks": 0.0, "shared_beyond_device_blocks": nil, "router_credit_blocks": 1.75},
			map[string]any{"worker_id": 2.0, "dp_rank": 0.0, "device_blocks": 0.0, "host_pinned_blocks": 0.0, "disk_blocks": 0.0,
				"host_pinned_extension_blocks": 0.0, "disk_extension_blocks": 0.0, "shared_beyond_device_blocks": nil, "router_credit_blocks": 0.0},
		},
		"shared_cache": map[string]any{"enabled": false, "total_hit_blocks": 0.0, "ranges": []any{}, "error": nil},
	}
	if diff := cmp.Diff(want, v); diff != "" {
		t.Fatalf("/overlap_scores (-want +got):\n%s", diff)
	}
}

func TestAcceptance05NotReadyWithoutSchedulableWorkers(t *testing.T) {
	e := newEnv(t)
	st, v := e.do("GET", "/ready", "")
	if st != 503 || obj(t, v)["ready"] != false {
		t.Fatalf("/ready = %d %v", st, v)
	}
	e.fails(503, "no schedulable workers are available", "POST", "/select", `{"model_name":"model",`+prompt+`}`)
	e.worker(1, `,"endpoint":""`) // registered but incomplete
	e.fails(503, "no schedulable workers are available", "POST", "/select", `{"model_name":"model",`+prompt+`}`)
	e.worker(2, `,"model_name":"other"`)
	e.fails(503, "no schedulable workers for model:default", "POST", "/select", `{"model_name":"model",`+prompt+`}`)
	if st, _ := e.do("GET", "/ready", ""); st != 200 {
		t.Fatalf("/ready with a schedulable worker = %d", st)
	}
}

// Item 6 is TestAcceptance06QueueingRequiresMaxNumBatchedTokens in conformance_queue_test.go.

func TestAcceptance07SelectResponseShape(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	st, raw := e.raw("POST", "/select", `{"selection_id":"sel-7","model_name":"model",`+prompt+`}`)
	if st != 200 {
		t.Fatalf("/select = %d %s", st, raw)
	}
	v := map[string]any{}
	if err := jsonUnmarshal(raw, &v); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{
		"selection_id": "sel-7", "model_name": "model", "routing_group": "default", "worker_id": 1.0, "dp_rank": 0.0,
		"endpoint": "http://worker-1:8000", "block_size": 4.0, "effective_prefill_tokens": 4.0, "potential_decode_blocks": 1.0,
		"overlap": map[string]any{"longest_matched": 0.0, "gpu": 0.0, "dp": map[string]any{"0": 0.0}, "cpu": 0.0, "disk": 0.0},
	}
	if diff := cmp.Diff(want, v); diff != "" {
		t.Fatalf("/select (-want +got):\n%s", diff)
	}
	for _, banned := range []string{"tenant_id", "cached_tokens", "effective_overlap_blocks", "sequence_hashes", "worker_load", "kv_hint"} {
		if strings.Contains(string(raw), banned) {
			t.Errorf("response contains %s", banned)
		}
	}
	e.wantLoad(1, 0, 0, 0, 0)
}

func TestAcceptance08OverlapScoresRowsPerRank(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.worker(2, `,"data_parallel_start_rank":2,"data_parallel_size":2`)
	v := obj(t, e.ok(200, "POST", "/overlap_scores", `{"model_name":"model",`+prompt+`}`))
	var rows [][2]float64
	for _, r := range v["workers"].([]any) {
		m := obj(t, r)
		rows = append(rows, [2]float64{m["worker_id"].(float64), m["dp_rank"].(float64)})
	}
	if diff := cmp.Diff([][2]float64{{1, 0}, {2, 2}, {2, 3}}, rows); diff != "" || v["num_blocks"] != 1.0 {
		t.Fatalf("rows (-want +got):\n%s num_blocks %v", diff, v["num_blocks"])
	}
}

func TestAcceptance09SelectAndReserveBooksOnce(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"r9","model_name":"model",`+prompt+`}`)
	e.wantLoad(1, 0, 4, 1, 1)
	e.fails(409, "selection r9 is already reserved or being reserved", "POST", "/select_and_reserve",
		`{"selection_id":"r9","model_name":"model",`+prompt+`}`)
	if v := e.ok(200, "DELETE", "/reservations/r9", ""); !cmp.Equal(v, map[string]any{"status": "ok"}) {
		t.Fatalf("DELETE body %v", v)
	}
	e.wantLoad(1, 0, 0, 0, 0)
}

// Item 10 is TestAcceptance10PolicyClassQueueRejection in conformance_queue_test.go.

func TestAcceptance11OutputBlock(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"o","model_name":"model",`+prompt+`}`)
	e.wantLoad(1, 0, 4, 1, 1)
	e.ok(200, "POST", "/reservations/o/output_block", `{}`)
	e.wantLoad(1, 0, 4, 2, 1)
	if st, _ := callRaw(t, e.srv, "POST", "/reservations/o/output_block", "", ""); st != 200 {
		t.Fatalf("empty body without Content-Type = %d", st)
	}
	e.wantLoad(1, 0, 4, 3, 1)
	for _, bad := range []string{`{"decay_fraction":1.5}`, `{"decay_fraction":-0.1}`} {
		e.fails(400, "decay_fraction must be between 0.0 and 1.0", "POST", "/reservations/o/output_block", bad)
	}
	e.fails(422, "decay_fraction", "POST", "/reservations/o/output_block", `{"decay_fraction":"NaN"}`)
	e.fails(400, "malformed JSON", "POST", "/reservations/o/output_block", `{"decay_fraction":NaN}`)
	// decay_fraction is checked before the lookup.
	e.fails(400, "decay_fraction", "POST", "/reservations/unknown/output_block", `{"decay_fraction":2}`)
	e.fails(404, "reservation unknown not found", "POST", "/reservations/unknown/output_block", `{}`)
	// decay 0 on the exclusive blocks: 1 prompt block + 2 output blocks all weigh 0.
	e.ok(200, "POST", "/reservations/o/output_block", `{"decay_fraction":0}`)
	e.wantLoad(1, 0, 4, 0, 1)
}

func TestAcceptance12ExplicitReservationAfterSelect(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.worker(2, "")
	s := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`}`))
	w := int(s["worker_id"].(float64))
	v := e.ok(201, "POST", "/reservations", f(`{"selection_id":"x12","model_name":"model","worker_id":%d,"dp_rank":0,%s}`, w, prompt))
	want := map[string]any{"selection_id": "x12", "model_name": "model", "routing_group": "default",
		"worker_id": float64(w), "dp_rank": 0.0, "endpoint": f("http://worker-%d:8000", w)}
	if diff := cmp.Diff(want, v); diff != "" {
		t.Fatalf("reservation (-want +got):\n%s", diff)
	}
	e.wantLoad(w, 0, 4, 1, 1)
	e.ok(200, "POST", "/reservations/x12/prefill_complete", "")
	e.wantLoad(w, 0, 0, 1, 1)
}

func TestAcceptance13ExplicitPrefillMustNotExceedISL(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	msg := e.fails(400, "must not exceed isl_tokens", "POST", "/reservations",
		`{"selection_id":"x13","model_name":"model","worker_id":1,`+prompt+`,"effective_prefill_tokens":5}`)
	if msg != "effective_prefill_tokens (5) must not exceed isl_tokens (4)" {
		t.Errorf("message %q", msg)
	}
	e.fails(400, "effective_prefill_tokens (9) must not exceed isl_tokens (8)", "POST", "/reservations",
		`{"selection_id":"x13","model_name":"model","worker_id":1,"sequence_hashes":[1,2],"isl_tokens":8,"effective_prefill_tokens":9}`)
}

func TestAcceptance14ExplicitReservationOfAnIncompleteWorker(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.worker(2, `,"block_size":0`)
	e.fails(404, "schedulable worker 2 not found for model:default", "POST", "/reservations",
		`{"selection_id":"x14","model_name":"model","worker_id":2,`+prompt+`}`)
	e.fails(404, "schedulable worker 1 (dp_rank 3) not found for model:default", "POST", "/reservations",
		`{"selection_id":"x14","model_name":"model","worker_id":1,"dp_rank":3,`+prompt+`}`)
}

func TestAcceptance15CachedReplay(t *testing.T) {
	e := newEnv(t)
	e.worker(1, `,"data_parallel_size":2`)
	e.worker(2, "")
	s := obj(t, e.ok(200, "POST", "/select", `{"selection_id":"r15","model_name":"model",`+prompt+`}`))
	r := obj(t, e.ok(201, "POST", "/reservations", `{"selection_id":"r15","model_name":"model","routing_group":"default"}`))
	if r["worker_id"] != s["worker_id"] || r["dp_rank"] != s["dp_rank"] || r["endpoint"] != s["endpoint"] {
		t.Fatalf("replay %v does not match select %v", r, s)
	}
	w, rk := int(s["worker_id"].(float64)), int(s["dp_rank"].(float64))
	e.wantLoad(w, rk, 4, 1, 1)
	e.ok(200, "POST", "/reservations/r15/prefill_complete", "")
	e.fails(404, "no pending selection r15 for model:default", "POST", "/reservations", `{"selection_id":"r15","model_name":"model"}`)
}

func TestAcceptance16ReplayWithoutSelect(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	msg := e.fails(404, "no pending selection", "POST", "/reservations", `{"selection_id":"nope","model_name":"model"}`)
	if msg != "no pending selection nope for model:default (expired, already used, or never selected)" {
		t.Errorf("message %q", msg)
	}
}

func TestAcceptance17ReservationRequiresSelectionID(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.fails(422, "selection_id", "POST", "/reservations", `{"model_name":"model"}`)
	e.fails(422, "selection_id", "POST", "/reservations", `{"model_name":"model","worker_id":1,`+prompt+`}`)
	e.fails(422, "selection_id", "POST", "/reservations", `{"selection_id":"","model_name":"model"}`)
	e.fails(422, "selection_id", "POST", "/reservations", `{"selection_id":7,"model_name":"model"}`)
}

func TestAcceptance18ReplayIsPure(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.ok(200, "POST", "/select", `{"selection_id":"r18","model_name":"model",`+prompt+`}`)
	e.ok(201, "POST", "/reservations", `{"selection_id":"r18","model_name":"model","effective_prefill_tokens":5,"track_prefill_tokens":false,"token_ids":[9,9,9,9,9,9,9,9]}`)
	e.wantLoad(1, 0, 4, 1, 1)
}

func TestAcceptance19ReplayUnderAnotherModelDoesNotConsume(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.worker(2, `,"model_name":"other"`)
	e.ok(200, "POST", "/select", `{"selection_id":"r19","model_name":"model",`+prompt+`}`)
	e.fails(404, "no pending selection r19 for other:default", "POST", "/reservations", `{"selection_id":"r19","model_name":"other"}`)
	e.fails(404, "no pending selection r19 for model:g2", "POST", "/reservations", `{"selection_id":"r19","model_name":"model","routing_group":"g2"}`)
	e.ok(201, "POST", "/reservations", `{"selection_id":"r19","model_name":"model"}`)
}

func TestAcceptance20ReplayAfterTheWorkerLeftAndCameBack(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.ok(200, "POST", "/select", `{"selection_id":"r20","model_name":"model",`+prompt+`}`)
	e.ok(200, "DELETE", "/workers/1", "")
	e.fails(503, "no schedulable workers", "POST", "/reservations", `{"selection_id":"r20","model_name":"model"}`)
	e.worker(1, "")
	e.ok(201, "POST", "/reservations", `{"selection_id":"r20","model_name":"model"}`)
	e.wantLoad(1, 0, 4, 1, 1)
}

func TestAcceptance21ReplayOfALiveID(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"r21","model_name":"model",`+prompt+`}`)
	e.ok(200, "POST", "/select", `{"selection_id":"r21","model_name":"model",`+prompt+`}`)
	e.fails(409, "selection r21 is already reserved or being reserved", "POST", "/reservations", `{"selection_id":"r21","model_name":"model"}`)
	e.ok(200, "DELETE", "/reservations/r21", "")
	e.ok(201, "POST", "/reservations", `{"selection_id":"r21","model_name":"model"}`)
	// The select ran after the first booking recorded the prefix (approximate mode), so its cached
	// effective_prefill_tokens is 0.
	e.wantLoad(1, 0, 0, 1, 1)
}

func TestAcceptance22ReplayAfterARankRangeMove(t *testing.T) {
	e := newEnv(t)
	e.worker(1, `,"data_parallel_size":2`)
	e.ok(200, "POST", "/select", `{"selection_id":"r22","model_name":"model","pinned_worker":{"worker_id":1,"dp_rank":1},`+prompt+`}`)
	e.ok(200, "PATCH", "/workers/1", `{"data_parallel_start_rank":4}`)
	e.fails(404, "schedulable worker 1 (dp_rank 1) not found for model:default", "POST", "/reservations", `{"selection_id":"r22","model_name":"model"}`)
	e.ok(200, "PATCH", "/workers/1", `{"data_parallel_start_rank":0}`)
	r := obj(t, e.ok(201, "POST", "/reservations", `{"selection_id":"r22","model_name":"model"}`))
	if r["dp_rank"] != 1.0 {
		t.Fatalf("replay %v", r)
	}
}

func TestAcceptance23ExplicitReservationDiscardsTheCachedSelection(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.ok(200, "POST", "/select", `{"selection_id":"r23","model_name":"model",`+prompt+`}`)
	e.ok(201, "POST", "/reservations", `{"selection_id":"r23","model_name":"model","worker_id":1,`+prompt+`}`)
	e.ok(200, "DELETE", "/reservations/r23", "")
	e.fails(404, "no pending selection r23", "POST", "/reservations", `{"selection_id":"r23","model_name":"model"}`)
	t.Run("even when the explicit booking fails", func(t *testing.T) {
		e.ok(200, "POST", "/select", `{"selection_id":"r23b","model_name":"model",`+prompt+`}`)
		e.fails(404, "schedulable worker 9 not found", "POST", "/reservations", `{"selection_id":"r23b","model_name":"model","worker_id":9,`+prompt+`}`)
		e.fails(404, "no pending selection r23b", "POST", "/reservations", `{"selection_id":"r23b","model_name":"model"}`)
	})
}

func TestAcceptance24ReplayFollowsTheSelectsTrackingDecision(t *testing.T) {
	e := newEnv(t, func(c *picker.Config) { c.Router.TrackPrefillTokens = false })
	e.worker(1, "")
	e.ok(200, "POST", "/select", `{"selection_id":"off","model_name":"model",`+prompt+`}`)
	e.ok(201, "POST", "/reservations", `{"selection_id":"off","model_name":"model"}`)
	e.wantLoad(1, 0, 0, 1, 1)
	e.ok(200, "POST", "/select", `{"selection_id":"on","model_name":"model","token_ids":[5,6,7,8],"router_config_override":{"track_prefill_tokens":true}}`)
	e.ok(201, "POST", "/reservations", `{"selection_id":"on","model_name":"model"}`)
	e.wantLoad(1, 0, 4, 2, 2)
}

func TestAcceptance25ReplicaLoadSync(t *testing.T) {
	t.Skip("replica sync arrives with ledger/replica (selection-service.md §15, not in this issue)")
}

func TestAcceptance26Dump(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.ok(200, "POST", "/select_and_reserve", `{"model_name":"model",`+prompt+`}`)
	v := obj(t, e.ok(200, "GET", "/dump", ""))
	d := obj(t, v["model:default"])
	evs, ok := d["events"].([]any)
	if d["block_size"] != 4.0 || !ok || len(evs) != 1 {
		t.Fatalf("/dump = %v", v)
	}
	want := map[string]any{"worker_id": 1.0, "storage_tier": "device", "event": map[string]any{
		"event_id": 0.0, "dp_rank": 0.0, "data": map[string]any{"stored": map[string]any{"parent_hash": nil,
			"blocks": []any{map[string]any{"block_hash": 14643705804678351452.0, "tokens_hash": 14643705804678351452.0}}}}}}
	if diff := cmp.Diff(want, evs[0]); diff != "" {
		t.Errorf("dump event (-want +got):\n%s", diff)
	}
	e.fails(405, "method not allowed", "POST", "/dump", `{}`)
}

// managerSource adapts a real kvevents.Manager (ZMQ SUB listeners on loopback) to the core.
type managerSource struct{ m *kvevents.Manager }

func (a managerSource) AttachWorker(spec picker.WorkerEventSpec, idx *kvindex.Index) error {
	return a.m.Attach(kvevents.WorkerSpec{WorkerID: spec.WorkerID, BlockSize: spec.BlockSize, IsEagle: spec.IsEagle,
		DPStartRank: spec.DPStartRank, DPSize: spec.DPSize, Endpoints: spec.Endpoints, ReplayEndpoint: spec.ReplayEndpoint}, idx)
}
func (a managerSource) DetachWorker(id uint64) { a.m.Detach(id) }

func TestAcceptance27InvalidKVEventsEndpointFailsReconciliation(t *testing.T) {
	m := kvevents.NewManager(kvevents.ManagerConfig{})
	t.Cleanup(func() { _ = m.Close() })
	e := newEnv(t, func(c *picker.Config) { c.Router.UseKVEvents = true; c.EventSource = managerSource{m} })
	port := freePort(t)
	w := e.worker(1, f(`,"data_parallel_size":2,"kv_events_endpoints":{"0":"tcp://127.0.0.1:%d","1":"tcp://127.0.0.1:notaport"}`, port))
	reasons, _ := w["not_schedulable_reasons"].([]any)
	if w["lifecycle"] != "incomplete" || len(reasons) != 1 || !strings.Contains(reasons[0].(string), "reconciliation failed") ||
		!strings.Contains(reasons[0].(string), "dp_rank 1") {
		t.Fatalf("worker = %v", w)
	}
	v := obj(t, e.ok(200, "PATCH", "/workers/1", f(`{"kv_events_endpoints":{"0":"tcp://127.0.0.1:%d","1":"tcp://127.0.0.1:%d"}}`, port, freePort(t))))
	if v["lifecycle"] != "schedulable" || v["not_schedulable_reasons"] != nil {
		t.Fatalf("patched worker = %v", v)
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func TestAcceptance28HashFormLengthMismatch(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	for _, route := range []string{"/select", "/select_and_reserve", "/potential_loads", "/overlap_scores"} {
		e.fails(400, "block_hashes length 1 must match sequence_hashes length 2", "POST", route,
			`{"model_name":"model","block_hashes":[1],"sequence_hashes":[1,2],"isl_tokens":8}`)
	}
	e.fails(400, "block_hashes length 1 must match sequence_hashes length 2", "POST", "/reservations",
		`{"selection_id":"x","model_name":"model","worker_id":1,"block_hashes":[1],"sequence_hashes":[1,2],"isl_tokens":8}`)
	t.Run("the other §6.3 messages", func(t *testing.T) {
		for _, tc := range []struct{ body, msg string }{
			{`"sequence_hashes":[1],"isl_tokens":4`, "block_hashes is required without token_ids"},
			{`"block_hashes":[1],"isl_tokens":4`, "sequence_hashes is required without token_ids"},
			{`"block_hashes":[1],"sequence_hashes":[1]`, "isl_tokens is required without token_ids"},
			{`"block_hashes":[1],"sequence_hashes":[1],"isl_tokens":0`, "isl_tokens must be greater than 0"},
			{`"token_ids":[]`, "token_ids must not be empty"},
		} {
			if msg := e.fails(400, tc.msg, "POST", "/select", `{"model_name":"model",`+tc.body+`}`); msg != tc.msg {
				t.Errorf("message %q, want %q", msg, tc.msg)
			}
		}
		// Explicit reservations relax block_hashes only.
		e.ok(201, "POST", "/reservations", `{"selection_id":"relaxed","model_name":"model","worker_id":1,"sequence_hashes":[1],"isl_tokens":4}`)
		e.fails(400, "sequence_hashes is required without token_ids", "POST", "/reservations",
			`{"selection_id":"x2","model_name":"model","worker_id":1,"isl_tokens":4}`)
	})
}

// fakePeers is a ReplicaPeers for the enabled-replica-sync path of §15.5.
type fakePeers struct{ peers map[string]bool }

func (p *fakePeers) RegisterPeer(ep string) (bool, error) {
	if p.peers[ep] {
		return false, nil
	}
	p.peers[ep] = true
	return true, nil
}

func (p *fakePeers) DeregisterPeer(ep string) error {
	if !p.peers[ep] {
		return picker.Errorf(picker.KindNotFound, "peer not found")
	}
	delete(p.peers, ep)
	return nil
}

func (p *fakePeers) Peers() []string {
	out := []string{}
	for ep := range p.peers {
		out = append(out, ep)
	}
	slices.Sort(out)
	return out
}

func TestReplicaPeerRoutesWithReplicaSyncEnabled(t *testing.T) {
	core, err := picker.New(func() picker.Config { c := picker.DefaultConfig(); c.Router.UseKVEvents = false; return c }())
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(httpapi.New(core, httpapi.Options{Replica: &fakePeers{peers: map[string]bool{}}}))
	defer srv.Close()
	e := &env{t: t, srv: srv, core: core}
	for _, step := range []struct {
		path, endpoint string
		status         int
	}{
		{"/replica_sync/register_peer", "tcp://selector-b:9092", 201},
		{"/replica_sync/register_peer", "tcp://selector-b:9092", 200},
		{"/replica_sync/register_peer", "tcp://[::1]:9093", 201},
		{"/replica_sync/deregister_peer", "tcp://[::1]:9093", 200},
		{"/replica_sync/deregister_peer", "tcp://[::1]:9093", 404},
	} {
		if st, v := e.do("POST", step.path, `{"endpoint":"`+step.endpoint+`"}`); st != step.status {
			t.Fatalf("%s %s = %d %v, want %d", step.path, step.endpoint, st, v, step.status)
		}
	}
	if v := e.ok(200, "GET", "/replica_sync/peers", ""); !cmp.Equal(v, []any{"tcp://selector-b:9092"}) {
		t.Fatalf("peers %v", v)
	}
}

func TestValidateReplicaEndpoint(t *testing.T) {
	for _, tc := range []struct {
		ep string
		ok bool
	}{
		{"tcp://selector-b:9092", true}, {"tcp://10.0.0.1:0", true}, {"tcp://[::1]:9092", true}, {"tcp://*:9092", true},
		{"ipc:///tmp/sync.sock", true}, {"inproc://sync", true},
		{"selector-b:9092", false}, {"udp://h:1", false}, {"tcp://h", false}, {"tcp://:9092", false}, {"tcp://h:65536", false},
		{"tcp://h:-1", false}, {"tcp://h:x", false}, {"tcp://::1:9092", false}, {"tcp://[::1:9092", false}, {"tcp://[]:1", false},
		{"ipc://", false}, {"inproc://", false}, {"", false},
		{"tcp://a@h:1", false}, {"tcp://h\n:1", false}, {"tcp://h :1", false}, {"tcp://" + strings.Repeat("h", 5000) + ":1", false},
	} {
		if err := httpapi.ValidateReplicaEndpoint(tc.ep); (err == nil) != tc.ok {
			t.Errorf("ValidateReplicaEndpoint(%q) = %v, want ok %v", tc.ep, err, tc.ok)
		}
	}
}
