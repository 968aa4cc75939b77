package picker_test

import (
	"testing"
	"time"

	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
	"github.com/kvepp/kvepp/policies"
)

// prompt returns n distinct token ids (distinct prompts never share a cached prefix).
func prompt(n int) []uint32 {
	promptSeq++
	out := make([]uint32, n)
	for i := range out {
		out[i] = promptSeq<<20 + uint32(i)
	}
	return out
}

var promptSeq uint32

// trainRate books and completes three observed requests of 1,000 tokens on worker 1, 100 ms each
// on the fake clock: a measured rate of 10,000 tokens/s.
func trainRate(t *testing.T, s *picker.Service, clk *pickertest.Clock) {
	t.Helper()
	for i := 0; i < 3; i++ {
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(1000)))
		if err != nil {
			t.Fatal(err)
		}
		clk.Advance(100 * time.Millisecond)
		if err := s.PrefillComplete(ctxb(), sel.SelectionID); err != nil {
			t.Fatal(err)
		}
		if err := s.Free(ctxb(), sel.SelectionID); err != nil {
			t.Fatal(err)
		}
	}
}

// releasedAt checks that exactly one estimated release is queued and that it is released at
// due after now on clk, not a millisecond earlier (advancing clk to due).
func releasedAt(t *testing.T, s *picker.Service, clk *pickertest.Clock, due time.Duration) {
	t.Helper()
	if n := s.PendingPrefillReleases(); n != 1 {
		t.Fatalf("%d releases queued, want 1", n)
	}
	clk.Advance(due - time.Millisecond)
	if n := s.ReleaseDuePrefills(clk.Now()); n != 0 {
		t.Fatalf("released %d after %v, before the estimate", n, due-time.Millisecond)
	}
	clk.Advance(time.Millisecond)
	if n := s.ReleaseDuePrefills(clk.Now()); n != 1 {
		t.Fatalf("released %d at the estimate (%v), want 1", n, due)
	}
}

// linearEstimate estimates prefill work linearly in the uncached tokens (no attention term), so
// the rates and queues of these tests give round times.
func linearEstimate(c *picker.Config) { c.PrefillAttentionTokens = 0 }

func TestPrefillOfUnobservedResponsesIsReleasedOnTheEstimate(t *testing.T) {
	clk := pickertest.NewClock(time0)
	s := newService(t, func(c *picker.Config) { c.Now = clk.Now }, linearEstimate)
	mustUpsert(t, s, worker(1))
	unobserved := func(r *picker.SelectRequest) { r.PrefillUnobserved = true }

	t.Run("without a measured rate the prefill is released at the assumed rate", func(t *testing.T) {
		// No response streamed yet: 2,000 tokens at the assumed 10,000 tokens/s finish 200 ms
		// after admission.
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(2000), unobserved))
		if err != nil {
			t.Fatal(err)
		}
		releasedAt(t, s, clk, 200*time.Millisecond)
		if got := loadOf(t, s, "model", "default", 1, 0).PotentialPrefillTokens; got != 0 {
			t.Fatalf("active prefill %d after the release, want 0", got)
		}
		_ = s.Free(ctxb(), sel.SelectionID)
	})
	t.Run("with no assumed rate and none measured the prefill is held until the response ends", func(t *testing.T) {
		clk := pickertest.NewClock(time0)
		s := newService(t, func(c *picker.Config) { c.Now = clk.Now; c.AssumedPrefillTokensPerSecond = 0 })
		mustUpsert(t, s, worker(1))
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(2000), unobserved))
		if err != nil {
			t.Fatal(err)
		}
		if n := s.PendingPrefillReleases(); n != 0 {
			t.Fatalf("%d releases queued without any rate", n)
		}
		clk.Advance(time.Hour)
		if n := s.ReleaseDuePrefills(clk.Now()); n != 0 || loadOf(t, s, "model", "default", 1, 0).PotentialPrefillTokens != 2000 {
			t.Fatalf("released %d, load %+v", n, loadOf(t, s, "model", "default", 1, 0))
		}
		_ = s.Free(ctxb(), sel.SelectionID)
	})

	trainRate(t, s, clk)

	t.Run("the prefill is released when the queued and own work is done at the measured rate", func(t *testing.T) {
		// Booked behind a streamed request of 3,000 tokens: 3,000 + 2,000 tokens at 10,000
		// tokens/s finish 500 ms after admission.
		first, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(3000)))
		if err != nil {
			t.Fatal(err)
		}
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(2000), unobserved))
		if err != nil {
			t.Fatal(err)
		}
		releasedAt(t, s, clk, 500*time.Millisecond)
		if got := loadOf(t, s, "model", "default", 1, 0).PotentialPrefillTokens; got != 3000 {
			t.Fatalf("active prefill %d, want only the streamed request's 3,000 left", got)
		}
		// The late signal at the end of the response changes nothing and trains nothing.
		if err := s.PrefillComplete(ctxb(), sel.SelectionID); err != nil {
			t.Fatal(err)
		}
		for _, id := range []string{first.SelectionID, sel.SelectionID} {
			if err := s.Free(ctxb(), id); err != nil {
				t.Fatal(err)
			}
		}
	})
	t.Run("a freed booking is not released later", func(t *testing.T) {
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(1000), unobserved))
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Free(ctxb(), sel.SelectionID); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Second)
		if n := s.ReleaseDuePrefills(clk.Now()); n != 0 {
			t.Fatalf("released %d freed bookings", n)
		}
	})
	t.Run("the opt-out holds every prefill until the response ends", func(t *testing.T) {
		clk := pickertest.NewClock(time0)
		s := newService(t, func(c *picker.Config) { c.Now = clk.Now; c.EstimatePrefillCompletion = false })
		mustUpsert(t, s, worker(1))
		trainRate(t, s, clk)
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(1000), unobserved)); err != nil {
			t.Fatal(err)
		}
		if n := s.PendingPrefillReleases(); n != 0 {
			t.Fatalf("%d releases queued with the estimate off", n)
		}
	})
}

// TestALongPromptIsReleasedAfterItsAttentionBoundPrefill: attention makes a prompt token's prefill
// cost grow with the tokens before it, so a long or long-cached prompt is released later than
// its uncached tokens at the rate would say (linear, and with the earlier 1.25 margin, the
// 96,000-token prompt below was released at 12 s, 7 s before the model says it finishes).
func TestALongPromptIsReleasedAfterItsAttentionBoundPrefill(t *testing.T) {
	unobserved := func(r *picker.SelectRequest) { r.PrefillUnobserved = true }
	t.Run("an uncached prompt costs its tokens times one plus half its length over the attention length", func(t *testing.T) {
		clk := pickertest.NewClock(time0)
		s := newService(t, func(c *picker.Config) { c.Now = clk.Now })
		if got := picker.DefaultConfig().PrefillAttentionTokens; got != 48000 {
			t.Fatalf("default attention length %v, want 48,000", got)
		}
		mustUpsert(t, s, worker(1))
		// 96,000 × (1 + 48,000/48,000) = 192,000 tokens of work at the assumed 10,000 tokens/s.
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(96000), unobserved))
		if err != nil {
			t.Fatal(err)
		}
		releasedAt(t, s, clk, 19200*time.Millisecond)
		_ = s.Free(ctxb(), sel.SelectionID)
	})
	t.Run("cached tokens before the uncached ones make each of them cost more", func(t *testing.T) {
		clk := pickertest.NewClock(time0)
		s := newService(t, func(c *picker.Config) { c.Now = clk.Now; c.PrefillAttentionTokens = 40000 })
		mustUpsert(t, s, worker(1))
		// Routing the first 32,000 tokens records them on worker 1 (approximate mode), so the
		// second request computes only its last 16,000: 16,000 × (1 + (32,000 + 8,000)/40,000) =
		// 32,000 tokens of work, 3.2 s at 10,000 tokens/s, twice the linear estimate.
		history := prompt(32000)
		first, err := s.SelectAndReserve(ctxb(), tokenReq(history))
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Free(ctxb(), first.SelectionID); err != nil {
			t.Fatal(err)
		}
		next := append(append([]uint32(nil), history...), prompt(16000)...)
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(next, unobserved))
		if err != nil {
			t.Fatal(err)
		}
		if got := loadOf(t, s, "model", "default", 1, 0).PotentialPrefillTokens; got != 16000 {
			t.Fatalf("booked prefill %d, want the 16,000 uncached tokens", got)
		}
		releasedAt(t, s, clk, 3200*time.Millisecond)
		_ = s.Free(ctxb(), sel.SelectionID)
	})
	t.Run("the estimate of the longest prompt is bounded at a day", func(t *testing.T) {
		// 16,777,216 tokens would take 82 h of work at 10,000 tokens/s.
		clk := pickertest.NewClock(time0)
		s := newService(t, func(c *picker.Config) { c.Now = clk.Now })
		mustUpsert(t, s, worker(1))
		isl := uint64(picker.MaxISLTokens)
		_, err := s.SelectAndReserve(ctxb(), picker.SelectRequest{ModelName: "model", SelectionID: "huge", PrefillUnobserved: true,
			Prompt: picker.Prompt{HashForm: true, BlockHashes: []uint64{}, SequenceHashes: []uint64{}, ISLTokens: isl, ISLTokensSet: true}})
		if err != nil {
			t.Fatal(err)
		}
		releasedAt(t, s, clk, 24*time.Hour)
	})
	t.Run("a vanishing rate does not overflow the estimate into the past", func(t *testing.T) {
		clk := pickertest.NewClock(time0)
		s := newService(t, func(c *picker.Config) { c.Now = clk.Now; c.AssumedPrefillTokensPerSecond = 1e-12 })
		mustUpsert(t, s, worker(1))
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(1000), unobserved)); err != nil {
			t.Fatal(err)
		}
		releasedAt(t, s, clk, 24*time.Hour)
	})
}

func TestPoliciesSeeTheMeasuredEngineLoad(t *testing.T) {
	clk := pickertest.NewClock(time0)
	var seen policies.EngineLoad
	recordLoad := &engineProbe{seen: &seen}
	s := newService(t, func(c *picker.Config) { c.Now = clk.Now }, withPolicy(nil, []policies.WorkerScorer{recordLoad}, lowestCost))
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.TotalKVBlocks = u64(5000) }))
	trainRate(t, s, clk)
	if _, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(400))); err != nil {
		t.Fatal(err)
	}
	if _, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(40))); err != nil {
		t.Fatal(err)
	}
	want := policies.EngineLoad{PrefillRequests: 1, PrefillTokensPerSecond: 10000, PrefillRateSamples: 3,
		PoolPrefillTokensPerSecond: 10000, ActiveBlocks: 100, TotalKVBlocks: 5000, PoolCandidates: 1}
	seen.PoolArrivalsPerSecond = 0 // measured from the fake clock's booking times; checked below
	if seen.PrefillTokensPerSecond < 9999 || seen.PrefillTokensPerSecond > 10001 || seen.PoolPrefillTokensPerSecond < 9999 {
		t.Fatalf("engine load %+v, want a measured 10,000 tokens/s", seen)
	}
	seen.PrefillTokensPerSecond, seen.PoolPrefillTokensPerSecond = 10000, 10000
	if seen != want {
		t.Fatalf("engine load %+v, want %+v", seen, want)
	}
}

// engineProbe is a scorer that records the engine load it is shown (cost 0).
type engineProbe struct{ seen *policies.EngineLoad }

func (p *engineProbe) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsLoad }

func (p *engineProbe) Score(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	*p.seen = *c.Load().Engine()
	return 0, nil
}

func TestAnEstimatedPrefillReleaseReachesThePeers(t *testing.T) {
	clk := pickertest.NewClock(time0)
	peer := newService(t, func(c *picker.Config) { c.Now = clk.Now })
	mustUpsert(t, peer, worker(1))
	rec := &recorder{to: peer, origin: 7}
	s := newService(t, withSlotPublisher(rec), func(c *picker.Config) { c.Now = clk.Now })
	mustUpsert(t, s, worker(1))
	trainRate(t, s, clk)

	sel, err := s.SelectAndReserve(ctxb(), tokenReq(prompt(2000), func(r *picker.SelectRequest) { r.PrefillUnobserved = true }))
	if err != nil {
		t.Fatal(err)
	}
	if got := loadOf(t, peer, "model", "default", 1, 0).PotentialPrefillTokens; got != 2000 {
		t.Fatalf("the peer's mirror holds %d prefill tokens, want 2000", got)
	}
	clk.Advance(time.Second) // 2,000 tokens at 10,000 tokens/s: due after about 200 ms
	if n := s.ReleaseDuePrefills(clk.Now()); n != 1 {
		t.Fatalf("released %d, want 1", n)
	}
	if got := loadOf(t, peer, "model", "default", 1, 0).PotentialPrefillTokens; got != 0 {
		t.Fatalf("after the estimated release the peer still holds %d prefill tokens", got)
	}
	if err := s.Free(ctxb(), sel.SelectionID); err != nil {
		t.Fatal(err)
	}
	if got := loadOf(t, peer, "model", "default", 1, 0).ActiveRequests; got != 0 {
		t.Fatalf("the peer holds %d requests after the free", got)
	}
}
