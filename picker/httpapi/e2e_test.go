package httpapi_test

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"
)

// The select-then-reserve flow of an external runtime (standalone-selection-service.txt "Ray
// Select-Then-Reserve Flow"), end to end over HTTP: select with an id, contact the worker,
// reserve (cached replay or explicit form), report prefill completion and output growth, free —
// and every load returns to zero.

func runtimeFlow(t *testing.T, e *env, id string, reserve func(sel map[string]any) string) {
	t.Helper()
	sel := obj(t, e.ok(200, "POST", "/select", f(`{"selection_id":%q,"model_name":"model","session_id":"conv-1",%s}`, id, tokJSON(10))))
	w, r := int(sel["worker_id"].(float64)), int(sel["dp_rank"].(float64))
	if sel["endpoint"] != f("http://worker-%d:8000", w) {
		t.Fatalf("endpoint %v for worker %d", sel["endpoint"], w)
	}
	e.wantLoad(w, r, 0, 0, 0) // /select books nothing
	res := obj(t, e.ok(201, "POST", "/reservations", reserve(sel)))
	if res["worker_id"] != sel["worker_id"] || res["dp_rank"] != sel["dp_rank"] || res["selection_id"] != id {
		t.Fatalf("reservation %v does not match selection %v", res, sel)
	}
	// 10 tokens at block size 4: 2 full blocks tracked, effective prefill 10 (nothing cached).
	e.wantLoad(w, r, 10, 2, 1)
	e.ok(200, "POST", "/reservations/"+id+"/prefill_complete", "")
	e.wantLoad(w, r, 0, 2, 1)
	for i := 0; i < 3; i++ {
		e.ok(200, "POST", "/reservations/"+id+"/output_block", `{}`)
	}
	e.wantLoad(w, r, 0, 5, 1)
	e.ok(200, "POST", "/reservations/"+id+"/output_block", `{"decay_fraction":0.5}`)
	e.wantLoad(w, r, 0, 3, 1) // 6 exclusive blocks at weight 0.5
	e.ok(200, "DELETE", "/reservations/"+id, "")
	e.fails(404, "reservation "+id+" not found", "DELETE", "/reservations/"+id, "")
	if n := e.totalRequests(); n != 0 {
		t.Fatalf("%v active requests left", n)
	}
	for _, p := range e.ok(200, "GET", "/loads", "").([]any) {
		for _, row := range obj(t, p)["loads"].([]any) {
			l := obj(t, row)
			if l["potential_prefill_tokens"] != 0.0 || l["potential_decode_blocks"] != 0.0 {
				t.Fatalf("load left after free: %v", l)
			}
		}
	}
}

func TestExternalRuntimeFlowWithCachedReplay(t *testing.T) {
	e := newEnv(t, affinityTTL(time.Minute))
	e.worker(1, `,"data_parallel_size":2`)
	e.worker(2, "")
	runtimeFlow(t, e, "ray-1", func(map[string]any) string {
		return `{"selection_id":"ray-1","model_name":"model","routing_group":"default"}`
	})
	// The replay bound the session; the lease went with the free.
	if got, leases := e.binding("conv-1"); got == "" || leases != 0 {
		t.Fatalf("session binding after the flow: %q with %d leases", got, leases)
	}
	// A second turn of the conversation steers to the bound worker.
	bound, _ := e.binding("conv-1")
	sel := obj(t, e.ok(200, "POST", "/select", `{"selection_id":"ray-2","model_name":"model","session_id":"conv-1",`+tokJSON(10)+`}`))
	if f("%v/%v", sel["worker_id"], sel["dp_rank"]) != bound {
		t.Fatalf("second turn went to %v/%v, binding %s", sel["worker_id"], sel["dp_rank"], bound)
	}
}

func TestExternalRuntimeFlowWithExplicitReservation(t *testing.T) {
	e := newEnv(t)
	e.worker(1, `,"data_parallel_size":2`)
	e.worker(2, "")
	runtimeFlow(t, e, "ray-x", func(sel map[string]any) string {
		return f(`{"selection_id":"ray-x","model_name":"model","worker_id":%v,"dp_rank":%v,%s,"effective_prefill_tokens":%v}`,
			sel["worker_id"], sel["dp_rank"], tokJSON(10), sel["effective_prefill_tokens"])
	})
	// The explicit booking discarded the cached selection.
	e.fails(404, "no pending selection ray-x", "POST", "/reservations", `{"selection_id":"ray-x","model_name":"model"}`)
}

func TestExternalRuntimeFlowWithExplicitHashForm(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	_, raw := e.raw("POST", "/select_and_reserve", `{"selection_id":"tmp","model_name":"model",`+tokJSON(10)+`}`)
	var sel struct {
		SequenceHashes []json.Number `json:"sequence_hashes"`
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&sel); err != nil || len(sel.SequenceHashes) != 2 {
		t.Fatalf("booking %s: %v", raw, err)
	}
	e.ok(200, "DELETE", "/reservations/tmp", "")
	// The runtime re-uses the normalized tracking hashes the service returned.
	runtimeFlow(t, e, "ray-h", func(map[string]any) string {
		return f(`{"selection_id":"ray-h","model_name":"model","worker_id":1,"sequence_hashes":%s,"isl_tokens":10}`, js(sel.SequenceHashes))
	})
}
