package runner

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvepp/kvepp/extproc"
)

// tokenizeBudget bounds the request-body bytes the local tokenizers work on at once
// (DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES): tokenizing costs memory in proportion to the decoded body
// (the prompt text, its segments and ids: up to ~20 bytes per body byte for text made of special
// tokens), so a few compressed bodies of tens of MB each would otherwise need gigabytes at once
// (audit 7 R3). A call weighs its body's length, at most the whole budget, so a body larger than
// the budget still runs, alone. Waiting ends with the request's context or after wait
// (DYN_EPP_TOKENIZATION_TIMEOUT_MS), whichever comes first. A nil budget admits everything.
//
// Admission is not first-come-first-served: a call gets in as soon as its bytes fit in the free
// room, even while larger calls wait (audit 8 finding 2: behind a strict FIFO one waiting 32 MB
// body made every 300-byte chat behind it wait, and time out with it). Small bodies are the
// common case and cost little; a large body can be overtaken for at most its wait, after which it
// gets the same 504 it would get behind other large bodies, so nothing waits unboundedly.
// Waiting bodies are already decoded: the budget bounds bytes being tokenized, not bytes held by
// requests waiting for it (those are bounded by DYN_EPP_MAX_INFLIGHT_REQUESTS × the body limit).
type tokenizeBudget struct {
	max   int64         // bytes
	wait  time.Duration // longest wait for room
	stats *budgetStats

	mu       sync.Mutex
	inFlight int64         // bytes admitted and not yet released
	freed    chan struct{} // closed (and replaced) whenever bytes are released
}

// budgetStats are the budget's counters, exported as metrics (registerBudgetMetrics).
type budgetStats struct {
	inFlight atomic.Int64  // bytes being tokenized
	waits    atomic.Uint64 // calls that did not fit at once and waited
	timeouts atomic.Uint64 // waits that ended in a tokenizer timeout (504)
}

// tokenizeBudgetStats are the process's budget counters: the runner builds one budget per
// process (loadTokenizers), and the metrics are registered before it exists.
var tokenizeBudgetStats budgetStats

// newTokenizeBudget returns the budget of maxBytes (nil when maxBytes is 0: unbounded).
func newTokenizeBudget(maxBytes int64, wait time.Duration) *tokenizeBudget {
	if maxBytes <= 0 {
		return nil
	}
	return &tokenizeBudget{max: maxBytes, wait: wait, stats: &tokenizeBudgetStats, freed: make(chan struct{})}
}

// errTokenizeBudget is wrapped by acquire's error when the budget stayed full for the whole wait.
var errTokenizeBudget = errors.New("the local tokenizer is busy")

// tryAcquire admits n bytes when they fit; otherwise it returns the channel closed at the next
// release.
func (b *tokenizeBudget) tryAcquire(n int64) (ok bool, freed <-chan struct{}) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.inFlight+n <= b.max {
		b.inFlight += n
		b.stats.inFlight.Add(n)
		return true, nil
	}
	return false, b.freed
}

// release gives n bytes back and wakes every waiter (each checks whether it fits now).
func (b *tokenizeBudget) release(n int64) {
	b.mu.Lock()
	b.inFlight -= n
	b.stats.inFlight.Add(-n)
	close(b.freed)
	b.freed = make(chan struct{})
	b.mu.Unlock()
}

// acquire waits until bodyBytes (at most the budget) fit and returns the function that gives them
// back. Errors: ctx's own error when the request ended first; otherwise one wrapping
// extproc.ErrTokenizerTimeout (504, as any tokenizer timeout) naming the setting and the bytes in
// flight when the wait ended.
func (b *tokenizeBudget) acquire(ctx context.Context, bodyBytes int) (release func(), err error) {
	if b == nil {
		return func() {}, nil
	}
	n := min(int64(bodyBytes), b.max)
	ok, freed := b.tryAcquire(n)
	if !ok {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		b.stats.waits.Add(1)
		timer := time.NewTimer(b.wait)
		defer timer.Stop()
		for !ok {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-timer.C:
				b.stats.timeouts.Add(1)
				b.mu.Lock()
				held := b.inFlight
				b.mu.Unlock()
				return nil, fmt.Errorf("%w: %w: %d bytes of request bodies were being tokenized and %d more did not fit (DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES=%d) for %v",
					extproc.ErrTokenizerTimeout, errTokenizeBudget, held, n, b.max, b.wait)
			case <-freed:
				ok, freed = b.tryAcquire(n)
			}
		}
	}
	var once sync.Once
	return func() { once.Do(func() { b.release(n) }) }, nil
}

// registerBudgetMetrics registers the budget's metrics on reg (epp.md §12, names prefixed
// kvepp_): bytes in flight, waits and timeouts, process-wide (tokenizeBudgetStats).
func registerBudgetMetrics(reg prometheus.Registerer) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvepp_tokenize_inflight_bytes",
			Help: "Request-body bytes the local tokenizers work on now, counted against DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES (a body over the budget counts as the whole budget)."},
			func() float64 { return float64(tokenizeBudgetStats.inFlight.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvepp_tokenize_budget_waits_total",
			Help: "Requests whose body did not fit in the free DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES at once and waited for room."},
			func() float64 { return float64(tokenizeBudgetStats.waits.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvepp_tokenize_budget_timeouts_total",
			Help: "Waits for DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES that lasted DYN_EPP_TOKENIZATION_TIMEOUT_MS and were answered 504 (tokenizer_timeout)."},
			func() float64 { return float64(tokenizeBudgetStats.timeouts.Load()) }),
	)
}
