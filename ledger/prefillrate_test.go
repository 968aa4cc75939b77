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

func TestPartitionRates(t *testing.T) {
	l := newTracking()
	if got := l.PartitionArrivalRate("m:g"); got != 0 {
		t.Fatalf("arrival rate %v before any booking", got)
	}
	// Bookings every 250 ms on two workers of one partition: 4 per second.
	for i := 0; i < 10; i++ {
		c := w1r0
		if i%2 == 1 {
			c = w2r0
		}
		mustBook(t, l, Booking{ID: string(rune('a' + i)), Candidate: c, PrefillTokens: 500, Partition: "m:g", Admitted: t0.Add(time.Duration(i) * 250 * time.Millisecond)})
	}
	if got := l.PartitionArrivalRate("m:g"); math.Abs(got-4) > 1e-9 {
		t.Fatalf("arrival rate %v, want 4 per second", got)
	}
	if got := l.PartitionArrivalRate("other:g"); got != 0 {
		t.Fatalf("another partition has rate %v", got)
	}
	// Each completes 100 ms after its admission, with at least its own 500 tokens done: the pooled
	// rate, fed by both workers, is at least 5,000 tokens/s, and each worker has its own.
	for i := 0; i < 10; i++ {
		_ = l.PrefillCompleteAt(string(rune('a'+i)), t0.Add(time.Duration(i)*250*time.Millisecond+100*time.Millisecond))
	}
	if got := l.PartitionPrefillRate("m:g"); got < 5000 {
		t.Fatalf("pooled prefill rate %v, want ≥ 5,000 tokens/s", got)
	}
	for _, c := range []Candidate{w1r0, w2r0} {
		if ld := l.Load(c); ld.PrefillRateSamples != 5 || ld.PrefillTokensPerSecond < 5000 {
			t.Fatalf("%v: %d samples, rate %v", c, ld.PrefillRateSamples, ld.PrefillTokensPerSecond)
		}
	}
}
