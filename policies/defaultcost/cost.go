// Package defaultcost is kvepp's built-in cost function and picker (selection-service.md §9),
// exported two ways: as plain functions (CachedTokens, EffectivePrefillTokens, Cost, PickMin,
// PickSoftmax, …) that the picker host also uses for its pinned and exact-target paths, and as a
// policies.WorkerScorer + policies.WorkerPicker pair registered under the policy type
// "dynamo-default-cost-fn" (selection-service.md §17.4).
package defaultcost

import (
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/kvepp/kvepp/policies"
)

// Params are the cost parameters of §9 (and §17.4's dynamo-default-cost-fn parameters): exactly
// the router configuration's cost fields, so the policy takes them from policies.RouterConfig
// unchanged and validates them with its Validate (finite, ≥ 0; the error names the YAML key).
type Params = policies.RouterConfig

// RequestBlocks is ceil(islTokens / blockSize) in blocks; 0 when either is ≤ 0.
func RequestBlocks(islTokens, blockSize int) int {
	if islTokens <= 0 || blockSize <= 0 {
		return 0
	}
	return (islTokens + blockSize - 1) / blockSize
}

// WeightedCachedBlocks is device + host_cache_hit_weight × hostExt + disk_cache_hit_weight ×
// diskExt, in blocks (§9.1; device weight 1, overlap_score_credit not applied). diskExtBlocks
// includes the external tier.
func WeightedCachedBlocks(p Params, deviceBlocks, hostExtBlocks, diskExtBlocks int) float64 {
	return float64(deviceBlocks) + p.HostCacheHitWeight*float64(hostExtBlocks) + p.DiskCacheHitWeight*float64(diskExtBlocks)
}

// CachedTokens is max(0, round(WeightedCachedBlocks × blockSize)) in tokens (§9.1; rounding half
// away from zero). Example: device 2, host 3, disk+external 9, weights 0.5/0.25, bs 16 → 92.
func CachedTokens(p Params, deviceBlocks, hostExtBlocks, diskExtBlocks, blockSize int) int {
	return cachedTokens(&p, deviceBlocks, hostExtBlocks, diskExtBlocks, blockSize)
}

// cachedTokens is CachedTokens without copying p (the per-candidate path).
func cachedTokens(p *Params, deviceBlocks, hostExtBlocks, diskExtBlocks, blockSize int) int {
	return WeightedCachedTokens(p.HostCacheHitWeight, p.DiskCacheHitWeight, deviceBlocks, hostExtBlocks, diskExtBlocks, blockSize)
}

// WeightedCachedTokens is CachedTokens with the two weights given directly (no router
// configuration to copy), for other policies' per-candidate paths: max(0, round((device +
// hostWeight × hostExt + diskWeight × diskExt) × blockSize)) tokens.
func WeightedCachedTokens(hostWeight, diskWeight float64, deviceBlocks, hostExtBlocks, diskExtBlocks, blockSize int) int {
	w := float64(deviceBlocks) + hostWeight*float64(hostExtBlocks) + diskWeight*float64(diskExtBlocks)
	v := math.Round(w * float64(blockSize))
	if !(v > 0) {
		return 0
	}
	if v >= math.MaxInt64 {
		return math.MaxInt64
	}
	return int(v)
}

// EffectivePrefillTokens is isl − min(cached, isl) in tokens (§9.1): the response field and the
// prefill load a booking adds. Negative inputs count as 0.
func EffectivePrefillTokens(islTokens, cachedTokens int) int {
	if islTokens <= 0 {
		return 0
	}
	if cachedTokens < 0 {
		cachedTokens = 0
	}
	return islTokens - min(cachedTokens, islTokens)
}

// PreferredTaintMultiplier is exp(−tanh(S)) for the sum S of the weights of the preferred taints a
// worker carries (§9.3), in (0.368, 2.718): S = 0.5 → 0.6299, S = −0.5 → 1.5874.
func PreferredTaintMultiplier(weightSum float64) float64 { return math.Exp(-math.Tanh(weightSum)) }

// Inputs are one candidate's inputs to Cost (§9.2). Tokens and blocks as named.
type Inputs struct {
	// ISLTokens is the request's input length; BlockSize the partition's block size.
	ISLTokens, BlockSize int
	// TrackPrefillTokens is the request's track_prefill_tokens decision.
	TrackPrefillTokens bool
	// DeviceBlocks, HostExtBlocks, DiskExtBlocks are the raw tier overlap (disk includes external).
	DeviceBlocks, HostExtBlocks, DiskExtBlocks int
	// ActivePrefillTokens is the candidate's active prefill.
	ActivePrefillTokens int
	// MinActivePrefillTokens is the minimum active prefill over the eligible (filtered) candidates;
	// read only when tracking and OverlapScoreCreditDecay > 0.
	MinActivePrefillTokens int
	// DecodeCostBlocks is decode_cost_blocks = active blocks + additional blocks (§10.4).
	DecodeCostBlocks int
	// ActiveRequests is the number of live bookings on the candidate.
	ActiveRequests int
	// TaintMultiplier multiplies the cost when HasTaintMultiplier is set (§9.3).
	TaintMultiplier float64
	// HasTaintMultiplier reports that the request has preferred taints and is not pinned.
	HasTaintMultiplier bool
}

// CreditDecay is the §9.2 credit decay factor in (0, 1]: with tracking and
// OverlapScoreCreditDecay > 0, 1 / (1 + decay × excess_blocks / request_blocks) where
// excess_blocks = (active − min active) / bs; otherwise 1.
func CreditDecay(p Params, in Inputs) float64 {
	if !in.TrackPrefillTokens || p.OverlapScoreCreditDecay <= 0 || in.BlockSize <= 0 {
		return 1
	}
	excess := float64(in.ActivePrefillTokens-in.MinActivePrefillTokens) / float64(in.BlockSize)
	if excess <= 0 {
		return 1
	}
	normalized := excess / float64(max(RequestBlocks(in.ISLTokens, in.BlockSize), 1))
	return 1 / (1 + p.OverlapScoreCreditDecay*normalized)
}

// Cost is the §9.2 per-candidate cost (lower is better), times the §9.3 multiplier when present:
//
//	raw_prefill_blocks = track ? (active_prefill + max(isl, cached_tokens)) / bs : 0
//	credit = credit × decay × device + host_w × host_ext + disk_w × disk_ext
//	cost   = scale × max(0, raw_prefill_blocks − credit) + decode_cost_blocks + request_w × active_requests
//
// Worked example (§9.7): A (device 8, host 4, prefill 1024, decode 132) → 217; B (nothing cached,
// prefill 0, decode 82) → 114; with decay 1 and B's prefill as the minimum, A → 222.33.
func Cost(p Params, in Inputs) float64 {
	return cost(&p, in.ISLTokens, in.BlockSize, in.TrackPrefillTokens, in.DeviceBlocks, in.HostExtBlocks,
		in.DiskExtBlocks, in.ActivePrefillTokens, in.MinActivePrefillTokens, in.DecodeCostBlocks,
		in.ActiveRequests, in.TaintMultiplier, in.HasTaintMultiplier)
}

// cost is Cost on scalar arguments (the per-candidate path of Scorer.Score builds no Inputs and
// copies no Params). The expressions are Cost's, unchanged, so results are bit-identical.
func cost(p *Params, isl, bs int, track bool, device, hostExt, diskExt, active, minActive, decode, requests int,
	taint float64, hasTaint bool) float64 {
	var rawBlocks float64
	decay := 1.0
	if bs > 0 {
		if track {
			// cachedTokens, inlined by hand (too large for the compiler).
			var cached int
			w := float64(device) + p.HostCacheHitWeight*float64(hostExt) + p.DiskCacheHitWeight*float64(diskExt)
			if v := math.Round(w * float64(bs)); v >= math.MaxInt64 {
				cached = math.MaxInt64
			} else if v > 0 {
				cached = int(v)
			}
			rawBlocks = float64(active+max(isl, cached)) / float64(bs)
			if !(p.OverlapScoreCreditDecay <= 0) { // CreditDecay, inlined (a NaN decay is applied, as there)
				excess := float64(active-minActive) / float64(bs)
				if !(excess <= 0) {
					normalized := excess / float64(max(RequestBlocks(isl, bs), 1))
					decay = 1 / (1 + p.OverlapScoreCreditDecay*normalized)
				}
			}
		}
	}
	credit := p.OverlapScoreCredit*decay*float64(device) +
		p.HostCacheHitWeight*float64(hostExt) + p.DiskCacheHitWeight*float64(diskExt)
	uncached := rawBlocks - credit
	if uncached < 0 { // max(0, ·) without math.Max's ±0/NaN handling (a NaN stays NaN and is rejected by the host)
		uncached = 0
	}
	c := p.PrefillLoadScale*uncached + float64(decode) +
		p.DecodeActiveRequestWeight*float64(requests)
	if hasTaint {
		c *= taint
	}
	return c
}

func intN(r *rand.Rand, n int) int {
	if r == nil {
		return rand.IntN(n)
	}
	return r.IntN(n)
}

func float01(r *rand.Rand) float64 {
	if r == nil {
		return rand.Float64()
	}
	return r.Float64()
}

// Pick chooses an index of costs by temperature: PickMin when temperature ≤ 0 (or NaN), else
// PickSoftmax (§9.4). It returns -1 for empty costs. r may be nil (the global source is used).
func Pick(r *rand.Rand, costs []float64, temperature float64) int {
	if !(temperature > 0) {
		return PickMin(r, costs)
	}
	return PickSoftmax(r, costs, temperature)
}

// PickMin returns the index of the minimum cost, breaking exact ties uniformly at random by
// reservoir sampling (the k-th tied candidate replaces the best with probability 1/k), §9.4.
// NaN costs are never chosen unless every cost is NaN (then index 0). Returns -1 for empty costs.
func PickMin(r *rand.Rand, costs []float64) int {
	if len(costs) == 0 {
		return -1
	}
	best, ties := -1, 0
	var bestCost float64
	for i, c := range costs {
		switch {
		case c != c: // NaN
		case best < 0 || c < bestCost:
			best, bestCost, ties = i, c, 1
		case c == bestCost:
			ties++
			if intN(r, ties) == 0 {
				best = i
			}
		}
	}
	if best < 0 {
		return 0
	}
	return best
}

// softmax holds the normalisation of §9.4 for one cost vector.
type softmax struct {
	scale, cmin, denom float64
	uniform            bool
}

// prepare computes the normalisation; ok is false when the costs contain NaN or ±Inf.
func prepare(costs []float64, temperature float64) (s softmax, ok bool) {
	cmin, cmax, maxAbs := math.Inf(1), math.Inf(-1), 0.0
	for _, c := range costs {
		if c != c || math.IsInf(c, 0) {
			return softmax{}, false
		}
		cmin, cmax, maxAbs = math.Min(cmin, c), math.Max(cmax, c), math.Max(maxAbs, math.Abs(c))
	}
	s.scale = 1
	if cmax == cmin {
		s.uniform = true
		return s, true
	}
	if rng := cmax - cmin; math.IsInf(rng, 0) {
		// The range overflows: divide every cost by max |c| first (§9.4).
		s.scale = 1 / maxAbs
		cmin, cmax = cmin*s.scale, cmax*s.scale
	}
	s.cmin = cmin
	s.denom = (cmax - cmin) * temperature
	return s, true
}

func (s softmax) weight(c float64) float64 {
	return math.Exp(-(c*s.scale - s.cmin) / s.denom)
}

// SoftmaxProbabilities appends to dst the §9.4 selection probabilities of costs at temperature
// T > 0: p_i ∝ exp(−(c_i − c_min) / ((c_max − c_min) × T)), uniform when all costs are equal, with
// every cost first divided by max |c_i| when c_max − c_min overflows. Example: costs 10/20/30 →
// 0.5065/0.3072/0.1863 at T = 1 and 0.6652/0.2447/0.0900 at T = 0.5. For T ≤ 0 (or an
// underflowing range × T) it is the PickMin distribution (ties share equally); for costs containing
// NaN or ±Inf it is the PickMin distribution over the minimum.
func SoftmaxProbabilities(costs []float64, temperature float64, dst []float64) []float64 {
	n := len(costs)
	if n == 0 {
		return dst
	}
	s, ok := prepare(costs, temperature)
	if ok && s.uniform {
		for range costs {
			dst = append(dst, 1/float64(n))
		}
		return dst
	}
	if !ok || !(temperature > 0) || s.denom == 0 {
		return minDistribution(costs, dst)
	}
	var sum float64
	for _, c := range costs {
		sum += s.weight(c)
	}
	for _, c := range costs {
		dst = append(dst, s.weight(c)/sum)
	}
	return dst
}

func minDistribution(costs, dst []float64) []float64 {
	best := math.NaN()
	ties := 0
	for _, c := range costs {
		if c == c && (best != best || c < best) {
			best, ties = c, 0
		}
		if c == best {
			ties++
		}
	}
	for _, c := range costs {
		switch {
		case ties == 0:
			dst = append(dst, 1/float64(len(costs)))
		case c == best:
			dst = append(dst, 1/float64(ties))
		default:
			dst = append(dst, 0)
		}
	}
	return dst
}

// PickSoftmax samples an index with the SoftmaxProbabilities distribution (§9.4): it draws
// u ∈ [0, 1) and takes the first index whose cumulative probability is ≥ u (the last index as
// fallback). All-equal costs are chosen uniformly. It allocates nothing. Costs containing NaN or
// ±Inf, T ≤ 0, or a range × T that underflows to 0 fall back to PickMin. Returns -1 for empty costs.
func PickSoftmax(r *rand.Rand, costs []float64, temperature float64) int {
	n := len(costs)
	if n == 0 {
		return -1
	}
	s, ok := prepare(costs, temperature)
	if ok && s.uniform {
		return intN(r, n)
	}
	if !ok || !(temperature > 0) || s.denom == 0 {
		return PickMin(r, costs)
	}
	var sum float64
	for _, c := range costs {
		sum += s.weight(c)
	}
	u := float01(r)
	var cum float64
	for i, c := range costs {
		cum += s.weight(c) / sum
		if cum >= u {
			return i
		}
	}
	return n - 1
}

// errorf builds a provider error naming the policy type.
func errorf(format string, args ...any) error {
	return fmt.Errorf(TypeName+": "+format, args...)
}
