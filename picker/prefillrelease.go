package picker

import (
	"container/heap"
	"sync"
	"time"

	"github.com/kvepp/kvepp/ledger"
)

// prefillRelease is one estimated prefill completion: at at, the booking id (under attempt) has
// most likely finished its prefill on the engine.
type prefillRelease struct {
	at      time.Time
	id      string
	attempt uint64
}

// releaseHeap orders estimated completions by time (container/heap).
type releaseHeap []prefillRelease

func (h releaseHeap) Len() int           { return len(h) }
func (h releaseHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h releaseHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *releaseHeap) Push(x any)        { *h = append(*h, x.(prefillRelease)) }
func (h *releaseHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// prefillReleases is the queue of estimated prefill completions of PrefillUnobserved bookings.
// Run waits for the earliest and releases what is due; kick tells it an earlier one arrived.
type prefillReleases struct {
	mu   sync.Mutex
	h    releaseHeap
	kick chan struct{}
}

func newPrefillReleases() *prefillReleases { return &prefillReleases{kick: make(chan struct{}, 1)} }

// push queues r, kicking Run when r is the new earliest.
func (q *prefillReleases) push(r prefillRelease) {
	q.mu.Lock()
	heap.Push(&q.h, r)
	first := q.h[0] == r
	q.mu.Unlock()
	if first {
		select {
		case q.kick <- struct{}{}:
		default:
		}
	}
}

// next returns the earliest queued time.
func (q *prefillReleases) next() (time.Time, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.h) == 0 {
		return time.Time{}, false
	}
	return q.h[0].at, true
}

// due removes and returns every release at or before now, earliest first.
func (q *prefillReleases) due(now time.Time, dst []prefillRelease) []prefillRelease {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.h) > 0 && !q.h[0].at.After(now) {
		dst = append(dst, heap.Pop(&q.h).(prefillRelease))
	}
	return dst
}

// len returns the number of queued releases.
func (q *prefillReleases) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.h)
}

// PrefillEstimate is the estimated prefill completion of a booking: when the worker rank will
// most likely have finished it, and the rate the estimate used.
type PrefillEstimate struct {
	// At is the estimated completion time.
	At time.Time
	// TokensPerSecond is the prefill rate used: the rank's measured rate, else the partition's
	// pooled one, else Config.AssumedPrefillTokensPerSecond.
	TokensPerSecond float64
}

// estimatePrefill estimates when booking b, of an isl-token prompt, finishes its prefill: its
// admission plus the work queued ahead of it (AheadPrefillTokens, tokens) and its own, at the
// rank's measured prefill rate, else at the rate pooled over its partition, else at
// Config.AssumedPrefillTokensPerSecond; ok is false when no rate is measured and none is
// assumed. Its own work is prefillWork: its PrefillTokens, each stretched by the attention over
// the tokens before it.
func (s *Service) estimatePrefill(b ledger.Booking, isl uint64) (PrefillEstimate, bool) {
	rate := s.ledger.Load(b.Candidate).PrefillTokensPerSecond
	if rate <= 0 {
		rate = s.ledger.PartitionPrefillRate(b.Partition)
	}
	if rate <= 0 {
		rate = s.cfg.AssumedPrefillTokensPerSecond
	}
	if rate <= 0 {
		return PrefillEstimate{}, false
	}
	work := float64(b.AheadPrefillTokens) + prefillWork(b.PrefillTokens, isl, s.cfg.PrefillAttentionTokens)
	secs := min(work/rate, maxPrefillEstimate.Seconds())
	return PrefillEstimate{At: b.Admitted.Add(time.Duration(secs * float64(time.Second))), TokensPerSecond: rate}, true
}

// maxPrefillEstimate bounds the estimated prefill time: at a vanishing rate (an assumed rate of
// 1e-12 tokens/s is a valid setting) the work would overflow a time.Duration into a negative one
// and release the booking at once, and the longest prompt (MaxISLTokens), squared by the attention
// term, takes 82 h at 10,000 tokens/s; the expiry guard frees a booking long before a day passes.
const maxPrefillEstimate = 24 * time.Hour

// prefillWork is the prefill work, in tokens at the linear rate, of computing the last uncached
// of isl prompt tokens: a prompt token's attention reads every token before it, so at context c
// it costs 1 + c/attention tokens (attention = Config.PrefillAttentionTokens; 0 = linear), and
// the uncached tokens, which follow the isl − uncached cached ones, cost
// uncached × (1 + (cached + uncached/2) / attention). Linear in the uncached tokens, a 120k-token
// prompt was estimated at half its prefill time on the faithful engine (enginesim's
// Llama-3.1-8B/A100 profile, where attention takes 70 % of it), so its booking was released while
// the engine still worked on it, and requests were drawn onto that busy worker.
func prefillWork(uncached, isl uint64, attention float64) float64 {
	own := float64(uncached)
	if attention <= 0 {
		return own
	}
	cached := max(float64(isl)-own, 0)
	return own * (1 + (cached+own/2)/attention)
}

// schedulePrefillRelease queues the estimated prefill completion of the PrefillUnobserved booking
// id, of an isl-token prompt, when Config.EstimatePrefillCompletion is on and a prefill rate is known or assumed; otherwise the
// booking keeps its prefill tokens until its caller completes or frees it.
func (s *Service) schedulePrefillRelease(id string, isl uint64) {
	if !s.cfg.EstimatePrefillCompletion {
		return
	}
	b, ok := s.ledger.Lookup(id)
	if !ok {
		return
	}
	est, ok := s.estimatePrefill(b, isl)
	if !ok {
		return
	}
	s.releases.push(prefillRelease{at: est.At, id: id, attempt: b.Attempt})
}

// ReleaseDuePrefills releases the prefill part of every PrefillUnobserved booking whose estimated
// completion is at or before now (still live under the same attempt and not completed
// otherwise), admits what that frees from the partition queues (§13.3), and returns how many it
// released. Run calls it when the earliest estimate is due; tests call it with a fake clock.
func (s *Service) ReleaseDuePrefills(now time.Time) int {
	released := 0
	for _, r := range s.releases.due(now, nil) {
		b, ok := s.ledger.Lookup(r.id)
		if !ok || b.Attempt != r.attempt || b.PrefillCompleted {
			continue
		}
		if s.ledger.PrefillCompleteAttempt(r.id, r.attempt) == nil {
			released++
			// Peers mirror the booking with its prefill; they release it when this replica
			// says so, as for an observed completion (selection-service.md §15.4).
			s.publishLifecycle(ledger.SlotPrefillComplete, &b)
			if s.queued.Load() > 0 {
				s.kickName(b.Partition)
			}
		}
	}
	return released
}

// PendingPrefillReleases returns the number of estimated prefill completions not yet due.
func (s *Service) PendingPrefillReleases() int { return s.releases.len() }

// runPrefillReleases is Run's part that releases estimated prefill completions when they are due.
func (s *Service) runPrefillReleases(done <-chan struct{}) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		d := time.Hour
		if at, ok := s.releases.next(); ok {
			d = max(at.Sub(s.now()), 0)
		}
		t.Reset(d)
		select {
		case <-done:
			return
		case <-s.releases.kick:
		case <-t.C:
			s.ReleaseDuePrefills(s.now())
		}
	}
}

// PrefillRateCeilingFactor bounds the prefill rates the service measures: an observed completion
// (a streamed response's first chunk, a prefill_complete call) whose work over its time implies
// more than this × Config.AssumedPrefillTokensPerSecond trains no rate (ledger
// Config.MaxPrefillTokensPerSecond), since it did not time a prefill — an instant in-stream error,
// a cached reply, or a proxy's early empty chunk. Without the bound four such answers to 24k-token
// prompts measured ~10^7 tokens/s and the next non-streamed 24k-token booking released its prefill
// at once instead of after ~3 s. Dropping them (rather than clamping them to the ceiling) leaves
// the estimate where it was, the safe side: a prefill held a little long rather than released
// while the engine still works on it. The cost: an engine truly more than 10× faster than the
// assumed rate is never measured (set DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND closer to it).
// With an assumed rate of 0 every sample counts.
const PrefillRateCeilingFactor = 10
