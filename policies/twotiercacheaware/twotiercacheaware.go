// Package twotiercacheaware is the `two-tier-cache-aware` worker-selection policy
// (selection-service.md §17), modelled on the SGLang router's cache-aware policy: it routes for
// cache locality while the pool is balanced and switches to the shortest queue once it is not.
//
// Load is a candidate's active requests. Over the candidates of one selection:
//
//   - imbalanced when max − min > balance_abs_threshold AND max > balance_rel_threshold × min:
//     the shortest queue — fewest active requests, then fewest active prefill tokens;
//   - otherwise cache-aware: the candidate with the largest device-overlap ratio
//     (DeviceOverlapBlocks / RequestBlocks) if that ratio is > cache_threshold (equal ratios → the
//     shortest queue); else the shortest queue.
//
// Remaining exact ties are broken uniformly at random with ctx.Rand(). Unlike SGLang, which falls
// back to the worker with the smallest radix tree, the below-threshold fallback here is the least
// loaded worker. The policy has no scorer (every row costs 0); its picker reads CACHE and LOAD.
package twotiercacheaware

import (
	"cmp"
	"fmt"
	"math"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/leastbusy"
)

// TypeName is the registered policy type (selection-service.md §17.4).
const TypeName = "two-tier-cache-aware"

// Defaults of the parameters (the SGLang router's cache-aware defaults).
const (
	// DefaultCacheThreshold is the default cache_threshold (device-overlap ratio).
	DefaultCacheThreshold = 0.5
	// DefaultBalanceAbsThreshold is the default balance_abs_threshold (active requests).
	DefaultBalanceAbsThreshold = 32
	// DefaultBalanceRelThreshold is the default balance_rel_threshold (max / min ratio).
	DefaultBalanceRelThreshold = 1.0001
)

// Thresholds are the validated parameters of the policy.
type Thresholds struct {
	// CacheThreshold is the device-overlap ratio (0..1) a candidate must exceed to win on cache.
	CacheThreshold float64
	// BalanceAbsThreshold is the active-request spread (max − min) that must be exceeded.
	BalanceAbsThreshold int
	// BalanceRelThreshold is the ratio max / min that must be exceeded (max > rel × min).
	BalanceRelThreshold float64
}

// Imbalanced reports whether the pool with maxLoad and minLoad active requests is imbalanced:
// maxLoad − minLoad > BalanceAbsThreshold AND maxLoad > BalanceRelThreshold × minLoad.
func (th Thresholds) Imbalanced(minLoad, maxLoad int) bool {
	return maxLoad-minLoad > th.BalanceAbsThreshold && float64(maxLoad) > th.BalanceRelThreshold*float64(minLoad)
}

// Picker is the two-tier decision (see the package comment). It declares CACHE and LOAD, is
// stateless and allocates nothing.
type Picker struct {
	// Thresholds are the decision's parameters.
	Thresholds Thresholds
}

var _ policies.WorkerPicker = (*Picker)(nil)

// RequiredWorkerInputs declares CACHE | LOAD.
func (p *Picker) RequiredWorkerInputs() policies.WorkerInputs {
	return policies.InputsCache | policies.InputsLoad
}

// Pick returns the chosen row. It fails with "no eligible worker" on an empty view and with
// "cache and load inputs unavailable" if the host supplied neither column.
func (p *Picker) Pick(ctx *policies.WorkerSelectionContext, view *policies.WorkerInputView) (int, error) {
	n := view.Len()
	if n == 0 {
		return 0, policies.Failed("no eligible worker")
	}
	if view.Cache(0) == nil || view.Load(0) == nil {
		return 0, policies.Failed("cache and load inputs unavailable")
	}
	minLoad, maxLoad := math.MaxInt, math.MinInt
	for row := 0; row < n; row++ {
		l := view.Load(row).ActiveRequests()
		minLoad, maxLoad = min(minLoad, l), max(maxLoad, l)
	}
	// shorter orders rows by queue: fewer active requests, then fewer active prefill tokens.
	shorter := func(a, b int) int {
		la, lb := view.Load(a), view.Load(b)
		if c := cmp.Compare(la.ActiveRequests(), lb.ActiveRequests()); c != 0 {
			return c
		}
		return cmp.Compare(la.ActivePrefillTokens(), lb.ActivePrefillTokens())
	}
	if !p.Thresholds.Imbalanced(minLoad, maxLoad) && p.cacheHit(ctx, view) {
		return leastbusy.BestRow(ctx, n, func(a, b int) int {
			if c := cmp.Compare(view.Cache(b).DeviceOverlapBlocks(), view.Cache(a).DeviceOverlapBlocks()); c != 0 {
				return c
			}
			return shorter(a, b)
		}), nil
	}
	return leastbusy.BestRow(ctx, n, shorter), nil
}

// cacheHit reports whether the largest device-overlap ratio, DeviceOverlapBlocks / RequestBlocks,
// exceeds CacheThreshold (never for a request without a full block).
func (p *Picker) cacheHit(ctx *policies.WorkerSelectionContext, view *policies.WorkerInputView) bool {
	blocks := ctx.RequestBlocks()
	if blocks <= 0 {
		return false
	}
	most := 0
	for row := 0; row < view.Len(); row++ {
		most = max(most, view.Cache(row).DeviceOverlapBlocks())
	}
	return float64(most)/float64(blocks) > p.Thresholds.CacheThreshold
}

// Parameters are the YAML parameters of a two-tier-cache-aware instance; all optional.
type Parameters struct {
	// CacheThreshold is cache_threshold: in [0, 1], default 0.5.
	CacheThreshold *float64 `json:"cache_threshold,omitempty"`
	// BalanceAbsThreshold is balance_abs_threshold: an integer ≥ 0 (active requests), default 32.
	BalanceAbsThreshold *int `json:"balance_abs_threshold,omitempty"`
	// BalanceRelThreshold is balance_rel_threshold: finite, ≥ 0, default 1.0001.
	BalanceRelThreshold *float64 `json:"balance_rel_threshold,omitempty"`
}

// Thresholds applies the defaults and validates; errors name the parameter.
func (p Parameters) Thresholds() (Thresholds, error) {
	th := Thresholds{CacheThreshold: DefaultCacheThreshold, BalanceAbsThreshold: DefaultBalanceAbsThreshold, BalanceRelThreshold: DefaultBalanceRelThreshold}
	if v := p.CacheThreshold; v != nil {
		if math.IsNaN(*v) || *v < 0 || *v > 1 {
			return Thresholds{}, fmt.Errorf("%s: parameter cache_threshold must be a number in [0, 1], got %v", TypeName, *v)
		}
		th.CacheThreshold = *v
	}
	if v := p.BalanceAbsThreshold; v != nil {
		if *v < 0 {
			return Thresholds{}, fmt.Errorf("%s: parameter balance_abs_threshold must be an integer ≥ 0, got %d", TypeName, *v)
		}
		th.BalanceAbsThreshold = *v
	}
	if v := p.BalanceRelThreshold; v != nil {
		if math.IsNaN(*v) || math.IsInf(*v, 0) || *v < 0 {
			return Thresholds{}, fmt.Errorf("%s: parameter balance_rel_threshold must be a finite number ≥ 0, got %v", TypeName, *v)
		}
		th.BalanceRelThreshold = *v
	}
	return th, nil
}

// New returns the factory building, per partition, a policy with no scorer and a Picker with th
// (from Parameters.Thresholds).
func New(th Thresholds) policies.PolicyFactory {
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return policies.NewPolicy(cfg, workerType, nil, &Picker{Thresholds: th})
	}
}

// Provider is the policies.Provider of type two-tier-cache-aware: strict decoding (unknown fields
// are errors), validation (Parameters.Thresholds), then New. Errors name the type and parameter.
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var p Parameters
	if err := params.Decode(&p); err != nil {
		return nil, fmt.Errorf("%s: %w", TypeName, err)
	}
	th, err := p.Thresholds()
	if err != nil {
		return nil, err
	}
	return New(th), nil
}
