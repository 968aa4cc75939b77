package enginesim

import (
	"errors"
	"fmt"
	"time"
)

// Sim is an engine model in virtual time: with [EngineVLLM] the same scheduler, block pool,
// prefix cache and step times as a [Worker] on EngineVLLM, with [EngineSimple] the same slots,
// prefill lane, prefix cache and timing as a Worker on EngineSimple, without sockets, goroutines
// or a clock. A driver submits requests at simulated times and applies the engine's steps in time
// order, getting each step's first tokens, finished requests and KV events; eppbench's --virtual
// replay drives one Sim per worker to evaluate routers deterministically and much faster than
// real time. With EngineSimple a "step" is one instant at which prefills end or requests finish.
// Not safe for concurrent use.
type Sim struct {
	cfg     Config
	cache   *prefixCache
	sched   *vllmScheduler // EngineVLLM
	simple  *simpleSim     // EngineSimple
	clock   time.Duration  // end of the last applied step
	planned bool
	step    plannedStep
	end     time.Duration
	itl     LatencyHistogram
	lag     time.Duration // unused in virtual time; kept zero
}

// SimStep is what one applied step produced.
type SimStep struct {
	// End is the simulated time the step ended.
	End time.Duration
	// FirstTokens are the ids of the requests that got their first token in this step.
	FirstTokens []string
	// Finished are the records of the requests that got their last token in this step.
	Finished []RequestRecord
	// Events are the step's KV events: evicted blocks, then newly cached blocks per request.
	Events []Event
	// OutputBlocks lists the requests whose output filled a KV block in this step: the generated
	// token count reached a multiple of the block size (EngineVLLM only; the simple engine emits
	// no per-token steps). A driver that tracks output KV, as kvepp's response path does for
	// streamed responses, reports these totals.
	OutputBlocks []OutputProgress
}

// OutputProgress is one request's generated output so far.
type OutputProgress struct {
	// ID is the request id.
	ID string
	// Generated is the number of output tokens generated so far.
	Generated int
}

// NewSim validates cfg as [Start] does (a zero Engine means EngineVLLM here; the socket, name,
// time-scale and streaming fields are ignored) and returns an idle engine at simulated time 0.
func NewSim(cfg Config) (*Sim, error) {
	if cfg.Engine == "" {
		cfg.Engine = EngineVLLM
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	s := &Sim{cfg: cfg, cache: newPrefixCache(cfg.BlockSize, cfg.CapacityBlocks, cfg.HashSeed)}
	if cfg.Engine == EngineSimple {
		s.simple = &simpleSim{cfg: cfg, cache: s.cache}
		return s, nil
	}
	s.sched = newVLLMScheduler(cfg.Profile, cfg.BlockSize, cfg.MaxNumBatchedTokens, cfg.MaxRunning, s.cache)
	return s, nil
}

// Config returns the engine's effective configuration (defaults filled in).
func (s *Sim) Config() Config { return s.cfg }

// Submit queues a request arriving at simulated time at (at or after the previous Submit and the
// last applied step's start). If the engine is idle its next step starts at at. Errors: an empty
// prompt, maxTokens < 1, or (EngineVLLM) a request that can never fit the block pool.
func (s *Sim) Submit(id string, tokens []uint32, maxTokens int, at time.Duration) error {
	if len(tokens) == 0 {
		return errors.New("enginesim: prompt has no tokens")
	}
	if maxTokens < 1 {
		return fmt.Errorf("enginesim: request %s: max tokens %d must be ≥ 1", id, maxTokens)
	}
	if s.simple != nil {
		s.simple.waiting = append(s.simple.waiting, &simpleReq{id: id, tokens: tokens, hashes: s.cache.blockHashes(tokens), maxTokens: maxTokens, arrival: at})
		s.simple.admit(at)
		s.clock = max(s.clock, at)
		s.end, s.planned = s.simple.next()
		return nil
	}
	if need := s.sched.blocksFor(len(tokens) + maxTokens); need > s.cfg.CapacityBlocks {
		return fmt.Errorf("%w: request %s needs %d blocks, the engine has %d", errTooLarge, id, need, s.cfg.CapacityBlocks)
	}
	r := newVLLMReq(&genRequest{id: id, tokens: tokens, maxTokens: maxTokens}, s.cache.blockHashes(tokens), at)
	s.sched.enqueue(r)
	if !s.planned {
		s.plan(max(s.clock, at))
	}
	return nil
}

// plan plans the next step starting at start, if there is work.
func (s *Sim) plan(start time.Duration) {
	s.step = s.sched.plan(start)
	s.planned = len(s.step.items) > 0
	s.end = start + s.step.dur
}

// NextStepEnd returns when the planned step ends, or false when the engine is idle.
func (s *Sim) NextStepEnd() (time.Duration, bool) { return s.end, s.planned }

// Step applies the planned step at its end, plans the next one (starting right away, or at the
// next waiting request's arrival) and returns what the step produced. It returns false when no
// step was planned.
func (s *Sim) Step() (SimStep, bool) {
	if !s.planned {
		return SimStep{}, false
	}
	if s.simple != nil {
		return s.stepSimple(), true
	}
	st, end := s.step, s.end
	res := s.sched.apply(&st, end)
	s.clock = end
	out := SimStep{End: end, Events: stepEvents(&st, &res, s.cfg.BlockSize)}
	for _, tok := range res.tokens {
		if tok.r.generated == 1 {
			out.FirstTokens = append(out.FirstTokens, tok.r.id)
		} else {
			s.itl.Add(tok.gap, 1)
		}
		if tok.r.generated%s.cfg.BlockSize == 0 {
			out.OutputBlocks = append(out.OutputBlocks, OutputProgress{ID: tok.r.id, Generated: tok.r.generated})
		}
	}
	for _, r := range res.finished {
		r.finished = true
		out.Finished = append(out.Finished, r.record(end))
	}
	s.planned = false
	if !s.sched.idle() {
		start := end
		if len(s.sched.running) == 0 {
			start = max(start, s.sched.waiting[0].arrival)
		}
		s.plan(start)
	}
	return out, true
}

// stepSimple applies the simple engine's state changes due at s.end.
func (s *Sim) stepSimple() SimStep {
	end := s.end
	events, first, finished := s.simple.apply(end)
	s.clock = end
	out := SimStep{End: end, Events: events}
	for _, r := range first {
		out.FirstTokens = append(out.FirstTokens, r.id)
	}
	for _, r := range finished {
		if r.maxTokens > 1 {
			s.itl.Add(s.cfg.DecodePerToken, r.maxTokens-1)
		}
		out.Finished = append(out.Finished, r.record(&s.cfg))
	}
	s.end, s.planned = s.simple.next()
	return out
}

// Stats returns the engine's counters (records are the caller's: Step returns them).
func (s *Sim) Stats() Stats {
	if p := s.simple; p != nil {
		st := Stats{
			Running: p.running(), Waiting: len(p.waiting), PeakRunning: p.peak,
			BlocksStored: s.cache.stored, BlocksEvicted: s.cache.evicted, ITL: s.itl, Steps: p.changes, BusyTime: p.busy,
		}
		st.CachedBlocks, st.PinnedBlocks = s.cache.size()
		return st
	}
	st := Stats{
		Running: len(s.sched.running), Waiting: len(s.sched.waiting), PeakRunning: s.sched.peak,
		BlocksStored: s.cache.stored, BlocksEvicted: s.cache.evicted, ITL: s.itl,
		UsedBlocks: s.cache.usedBlocks(), Preemptions: s.sched.preemptions, Steps: s.sched.steps, BusyTime: s.sched.busy,
	}
	st.CachedBlocks, st.PinnedBlocks = s.cache.size()
	return st
}
