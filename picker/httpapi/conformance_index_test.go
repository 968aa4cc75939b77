package httpapi_test

import (
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
)

// Conformance suite, selection-service.md §20 "Indexing, hints and policy inputs" (items 29-33).

func longest(t *testing.T, v any) any { return obj(t, obj(t, v)["overlap"])["longest_matched"] }

func TestAcceptance29ApproximateModeRecordsBookingsOnly(t *testing.T) {
	sel := `{"model_name":"model",` + prompt + `}`
	for _, tc := range []struct {
		name   string
		before func(e *env)
		want   float64
	}{
		{"a query-only select records nothing", func(e *env) {
			e.ok(200, "POST", "/select", `{"selection_id":"q","model_name":"model",`+prompt+`}`)
			e.ok(200, "POST", "/select", `{"model_name":"model","advisory":true,`+prompt+`}`)
		}, 0},
		{"select_and_reserve records its prefix", func(e *env) {
			e.ok(200, "POST", "/select_and_reserve", sel)
		}, 4},
		{"a cached replay records its prefix", func(e *env) {
			e.ok(200, "POST", "/select", `{"selection_id":"c","model_name":"model",`+prompt+`}`)
			e.ok(201, "POST", "/reservations", `{"selection_id":"c","model_name":"model"}`)
		}, 4},
		{"an explicit reservation with token_ids records its prefix", func(e *env) {
			e.ok(201, "POST", "/reservations", `{"selection_id":"x","model_name":"model","worker_id":1,`+prompt+`}`)
		}, 4},
		{"an explicit reservation with block_hashes records its prefix", func(e *env) {
			e.ok(201, "POST", "/reservations", `{"selection_id":"x","model_name":"model","worker_id":1,"block_hashes":[-3803038269031200164],"sequence_hashes":[5],"isl_tokens":4}`)
		}, 4},
		{"a hash-only explicit reservation records nothing", func(e *env) {
			e.ok(201, "POST", "/reservations", `{"selection_id":"x","model_name":"model","worker_id":1,"sequence_hashes":[-3803038269031200164],"isl_tokens":4}`)
		}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.worker(1, "")
			tc.before(e)
			if got := longest(t, e.ok(200, "POST", "/select", sel)); got != tc.want {
				t.Fatalf("longest_matched %v, want %v", got, tc.want)
			}
		})
	}
}

func TestAcceptance30EventDrivenIndexNeverRecordsBookings(t *testing.T) {
	e := newEnv(t, kvEvents)
	e.worker(1, `,"kv_events_endpoint":"tcp://w1:5557"`)
	e.ok(200, "POST", "/select_and_reserve", `{"model_name":"model",`+prompt+`}`)
	e.ok(200, "POST", "/select", `{"selection_id":"c","model_name":"model",`+prompt+`}`)
	e.ok(201, "POST", "/reservations", `{"selection_id":"c","model_name":"model"}`)
	e.ok(201, "POST", "/reservations", `{"selection_id":"x","model_name":"model","worker_id":1,`+prompt+`}`)
	if got := longest(t, e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`}`)); got != 0.0 {
		t.Fatalf("longest_matched %v after bookings on an event-driven index", got)
	}
	d := obj(t, obj(t, e.ok(200, "GET", "/dump", ""))["model:default"])
	if !cmp.Equal(d["events"], []any{}) {
		t.Fatalf("dump events %v", d["events"])
	}
}

// hintEnv registers hint-capable workers with KV events on. spec per worker: extra JSON.
func hintEnv(t *testing.T, workers map[int]string) *env {
	e := newEnv(t, kvEvents)
	for id := 1; id <= len(workers); id++ {
		e.worker(id, f(`,"kv_events_endpoints":{"0":"tcp://w%d:5557","1":"tcp://w%d:5558"}`, id, id)+workers[id])
	}
	return e
}

// bookHint books the 8-token prompt (two blocks) pinned to worker 1 and returns its kv_hint.
func bookHint(t *testing.T, e *env, id string) any {
	t.Helper()
	v := obj(t, e.ok(200, "POST", "/select_and_reserve", f(`{"selection_id":%q,"model_name":"model",%s,"pinned_worker":{"worker_id":1,"dp_rank":0}}`, id, tokJSON(8))))
	e.ok(200, "DELETE", "/reservations/"+id, "")
	return v["kv_hint"]
}

func wantHint(t *testing.T, got any, id, endpoint string, hashes ...uint64) {
	t.Helper()
	var hs []any
	for _, h := range hashes {
		hs = append(hs, float64(h))
	}
	want := map[string]any{"protocol_version": "0.1", "message_id": id, "actions": []any{map[string]any{
		"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
		"payload": map[string]any{"source_control_endpoint": endpoint, "block_hashes": hs}}}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("kv_hint (-want +got):\n%s", diff)
	}
}

func TestAcceptance31BookingsAttachKVHints(t *testing.T) {
	h := local(8, 4)
	e := hintEnv(t, map[int]string{
		1: `,"router_hint_worker_type":"decode"`,
		2: `,"router_hint_worker_type":"decode","router_hint_source_control_endpoints":{"0":"tcp://worker-2:5600"}`,
	})
	e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h...)
	t.Run("a same-type worker holding a longer prefix is the source", func(t *testing.T) {
		wantHint(t, bookHint(t, e, "hint-1"), "hint-1", "tcp://worker-2:5600", h[0]+1, h[1]+1)
		// Unsigned decimal on the wire (external ids are u64).
		_, raw := e.raw("POST", "/select_and_reserve", `{"selection_id":"raw","model_name":"model",`+tokJSON(8)+`,"pinned_worker":{"worker_id":1,"dp_rank":0}}`)
		if !strings.Contains(string(raw), `"block_hashes":[`+strconv.FormatUint(h[0]+1, 10)+`,`+strconv.FormatUint(h[1]+1, 10)+`]`) {
			t.Errorf("hint hashes not unsigned decimal: %s", raw)
		}
		e.ok(200, "DELETE", "/reservations/raw", "")
	})
	t.Run("no hint when the chosen worker is the best holder", func(t *testing.T) {
		v := obj(t, e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"best","model_name":"model",`+tokJSON(8)+`}`))
		if v["worker_id"] != 2.0 || v["kv_hint"] != nil {
			t.Fatalf("booking on the best holder = %v", v)
		}
		e.ok(200, "DELETE", "/reservations/best", "")
	})
	t.Run("never on a query-only select", func(t *testing.T) {
		for _, adv := range []string{"false", "true"} {
			_, raw := e.raw("POST", "/select", `{"selection_id":"q","model_name":"model","advisory":`+adv+`,`+tokJSON(8)+`,"pinned_worker":{"worker_id":1,"dp_rank":0}}`)
			if strings.Contains(string(raw), "kv_hint") {
				t.Fatalf("select carries a hint: %s", raw)
			}
		}
	})
	t.Run("never with an approximate index", func(t *testing.T) {
		a := newEnv(t)
		a.worker(1, `,"router_hint_worker_type":"decode"`)
		a.worker(2, `,"router_hint_worker_type":"decode","router_hint_source_control_endpoints":{"0":"tcp://worker-2:5600"}`)
		a.ok(200, "POST", "/select_and_reserve", `{"model_name":"model",`+tokJSON(8)+`,"pinned_worker":{"worker_id":2,"dp_rank":0}}`)
		v := obj(t, a.ok(200, "POST", "/select_and_reserve", `{"model_name":"model",`+tokJSON(8)+`,"pinned_worker":{"worker_id":1,"dp_rank":0}}`))
		if v["kv_hint"] != nil {
			t.Fatalf("approximate-mode booking carries a hint: %v", v)
		}
	})
}

func TestAcceptance32HintSourceRules(t *testing.T) {
	h := local(8, 4)
	const decode = `,"router_hint_worker_type":"decode"`
	src := func(eps string) string { return decode + `,"router_hint_source_control_endpoints":` + eps }
	t.Run("a state_agent_v2 worker is never a source", func(t *testing.T) {
		e := hintEnv(t, map[int]string{1: decode, 2: src(`{"0":"tcp://w2:5600"}`) + `,"kv_event_source_mode":"state_agent_v2"`})
		e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h...)
		if got := bookHint(t, e, "s"); got != nil {
			t.Fatalf("hint from a state agent: %v", got)
		}
	})
	t.Run("a state_agent_v2 worker can receive hints", func(t *testing.T) {
		e := hintEnv(t, map[int]string{1: decode + `,"kv_event_source_mode":"state_agent_v2"`, 2: src(`{"0":"tcp://w2:5600"}`)})
		e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h...)
		wantHint(t, bookHint(t, e, "s"), "s", "tcp://w2:5600", h[0]+1, h[1]+1)
	})
	t.Run("both workers must be hint-capable", func(t *testing.T) {
		e := hintEnv(t, map[int]string{1: "", 2: src(`{"0":"tcp://w2:5600"}`)})
		e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h...)
		if got := bookHint(t, e, "s"); got != nil {
			t.Fatalf("hint to a worker without router_hint_worker_type: %v", got)
		}
		e2 := hintEnv(t, map[int]string{1: decode, 2: `,"router_hint_source_control_endpoints":{"0":"tcp://w2:5600"}`})
		e2.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h...)
		if got := bookHint(t, e2, "s"); got != nil {
			t.Fatalf("hint from a worker without router_hint_worker_type: %v", got)
		}
	})
	t.Run("capability follows catalog membership", func(t *testing.T) {
		e := hintEnv(t, map[int]string{1: decode, 2: src(`{"0":"tcp://w2:5600"}`)})
		e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h...)
		wantHint(t, bookHint(t, e, "a"), "a", "tcp://w2:5600", h[0]+1, h[1]+1)
		e.ok(200, "PATCH", "/workers/1", `{"router_hint_worker_type":""}`)
		if got := bookHint(t, e, "b"); got != nil {
			t.Fatalf("hint after the target lost its capability: %v", got)
		}
		e.ok(200, "PATCH", "/workers/1", `{"router_hint_worker_type":"decode"}`)
		wantHint(t, bookHint(t, e, "c"), "c", "tcp://w2:5600", h[0]+1, h[1]+1)
		e.ok(200, "DELETE", "/workers/2", "")
		if got := bookHint(t, e, "d"); got != nil {
			t.Fatalf("hint from a deleted worker: %v", got)
		}
	})
	t.Run("the source endpoint matches the source rank", func(t *testing.T) {
		e := hintEnv(t, map[int]string{1: decode, 2: src(`{"0":"tcp://w2:5600","1":"tcp://w2:5601"}`) + `,"data_parallel_size":2`})
		e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h[0])
		e.ev.Store(t, 2, 1, kvindex.TierDevice, nil, h...)
		wantHint(t, bookHint(t, e, "r"), "r", "tcp://w2:5601", h[0]+1, h[1]+1)
	})
	t.Run("a source without an endpoint for its longest rank is skipped", func(t *testing.T) {
		e := hintEnv(t, map[int]string{1: decode, 2: src(`{"0":"tcp://w2:5600"}`) + `,"data_parallel_size":2`})
		e.ev.Store(t, 2, 1, kvindex.TierDevice, nil, h...)
		if got := bookHint(t, e, "r"); got != nil {
			t.Fatalf("hint without an endpoint for rank 1: %v", got)
		}
	})
	t.Run("the source must share the target's worker type", func(t *testing.T) {
		e := hintEnv(t, map[int]string{1: decode, 2: `,"router_hint_worker_type":"prefill","router_hint_source_control_endpoints":{"0":"tcp://w2:5600"}`})
		e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h...)
		if got := bookHint(t, e, "t"); got != nil {
			t.Fatalf("hint across worker types: %v", got)
		}
	})
	t.Run("a persistent-cache owner is preferred over a state-agent worker", func(t *testing.T) {
		e := hintEnv(t, map[int]string{
			1: decode,
			2: src(`{"0":"tcp://w2:5600"}`),
			3: src(`{"0":"tcp://w3:5600"}`) + `,"kv_event_source_mode":"state_agent_v2"`,
		})
		e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h[0])
		e.ev.Store(t, 3, 0, kvindex.TierDevice, nil, h...)
		wantHint(t, bookHint(t, e, "p"), "p", "tcp://w2:5600", h[0]+1)
	})
	t.Run("ties go to the longest match, then the lowest worker", func(t *testing.T) {
		e := hintEnv(t, map[int]string{1: decode, 2: src(`{"0":"tcp://w2:5600"}`), 3: src(`{"0":"tcp://w3:5600"}`), 4: src(`{"0":"tcp://w4:5600"}`)})
		e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h[0])
		e.ev.Store(t, 3, 0, kvindex.TierDevice, nil, h...)
		e.ev.Store(t, 4, 0, kvindex.TierDevice, nil, h...)
		wantHint(t, bookHint(t, e, "tie"), "tie", "tcp://w3:5600", h[0]+1, h[1]+1)
	})
	t.Run("a source must hold strictly more than the chosen candidate", func(t *testing.T) {
		e := hintEnv(t, map[int]string{1: decode, 2: src(`{"0":"tcp://w2:5600"}`)})
		e.ev.Store(t, 1, 0, kvindex.TierDevice, nil, h...)
		e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h...)
		if got := bookHint(t, e, "eq"); got != nil {
			t.Fatalf("hint from an equal holder: %v", got)
		}
	})
}

// sessionRecorder is a custom policy that records the session context it receives.
type sessionRecorder struct {
	mu   sync.Mutex
	seen []string
}

func (r *sessionRecorder) factory() policies.PolicyFactory {
	rec := policytest.Scorer{Fn: func(ctx *policies.WorkerSelectionContext, _ *policies.WorkerCandidate) (float64, error) {
		s := "<nil>"
		if sc := ctx.SessionContext(); sc != nil {
			var hs []string
			for k, v := range sc.AgentHeaders() {
				hs = append(hs, k+"="+strings.Join(v, "|"))
			}
			s = strings.Join([]string{sc.SessionID(), sc.ParentSessionID(), strconv.FormatBool(sc.SessionFinal()),
				sc.InputTrigger().String(), strconv.FormatBool(sc.KVHints().EvictSession()), strings.Join(hs, ",")}, ";")
		}
		r.mu.Lock()
		r.seen = append(r.seen, s)
		r.mu.Unlock()
		return 0, nil
	}}
	return func(cfg policies.RouterConfig, wt string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return policies.NewPolicy(cfg, wt, []policies.WorkerScorer{rec}, firstRow)
	}
}

func (r *sessionRecorder) last() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.seen) == 0 {
		return ""
	}
	return r.seen[len(r.seen)-1]
}

// Items 33 and 58: session_context reaches the policy context and wins over session_id; a
// legacy session_id maps to a context with only session_id.
func TestAcceptance33SessionContextReachesThePolicy(t *testing.T) {
	rec := &sessionRecorder{}
	e := newEnv(t, withFactory(rec.factory()))
	e.worker(1, "")
	for _, route := range []string{"/select", "/select_and_reserve"} {
		for _, tc := range []struct{ name, body, want string }{
			{"the structured context wins over session_id",
				`"session_id":"legacy","session_context":{"session_id":"child-session","parent_session_id":"root-session","session_final":true,"input_trigger":"tool_result","agent_headers":{"x-claude-code-request-class":["subagent","b"]},"kv_hints":{"evict_session":true}}`,
				"child-session;root-session;true;tool_result;true;x-claude-code-request-class=subagent|b"},
			{"a legacy session_id maps to a context with only session_id", `"session_id":"legacy"`, "legacy;;false;;false;"},
			{"no session gives no context", `"advisory":false`, "<nil>"},
		} {
			t.Run(route+": "+tc.name, func(t *testing.T) {
				e.ok(200, "POST", route, `{"model_name":"model",`+prompt+`,`+tc.body+`}`)
				if got := rec.last(); got != tc.want {
					t.Fatalf("policy saw %q, want %q", got, tc.want)
				}
			})
		}
	}
	t.Run("session_context validation is 422", func(t *testing.T) {
		e.fails(422, "input_trigger", "POST", "/select", `{"model_name":"model",`+prompt+`,"session_context":{"session_id":"s","input_trigger":"dream"}}`)
		e.fails(422, "session_id", "POST", "/select", `{"model_name":"model",`+prompt+`,"session_context":{"parent_session_id":"s"}}`)
	})
}

func TestAcceptance58SessionContextDeserialization(t *testing.T) {
	// The HTTP decoding half of item 58; the policy half is item 33.
	rec := &sessionRecorder{}
	e := newEnv(t, withFactory(rec.factory()))
	e.worker(1, "")
	e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`,"session_context":{"session_id":"only"}}`)
	if got := rec.last(); got != "only;;false;;false;" {
		t.Fatalf("structured form decoded as %q", got)
	}
	e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`,"session_id":"flat","session_context":null}`)
	if got := rec.last(); got != "flat;;false;;false;" {
		t.Fatalf("fallback to session_id decoded as %q", got)
	}
}
