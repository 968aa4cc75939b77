// Package roundrobin is the `round-robin` baseline worker-selection policy
// (selection-service.md §17): candidates are taken in ascending (worker_id, dp_rank) order, one
// per selection, wrapping around. The host's candidate order is unspecified (§17.2 rule 5), so the
// rotation follows the explicit key, not the row order. It reads no optional input group.
package roundrobin

import (
	"cmp"
	"fmt"

	"github.com/kvepp/kvepp/policies"
)

// TypeName is the registered policy type (selection-service.md §17.4).
const TypeName = "round-robin"

// Picker rotates over the candidates in (worker_id, dp_rank) order. Its state is a cursor, the
// last worker it picked: each Pick returns the candidate with the smallest key greater than the
// cursor, or the smallest key overall when none is greater (wrap-around). With a fixed candidate
// set this is a counter modulo the set size; when workers join or leave, no remaining worker is
// skipped or picked twice within a round. One Picker per partition (the factory builds a fresh
// one), so partitions rotate independently. Pick is O(candidates) without sorting or allocation.
type Picker struct {
	last    policies.Worker
	started bool
}

var _ policies.WorkerPicker = (*Picker)(nil)

// RequiredWorkerInputs declares no group.
func (p *Picker) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }

// Pick returns the next candidate in the rotation and advances the cursor. It fails with
// "no eligible worker" on an empty view.
func (p *Picker) Pick(_ *policies.WorkerSelectionContext, view *policies.WorkerInputView) (int, error) {
	rows := view.Candidates()
	if len(rows) == 0 {
		return 0, policies.Failed("no eligible worker")
	}
	first, next := 0, -1
	for row := range rows {
		w := rows[row].Worker()
		if compare(w, rows[first].Worker()) < 0 {
			first = row
		}
		if p.started && compare(w, p.last) > 0 && (next < 0 || compare(w, rows[next].Worker()) < 0) {
			next = row
		}
	}
	if next < 0 {
		next = first
	}
	p.last, p.started = rows[next].Worker(), true
	return next, nil
}

// compare orders workers by (worker_id, dp_rank).
func compare(a, b policies.Worker) int {
	if c := cmp.Compare(a.WorkerID, b.WorkerID); c != 0 {
		return c
	}
	return cmp.Compare(a.DPRank, b.DPRank)
}

// Parameters are the YAML parameters of a round-robin instance: none (any key is rejected as
// unknown).
type Parameters struct{}

// New returns the factory building, per partition, a policy with no scorer and a fresh Picker.
func New() policies.PolicyFactory {
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return policies.NewPolicy(cfg, workerType, nil, &Picker{})
	}
}

// Provider is the policies.Provider of type round-robin. It accepts only an empty parameter
// mapping (unknown fields are errors naming the field and the type).
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var p Parameters
	if err := params.Decode(&p); err != nil {
		return nil, fmt.Errorf("%s: %w", TypeName, err)
	}
	return New(), nil
}
