package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"time"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/enginesim"
	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/runner"
)

// virtualEvents is the KV-event source of a virtual replay: it hands each attached worker's
// partition index to the replay, which applies the simulated engines' events to it directly.
type virtualEvents struct{ idx map[uint64]*kvindex.Index }

var _ picker.KVEventSource = (*virtualEvents)(nil)

// AttachWorker implements picker.KVEventSource.
func (v *virtualEvents) AttachWorker(spec picker.WorkerEventSpec, idx *kvindex.Index) error {
	v.idx[spec.WorkerID] = idx
	return nil
}

// DetachWorker implements picker.KVEventSource.
func (v *virtualEvents) DetachWorker(workerID uint64) { delete(v.idx, workerID) }

// virtualClock is the replay's simulated clock, the selection core's Now.
type virtualClock struct {
	base time.Time
	now  time.Duration
}

func (c *virtualClock) time() time.Time { return c.base.Add(c.now) }

// runVirtualBaseline replays rc.Workload for baseline b in simulated time (--virtual): kvepp's
// selection core (picker, ledger, prefix index and the baseline's policy, configured from the same
// DYN_* settings as the kvepp process of a real replay) runs in-process on a simulated clock
// against one enginesim.Sim per worker. Requests are routed at their arrival; each engine's steps
// are applied in time order, their KV events go through the vLLM wire encoding and kvepp's event
// converter into the index, a streamed request's first token completes its prefill, and its last
// token frees its booking. Nothing is timed by the machine, so a run is deterministic for a seed
// and takes seconds; what it does not exercise is the wire path (ext_proc, ZeroMQ, HTTP).
func runVirtualBaseline(ctx context.Context, rc RunConfig, b Baseline) (*baselineRun, error) {
	began := time.Now()
	spec := rc.kveppSpecFor(b, rc.workersFile(b))
	cfg, err := runner.LoadConfig(spec.environ(), nil, io.Discard)
	if err != nil {
		return nil, fmt.Errorf("baseline %s: %w", b.Name, err)
	}
	pc, err := runner.PickerConfig(cfg, catalog.Builtins())
	if err != nil {
		return nil, fmt.Errorf("baseline %s: %w", b.Name, err)
	}
	clock := &virtualClock{base: time.Unix(1_700_000_000, 0)}
	pc.Now = clock.time
	seed := rc.Seed
	pc.RandSource = func() rand.Source { seed++; return rand.NewPCG(seed, 0x9e3779b97f4a7c15) }
	events := &virtualEvents{idx: map[uint64]*kvindex.Index{}}
	if b.UseKVEvents {
		pc.EventSource = events
	}
	svc, err := picker.New(pc)
	if err != nil {
		return nil, fmt.Errorf("baseline %s: %w", b.Name, err)
	}
	sim := rc.Sim
	n := sim.Workers
	sims := make([]*enginesim.Sim, n)
	convs := make([]*kvevents.Converter, n)
	run := &baselineRun{baseline: b, cpuMethod: "not measured (virtual replay in-process)"}
	bs, capacity := uint32(sim.BlockSize), uint64(sim.CapacityBlocks)
	for i := range sims {
		ec := sim.engineConfig(rc)
		ec.HashSeed = rc.Seed + uint64(i)
		if sims[i], err = enginesim.NewSim(ec); err != nil {
			return nil, err
		}
		id := uint64(i + 1)
		rec := picker.WorkerRecord{WorkerID: id, ModelName: rc.Model, Endpoint: fmt.Sprintf("http://virtual-worker-%d", i), BlockSize: &bs, TotalKVBlocks: &capacity}
		if b.UseKVEvents {
			rec.KVEventsEndpoint = fmt.Sprintf("tcp://virtual-worker-%d:5557", i)
		}
		if _, err := svc.UpsertWorker(ctx, rec, picker.SourceAPI); err != nil {
			return nil, fmt.Errorf("baseline %s: register worker %d: %w", b.Name, id, err)
		}
		convs[i] = kvevents.NewConverter(id, 0, sim.BlockSize, false)
		run.workers = append(run.workers, fmt.Sprintf("w-%d", i))
	}

	reqs := rc.Workload.Requests
	results := make([]requestResult, len(reqs))
	index := make(map[string]int, len(reqs))
	for i := range reqs {
		index[reqs[i].ID] = i
	}
	// Results are stamped on the simulated clock itself (summarize gets a time scale of 1), so
	// nothing in a virtual replay depends on --speedup, as README says; scaled by it, an extreme
	// --speedup rounded every span to 0 and the table read "out tok/s 0".
	wallOf := func(t time.Duration) time.Time { return clock.base.Add(t) }
	base := reqs[0].Arrival
	var seqs = make([]uint64, n)
	prog := newProgress(rc.Progress, rc.ProgressTTY, b.Name, len(reqs))
	defer prog.finish()
	done := 0
	var tokens []uint32
	for next := 0; next < len(reqs) || anyBusy(sims); {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		// The earliest event: a step end (first, on ties) or the next arrival.
		w, at := -1, time.Duration(0)
		for i, s := range sims {
			if end, ok := s.NextStepEnd(); ok && (w < 0 || end < at) {
				w, at = i, end
			}
		}
		if next < len(reqs) && (w < 0 || reqs[next].Arrival-base < at) {
			r := &reqs[next]
			res := &results[next]
			next++
			clock.now = r.Arrival - base
			svc.ReleaseDuePrefills(clock.time())
			res.streamed = streamed(r.ID, rc.Seed, rc.StreamFraction)
			res.sent = wallOf(clock.now)
			tokens = r.AppendTokens(tokens[:0], rc.Workload.Seed)
			t0 := time.Now()
			sel, err := svc.SelectAndReserve(ctx, picker.SelectRequest{
				ModelName: rc.Model, SelectionID: r.ID, Prompt: picker.Prompt{TokenIDs: tokens}, PrefillUnobserved: !res.streamed,
			})
			res.decision = time.Since(t0)
			if err != nil {
				res.status, res.clientErr = 503, err.Error()
				continue
			}
			wi := int(sel.WorkerID) - 1
			res.worker = run.workers[wi]
			prompt := append([]uint32(nil), tokens...)
			if err := sims[wi].Submit(r.ID, prompt, r.OutputTokens, clock.now); err != nil {
				res.status, res.clientErr = 400, err.Error()
				_ = svc.Free(ctx, r.ID)
			}
			continue
		}
		clock.now = at
		st, _ := sims[w].Step()
		if b.UseKVEvents && len(st.Events) > 0 {
			if err := applyVirtualEvents(events.idx[uint64(w+1)], convs[w], st.Events, seqs[w]); err != nil {
				return nil, fmt.Errorf("baseline %s: worker %d: %w", b.Name, w, err)
			}
			seqs[w]++
		}
		for _, id := range st.FirstTokens {
			if i := index[id]; results[i].streamed {
				_ = svc.PrefillComplete(ctx, id)
			}
		}
		feedVirtualOutput(ctx, svc, st.OutputBlocks, func(id string) bool { return results[index[id]].streamed })
		for _, rec := range st.Finished {
			i := index[rec.ID]
			res := &results[i]
			res.status, res.done = 200, true
			res.ttft, res.queue, res.e2e, res.preemptions = rec.TTFT, rec.Queue, rec.E2E, rec.Preemptions
			res.prompt, res.cached, res.output = rec.PromptTokens, rec.CachedTokens, rec.OutputTokens
			res.finished = wallOf(at)
			_ = svc.Free(ctx, rec.ID)
			run.pool.Requests++
			run.pool.PromptTokens += int64(rec.PromptTokens)
			run.pool.CachedPromptTokens += int64(rec.CachedTokens)
			run.pool.OutputTokens += int64(rec.OutputTokens)
			done++
			prog.update(done)
		}
	}
	for _, s := range sims {
		ws := s.Stats()
		run.pool.Workers = append(run.pool.Workers, ws)
		run.pool.ITL.Merge(&ws.ITL)
		run.pool.Preemptions += ws.Preemptions
	}
	run.start, run.end = clock.base, wallOf(clock.now)
	run.startup = time.Since(began)
	run.results = results
	return run, nil
}

// anyBusy reports whether some engine has a step planned.
func anyBusy(sims []*enginesim.Sim) bool {
	for _, s := range sims {
		if _, ok := s.NextStepEnd(); ok {
			return true
		}
	}
	return false
}

// applyVirtualEvents sends one step's events to idx as kvepp receives them: encoded as a vLLM
// batch, decoded and converted (re-hashed from their token ids) by kvepp's own code.
func applyVirtualEvents(idx *kvindex.Index, conv *kvevents.Converter, events []enginesim.Event, seq uint64) error {
	payload, err := enginesim.EncodeBatch(nil, 0, events, 0)
	if err != nil {
		return err
	}
	batch, err := kvevents.DecodeBatch(payload)
	if err != nil {
		return err
	}
	converted, errs := conv.Convert(batch, seq, nil)
	if len(errs) > 0 {
		return fmt.Errorf("converting KV events: %v", errs[0])
	}
	for _, ev := range converted {
		if err := idx.Apply(ev); err != nil {
			return fmt.Errorf("applying a KV event: %w", err)
		}
	}
	return nil
}

// feedVirtualOutput reports the output progress of streamed requests to the selection core as
// kvepp's ext_proc response path does (extproc: one OutputTokens call with the running total per
// response chunk; here at every output block boundary, which is where a call can change the
// booking). Non-streamed responses report nothing, as over the wire. With
// DYN_ROUTER_TRACK_OUTPUT_BLOCKS off OutputTokens does nothing.
func feedVirtualOutput(ctx context.Context, svc *picker.Service, progress []enginesim.OutputProgress, streamed func(id string) bool) {
	if !svc.TracksOutputBlocks() {
		return
	}
	for _, p := range progress {
		if streamed(p.ID) {
			_, _ = svc.OutputTokens(ctx, p.ID, uint64(p.Generated))
		}
	}
}
