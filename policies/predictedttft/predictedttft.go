// Package predictedttft is the `predicted-ttft` worker-selection policy, kvepp's default for the
// EPP: it sends each request to the worker where it will most likely see its first token soonest,
// counting the delay its own prefill work imposes on the requests that arrive after it.
//
// Time to first token on a vLLM-style engine is set by the prefill work ahead of the request and
// its own uncached tokens, at the speed that engine prefills. TTFTScorer predicts it per worker
// from the host's measurements (selection-service.md §17.3 LOAD, with kvepp's EngineLoad
// extension):
//
//	ttft_w = (queued_prefill_w + uncached_w) / rate_w  +  kv_wait_w
//
// where queued_prefill_w is the worker's booked prefill tokens not yet complete, uncached_w the
// request's tokens the worker has not cached (the longer of the prefix the index reports and the
// prefix live bookings on the worker are computing; host and disk tiers weighted as the built-in
// cost does), rate_w the worker's measured prefill rate blended with the pool's (tokens/s;
// prefill_tokens_per_second until one is measured), and kv_wait_w the time the request would wait
// for KV memory: when the blocks the worker's live bookings hold plus the request's new blocks
// exceed its total_kv_blocks, the overflow at the same rate.
//
// DelayAwarePicker then adds what the choice costs the requests that come next. The request's
// own prefill (uncached_w / rate_w seconds of the worker's time) delays the requests that arrive
// before that work is absorbed, about arrivals_per_worker × horizon_w of them, where
// arrivals_per_worker is the pool's measured booking rate over its candidates:
//
//	cost_w    = ttft_w + delay_weight · (uncached_w / rate_w) · arrivals_per_worker · horizon_w
//	                   + sticky_weight · max(0, uncached_w − min_{v roomy} uncached_v) / rate_w
//	                   + recompute_weight · (uncached_w − min_v uncached_v) / rate_w
//	horizon_w = max(ttft_w, median_v ttft_v)
//
// The horizon is at least the pool's typical backlog, not only the chosen worker's own: a
// balancing router sends the next arrivals to whichever worker is lightest, so work added to an
// idle worker is not absorbed by that worker's idleness but pushes the pool's backlog back for
// as long as the typical worker needs to drain it. Charging it only at the idle worker's own TTFT
// made recomputing a conversation's history on an idle worker look almost free, and the policy
// left the worker that cached it whenever that worker was slightly busier. The median (the lower
// one for an even count), not the mean, keeps one overloaded worker from raising everyone's
// horizon: a mean would make recompute look dearer the hotter the hot worker got, and keep
// routing to it.
//
// On a quiet pool the charge is small and the policy picks the fastest first token; as traffic
// grows, work placed on a worker that caches less of the request costs more, so conversations stay
// with the workers that hold their history.
//
// The sticky term keeps a conversation on the worker holding its history while that worker's engine
// is roomy: its live bookings and the request hold at most sticky_kv_fraction of its
// total_kv_blocks (heldBlocks). Without it the policy left that worker whenever a long prompt
// queued there made it a few seconds busier, and recomputed the history elsewhere: on the Mooncake
// traces at 100,000 blocks per worker that was most of the hits lost against an unbounded cache
// (2.7 of 3.6 points on the conversation trace, 2.1 of 3.9 on the synthetic one, where LRU eviction
// costs the rest), while the home worker's KV was 2–25 % booked. A roomy engine has KV to spare for
// its running requests' output and keeps its prefix cache, so waiting there costs only the prefill
// queue the prediction sees. The guard is what makes the weight safe: charged against any worker
// (recompute_weight), stickiness piles conversations onto the workers that hold them until their
// output outgrows the memory, a queue the prediction does not see (it prices a KV overflow at the
// prefill rate, but the overflow clears only as running responses finish); on the 160-conversation
// demo TTFT p99 grew from 0.8 s to 8–18 s. The charge is measured against the best-cached roomy
// candidate, and is 0 when no candidate is roomy or none reports total_kv_blocks. The optional
// recompute_weight (default 0) charges the prefill a choice makes the pool redo against every
// candidate at a fixed weight, for operators who value cache hits over time to first token.
// Candidates whose cost is within near_tie_tokens of prefill work of the lowest are near ties: the
// lighter decode load after placing the request (decode_cost_blocks) wins, then the lower cost,
// exact ties uniformly at random.
package predictedttft

import (
	"cmp"
	"fmt"
	"math"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
	"github.com/kvepp/kvepp/policies/leastbusy"
)

// TypeName is the registered policy type (selection-service.md §17.4).
const TypeName = "predicted-ttft"

// Defaults of the parameters.
const (
	DefaultPrefillTokensPerSecond = 10000 // tokens/s, until a worker's rate is measured
	DefaultDelayWeight            = 1     // weight of the delay imposed on later arrivals
	DefaultRecomputeWeight        = 0     // weight of the prefill the pool redoes
	DefaultKVPressureWeight       = 1     // weight of the KV wait
	DefaultNearTieTokens          = 1024  // tokens of prefill work within which costs tie
	DefaultStickyWeight           = 20    // weight of the recompute a choice makes, against roomy workers
	DefaultStickyKVFraction       = 0.2   // share of its KV a worker may hold booked and stay roomy
)

// Params are the policy's parameters (see the package documentation and README.md).
type Params struct {
	// PrefillTokensPerSecond is the prefill rate assumed for a worker whose rate the host has not
	// measured yet, tokens/s (> 0).
	PrefillTokensPerSecond float64
	// DelayWeight scales the delay the request's prefill imposes on later arrivals (≥ 0).
	DelayWeight float64
	// RecomputeWeight charges the prefill work a choice makes the pool redo, (uncached − min
	// uncached) / rate, at this weight (≥ 0).
	RecomputeWeight float64
	// StickyWeight charges the prefill work a choice redoes that a roomy candidate has cached,
	// (uncached − min over roomy candidates of uncached, at least 0) / rate, at this weight (≥ 0;
	// 0 turns it off). A candidate is roomy when its engine's KV after placing the request holds
	// at most StickyKVFraction of its total_kv_blocks in live bookings (package documentation).
	StickyWeight float64
	// StickyKVFraction is the share of a candidate's total_kv_blocks (0..1) its live bookings and
	// the request may hold for it to count as roomy; a candidate without total_kv_blocks never
	// does.
	StickyKVFraction float64
	// KVPressureWeight scales the predicted wait for KV memory (≥ 0; 0 turns it off).
	KVPressureWeight float64
	// NearTieTokens is the prefill work (tokens, ≥ 0) within which two candidates' costs count as
	// equal: among the candidates within NearTieTokens / rate of the lowest cost the one with the
	// lightest decode load after placing the request (decode_cost_blocks) wins, then the lower
	// cost, exact ties uniformly at random.
	NearTieTokens float64
	// HostCacheHitWeight and DiskCacheHitWeight weigh host-pinned and disk (+ external) overlap
	// beyond the device prefix as cached tokens, as the built-in cost does (router configuration).
	HostCacheHitWeight, DiskCacheHitWeight float64
}

// DefaultParams returns the defaults with the cache-hit weights of cfg.
func DefaultParams(cfg policies.RouterConfig) Params {
	return Params{
		PrefillTokensPerSecond: DefaultPrefillTokensPerSecond,
		DelayWeight:            DefaultDelayWeight,
		RecomputeWeight:        DefaultRecomputeWeight,
		StickyWeight:           DefaultStickyWeight,
		StickyKVFraction:       DefaultStickyKVFraction,
		KVPressureWeight:       DefaultKVPressureWeight,
		NearTieTokens:          DefaultNearTieTokens,
		HostCacheHitWeight:     cfg.HostCacheHitWeight,
		DiskCacheHitWeight:     cfg.DiskCacheHitWeight,
	}
}

// validate checks the parameters; errors name the YAML key.
func (p Params) validate() error {
	bad := func(v float64) bool { return math.IsNaN(v) || math.IsInf(v, 0) || v < 0 }
	for _, f := range []struct {
		name string
		v    float64
	}{
		{"delay_weight", p.DelayWeight}, {"recompute_weight", p.RecomputeWeight},
		{"kv_pressure_weight", p.KVPressureWeight}, {"near_tie_tokens", p.NearTieTokens},
		{"sticky_weight", p.StickyWeight}, {"sticky_kv_fraction", p.StickyKVFraction},
	} {
		if bad(f.v) {
			return fmt.Errorf("%s: parameter %s must be a finite number ≥ 0, got %v", TypeName, f.name, f.v)
		}
	}
	if p.StickyKVFraction > 1 {
		return fmt.Errorf("%s: parameter sticky_kv_fraction must be at most 1, got %v", TypeName, p.StickyKVFraction)
	}
	if bad(p.PrefillTokensPerSecond) || p.PrefillTokensPerSecond == 0 {
		return fmt.Errorf("%s: parameter prefill_tokens_per_second must be a finite number > 0, got %v", TypeName, p.PrefillTokensPerSecond)
	}
	return nil
}

// rateShrinkSamples is how many observations the partition's pooled rate counts for when it is
// blended with a worker's own.
const rateShrinkSamples = 32

// rate is the candidate's prefill rate in tokens/s: its own measurement blended with the
// partition's pooled one (each weighted by its sample count, the pooled one counting as
// rateShrinkSamples, the worker's at most that), else the pooled one, else the assumed one. The
// blend keeps one worker's estimate, which depends on the prompt lengths it happened to serve
// (attention grows with length), from starving or flooding it, while a persistently faster or
// slower worker still shows.
func (p *Params) rate(load *policies.LoadInputs) float64 {
	e := load.Engine()
	own, pool := e.PrefillTokensPerSecond, e.PoolPrefillTokensPerSecond
	switch {
	case own > 0 && pool > 0:
		n := float64(min(e.PrefillRateSamples, rateShrinkSamples))
		return (own*n + pool*rateShrinkSamples) / (n + rateShrinkSamples)
	case own > 0:
		return own
	case pool > 0:
		return pool
	}
	return p.PrefillTokensPerSecond
}

// uncached is the request's prompt tokens the candidate will have to compute (tokens, ≥ 0): its
// prompt minus what the candidate caches, where the cached prefix is the longer of the one the
// prefix index reports and the one live bookings on the candidate hold. A live booking's blocks
// are either in the engine's KV cache already or computed before this request's (the engine
// schedules requests in order), so a request routed behind another with the same prefix finds
// that prefix cached even before the KV events announce it. The live prefix is the request's full
// blocks minus those no live booking holds (decode_cost_blocks − active blocks, §10.4; sequence
// hashes chain, so held blocks form a prefix), and is 0 when the host tracks no active blocks.
func (p *Params) uncached(ctx *policies.WorkerSelectionContext, cache *policies.CacheInputs, load *policies.LoadInputs) float64 {
	device, host, disk := cache.DeviceOverlapBlocks(), cache.HostOverlapBlocks(), cache.DiskOverlapBlocks()
	if active := load.Engine().ActiveBlocks; active > 0 && ctx.BlockSize() > 0 && load.DecodeCostBlocks() >= active {
		full := ctx.ISLTokens() / ctx.BlockSize()
		if live := full - (load.DecodeCostBlocks() - active); live > device {
			hostEnd, diskEnd := device+host, device+host+disk
			device = live
			host = max(hostEnd-device, 0)
			disk = max(diskEnd-max(device, hostEnd), 0)
		}
	}
	cached := defaultcost.WeightedCachedTokens(p.HostCacheHitWeight, p.DiskCacheHitWeight, device, host, disk, ctx.BlockSize())
	return float64(defaultcost.EffectivePrefillTokens(ctx.ISLTokens(), cached))
}

// TTFT is the predicted time to first token of the request on the candidate, seconds (package
// documentation): the prefill queued and its own at the candidate's rate, plus the wait for KV
// memory. The queued prefill counts in full until the engine reports each request's first token:
// crediting progress on the request being prefilled from the average rate made long prompts,
// whose attention makes them slower than average, look nearly done and drew more traffic to the
// busiest workers (measured: worse TTFT p90 on every trace window).
func (p *Params) TTFT(ctx *policies.WorkerSelectionContext, cache *policies.CacheInputs, load *policies.LoadInputs) float64 {
	r := p.rate(load)
	t := (float64(load.ActivePrefillTokens()) + p.uncached(ctx, cache, load)) / r
	if e := load.Engine(); e.TotalKVBlocks > 0 && p.KVPressureWeight > 0 {
		if over := p.heldBlocks(ctx, load) - e.TotalKVBlocks; over > 0 {
			t += p.KVPressureWeight * float64(over*ctx.BlockSize()) / r
		}
	}
	return t
}

// heldBlocks is the KV memory the candidate's engine must hold once the request runs, in blocks:
// what its live bookings hold (prompt blocks and, with DYN_ROUTER_TRACK_OUTPUT_BLOCKS, the output
// blocks of running responses) plus every block of this prompt they do not hold yet
// (decode_cost_blocks, §10.4) and its trailing partial block. A prompt block the engine caches but
// no live booking holds counts too: the engine pins it for the request (it is no longer
// evictable), so a cache hit saves the prefill but not the memory.
func (p *Params) heldBlocks(ctx *policies.WorkerSelectionContext, load *policies.LoadInputs) int {
	partial := 0
	if bs := ctx.BlockSize(); bs > 0 {
		partial = max(ctx.RequestBlocks()-ctx.ISLTokens()/bs, 0)
	}
	return load.DecodeCostBlocks() + partial
}

// roomy reports whether the candidate's engine stays roomy with the request placed on it: its
// live bookings and the request hold at most StickyKVFraction of its total_kv_blocks (heldBlocks).
// An engine with that much KV to spare has room for its running requests' output and keeps its
// prefix cache, so keeping a conversation there cannot become the KV-memory queue the predicted
// TTFT does not foresee. Without total_kv_blocks the candidate is never roomy.
func (p *Params) roomy(ctx *policies.WorkerSelectionContext, load *policies.LoadInputs) bool {
	total := load.Engine().TotalKVBlocks
	return total > 0 && float64(p.heldBlocks(ctx, load)) <= p.StickyKVFraction*float64(total)
}

// TTFTScorer costs a candidate by its predicted time to first token (Params.TTFT, seconds). It
// declares CACHE | LOAD.
type TTFTScorer struct {
	// Params are the prediction's parameters.
	Params Params
}

var _ policies.WorkerScorer = (*TTFTScorer)(nil)

// RequiredWorkerInputs declares CACHE | LOAD.
func (s *TTFTScorer) RequiredWorkerInputs() policies.WorkerInputs {
	return policies.InputsCache | policies.InputsLoad
}

// Score returns the predicted TTFT in seconds. It fails with a policies.PolicyError when the host
// supplied no CACHE or LOAD group.
func (s *TTFTScorer) Score(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	cache, load := c.Cache(), c.Load()
	if cache == nil || load == nil {
		return 0, policies.Failed(TypeName + ": cache and load inputs are required")
	}
	return s.Params.TTFT(ctx, cache, load), nil
}

// DelayAwarePicker picks the row with the lowest cost (package documentation): the scorers' cost
// (the predicted TTFT) plus the delay the request's prefill imposes on later arrivals (over a
// horizon of at least the candidates' median predicted TTFT), the prefill it redoes that a roomy
// candidate caches (StickyWeight) and, with RecomputeWeight, the prefill the pool redoes; near ties
// go to the lightest decode load, exact ties uniformly at random. It declares CACHE | LOAD and
// reuses its buffers, so it allocates only when the candidate count grows.
type DelayAwarePicker struct {
	// Params are the policy's parameters.
	Params   Params
	uncached []float64
	total    []float64
	rates    []float64
	ttfts    []float64 // the candidates' predicted TTFT, reordered to find the median
}

// nthSmallest returns the k-th smallest value of a (0-based, 0 ≤ k < len(a)), reordering a in
// place: a quickselect (Hoare partition around the median of three) that takes O(len(a)) time on
// average, where sorting for the median doubled the policy's time at 10,000 candidates.
func nthSmallest(a []float64, k int) float64 {
	lo, hi := 0, len(a)-1
	for lo < hi {
		mid := lo + (hi-lo)/2
		// Median of three as the pivot: sorted or constant inputs stay linear.
		if a[mid] < a[lo] {
			a[mid], a[lo] = a[lo], a[mid]
		}
		if a[hi] < a[lo] {
			a[hi], a[lo] = a[lo], a[hi]
		}
		if a[hi] < a[mid] {
			a[hi], a[mid] = a[mid], a[hi]
		}
		pivot := a[mid]
		i, j := lo, hi
		for i <= j {
			for a[i] < pivot {
				i++
			}
			for a[j] > pivot {
				j--
			}
			if i <= j {
				a[i], a[j] = a[j], a[i]
				i++
				j--
			}
		}
		switch {
		case k <= j:
			hi = j
		case k >= i:
			lo = i
		default:
			return a[k]
		}
	}
	return a[k]
}

var _ policies.WorkerPicker = (*DelayAwarePicker)(nil)

// RequiredWorkerInputs declares CACHE | LOAD.
func (p *DelayAwarePicker) RequiredWorkerInputs() policies.WorkerInputs {
	return policies.InputsCache | policies.InputsLoad
}

// Pick returns the chosen row. It fails with a policies.PolicyError on an empty view or when the
// host supplied no CACHE or LOAD column.
func (p *DelayAwarePicker) Pick(ctx *policies.WorkerSelectionContext, view *policies.WorkerInputView) (int, error) {
	rows := view.Candidates()
	n := len(rows)
	if n == 0 {
		return 0, policies.Failed(TypeName + ": no eligible worker")
	}
	p.uncached, p.total, p.rates, p.ttfts = p.uncached[:0], p.total[:0], p.rates[:0], p.ttfts[:0]
	// least: the fewest uncached tokens of any candidate; home: of any roomy one (+Inf if none,
	// which leaves the sticky charge 0).
	least, home := math.Inf(1), math.Inf(1)
	for row := 0; row < n; row++ {
		cache, load := view.Cache(row), view.Load(row)
		if cache == nil || load == nil {
			return 0, policies.Failed(TypeName + ": cache and load inputs are required")
		}
		u := p.Params.uncached(ctx, cache, load)
		p.uncached = append(p.uncached, u)
		p.rates = append(p.rates, p.Params.rate(load))
		p.ttfts = append(p.ttfts, rows[row].Cost())
		least = min(least, u)
		if p.Params.StickyWeight > 0 && p.Params.roomy(ctx, load) {
			home = min(home, u)
		}
	}
	// The pool's typical predicted TTFT: the (lower) median over the candidates.
	typical := nthSmallest(p.ttfts, (n-1)/2)
	best, bestRow := math.Inf(1), 0
	for row := 0; row < n; row++ {
		load := view.Load(row)
		r := p.rates[row]
		e := load.Engine()
		perWorker := 0.0
		if e.PoolCandidates > 0 {
			perWorker = e.PoolArrivalsPerSecond / float64(e.PoolCandidates)
		}
		ttft := rows[row].Cost()
		own := p.uncached[row] / r
		horizon := max(ttft, typical)
		c := ttft + p.Params.DelayWeight*own*perWorker*horizon + p.Params.RecomputeWeight*(p.uncached[row]-least)/r
		if redo := p.uncached[row] - home; redo > 0 {
			c += p.Params.StickyWeight * redo / r
		}
		p.total = append(p.total, c)
		if c < best {
			best, bestRow = c, row
		}
	}
	// Near ties: within NearTieTokens of prefill work (at the best row's rate) of the lowest cost
	// the prediction cannot tell the candidates apart, so the lighter decode load after placing
	// the request (decode_cost_blocks, §10.4: the blocks live bookings hold plus the request's
	// blocks they do not) decides, then the cost.
	tie := best + p.Params.NearTieTokens/p.rates[bestRow]
	return leastbusy.BestRow(ctx, n, func(a, b int) int {
		ta, tb := p.total[a] <= tie, p.total[b] <= tie
		switch {
		case ta && tb:
			if c := cmp.Compare(view.Load(a).DecodeCostBlocks(), view.Load(b).DecodeCostBlocks()); c != 0 {
				return c
			}
		case ta:
			return -1
		case tb:
			return 1
		}
		return cmp.Compare(p.total[a], p.total[b])
	}), nil
}

// NewPolicy builds the policy (TTFTScorer, DelayAwarePicker) with p. Errors: invalid parameters,
// naming the parameter.
func NewPolicy(cfg policies.RouterConfig, workerType string, p Params) (*policies.WorkerSelectionPolicy, error) {
	if err := p.validate(); err != nil {
		return nil, err
	}
	return policies.NewPolicy(cfg, workerType, []policies.WorkerScorer{&TTFTScorer{Params: p}}, &DelayAwarePicker{Params: p})
}

// Parameters are the YAML parameters of a predicted-ttft instance; every one is optional.
type Parameters struct {
	PrefillTokensPerSecond *float64 `json:"prefill_tokens_per_second,omitempty"` // Params.PrefillTokensPerSecond
	DelayWeight            *float64 `json:"delay_weight,omitempty"`              // Params.DelayWeight
	RecomputeWeight        *float64 `json:"recompute_weight,omitempty"`          // Params.RecomputeWeight
	KVPressureWeight       *float64 `json:"kv_pressure_weight,omitempty"`        // Params.KVPressureWeight
	NearTieTokens          *float64 `json:"near_tie_tokens,omitempty"`           // Params.NearTieTokens
	StickyWeight           *float64 `json:"sticky_weight,omitempty"`             // Params.StickyWeight
	StickyKVFraction       *float64 `json:"sticky_kv_fraction,omitempty"`        // Params.StickyKVFraction
}

// apply overlays the given parameters on p.
func (v Parameters) apply(p Params) Params {
	for _, f := range []struct {
		dst *float64
		src *float64
	}{
		{&p.PrefillTokensPerSecond, v.PrefillTokensPerSecond},
		{&p.DelayWeight, v.DelayWeight},
		{&p.RecomputeWeight, v.RecomputeWeight},
		{&p.KVPressureWeight, v.KVPressureWeight},
		{&p.NearTieTokens, v.NearTieTokens},
		{&p.StickyWeight, v.StickyWeight},
		{&p.StickyKVFraction, v.StickyKVFraction},
	} {
		if f.src != nil {
			*f.dst = *f.src
		}
	}
	return p
}

// Provider is the policies.Provider of type predicted-ttft: it decodes the parameters strictly
// (unknown fields are errors), validates them against the defaults, and returns a factory that
// builds the policy per partition with the cache-hit weights of the partition's router
// configuration. Errors name the type and the offending parameter.
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var v Parameters
	if err := params.Decode(&v); err != nil {
		return nil, fmt.Errorf("%s: %w", TypeName, err)
	}
	if err := v.apply(DefaultParams(policies.DefaultRouterConfig())).validate(); err != nil {
		return nil, err
	}
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return NewPolicy(cfg, workerType, v.apply(DefaultParams(cfg)))
	}, nil
}
