package picker_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
	"github.com/kvepp/kvepp/picker/queue"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
)

// Queue admission (selection-service.md §13) through the service.

// withThreshold turns queueing on with router_queue_threshold th.
func withThreshold(th float64) func(*picker.Config) {
	return func(c *picker.Config) { c.Router.QueueThreshold = &th }
}

// withProfiles turns queueing on with a root profile built from spec.
func withProfiles(t *testing.T, spec queue.ProfileSpec) func(*picker.Config) {
	t.Helper()
	p, err := queue.NewProfile(spec)
	if err != nil {
		t.Fatal(err)
	}
	return func(c *picker.Config) { c.PolicyProfiles = &queue.Profiles{Root: p} }
}

// batched sets max_num_batched_tokens (tokens).
func batched(n uint64) func(*picker.WorkerRecord) {
	return func(r *picker.WorkerRecord) { r.MaxNumBatchedTokens = u64(n) }
}

// occupy books prefill tokens on (worker, 0) under id with an explicit reservation.
func occupy(t *testing.T, s *picker.Service, id string, workerID uint64, prefill uint64) {
	t.Helper()
	_, err := s.Reserve(ctxb(), picker.ReservationRequest{
		ModelName: "model", SelectionID: id, WorkerID: u64(workerID),
		Prompt:                 picker.Prompt{HashForm: true, SequenceHashes: []uint64{}, ISLTokens: prefill, ISLTokensSet: true},
		EffectivePrefillTokens: u64(prefill),
	})
	if err != nil {
		t.Fatalf("occupy worker %d: %v", workerID, err)
	}
}

type outcome struct {
	sel picker.Selection
	err error
}

// async runs f in a goroutine and delivers its result.
func async(f func() (picker.Selection, error)) <-chan outcome {
	ch := make(chan outcome, 1)
	go func() {
		sel, err := f()
		ch <- outcome{sel, err}
	}()
	return ch
}

// waitPending waits until partition model:default reports n queued requests.
func waitPending(t *testing.T, s *picker.Service, n uint64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var got uint64
		for _, pl := range s.Loads("model", "default") {
			got = pl.PendingCount
		}
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pending_count = %d, want %d", got, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// still asserts that ch has not delivered.
func still(t *testing.T, ch <-chan outcome, what string) {
	t.Helper()
	select {
	case o := <-ch:
		t.Fatalf("%s returned while it should wait: %+v %v", what, o.sel, o.err)
	default:
	}
}

// recv returns ch's outcome, failing after 5 s.
func recv(t *testing.T, ch <-chan outcome) outcome {
	t.Helper()
	select {
	case o := <-ch:
		return o
	case <-time.After(5 * time.Second):
		t.Fatal("request still waiting after 5 s")
		return outcome{}
	}
}

// busyPair is a service with router_queue_threshold 0 (any booked prefill busies a rank) and
// workers 1 and 2 (max_num_batched_tokens 1024) each holding 4 prefill tokens (o1, o2).
func busyPair(t *testing.T, mods ...func(*picker.Config)) *picker.Service {
	t.Helper()
	s := newService(t, append([]func(*picker.Config){withThreshold(0)}, mods...)...)
	mustUpsert(t, s, worker(1, batched(1024)))
	mustUpsert(t, s, worker(2, batched(1024)))
	occupy(t, s, "o1", 1, 4)
	occupy(t, s, "o2", 2, 4)
	return s
}

func reserveAsync(s *picker.Service, ctx context.Context, id string, mods ...func(*picker.SelectRequest)) <-chan outcome {
	req := tokenReq(tokens(4), append([]func(*picker.SelectRequest){func(r *picker.SelectRequest) { r.SelectionID = id }}, mods...)...)
	return async(func() (picker.Selection, error) { return s.SelectAndReserve(ctx, req) })
}

func TestQueueAdmission(t *testing.T) {
	t.Run("a request is admitted at once while the pool is not busy", func(t *testing.T) {
		s := newService(t, withThreshold(0))
		mustUpsert(t, s, worker(1, batched(1024)))
		occupy(t, s, "o1", 1, 4)
		mustUpsert(t, s, worker(2, batched(1024)))
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4)))
		if err != nil || sel.WorkerID != 2 {
			t.Fatalf("%+v %v", sel, err)
		}
		if q := s.QueuedRequests(picker.PartitionKey{ModelName: "model", RoutingGroup: "default"}); len(q) != 0 {
			t.Fatalf("queued %+v", q)
		}
	})
	lifecycle := []struct {
		name string
		free func(t *testing.T, s *picker.Service, clock *pickertest.Clock)
	}{
		{"free", func(t *testing.T, s *picker.Service, _ *pickertest.Clock) {
			if err := s.Free(ctxb(), "o2"); err != nil {
				t.Fatal(err)
			}
		}},
		{"prefill_complete", func(t *testing.T, s *picker.Service, _ *pickertest.Clock) {
			if err := s.PrefillComplete(ctxb(), "o2"); err != nil {
				t.Fatal(err)
			}
		}},
		{"expiry", func(t *testing.T, s *picker.Service, clock *pickertest.Clock) {
			if n := s.ExpireStale(clock.Advance(299 * time.Second)); n != 0 {
				t.Fatalf("expired %d too early", n)
			}
			occupy(t, s, "o1-late", 1, 4)                // admitted later: survives the next sweep
			if err := s.Free(ctxb(), "o1"); err != nil { // worker 1 stays busy through o1-late
				t.Fatal(err)
			}
			if n := s.ExpireStale(clock.Advance(2 * time.Second)); n != 1 {
				t.Fatalf("expired %d, want o2", n)
			}
		}},
		{"a worker added", func(t *testing.T, s *picker.Service, _ *pickertest.Clock) {
			mustUpsert(t, s, worker(3, batched(1024)))
		}},
	}
	for _, tc := range lifecycle {
		t.Run("a waiting request is admitted by "+tc.name, func(t *testing.T) {
			clock := pickertest.NewClock(time0)
			s := busyPair(t, func(c *picker.Config) { c.Now = clock.Now })
			ch := reserveAsync(s, ctxb(), "q")
			waitPending(t, s, 1)
			still(t, ch, "the queued request")
			tc.free(t, s, clock)
			o := recv(t, ch)
			if o.err != nil || !o.sel.Booked || o.sel.SelectionID != "q" {
				t.Fatalf("%+v %v", o.sel, o.err)
			}
			waitPending(t, s, 0)
			if tc.name != "a worker added" && o.sel.WorkerID != 2 {
				t.Fatalf("admitted on worker %d, want the freed worker 2", o.sel.WorkerID)
			}
			if err := s.Free(ctxb(), "q"); err != nil {
				t.Fatalf("the admitted booking is not live: %v", err)
			}
		})
	}
	t.Run("an advisory select never waits", func(t *testing.T) {
		s := busyPair(t)
		sel, err := s.Select(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.Advisory = true }))
		if err != nil || sel.WorkerLoad == nil || sel.WorkerLoad.ActivePrefillTokens != 4 || sel.WorkerLoad.PrefillTokenCapacity != 1024 {
			t.Fatalf("%+v %v", sel, err)
		}
	})
	t.Run("a query-only select waits and books nothing", func(t *testing.T) {
		s := busyPair(t)
		req := tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "peek" })
		ch := async(func() (picker.Selection, error) { return s.Select(ctxb(), req) })
		waitPending(t, s, 1)
		still(t, ch, "the query-only select")
		if err := s.Free(ctxb(), "o1"); err != nil {
			t.Fatal(err)
		}
		o := recv(t, ch)
		if o.err != nil || o.sel.Booked || o.sel.WorkerID != 1 {
			t.Fatalf("%+v %v", o.sel, o.err)
		}
		if l := loadOf(t, s, "model", "default", 1, 0); l.ActiveRequests != 0 {
			t.Fatalf("a query-only select booked: %+v", l)
		}
		// The dequeued select still wrote the pending-selection cache (§7.2 step 4).
		if _, err := s.Reserve(ctxb(), picker.ReservationRequest{ModelName: "model", SelectionID: "peek"}); err != nil {
			t.Fatalf("replay of the queued select: %v", err)
		}
	})
	t.Run("a new arrival never bypasses its class's backlog", func(t *testing.T) {
		s := busyPair(t)
		pinned := reserveAsync(s, ctxb(), "pinned", func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 1} })
		waitPending(t, s, 1)
		if err := s.Free(ctxb(), "o2"); err != nil { // worker 2 is free, the pinned head still waits for 1
			t.Fatal(err)
		}
		waitPending(t, s, 1)
		free := reserveAsync(s, ctxb(), "free")
		waitPending(t, s, 2)
		still(t, free, "the request behind the backlog")
		if err := s.Free(ctxb(), "o1"); err != nil {
			t.Fatal(err)
		}
		if o := recv(t, pinned); o.err != nil || o.sel.WorkerID != 1 {
			t.Fatalf("pinned: %+v %v", o.sel, o.err)
		}
		if o := recv(t, free); o.err != nil || o.sel.WorkerID != 2 {
			t.Fatalf("free: %+v %v", o.sel, o.err)
		}
	})
	t.Run("a pinned request waits only for its own rank", func(t *testing.T) {
		s := newService(t, withThreshold(0))
		mustUpsert(t, s, worker(1, batched(1024)))
		mustUpsert(t, s, worker(2, batched(1024)))
		occupy(t, s, "o1", 1, 4)
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 2} }))
		if err != nil || sel.WorkerID != 2 {
			t.Fatalf("pinned to the free worker: %+v %v", sel, err)
		}
		if err := s.Free(ctxb(), sel.SelectionID); err != nil {
			t.Fatal(err)
		}
		ch := reserveAsync(s, ctxb(), "p1", func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 1} })
		waitPending(t, s, 1)
		still(t, ch, "the request pinned to the busy worker")
		if err := s.Free(ctxb(), "o1"); err != nil {
			t.Fatal(err)
		}
		if o := recv(t, ch); o.err != nil || o.sel.WorkerID != 1 {
			t.Fatalf("%+v %v", o.sel, o.err)
		}
	})
	t.Run("do_not_queue turns a wait into 429 and leaves a free pool alone", func(t *testing.T) {
		s := busyPair(t)
		_, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.DoNotQueue = true; r.SelectionID = "dnq" }))
		wantKind(t, err, picker.KindOverloaded, `router policy class "default" would queue the request and do_not_queue is set`)
		waitPending(t, s, 0)
		if err := s.Free(ctxb(), "o1"); err != nil {
			t.Fatal(err)
		}
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.DoNotQueue = true; r.SelectionID = "dnq" }))
		if err != nil || sel.WorkerID != 1 {
			t.Fatalf("with a free worker: %+v %v (the rejected claim must have been released)", sel, err)
		}
	})
	t.Run("a caller that goes away is removed from the queue and its claim released", func(t *testing.T) {
		s := busyPair(t)
		ctx, cancel := context.WithCancel(ctxb())
		ch := reserveAsync(s, ctx, "gone")
		waitPending(t, s, 1)
		cancel()
		o := recv(t, ch)
		if !errors.Is(o.err, context.Canceled) {
			t.Fatalf("err = %v", o.err)
		}
		waitPending(t, s, 0)
		if err := s.Free(ctxb(), "o1"); err != nil {
			t.Fatal(err)
		}
		if sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "gone" })); err != nil || sel.WorkerID != 1 {
			t.Fatalf("reuse of the cancelled id: %+v %v", sel, err)
		}
	})
	t.Run("a caller cancelled while its dequeued request books gets the booking freed", func(t *testing.T) {
		ctx, cancel := context.WithCancel(ctxb())
		armed := make(chan struct{})
		cancelling := policytest.Picker{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) {
			select {
			case <-armed:
				cancel()
			default:
			}
			return 0, nil
		}}
		s := busyPair(t, withPolicy(nil, nil, cancelling))
		ch := reserveAsync(s, ctx, "late")
		waitPending(t, s, 1)
		close(armed)
		if err := s.Free(ctxb(), "o2"); err != nil {
			t.Fatal(err)
		}
		if o := recv(t, ch); !errors.Is(o.err, context.Canceled) {
			t.Fatalf("err = %v", o.err)
		}
		if l := loadOf(t, s, "model", "default", 2, 0); l.ActiveRequests != 0 || l.PotentialPrefillTokens != 0 {
			t.Fatalf("booking leaked: %+v", l)
		}
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "late" })); err != nil {
			t.Fatalf("claim leaked: %v", err)
		}
	})
	t.Run("shutdown fails queued selections with 503 and releases their claims", func(t *testing.T) {
		s := busyPair(t)
		ch := reserveAsync(s, ctxb(), "sd")
		peek := async(func() (picker.Selection, error) { return s.Select(ctxb(), tokenReq(tokens(4))) })
		waitPending(t, s, 2)
		s.BeginShutdown()
		for _, c := range []<-chan outcome{ch, peek} {
			o := recv(t, c)
			wantKind(t, o.err, picker.KindNotReady, "selection service is shutting down")
		}
		waitPending(t, s, 0)
		if err := s.Free(ctxb(), "sd"); err == nil {
			t.Fatal("a shut-down request was booked")
		}
	})
	t.Run("loads report the backlog in requests and raw ISL tokens", func(t *testing.T) {
		s := busyPair(t)
		a := reserveAsync(s, ctxb(), "a")
		waitPending(t, s, 1)
		b := async(func() (picker.Selection, error) {
			return s.SelectAndReserve(ctxb(), tokenReq(tokens(10), func(r *picker.SelectRequest) { r.SelectionID = "b" }))
		})
		waitPending(t, s, 2)
		if pl := s.Loads("model", "default")[0]; pl.PendingCount != 2 || pl.PendingISLTokens != 14 {
			t.Fatalf("pending %d / %d tokens", pl.PendingCount, pl.PendingISLTokens)
		}
		s.BeginShutdown()
		recv(t, a)
		recv(t, b)
	})
}

func TestWorkersNeedMaxNumBatchedTokensWhileProfilesQueue(t *testing.T) {
	s := newService(t, withProfiles(t, queue.ProfileSpec{DefaultFamily: "f", Buckets: []queue.Bucket{{Name: "all"}},
		Classes: []queue.Class{{Name: "c", Family: "f", Bucket: "all", Quantum: 1}}}))
	st := mustUpsert(t, s, worker(1))
	if st.Lifecycle != picker.LifecycleIncomplete || len(st.NotSchedulableReasons) != 1 ||
		st.NotSchedulableReasons[0] != "max_num_batched_tokens is required while queueing is enabled" {
		t.Fatalf("%+v", st)
	}
	if st := mustUpsert(t, s, worker(1, batched(8))); st.Lifecycle != picker.LifecycleSchedulable {
		t.Fatalf("%+v", st)
	}
}

func TestPolicyClassBusyRules(t *testing.T) {
	spec := func(c queue.Class) queue.ProfileSpec {
		c.Name, c.Family, c.Bucket, c.Quantum = "c", "f", "all", 1
		return queue.ProfileSpec{DefaultFamily: "f", Buckets: []queue.Bucket{{Name: "all"}}, Classes: []queue.Class{c}}
	}
	t.Run("an absolute threshold busies a rank above it", func(t *testing.T) {
		s := newService(t, withProfiles(t, spec(queue.Class{BusyThreshold: f64(100)})))
		mustUpsert(t, s, worker(1, batched(1<<20)))
		occupy(t, s, "o", 1, 100)
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "at" })); err != nil {
			t.Fatalf("at the threshold: %v", err)
		}
		ch := reserveAsync(s, ctxb(), "above") // 104 tokens booked now
		waitPending(t, s, 1)
		if err := s.Free(ctxb(), "at"); err != nil {
			t.Fatal(err)
		}
		if o := recv(t, ch); o.err != nil {
			t.Fatal(o.err)
		}
	})
	t.Run("a class without thresholds busies at 16 times max_num_batched_tokens", func(t *testing.T) {
		s := newService(t, withProfiles(t, spec(queue.Class{})))
		mustUpsert(t, s, worker(1, batched(4)))
		occupy(t, s, "o", 1, 64)
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4))); err != nil {
			t.Fatalf("at 16 × 4: %v", err)
		}
		ch := reserveAsync(s, ctxb(), "above")
		waitPending(t, s, 1)
		s.BeginShutdown()
		recv(t, ch)
	})
	t.Run("busy_worker_ratio queues once that share of ranks is busy", func(t *testing.T) {
		s := newService(t, withProfiles(t, spec(queue.Class{BusyThreshold: f64(0), BusyWorkerRatio: f64(0.5)})))
		mustUpsert(t, s, worker(1, batched(1024)))
		mustUpsert(t, s, worker(2, batched(1024)))
		occupy(t, s, "o1", 1, 4)
		ch := reserveAsync(s, ctxb(), "half") // worker 2 is idle, but half the pool is busy
		waitPending(t, s, 1)
		if err := s.Free(ctxb(), "o1"); err != nil {
			t.Fatal(err)
		}
		if o := recv(t, ch); o.err != nil {
			t.Fatal(o.err)
		}
	})
}

func TestPolicyClassResolution(t *testing.T) {
	ev := pickertest.NewEventSource()
	s := newService(t, withEvents(ev), withProfiles(t, queue.ProfileSpec{
		DefaultFamily: "batch",
		Buckets:       []queue.Bucket{{Name: "warm", MinTokens: 0}, {Name: "cold", MinTokens: 8}},
		Classes: []queue.Class{
			{Name: "i-warm", Family: "interactive", Bucket: "warm", Quantum: 1, BusyThreshold: f64(0)},
			{Name: "i-cold", Family: "interactive", Bucket: "cold", Quantum: 1, BusyThreshold: f64(0)},
			{Name: "b-warm", Family: "batch", Bucket: "warm", Quantum: 1, BusyThreshold: f64(0)},
			{Name: "b-cold", Family: "batch", Bucket: "cold", Quantum: 1, BusyThreshold: f64(0)},
			{Name: "latency", Quantum: 1, BusyThreshold: f64(0)},
		},
	}))
	mustUpsert(t, s, worker(1, batched(1024), func(r *picker.WorkerRecord) { r.KVEventsEndpoint = "tcp://w1:1" }))
	// Worker 1 caches the first two blocks of tokens 1..12: uncached 4 (warm) for that prompt.
	l := kvindex.BlockHashes(tokens(12), 4, kvindex.BaseSeed)
	ev.Store(t, 1, 0, kvindex.TierDevice, nil, l[0], l[1])
	occupy(t, s, "o", 1, 4)
	cases := []struct {
		header string
		prompt []uint32
		want   string
	}{
		{"interactive", tokens(12), "i-warm"},
		{"interactive", []uint32{9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9}, "i-cold"},
		{"", tokens(12), "b-warm"},
		{"unknown-family", []uint32{7, 7, 7, 7, 7, 7, 7, 7}, "b-cold"},
		{"i-cold", tokens(12), "b-warm"},
		{"latency", tokens(12), "latency"},
	}
	var chans []<-chan outcome
	for i, tc := range cases {
		req := tokenReq(tc.prompt, func(r *picker.SelectRequest) { r.PolicyClass = tc.header; r.SelectionID = itoa(uint64(i)) })
		chans = append(chans, async(func() (picker.Selection, error) { return s.SelectAndReserve(ctxb(), req) }))
		waitPending(t, s, uint64(i+1))
	}
	got := map[string]string{}
	for _, q := range s.QueuedRequests(picker.PartitionKey{ModelName: "model", RoutingGroup: "default"}) {
		got[q.SelectionID] = q.PolicyClass
	}
	for i, tc := range cases {
		if got[itoa(uint64(i))] != tc.want {
			t.Errorf("header %q prompt %v → class %q, want %q", tc.header, tc.prompt, got[itoa(uint64(i))], tc.want)
		}
	}
	s.BeginShutdown()
	for _, c := range chans {
		recv(t, c)
	}
}

func TestModelProfilesReplaceTheRootProfile(t *testing.T) {
	one := func(class string, th float64) *queue.Profile {
		p, err := queue.NewProfile(queue.ProfileSpec{DefaultFamily: "f", Buckets: []queue.Bucket{{Name: "all"}},
			Classes: []queue.Class{{Name: class, Family: "f", Bucket: "all", Quantum: 1, BusyThreshold: f64(th)}}})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	s := newService(t, withThreshold(0), func(c *picker.Config) {
		c.PolicyProfiles = &queue.Profiles{Root: one("root-class", 0), Models: map[string]*queue.Profile{"llama": one("llama-class", 0)}}
	})
	var chans []<-chan outcome
	ids := map[string]uint64{"model": 1, "llama": 2}
	for _, model := range []string{"model", "llama"} {
		id := ids[model]
		mustUpsert(t, s, worker(id, batched(1024), func(r *picker.WorkerRecord) { r.ModelName = model }))
		if _, err := s.Reserve(ctxb(), picker.ReservationRequest{ModelName: model, SelectionID: "o-" + model, WorkerID: u64(id),
			Prompt: picker.Prompt{HashForm: true, SequenceHashes: []uint64{}, ISLTokens: 4, ISLTokensSet: true}, EffectivePrefillTokens: u64(4)}); err != nil {
			t.Fatal(err)
		}
		req := tokenReq(tokens(4), func(r *picker.SelectRequest) { r.ModelName = model; r.SelectionID = "q-" + model })
		chans = append(chans, async(func() (picker.Selection, error) { return s.SelectAndReserve(ctxb(), req) }))
	}
	for model, want := range map[string]string{"model": "root-class", "llama": "llama-class"} {
		key := picker.PartitionKey{ModelName: model, RoutingGroup: "default"}
		deadline := time.Now().Add(5 * time.Second)
		for len(s.QueuedRequests(key)) == 0 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if q := s.QueuedRequests(key); len(q) != 1 || q[0].PolicyClass != want {
			t.Fatalf("%s queue = %+v, want one request in %s", model, q, want)
		}
	}
	s.BeginShutdown()
	for _, c := range chans {
		recv(t, c)
	}
}
