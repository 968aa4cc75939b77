package enginesim

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// vllmEngine runs a worker's vllmScheduler against the clock: one goroutine plans a step, waits
// for its simulated duration (scaled to wall time) and applies it, publishing the step's KV
// events and waking the handlers of requests that got tokens. The scheduler state is guarded by
// the worker's mutex.
type vllmEngine struct {
	w     *Worker
	sched *vllmScheduler
	start time.Time     // wall time of simulated time 0
	wake  chan struct{} // new work arrived
	done  chan struct{} // closed when the loop has exited

	// Guarded by w.mu.
	clock time.Duration // end of the last step, simulated
	lag   time.Duration // simulated time steps started later than the previous one ended
}

func newVLLMEngine(w *Worker) *vllmEngine {
	cfg := w.cfg
	return &vllmEngine{
		w:     w,
		sched: newVLLMScheduler(cfg.Profile, cfg.BlockSize, cfg.MaxNumBatchedTokens, cfg.MaxRunning, w.cache),
		start: time.Now(),
		wake:  make(chan struct{}, 1),
		done:  make(chan struct{}),
	}
}

// now is the current simulated time.
func (e *vllmEngine) now() time.Duration { return e.w.sim(time.Since(e.start)) }

// wallAt is the wall time of simulated time t.
func (e *vllmEngine) wallAt(t time.Duration) time.Time { return e.start.Add(e.w.wall(t)) }

// errTooLarge is returned for a request that can never fit the KV block pool.
var errTooLarge = errors.New("request does not fit the KV cache")

// fits fails with errTooLarge, with EngineVLLM, for a request whose prompt and max_tokens need
// more KV blocks than the worker has: it could never run (it would only preempt itself), so it is
// refused up front, as vLLM refuses a request longer than its KV cache.
func (w *Worker) fits(promptTokens, maxTokens int) error {
	if w.vllm == nil {
		return nil
	}
	if need := w.vllm.sched.blocksFor(promptTokens + maxTokens); need > w.cfg.CapacityBlocks {
		return fmt.Errorf("%w: %d prompt tokens + %d output tokens need %d blocks of %d tokens, the worker has %d",
			errTooLarge, promptTokens, maxTokens, need, w.cfg.BlockSize, w.cfg.CapacityBlocks)
	}
	return nil
}

// submit queues r, or fails when the worker is closed or r can never fit the pool (fits).
func (e *vllmEngine) submit(r *vllmReq) error {
	w := e.w
	if err := w.fits(len(r.tokens), r.maxTokens); err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return ErrClosed
	}
	e.sched.enqueue(r)
	select {
	case e.wake <- struct{}{}:
	default:
	}
	return nil
}

// cancel marks r canceled; the loop drops it (freeing its blocks) before the next step.
func (e *vllmEngine) cancel(r *vllmReq) {
	r.canceled.Store(true)
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// catchUp is how far behind the wall clock (in simulated time) the engine's clock may run: a step
// whose timer fired late starts the next one at the exact simulated end of the last, without
// waiting, so goroutines that wake a little late on a busy machine do not slow the model down.
// Requests are admitted by their simulated arrival, so causality holds. Falling further behind
// than this jumps the clock forward and counts the jump as engine lag.
const catchUp = 250 * time.Millisecond

// stepStart is the simulated start of the next step: the end of the last one, or, when the
// engine fell more than catchUp behind the wall clock, now − catchUp (the difference counts as
// lag); an engine with nothing running waits for its first request's arrival. Caller holds w.mu.
func (e *vllmEngine) stepStart() time.Duration {
	now := e.now()
	start := e.clock
	if len(e.sched.running) == 0 {
		if len(e.sched.waiting) > 0 {
			start = max(start, e.sched.waiting[0].arrival)
		}
	} else if floor := now - catchUp; floor > start {
		e.lag += floor - start
		start = floor
	}
	return start
}

// run is the engine loop; it returns when the worker's context ends, canceling what is left.
func (e *vllmEngine) run(ctx context.Context) {
	defer close(e.done)
	w := e.w
	var dropped []*vllmReq
	for {
		w.mu.Lock()
		dropped = e.sched.dropCanceled(dropped[:0])
		for _, r := range dropped {
			e.finishLocked(r, true)
		}
		var st plannedStep
		var start time.Duration
		if !e.sched.idle() {
			start = e.stepStart()
			st = e.sched.plan(start)
		}
		w.mu.Unlock()
		if len(st.items) == 0 {
			// Idle, or nothing can run (every waiting request is blocked): wait for a change.
			select {
			case <-e.wake:
				continue
			case <-ctx.Done():
				e.shutdown()
				return
			}
		}
		end := start + st.dur
		if d := time.Until(e.wallAt(end)); d > 0 {
			t := time.NewTimer(d)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				e.shutdown()
				return
			}
		}
		w.mu.Lock()
		e.clock = end
		res := e.sched.apply(&st, end)
		e.publishLocked(&st, &res)
		for _, tok := range res.tokens {
			r := tok.r
			if r.generated > 1 {
				w.itl.Add(tok.gap, 1)
			}
			r.emitted.Store(int64(r.generated))
			if r.generated == 1 || (r.generated-1)%w.cfg.StreamInterval == 0 || r.generated >= r.maxTokens {
				r.wake()
			}
		}
		for _, r := range res.finished {
			e.finishLocked(r, false)
		}
		w.mu.Unlock()
	}
}

// shutdown cancels every request still queued or running (the worker is closing).
func (e *vllmEngine) shutdown() {
	w := e.w
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, q := range [][]*vllmReq{e.sched.running, e.sched.waiting} {
		for _, r := range q {
			r.canceled.Store(true)
		}
	}
	for _, r := range e.sched.dropCanceled(nil) {
		e.finishLocked(r, true)
	}
}

// publishLocked sends the step's KV events (stepEvents) as one batch. Caller holds w.mu, so
// batch order is cache order.
func (e *vllmEngine) publishLocked(st *plannedStep, res *stepResult) {
	if events := stepEvents(st, res, e.w.cfg.BlockSize); len(events) > 0 {
		_, _ = e.w.pub.publish(nowSeconds(), events) // fails only once the worker is closing
	}
}

// stepEvents are a step's KV events: the evicted blocks, then each request's newly cached blocks
// chained to the block before them.
func stepEvents(st *plannedStep, res *stepResult, bs int) []Event {
	var events []Event
	if len(st.removed) > 0 {
		events = append(events, Event{Kind: BlockRemoved, BlockHashes: st.removed})
	}
	for _, run := range res.stored {
		r := run.r
		ev := Event{
			Kind:        BlockStored,
			BlockHashes: r.hashes[run.start:run.end],
			TokenIDs:    r.tokens[run.start*bs : run.end*bs],
			BlockSize:   bs,
		}
		if run.start > 0 {
			ev.HasParent, ev.ParentHash = true, r.hashes[run.start-1]
		}
		events = append(events, ev)
	}
	return events
}

// finishLocked writes r's record, folds it into the stats once and releases its handler.
func (e *vllmEngine) finishLocked(r *vllmReq, canceled bool) {
	if r.finished {
		return
	}
	r.finished = true
	rec := r.record(e.now())
	rec.Canceled = canceled
	r.rec = rec
	e.w.finishLocked(rec)
	r.done.Store(true)
	r.wake()
}

// record builds r's RequestRecord at simulated time now (for an unfinished request).
func (r *vllmReq) record(now time.Duration) RequestRecord {
	rec := RequestRecord{
		ID: r.id, Path: r.path, PromptTokens: len(r.tokens), CachedTokens: r.cached, OutputTokens: r.generated,
		Arrival: r.arrivalAt, Finished: time.Now(), Preemptions: r.preemptions,
	}
	if r.scheduled {
		rec.Queue = r.firstSched - r.arrival
	} else {
		rec.Queue = now - r.arrival
	}
	if r.generated > 0 {
		rec.TTFT = r.firstToken - r.arrival
		rec.E2E = r.lastToken - r.arrival
	}
	return rec
}

// executeVLLM runs a request on the vLLM engine model and delivers its tokens as execute does.
func (w *Worker) executeVLLM(ctx context.Context, req *genRequest, onTokens func(from, to int) error) (RequestRecord, error) {
	e := w.vllm
	r := newVLLMReq(req, w.cache.blockHashes(req.tokens), e.now())
	if err := e.submit(r); err != nil {
		return RequestRecord{ID: req.id, Path: req.path, PromptTokens: len(req.tokens), Arrival: req.arrival}, err
	}
	sent := 0
	for {
		select {
		case <-r.poke:
		case <-ctx.Done():
			e.cancel(r)
			for !r.done.Load() { // the loop drops r and finishes its record before the next step
				<-r.poke
			}
			return r.rec, ctx.Err()
		}
		n, done := int(r.emitted.Load()), r.done.Load()
		if done {
			n = r.rec.OutputTokens
		}
		for onTokens != nil && sent < n {
			to := n
			if sent == 0 {
				to = 1
			} else if to-sent > w.cfg.StreamInterval {
				to = sent + w.cfg.StreamInterval
			} else if to-sent < w.cfg.StreamInterval && !done {
				break // wait for a full chunk
			}
			if err := onTokens(sent, to); err != nil {
				e.cancel(r)
				for !r.done.Load() {
					<-r.poke
				}
				return r.rec, err
			}
			sent = to
		}
		if done {
			if r.rec.Canceled {
				return r.rec, ErrClosed
			}
			return r.rec, nil
		}
	}
}
