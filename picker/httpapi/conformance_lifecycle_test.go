package httpapi_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
	"github.com/kvepp/kvepp/policies/policytest"
)

// Conformance suite, selection-service.md §20 "Lifecycle, catalog and booking safety" (items
// 34-47).

func TestAcceptance34Shutdown(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.worker(2, "")
	e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"live","model_name":"model",`+prompt+`}`)
	e.ok(200, "POST", "/select", `{"selection_id":"cached","model_name":"model",`+prompt+`}`)
	e.core.BeginShutdown()
	st, v := e.do("GET", "/ready", "")
	if st != 503 || obj(t, v)["ready"] != false || obj(t, v)["schedulable_workers"] != 2.0 {
		t.Fatalf("/ready during shutdown = %d %v", st, v)
	}
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/select", `{"model_name":"model",` + prompt + `}`},
		{"POST", "/select_and_reserve", `{"model_name":"model",` + prompt + `}`},
		{"POST", "/reservations", `{"selection_id":"cached","model_name":"model"}`},
		{"POST", "/reservations", `{"selection_id":"e","model_name":"model","worker_id":1,` + prompt + `}`},
		{"POST", "/potential_loads", `{"model_name":"model",` + prompt + `}`},
		{"POST", "/overlap_scores", `{"model_name":"model",` + prompt + `}`},
		{"POST", "/workers", `{"worker_id":3,"model_name":"model","endpoint":"http://w3","block_size":4}`},
		{"PATCH", "/workers/1", `{"total_kv_blocks":5}`},
		{"POST", "/reservations/live/prefill_complete", ""},
		{"POST", "/reservations/live/output_block", `{}`},
		{"DELETE", "/reservations/live", ""},
	} {
		e.fails(503, "selection service is shutting down", c.method, c.path, c.body)
	}
	for _, c := range []struct{ method, path string }{
		{"GET", "/workers"}, {"GET", "/loads"}, {"GET", "/health"}, {"GET", "/dump"}, {"GET", "/replica_sync/peers"}, {"DELETE", "/workers/2"},
	} {
		e.ok(200, c.method, c.path, "")
	}
	// Queued selections failing on shutdown: TestAcceptance34QueuedSelectionsFailOnShutdown;
	// listeners stopping on shutdown is the service runner's job (runner/selectservice
	// TestRunShutdownClosesTheEventListeners).
}

func TestAcceptance35PolicyFactoryGetsWorkerTypeSelect(t *testing.T) {
	var mu sync.Mutex
	var got []string
	e := newEnv(t, withFactory(func(cfg policies.RouterConfig, wt string, p policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		mu.Lock()
		got = append(got, wt+"@"+p.ModelName+":"+p.RoutingGroup)
		mu.Unlock()
		return defaultcost.Builtin()(cfg, wt, p)
	}))
	e.worker(1, "")
	e.worker(2, `,"routing_group":"g2"`)
	e.worker(3, "")
	e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`}`)
	if diff := cmp.Diff([]string{"select@model:default", "select@model:g2"}, got); diff != "" {
		t.Fatalf("factory calls (-want +got):\n%s", diff)
	}
}

func TestAcceptance36ReplacingTheLastWorkerKeepsTheIndexWorking(t *testing.T) {
	e := newEnv(t, kvEvents)
	h := local(4, 4)
	e.worker(1, `,"kv_events_endpoint":"tcp://w1:1"`)
	e.ev.Store(t, 1, 0, kvindex.TierDevice, nil, h...)
	e.ok(200, "DELETE", "/workers/1", "")
	e.worker(2, `,"kv_events_endpoint":"tcp://w2:1"`)
	if got := longest(t, e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`}`)); got != 0.0 {
		t.Fatalf("departed worker's rows still match: %v", got)
	}
	e.ev.Store(t, 2, 0, kvindex.TierDevice, nil, h...)
	v := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`}`))
	if v["worker_id"] != 2.0 || longest(t, v) != 4.0 {
		t.Fatalf("replacement's events not visible: %v", v)
	}
}

func TestAcceptance37MultiRankWorkerWithReplayEndpointStaysIncomplete(t *testing.T) {
	e := newEnv(t, kvEvents)
	w := e.worker(1, `,"data_parallel_size":2,"kv_events_endpoints":{"0":"tcp://w:1","1":"tcp://w:2"},"replay_endpoint":"tcp://w:3"`)
	if w["lifecycle"] != "incomplete" || !cmp.Equal(w["not_schedulable_reasons"], []any{"replay_endpoint is supported only for data_parallel_size 1"}) {
		t.Fatalf("worker = %v", w)
	}
	if w := e.worker(2, `,"kv_events_endpoint":"tcp://w:1","replay_endpoint":"tcp://w:3"`); w["lifecycle"] != "schedulable" {
		t.Fatalf("single-rank worker with replay_endpoint = %v", w)
	}
}

func TestAcceptance38ReUpsertRecreatesALostListener(t *testing.T) {
	e := newEnv(t, kvEvents)
	rec := `,"kv_events_endpoint":"tcp://w1:1"`
	e.worker(1, rec)
	e.ev.DetachWorker(1) // the listener is lost behind the catalog's back
	if e.attached(1) {
		t.Fatal("listener not lost")
	}
	e.worker(1, rec) // identical record
	if !e.attached(1) {
		t.Fatal("re-upsert did not recreate the listener")
	}
	t.Run("after an attach failure", func(t *testing.T) {
		e.ev.FailAttach(func(picker.WorkerEventSpec) error { return fmt.Errorf("listener start failed") })
		if w := e.worker(1, rec); w["lifecycle"] != "incomplete" {
			t.Fatalf("failed attach = %v", w)
		}
		e.ev.FailAttach(nil)
		if w := e.worker(1, rec); w["lifecycle"] != "schedulable" || !e.attached(1) {
			t.Fatalf("re-upsert = %v", w)
		}
	})
}

func TestAcceptance39UpsertMovesAWorkerBetweenGroups(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"old","model_name":"model",`+prompt+`}`)
	e.worker(1, `,"routing_group":"g2"`)
	e.fails(503, "no schedulable workers for model:default", "POST", "/select", `{"model_name":"model",`+prompt+`}`)
	v := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model","routing_group":"g2",`+prompt+`}`))
	if v["worker_id"] != 1.0 || v["routing_group"] != "g2" {
		t.Fatalf("select in the new group = %v", v)
	}
	e.fails(404, "reservation old not found", "DELETE", "/reservations/old", "")
}

func TestAcceptance40MetadataUpdatesKeepIndexRows(t *testing.T) {
	e := newEnv(t, kvEvents)
	e.worker(1, `,"kv_events_endpoint":"tcp://w1:1"`)
	e.ev.Store(t, 1, 0, kvindex.TierDevice, nil, local(4, 4)...)
	sel := `{"model_name":"model",` + prompt + `}`
	e.ok(200, "PATCH", "/workers/1", `{"total_kv_blocks":100,"taints":["gpu"],"max_num_batched_tokens":2048}`)
	e.worker(1, `,"kv_events_endpoint":"tcp://w1:1","total_kv_blocks":7`)
	if got := longest(t, e.ok(200, "POST", "/select", sel)); got != 4.0 {
		t.Fatalf("metadata update dropped the rows: %v", got)
	}
	e.ok(200, "DELETE", "/workers/1", "")
	e.worker(1, `,"kv_events_endpoint":"tcp://w1:1"`)
	if got := longest(t, e.ok(200, "POST", "/select", sel)); got != 0.0 {
		t.Fatalf("delete + add kept the rows: %v", got)
	}
}

func TestAcceptance41CatalogUpdatesAreAtomicAndDeletesReleaseBookings(t *testing.T) {
	e := newEnv(t)
	e.worker(1, `,"data_parallel_size":2`)
	e.worker(2, "")
	t.Run("a selection never sees a half-applied record", func(t *testing.T) {
		e.ok(200, "PATCH", "/workers/1", `{"endpoint":"http://w1-0:8000"}`)
		var wg sync.WaitGroup
		stop := make(chan struct{})
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				start := []int{0, 8}[i%2]
				if st, _ := call(t, e.srv, "PATCH", "/workers/1", f(`{"data_parallel_start_rank":%d,"endpoint":"http://w1-%d:8000"}`, start, start)); st != 200 {
					t.Errorf("PATCH = %d", st)
					return
				}
			}
		}()
		defer func() { close(stop); wg.Wait() }()
		for i := 0; i < 300; i++ {
			st, v := e.do("POST", "/select_and_reserve", `{"model_name":"model","allowed_worker_ids":[1],`+prompt+`}`)
			if st != 200 {
				t.Fatalf("select = %d %v", st, v)
			}
			m := obj(t, v)
			r, ep := int(m["dp_rank"].(float64)), m["endpoint"].(string)
			if want := f("http://w1-%d:8000", r/8*8); ep != want {
				t.Fatalf("rank %d came with endpoint %s (want %s)", r, ep, want)
			}
			e.ok(200, "DELETE", "/reservations/"+m["selection_id"].(string), "")
		}
	})
	t.Run("deleting a worker releases its live bookings", func(t *testing.T) {
		e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"w2a","model_name":"model","pinned_worker":{"worker_id":2,"dp_rank":0},`+prompt+`}`)
		e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"w2b","model_name":"model","pinned_worker":{"worker_id":2,"dp_rank":0},`+prompt+`}`)
		d := obj(t, e.ok(200, "DELETE", "/workers/2", ""))
		if d["lifecycle"] != "unschedulable" {
			t.Fatalf("DELETE body %v", d)
		}
		for _, id := range []string{"w2a", "w2b"} {
			e.fails(404, "reservation "+id+" not found", "DELETE", "/reservations/"+id, "")
		}
		if n := e.totalRequests(); n != 0 {
			t.Fatalf("%v active requests after deleting the worker", n)
		}
		e.fails(404, "worker 2 not found", "DELETE", "/workers/2", "")
		for _, w := range e.ok(200, "GET", "/workers", "").([]any) {
			if obj(t, w)["worker_id"] == 2.0 {
				t.Fatal("deleted worker still listed")
			}
		}
	})
}

func TestAcceptance42NoBookingSurvivesItsWorkersRemoval(t *testing.T) {
	// Without a queue, selection and booking are atomic with respect to catalog updates, so a
	// booking can never outlive a drained worker. The queued half of item 42 (re-validation at
	// dequeue, 500 "selected worker {id} is no longer schedulable") is
	// TestAcceptance42QueuedBookingOnADrainedWorker in conformance_queue_test.go.
	e := newEnv(t)
	e.worker(1, "")
	e.worker(2, "")
	var wg sync.WaitGroup
	var mu sync.Mutex
	onTwo := []string{}
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				st, v := call(t, e.srv, "POST", "/select_and_reserve", `{"model_name":"model",`+prompt+`}`)
				if st != 200 {
					continue
				}
				if m := v.(map[string]any); m["worker_id"] == 2.0 {
					mu.Lock()
					onTwo = append(onTwo, m["selection_id"].(string))
					mu.Unlock()
				}
			}
		}()
	}
	time.Sleep(2 * time.Millisecond)
	e.ok(200, "DELETE", "/workers/2", "")
	wg.Wait()
	for _, id := range onTwo {
		if st, _ := e.do("DELETE", "/reservations/"+id, ""); st != 404 {
			t.Fatalf("booking %s on the deleted worker survived (%d)", id, st)
		}
	}
	for _, p := range e.ok(200, "GET", "/loads", "").([]any) {
		for _, row := range obj(t, p)["loads"].([]any) {
			if obj(t, row)["worker_id"] == 2.0 {
				t.Fatal("deleted worker still has a load row")
			}
		}
	}
}

// flipCtx reports cancellation from its n-th Err call on.
type flipCtx struct {
	context.Context
	calls atomic.Int32
	after int32
}

func (c *flipCtx) Err() error {
	if c.calls.Add(1) > c.after {
		return context.Canceled
	}
	return nil
}

func TestAcceptance43CancelledSelectionFreesBookingAndClaim(t *testing.T) {
	for _, mode := range []struct {
		name string
		mods []func(*picker.Config)
	}{
		{"event-driven index", []func(*picker.Config){kvEvents}},
		{"while recording into the approximate index", nil},
	} {
		t.Run(mode.name, func(t *testing.T) {
			e := newEnv(t, append(mode.mods, affinityTTL(time.Minute))...)
			e.worker(1, `,"kv_events_endpoint":"tcp://w1:1"`)
			// The first Err check (before selecting) passes; the one after booking reports the
			// caller gone.
			ctx := &flipCtx{Context: context.Background(), after: 1}
			_, err := e.core.SelectAndReserve(ctx, picker.SelectRequest{ModelName: "model", SelectionID: "gone",
				Prompt: picker.Prompt{TokenIDs: toks(4)}, Session: &picker.SessionContext{SessionID: "s"}})
			if err == nil {
				t.Fatal("cancelled selection succeeded")
			}
			e.wantLoad(1, 0, 0, 0, 0)
			e.fails(404, "reservation gone not found", "DELETE", "/reservations/gone", "")
			if _, _, _, ok := e.core.SessionBinding(picker.PartitionKey{ModelName: "model", RoutingGroup: "default"}, "s"); ok {
				t.Fatal("the cancelled booking bound its session")
			}
			// The claim is gone too: the id books again.
			e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"gone","model_name":"model",`+prompt+`}`)
			t.Run("a cancelled replay keeps the pending selection", func(t *testing.T) {
				e.ok(200, "POST", "/select", `{"selection_id":"rp","model_name":"model",`+prompt+`}`)
				_, err := e.core.Reserve(&flipCtx{Context: context.Background()}, picker.ReservationRequest{ModelName: "model", SelectionID: "rp"})
				if err == nil {
					t.Fatal("cancelled replay succeeded")
				}
				e.ok(201, "POST", "/reservations", `{"selection_id":"rp","model_name":"model"}`)
			})
		})
	}
}

func TestAcceptance44SelectionIDsAreProcessWide(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	e.worker(2, `,"model_name":"m2"`)
	e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"dup","model_name":"model",`+prompt+`}`)
	e.fails(409, "selection dup is already reserved or being reserved", "POST", "/select_and_reserve", `{"selection_id":"dup","model_name":"m2",`+prompt+`}`)
	e.fails(409, "selection dup is already reserved or being reserved", "POST", "/reservations", `{"selection_id":"dup","model_name":"m2","worker_id":2,`+prompt+`}`)
	e.fails(409, "selection dup is already reserved or being reserved", "POST", "/reservations", `{"selection_id":"dup","model_name":"model","worker_id":1,`+prompt+`}`)
	e.ok(200, "POST", "/select", `{"selection_id":"dup","model_name":"m2",`+prompt+`}`)
	e.fails(409, "selection dup is already reserved or being reserved", "POST", "/reservations", `{"selection_id":"dup","model_name":"m2"}`)
}

func TestAcceptance45InFlightReservationsAreInvisibleToLifecycleCalls(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	block := policytest.Scorer{Fn: func(ctx *policies.WorkerSelectionContext, _ *policies.WorkerCandidate) (float64, error) {
		if n, ok := ctx.ExpectedOutputTokens(); ok && n == 777 {
			entered <- struct{}{}
			<-release
		}
		return 0, nil
	}}
	e := newEnv(t, withFactory(func(cfg policies.RouterConfig, wt string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return policies.NewPolicy(cfg, wt, []policies.WorkerScorer{block}, firstRow)
	}))
	e.worker(1, "")
	done := make(chan int)
	go func() {
		st, _ := call(t, e.srv, "POST", "/select_and_reserve", `{"selection_id":"flight","model_name":"model","expected_output_tokens":777,`+prompt+`}`)
		done <- st
	}()
	<-entered
	e.fails(404, "reservation flight not found", "DELETE", "/reservations/flight", "")
	e.fails(404, "reservation flight not found", "POST", "/reservations/flight/prefill_complete", "")
	e.fails(404, "reservation flight not found", "POST", "/reservations/flight/output_block", `{}`)
	e.fails(409, "selection flight is already reserved or being reserved", "POST", "/select_and_reserve", `{"selection_id":"flight","model_name":"model",`+prompt+`}`)
	close(release)
	if st := <-done; st != 200 {
		t.Fatalf("in-flight booking = %d", st)
	}
	e.ok(200, "POST", "/reservations/flight/prefill_complete", "")
	e.ok(200, "POST", "/reservations/flight/prefill_complete", "")
	e.wantLoad(1, 0, 0, 1, 1)
	e.ok(200, "DELETE", "/reservations/flight", "")
	e.fails(404, "reservation flight not found", "POST", "/reservations/flight/prefill_complete", "")
}

func TestAcceptance46ReservationIndexTracksBookingsUntilFreed(t *testing.T) {
	e := newEnv(t, affinityTTL(time.Minute))
	e.worker(1, "")
	e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"old","model_name":"model","session_id":"s",`+prompt+`}`)
	e.clock.Advance(200 * time.Second)
	e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"young","model_name":"model",`+prompt+`}`)
	key := picker.PartitionKey{ModelName: "model", RoutingGroup: "default"}
	if _, _, n, _ := e.core.SessionBinding(key, "s"); n != 1 {
		t.Fatalf("leases before expiry = %d", n)
	}
	now := e.clock.Advance(101 * time.Second) // "old" is 301 s old, "young" 101 s
	if n := e.core.ExpireStale(now); n != 1 {
		t.Fatalf("expired %d bookings, want 1", n)
	}
	e.fails(404, "reservation old not found", "POST", "/reservations/old/prefill_complete", "")
	e.ok(200, "POST", "/reservations/young/prefill_complete", "")
	if _, _, n, ok := e.core.SessionBinding(key, "s"); !ok || n != 0 {
		t.Fatalf("expiry did not release the lease: leases %d ok %v", n, ok)
	}
	if n := e.core.SweepReservations(now); n != 0 {
		t.Fatalf("sweep released %d leases of live bookings", n)
	}
	t.Run("mirrored replica bookings", func(t *testing.T) {
		t.Skip("replica mirrors arrive with ledger/replica (selection-service.md §15)")
	})
}

func TestAcceptance47AdvisorySelect(t *testing.T) {
	half, zero := 0.5, 0.0
	withThresholds := func(c *picker.Config) {
		c.Router.ConditionalDisaggPrefillBusyThreshold = &half
		c.Router.ConditionalDisaggDecodeBusyThreshold = &zero
	}
	t.Run("reports worker_load and busy flags and books nothing", func(t *testing.T) {
		e := newEnv(t, withThresholds)
		e.worker(1, `,"max_num_batched_tokens":1024,"total_kv_blocks":1000`)
		e.ok(201, "POST", "/reservations", `{"selection_id":"bg","model_name":"model","worker_id":1,"sequence_hashes":[],"isl_tokens":600,"effective_prefill_tokens":600}`)
		v := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model","advisory":true,`+prompt+`}`))
		want := map[string]any{"active_prefill_tokens": 600.0, "prefill_token_capacity": 1024.0, "total_kv_blocks": 1000.0, "prefill_busy": true}
		if diff := cmp.Diff(want, v["worker_load"]); diff != "" || v["decode_busy"] != true {
			t.Fatalf("worker_load (-want +got):\n%s decode_busy %v", diff, v["decode_busy"])
		}
		e.ok(200, "DELETE", "/reservations/bg", "")
		v = obj(t, e.ok(200, "POST", "/select", `{"model_name":"model","advisory":true,`+prompt+`}`))
		if wl := obj(t, v["worker_load"]); wl["prefill_busy"] != false || wl["active_prefill_tokens"] != 0.0 {
			t.Fatalf("idle worker_load %v", wl)
		}
		e.wantLoad(1, 0, 0, 0, 0)
		if v := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model",`+prompt+`}`)); v["worker_load"] != nil {
			t.Fatal("non-advisory select reports worker_load")
		}
		if v := obj(t, e.ok(200, "POST", "/select_and_reserve", `{"model_name":"model","advisory":true,`+prompt+`}`)); v["worker_load"] != nil || v["decode_busy"] != true {
			t.Fatalf("advisory is ignored by select_and_reserve: %v", v)
		}
	})
	t.Run("busy flags are absent without thresholds", func(t *testing.T) {
		e := newEnv(t)
		e.worker(1, `,"max_num_batched_tokens":1024,"total_kv_blocks":1000`)
		v := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model","advisory":true,`+prompt+`}`))
		if _, ok := v["decode_busy"]; ok {
			t.Error("decode_busy without a threshold")
		}
		if diff := cmp.Diff(map[string]any{"active_prefill_tokens": 0.0, "prefill_token_capacity": 1024.0, "total_kv_blocks": 1000.0}, v["worker_load"]); diff != "" {
			t.Errorf("worker_load (-want +got):\n%s", diff)
		}
	})
	t.Run("decode_busy is absent without total_kv_blocks and capacity defaults to 10,000,000", func(t *testing.T) {
		e := newEnv(t, withThresholds)
		e.worker(1, "")
		v := obj(t, e.ok(200, "POST", "/select", `{"model_name":"model","advisory":true,`+prompt+`}`))
		if _, ok := v["decode_busy"]; ok {
			t.Error("decode_busy without total_kv_blocks")
		}
		if diff := cmp.Diff(map[string]any{"active_prefill_tokens": 0.0, "prefill_token_capacity": 1e7, "prefill_busy": false}, v["worker_load"]); diff != "" {
			t.Errorf("worker_load (-want +got):\n%s", diff)
		}
	})
}
