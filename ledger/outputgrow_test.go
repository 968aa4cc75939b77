package ledger

import (
	"errors"
	"testing"
)

// TestGrowOutputBlocks checks that GrowOutputBlocks raises a booking to the target number of
// output blocks (one active block each, never shrinking), acts only on the attempt it names,
// releases every output block with the booking, and with block tracking off only counts.
func TestGrowOutputBlocks(t *testing.T) {
	next := uint64(100)
	fresh := func() uint64 { next++; return next }
	l := newTracking()
	mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1, 2}})
	b, _ := l.Lookup("a")
	for _, step := range []struct{ target, added, blocks uint32 }{{3, 3, 5}, {3, 0, 5}, {1, 0, 5}, {4, 1, 6}} {
		added, err := l.GrowOutputBlocks("a", b.Attempt, step.target, fresh)
		if err != nil || added != step.added {
			t.Fatalf("grow to %d: added %d, %v; want %d", step.target, added, err, step.added)
		}
		wantLoad(t, l, w1r0, Load{ActiveBlocks: uint64(step.blocks), ActiveRequests: 1})
		checkInvariants(t, l)
	}
	if _, err := l.GrowOutputBlocks("a", b.Attempt+1, 10, fresh); !errors.Is(err, ErrNotFound) {
		t.Fatalf("another attempt: %v, want ErrNotFound", err)
	}
	if got, _ := l.Lookup("a"); got.OutputBlocks != 4 {
		t.Fatalf("OutputBlocks %d, want 4", got.OutputBlocks)
	}
	if _, err := l.Free("a"); err != nil {
		t.Fatal(err)
	}
	wantLoad(t, l, w1r0, Load{})
	if _, err := l.GrowOutputBlocks("a", b.Attempt, 10, fresh); !errors.Is(err, ErrNotFound) {
		t.Fatalf("freed booking: %v, want ErrNotFound", err)
	}

	off := New(Config{TrackActiveBlocks: false})
	mustBook(t, off, Booking{ID: "b", Candidate: w1r0, SequenceHashes: []uint64{1}})
	bb, _ := off.Lookup("b")
	if added, err := off.GrowOutputBlocks("b", bb.Attempt, 2, fresh); added != 2 || err != nil {
		t.Fatalf("tracking off: added %d, %v", added, err)
	}
	wantLoad(t, off, w1r0, Load{ActiveRequests: 1})
}
