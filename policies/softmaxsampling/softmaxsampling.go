// Package softmaxsampling is the `softmax-sampling` worker-selection policy
// (selection-service.md §9.4, §17): instead of always taking the cheapest candidate, it samples
// one with probability p_i ∝ exp(−(c_i − c_min) / ((c_max − c_min) × T)) over the min-max
// normalised summed costs, so near-ties share traffic and a worker that is only slightly more
// expensive still gets some. The request's router_config_override.router_temperature, when
// present, replaces T (0 then means the minimum cost, ties at random).
//
// The sampling is defaultcost.Pick (the §9.4 implementation, not re-implemented here). The YAML
// type scores with the built-in cost (defaultcost.Scorer); Go code can stack any scorers in front
// of the Picker with NewPolicy.
package softmaxsampling

import (
	"fmt"
	"math"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
)

// TypeName is the registered policy type (selection-service.md §17.4).
const TypeName = "softmax-sampling"

// DefaultTemperature is the temperature used when the parameter is omitted.
const DefaultTemperature = 1.0

// Picker samples a row by the §9.4 softmax at Temperature, or at the request's
// RouterTemperatureOverride when set. It declares no group; its cost buffer is reused, so it
// allocates only when the candidate count grows. One Picker per policy instance.
type Picker struct {
	// Temperature is T (finite, > 0).
	Temperature float64
	costs       []float64
}

var _ policies.WorkerPicker = (*Picker)(nil)

// RequiredWorkerInputs declares no group.
func (p *Picker) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }

// temperature returns the temperature that applies to the request: the override when present,
// else the configured one.
func (p *Picker) temperature(ctx *policies.WorkerSelectionContext) float64 {
	if t, ok := ctx.RouterTemperatureOverride(); ok {
		return t
	}
	return p.Temperature
}

// Pick samples a row with ctx.Rand(). It fails with "no eligible worker" on an empty view.
func (p *Picker) Pick(ctx *policies.WorkerSelectionContext, view *policies.WorkerInputView) (int, error) {
	p.costs = p.costs[:0]
	for _, c := range view.Candidates() {
		p.costs = append(p.costs, c.Cost())
	}
	row := defaultcost.Pick(ctx.Rand(), p.costs, p.temperature(ctx))
	if row < 0 {
		return 0, policies.Failed("no eligible worker")
	}
	return row, nil
}

// NewPolicy builds one instance: scorers summed in order (at least one), then a Picker at
// temperature (finite, > 0). Errors name the problem.
func NewPolicy(cfg policies.RouterConfig, workerType string, temperature float64, scorers ...policies.WorkerScorer) (*policies.WorkerSelectionPolicy, error) {
	if err := validateTemperature(temperature); err != nil {
		return nil, err
	}
	if len(scorers) == 0 {
		return nil, fmt.Errorf("%s: at least one scorer is required", TypeName)
	}
	return policies.NewPolicy(cfg, workerType, scorers, &Picker{Temperature: temperature})
}

// Parameters are the YAML parameters of a softmax-sampling instance.
type Parameters struct {
	// Temperature is temperature: optional (default 1.0), finite, > 0.
	Temperature *float64 `json:"temperature,omitempty"`
}

func validateTemperature(t float64) error {
	if math.IsNaN(t) || math.IsInf(t, 0) || t <= 0 {
		return fmt.Errorf("%s: parameter temperature must be a finite number > 0, got %v", TypeName, t)
	}
	return nil
}

// Provider is the policies.Provider of type softmax-sampling: strict decoding (unknown fields are
// errors), temperature validated (finite, > 0), and a factory building, per partition, the
// built-in cost scorer (parameters from the router configuration, which must be valid) and a
// Picker. Errors name the type and the parameter.
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var p Parameters
	if err := params.Decode(&p); err != nil {
		return nil, fmt.Errorf("%s: %w", TypeName, err)
	}
	temperature := DefaultTemperature
	if p.Temperature != nil {
		temperature = *p.Temperature
	}
	if err := validateTemperature(temperature); err != nil {
		return nil, err
	}
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		costParams := cfg
		if err := costParams.Validate(); err != nil {
			return nil, fmt.Errorf("%s: %w", TypeName, err)
		}
		return NewPolicy(cfg, workerType, temperature, defaultcost.NewScorer(costParams))
	}, nil
}
