// Package random is the `random` baseline worker-selection policy (selection-service.md §17):
// every candidate that survives eligibility is equally likely, drawn with ctx.Rand(). It reads no
// optional input group and ignores cost, so it is the reference point for what cache- and
// load-awareness buys.
package random

import (
	"fmt"

	"github.com/kvepp/kvepp/policies"
)

// TypeName is the registered policy type (selection-service.md §17.4).
const TypeName = "random"

// UniformPicker picks a row uniformly at random with ctx.Rand(). It declares no group, needs no
// scorer and allocates nothing.
type UniformPicker struct{}

var _ policies.WorkerPicker = UniformPicker{}

// RequiredWorkerInputs declares no group.
func (UniformPicker) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }

// Pick returns a uniformly random row. It fails with "no eligible worker" on an empty view.
func (UniformPicker) Pick(ctx *policies.WorkerSelectionContext, view *policies.WorkerInputView) (int, error) {
	if view.Len() == 0 {
		return 0, policies.Failed("no eligible worker")
	}
	return ctx.Rand().IntN(view.Len()), nil
}

// Parameters are the YAML parameters of a random instance: none (any key is rejected as unknown).
type Parameters struct{}

// New returns the factory building, per partition, a policy with no scorer and UniformPicker.
func New() policies.PolicyFactory {
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return policies.NewPolicy(cfg, workerType, nil, UniformPicker{})
	}
}

// Provider is the policies.Provider of type random. It accepts only an empty parameter mapping
// (unknown fields are errors naming the field and the type).
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var p Parameters
	if err := params.Decode(&p); err != nil {
		return nil, fmt.Errorf("%s: %w", TypeName, err)
	}
	return New(), nil
}
