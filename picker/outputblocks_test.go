package picker_test

import (
	"testing"

	"github.com/kvepp/kvepp/picker"
)

func withOutputTracking(on bool) func(*picker.Config) {
	return func(c *picker.Config) { c.Router.TrackOutputBlocks = on }
}

// TestOutputTokensGrowTheBookingByOneBlockPerBlockSize checks DYN_ROUTER_TRACK_OUTPUT_BLOCKS: a
// running total of generated tokens grows the booking to ⌊total / block_size⌋ output blocks (block
// size 4 here), each one active block on its rank; totals never shrink it; Free returns the rank to
// zero, and a freed booking's later report is not found and changes nothing.
func TestOutputTokensGrowTheBookingByOneBlockPerBlockSize(t *testing.T) {
	s := newService(t, withOutputTracking(true))
	mustUpsert(t, s, worker(1))
	sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(8))) // 2 prompt blocks
	if err != nil {
		t.Fatal(err)
	}
	blocks := func() uint64 { return loadOf(t, s, "model", "", 1, 0).PotentialDecodeBlocks }
	if got := blocks(); got != 2 {
		t.Fatalf("active blocks %d after booking, want 2", got)
	}
	for _, step := range []struct {
		generated uint64
		added     int
		want      uint64
	}{
		{1, 0, 2}, {3, 0, 2}, {4, 1, 3}, {5, 0, 3}, {13, 2, 5}, {13, 0, 5}, {6, 0, 5}, {16, 1, 6},
	} {
		added, err := s.OutputTokens(ctxb(), sel.SelectionID, step.generated)
		if err != nil {
			t.Fatal(err)
		}
		if added != step.added || blocks() != step.want {
			t.Fatalf("after %d tokens: added %d, active blocks %d; want %d, %d", step.generated, added, blocks(), step.added, step.want)
		}
	}
	if err := s.Free(ctxb(), sel.SelectionID); err != nil {
		t.Fatal(err)
	}
	if got := blocks(); got != 0 {
		t.Fatalf("active blocks %d after free, want 0 (output blocks leaked)", got)
	}
	_, err = s.OutputTokens(ctxb(), sel.SelectionID, 100)
	wantKind(t, err, picker.KindNotFound, "reservation "+sel.SelectionID+" not found")
	if got := blocks(); got != 0 {
		t.Fatalf("active blocks %d after a report on a freed booking", got)
	}
}

// TestOutputTokensAreBoundedByTheWorkersKVPool checks that a booking never holds more output
// blocks than its worker's total_kv_blocks leaves after the prompt, whatever total is reported.
func TestOutputTokensAreBoundedByTheWorkersKVPool(t *testing.T) {
	s := newService(t, withOutputTracking(true))
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.TotalKVBlocks = u64(10) }))
	sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(12))) // 3 prompt blocks
	if err != nil {
		t.Fatal(err)
	}
	added, err := s.OutputTokens(ctxb(), sel.SelectionID, 1<<40)
	if err != nil {
		t.Fatal(err)
	}
	if added != 7 {
		t.Fatalf("added %d output blocks, want 7 (10 blocks of KV less 3 of prompt)", added)
	}
	if got := loadOf(t, s, "model", "", 1, 0).PotentialDecodeBlocks; got != 10 {
		t.Fatalf("active blocks %d, want the pool's 10", got)
	}
	if added, _ := s.OutputTokens(ctxb(), sel.SelectionID, 1<<50); added != 0 {
		t.Fatalf("a larger total added %d blocks beyond the bound", added)
	}
}

// TestOutputTokensDoNothingWithTrackingOff checks Dynamo's default (router_track_output_blocks
// false): reports change no load and need no lookup.
func TestOutputTokensDoNothingWithTrackingOff(t *testing.T) {
	s := newService(t, withOutputTracking(false))
	mustUpsert(t, s, worker(1))
	sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(8)))
	if err != nil {
		t.Fatal(err)
	}
	if s.TracksOutputBlocks() {
		t.Fatal("TracksOutputBlocks with tracking off")
	}
	if added, err := s.OutputTokens(ctxb(), sel.SelectionID, 400); added != 0 || err != nil {
		t.Fatalf("OutputTokens = %d, %v with tracking off", added, err)
	}
	if got := loadOf(t, s, "model", "", 1, 0).PotentialDecodeBlocks; got != 2 {
		t.Fatalf("active blocks %d, want the prompt's 2", got)
	}
}

// TestOutputTokensGrowAtMostMaxOutputBlocksPerReport checks the per-report bound on a worker
// without total_kv_blocks: a total of 2^64−1 tokens adds MaxOutputBlocksPerReport blocks, the next
// report as many again, and an exact total within the bound is applied whole.
func TestOutputTokensGrowAtMostMaxOutputBlocksPerReport(t *testing.T) {
	s := newService(t, withOutputTracking(true))
	mustUpsert(t, s, worker(1))
	sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(8))) // 2 prompt blocks, block size 4
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []uint64{2 + picker.MaxOutputBlocksPerReport, 2 + 2*picker.MaxOutputBlocksPerReport} {
		added, err := s.OutputTokens(ctxb(), sel.SelectionID, ^uint64(0))
		if err != nil || added != picker.MaxOutputBlocksPerReport {
			t.Fatalf("report %d: added %d, %v; want %d", i, added, err, picker.MaxOutputBlocksPerReport)
		}
		if got := loadOf(t, s, "model", "", 1, 0).PotentialDecodeBlocks; got != want {
			t.Fatalf("report %d: active blocks %d, want %d", i, got, want)
		}
	}
	if added, _ := s.OutputTokens(ctxb(), sel.SelectionID, 4*(2*picker.MaxOutputBlocksPerReport+10)); added != 10 {
		t.Fatalf("a total 10 blocks beyond the booking added %d", added)
	}
	if err := s.Free(ctxb(), sel.SelectionID); err != nil {
		t.Fatal(err)
	}
	if got := loadOf(t, s, "model", "", 1, 0).PotentialDecodeBlocks; got != 0 {
		t.Fatalf("active blocks %d after free", got)
	}
}
