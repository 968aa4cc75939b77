package ledger

import (
	"errors"
	"math"
	"testing"
)

// TestGrowOutputBlocks checks that GrowOutputBlocks raises a booking to the target number of
// output blocks (one active block each, never shrinking), acts only on the attempt it names,
// releases every output block with the booking, and with block tracking off only counts.
func TestGrowOutputBlocks(t *testing.T) {
	l := newTracking()
	mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1, 2}})
	b, _ := l.Lookup("a")
	for _, step := range []struct{ target, added, blocks uint32 }{{3, 3, 5}, {3, 0, 5}, {1, 0, 5}, {4, 1, 6}} {
		added, err := l.GrowOutputBlocks("a", b.Attempt, step.target)
		if err != nil || added != step.added {
			t.Fatalf("grow to %d: added %d, %v; want %d", step.target, added, err, step.added)
		}
		wantLoad(t, l, w1r0, Load{ActiveBlocks: uint64(step.blocks), ActiveRequests: 1})
		checkInvariants(t, l)
	}
	if _, err := l.GrowOutputBlocks("a", b.Attempt+1, 10); !errors.Is(err, ErrNotFound) {
		t.Fatalf("another attempt: %v, want ErrNotFound", err)
	}
	if got, _ := l.Lookup("a"); got.OutputBlocks != 4 {
		t.Fatalf("OutputBlocks %d, want 4", got.OutputBlocks)
	}
	if _, err := l.Free("a"); err != nil {
		t.Fatal(err)
	}
	wantLoad(t, l, w1r0, Load{})
	if _, err := l.GrowOutputBlocks("a", b.Attempt, 10); !errors.Is(err, ErrNotFound) {
		t.Fatalf("freed booking: %v, want ErrNotFound", err)
	}

	off := New(Config{TrackActiveBlocks: false})
	mustBook(t, off, Booking{ID: "b", Candidate: w1r0, SequenceHashes: []uint64{1}})
	bb, _ := off.Lookup("b")
	if added, err := off.GrowOutputBlocks("b", bb.Attempt, 2); added != 2 || err != nil {
		t.Fatalf("tracking off: added %d, %v", added, err)
	}
	wantLoad(t, off, w1r0, Load{ActiveRequests: 1})
}

// TestGrowOutputBlocksIsConstantCost grows one booking by 2^20 output blocks (what one event
// claiming 2^64 tokens asked for when the worker has no total_kv_blocks): it allocates nothing and
// leaves the rank's block table at the prompt's size, while the loads count every block — weighted
// by the booking's decay_fraction like any exclusively held block, mixed with output_block's
// hashed blocks — and all of them go with the booking.
func TestGrowOutputBlocksIsConstantCost(t *testing.T) {
	l := newTracking()
	mustBook(t, l, Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1, 2}})
	mustBook(t, l, Booking{ID: "b", Candidate: w1r0, SequenceHashes: []uint64{1}})
	b, _ := l.Lookup("a")
	target := uint32(1)
	allocs := testing.AllocsPerRun(4, func() {
		target += 1 << 18
		if _, err := l.GrowOutputBlocks("a", b.Attempt, target); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("growing by 2^18 blocks allocated %v times, want 0", allocs)
	}
	grown := uint64(target) // AllocsPerRun runs the function once more than asked
	if n := len(l.ranks[w1r0].blocks.keys); n > minTableSize {
		t.Fatalf("block table has %d slots after growth, want the prompt's (≤ %d)", n, minTableSize)
	}
	wantLoad(t, l, w1r0, Load{ActiveBlocks: 2 + grown, ActiveRequests: 2})
	checkInvariants(t, l)
	half := 0.5
	if err := l.OutputBlock("a", &half, 999); err != nil { // one hashed output block, and decay 0.5
		t.Fatal(err)
	}
	// Block 1 is shared (weight 1); block 2, the hashed one and the counted ones are a's alone.
	wantLoad(t, l, w1r0, Load{ActiveBlocks: uint64(math.Round(1 + float64(2+grown)/2)), ActiveRequests: 2})
	checkInvariants(t, l)
	if got, _ := l.Lookup("a"); uint64(got.OutputBlocks) != grown+1 {
		t.Fatalf("OutputBlocks %d, want %d", got.OutputBlocks, grown+1)
	}
	if _, err := l.Free("a"); err != nil {
		t.Fatal(err)
	}
	wantLoad(t, l, w1r0, Load{ActiveBlocks: 1, ActiveRequests: 1})
	checkInvariants(t, l)
	if _, err := l.Free("b"); err != nil {
		t.Fatal(err)
	}
	wantLoad(t, l, w1r0, Load{})
	if r := l.ranks[w1r0]; r.private != 0 || r.deficit != 0 {
		t.Fatalf("rank keeps private %d, deficit %d after the last free", r.private, r.deficit)
	}
}

// BenchmarkGrowOutputBlocks1M books a 2-block prompt, grows it by 2^20 output blocks in one call
// (one usage event claiming ≥ 2^24 tokens on a worker without total_kv_blocks) and frees it: the
// time and memory one such event costs under the ledger lock.
func BenchmarkGrowOutputBlocks1M(b *testing.B) {
	l := newTracking()
	b.ReportAllocs()
	for range b.N {
		if err := l.Book(Booking{ID: "a", Candidate: w1r0, SequenceHashes: []uint64{1, 2}, Admitted: t0}); err != nil {
			b.Fatal(err)
		}
		bk, _ := l.Lookup("a")
		if _, err := l.GrowOutputBlocks("a", bk.Attempt, 1<<20); err != nil {
			b.Fatal(err)
		}
		if _, err := l.Free("a"); err != nil {
			b.Fatal(err)
		}
	}
}
