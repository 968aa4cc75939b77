package picker_test

import (
	"testing"
	"time"

	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
)

// TestInstantAnswersDoNotTrainThePrefillRate replays audit 9's burst on a fake clock: four
// streamed 24k-token prompts whose first chunk comes 1 ms after admission (≈ 2.4·10^7 tokens/s,
// far beyond PrefillRateCeilingFactor × the assumed 10,000 tokens/s) train no rate, so the next
// non-streamed prompt is still released at the assumed rate; a plausible completion (within the
// factor) after them still counts.
func TestInstantAnswersDoNotTrainThePrefillRate(t *testing.T) {
	clk := pickertest.NewClock(time0)
	s := newService(t, func(c *picker.Config) { c.Now = clk.Now }, linearEstimate)
	mustUpsert(t, s, worker(1))
	streamed(t, s, clk, 4, 24000, time.Millisecond)
	sel, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(2000), func(r *picker.SelectRequest) { r.PrefillUnobserved = true }))
	if err != nil {
		t.Fatal(err)
	}
	releasedAt(t, s, clk, 200*time.Millisecond) // 2,000 tokens at the assumed 10,000 tokens/s
	if err := s.Free(ctxb(), sel.SelectionID); err != nil {
		t.Fatal(err)
	}
	streamed(t, s, clk, 3, 1000, 50*time.Millisecond) // 20,000 tokens/s: plausible, counted
	if _, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(2000), func(r *picker.SelectRequest) { r.PrefillUnobserved = true })); err != nil {
		t.Fatal(err)
	}
	releasedAt(t, s, clk, 100*time.Millisecond) // 2,000 tokens at the measured 20,000 tokens/s
}

// streamed books n observed requests of isl tokens one after another, completing each one's
// prefill d after its admission on clk and freeing it.
func streamed(t *testing.T, s *picker.Service, clk *pickertest.Clock, n, isl int, d time.Duration) {
	t.Helper()
	for range n {
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(isl)))
		if err == nil {
			clk.Advance(d)
			err = s.PrefillComplete(ctxb(), sel.SelectionID)
		}
		if err == nil {
			err = s.Free(ctxb(), sel.SelectionID)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}
