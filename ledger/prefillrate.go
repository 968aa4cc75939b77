package ledger

import "time"

// prefillRateDecay is the weight each new sample takes from the old estimate: the estimate
// follows about the last 32 observed completions.
const prefillRateDecay = 1.0 / 32

// prefillRateMinSamples is how many observed completions a candidate needs before its rate is
// reported.
const prefillRateMinSamples = 3

// prefillRate estimates how fast a candidate prefills: the ratio of exponentially weighted sums
// of the prefill work each observed request waited for (the work queued ahead of it plus its
// own, tokens) and the time it took from booking to its first token (seconds). As a ratio of sums
// it weighs requests by their duration, so the fixed per-request overhead of tiny prefills lowers
// the rate only as much as it costs in time.
type prefillRate struct {
	work, secs float64
	samples    int
}

// observe adds one completion: work tokens done in d.
func (p *prefillRate) observe(work uint64, d time.Duration) {
	if d <= 0 {
		return
	}
	p.work = p.work*(1-prefillRateDecay) + float64(work)
	p.secs = p.secs*(1-prefillRateDecay) + d.Seconds()
	p.samples++
}

// tokensPerSecond is the estimate, 0 before prefillRateMinSamples observations.
func (p *prefillRate) tokensPerSecond() float64 {
	if p.samples < prefillRateMinSamples || p.secs <= 0 {
		return 0
	}
	return p.work / p.secs
}

// PrefillCompleteAt is PrefillComplete for a completion the caller observed at now (the first
// response chunk of a streamed response, or a client's prefill_complete call): unless the
// booking is Unobserved or its prefill was already complete, it also trains the candidate's
// prefill rate (Load.PrefillTokensPerSecond) with the work the booking waited for,
// AheadPrefillTokens + PrefillTokens, over the time since it was admitted — unless that implies a
// rate above Config.MaxPrefillTokensPerSecond. Errors: ErrNotFound
// for an id that is not a live booking.
func (l *Ledger) PrefillCompleteAt(id string, now time.Time) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.liveSlot(id)
	if s == nil {
		return notFound(id)
	}
	if l.completePrefill(s) && !s.b.Unobserved && s.b.PrefillTokens > 0 {
		work, d := satAddU64(s.b.AheadPrefillTokens, s.b.PrefillTokens), now.Sub(s.b.Admitted)
		if l.maxRate > 0 && float64(work) > l.maxRate*d.Seconds() {
			return nil // implausibly fast: not a prefill (Config.MaxPrefillTokensPerSecond)
		}
		s.rank.rate.observe(work, d)
		pr := l.partRates[s.b.Partition]
		if pr == nil {
			pr = &prefillRate{}
			l.partRates[s.b.Partition] = pr
		}
		pr.observe(work, d)
	}
	return nil
}

// PartitionPrefillRate is the prefill rate pooled over every candidate of bookings with
// Booking.Partition == partition (the same estimator as Load.PrefillTokensPerSecond, fed by the
// observed completions of all of them), tokens/s; 0 until enough completions were observed.
func (l *Ledger) PartitionPrefillRate(partition string) float64 {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if pr := l.partRates[partition]; pr != nil {
		return pr.tokensPerSecond()
	}
	return 0
}

// PrefillCompleteAttempt is PrefillComplete restricted to the booking with the given Attempt
// (see FreeAttempt), for a completion decided earlier or elsewhere — an estimated release, or a
// peer replica's MarkPrefillCompleted for a mirrored booking: if id is live under a different
// attempt (released and booked again since the caller resolved it) it returns ErrNotFound and
// leaves the newer booking untouched (§10.6). Idempotent on a live booking; it trains no prefill
// rate.
func (l *Ledger) PrefillCompleteAttempt(id string, attempt uint64) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.liveSlot(id)
	if s == nil || s.b.Attempt != attempt {
		return notFound(id)
	}
	l.completePrefill(s)
	return nil
}

// satAddU64 is a + b saturating at the largest uint64.
func satAddU64(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return ^uint64(0)
}

// arrivalRate estimates how often bookings arrive: an exponentially weighted mean of the time
// between consecutive bookings (about the last 64), whose inverse is the rate.
type arrivalRate struct {
	last     time.Time
	interval float64 // seconds
	samples  int
}

// observe records a booking admitted at t.
func (a *arrivalRate) observe(t time.Time) {
	if !a.last.IsZero() {
		if d := t.Sub(a.last).Seconds(); d >= 0 {
			if a.samples == 0 {
				a.interval = d
			} else {
				a.interval += (d - a.interval) / 64
			}
			a.samples++
		}
	}
	if t.After(a.last) {
		a.last = t
	}
}

// perSecond is the estimated arrival rate, 0 before prefillRateMinSamples intervals.
func (a *arrivalRate) perSecond() float64 {
	if a.samples < prefillRateMinSamples || a.interval <= 0 {
		return 0
	}
	return 1 / a.interval
}

// PartitionArrivalRate is how many bookings per second arrive for Booking.Partition ==
// partition (the recent mean time between them, inverted), 0 until a few were booked.
func (l *Ledger) PartitionArrivalRate(partition string) float64 {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if a := l.arrivals[partition]; a != nil {
		return a.perSecond()
	}
	return 0
}
