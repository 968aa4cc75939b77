package enginesim

import (
	"math"
	"time"
)

// Histogram layout: bucket 0 holds durations below histogramBase, bucket i ≥ 1 durations in
// [base·2^((i−1)/16), base·2^(i/16)), the last bucket everything above; 16 buckets per doubling
// keep a quantile within 4.4 % of the exact value.
const (
	histogramBase    = 10 * time.Microsecond
	histogramPerOct  = 16
	histogramBuckets = 25*histogramPerOct + 2 // up to 10 µs · 2^25 ≈ 335 s
)

// LatencyHistogram counts durations in logarithmic buckets (16 per doubling from 10 µs to about
// 335 s), so quantiles over millions of samples cost a fixed 3 KiB. The zero value is empty and
// ready to use.
type LatencyHistogram struct {
	counts [histogramBuckets]uint64
	n      uint64
	sum    time.Duration
}

func histogramBucket(d time.Duration) int {
	if d < histogramBase {
		return 0
	}
	i := 1 + int(math.Floor(histogramPerOct*math.Log2(float64(d)/float64(histogramBase))))
	return min(i, histogramBuckets-1)
}

// Add counts d n times.
func (h *LatencyHistogram) Add(d time.Duration, n int) {
	if n <= 0 {
		return
	}
	h.counts[histogramBucket(d)] += uint64(n)
	h.n += uint64(n)
	h.sum += d * time.Duration(n)
}

// Merge adds every sample of o.
func (h *LatencyHistogram) Merge(o *LatencyHistogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.sum += o.sum
}

// Count returns the number of samples.
func (h *LatencyHistogram) Count() uint64 { return h.n }

// Mean returns the mean sample, 0 when empty.
func (h *LatencyHistogram) Mean() time.Duration {
	if h.n == 0 {
		return 0
	}
	return h.sum / time.Duration(h.n)
}

// Quantile returns the p-quantile (0 ≤ p ≤ 1) by nearest rank, as the geometric middle of its
// bucket (within 4.4 % of the exact sample), 0 when empty.
func (h *LatencyHistogram) Quantile(p float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(p * float64(h.n)))
	rank = max(1, min(rank, h.n))
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			if i == 0 {
				return histogramBase / 2
			}
			mid := (float64(i) - 0.5) / histogramPerOct
			return time.Duration(float64(histogramBase) * math.Exp2(mid))
		}
	}
	return time.Duration(float64(histogramBase) * math.Exp2(float64(histogramBuckets-1)/histogramPerOct))
}
