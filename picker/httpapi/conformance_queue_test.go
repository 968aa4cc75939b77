package httpapi_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
)

// Conformance suite, selection-service.md §20 items about queueing (§13): 6, 10, 34 (queued
// half), 42 (queued half), 48, 67 and 68. Waiting requests run in goroutines; the tests observe
// the queue through GET /loads pending_count and release capacity with lifecycle calls, so no
// test sleeps for the queue.

// threshold turns queueing on with router_queue_threshold th.
func threshold(th float64) func(*picker.Config) {
	return func(c *picker.Config) { c.Router.QueueThreshold = &th }
}

// policyYAML installs the policy classes of a §18.2 document.
func policyYAML(t *testing.T, doc string) func(*picker.Config) {
	t.Helper()
	c, err := catalog.ParseConfig([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	ps, err := c.QueueProfiles()
	if err != nil {
		t.Fatal(err)
	}
	return func(cfg *picker.Config) { cfg.PolicyProfiles = ps }
}

// queueEnv is newEnv whose queued requests are failed (503) before the server closes.
func queueEnv(t *testing.T, mods ...func(*picker.Config)) *env {
	t.Helper()
	e := newEnv(t, mods...)
	t.Cleanup(e.core.BeginShutdown)
	return e
}

// reply is one asynchronous HTTP call's outcome.
type reply struct {
	status int
	body   map[string]any
	raw    string
	err    error
}

// async sends a JSON request from a goroutine (headers optional) and delivers its reply.
func (e *env) async(method, path, body string, headers map[string]string) <-chan reply {
	ch := make(chan reply, 1)
	go func() {
		ch <- send(e.srv.URL, e.srv.Client(), method, path, body, headers)
	}()
	return ch
}

// send performs one JSON request without touching testing.T (safe off the test goroutine).
func send(base string, client *http.Client, method, path, body string, headers map[string]string) reply {
	req, err := http.NewRequest(method, base+path, strings.NewReader(body))
	if err != nil {
		return reply{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := client.Do(req)
	if err != nil {
		return reply{err: err}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{err: err}
	}
	r := reply{status: resp.StatusCode, raw: string(raw)}
	if err := json.Unmarshal(raw, &r.body); err != nil {
		r.err = err
	}
	return r
}

// sendH is a synchronous request with headers.
func (e *env) sendH(method, path, body string, headers map[string]string) reply {
	e.t.Helper()
	r := send(e.srv.URL, e.srv.Client(), method, path, body, headers)
	if r.err != nil {
		e.t.Fatalf("%s %s: %v (%s)", method, path, r.err, r.raw)
	}
	return r
}

// got waits for ch's reply (5 s at most).
func (e *env) got(ch <-chan reply) reply {
	e.t.Helper()
	select {
	case r := <-ch:
		if r.err != nil {
			e.t.Fatalf("async call: %v (%s)", r.err, r.raw)
		}
		return r
	case <-time.After(5 * time.Second):
		e.t.Fatal("request still waiting after 5 s")
		return reply{}
	}
}

// pending returns GET /loads pending_count and pending_isl_tokens of model:default.
func (e *env) pending() (count, isl float64) {
	e.t.Helper()
	for _, p := range e.ok(200, "GET", "/loads?model_name=model", "").([]any) {
		m := obj(e.t, p)
		count, isl = m["pending_count"].(float64), m["pending_isl_tokens"].(float64)
	}
	return count, isl
}

// waitPending waits until model:default reports n queued requests.
func (e *env) waitPending(n float64) {
	e.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, _ := e.pending()
		if c == n {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("pending_count = %v, want %v", c, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// occupy books prefill tokens on worker w (dp_rank 0) under id with an explicit reservation.
func (e *env) occupy(id string, w, prefill int) {
	e.t.Helper()
	e.ok(201, "POST", "/reservations", f(`{"selection_id":%q,"model_name":"model","worker_id":%d,"sequence_hashes":[],"isl_tokens":%d,"effective_prefill_tokens":%d}`,
		id, w, prefill, prefill))
}

const batched1024 = `,"max_num_batched_tokens":1024`

func TestAcceptance06QueueingRequiresMaxNumBatchedTokens(t *testing.T) {
	e := queueEnv(t, threshold(1.0))
	w := e.worker(1, "")
	reasons, _ := w["not_schedulable_reasons"].([]any)
	if w["lifecycle"] != "incomplete" || len(reasons) != 1 || !strings.Contains(reasons[0].(string), "max_num_batched_tokens") {
		t.Fatalf("worker = %v", w)
	}
	e.fails(503, "no schedulable workers", "POST", "/select", `{"model_name":"model",`+prompt+`}`)

	// With its capacity the worker is schedulable and /select goes through queue admission:
	// admitted at once while the worker is not busy (active prefill ≤ 1.0 × 4 tokens), waiting
	// while it is, and admitted when the booking that busies it is freed.
	if w := e.worker(1, `,"max_num_batched_tokens":4`); w["lifecycle"] != "schedulable" {
		t.Fatalf("worker = %v", w)
	}
	e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`}`)
	e.occupy("busy", 1, 5)
	waiting := e.async("POST", "/select", `{"model_name":"model",`+prompt+`}`, nil)
	e.waitPending(1)
	// An advisory select never waits, even behind the backlog.
	if v := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model","advisory":true,`+prompt+`}`)); obj(t, v["worker_load"])["active_prefill_tokens"] != 5.0 {
		t.Fatalf("advisory select = %v", v)
	}
	e.ok(200, "DELETE", "/reservations/busy", "")
	if r := e.got(waiting); r.status != 200 || r.body["worker_id"] != 1.0 {
		t.Fatalf("queued /select = %d %s", r.status, r.raw)
	}
	e.waitPending(0)
	e.wantLoad(1, 0, 0, 0, 0) // the query-only select booked nothing
}

// latencyBatch defines the explicit class latency (busy at any prefill, no queue room) and the
// default family batch.
const latencyBatch = `
default_policy_family: batch
uncached_isl_buckets: [{min_tokens: 0, bucket: all}]
policy_classes:
  - {name: latency, quantum: 1, prefill_busy_threshold: 0, request_queue_limit_per_worker: 0}
  - {name: batch, policy_family: batch, cache_bucket: all, quantum: 1}
`

func TestAcceptance10PolicyClassQueueRejection(t *testing.T) {
	e := queueEnv(t, policyYAML(t, latencyBatch))
	e.worker(1, batched1024)
	e.worker(2, batched1024)
	latency := map[string]string{"x-dynamo-meta-policy-class": " latency "}
	// Limits are evaluated only when a request is about to be enqueued: idle workers admit it.
	if r := e.sendH("POST", "/select", `{"model_name":"model",`+prompt+`}`, latency); r.status != 200 {
		t.Fatalf("/select on idle workers = %d %s", r.status, r.raw)
	}
	e.occupy("b1", 1, 4)
	e.occupy("b2", 2, 4)
	for _, route := range []string{"/select", "/select_and_reserve"} {
		r := e.sendH("POST", route, `{"selection_id":"lat","model_name":"model",`+prompt+`}`, latency)
		want := map[string]any{
			"error":   `router policy class "latency" queue requests limit reached (current=0, limit=0)`,
			"details": map[string]any{"policy_class": "latency", "limit_kind": "requests", "current": 0.0, "limit": 0.0},
		}
		if diff := cmp.Diff(want, r.body); r.status != 429 || diff != "" {
			t.Fatalf("%s = %d (-want +got):\n%s", route, r.status, diff)
		}
	}
	// The batch family (no header) busies at 16 × 1024 tokens: 4 booked tokens do not queue it.
	e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"batch","model_name":"model",`+prompt+`}`)
	// The rejected /select_and_reserve left no claim behind.
	e.ok(200, "DELETE", "/reservations/b1", "")
	e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"lat","model_name":"model",`+prompt+`}`)
}

func TestAcceptance34QueuedSelectionsFailOnShutdown(t *testing.T) {
	e := queueEnv(t, threshold(0))
	e.worker(1, batched1024)
	e.occupy("busy", 1, 4)
	reserve := e.async("POST", "/select_and_reserve", `{"selection_id":"q","model_name":"model",`+prompt+`}`, nil)
	query := e.async("POST", "/select", `{"model_name":"model",`+prompt+`}`, nil)
	e.waitPending(2)
	e.core.BeginShutdown()
	for _, ch := range []<-chan reply{reserve, query} {
		if r := e.got(ch); r.status != 503 || r.body["error"] != "selection service is shutting down" {
			t.Fatalf("queued selection on shutdown = %d %s", r.status, r.raw)
		}
	}
	e.waitPending(0)
	e.wantLoad(1, 0, 4, 0, 1) // only the occupying booking
}

// TestAcceptance42QueuedBookingOnADrainedWorker is the queued half of item 42: the worker picked
// at dequeue is drained (DELETE marks it draining before its partition view drops it) while the
// dequeued request books; re-validation frees the booking and the call fails with 500.
func TestAcceptance42QueuedBookingOnADrainedWorker(t *testing.T) {
	var (
		e       *env
		armed   atomic.Bool
		deleted = make(chan error, 1)
	)
	// The picker takes worker 2; once armed it first starts DELETE /workers/2 and waits until the
	// catalog shows the worker draining (the deletion then waits for this partition).
	pick := policytest.Picker{Fn: func(_ *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
		row := 0
		for i, c := range v.Candidates() {
			if c.Worker().WorkerID == 2 {
				row = i
			}
		}
		if !armed.CompareAndSwap(true, false) {
			return row, nil
		}
		go func() {
			_, err := e.core.DeleteWorker(context.Background(), 2)
			deleted <- err
		}()
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			if st, ok := e.core.Worker(2); ok && st.Lifecycle == picker.LifecycleDraining {
				break
			}
		}
		return row, nil
	}}
	e = queueEnv(t, threshold(0), withFactory(func(cfg policies.RouterConfig, wt string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return policies.NewPolicy(cfg, wt, []policies.WorkerScorer{zeroScore}, pick)
	}))
	e.worker(1, batched1024)
	e.worker(2, batched1024)
	e.occupy("o1", 1, 4)
	e.occupy("o2", 2, 4)
	waiting := e.async("POST", "/select_and_reserve", `{"selection_id":"drained","model_name":"model",`+prompt+`}`, nil)
	e.waitPending(1)
	armed.Store(true)
	e.ok(200, "DELETE", "/reservations/o1", "") // frees worker 1: the queued request is dequeued
	r := e.got(waiting)
	if r.status != 500 || r.body["error"] != "selected worker 2 is no longer schedulable" {
		t.Fatalf("dequeued booking on a draining worker = %d %s", r.status, r.raw)
	}
	if err := <-deleted; err != nil {
		t.Fatal(err)
	}
	if n := e.totalRequests(); n != 0 {
		t.Fatalf("%v bookings survived (the drained booking must be freed)", n)
	}
	e.fails(404, "reservation drained not found", "DELETE", "/reservations/drained", "")
	if v := obj(t, e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"drained","model_name":"model",`+prompt+`}`)); v["worker_id"] != 1.0 {
		t.Fatalf("reusing the id = %v", v)
	}
}

func TestAcceptance48QueueRefresh(t *testing.T) {
	cases := []struct {
		name    string
		refresh float64
		wait    time.Duration
		fresh   bool
	}{
		{"a request queued 11 s sees the prefix worker 2 gained while it waited", 10, 11 * time.Second, true},
		{"a request queued 5 s keeps its enqueue-time overlap", 10, 5 * time.Second, false},
		{"a refresh age of 0 disables the refresh", 0, 11 * time.Second, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := queueEnv(t, kvEvents, threshold(0), func(c *picker.Config) { c.Router.OverlapRefreshAfterSecs = tc.refresh })
			e.worker(1, `,"kv_events_endpoint":"tcp://w1:1"`+batched1024)
			e.worker(2, `,"kv_events_endpoint":"tcp://w2:1"`+batched1024)
			e.occupy("o1", 1, 4)
			e.occupy("o2", 2, 4)
			waiting := e.async("POST", "/select_and_reserve", `{"selection_id":"q48","model_name":"model",`+tokJSON(8)+`}`, nil)
			e.waitPending(1)
			e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, local(8, 4)...)
			e.clock.Advance(tc.wait)
			e.ok(200, "DELETE", "/reservations/o2", "")
			r := e.got(waiting)
			if r.status != 200 || r.body["worker_id"] != 2.0 {
				t.Fatalf("dequeued = %d %s", r.status, r.raw)
			}
			ept, ov := 8.0, map[string]any{"longest_matched": 0.0, "gpu": 0.0, "cpu": 0.0, "disk": 0.0, "dp": map[string]any{"0": 0.0}}
			if tc.fresh {
				ept, ov = 0, map[string]any{"longest_matched": 8.0, "gpu": 8.0, "cpu": 8.0, "disk": 8.0, "dp": map[string]any{"0": 8.0}}
			}
			if diff := cmp.Diff(ov, r.body["overlap"]); r.body["effective_prefill_tokens"] != ept || diff != "" {
				t.Fatalf("effective_prefill_tokens %v (want %v), overlap (-want +got):\n%s", r.body["effective_prefill_tokens"], ept, diff)
			}
			e.wantLoad(2, 0, ept, 2, 1) // the booked prefill is the response's value
		})
	}
}

func TestAcceptance67QueueOrdering(t *testing.T) {
	// One worker busy at any prefill: each admitted request books 4 tokens and busies it again,
	// so every free admits exactly one request and the admission order is observable.
	order := func(t *testing.T, policy string, reqs []string, want []int) {
		e := queueEnv(t, threshold(0), func(c *picker.Config) { c.Router.QueuePolicy = policy })
		e.worker(1, batched1024)
		e.occupy("busy", 1, 4)
		chans := make([]<-chan reply, len(reqs))
		for i, extra := range reqs {
			chans[i] = e.async("POST", "/select_and_reserve", f(`{"selection_id":"r%d","model_name":"model",%s%s}`, i, prompt, extra), nil)
			e.waitPending(float64(i + 1))
			e.clock.Advance(time.Second) // arrivals one second apart
		}
		prev := "busy"
		for k, i := range want {
			e.ok(200, "DELETE", "/reservations/"+prev, "")
			if r := e.got(chans[i]); r.status != 200 {
				t.Fatalf("r%d = %d %s", i, r.status, r.raw)
			}
			e.waitPending(float64(len(want) - k - 1))
			prev = f("r%d", i)
		}
	}
	t.Run("fcfs admits in arrival order, a higher strict priority first", func(t *testing.T) {
		order(t, "fcfs", []string{"", "", `,"strict_priority":1`, ""}, []int{2, 0, 1, 3})
	})
	t.Run("fcfs counts priority_jump in seconds of arrival", func(t *testing.T) {
		order(t, "fcfs", []string{"", "", `,"priority_jump":1.5`}, []int{0, 2, 1})
	})
	t.Run("lcfs admits the latest arrival first", func(t *testing.T) {
		order(t, "lcfs", []string{"", "", ""}, []int{2, 1, 0})
	})
	t.Run("wspt keys 1/64, 1/1008 and 1/1 and admits the cheapest uncached work first", func(t *testing.T) {
		e := queueEnv(t, kvEvents, threshold(0), func(c *picker.Config) { c.Router.QueuePolicy = "wspt" })
		for id, blocks := range map[int]int{1: 60, 2: 1, 3: 64} {
			e.worker(id, f(`,"block_size":16,"kv_events_endpoint":"tcp://w%d:1"`, id)+batched1024)
			e.ev.Store(t, uint64(id), 0, kvindex.TierDevice, nil, local(1024, 16)[:blocks]...)
			e.occupy(f("o%d", id), id, 4)
		}
		reqs := map[string]string{
			"best60": `,"allowed_worker_ids":[1,2]`,                  // best eligible overlap 60 blocks → 1024 − 960 = 64
			"pinned": `,"pinned_worker":{"worker_id":2,"dp_rank":0}`, // the pinned worker's 1 block → 1008
			"full":   "",                                             // worker 3 holds all 64 blocks → max(1, 0) = 1
		}
		chans := map[string]<-chan reply{}
		n := 0.0
		for _, id := range []string{"best60", "pinned", "full"} {
			chans[id] = e.async("POST", "/select_and_reserve", f(`{"selection_id":%q,"model_name":"model",%s%s}`, id, tokJSON(1024), reqs[id]), nil)
			n++
			e.waitPending(n)
		}
		type key struct {
			id    string
			cost  uint64
			score float64
		}
		var got []key
		for _, q := range e.core.QueuedRequests(picker.PartitionKey{ModelName: "model", RoutingGroup: "default"}) {
			got = append(got, key{q.SelectionID, q.SchedulingCostTokens, q.PolicyScore})
		}
		want := []key{{"full", 1, 1}, {"best60", 64, 1.0 / 64}, {"pinned", 1008, 1.0 / 1008}}
		if diff := cmp.Diff(want, got, cmp.AllowUnexported(key{})); diff != "" {
			t.Fatalf("queue order and keys (-want +got):\n%s", diff)
		}
		e.ok(200, "DELETE", "/reservations/o3", "")
		if r := e.got(chans["full"]); r.status != 200 || r.body["worker_id"] != 3.0 || r.body["effective_prefill_tokens"] != 0.0 {
			t.Fatalf("full = %d %s", r.status, r.raw)
		}
		e.waitPending(2) // best60's workers 1 and 2 are busy; the pinned request waits behind it
		e.ok(200, "DELETE", "/reservations/o1", "")
		if r := e.got(chans["best60"]); r.status != 200 || r.body["worker_id"] != 1.0 {
			t.Fatalf("best60 = %d %s", r.status, r.raw)
		}
		e.ok(200, "DELETE", "/reservations/o2", "")
		if r := e.got(chans["pinned"]); r.status != 200 || r.body["worker_id"] != 2.0 {
			t.Fatalf("pinned = %d %s", r.status, r.raw)
		}
	})
}

// capped is one family whose class busies at any prefill and queues one request per worker.
const capped = `
default_policy_family: capped
uncached_isl_buckets: [{min_tokens: 0, bucket: all}]
policy_classes:
  - {name: capped, policy_family: capped, cache_bucket: all, quantum: 1, prefill_busy_threshold: 0, request_queue_limit_per_worker: 1}
`

// TestAcceptance68PolicyClassQueue is the service half of item 68 (the DRR, ordering and limit
// arithmetic half is picker/queue TestAcceptance68PolicyClassQueue on the pure queue).
func TestAcceptance68PolicyClassQueue(t *testing.T) {
	e := queueEnv(t, policyYAML(t, capped))
	e.worker(1, batched1024)
	e.worker(2, batched1024)
	e.occupy("o1", 1, 4)
	e.occupy("o2", 2, 4)
	queued := func(id string, tokens int) <-chan reply {
		return e.async("POST", "/select_and_reserve", f(`{"selection_id":%q,"model_name":"model",%s}`, id, tokJSON(tokens)), nil)
	}
	// 1 per worker × 2 workers: two accepted, one of them oversized, checked before adding.
	first := queued("first", 4)
	e.waitPending(1)
	oversized := queued("oversized", 4000)
	e.waitPending(2)
	if c, isl := e.pending(); c != 2 || isl != 4004 {
		t.Fatalf("pending %v / %v tokens", c, isl)
	}
	r := e.sendH("POST", "/select_and_reserve", `{"selection_id":"third","model_name":"model",`+prompt+`}`, nil)
	wantDetails := map[string]any{"policy_class": "capped", "limit_kind": "requests", "current": 2.0, "limit": 2.0}
	if r.status != 429 || !cmp.Equal(r.body["details"], wantDetails) ||
		r.body["error"] != `router policy class "capped" queue requests limit reached (current=2, limit=2)` {
		t.Fatalf("third = %d %s", r.status, r.raw)
	}
	// A third schedulable worker raises the limit to 3 and, idle, admits the head at once.
	e.worker(3, batched1024)
	if r := e.got(first); r.status != 200 || r.body["worker_id"] != 3.0 {
		t.Fatalf("first = %d %s", r.status, r.raw)
	}
	e.waitPending(1)
	second := queued("second", 4)
	e.waitPending(2)
	third := queued("third", 4)
	e.waitPending(3)
	r = e.sendH("POST", "/select_and_reserve", `{"selection_id":"fourth","model_name":"model",`+prompt+`}`, nil)
	if r.status != 429 || r.body["details"].(map[string]any)["limit"] != 3.0 {
		t.Fatalf("fourth = %d %s", r.status, r.raw)
	}
	// Removing a worker lowers the limit without evicting anyone.
	e.ok(200, "DELETE", "/workers/3", "")
	e.waitPending(3)
	e.core.BeginShutdown()
	for _, ch := range []<-chan reply{oversized, second, third} {
		if r := e.got(ch); r.status != 503 {
			t.Fatalf("queued request on shutdown = %d %s", r.status, r.raw)
		}
	}
}
