package ledger

import (
	"errors"
	"math"
	"testing"
	"time"
)

func TestPrefillRateIsLearnedFromObservedCompletions(t *testing.T) {
	l := newTracking()
	now := t0
	// Three requests, each booked behind the previous one's work: 1,000 tokens done per 100 ms.
	for i, id := range []string{"a", "b", "c"} {
		mustBook(t, l, Booking{ID: id, Candidate: w1r0, PrefillTokens: 1000, Admitted: now})
		b, _ := l.Lookup(id)
		if b.AheadPrefillTokens != 0 {
			t.Fatalf("booking %d: %d tokens ahead, want 0 (the earlier ones completed)", i, b.AheadPrefillTokens)
		}
		if ld := l.Load(w1r0); ld.PrefillTokensPerSecond != 0 && i < prefillRateMinSamples {
			t.Fatalf("a rate of %v after %d samples", ld.PrefillTokensPerSecond, i)
		}
		now = now.Add(100 * time.Millisecond)
		if err := l.PrefillCompleteAt(id, now); err != nil {
			t.Fatal(err)
		}
	}
	if got := l.Load(w1r0).PrefillTokensPerSecond; math.Abs(got-10000) > 1e-6 {
		t.Fatalf("rate %v tokens/s, want 10,000", got)
	}
	if ld := l.Load(w1r0); ld.PrefillRequests != 0 || ld.ActivePrefillTokens != 0 {
		t.Fatalf("load %+v after every prefill completed", ld)
	}

	t.Run("the work queued ahead counts: z waited for 2,000 tokens ahead and its own 1,000, 300 ms in all", func(t *testing.T) {
		l := newTracking()
		for _, id := range []string{"x", "y", "z"} {
			mustBook(t, l, Booking{ID: id, Candidate: w1r0, PrefillTokens: 1000, Admitted: t0})
		}
		b, _ := l.Lookup("z")
		if b.AheadPrefillTokens != 2000 {
			t.Fatalf("z has %d tokens ahead, want 2000", b.AheadPrefillTokens)
		}
		for i, id := range []string{"x", "y", "z"} {
			if err := l.PrefillCompleteAt(id, t0.Add(time.Duration(i+1)*100*time.Millisecond)); err != nil {
				t.Fatal(err)
			}
		}
		// Samples: 1000/0.1 s, 2000/0.2 s, 3000/0.3 s → 10,000 tokens/s.
		if got := l.Load(w1r0).PrefillTokensPerSecond; math.Abs(got-10000) > 1e-6 {
			t.Fatalf("rate %v, want 10,000", got)
		}
	})
	t.Run("unobserved bookings and repeated completions train nothing", func(t *testing.T) {
		l := newTracking()
		for i, id := range []string{"p", "q", "r", "s"} {
			mustBook(t, l, Booking{ID: id, Candidate: w1r0, PrefillTokens: 1000, Admitted: t0, Unobserved: i == 3})
			_ = l.PrefillCompleteAt(id, t0.Add(time.Second))
		}
		_ = l.PrefillCompleteAt("p", t0.Add(time.Hour)) // already complete: no sample
		if got := l.Load(w1r0).PrefillTokensPerSecond; math.Abs(got-1000) > 1e-6 {
			t.Fatalf("rate %v, want 1,000 from p, q and r only", got)
		}
	})
}

func TestPrefillCompleteAttemptActsOnlyOnThatBooking(t *testing.T) {
	l := newTracking()
	mustBook(t, l, Booking{ID: "a", Candidate: w1r0, PrefillTokens: 10})
	old, _ := l.Lookup("a")
	if _, err := l.Free("a"); err != nil {
		t.Fatal(err)
	}
	mustBook(t, l, Booking{ID: "a", Candidate: w1r0, PrefillTokens: 20})
	if err := l.PrefillCompleteAttempt("a", old.Attempt); !errors.Is(err, ErrNotFound) {
		t.Fatalf("completing a released attempt: %v, want ErrNotFound", err)
	}
	wantLoad(t, l, w1r0, Load{ActivePrefillTokens: 20, PrefillRequests: 1, ActiveRequests: 1})
	cur, _ := l.Lookup("a")
	if err := l.PrefillCompleteAttempt("a", cur.Attempt); err != nil {
		t.Fatal(err)
	}
	wantLoad(t, l, w1r0, Load{ActiveRequests: 1})
	checkInvariants(t, l)
}
