// Package leastactiverequests is the `least-active-requests` baseline worker-selection policy
// (selection-service.md §17): pick the candidate with the fewest live bookings, exact ties broken
// uniformly at random with ctx.Rand() — the same rule as the EPP's load-only pick (epp.md §5.7),
// here as a selectable policy. It stacks leastbusy.ActiveRequestsScorer and
// leastbusy.LowestCostPicker without a filter.
package leastactiverequests

import (
	"fmt"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/leastbusy"
)

// TypeName is the registered policy type (selection-service.md §17.4).
const TypeName = "least-active-requests"

// Parameters are the YAML parameters of a least-active-requests instance: none (any key is
// rejected as unknown).
type Parameters struct{}

// New returns the factory building, per partition, ActiveRequestsScorer → LowestCostPicker. The
// policy declares only LOAD.
func New() policies.PolicyFactory {
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return policies.NewPolicy(cfg, workerType,
			[]policies.WorkerScorer{leastbusy.ActiveRequestsScorer{}},
			leastbusy.LowestCostPicker{})
	}
}

// Provider is the policies.Provider of type least-active-requests. It accepts only an empty
// parameter mapping (unknown fields are errors naming the field and the type).
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var p Parameters
	if err := params.Decode(&p); err != nil {
		return nil, fmt.Errorf("%s: %w", TypeName, err)
	}
	return New(), nil
}
