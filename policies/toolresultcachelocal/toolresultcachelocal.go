// Package toolresultcachelocal is the `tool-result-cache-local` worker-selection policy
// (selection-service.md §17, custom-routing-strategies.txt "Session Context"): an agent turn that
// carries a tool result (session_context.input_trigger = tool_result) extends a conversation whose
// prefix is already resident somewhere, so it goes to the candidate with the largest
// device-resident overlap, exact overlap ties to the lowest built-in cost (§9.2); every other
// request goes to the lowest built-in cost. Remaining exact ties are broken uniformly at random with
// ctx.Rand().
//
// The cost is defaultcost.Scorer with the partition's router configuration (per-request overrides
// do not apply, as for any configured instance, §17.4); the policy does not re-implement it.
package toolresultcachelocal

import (
	"cmp"
	"fmt"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
	"github.com/kvepp/kvepp/policies/leastbusy"
)

// TypeName is the registered policy type (selection-service.md §17.4).
const TypeName = "tool-result-cache-local"

// Picker chooses by device overlap for tool-result turns and by cost otherwise (see the package
// comment). It declares CACHE (read only on the tool-result path; the built-in scorer declares it
// anyway, so it adds no host work) and allocates nothing.
type Picker struct{}

var _ policies.WorkerPicker = Picker{}

// RequiredWorkerInputs declares CACHE.
func (Picker) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsCache }

// IsToolResult reports whether the request's session context says it carries a tool result.
func IsToolResult(ctx *policies.WorkerSelectionContext) bool {
	s := ctx.SessionContext()
	return s != nil && s.InputTrigger() == policies.InputTriggerToolResult
}

// Pick returns the chosen row. It fails with "no eligible worker" on an empty view and with
// "cache input unavailable" if the host supplied no CACHE column on the tool-result path.
func (Picker) Pick(ctx *policies.WorkerSelectionContext, view *policies.WorkerInputView) (int, error) {
	rows := view.Candidates()
	if len(rows) == 0 {
		return 0, policies.Failed("no eligible worker")
	}
	tool := IsToolResult(ctx)
	if tool && view.Cache(0) == nil {
		return 0, policies.Failed("cache input unavailable")
	}
	// compare orders row a before row b: larger device overlap first on the tool-result path,
	// then lower cost.
	compare := func(a, b int) int {
		if tool {
			if c := cmp.Compare(view.Cache(b).DeviceOverlapBlocks(), view.Cache(a).DeviceOverlapBlocks()); c != 0 {
				return c
			}
		}
		return cmp.Compare(rows[a].Cost(), rows[b].Cost())
	}
	return leastbusy.BestRow(ctx, len(rows), compare), nil
}

// Parameters are the YAML parameters of a tool-result-cache-local instance: none (any key is
// rejected as unknown). The cost parameters come from the router configuration (DYN_ROUTER_*).
type Parameters struct{}

// New returns the factory building, per partition, defaultcost.Scorer (parameters from the
// router configuration, which must be valid: errors name the offending setting) and Picker.
func New() policies.PolicyFactory {
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		params := cfg
		if err := params.Validate(); err != nil {
			return nil, fmt.Errorf("%s: %w", TypeName, err)
		}
		return policies.NewPolicy(cfg, workerType, []policies.WorkerScorer{defaultcost.NewScorer(params)}, Picker{})
	}
}

// Provider is the policies.Provider of type tool-result-cache-local. It accepts only an empty
// parameter mapping (unknown fields are errors naming the field and the type).
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var p Parameters
	if err := params.Decode(&p); err != nil {
		return nil, fmt.Errorf("%s: %w", TypeName, err)
	}
	return New(), nil
}
