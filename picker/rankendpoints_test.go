package picker_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/picker"
)

// rankWorker is a two-rank worker whose ranks are served on their own ports (as discovery
// registers an InferencePool pod with two target ports).
func rankWorker(id uint64) picker.WorkerRecord {
	return worker(id, func(r *picker.WorkerRecord) {
		r.DataParallelStartRank, r.DataParallelSize = u32(4), u32(2)
		r.RankEndpoints = []string{fmt.Sprintf("http://10.0.0.%d:8000", id), fmt.Sprintf("http://10.0.0.%d:8001", id)}
	})
}

func TestRankEndpointsAreWhatEveryPickNames(t *testing.T) {
	s := newService(t)
	for id := uint64(1); id <= 2; id++ {
		if st, err := s.UpsertWorker(ctxb(), rankWorker(id), picker.SourceDiscovery); err != nil || st.Lifecycle != picker.LifecycleSchedulable {
			t.Fatalf("upsert: %+v %v", st, err)
		}
	}
	want := func(id uint64, rank uint32) string { return fmt.Sprintf("http://10.0.0.%d:%d", id, 8000+rank-4) }
	seen := map[string]bool{}
	for i := 0; i < 60; i++ {
		prompt := []uint32{uint32(1000 + 8*i), uint32(1001 + 8*i), uint32(1002 + 8*i), uint32(1003 + 8*i), 5, 6, 7, 8}
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(prompt, func(r *picker.SelectRequest) { r.Fallbacks = 1 }))
		if err != nil {
			t.Fatal(err)
		}
		if sel.Endpoint != want(sel.WorkerID, sel.DPRank) {
			t.Fatalf("worker %d rank %d at %q", sel.WorkerID, sel.DPRank, sel.Endpoint)
		}
		for _, f := range sel.Fallbacks {
			if f.Endpoint != want(f.WorkerID, f.DPRank) {
				t.Fatalf("fallback worker %d rank %d at %q", f.WorkerID, f.DPRank, f.Endpoint)
			}
		}
		seen[sel.Endpoint] = true // bookings stay live, so the load spreads the picks
	}
	if len(seen) != 4 {
		t.Fatalf("picked endpoints %v, want all four ranks", seen)
	}
	if sel, err := s.LoadOnlyPick(ctxb(), "model", nil, false); err != nil || sel.Endpoint != want(sel.WorkerID, sel.DPRank) {
		t.Fatalf("load-only pick %+v %v", sel, err)
	}
	res, err := s.Reserve(ctxb(), picker.ReservationRequest{ModelName: "model", SelectionID: "x", WorkerID: u64(2), DPRank: u32(5),
		Prompt: picker.Prompt{TokenIDs: tokens(8)}})
	if err != nil || res.Endpoint != "http://10.0.0.2:8001" {
		t.Fatalf("explicit reservation %+v %v", res, err)
	}
	if st, _ := s.Worker(2); fmt.Sprint(st.DPRankEndpoints) != "map[4:http://10.0.0.2:8000 5:http://10.0.0.2:8001]" {
		t.Fatalf("dp_rank_endpoints %v", st.DPRankEndpoints)
	}
}

func TestRankEndpointsFollowTheRecord(t *testing.T) {
	rankOf5 := func(s *picker.Service) string { st, _ := s.Worker(1); return st.RankEndpoint(5) }
	t.Run("a PATCH of the endpoint drops them; other PATCHes keep them", func(t *testing.T) {
		s := newService(t)
		if _, err := s.UpsertWorker(ctxb(), rankWorker(1), picker.SourceDiscovery); err != nil {
			t.Fatal(err)
		}
		if _, err := s.PatchWorker(ctxb(), 1, picker.WorkerPatch{Taints: []string{"gpu"}, Endpoint: strp("http://worker-1:8000")}); err != nil {
			t.Fatal(err)
		}
		if got := rankOf5(s); got != "http://10.0.0.1:8001" {
			t.Fatalf("after a PATCH keeping the endpoint, rank 5 at %q", got)
		}
		st, err := s.PatchWorker(ctxb(), 1, picker.WorkerPatch{Endpoint: strp("http://elsewhere:9000")})
		if err != nil || st.DPRankEndpoints != nil || rankOf5(s) != "http://elsewhere:9000" {
			t.Fatalf("after moving the endpoint: %+v %v, rank 5 at %q", st.DPRankEndpoints, err, rankOf5(s))
		}
		res, err := s.Reserve(ctxb(), picker.ReservationRequest{ModelName: "model", SelectionID: "y", WorkerID: u64(1), DPRank: u32(5),
			Prompt: picker.Prompt{TokenIDs: tokens(8)}})
		if err != nil || res.Endpoint != "http://elsewhere:9000" {
			t.Fatalf("reservation after the move %+v %v", res, err)
		}
	})
	t.Run("a PATCH of the rank range drops them", func(t *testing.T) {
		s := newService(t)
		if _, err := s.UpsertWorker(ctxb(), rankWorker(1), picker.SourceDiscovery); err != nil {
			t.Fatal(err)
		}
		if _, err := s.PatchWorker(ctxb(), 1, picker.WorkerPatch{DataParallelSize: u32(3)}); err != nil {
			t.Fatal(err)
		}
		if got := rankOf5(s); got != "http://worker-1:8000" {
			t.Fatalf("rank 5 at %q", got)
		}
	})
	t.Run("a whole record without them replaces them", func(t *testing.T) {
		s := newService(t)
		if _, err := s.UpsertWorker(ctxb(), rankWorker(1), picker.SourceDiscovery); err != nil {
			t.Fatal(err)
		}
		rec := rankWorker(1)
		rec.RankEndpoints = nil
		if _, err := s.UpsertWorker(ctxb(), rec, picker.SourceAPI); err != nil {
			t.Fatal(err)
		}
		if got := rankOf5(s); got != "http://worker-1:8000" {
			t.Fatalf("rank 5 at %q", got)
		}
	})
	t.Run("a list that does not cover the ranks leaves the worker incomplete", func(t *testing.T) {
		s := newService(t)
		rec := rankWorker(1)
		rec.RankEndpoints = rec.RankEndpoints[:1]
		st, err := s.UpsertWorker(ctxb(), rec, picker.SourceDiscovery)
		if err != nil || st.Lifecycle != picker.LifecycleIncomplete || !strings.Contains(strings.Join(st.NotSchedulableReasons, ";"), "rank endpoints: 1 given for data_parallel_size 2") {
			t.Fatalf("%+v %v", st, err)
		}
	})
}
