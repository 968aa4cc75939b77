package runner

import (
	"context"
	"errors"
	"fmt"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/kvepp/kvepp/extproc"
)

// tokenizeBudget bounds the request-body bytes the local tokenizers work on at once
// (DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES): tokenizing costs memory in proportion to the decoded body
// (the prompt text, its segments and ids: up to ~20 bytes per body byte for text made of special
// tokens), so a few compressed bodies of tens of MB each would otherwise need gigabytes at once
// (audit 7 R3). A call weighs its body's length, at most the whole budget, so a body larger than
// the budget still runs, alone. Waiting ends with the request's context or after wait
// (DYN_EPP_TOKENIZATION_TIMEOUT_MS), whichever comes first. A nil budget admits everything.
type tokenizeBudget struct {
	sem  *semaphore.Weighted
	max  int64         // bytes
	wait time.Duration // longest wait for room
}

// newTokenizeBudget returns the budget of maxBytes (nil when maxBytes is 0: unbounded).
func newTokenizeBudget(maxBytes int64, wait time.Duration) *tokenizeBudget {
	if maxBytes <= 0 {
		return nil
	}
	return &tokenizeBudget{sem: semaphore.NewWeighted(maxBytes), max: maxBytes, wait: wait}
}

// errTokenizeBudget is wrapped by acquire's error when the budget stayed full for the whole wait.
var errTokenizeBudget = errors.New("the local tokenizer is busy")

// acquire waits until bodyBytes (at most the budget) fit and returns the function that gives them
// back. Errors: ctx's own error when the request ended first; otherwise one wrapping
// extproc.ErrTokenizerTimeout (504, as any tokenizer timeout) naming the setting.
func (b *tokenizeBudget) acquire(ctx context.Context, bodyBytes int) (release func(), err error) {
	if b == nil {
		return func() {}, nil
	}
	n := min(int64(bodyBytes), b.max)
	if b.sem.TryAcquire(n) {
		return func() { b.sem.Release(n) }, nil
	}
	wctx, cancel := context.WithTimeout(ctx, b.wait)
	defer cancel()
	if err := b.sem.Acquire(wctx, n); err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("%w: %w: %d bytes of request bodies were being tokenized (DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES=%d) for %v",
			extproc.ErrTokenizerTimeout, errTokenizeBudget, b.max, b.max, b.wait)
	}
	return func() { b.sem.Release(n) }, nil
}
