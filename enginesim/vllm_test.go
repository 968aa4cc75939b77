package enginesim

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// testProfile has round numbers: a step costs 1 ms + 10 µs per token; attention is free unless a
// test sets it.
var testProfile = StepProfile{Name: "test", StepMs: 1, PerTokenUs: 10, MaxNumBatchedTokens: 64, MaxNumSeqs: 8}

// schedHarness drives a vllmScheduler in virtual time, step by step.
type schedHarness struct {
	t     *testing.T
	s     *vllmScheduler
	clock time.Duration
	steps []plannedStep
	res   []stepResult
}

func newHarness(t *testing.T, prof StepProfile, capacity int) *schedHarness {
	c := newPrefixCache(4, capacity, 0)
	return &schedHarness{t: t, s: newVLLMScheduler(prof, 4, prof.MaxNumBatchedTokens, prof.MaxNumSeqs, c)}
}

// add queues a request with the given prompt and output length, arriving now.
func (h *schedHarness) add(id string, prompt []uint32, maxTokens int) *vllmReq {
	r := newVLLMReq(&genRequest{id: id, tokens: prompt, maxTokens: maxTokens}, h.s.cache.blockHashes(prompt), h.clock)
	h.s.enqueue(r)
	return r
}

// step plans and applies one step and returns it; it fails the test if nothing was scheduled.
func (h *schedHarness) step() (plannedStep, stepResult) {
	h.t.Helper()
	st := h.s.plan(h.clock)
	if len(st.items) == 0 {
		h.t.Fatalf("step %d: nothing scheduled (waiting %d, running %d)", len(h.steps), len(h.s.waiting), len(h.s.running))
	}
	h.clock += st.dur
	res := h.s.apply(&st, h.clock)
	h.steps, h.res = append(h.steps, st), append(h.res, res)
	return st, res
}

// runAll steps until nothing is left, at most limit steps.
func (h *schedHarness) runAll(limit int) {
	h.t.Helper()
	for i := 0; !h.s.idle(); i++ {
		if i == limit {
			h.t.Fatalf("not idle after %d steps", limit)
		}
		h.step()
	}
}

// shares is what each request computed in a step, as "id:n".
func shares(st plannedStep) []string {
	var out []string
	for _, it := range st.items {
		out = append(out, it.r.id+":"+strconv.Itoa(it.n))
	}
	return out
}

func TestVLLMChunkedPrefillSharesTheTokenBudget(t *testing.T) {
	h := newHarness(t, testProfile, 1000)
	a := h.add("a", seqTokens(0, 150), 3)
	st, res := h.step()
	if got := shares(st); !slices.Equal(got, []string{"a:64"}) {
		t.Fatalf("step 1 computes %v, want a's first 64-token chunk", got)
	}
	if st.dur != time.Millisecond+64*10*time.Microsecond {
		t.Errorf("step 1 took %v, want 1 ms + 64 × 10 µs", st.dur)
	}
	if len(res.tokens) != 0 {
		t.Errorf("a sampled a token before its prefill ended")
	}
	if len(res.stored) != 1 || res.stored[0].start != 0 || res.stored[0].end != 16 {
		t.Errorf("step 1 stored %+v, want a's 16 full blocks of the chunk", res.stored)
	}
	h.step() // 64 more
	st, res = h.step()
	if got := shares(st); !slices.Equal(got, []string{"a:22"}) {
		t.Fatalf("step 3 computes %v, want the last 22 prompt tokens", got)
	}
	if len(res.tokens) != 1 || a.generated != 1 || a.firstToken != h.clock {
		t.Errorf("the step that ends the prefill samples the first token: generated %d at %v, clock %v", a.generated, a.firstToken, h.clock)
	}
	// Decode steps: one token each, until max_tokens.
	h.runAll(10)
	if a.generated != 3 || len(h.steps) != 5 {
		t.Errorf("generated %d tokens in %d steps, want 3 tokens in 3 prefill + 2 decode steps", a.generated, len(h.steps))
	}
	if h.s.cache.usedBlocks() != 0 {
		t.Errorf("%d blocks still held after the request finished", h.s.cache.usedBlocks())
	}
}

func TestVLLMDecodeComesFirstAndPrefillFillsTheRest(t *testing.T) {
	h := newHarness(t, testProfile, 1000)
	a := h.add("a", seqTokens(0, 20), 10)
	h.step() // a's prefill, first token
	h.add("b", seqTokens(1000, 200), 2)
	st, _ := h.step()
	if got := shares(st); !slices.Equal(got, []string{"a:1", "b:63"}) {
		t.Fatalf("step computes %v, want a's decode token then 63 of b's prompt", got)
	}
	if st.work.DecodeRequests != 1 || st.work.DecodeContextTokens != 21 || st.work.PrefillTokens != 63 {
		t.Errorf("step work %+v, want 1 decode over 21 tokens and 63 prefill tokens", st.work)
	}
	if a.generated != 2 {
		t.Errorf("a has %d tokens, want 2", a.generated)
	}
}

func TestVLLMStepTimeGrowsWithAttentionAndContext(t *testing.T) {
	p := testProfile
	p.AttentionPairNs, p.ContextTokenNs = 1000, 100
	w := StepWork{}
	w.addChunk(64, 100) // 64 × (100 + 32.5) = 8,480 pairs
	w.DecodeRequests, w.DecodeContextTokens = 2, 3000
	want := time.Duration((1 + 0.01*66 + 8480*1000/1e6 + 100*3000/1e6) * float64(time.Millisecond))
	if got := p.StepTime(w); got != want {
		t.Errorf("step time %v, want %v", got, want)
	}
}

func TestVLLMPrefixIsLookedUpWhenScheduled(t *testing.T) {
	h := newHarness(t, testProfile, 1000)
	prompt := seqTokens(0, 40) // 10 full blocks
	h.add("a", prompt, 1)
	h.runAll(5)
	b := h.add("b", prompt, 1)
	st, _ := h.step()
	// At most ⌊(40−1)/4⌋ = 9 blocks hit: the last block is recomputed.
	if b.cached != 36 || st.items[0].from != 36 || st.items[0].n != 4 {
		t.Errorf("b cached %d and computed %d tokens from %d, want 36 cached and the last 4 computed", b.cached, st.items[0].n, st.items[0].from)
	}
	if h.s.cache.stored != 10 {
		t.Errorf("%d blocks stored, want 10: b's recomputed last block is the cached copy", h.s.cache.stored)
	}
}

func TestVLLMRunningBlocksAreNotEvictable(t *testing.T) {
	// 12 blocks: a holds 6 prompt blocks + 1 decode block while it runs; b needs 7.
	h := newHarness(t, testProfile, 12)
	a := h.add("a", seqTokens(0, 24), 8)
	h.step()
	b := h.add("b", seqTokens(1000, 24), 1)
	for a.generated < a.maxTokens {
		st, _ := h.step()
		if slices.Contains(h.s.running, b) {
			t.Fatalf("b was admitted while a still held its blocks: step %v", shares(st))
		}
	}
	aDone := h.clock
	h.step()
	if !b.scheduled || b.firstSched != aDone {
		t.Errorf("b scheduled %v at %v, want in the step right after a finished at %v", b.scheduled, b.firstSched, aDone)
	}
	if h.s.preemptions != 0 {
		t.Errorf("%d preemptions, want none: b waited instead", h.s.preemptions)
	}
}

func TestVLLMPreemptsTheLastRunningRequestWhenThePoolIsFull(t *testing.T) {
	// 8 blocks of 4 tokens. a and b each need 3 prompt blocks; decoding grows them until a block
	// is needed and none is free.
	h := newHarness(t, testProfile, 8)
	a := h.add("a", seqTokens(0, 12), 12)
	b := h.add("b", seqTokens(1000, 12), 12)
	h.step() // both prefilled: 3 + 3 blocks, and one token each
	for h.s.preemptions == 0 {
		h.step()
		if len(h.steps) > 20 {
			t.Fatal("no preemption")
		}
	}
	if !slices.Contains(h.s.waiting, b) || a.preemptions != 0 || b.preemptions != 1 {
		t.Fatalf("after the first preemption: a preempted %d times, b %d, waiting %v; want b (the last admitted) preempted",
			a.preemptions, b.preemptions, len(h.s.waiting))
	}
	if b.computed != 0 || b.heldBlocks() != 0 {
		t.Errorf("preempted b keeps %d computed tokens and %d blocks, want none (recompute)", b.computed, b.heldBlocks())
	}
	genB := b.generated
	h.runAll(100)
	if a.generated != 12 || b.generated != 12 {
		t.Errorf("generated a %d, b %d, want 12 each", a.generated, b.generated)
	}
	if genB == 0 {
		t.Errorf("b was preempted before its first token")
	}
	if h.s.cache.usedBlocks() != 0 {
		t.Errorf("%d blocks held after both finished", h.s.cache.usedBlocks())
	}
}

func TestVLLMFreeCachedBlocksAreEvictedLeastRecentlyUsedTailFirst(t *testing.T) {
	h := newHarness(t, testProfile, 10)
	first := seqTokens(0, 21) // 5 full blocks
	h.add("a", first, 1)
	h.runAll(5)
	if cached, pinned := h.s.cache.size(); cached != 5 || pinned != 0 {
		t.Fatalf("cached %d pinned %d after a, want 5 and 0", cached, pinned)
	}
	// b needs 10 blocks: the 5 unused ones and a's 5, evicted last block first.
	h.add("b", seqTokens(1000, 40), 1)
	st, _ := h.step()
	aHashes := h.s.cache.blockHashes(first)
	want := []uint64{aHashes[4], aHashes[3], aHashes[2], aHashes[1], aHashes[0]}
	if !slices.Equal(st.removed, want) {
		t.Errorf("evicted %x, want a's blocks tail first %x", st.removed, want)
	}
}

func TestVLLMMaxNumSeqsLimitsRunning(t *testing.T) {
	p := testProfile
	p.MaxNumSeqs = 2
	h := newHarness(t, p, 1000)
	for i := 0; i < 3; i++ {
		h.add(strconv.Itoa(i), seqTokens(100*i, 8), 4)
	}
	st, _ := h.step()
	if len(st.items) != 2 || len(h.s.waiting) != 1 {
		t.Errorf("step scheduled %v with %d waiting, want 2 running and 1 waiting", shares(st), len(h.s.waiting))
	}
}

func TestVLLMCanceledRequestsReleaseTheirBlocks(t *testing.T) {
	h := newHarness(t, testProfile, 100)
	a := h.add("a", seqTokens(0, 40), 100)
	h.step()
	a.canceled.Store(true)
	if dropped := h.s.dropCanceled(nil); len(dropped) != 1 || dropped[0] != a {
		t.Fatalf("dropped %v", dropped)
	}
	if h.s.cache.usedBlocks() != 0 || !h.s.idle() {
		t.Errorf("used %d blocks, idle %v after the cancel", h.s.cache.usedBlocks(), h.s.idle())
	}
}

// vllmWorker starts a worker on the vLLM engine model.
func vllmWorker(t *testing.T, prof StepProfile, capacity int, scale float64) *Worker {
	t.Helper()
	return startWorker(t, Config{Engine: EngineVLLM, Profile: prof, BlockSize: 4, CapacityBlocks: capacity, TimeScale: scale})
}

func TestVLLMWorkerTimesRequestsByTheirSteps(t *testing.T) {
	prof := StepProfile{Name: "slow", StepMs: 10, PerTokenUs: 100, MaxNumBatchedTokens: 64, MaxNumSeqs: 8}
	w := vllmWorker(t, prof, 1000, 1)
	rec, err := w.Generate(context.Background(), seqTokens(0, 100), 5)
	if err != nil {
		t.Fatal(err)
	}
	// Prefill: chunks of 64 and 36 tokens (16.4 ms, 13.6 ms); 4 decode steps of 10.1 ms. A loaded
	// machine only makes steps start late, never early.
	wantTTFT := 30 * time.Millisecond
	if rec.TTFT < wantTTFT-time.Microsecond || rec.TTFT > wantTTFT+500*time.Millisecond {
		t.Errorf("TTFT %v, want %v plus at most the scheduling slack", rec.TTFT, wantTTFT)
	}
	if d := rec.E2E - rec.TTFT; d < 4*10100*time.Microsecond {
		t.Errorf("E2E − TTFT = %v, want ≥ 4 decode steps of 10.1 ms", d)
	}
	s := w.Stats()
	if s.Steps != 6 || s.ITL.Count() != 4 || s.Requests != 1 || s.UsedBlocks != 0 {
		t.Errorf("stats: %d steps, %d ITL samples, %d requests, %d used blocks; want 6, 4, 1, 0", s.Steps, s.ITL.Count(), s.Requests, s.UsedBlocks)
	}
	if s.CachedBlocks != 25 {
		t.Errorf("%d blocks cached, want the prompt's 25", s.CachedBlocks)
	}
}

func TestVLLMWorkerRejectsARequestThatCannotFit(t *testing.T) {
	w := vllmWorker(t, testProfile, 10, 0.05)
	_, err := w.Generate(context.Background(), seqTokens(0, 40), 4)
	if err == nil || !errors.Is(err, errTooLarge) {
		t.Fatalf("err %v, want errTooLarge", err)
	}
}

func TestVLLMWorkerStreamsPublishesEventsAndRefusesWhatCannotFit(t *testing.T) {
	w := startWorker(t, Config{Engine: EngineVLLM, Profile: testProfile, CapacityBlocks: 64, TimeScale: 0.01, StreamInterval: 2})
	sub := subscribe(t, w)
	prompt := seqTokens(5, 40)
	status, _, body := postJSON(t, w.Endpoint()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 5, "stream": true})
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, body)
	}
	events := sseEvents(t, body)
	// Token chunks [0,1), [1,3), [3,5), the usage chunk and [DONE].
	if len(events) != 5 || events[4] != "[DONE]" {
		t.Fatalf("got %d events: %v", len(events), events)
	}
	if diff := cmp.Diff(usageOf(40, 5, 0), decodeResponse(t, events[3]).Usage); diff != "" {
		t.Errorf("usage (-want +got):\n%s", diff)
	}
	b := liveBatch(t, sub.next(t), 0)
	if len(b.Events) != 1 || b.Events[0].Tag != "BlockStored" || len(b.Events[0].Hashes) != 2 || !slices.Equal(b.Events[0].Tokens, prompt[:32]) {
		t.Fatalf("first batch %+v, want the prompt's 2 full blocks stored", b.Events)
	}
	// The same prompt hits both blocks once the first request stored them (≤ ⌊39/16⌋ = 2).
	status, _, body = postJSON(t, w.Endpoint()+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 1})
	if status != http.StatusOK || !strings.Contains(string(body), `"cached_tokens":32`) {
		t.Fatalf("second request: status %d: %s", status, body)
	}
	status, _, body = postJSON(t, w.Endpoint()+"/v1/completions", map[string]any{"prompt": seqTokens(100, 1000), "max_tokens": 100})
	if status != http.StatusBadRequest || !strings.Contains(string(body), "need 69 blocks") {
		t.Fatalf("a request larger than the KV cache: status %d: %s", status, body)
	}
	if s := w.Stats(); s.Requests != 2 || s.UsedBlocks != 0 || s.Steps < 4 {
		t.Errorf("stats %+v", s)
	}
}

func TestVLLMWorkerCancelsAndCloses(t *testing.T) {
	w := vllmWorker(t, StepProfile{Name: "slow", StepMs: 50, PerTokenUs: 1, MaxNumBatchedTokens: 64, MaxNumSeqs: 8}, 1000, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := w.Generate(ctx, seqTokens(0, 40), 1000)
		done <- err
	}()
	waitFor(t, "the request to run", func() bool { return w.Stats().Running == 1 })
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled Generate returned %v", err)
	}
	waitFor(t, "the canceled request to release its blocks", func() bool { s := w.Stats(); return s.Running == 0 && s.UsedBlocks == 0 && s.Canceled == 1 })
	go func() {
		_, err := w.Generate(context.Background(), seqTokens(0, 40), 1000)
		done <- err
	}()
	waitFor(t, "the second request to run", func() bool { return w.Stats().Running == 1 })
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err == nil {
		t.Fatal("a request running across Close completed")
	}
}

func TestSimRunsTheEngineModelInVirtualTime(t *testing.T) {
	s, err := NewSim(Config{Profile: testProfile, BlockSize: 4, CapacityBlocks: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := s.NextStepEnd(); ok {
		t.Fatal("an idle engine has a step planned")
	}
	if err := s.Submit("a", seqTokens(0, 100), 3, 10*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := s.Submit("b", seqTokens(1000, 8), 1, 11*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	var first []string
	var done []RequestRecord
	var stored int
	for {
		st, ok := s.Step()
		if !ok {
			break
		}
		first, done = append(first, st.FirstTokens...), append(done, st.Finished...)
		for _, ev := range st.Events {
			if ev.Kind == BlockStored {
				stored += len(ev.BlockHashes)
			}
		}
	}
	// a: chunk 64 at 10 ms (1.64 ms), then its last 36 tokens with b's 8 (1.44 ms): both get their
	// first token at 13.08 ms; a decodes twice more (1.02 and 1.01 ms).
	if !slices.Equal(first, []string{"a", "b"}) || len(done) != 2 || done[0].ID != "b" || done[1].ID != "a" {
		t.Fatalf("first tokens %v, finished %v", first, done)
	}
	if want := 3080 * time.Microsecond; done[1].TTFT != want {
		t.Errorf("a's TTFT %v, want %v", done[1].TTFT, want)
	}
	if stored != 25+2 {
		t.Errorf("%d blocks stored, want a's 25 and b's 2", stored)
	}
	if err := s.Submit("big", seqTokens(0, 4000), 1, time.Second); !errors.Is(err, errTooLarge) {
		t.Errorf("an oversize request: %v", err)
	}
	if st := s.Stats(); st.Steps != 4 || st.ITL.Count() != 2 {
		t.Errorf("stats: %d steps, %d ITL samples; want 4 and 2", st.Steps, st.ITL.Count())
	}
}

// TestSimRunsTheSimpleEngineInVirtualTime replays three requests through the simple engine in
// virtual time: FIFO running slots, the serial prefill lane, the prefix looked up when the prefill
// starts, and the timing of Worker.execute.
func TestSimRunsTheSimpleEngineInVirtualTime(t *testing.T) {
	s, err := NewSim(Config{
		Engine: EngineSimple, BlockSize: 4, CapacityBlocks: 100, MaxRunning: 2, SerialPrefill: true,
		PrefillPerToken: time.Millisecond, PrefillOverhead: 2 * time.Millisecond, DecodePerToken: 10 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	shared := append(seqTokens(0, 20), seqTokens(500, 20)...) // a's first 5 blocks, then its own
	for _, r := range []struct {
		id     string
		tokens []uint32
		max    int
		at     time.Duration
	}{
		{"a", seqTokens(0, 40), 3, 0},
		{"b", shared, 1, time.Millisecond},
		{"c", seqTokens(1000, 8), 1, 2 * time.Millisecond},
	} {
		if err := s.Submit(r.id, r.tokens, r.max, r.at); err != nil {
			t.Fatal(err)
		}
	}
	var ends []time.Duration
	var first []string
	recs := map[string]RequestRecord{}
	stored := map[string]int{}
	for {
		st, ok := s.Step()
		if !ok {
			break
		}
		ends, first = append(ends, st.End), append(first, st.FirstTokens...)
		for _, rec := range st.Finished {
			recs[rec.ID] = rec
		}
		for _, ev := range st.Events {
			if ev.Kind == BlockStored {
				stored[st.FirstTokens[0]] += len(ev.BlockHashes)
			}
		}
	}
	ms := time.Millisecond
	// a: prefill 0–42 ms (2 + 40), tokens at 42, 52, 62. b: waits for the lane, hits a's 5 shared
	// blocks at 42, prefills 20 tokens to 64. c: waits for a running slot until a finishes at 62,
	// then for the lane until 64, prefills 8 tokens to 74.
	if want := []time.Duration{42 * ms, 62 * ms, 64 * ms, 74 * ms}; !slices.Equal(ends, want) {
		t.Fatalf("state changes at %v, want %v", ends, want)
	}
	if !slices.Equal(first, []string{"a", "b", "c"}) {
		t.Fatalf("first tokens %v", first)
	}
	for id, want := range map[string]RequestRecord{
		"a": {Queue: 0, TTFT: 42 * ms, E2E: 62 * ms, CachedTokens: 0, OutputTokens: 3},
		"b": {Queue: 41 * ms, TTFT: 63 * ms, E2E: 63 * ms, CachedTokens: 20, OutputTokens: 1},
		"c": {Queue: 62 * ms, TTFT: 72 * ms, E2E: 72 * ms, CachedTokens: 0, OutputTokens: 1},
	} {
		got := recs[id]
		if got.Queue != want.Queue || got.TTFT != want.TTFT || got.E2E != want.E2E || got.CachedTokens != want.CachedTokens || got.OutputTokens != want.OutputTokens {
			t.Errorf("%s: queue %v TTFT %v E2E %v cached %d output %d; want %v %v %v %d %d", id,
				got.Queue, got.TTFT, got.E2E, got.CachedTokens, got.OutputTokens, want.Queue, want.TTFT, want.E2E, want.CachedTokens, want.OutputTokens)
		}
	}
	if stored["a"] != 10 || stored["b"] != 5 || stored["c"] != 2 {
		t.Errorf("blocks stored per request %v, want a 10, b 5 (after its hit), c 2", stored)
	}
	if st := s.Stats(); st.Steps != 4 || st.ITL.Count() != 2 || st.PeakRunning != 2 || st.Running != 0 {
		t.Errorf("stats: %d state changes, %d ITL samples, peak %d, running %d; want 4, 2, 2, 0", st.Steps, st.ITL.Count(), st.PeakRunning, st.Running)
	}
}
