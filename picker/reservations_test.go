package picker_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/picker"
)

func TestReservationLifecycle(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(1))
	sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(8), func(r *picker.SelectRequest) { r.SelectionID = "r1" }))
	if err != nil {
		t.Fatal(err)
	}
	want := picker.PotentialLoad{WorkerID: 1, PotentialPrefillTokens: 8, PotentialDecodeBlocks: 2, ActiveRequests: 1}
	if got := loadOf(t, s, "model", "default", 1, 0); got != want {
		t.Fatalf("after booking %+v, want %+v", got, want)
	}
	t.Run("prefill_complete removes the prefill and is idempotent", func(t *testing.T) {
		for i := 0; i < 2; i++ {
			if err := s.PrefillComplete(ctxb(), sel.SelectionID); err != nil {
				t.Fatal(err)
			}
		}
		want.PotentialPrefillTokens = 0
		if got := loadOf(t, s, "model", "default", 1, 0); got != want {
			t.Errorf("after prefill_complete %+v, want %+v", got, want)
		}
	})
	t.Run("output_block adds one decode block", func(t *testing.T) {
		if err := s.OutputBlock(ctxb(), "r1", nil); err != nil {
			t.Fatal(err)
		}
		want.PotentialDecodeBlocks = 3
		if got := loadOf(t, s, "model", "default", 1, 0); got != want {
			t.Errorf("after output_block %+v, want %+v", got, want)
		}
	})
	t.Run("output_block validates decay_fraction before the lookup", func(t *testing.T) {
		wantKind(t, s.OutputBlock(ctxb(), "nope", f64(1.5)), picker.KindBadRequest, "decay_fraction must be between 0.0 and 1.0")
		wantKind(t, s.OutputBlock(ctxb(), "nope", f64(0.5)), picker.KindNotFound, "reservation nope not found")
	})
	t.Run("free returns loads to zero, exactly once", func(t *testing.T) {
		if err := s.Free(ctxb(), "r1"); err != nil {
			t.Fatal(err)
		}
		if got := loadOf(t, s, "model", "default", 1, 0); got != (picker.PotentialLoad{WorkerID: 1}) {
			t.Errorf("after free %+v", got)
		}
		wantKind(t, s.Free(ctxb(), "r1"), picker.KindNotFound, "reservation r1 not found")
		wantKind(t, s.PrefillComplete(ctxb(), "r1"), picker.KindNotFound, "reservation r1 not found")
	})
	t.Run("lifecycle calls keep working during shutdown", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(8)))
		if err != nil {
			t.Fatal(err)
		}
		s.BeginShutdown()
		if err := s.PrefillComplete(ctxb(), sel.SelectionID); err != nil {
			t.Error(err)
		}
		if err := s.Free(ctxb(), sel.SelectionID); err != nil {
			t.Error(err)
		}
	})
}

func TestExpireStale(t *testing.T) {
	now := time0
	s := newService(t, func(c *picker.Config) { c.Now = func() time.Time { return now } })
	mustUpsert(t, s, worker(1))
	if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(8), func(r *picker.SelectRequest) { r.SelectionID = "old" })); err != nil {
		t.Fatal(err)
	}
	now = now.Add(200 * time.Second)
	if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(8), func(r *picker.SelectRequest) { r.SelectionID = "young" })); err != nil {
		t.Fatal(err)
	}
	if n := s.ExpireStale(time0.Add(300 * time.Second)); n != 0 {
		t.Fatalf("expired %d at exactly the limit, want 0", n)
	}
	if n := s.ExpireStale(time0.Add(301 * time.Second)); n != 1 {
		t.Fatalf("expired %d, want the old booking only", n)
	}
	wantKind(t, s.Free(ctxb(), "old"), picker.KindNotFound, "")
	if err := s.Free(ctxb(), "young"); err != nil {
		t.Errorf("the young booking was expired: %v", err)
	}
}

func TestLoadsShape(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(2, func(r *picker.WorkerRecord) { r.DataParallelStartRank = u32(2); r.DataParallelSize = u32(2) }))
	mustUpsert(t, s, worker(1))
	mustUpsert(t, s, worker(3, func(r *picker.WorkerRecord) { r.ModelName = "a" }))
	mustUpsert(t, s, worker(4, func(r *picker.WorkerRecord) { r.Endpoint = "" }))
	got := s.Loads("", "")
	want := []picker.PartitionLoads{
		{ModelName: "a", RoutingGroup: "default", Loads: []picker.PotentialLoad{{WorkerID: 3}}},
		{ModelName: "model", RoutingGroup: "default", Loads: []picker.PotentialLoad{{WorkerID: 1}, {WorkerID: 2, DPRank: 2}, {WorkerID: 2, DPRank: 3}}},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("loads (-want +got):\n%s", diff)
	}
	if got := s.Loads("a", ""); len(got) != 1 || got[0].ModelName != "a" {
		t.Errorf("filtered loads %+v", got)
	}
	if got := s.Loads("none", ""); got == nil || len(got) != 0 {
		t.Errorf("unknown partition loads %#v, want empty", got)
	}
}

func TestLoadOnlyPick(t *testing.T) {
	setup := func(t *testing.T) *picker.Service {
		s := newService(t)
		mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.DataParallelSize = u32(2) }))
		mustUpsert(t, s, worker(2))
		mustUpsert(t, s, worker(3, func(r *picker.WorkerRecord) { r.ModelName = "other" }))
		for _, pin := range []picker.WorkerRank{{WorkerID: 1, DPRank: 0}, {WorkerID: 1, DPRank: 1}, {WorkerID: 2}, {WorkerID: 2}} {
			pin := pin
			if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.PinnedWorker = &pin })); err != nil {
				t.Fatal(err)
			}
		}
		return s
	}
	t.Run("picks the rank with the fewest active requests and books nothing", func(t *testing.T) {
		s := setup(t)
		mustUpsert(t, s, worker(5))
		sel, err := s.LoadOnlyPick(ctxb(), "model", nil, false)
		if err != nil || sel.WorkerID != 5 || sel.Endpoint != "http://worker-5:8000" || sel.ModelName != "model" || sel.Booked {
			t.Fatalf("%+v %v", sel, err)
		}
		if l := loadOf(t, s, "model", "default", 5, 0); l.ActiveRequests != 0 {
			t.Errorf("load-only pick booked: %+v", l)
		}
	})
	t.Run("breaks ties uniformly at random", func(t *testing.T) {
		s := setup(t)
		seen := map[picker.WorkerRank]int{}
		for i := 0; i < 400; i++ {
			sel, err := s.LoadOnlyPick(ctxb(), "model", nil, false)
			if err != nil {
				t.Fatal(err)
			}
			seen[picker.WorkerRank{WorkerID: sel.WorkerID, DPRank: sel.DPRank}]++
		}
		// Worker 1's two ranks hold one request each, worker 2 holds two.
		if len(seen) != 2 || seen[picker.WorkerRank{WorkerID: 1, DPRank: 0}] < 150 || seen[picker.WorkerRank{WorkerID: 1, DPRank: 1}] < 150 {
			t.Errorf("tie distribution %v", seen)
		}
	})
	t.Run("honours the allowed workers", func(t *testing.T) {
		s := setup(t)
		sel, err := s.LoadOnlyPick(ctxb(), "model", []uint64{2}, true)
		if err != nil || sel.WorkerID != 2 {
			t.Fatalf("%+v %v", sel, err)
		}
		_, err = s.LoadOnlyPick(ctxb(), "model", nil, true)
		wantKind(t, err, picker.KindNotReady, "no endpoints available to route work")
	})
	t.Run("an empty model considers every partition", func(t *testing.T) {
		s := setup(t)
		sel, err := s.LoadOnlyPick(ctxb(), "", nil, false)
		if err != nil || sel.WorkerID != 3 || sel.ModelName != "other" {
			t.Fatalf("%+v %v", sel, err)
		}
	})
	t.Run("an unknown model has no endpoint", func(t *testing.T) {
		s := setup(t)
		_, err := s.LoadOnlyPick(ctxb(), "nope", nil, false)
		wantKind(t, err, picker.KindNotReady, "no endpoints available to route work")
	})
	t.Run("an empty catalog is not ready", func(t *testing.T) {
		s := newService(t)
		_, err := s.LoadOnlyPick(ctxb(), "", nil, false)
		wantKind(t, err, picker.KindNotReady, "no schedulable workers are available")
	})
}

// TestConcurrentSelectAndReserveNeverDoubleCounts runs N concurrent bookings of one prompt on two
// workers. Selection and booking are serialized per partition, so each booking sees every earlier
// one: the loads split evenly. Were two calls to observe the same pre-booking load, both would
// pick the same worker and the split would drift.
func TestConcurrentSelectAndReserveNeverDoubleCounts(t *testing.T) {
	s := newService(t, func(c *picker.Config) { c.Router.AssumeKVReuse = false })
	mustUpsert(t, s, worker(1))
	mustUpsert(t, s, worker(2))
	const n = 200
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			_, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(64), func(r *picker.SelectRequest) {
				r.SelectionID = fmt.Sprintf("c%d", i)
				r.Override = &picker.RouterConfigOverride{TrackPrefillTokens: boolp(false)}
			}))
			errs <- err
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	l1, l2 := loadOf(t, s, "model", "default", 1, 0), loadOf(t, s, "model", "default", 2, 0)
	if l1.ActiveRequests+l2.ActiveRequests != n {
		t.Fatalf("active requests %d + %d, want %d", l1.ActiveRequests, l2.ActiveRequests, n)
	}
	// Random tracking hashes make every booking add 16 distinct blocks; the cost is the decode
	// blocks, so the serialized picks alternate and the split is exact.
	if l1.ActiveRequests != n/2 || l1.PotentialDecodeBlocks != 16*n/2 || l2.PotentialDecodeBlocks != 16*n/2 {
		t.Errorf("uneven split: %+v / %+v", l1, l2)
	}
	for i := 0; i < n; i++ {
		if err := s.Free(ctxb(), fmt.Sprintf("c%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	for _, w := range []uint64{1, 2} {
		if l := loadOf(t, s, "model", "default", w, 0); l != (picker.PotentialLoad{WorkerID: w}) {
			t.Errorf("worker %d after freeing everything: %+v", w, l)
		}
	}
}

// TestDeleteDuringSelectionLeavesNoBooking deletes workers while bookings race onto them: after
// the deletes, no live booking may remain on a deleted worker (acceptance 41).
func TestDeleteDuringSelectionLeavesNoBooking(t *testing.T) {
	s := newService(t)
	for id := uint64(1); id <= 4; id++ {
		mustUpsert(t, s, worker(id))
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var booked []picker.Selection
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(16)))
				if err == nil {
					mu.Lock()
					booked = append(booked, sel)
					mu.Unlock()
				}
			}
		}()
	}
	for id := uint64(1); id <= 3; id++ {
		if _, err := s.DeleteWorker(ctxb(), id); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	for _, sel := range booked {
		err := s.Free(ctxb(), sel.SelectionID)
		if sel.WorkerID != 4 && err == nil {
			t.Errorf("booking %s on deleted worker %d was still live", sel.SelectionID, sel.WorkerID)
		}
		if sel.WorkerID == 4 && err != nil {
			t.Errorf("booking on worker 4: %v", err)
		}
	}
}
