package picker_test

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
)

var modelDefault = picker.PartitionKey{ModelName: "model", RoutingGroup: "default"}

func TestReserveErrorsAreTyped(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(1))
	mustUpsert(t, s, worker(2, func(r *picker.WorkerRecord) { r.Endpoint = "" }))
	id := func(v uint64) *uint64 { return &v }
	for _, tc := range []struct {
		name string
		req  picker.ReservationRequest
		kind picker.Kind
		msg  string
	}{
		{"an empty selection_id is unprocessable", picker.ReservationRequest{ModelName: "model"}, picker.KindUnprocessable, "selection_id must not be empty"},
		{"a replay without a select is not found", picker.ReservationRequest{ModelName: "model", SelectionID: "x"}, picker.KindNotFound,
			"no pending selection x for model:default (expired, already used, or never selected)"},
		{"an explicit booking of an incomplete worker is not found",
			picker.ReservationRequest{ModelName: "model", SelectionID: "x", WorkerID: id(2), Prompt: picker.Prompt{TokenIDs: tokens(4)}},
			picker.KindNotFound, "schedulable worker 2 not found for model:default"},
		{"an explicit booking beyond the rank range is not found",
			picker.ReservationRequest{ModelName: "model", SelectionID: "x", WorkerID: id(1), DPRank: u32(1), Prompt: picker.Prompt{TokenIDs: tokens(4)}},
			picker.KindNotFound, "schedulable worker 1 (dp_rank 1) not found for model:default"},
		{"an explicit booking in a missing partition is not ready",
			picker.ReservationRequest{ModelName: "nope", SelectionID: "x", WorkerID: id(1), Prompt: picker.Prompt{TokenIDs: tokens(4)}},
			picker.KindNotReady, "no schedulable workers for nope:default: there is no partition nope:default (registered models: model)"},
		{"an explicit prefill above the isl is a bad request",
			picker.ReservationRequest{ModelName: "model", SelectionID: "x", WorkerID: id(1), Prompt: picker.Prompt{TokenIDs: tokens(4)}, EffectivePrefillTokens: u64(5)},
			picker.KindBadRequest, "effective_prefill_tokens (5) must not exceed isl_tokens (4)"},
		{"a bad override is unprocessable",
			picker.ReservationRequest{ModelName: "model", SelectionID: "x", WorkerID: id(1), Prompt: picker.Prompt{TokenIDs: tokens(4)},
				Override: &picker.RouterConfigOverride{PrefillLoadScale: f64(-1)}},
			picker.KindUnprocessable, ""},
		{"a hash-form prompt needs sequence_hashes",
			picker.ReservationRequest{ModelName: "model", SelectionID: "x", WorkerID: id(1), Prompt: picker.Prompt{HashForm: true, ISLTokens: 4}},
			picker.KindBadRequest, "sequence_hashes is required without token_ids"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := s.Reserve(ctxb(), tc.req)
			wantKind(t, err, tc.kind, tc.msg)
		})
	}
	if b, c := bookingsAndClaims(t, s); b != 0 || c != 0 {
		t.Fatalf("failed reservations left %d bookings %d claims", b, c)
	}
}

// bookingsAndClaims counts live bookings via /loads (claims are invisible there, so a claim left
// behind shows up as a 409 for its id instead).
func bookingsAndClaims(t *testing.T, s *picker.Service) (int, int) {
	t.Helper()
	n := 0
	for _, p := range s.Loads("", "") {
		for _, l := range p.Loads {
			n += int(l.ActiveRequests)
		}
	}
	claims := 0
	if _, err := s.Reserve(ctxb(), picker.ReservationRequest{ModelName: "model", SelectionID: "x", WorkerID: u64(1),
		Prompt: picker.Prompt{TokenIDs: tokens(4)}}); err != nil {
		claims = 1
	} else if err := s.Free(ctxb(), "x"); err != nil {
		t.Fatal(err)
	}
	return n, claims
}

func TestConcurrentReplaysBookOnce(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(1))
	if _, err := s.Select(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "c" })); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	kinds := map[picker.Kind]int{}
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := s.Reserve(ctxb(), picker.ReservationRequest{ModelName: "model", SelectionID: "c"})
			mu.Lock()
			kinds[picker.KindOf(err)]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	if kinds[""] != 1 || kinds[picker.KindConflict]+kinds[picker.KindNotFound] != 7 {
		t.Fatalf("outcomes %v, want exactly one booking", kinds)
	}
	if l := loadOf(t, s, "model", "default", 1, 0); l.ActiveRequests != 1 {
		t.Fatalf("load %+v", l)
	}
}

func TestPendingCacheBoundsComeFromTheConfig(t *testing.T) {
	s := newService(t, func(c *picker.Config) { c.SelectionCache = ledger.PendingConfig{MaxEntries: 2} })
	mustUpsert(t, s, worker(1))
	for _, id := range []string{"a", "b", "c"} {
		if _, err := s.Select(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = id })); err != nil {
			t.Fatal(err)
		}
	}
	_, err := s.Reserve(ctxb(), picker.ReservationRequest{ModelName: "model", SelectionID: "a"})
	wantKind(t, err, picker.KindNotFound, "")
	for _, id := range []string{"b", "c"} {
		if _, err := s.Reserve(ctxb(), picker.ReservationRequest{ModelName: "model", SelectionID: id}); err != nil {
			t.Fatalf("replay %s: %v", id, err)
		}
	}
	for _, bad := range []ledger.PendingConfig{{TTL: -1}, {MaxEntries: -1}, {MaxBytes: -1}} {
		cfg := picker.DefaultConfig()
		cfg.Router.UseKVEvents = false
		cfg.SelectionCache = bad
		if _, err := picker.New(cfg); err == nil || !strings.HasPrefix(err.Error(), "invalid KV router configuration: ") {
			t.Errorf("New with %+v = %v", bad, err)
		}
	}
}

// publisher records published bindings.
type publisher struct {
	mu  sync.Mutex
	got []string
}

func (p *publisher) PublishAffinity(key picker.PartitionKey, u ledger.AffinityUpdate) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.got = append(p.got, key.String()+"/"+u.SessionID+"->"+u.Target.String())
}

func (p *publisher) list() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.got...)
}

func TestAffinityPublisherSeesCommitsAndReleasesButNotExpiry(t *testing.T) {
	pub := &publisher{}
	clock := time0
	s := newService(t, func(c *picker.Config) {
		c.SessionAffinityTTL = time.Minute
		c.AffinityPublisher = pub
		c.Now = func() time.Time { return clock }
	})
	mustUpsert(t, s, worker(1))
	book := func(id string) {
		t.Helper()
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) {
			r.SelectionID = id
			r.Session = &picker.SessionContext{SessionID: "s"}
		})); err != nil {
			t.Fatal(err)
		}
	}
	book("a")
	book("b")
	if err := s.Free(ctxb(), "a"); err != nil {
		t.Fatal(err)
	}
	clock = clock.Add(301 * time.Second)
	if n := s.ExpireStale(clock); n != 1 {
		t.Fatalf("expired %d", n)
	}
	want := "model:default/s->worker 1 dp_rank 0"
	got := pub.list()
	if len(got) != 3 || got[0] != want || got[1] != want || got[2] != want {
		t.Fatalf("published %v, want commit, lease commit and the free's release (no expiry)", got)
	}
	if _, _, leases, ok := s.SessionBinding(modelDefault, "s"); !ok || leases != 0 {
		t.Fatalf("binding after expiry: leases %d ok %v", leases, ok)
	}
}

func TestRestorePartition(t *testing.T) {
	src := newService(t)
	mustUpsert(t, src, worker(1))
	if _, err := src.SelectAndReserve(ctxb(), tokenReq(tokens(8))); err != nil {
		t.Fatal(err)
	}
	dump := src.Dump()["model:default"]
	t.Run("events restore into a fresh partition", func(t *testing.T) {
		s := newService(t)
		if err := s.RestorePartition(modelDefault, dump.BlockSize, dump.Events); err != nil {
			t.Fatal(err)
		}
		mustUpsert(t, s, worker(1))
		sel, err := s.Select(ctxb(), tokenReq(tokens(8)))
		if err != nil || sel.Overlap.LongestMatched != 8 {
			t.Fatalf("select after restore %+v %v", sel.Overlap, err)
		}
	})
	t.Run("the event-driven index restores too", func(t *testing.T) {
		ev := pickertest.NewEventSource()
		s := newService(t, withEvents(ev))
		evs := []kvindex.RouterEvent{{WorkerID: 1, Kind: kvindex.EventStored, Blocks: []kvindex.StoredBlock{{BlockHash: 9, TokensHash: kvindex.BlockHashes(tokens(4), 4, kvindex.BaseSeed)[0]}}}}
		if err := s.RestorePartition(modelDefault, 4, evs); err != nil {
			t.Fatal(err)
		}
		mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.KVEventsEndpoint = "tcp://w:1" }))
		sel, err := s.Select(ctxb(), tokenReq(tokens(4)))
		if err != nil || sel.Overlap.LongestMatched != 4 {
			t.Fatalf("select after restore %+v %v", sel.Overlap, err)
		}
	})
	t.Run("invalid restores fail", func(t *testing.T) {
		s := newService(t)
		if err := s.RestorePartition(modelDefault, 0, nil); err == nil {
			t.Error("block size 0 accepted")
		}
		if err := s.RestorePartition(picker.PartitionKey{ModelName: "m\x00", RoutingGroup: "default"}, 4, nil); err == nil ||
			!strings.Contains(err.Error(), "control character") {
			t.Errorf("a name no registration could make = %v", err)
		}
		mustUpsert(t, s, worker(1))
		if err := s.RestorePartition(modelDefault, 16, dump.Events); err == nil || !strings.Contains(err.Error(), "block_size") {
			t.Errorf("block size clash = %v", err)
		}
	})
}
