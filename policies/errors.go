package policies

import (
	"errors"
	"fmt"
)

// ErrAllFiltered is returned by Select when policy filters reject every candidate
// (selection-service.md §8 step 7, §17.2 rule 1; HTTP 503).
var ErrAllFiltered = errors.New("all eligible workers were rejected by policy filters")

// ErrNoCandidates is returned by Select when it is given no candidate at all (HTTP 503).
var ErrNoCandidates = errors.New("no endpoints available to route work")

// Stage names the pipeline stage a PolicyError came from.
type Stage string

const (
	// StageFilter: a WorkerFilter.
	StageFilter Stage = "filter"
	// StageScorer: a WorkerScorer.
	StageScorer Stage = "scorer"
	// StagePicker: the WorkerPicker.
	StagePicker Stage = "picker"
	// StageInputs: the host's InputSource while computing a group.
	StageInputs Stage = "inputs"
)

// PolicyError is a policy-raised failure (selection-service.md §17.2 rule 4; HTTP 500 with the
// message). Components create one with Failed. Select also returns a *PolicyError for any other
// error a component returns (message kept, original available through errors.Unwrap) and for a
// recovered panic, with Stage and Component filled in.
type PolicyError struct {
	msg string
	// Stage is where the error arose ("" for an error built by Failed and not yet returned by Select).
	Stage Stage
	// Component is the index of the filter or scorer in declaration order (0 for the picker).
	Component int
	// Panic is the recovered panic value, nil unless the component panicked.
	Panic any
	cause error
}

// Failed builds the error a filter, scorer or picker returns to fail the selection with msg.
func Failed(msg string) *PolicyError { return &PolicyError{msg: msg} }

// Error returns the message.
func (e *PolicyError) Error() string { return e.msg }

// Unwrap returns the component's original error, if any.
func (e *PolicyError) Unwrap() error { return e.cause }

// NonFiniteCostError reports a scorer contribution or running total that is NaN or ±Inf
// (selection-service.md §17.2 rule 2; upstream NonFiniteCost{scorer_index, row}; HTTP 500).
type NonFiniteCostError struct {
	// ScorerIndex is the scorer's index in declaration order.
	ScorerIndex int
	// Row is the candidate's row among the filter survivors (the picker's row numbering).
	Row int
	// Worker is that candidate.
	Worker Worker
	// Value is the offending contribution or running total.
	Value float64
}

// Error describes the scorer, row and value.
func (e *NonFiniteCostError) Error() string {
	return fmt.Sprintf("scorer %d produced a non-finite cost %v for row %d (%v)", e.ScorerIndex, e.Value, e.Row, e.Worker)
}

// InvalidPickerRowError reports a picker row outside [0, CandidateCount)
// (selection-service.md §17.2 rule 3; upstream InvalidPickerRow{row, candidate_count}; HTTP 500).
type InvalidPickerRowError struct {
	Row            int // the row the picker returned
	CandidateCount int // the number of rows in the picker's view
}

// Error describes the row and the candidate count.
func (e *InvalidPickerRowError) Error() string {
	return fmt.Sprintf("picker returned row %d but there are %d candidates", e.Row, e.CandidateCount)
}
