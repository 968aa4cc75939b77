package enginesim

import (
	"errors"
	"fmt"
	"time"
)

// Pool is a set of workers started together. It is safe for concurrent use.
type Pool struct {
	workers []*Worker
}

// NewPool starts n workers from cfg (n ≥ 1). Worker i is named
// "<cfg.Name or enginesim>-<i>" and uses HashSeed cfg.HashSeed+i, so, like
// independent vLLM replicas, the workers give the same block different engine
// hashes. Leave the listen addresses empty (or port 0): a fixed port makes the
// second worker fail to bind. If any worker fails to start, the ones already
// started are closed and the error names the worker index.
func NewPool(n int, cfg Config) (*Pool, error) {
	if n < 1 {
		return nil, fmt.Errorf("enginesim: pool size %d must be at least 1", n)
	}
	cfgs := make([]Config, n)
	name := cfg.Name
	if name == "" {
		name = defaultWorkerNamePrefix
	}
	for i := range cfgs {
		c := cfg
		c.Name = fmt.Sprintf("%s-%d", name, i)
		c.HashSeed = cfg.HashSeed + uint64(i)
		cfgs[i] = c
	}
	return NewPoolFrom(cfgs)
}

// NewPoolFrom starts one worker per config, in order (for heterogeneous pools).
// An empty list is an error; if any worker fails to start, the ones already
// started are closed and the error names the worker index.
func NewPoolFrom(cfgs []Config) (*Pool, error) {
	if len(cfgs) == 0 {
		return nil, errors.New("enginesim: pool needs at least one worker config")
	}
	p := &Pool{}
	for i, c := range cfgs {
		w, err := Start(c)
		if err != nil {
			_ = p.Close()
			return nil, fmt.Errorf("enginesim: start pool worker %d: %w", i, err)
		}
		p.workers = append(p.workers, w)
	}
	return p, nil
}

// Len returns the number of workers.
func (p *Pool) Len() int { return len(p.workers) }

// Worker returns worker i (0 ≤ i < Len), or nil when i is out of range.
func (p *Pool) Worker(i int) *Worker {
	if i < 0 || i >= len(p.workers) {
		return nil
	}
	return p.workers[i]
}

// Workers returns the workers in start order (a copy of the slice).
func (p *Pool) Workers() []*Worker { return append([]*Worker(nil), p.workers...) }

// Endpoints returns each worker's HTTP base URL, in worker order.
func (p *Pool) Endpoints() []string {
	out := make([]string, len(p.workers))
	for i, w := range p.workers {
		out[i] = w.Endpoint()
	}
	return out
}

// PoolStats aggregates the workers' stats. Token counters cover completed
// requests.
type PoolStats struct {
	Workers            []Stats // per worker, in worker order
	Requests           int64
	Canceled           int64
	PromptTokens       int64
	CachedPromptTokens int64
	OutputTokens       int64
	ITL                LatencyHistogram // every worker's inter-token gaps
	Preemptions        uint64           // EngineVLLM recompute preemptions, all workers
	EngineLag          time.Duration    // EngineVLLM late step starts, summed over workers (simulated)
}

// HitRate returns CachedPromptTokens / PromptTokens over the whole pool, or 0
// with no prompt tokens.
func (s PoolStats) HitRate() float64 {
	if s.PromptTokens == 0 {
		return 0
	}
	return float64(s.CachedPromptTokens) / float64(s.PromptTokens)
}

// Stats returns every worker's stats and their sums.
func (p *Pool) Stats() PoolStats {
	var s PoolStats
	for _, w := range p.workers {
		ws := w.Stats()
		s.Workers = append(s.Workers, ws)
		s.Requests += ws.Requests
		s.Canceled += ws.Canceled
		s.PromptTokens += ws.PromptTokens
		s.CachedPromptTokens += ws.CachedPromptTokens
		s.OutputTokens += ws.OutputTokens
		s.ITL.Merge(&ws.ITL)
		s.Preemptions += ws.Preemptions
		s.EngineLag += ws.EngineLag
	}
	return s
}

// Reset resets every worker's prefix cache (see [Worker.Reset]) and returns the
// joined errors.
func (p *Pool) Reset() error {
	var errs []error
	for _, w := range p.workers {
		errs = append(errs, w.Reset())
	}
	return errors.Join(errs...)
}

// Close closes every worker and returns the joined errors. It is idempotent.
func (p *Pool) Close() error {
	var errs []error
	for _, w := range p.workers {
		errs = append(errs, w.Close())
	}
	return errors.Join(errs...)
}
