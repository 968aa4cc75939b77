package ledger

import (
	"errors"
	"testing"
)

func TestMirror(t *testing.T) {
	mirror := func(id string, c Candidate, part string, origin uint64) Booking {
		return Booking{ID: id, Candidate: c, SequenceHashes: []uint64{10, 11}, PrefillTokens: 8, Admitted: t0,
			Partition: part, Origin: origin}
	}
	t.Run("an unused id is booked as a mirror and counts as load", func(t *testing.T) {
		l := newTracking()
		if _, replaced, err := l.Mirror(mirror("a", w1r0, "m:default", 7)); err != nil || replaced {
			t.Fatalf("Mirror = replaced %v, %v", replaced, err)
		}
		checkInvariants(t, l)
		wantLoad(t, l, w1r0, Load{ActivePrefillTokens: 8, ActiveBlocks: 2, ActiveRequests: 1, PrefillRequests: 1})
		b, ok := l.Lookup("a")
		if !ok || b.Origin != 7 {
			t.Fatalf("Lookup = %+v, %v; want origin 7", b, ok)
		}
	})
	t.Run("a re-sent admission of the same partition replaces the earlier mirror", func(t *testing.T) {
		l := newTracking()
		if _, _, err := l.Mirror(mirror("a", w1r0, "m:default", 7)); err != nil {
			t.Fatal(err)
		}
		old, replaced, err := l.Mirror(mirror("a", w2r0, "m:default", 9))
		if err != nil || !replaced || old.Candidate != w1r0 {
			t.Fatalf("Mirror = %+v replaced %v, %v", old, replaced, err)
		}
		checkInvariants(t, l)
		wantLoad(t, l, w1r0, Load{})
		wantLoad(t, l, w2r0, Load{ActivePrefillTokens: 8, ActiveBlocks: 2, ActiveRequests: 1, PrefillRequests: 1})
	})
	t.Run("a local claim becomes the mirror and the local booking then conflicts", func(t *testing.T) {
		l := newTracking()
		if err := l.Claim("a"); err != nil {
			t.Fatal(err)
		}
		if _, _, err := l.Mirror(mirror("a", w1r0, "m:default", 7)); err != nil {
			t.Fatal(err)
		}
		checkInvariants(t, l)
		if n, claims := l.Len(); n != 1 || claims != 0 {
			t.Fatalf("Len = %d bookings, %d claims; want 1, 0", n, claims)
		}
		if err := l.Book(Booking{ID: "a", Candidate: w2r0, Admitted: t0}); !errors.Is(err, ErrConflict) {
			t.Fatalf("local Book after the mirror = %v, want ErrConflict", err)
		}
		l.Unclaim("a") // the local request's deferred cleanup must not touch the mirror
		if _, ok := l.Lookup("a"); !ok {
			t.Fatal("Unclaim removed the mirror")
		}
	})
	t.Run("a live local booking is never replaced", func(t *testing.T) {
		l := newTracking()
		mustBook(t, l, Booking{ID: "a", Candidate: w1r0, PrefillTokens: 3, Partition: "m:default"})
		if _, _, err := l.Mirror(mirror("a", w2r0, "m:default", 7)); !errors.Is(err, ErrConflict) {
			t.Fatalf("Mirror over a local booking = %v, want ErrConflict", err)
		}
		wantLoad(t, l, w1r0, Load{ActivePrefillTokens: 3, ActiveRequests: 1, PrefillRequests: 1})
		wantLoad(t, l, w2r0, Load{})
	})
	t.Run("a mirror of another partition is never replaced", func(t *testing.T) {
		l := newTracking()
		if _, _, err := l.Mirror(mirror("a", w1r0, "m:default", 7)); err != nil {
			t.Fatal(err)
		}
		if _, _, err := l.Mirror(mirror("a", w2r0, "other:default", 7)); !errors.Is(err, ErrConflict) {
			t.Fatalf("Mirror of another partition = %v, want ErrConflict", err)
		}
		checkInvariants(t, l)
	})
	t.Run("an empty id or a zero origin is invalid", func(t *testing.T) {
		l := newTracking()
		if _, _, err := l.Mirror(mirror("", w1r0, "m:default", 7)); !errors.Is(err, ErrInvalid) {
			t.Fatalf("empty id: %v", err)
		}
		if _, _, err := l.Mirror(mirror("a", w1r0, "m:default", 0)); !errors.Is(err, ErrInvalid) {
			t.Fatalf("zero origin: %v", err)
		}
		if n, _ := l.Len(); n != 0 {
			t.Fatalf("%d bookings after invalid mirrors", n)
		}
	})
}

func TestPrefillCompleteAttempt(t *testing.T) {
	l := newTracking()
	mustBook(t, l, Booking{ID: "a", Candidate: w1r0, PrefillTokens: 30})
	first, _ := l.Lookup("a")
	if err := l.PrefillCompleteAttempt("a", first.Attempt); err != nil {
		t.Fatal(err)
	}
	if err := l.PrefillCompleteAttempt("a", first.Attempt); err != nil {
		t.Fatalf("repeat on the live booking: %v", err)
	}
	wantLoad(t, l, w1r0, Load{ActiveRequests: 1})
	if _, err := l.Free("a"); err != nil {
		t.Fatal(err)
	}
	mustBook(t, l, Booking{ID: "a", Candidate: w1r0, PrefillTokens: 12})
	if err := l.PrefillCompleteAttempt("a", first.Attempt); !errors.Is(err, ErrNotFound) {
		t.Fatalf("stale attempt = %v, want ErrNotFound", err)
	}
	wantLoad(t, l, w1r0, Load{ActivePrefillTokens: 12, ActiveRequests: 1, PrefillRequests: 1})
	if err := l.PrefillCompleteAttempt("nope", 1); !errors.Is(err, ErrNotFound) {
		t.Fatalf("unknown id = %v", err)
	}
	checkInvariants(t, l)
}

func TestReleaseMirrorsOf(t *testing.T) {
	l := newTracking()
	for _, m := range []Booking{
		{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1}, Admitted: t0, Partition: "m:default", Origin: 7},
		{ID: "b", Candidate: w2r0, SequenceHashes: []uint64{2}, Admitted: t0, Partition: "m:default", Origin: 7},
		{ID: "c", Candidate: w2r0, SequenceHashes: []uint64{3}, Admitted: t0, Partition: "m:default", Origin: 9},
	} {
		if _, _, err := l.Mirror(m); err != nil {
			t.Fatal(err)
		}
	}
	mustBook(t, l, Booking{ID: "local", Candidate: w1r0, SequenceHashes: []uint64{4}, Admitted: t0, Partition: "m:default"})
	if got := l.ReleaseMirrorsOf(0); len(got) != 0 {
		t.Fatalf("origin 0 released %d bookings", len(got))
	}
	got := l.ReleaseMirrorsOf(7)
	if len(got) != 2 || got[0].Origin != 7 || got[1].Origin != 7 {
		t.Fatalf("released %+v, want the two mirrors of origin 7", got)
	}
	checkInvariants(t, l)
	if n, _ := l.Len(); n != 2 {
		t.Fatalf("%d live bookings left, want 2 (origin 9's mirror and the local one)", n)
	}
	wantLoad(t, l, w1r0, Load{ActiveBlocks: 1, ActiveRequests: 1})
}
