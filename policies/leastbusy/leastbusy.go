// Package leastbusy is the `least-busy` worker-selection policy, the normative example of
// custom-routing-strategies.txt (selection-service.md §17): keep candidates with at least
// min_device_overlap_blocks device-resident overlap blocks (MinimumDeviceOverlapFilter), cost each
// survivor by its active requests (ActiveRequestsScorer), and pick the lowest cost
// (LowestCostPicker; exact ties broken uniformly at random with ctx.Rand()).
//
// The components are exported so other policies can stack them, and BestRow — "best by an
// explicit order, exact ties uniformly at random" — is shared by the catalog's other pickers.
package leastbusy

import (
	"cmp"
	"fmt"
	"math"

	"github.com/kvepp/kvepp/policies"
)

// TypeName is the registered policy type (selection-service.md §17.4).
const TypeName = "least-busy"

// MinimumDeviceOverlapFilter keeps a candidate whose device-resident prefix overlap is at least
// MinimumBlocks blocks (custom-routing-strategies.txt "Filter Workers"). It declares CACHE.
type MinimumDeviceOverlapFilter struct {
	// MinimumBlocks is the smallest device overlap kept, in blocks (finite, ≥ 0).
	MinimumBlocks float64
}

var _ policies.WorkerFilter = (*MinimumDeviceOverlapFilter)(nil)

// RequiredWorkerInputs declares CACHE.
func (f *MinimumDeviceOverlapFilter) RequiredWorkerInputs() policies.WorkerInputs {
	return policies.InputsCache
}

// Keep reports DeviceOverlapBlocks() ≥ MinimumBlocks. It fails with a policies.PolicyError
// "cache input unavailable" when the host supplied no CACHE group.
func (f *MinimumDeviceOverlapFilter) Keep(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
	cache := c.Cache()
	if cache == nil {
		return false, policies.Failed("cache input unavailable")
	}
	return float64(cache.DeviceOverlapBlocks()) >= f.MinimumBlocks, nil
}

// ActiveRequestsScorer costs a candidate by its live bookings: cost = ActiveRequests()
// (custom-routing-strategies.txt "Score Workers"). It declares LOAD.
type ActiveRequestsScorer struct{}

var _ policies.WorkerScorer = ActiveRequestsScorer{}

// RequiredWorkerInputs declares LOAD.
func (ActiveRequestsScorer) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsLoad }

// Score returns the candidate's active requests as a cost. It fails with a policies.PolicyError
// "load input unavailable" when the host supplied no LOAD group.
func (ActiveRequestsScorer) Score(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	load := c.Load()
	if load == nil {
		return 0, policies.Failed("load input unavailable")
	}
	return float64(load.ActiveRequests()), nil
}

// LowestCostPicker picks the row with the lowest summed cost; exact ties are broken uniformly at
// random with ctx.Rand() by reservoir sampling (the k-th tied row replaces the best with
// probability 1/k), so the choice does not depend on the host's candidate order
// (custom-routing-strategies.txt "Pick a Worker", selection-service.md §17.2 rule 5). It
// declares no group and allocates nothing.
type LowestCostPicker struct{}

var _ policies.WorkerPicker = LowestCostPicker{}

// RequiredWorkerInputs declares no group.
func (LowestCostPicker) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }

// Pick returns the lowest-cost row. It fails with "no eligible worker" on an empty view.
func (LowestCostPicker) Pick(ctx *policies.WorkerSelectionContext, view *policies.WorkerInputView) (int, error) {
	rows := view.Candidates()
	if len(rows) == 0 {
		return 0, policies.Failed("no eligible worker")
	}
	return BestRow(ctx, len(rows), func(a, b int) int { return cmp.Compare(rows[a].Cost(), rows[b].Cost()) }), nil
}

// BestRow returns the row of 0..n-1 that compare orders first (compare(a, b) < 0: a is better),
// breaking exact ties (compare == 0) uniformly at random with ctx.Rand() by reservoir sampling:
// the k-th tied row replaces the best with probability 1/k, so the result does not depend on the
// host's candidate order. ctx.Rand() is used only when a tie occurs. n must be ≥ 1. Pickers with
// other orders (overlap first, queue length first, …) share it.
func BestRow(ctx *policies.WorkerSelectionContext, n int, compare func(a, b int) int) int {
	best, ties := 0, 1
	for row := 1; row < n; row++ {
		switch c := compare(row, best); {
		case c < 0:
			best, ties = row, 1
		case c == 0:
			ties++
			if ctx.Rand().IntN(ties) == 0 {
				best = row
			}
		}
	}
	return best
}

// Parameters are the YAML parameters of a least-busy instance.
type Parameters struct {
	// MinDeviceOverlapBlocks is min_device_overlap_blocks: required, finite, ≥ 0 (blocks).
	MinDeviceOverlapBlocks *float64 `json:"min_device_overlap_blocks"`
}

// Validate checks that min_device_overlap_blocks is present, finite and ≥ 0; the error names it.
func (p Parameters) Validate() error {
	v := p.MinDeviceOverlapBlocks
	if v == nil {
		return fmt.Errorf("%s: parameter min_device_overlap_blocks is required", TypeName)
	}
	if math.IsNaN(*v) || math.IsInf(*v, 0) || *v < 0 {
		return fmt.Errorf("%s: parameter min_device_overlap_blocks must be a finite non-negative number, got %v", TypeName, *v)
	}
	return nil
}

// Provider is the policies.Provider of type least-busy: it decodes the parameters strictly
// (unknown fields are errors), validates them, and returns a factory building, per partition,
// MinimumDeviceOverlapFilter → ActiveRequestsScorer → LowestCostPicker. Errors name the type and
// the offending parameter.
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var p Parameters
	if err := params.Decode(&p); err != nil {
		return nil, fmt.Errorf("%s: %w", TypeName, err)
	}
	if err := p.Validate(); err != nil {
		return nil, err
	}
	minimum := *p.MinDeviceOverlapBlocks
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return policies.NewPolicyWithFilters(cfg, workerType,
			[]policies.WorkerFilter{&MinimumDeviceOverlapFilter{MinimumBlocks: minimum}},
			[]policies.WorkerScorer{ActiveRequestsScorer{}},
			LowestCostPicker{})
	}, nil
}
