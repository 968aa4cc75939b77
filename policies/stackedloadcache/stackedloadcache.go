// Package stackedloadcache is the `stacked-load-cache` worker-selection policy
// (selection-service.md §17): two stacked scorers whose costs the host sums — a weighted
// active-request count (load) and a weighted count of the request's blocks not resident on the
// candidate's device (cache) — then the lowest total cost (leastbusy.LowestCostPicker, exact ties
// broken at random).
//
//	cost = active_requests_weight × active_requests + uncached_blocks_weight × max(0, request_blocks − device_overlap_blocks)
//
// A scorer whose weight is 0 is left out, so the policy then does not ask the host for its input
// group.
package stackedloadcache

import (
	"errors"
	"fmt"
	"math"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/leastbusy"
)

// TypeName is the registered policy type (selection-service.md §17.4).
const TypeName = "stacked-load-cache"

// ActiveRequestsScorer costs a candidate Weight × ActiveRequests(). It declares LOAD.
type ActiveRequestsScorer struct {
	// Weight multiplies the active-request count (finite, ≥ 0).
	Weight float64
}

var _ policies.WorkerScorer = (*ActiveRequestsScorer)(nil)

// RequiredWorkerInputs declares LOAD.
func (s *ActiveRequestsScorer) RequiredWorkerInputs() policies.WorkerInputs {
	return policies.InputsLoad
}

// Score returns Weight × ActiveRequests(). It fails with "load input unavailable" when the host
// supplied no LOAD group.
func (s *ActiveRequestsScorer) Score(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	load := c.Load()
	if load == nil {
		return 0, policies.Failed("load input unavailable")
	}
	return s.Weight * float64(load.ActiveRequests()), nil
}

// UncachedBlocksScorer costs a candidate Weight × max(0, RequestBlocks() − DeviceOverlapBlocks()):
// the request's blocks the candidate would have to prefill because they are not device-resident.
// It declares CACHE.
type UncachedBlocksScorer struct {
	// Weight multiplies the uncached block count (finite, ≥ 0).
	Weight float64
}

var _ policies.WorkerScorer = (*UncachedBlocksScorer)(nil)

// RequiredWorkerInputs declares CACHE.
func (s *UncachedBlocksScorer) RequiredWorkerInputs() policies.WorkerInputs {
	return policies.InputsCache
}

// Score returns Weight × max(0, request blocks − device overlap blocks). It fails with
// "cache input unavailable" when the host supplied no CACHE group.
func (s *UncachedBlocksScorer) Score(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	cache := c.Cache()
	if cache == nil {
		return 0, policies.Failed("cache input unavailable")
	}
	return s.Weight * float64(max(0, ctx.RequestBlocks()-cache.DeviceOverlapBlocks())), nil
}

// Parameters are the YAML parameters of a stacked-load-cache instance. Both are optional (default
// 1), finite and ≥ 0, and not both 0.
type Parameters struct {
	// ActiveRequestsWeight is active_requests_weight: cost per live booking.
	ActiveRequestsWeight *float64 `json:"active_requests_weight,omitempty"`
	// UncachedBlocksWeight is uncached_blocks_weight: cost per request block not on the device.
	UncachedBlocksWeight *float64 `json:"uncached_blocks_weight,omitempty"`
}

// Weights are validated scorer weights.
type Weights struct {
	ActiveRequests float64 // weight of ActiveRequestsScorer
	UncachedBlocks float64 // weight of UncachedBlocksScorer
}

// Weights applies the defaults (1 each) and validates: each finite and ≥ 0, not both 0. Errors
// name the parameter.
func (p Parameters) Weights() (Weights, error) {
	w := Weights{ActiveRequests: 1, UncachedBlocks: 1}
	for _, f := range []struct {
		name string
		src  *float64
		dst  *float64
	}{
		{"active_requests_weight", p.ActiveRequestsWeight, &w.ActiveRequests},
		{"uncached_blocks_weight", p.UncachedBlocksWeight, &w.UncachedBlocks},
	} {
		if f.src == nil {
			continue
		}
		if v := *f.src; math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return Weights{}, fmt.Errorf("%s: parameter %s must be a finite non-negative number, got %v", TypeName, f.name, v)
		}
		*f.dst = *f.src
	}
	if w.ActiveRequests == 0 && w.UncachedBlocks == 0 {
		return Weights{}, errors.New(TypeName + ": parameters active_requests_weight and uncached_blocks_weight must not both be 0")
	}
	return w, nil
}

// New returns the factory building, per partition, the scorers with a non-zero weight (active
// requests first, then uncached blocks) and leastbusy.LowestCostPicker. w must come from
// Parameters.Weights.
func New(w Weights) policies.PolicyFactory {
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		scorers := make([]policies.WorkerScorer, 0, 2)
		if w.ActiveRequests != 0 {
			scorers = append(scorers, &ActiveRequestsScorer{Weight: w.ActiveRequests})
		}
		if w.UncachedBlocks != 0 {
			scorers = append(scorers, &UncachedBlocksScorer{Weight: w.UncachedBlocks})
		}
		return policies.NewPolicy(cfg, workerType, scorers, leastbusy.LowestCostPicker{})
	}
}

// Provider is the policies.Provider of type stacked-load-cache: strict decoding (unknown fields
// are errors), validation (Parameters.Weights), then New. Errors name the type and parameter.
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var p Parameters
	if err := params.Decode(&p); err != nil {
		return nil, fmt.Errorf("%s: %w", TypeName, err)
	}
	w, err := p.Weights()
	if err != nil {
		return nil, err
	}
	return New(w), nil
}
