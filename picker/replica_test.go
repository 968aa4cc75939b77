package picker_test

import (
	"math"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/picker"
)

// published is one PublishSlot call.
type published struct {
	Key       picker.PartitionKey
	BlockSize uint32
	Ev        ledger.SlotEvent
}

// recorder is a picker.SlotPublisher that keeps every event and, when to is set, applies it to
// another service as the replica transport would (with origin as the sender's router_id).
type recorder struct {
	mu     sync.Mutex
	events []published
	to     *picker.Service
	origin uint64
	last   picker.RemoteOutcome
}

func (r *recorder) PublishSlot(key picker.PartitionKey, bs uint32, ev ledger.SlotEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, published{key, bs, ev})
	if r.to != nil {
		ev.Origin = r.origin
		r.last = r.to.ApplyRemoteSlot(key, bs, ev)
	}
}

func (r *recorder) take() []published {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.events
	r.events = nil
	return out
}

func withSlotPublisher(p picker.SlotPublisher) func(*picker.Config) {
	return func(c *picker.Config) { c.SlotPublisher = p }
}

var modelKey = picker.PartitionKey{ModelName: "model", RoutingGroup: "default"}

func TestSlotEventsArePublished(t *testing.T) {
	rec := &recorder{}
	now := time0
	s := newService(t, withSlotPublisher(rec), func(c *picker.Config) { c.Now = func() time.Time { return now } })
	mustUpsert(t, s, worker(1))
	sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(9), func(r *picker.SelectRequest) {
		r.SelectionID = "a"
		r.ExpectedOutputTokens = u32(50)
		r.Prompt.LoraName = "adapter"
	}))
	if err != nil {
		t.Fatal(err)
	}
	got := rec.take()
	want := []published{{modelKey, 4, ledger.SlotEvent{
		Kind: ledger.SlotAdmission, ID: "a", Candidate: ledger.Candidate{WorkerID: 1}, LoraName: strp("adapter"),
		SequenceHashes: sel.SequenceHashes, TrackPrefillTokens: true, PrefillTokens: u64(9), ExpectedOutputTokens: u32(50),
	}}}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("admission (-want +got):\n%s", d)
	}
	if len(sel.SequenceHashes) != 2 {
		t.Fatalf("%d sequence hashes, want 2 full blocks of 4 tokens", len(sel.SequenceHashes))
	}

	t.Run("output_block is local only", func(t *testing.T) {
		if err := s.OutputBlock(ctxb(), "a", nil); err != nil {
			t.Fatal(err)
		}
		if got := rec.take(); len(got) != 0 {
			t.Fatalf("output_block published %+v", got)
		}
	})
	t.Run("prefill_complete publishes, and a repeat re-publishes", func(t *testing.T) {
		for range 2 {
			if err := s.PrefillComplete(ctxb(), "a"); err != nil {
				t.Fatal(err)
			}
		}
		want := published{modelKey, 4, ledger.SlotEvent{Kind: ledger.SlotPrefillComplete, ID: "a", Candidate: ledger.Candidate{WorkerID: 1}}}
		if d := cmp.Diff([]published{want, want}, rec.take()); d != "" {
			t.Fatalf("(-want +got):\n%s", d)
		}
	})
	t.Run("free publishes", func(t *testing.T) {
		if err := s.Free(ctxb(), "a"); err != nil {
			t.Fatal(err)
		}
		want := []published{{modelKey, 4, ledger.SlotEvent{Kind: ledger.SlotFree, ID: "a", Candidate: ledger.Candidate{WorkerID: 1}}}}
		if d := cmp.Diff(want, rec.take()); d != "" {
			t.Fatalf("(-want +got):\n%s", d)
		}
	})
	t.Run("an explicit reservation and a cached replay publish their admissions", func(t *testing.T) {
		_, err := s.Reserve(ctxb(), picker.ReservationRequest{ModelName: "model", SelectionID: "x", WorkerID: u64(1),
			Prompt: picker.Prompt{TokenIDs: tokens(4)}, EffectivePrefillTokens: u64(3)})
		if err != nil {
			t.Fatal(err)
		}
		// Another prompt than x's, so no cached prefix lowers its prefill.
		if _, err := s.Select(ctxb(), tokenReq([]uint32{90, 91, 92, 93}, func(r *picker.SelectRequest) { r.SelectionID = "y" })); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Reserve(ctxb(), picker.ReservationRequest{ModelName: "model", SelectionID: "y"}); err != nil {
			t.Fatal(err)
		}
		got := rec.take()
		if len(got) != 2 || got[0].Ev.ID != "x" || *got[0].Ev.PrefillTokens != 3 || got[1].Ev.ID != "y" ||
			got[1].Ev.Kind != ledger.SlotAdmission || *got[1].Ev.PrefillTokens != 4 || len(got[1].Ev.SequenceHashes) != 1 {
			t.Fatalf("published %+v", got)
		}
	})
	t.Run("expiry and worker removal publish nothing", func(t *testing.T) {
		now = now.Add(time.Hour)
		if n := s.ExpireStale(now); n != 2 {
			t.Fatalf("expired %d, want 2", n)
		}
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "z" })); err != nil {
			t.Fatal(err)
		}
		rec.take()
		if _, err := s.DeleteWorker(ctxb(), 1); err != nil {
			t.Fatal(err)
		}
		if got := rec.take(); len(got) != 0 {
			t.Fatalf("published %+v", got)
		}
	})
}

// replicaPair returns services a and b whose slot events are applied to each other in process.
func replicaPair(t *testing.T, mods ...func(*picker.Config)) (a, b *picker.Service, ab, ba *recorder) {
	ab, ba = &recorder{origin: 11}, &recorder{origin: 22}
	a = newService(t, append([]func(*picker.Config){withSlotPublisher(ab)}, mods...)...)
	b = newService(t, append([]func(*picker.Config){withSlotPublisher(ba)}, mods...)...)
	ab.to, ba.to = b, a
	for _, s := range []*picker.Service{a, b} {
		mustUpsert(t, s, worker(1))
		mustUpsert(t, s, worker(2))
	}
	return a, b, ab, ba
}

// triple is (active requests, active blocks, prefill tokens) of a rank (acceptance 25).
type triple struct{ Requests, Blocks, Prefill uint64 }

func tripleOf(t *testing.T, s *picker.Service, w uint64) triple {
	l := loadOf(t, s, "model", "default", w, 0)
	return triple{l.ActiveRequests, l.PotentialDecodeBlocks, l.PotentialPrefillTokens}
}

func TestMirroredBookingLifecycle(t *testing.T) {
	a, b, _, _ := replicaPair(t)
	sel, err := a.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "s1" }))
	if err != nil {
		t.Fatal(err)
	}
	w := sel.WorkerID
	if got := tripleOf(t, b, w); got != (triple{1, 1, 4}) {
		t.Fatalf("peer after admission = %+v, want (1,1,4)", got)
	}
	bk, ok := b.Booking("s1")
	if !ok || bk.Origin != 11 {
		t.Fatalf("mirror = %+v, %v; want origin 11", bk, ok)
	}
	if err := a.PrefillComplete(ctxb(), "s1"); err != nil {
		t.Fatal(err)
	}
	if got := tripleOf(t, b, w); got != (triple{1, 1, 0}) {
		t.Fatalf("peer after prefill_complete = %+v, want (1,1,0)", got)
	}
	// B frees A's booking: the mirror goes on B and the Free reaches A (§10.2, §15.4).
	if err := b.Free(ctxb(), "s1"); err != nil {
		t.Fatal(err)
	}
	for name, s := range map[string]*picker.Service{"a": a, "b": b} {
		if got := tripleOf(t, s, w); got != (triple{}) {
			t.Fatalf("%s after the peer's free = %+v, want (0,0,0)", name, got)
		}
	}
	if err := a.Free(ctxb(), "s1"); err == nil {
		t.Fatal("a's booking is still live after b freed it")
	}
}

func TestMirroredPrefillCompleteOnThePeer(t *testing.T) {
	a, b, _, _ := replicaPair(t)
	if _, err := a.Reserve(ctxb(), picker.ReservationRequest{ModelName: "model", SelectionID: "e", WorkerID: u64(2),
		Prompt: picker.Prompt{TokenIDs: tokens(8)}}); err != nil {
		t.Fatal(err)
	}
	if err := b.PrefillComplete(ctxb(), "e"); err != nil {
		t.Fatal(err)
	}
	if got := tripleOf(t, a, 2); got != (triple{1, 2, 0}) {
		t.Fatalf("origin after the peer's prefill_complete = %+v, want (1,2,0)", got)
	}
	// output_block on the peer is local to it (§15.4).
	if err := b.OutputBlock(ctxb(), "e", nil); err != nil {
		t.Fatal(err)
	}
	if got, want := tripleOf(t, a, 2), (triple{1, 2, 0}); got != want {
		t.Fatalf("origin after the peer's output_block = %+v, want %+v", got, want)
	}
	if got, want := tripleOf(t, b, 2), (triple{1, 3, 0}); got != want {
		t.Fatalf("peer after its output_block = %+v, want %+v", got, want)
	}
}

func TestApplyRemoteSlotDropRules(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.DataParallelSize = u32(2) }))
	other := picker.PartitionKey{ModelName: "model", RoutingGroup: "other"}
	mustUpsert(t, s, worker(9, func(r *picker.WorkerRecord) { r.RoutingGroup = "other" }))
	add := func(id string, w uint64, r uint32) ledger.SlotEvent {
		return ledger.SlotEvent{Kind: ledger.SlotAdmission, ID: id, Candidate: ledger.Candidate{WorkerID: w, DPRank: r},
			Origin: 5, SequenceHashes: []uint64{1, 2}, TrackPrefillTokens: true, PrefillTokens: u64(7)}
	}
	lifecycle := func(kind ledger.SlotEventKind, id string, w uint64) ledger.SlotEvent {
		return ledger.SlotEvent{Kind: kind, ID: id, Candidate: ledger.Candidate{WorkerID: w}, Origin: 5}
	}
	if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "local" })); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		key  picker.PartitionKey
		bs   uint32
		ev   ledger.SlotEvent
		want picker.RemoteOutcome
	}{
		{"an unknown partition is dropped", picker.PartitionKey{ModelName: "nope", RoutingGroup: "default"}, 4, add("a", 1, 0), picker.RemoteUnknownPartition},
		{"a block size mismatch is dropped", modelKey, 16, add("a", 1, 0), picker.RemoteBlockSizeMismatch},
		{"an unknown worker is dropped", modelKey, 4, add("a", 3, 0), picker.RemoteUnknownWorker},
		{"a worker of another partition is dropped", modelKey, 4, add("a", 9, 0), picker.RemoteUnknownWorker},
		{"a rank outside the worker's range is dropped", modelKey, 4, add("a", 1, 2), picker.RemoteUnknownRank},
		{"an admission over a local booking is a conflict", modelKey, 4, add("local", 1, 1), picker.RemoteConflict},
		{"an empty id is invalid", modelKey, 4, add("", 1, 0), picker.RemoteInvalid},
		{"a prefill completion of an unknown id is dropped", modelKey, 4, lifecycle(ledger.SlotPrefillComplete, "ghost", 1), picker.RemoteUnknownReservation},
		{"a free of an unknown id is dropped", modelKey, 4, lifecycle(ledger.SlotFree, "ghost", 1), picker.RemoteUnknownReservation},
		{"a free naming another partition is dropped", other, 4, lifecycle(ledger.SlotFree, "local", 9), picker.RemoteUnknownReservation},
		{"an admission is applied", modelKey, 4, add("m", 1, 1), picker.RemoteApplied},
		{"a free naming another worker than the mirror's is dropped", modelKey, 4, ledger.SlotEvent{Kind: ledger.SlotFree, ID: "m", Candidate: ledger.Candidate{WorkerID: 1}, Origin: 5}, picker.RemoteUnknownReservation},
		{"the matching free is applied", modelKey, 4, ledger.SlotEvent{Kind: ledger.SlotFree, ID: "m", Candidate: ledger.Candidate{WorkerID: 1, DPRank: 1}, Origin: 5}, picker.RemoteApplied},
		{"an unknown kind is invalid", modelKey, 4, ledger.SlotEvent{Kind: 0, ID: "q", Candidate: ledger.Candidate{WorkerID: 1}, Origin: 5}, picker.RemoteInvalid},
		{"a prefill hint beyond MaxISLTokens is invalid", modelKey, 4, func() ledger.SlotEvent {
			ev := add("huge", 1, 0)
			ev.PrefillTokens = u64(math.MaxUint64)
			return ev
		}(), picker.RemoteInvalid},
		{"a prompt beyond MaxISLTokens is invalid", modelKey, 4, func() ledger.SlotEvent {
			ev := add("long", 1, 0)
			ev.SequenceHashes = make([]uint64, picker.MaxISLTokens/4+2)
			return ev
		}(), picker.RemoteInvalid},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := s.ApplyRemoteSlot(tc.key, tc.bs, tc.ev); got != tc.want {
				t.Fatalf("ApplyRemoteSlot = %v, want %v", got, tc.want)
			}
		})
	}
	if bk, ok := s.Booking("local"); !ok || bk.Origin != 0 {
		t.Fatalf("the local booking changed: %+v %v", bk, ok)
	}
	if n, _ := s.ReservationCounts(); n != 1 {
		t.Fatalf("%d bookings, want only the local one", n)
	}
}

func TestApplyRemoteSlotPrefillWithoutHint(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(1))
	ev := ledger.SlotEvent{Kind: ledger.SlotAdmission, ID: "a", Candidate: ledger.Candidate{WorkerID: 1}, Origin: 5,
		SequenceHashes: []uint64{1, 2, 3}, TrackPrefillTokens: true}
	if got := s.ApplyRemoteSlot(modelKey, 4, ev); got != picker.RemoteApplied {
		t.Fatal(got)
	}
	ev.ID, ev.TrackPrefillTokens, ev.SequenceHashes = "b", false, []uint64{4}
	if got := s.ApplyRemoteSlot(modelKey, 4, ev); got != picker.RemoteApplied {
		t.Fatal(got)
	}
	if got := tripleOf(t, s, 1); got != (triple{2, 4, 12}) {
		t.Fatalf("loads = %+v, want 2 requests, 4 blocks, 12 prefill tokens (3 blocks × 4 without a hint, 0 untracked)", got)
	}
}

func TestRemoteFreeReleasesTheOriginsAffinityLease(t *testing.T) {
	a, b, _, _ := replicaPair(t, func(c *picker.Config) { c.SessionAffinityTTL = time.Minute })
	req := tokenReq(tokens(4), func(r *picker.SelectRequest) {
		r.SelectionID = "s"
		r.Session = &picker.SessionContext{SessionID: "conv"}
	})
	sel, err := a.SelectAndReserve(ctxb(), req)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, leases, ok := a.SessionBinding(modelKey, "conv"); !ok || leases != 1 {
		t.Fatalf("binding on a: leases %d ok %v", leases, ok)
	}
	if err := b.Free(ctxb(), "s"); err != nil {
		t.Fatal(err)
	}
	target, _, leases, ok := a.SessionBinding(modelKey, "conv")
	if !ok || leases != 0 || target.WorkerID != sel.WorkerID {
		t.Fatalf("binding on a after the peer's free: %+v leases %d ok %v; want bound, 0 leases", target, leases, ok)
	}
}
