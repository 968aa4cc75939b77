package picker_test

import (
	"slices"
	"testing"

	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
)

func TestCandidacy(t *testing.T) {
	t.Run("a withheld worker is never selected, load-only picked or offered as a fallback", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		mustUpsert(t, s, worker(2))
		s.SetCandidate(2, false)
		if s.IsCandidate(2) || !s.IsCandidate(1) || !slices.Equal(s.WithheldWorkers(), []uint64{2}) {
			t.Fatalf("candidacy: 1=%t 2=%t withheld=%v", s.IsCandidate(1), s.IsCandidate(2), s.WithheldWorkers())
		}
		for i := 0; i < 20; i++ {
			sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(8), func(r *picker.SelectRequest) {
				r.SelectionID = "r" + itoa(uint64(i))
				r.Fallbacks = 3
			}))
			if err != nil || sel.WorkerID != 1 || len(sel.Fallbacks) != 0 {
				t.Fatalf("select %d: %+v %v", i, sel, err)
			}
			lo, err := s.LoadOnlyPick(ctxb(), "model", nil, false)
			if err != nil || lo.WorkerID != 1 {
				t.Fatalf("load-only %d: %+v %v", i, lo, err)
			}
		}
		// The worker stays registered and schedulable: only candidacy changed.
		if st, ok := s.Worker(2); !ok || st.Lifecycle != picker.LifecycleSchedulable {
			t.Fatalf("withheld worker left the catalog: %+v %t", st, ok)
		}
	})
	t.Run("a pin on a withheld worker finds no endpoint and a pool of withheld workers is a 503", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		s.SetCandidate(1, false)
		pin := picker.WorkerRank{WorkerID: 1}
		_, err := s.Select(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.PinnedWorker = &pin }))
		wantKind(t, err, picker.KindNotReady, "no endpoints available to route work")
		_, err = s.SelectAndReserve(ctxb(), tokenReq(tokens(4)))
		wantKind(t, err, picker.KindNotReady, "no endpoints available to route work")
		_, err = s.LoadOnlyPick(ctxb(), "model", nil, false)
		wantKind(t, err, picker.KindNotReady, "no endpoints available to route work")
	})
	t.Run("withholding keeps the KV listener and restoring makes the worker pickable again", func(t *testing.T) {
		ev := pickertest.NewEventSource()
		s := newService(t, withEvents(ev))
		withEndpoint := func(r *picker.WorkerRecord) { r.KVEventsEndpoint = "tcp://w" + itoa(r.WorkerID) + ":5557" }
		mustUpsert(t, s, worker(1, withEndpoint))
		mustUpsert(t, s, worker(2, withEndpoint))
		idx := ev.Index(2)
		s.SetCandidate(2, false)
		s.SetCandidate(2, false) // idempotent
		if _, attached := ev.Attached(2); !attached || ev.Index(2) != idx {
			t.Fatal("withholding detached the worker's KV listener or changed its index")
		}
		s.SetCandidate(2, true)
		seen := map[uint64]bool{}
		for i := 0; i < 40 && len(seen) < 2; i++ {
			sel, err := s.LoadOnlyPick(ctxb(), "model", nil, false)
			if err != nil {
				t.Fatal(err)
			}
			seen[sel.WorkerID] = true
		}
		if !seen[2] {
			t.Fatalf("worker 2 never picked after candidacy was restored: %v", seen)
		}
	})
	t.Run("a mark set before registration applies from the first pick, and deletion clears it", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		s.SetCandidate(7, false)
		mustUpsert(t, s, worker(7))
		for i := 0; i < 10; i++ {
			if lo, err := s.LoadOnlyPick(ctxb(), "model", nil, false); err != nil || lo.WorkerID != 1 {
				t.Fatalf("%+v %v", lo, err)
			}
		}
		if _, err := s.DeleteWorker(ctxb(), 7); err != nil {
			t.Fatal(err)
		}
		if !s.IsCandidate(7) {
			t.Fatal("DeleteWorker kept the withheld mark")
		}
	})
}
