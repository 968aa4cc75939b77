package ledger

import (
	"math"
	"testing"
	"time"
)

// TestImplausiblyFastCompletionsTrainNoRate checks Config.MaxPrefillTokensPerSecond: a completion
// implying more than it (1,000 tokens in 1 ms against a 100,000 tokens/s ceiling) trains neither
// the rank's nor the partition's rate; one at the ceiling or below does.
func TestImplausiblyFastCompletionsTrainNoRate(t *testing.T) {
	l := New(Config{TrackActiveBlocks: true, MaxPrefillTokensPerSecond: 100000})
	complete := func(id string, d time.Duration) {
		mustBook(t, l, Booking{ID: id, Partition: "p", Candidate: w1r0, PrefillTokens: 1000, Admitted: t0})
		if err := l.PrefillCompleteAt(id, t0.Add(d)); err != nil {
			t.Fatal(err)
		}
		if _, err := l.Free(id); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"a", "b", "c", "d"} {
		complete(id, time.Millisecond)
	}
	if ld := l.Load(w1r0); ld.PrefillRateSamples != 0 || l.PartitionPrefillRate("p") != 0 {
		t.Fatalf("instant completions trained a rate: %+v, partition %v", ld, l.PartitionPrefillRate("p"))
	}
	for _, id := range []string{"e", "f", "g"} {
		complete(id, 10*time.Millisecond) // exactly the ceiling
	}
	if got := l.Load(w1r0).PrefillTokensPerSecond; math.Abs(got-100000) > 1e-6 {
		t.Fatalf("rate %v after completions at the ceiling, want 100,000", got)
	}
}
