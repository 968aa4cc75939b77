// Package custompolicy is an out-of-tree-style worker-selection policy, `acme-least-kv`, written
// the way a policy author outside kvepp writes one (custom-routing-strategies.txt,
// selection-service.md §17): it imports only the public policies and catalog packages, and
// cmd/epp-custom links it into an EPP next to the standard catalog. Copy this folder to start
// your own policy.
//
// The policy sends a request to the worker whose KV footprint grows least:
//
//   - filter  MaxActiveRequestsFilter: reject workers already running max_active_requests
//     requests (a hard cap; LOAD);
//   - scorer  KVFootprintScorer: cost = max(0, decode_cost_blocks − device_overlap_credit ×
//     device_overlap_blocks), times the preferred-taint multiplier when the request has preferred
//     taints (CACHE | LOAD | ROUTING);
//   - picker  LowestCostPicker: the lowest cost, ties to the lowest (worker_id, dp_rank) — an
//     explicit, deterministic order, since the host's candidate order is unspecified.
package custompolicy

import (
	"cmp"
	"fmt"
	"math"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/policies"
)

// TypeName is the registered policy type. Choose a stable name that no other provider uses.
const TypeName = "acme-least-kv"

// MaxActiveRequestsFilter keeps workers with fewer than Max active requests. It declares LOAD.
type MaxActiveRequestsFilter struct {
	// Max is the number of active requests at which a worker stops receiving work (≥ 1).
	Max int
}

var _ policies.WorkerFilter = (*MaxActiveRequestsFilter)(nil)

// RequiredWorkerInputs declares LOAD.
func (f *MaxActiveRequestsFilter) RequiredWorkerInputs() policies.WorkerInputs {
	return policies.InputsLoad
}

// Keep reports ActiveRequests() < Max. It fails with "load input unavailable" when the host
// supplied no LOAD group.
func (f *MaxActiveRequestsFilter) Keep(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
	load := c.Load()
	if load == nil {
		return false, policies.Failed("load input unavailable")
	}
	return load.ActiveRequests() < f.Max, nil
}

// KVFootprintScorer costs a worker by the KV blocks it would hold after admitting the request,
// minus a credit for the prefix it already has on the device, scaled by the preferred-taint
// multiplier (selection-service.md §9.3) when present. It declares CACHE | LOAD | ROUTING.
type KVFootprintScorer struct {
	// DeviceOverlapCredit is the cost removed per device-resident overlap block (finite, ≥ 0).
	DeviceOverlapCredit float64
}

var _ policies.WorkerScorer = (*KVFootprintScorer)(nil)

// RequiredWorkerInputs declares CACHE | LOAD | ROUTING.
func (s *KVFootprintScorer) RequiredWorkerInputs() policies.WorkerInputs {
	return policies.InputsCache | policies.InputsLoad | policies.InputsRouting
}

// Score returns max(0, DecodeCostBlocks − credit × DeviceOverlapBlocks) × multiplier. It fails
// with "cache and load inputs unavailable" when the host supplied neither group.
func (s *KVFootprintScorer) Score(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	cache, load := c.Cache(), c.Load()
	if cache == nil || load == nil {
		return 0, policies.Failed("cache and load inputs unavailable")
	}
	cost := math.Max(0, float64(load.DecodeCostBlocks())-s.DeviceOverlapCredit*float64(cache.DeviceOverlapBlocks()))
	if r := c.Routing(); r != nil {
		if m, ok := r.PreferredTaintMultiplier(); ok {
			cost *= m
		}
	}
	return cost, nil
}

// LowestCostPicker picks the lowest cost; equal costs go to the lowest (worker_id, dp_rank). It
// declares no group.
type LowestCostPicker struct{}

var _ policies.WorkerPicker = LowestCostPicker{}

// RequiredWorkerInputs declares no group.
func (LowestCostPicker) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }

// Pick returns the chosen row; it fails with "no eligible worker" on an empty view.
func (LowestCostPicker) Pick(_ *policies.WorkerSelectionContext, view *policies.WorkerInputView) (int, error) {
	rows := view.Candidates()
	if len(rows) == 0 {
		return 0, policies.Failed("no eligible worker")
	}
	best := 0
	for row := 1; row < len(rows); row++ {
		a, b := rows[row], rows[best]
		c := cmp.Compare(a.Cost(), b.Cost())
		if c == 0 {
			c = cmp.Or(cmp.Compare(a.Worker().WorkerID, b.Worker().WorkerID), cmp.Compare(a.Worker().DPRank, b.Worker().DPRank))
		}
		if c < 0 {
			best = row
		}
	}
	return best, nil
}

// Parameters are the YAML parameters of an acme-least-kv instance.
type Parameters struct {
	// MaxActiveRequests is max_active_requests: required, integer ≥ 1.
	MaxActiveRequests *int `json:"max_active_requests"`
	// DeviceOverlapCredit is device_overlap_credit: optional, finite, ≥ 0, default 1.
	DeviceOverlapCredit *float64 `json:"device_overlap_credit,omitempty"`
}

// Provider parses and validates the parameters once at startup (strictly: unknown fields are
// errors) and returns the factory that builds one policy per partition. Errors name the type and
// the parameter, and stop startup.
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var p Parameters
	if err := params.Decode(&p); err != nil {
		return nil, fmt.Errorf("%s: %w", TypeName, err)
	}
	if p.MaxActiveRequests == nil {
		return nil, fmt.Errorf("%s: parameter max_active_requests is required", TypeName)
	}
	maxActive := *p.MaxActiveRequests
	if maxActive < 1 {
		return nil, fmt.Errorf("%s: parameter max_active_requests must be an integer ≥ 1, got %d", TypeName, maxActive)
	}
	credit := 1.0
	if v := p.DeviceOverlapCredit; v != nil {
		if math.IsNaN(*v) || math.IsInf(*v, 0) || *v < 0 {
			return nil, fmt.Errorf("%s: parameter device_overlap_credit must be a finite number ≥ 0, got %v", TypeName, *v)
		}
		credit = *v
	}
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return policies.NewPolicyWithFilters(cfg, workerType,
			[]policies.WorkerFilter{&MaxActiveRequestsFilter{Max: maxActive}},
			[]policies.WorkerScorer{&KVFootprintScorer{DeviceOverlapCredit: credit}},
			LowestCostPicker{})
	}, nil
}

// Register adds the acme-least-kv type to r (the catalog-package convention of
// selection-service.md §17.4). It fails if the type is already registered.
func Register(r *catalog.Registry) error {
	return r.Register(TypeName, Provider)
}
