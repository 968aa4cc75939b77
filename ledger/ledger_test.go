package ledger

import (
	"errors"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"
)

var (
	w1r0 = Candidate{WorkerID: 1, DPRank: 0}
	w1r1 = Candidate{WorkerID: 1, DPRank: 1}
	w2r0 = Candidate{WorkerID: 2, DPRank: 0}
	t0   = time.Unix(1_700_000_000, 0)
)

func ptr[T any](v T) *T { return &v }

func newTracking() *Ledger { return New(Config{TrackActiveBlocks: true}) }

func mustBook(t *testing.T, l *Ledger, b Booking) {
	t.Helper()
	if b.Admitted.IsZero() {
		b.Admitted = t0
	}
	if err := l.Book(b); err != nil {
		t.Fatalf("Book(%q): %v", b.ID, err)
	}
	checkInvariants(t, l)
}

func wantLoad(t *testing.T, l *Ledger, c Candidate, want Load) {
	t.Helper()
	if got := l.Load(c); got != want {
		t.Fatalf("Load(%v) = %+v, want %+v", c, got, want)
	}
}

func TestBookingLifecycle(t *testing.T) {
	t.Run("a booking adds one request, its prefill tokens and one block per sequence hash", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1, 2, 3}, PrefillTokens: 48})
		wantLoad(t, l, w1r0, Load{ActivePrefillTokens: 48, ActiveBlocks: 3, PrefillRequests: 1, ActiveRequests: 1})
		wantLoad(t, l, w1r1, Load{})
	})
	t.Run("prefill_complete removes the prefill tokens and keeps the blocks as decode load", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1, 2}, PrefillTokens: 30})
		mustBook(t, l, Booking{ID: "b", Candidate: w1r0, SequenceHashes: []uint64{7}, PrefillTokens: 5})
		if err := l.PrefillComplete("a"); err != nil {
			t.Fatal(err)
		}
		wantLoad(t, l, w1r0, Load{ActivePrefillTokens: 5, ActiveBlocks: 3, PrefillRequests: 1, ActiveRequests: 2})
	})
	t.Run("prefill_complete is idempotent on a live booking", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0, PrefillTokens: 30})
		mustBook(t, l, Booking{ID: "b", Candidate: w1r0, PrefillTokens: 4})
		for i := 0; i < 3; i++ {
			if err := l.PrefillComplete("a"); err != nil {
				t.Fatalf("call %d: %v", i, err)
			}
		}
		wantLoad(t, l, w1r0, Load{ActivePrefillTokens: 4, PrefillRequests: 1, ActiveRequests: 2})
		b, _ := l.Free("a")
		if !b.PrefillCompleted {
			t.Fatal("freed booking should report PrefillCompleted")
		}
		wantLoad(t, l, w1r0, Load{ActivePrefillTokens: 4, PrefillRequests: 1, ActiveRequests: 1})
	})
	t.Run("free releases a booking exactly once and a second free is not found", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1, 2}, PrefillTokens: 9, Partition: "m:g"})
		b, err := l.Free("a")
		if err != nil {
			t.Fatal(err)
		}
		if b.ID != "a" || b.Candidate != w1r0 || b.Partition != "m:g" || b.PrefillTokens != 9 || len(b.SequenceHashes) != 2 {
			t.Fatalf("Free returned %+v", b)
		}
		wantLoad(t, l, w1r0, Load{})
		_, err = l.Free("a")
		if !errors.Is(err, ErrNotFound) || err.Error() != "reservation a not found" {
			t.Fatalf("second Free: %v", err)
		}
		if err := l.PrefillComplete("a"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("PrefillComplete after free: %v", err)
		}
		if err := l.OutputBlock("a", nil, 5); !errors.Is(err, ErrNotFound) {
			t.Fatalf("OutputBlock after free: %v", err)
		}
		checkInvariants(t, l)
	})
	t.Run("a freed id can be booked again", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0})
		if _, err := l.Free("a"); err != nil {
			t.Fatal(err)
		}
		mustBook(t, l, Booking{ID: "a", Candidate: w2r0})
		wantLoad(t, l, w2r0, Load{ActiveRequests: 1})
	})
	t.Run("booking an id that is live conflicts and changes nothing", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1}})
		err := l.Book(Booking{ID: "a", Candidate: w2r0, SequenceHashes: []uint64{2}, PrefillTokens: 3})
		if !errors.Is(err, ErrConflict) || err.Error() != "selection a is already reserved or being reserved" {
			t.Fatalf("Book of live id: %v", err)
		}
		wantLoad(t, l, w2r0, Load{})
		wantLoad(t, l, w1r0, Load{ActiveBlocks: 1, ActiveRequests: 1})
	})
	t.Run("an empty selection_id is rejected as invalid", func(t *testing.T) {
		l := newTracking()
		if err := l.Book(Booking{Candidate: w1r0}); !errors.Is(err, ErrInvalid) {
			t.Fatalf("Book: %v", err)
		}
		if err := l.Claim(""); !errors.Is(err, ErrInvalid) {
			t.Fatalf("Claim: %v", err)
		}
	})
	t.Run("lookup returns the booking with ledger-maintained fields", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r1, SequenceHashes: []uint64{1}, PrefillTokens: 4,
			ExpectedOutputTokens: ptr[uint32](100), Partition: "m:g", DecayFraction: 0.2, OutputBlocks: 9})
		b, ok := l.Lookup("a")
		if !ok || b.Candidate != w1r1 || b.DecayFraction != 1 || b.OutputBlocks != 0 || b.Attempt == 0 ||
			*b.ExpectedOutputTokens != 100 || !b.Admitted.Equal(t0) {
			t.Fatalf("Lookup = %+v, %v", b, ok)
		}
		if err := l.OutputBlock("a", ptr(0.25), 99); err != nil {
			t.Fatal(err)
		}
		b, _ = l.Lookup("a")
		if b.OutputBlocks != 1 || b.DecayFraction != 0.25 {
			t.Fatalf("after OutputBlock: %+v", b)
		}
		if _, ok := l.Lookup("missing"); ok {
			t.Fatal("Lookup of unknown id found something")
		}
	})
	t.Run("attempts distinguish a reused id", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0})
		first, _ := l.Lookup("a")
		if _, err := l.Free("a"); err != nil {
			t.Fatal(err)
		}
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0})
		if _, err := l.FreeAttempt("a", first.Attempt); !errors.Is(err, ErrNotFound) {
			t.Fatalf("stale FreeAttempt: %v", err)
		}
		wantLoad(t, l, w1r0, Load{ActiveRequests: 1})
		second, _ := l.Lookup("a")
		if _, err := l.FreeAttempt("a", second.Attempt); err != nil {
			t.Fatalf("FreeAttempt: %v", err)
		}
		wantLoad(t, l, w1r0, Load{})
	})
}

func TestClaims(t *testing.T) {
	t.Run("a claimed id that is not booked is invisible to lifecycle calls", func(t *testing.T) {
		l := newTracking()
		if err := l.Claim("a"); err != nil {
			t.Fatal(err)
		}
		if err := l.PrefillComplete("a"); !errors.Is(err, ErrNotFound) {
			t.Errorf("PrefillComplete: %v", err)
		}
		if err := l.OutputBlock("a", nil, 1); !errors.Is(err, ErrNotFound) {
			t.Errorf("OutputBlock: %v", err)
		}
		if _, err := l.Free("a"); !errors.Is(err, ErrNotFound) {
			t.Errorf("Free: %v", err)
		}
		if _, ok := l.Lookup("a"); ok {
			t.Error("Lookup found a claim")
		}
		if b, c := l.Len(); b != 0 || c != 1 {
			t.Errorf("Len = %d bookings, %d claims", b, c)
		}
	})
	t.Run("a claimed id blocks a second claim", func(t *testing.T) {
		l := newTracking()
		_ = l.Claim("a")
		if err := l.Claim("a"); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "selection a") {
			t.Fatalf("second Claim: %v", err)
		}
	})
	t.Run("a live id blocks a claim", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0})
		if err := l.Claim("a"); !errors.Is(err, ErrConflict) {
			t.Fatalf("Claim of live id: %v", err)
		}
	})
	t.Run("the claimer's booking turns the claim into a live booking", func(t *testing.T) {
		l := newTracking()
		_ = l.Claim("a")
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0})
		if b, c := l.Len(); b != 1 || c != 0 {
			t.Fatalf("Len = %d bookings, %d claims", b, c)
		}
		if err := l.Book(Booking{ID: "a", Candidate: w1r0}); !errors.Is(err, ErrConflict) {
			t.Fatalf("second Book: %v", err)
		}
	})
	t.Run("unclaim frees the id for a later claim", func(t *testing.T) {
		l := newTracking()
		_ = l.Claim("a")
		l.Unclaim("a")
		if err := l.Claim("a"); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("unclaim never touches a live booking", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0})
		l.Unclaim("a")
		l.Unclaim("never-seen")
		if _, ok := l.Lookup("a"); !ok {
			t.Fatal("Unclaim removed a live booking")
		}
	})
}

func TestActiveBlocks(t *testing.T) {
	type step struct {
		op    string // book, free, out, pc
		id    string
		c     Candidate
		seq   []uint64
		decay *float64
		hash  uint64
		want  uint64 // active blocks on w1r0 after the step
	}
	cases := []struct {
		name  string
		steps []step
	}{
		{"a prefix shared by two bookings counts once", []step{
			{op: "book", id: "a", seq: []uint64{1, 2, 3}, want: 3},
			{op: "book", id: "b", seq: []uint64{1, 2, 4}, want: 4},
		}},
		{"freeing one sharer keeps the shared prefix live", []step{
			{op: "book", id: "a", seq: []uint64{1, 2, 3}, want: 3},
			{op: "book", id: "b", seq: []uint64{1, 2}, want: 3},
			{op: "free", id: "a", want: 2},
			{op: "free", id: "b", want: 0},
		}},
		{"the same hashes on another rank do not count here", []step{
			{op: "book", id: "a", seq: []uint64{1, 2}, want: 2},
			{op: "book", id: "b", c: w1r1, seq: []uint64{1, 2, 3}, want: 2},
		}},
		{"an output block without decay adds one active block", []step{
			{op: "book", id: "a", seq: []uint64{1, 2}, want: 2},
			{op: "out", id: "a", hash: 1001, want: 3},
			{op: "out", id: "a", hash: 1002, want: 4},
			{op: "free", id: "a", want: 0},
		}},
		{"decay_fraction weights the blocks a booking holds exclusively", []step{
			{op: "book", id: "a", seq: []uint64{1, 2, 3}, want: 3},
			{op: "out", id: "a", hash: 100, decay: ptr(0.5), want: 2}, // 4 × 0.5
			{op: "out", id: "a", hash: 101, decay: ptr(0.5), want: 3}, // 5 × 0.5 = 2.5 rounds half away from zero
			{op: "out", id: "a", hash: 102, decay: ptr(0.1), want: 1}, // 6 × 0.1 = 0.6
			{op: "out", id: "a", hash: 103, decay: ptr(0.0), want: 0},
			{op: "out", id: "a", hash: 104, want: 0}, // decay persists until overwritten
			{op: "out", id: "a", hash: 105, decay: ptr(1.0), want: 9},
		}},
		{"shared blocks keep weight 1 whatever the holders' decay", []step{
			{op: "book", id: "a", seq: []uint64{1, 2, 3}, want: 3},
			{op: "out", id: "a", hash: 100, decay: ptr(0.0), want: 0},
			{op: "book", id: "b", seq: []uint64{1, 2}, want: 2},        // 1,2 shared (1.0 each); 3 and 100 only a's (0)
			{op: "out", id: "b", hash: 200, decay: ptr(0.5), want: 3},  // + 200 at 0.5 → 2.5 → 3
			{op: "free", id: "b", want: 0},                             // 1,2 exclusive to a again → weight 0
			{op: "out", id: "a", hash: 101, decay: ptr(0.25), want: 1}, // 5 × 0.25 = 1.25
		}},
		{"decay of a booking that holds nothing exclusively changes nothing", []step{
			{op: "book", id: "a", seq: []uint64{1, 2}, want: 2},
			{op: "book", id: "b", seq: []uint64{1, 2}, want: 2},
			{op: "pc", id: "a", want: 2},
			{op: "free", id: "a", want: 2},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l := newTracking()
			for i, s := range tc.steps {
				c := s.c
				if c == (Candidate{}) {
					c = w1r0
				}
				var err error
				switch s.op {
				case "book":
					err = l.Book(Booking{ID: s.id, Candidate: c, SequenceHashes: s.seq, Admitted: t0})
				case "free":
					_, err = l.Free(s.id)
				case "out":
					err = l.OutputBlock(s.id, s.decay, s.hash)
				case "pc":
					err = l.PrefillComplete(s.id)
				}
				if err != nil {
					t.Fatalf("step %d (%s %s): %v", i, s.op, s.id, err)
				}
				checkInvariants(t, l)
				if got := l.Load(w1r0).ActiveBlocks; got != s.want {
					t.Fatalf("step %d (%s %s): active blocks %d, want %d", i, s.op, s.id, got, s.want)
				}
			}
		})
	}
}

func TestOutputBlockValidation(t *testing.T) {
	for _, d := range []float64{-0.01, 1.5, math.NaN(), math.Inf(1)} {
		t.Run("decay_fraction "+strconv.FormatFloat(d, 'g', -1, 64)+" is rejected before lookup and changes nothing", func(t *testing.T) {
			l := newTracking()
			mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1}})
			err := l.OutputBlock("a", ptr(d), 2)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "decay_fraction must be between 0.0 and 1.0") {
				t.Fatalf("OutputBlock: %v", err)
			}
			if err := l.OutputBlock("unknown", ptr(d), 2); !errors.Is(err, ErrInvalid) {
				t.Fatalf("OutputBlock of unknown id with bad decay: %v (want ErrInvalid first)", err)
			}
			wantLoad(t, l, w1r0, Load{ActiveBlocks: 1, ActiveRequests: 1})
			if b, _ := l.Lookup("a"); b.OutputBlocks != 0 || b.DecayFraction != 1 {
				t.Fatalf("booking changed: %+v", b)
			}
		})
	}
}

func TestTrackActiveBlocksOff(t *testing.T) {
	t.Run("bookings hold no blocks and output blocks add none", func(t *testing.T) {
		l := New(Config{TrackActiveBlocks: false})
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1, 2, 3}, PrefillTokens: 7})
		if err := l.OutputBlock("a", ptr(0.5), 9); err != nil {
			t.Fatal(err)
		}
		wantLoad(t, l, w1r0, Load{ActivePrefillTokens: 7, PrefillRequests: 1, ActiveRequests: 1})
		if got := l.AdditionalBlocks(w1r0, []uint64{1, 2, 3}); got != 3 {
			t.Fatalf("AdditionalBlocks = %d, want 3 (nothing is live)", got)
		}
		if _, err := l.Free("a"); err != nil {
			t.Fatal(err)
		}
		wantLoad(t, l, w1r0, Load{})
	})
}

func TestAdditionalBlocks(t *testing.T) {
	l := newTracking()
	mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1, 2, 3}})
	cases := []struct {
		name   string
		c      Candidate
		hashes []uint64
		want   int
	}{
		{"a request whose whole prefix is live adds nothing", w1r0, []uint64{1, 2, 3}, 0},
		{"a request extending a live prefix adds only its new blocks", w1r0, []uint64{1, 2, 3, 4, 5}, 2},
		{"a diverging request adds everything after the divergence", w1r0, []uint64{1, 9, 10}, 2},
		{"a rank without bookings adds every block", w2r0, []uint64{1, 2, 3}, 3},
		{"an empty request adds nothing", w1r0, nil, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := l.AdditionalBlocks(tc.c, tc.hashes); got != tc.want {
				t.Fatalf("AdditionalBlocks = %d, want %d", got, tc.want)
			}
			ld, add := l.LoadAndAdditional(tc.c, tc.hashes)
			if add != tc.want || ld != l.Load(tc.c) {
				t.Fatalf("LoadAndAdditional = %+v, %d", ld, add)
			}
		})
	}
	t.Run("Loads returns index-aligned loads", func(t *testing.T) {
		got := l.Loads([]Candidate{w2r0, w1r0}, nil)
		if len(got) != 2 || got[0] != (Load{}) || got[1] != (Load{ActiveBlocks: 3, ActiveRequests: 1}) {
			t.Fatalf("Loads = %+v", got)
		}
	})
}

func TestFreeWorker(t *testing.T) {
	t.Run("every booking on every rank of the worker is released once", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1}, PrefillTokens: 3})
		mustBook(t, l, Booking{ID: "b", Candidate: w1r1, SequenceHashes: []uint64{1}, PrefillTokens: 3})
		mustBook(t, l, Booking{ID: "c", Candidate: w1r1, SequenceHashes: []uint64{2}})
		mustBook(t, l, Booking{ID: "d", Candidate: w2r0, SequenceHashes: []uint64{1}, PrefillTokens: 3})
		_ = l.Claim("e")
		got := l.FreeWorker(1)
		ids := map[string]bool{}
		for _, b := range got {
			ids[b.ID] = true
		}
		if len(got) != 3 || !ids["a"] || !ids["b"] || !ids["c"] {
			t.Fatalf("FreeWorker released %v", ids)
		}
		checkInvariants(t, l)
		wantLoad(t, l, w1r0, Load{})
		wantLoad(t, l, w1r1, Load{})
		wantLoad(t, l, w2r0, Load{ActivePrefillTokens: 3, ActiveBlocks: 1, PrefillRequests: 1, ActiveRequests: 1})
		if _, err := l.Free("b"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Free after FreeWorker: %v", err)
		}
		if b, c := l.Len(); b != 1 || c != 1 {
			t.Fatalf("Len = %d, %d; the claim must survive", b, c)
		}
		if len(l.FreeWorker(1)) != 0 {
			t.Fatal("second FreeWorker released something")
		}
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1}})
		wantLoad(t, l, w1r0, Load{ActiveBlocks: 1, ActiveRequests: 1})
	})
}

func TestExpireAdmittedBefore(t *testing.T) {
	t.Run("bookings admitted strictly before the cut-off are released; claims survive", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "old", Candidate: w1r0, SequenceHashes: []uint64{1, 2}, PrefillTokens: 8, Admitted: t0})
		mustBook(t, l, Booking{ID: "edge", Candidate: w1r0, SequenceHashes: []uint64{1}, Admitted: t0.Add(time.Minute)})
		mustBook(t, l, Booking{ID: "new", Candidate: w2r0, Admitted: t0.Add(2 * time.Minute)})
		_ = l.Claim("claimed")
		got := l.ExpireAdmittedBefore(t0.Add(time.Minute))
		if len(got) != 1 || got[0].ID != "old" {
			t.Fatalf("expired %+v", got)
		}
		checkInvariants(t, l)
		wantLoad(t, l, w1r0, Load{ActiveBlocks: 1, ActiveRequests: 1})
		if _, err := l.Free("old"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Free of expired booking: %v", err)
		}
		if got := l.ExpireAdmittedBefore(t0.Add(time.Hour)); len(got) != 2 {
			t.Fatalf("second sweep expired %d", len(got))
		}
		if b, c := l.Len(); b != 0 || c != 1 {
			t.Fatalf("Len = %d, %d", b, c)
		}
	})
}

func TestPrefillTokensNeverWrap(t *testing.T) {
	const maxU = math.MaxUint64
	type step struct {
		op   string // "book", "prefill_complete", "free"
		id   string
		toks uint64
		want Load
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{
			name: "two bookings of 2^64-1 and 1 tokens saturate instead of wrapping to 0",
			steps: []step{
				{op: "book", id: "a", toks: maxU, want: Load{ActivePrefillTokens: maxU, PrefillRequests: 1, ActiveRequests: 1}},
				{op: "book", id: "b", toks: 1, want: Load{ActivePrefillTokens: maxU, PrefillRequests: 2, ActiveRequests: 2}},
			},
		},
		{
			name: "freeing after saturation returns exactly to the remaining bookings' sum and then to 0",
			steps: []step{
				{op: "book", id: "a", toks: maxU, want: Load{ActivePrefillTokens: maxU, PrefillRequests: 1, ActiveRequests: 1}},
				{op: "book", id: "b", toks: 7, want: Load{ActivePrefillTokens: maxU, PrefillRequests: 2, ActiveRequests: 2}},
				{op: "book", id: "c", toks: maxU - 3, want: Load{ActivePrefillTokens: maxU, PrefillRequests: 3, ActiveRequests: 3}},
				{op: "free", id: "a", want: Load{ActivePrefillTokens: maxU, PrefillRequests: 2, ActiveRequests: 2}},
				{op: "free", id: "c", want: Load{ActivePrefillTokens: 7, PrefillRequests: 1, ActiveRequests: 1}},
				{op: "free", id: "b", want: Load{}},
			},
		},
		{
			name: "prefill_complete after saturation subtracts exactly",
			steps: []step{
				{op: "book", id: "a", toks: maxU, want: Load{ActivePrefillTokens: maxU, PrefillRequests: 1, ActiveRequests: 1}},
				{op: "book", id: "b", toks: maxU, want: Load{ActivePrefillTokens: maxU, PrefillRequests: 2, ActiveRequests: 2}},
				{op: "book", id: "c", toks: 5, want: Load{ActivePrefillTokens: maxU, PrefillRequests: 3, ActiveRequests: 3}},
				{op: "prefill_complete", id: "b", want: Load{ActivePrefillTokens: maxU, PrefillRequests: 2, ActiveRequests: 3}},
				{op: "prefill_complete", id: "a", want: Load{ActivePrefillTokens: 5, PrefillRequests: 1, ActiveRequests: 3}},
				{op: "free", id: "a", want: Load{ActivePrefillTokens: 5, PrefillRequests: 1, ActiveRequests: 2}},
				{op: "free", id: "c", want: Load{ActiveRequests: 1}},
				{op: "free", id: "b", want: Load{}},
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l := newTracking()
			for i, st := range tc.steps {
				var err error
				switch st.op {
				case "book":
					err = l.Book(Booking{ID: st.id, Candidate: w1r0, PrefillTokens: st.toks, Admitted: t0})
				case "prefill_complete":
					err = l.PrefillComplete(st.id)
				case "free":
					_, err = l.Free(st.id)
				}
				if err != nil {
					t.Fatalf("step %d %s %s: %v", i, st.op, st.id, err)
				}
				checkInvariants(t, l)
				if got := l.Load(w1r0); got != st.want {
					t.Fatalf("step %d %s %s: Load = %+v, want %+v", i, st.op, st.id, got, st.want)
				}
			}
		})
	}
	t.Run("freeing a whole worker after saturation leaves no load behind", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0, PrefillTokens: maxU})
		mustBook(t, l, Booking{ID: "b", Candidate: w1r0, PrefillTokens: maxU})
		if n := len(l.FreeWorker(1)); n != 2 {
			t.Fatalf("FreeWorker released %d bookings, want 2", n)
		}
		mustBook(t, l, Booking{ID: "c", Candidate: w1r0, PrefillTokens: 3})
		wantLoad(t, l, w1r0, Load{ActivePrefillTokens: 3, PrefillRequests: 1, ActiveRequests: 1})
	})
}
