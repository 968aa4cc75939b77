package enginesim

import (
	"bufio"
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestConfigValidation(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"a negative block size is rejected", Config{BlockSize: -1}, "BlockSize -1"},
		{"a negative capacity is rejected", Config{CapacityBlocks: -2}, "CapacityBlocks -2"},
		{"a negative batch limit is rejected", Config{MaxRunning: -1}, "MaxRunning -1"},
		{"a negative prefill time is rejected", Config{PrefillPerToken: -time.Millisecond}, "PrefillPerToken -1ms"},
		{"a negative decode time is rejected", Config{DecodePerToken: -1}, "DecodePerToken"},
		{"a negative time scale is rejected", Config{TimeScale: -1}, "TimeScale -1"},
		{"an unusable HTTP address is rejected", Config{HTTPAddr: "256.0.0.1:http"}, `HTTPAddr "256.0.0.1:http"`},
		{"an unusable KV events endpoint is rejected", Config{KVEventsAddr: "bogus://x"}, `"bogus://x"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w, err := Start(tc.cfg)
			if err == nil {
				w.Close()
				t.Fatal("Start succeeded")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err %q does not name %q", err, tc.want)
			}
		})
	}
	t.Run("zero values take the documented defaults", func(t *testing.T) {
		w := startWorker(t, Config{})
		c := w.Config()
		if c.BlockSize != 16 || c.CapacityBlocks != DefaultCapacityBlocks || c.MaxRunning != 256 || c.TimeScale != 1 ||
			c.DefaultMaxTokens != 16 || c.ReplayBuffer != 10000 || c.Model != DefaultModel || c.Name != "enginesim" {
			t.Errorf("effective config %+v", c)
		}
		for _, ep := range []string{w.Endpoint(), w.KVEventsEndpoint(), w.ReplayEndpoint()} {
			if !strings.Contains(ep, "127.0.0.1:") || strings.HasSuffix(ep, ":0") {
				t.Errorf("endpoint %q is not a bound loopback port", ep)
			}
		}
	})
}

func TestTimingModel(t *testing.T) {
	const scale = 0.01
	w := startWorker(t, Config{
		TimeScale:       scale,
		PrefillOverhead: 20 * time.Millisecond,
		PrefillPerToken: time.Millisecond,
		DecodePerToken:  5 * time.Millisecond,
	})
	prompt := seqTokens(0, 40)
	tests := []struct {
		name        string
		wantCached  int
		wantPrefill time.Duration
	}{
		{"a cold request prefills every prompt token", 0, 20*time.Millisecond + 40*time.Millisecond},
		{"a warm request prefills only the uncached tail", 32, 20*time.Millisecond + 8*time.Millisecond},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			rec, err := w.Generate(context.Background(), prompt, 4)
			if err != nil {
				t.Fatal(err)
			}
			wall := time.Since(start)
			if rec.CachedTokens != tc.wantCached || rec.PromptTokens != 40 || rec.OutputTokens != 4 {
				t.Errorf("record %+v", rec)
			}
			if got := rec.TTFT - rec.Queue; got != tc.wantPrefill {
				t.Errorf("TTFT − queue = %v, want %v", got, tc.wantPrefill)
			}
			if got := rec.E2E - rec.TTFT; got != 3*5*time.Millisecond {
				t.Errorf("E2E − TTFT = %v, want 3 × 5ms", got)
			}
			if minWall := time.Duration(float64(tc.wantPrefill+15*time.Millisecond) * scale); wall < minWall {
				t.Errorf("request took %v of wall time, less than the scaled %v", wall, minWall)
			}
		})
	}
}

func TestBatchLimitQueuesRequests(t *testing.T) {
	// Each request takes 400 ms simulated = 40 ms wall.
	w := startWorker(t, Config{MaxRunning: 1, TimeScale: 0.1, PrefillOverhead: 400 * time.Millisecond})
	var wg sync.WaitGroup
	recs := make([]RequestRecord, 3)
	for i := range recs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rec, err := w.Generate(context.Background(), seqTokens(100*i, 20), 1)
			if err != nil {
				t.Error(err)
			}
			recs[i] = rec
		}()
		// Stagger arrivals so the FIFO order is known.
		waitFor(t, "the request to be admitted or queued", func() bool {
			s := w.Stats()
			return s.Running+s.Waiting == i+1
		})
	}
	if s := w.Stats(); s.Running != 1 || s.Waiting != 2 {
		t.Errorf("with 3 requests and a batch limit of 1: running %d waiting %d, want 1 and 2", s.Running, s.Waiting)
	}
	wg.Wait()
	s := w.Stats()
	if s.PeakRunning != 1 || s.Requests != 3 || s.Waiting != 0 || s.Running != 0 {
		t.Errorf("stats %+v: want peak 1 and 3 completed", s)
	}
	for i := 1; i < 3; i++ {
		if !recs[i].Finished.After(recs[i-1].Finished) {
			t.Errorf("request %d finished before request %d: the queue is not FIFO", i, i-1)
		}
		if minQueue := time.Duration(i) * 300 * time.Millisecond; recs[i].Queue < minQueue {
			t.Errorf("request %d queued %v simulated, want ≥ %v behind %d earlier requests", i, recs[i].Queue, minQueue, i)
		}
		if recs[i].TTFT != recs[i].Queue+400*time.Millisecond {
			t.Errorf("request %d TTFT %v ≠ queue %v + prefill 400ms", i, recs[i].TTFT, recs[i].Queue)
		}
	}
}

func TestQueuedRequestCanBeCanceled(t *testing.T) {
	w := startWorker(t, Config{MaxRunning: 1, TimeScale: 0.01, PrefillOverhead: time.Second}) // 10 ms wall each
	done := make(chan error, 1)
	go func() {
		_, err := w.Generate(context.Background(), seqTokens(0, 20), 1)
		done <- err
	}()
	waitFor(t, "the first request to run", func() bool { return w.Stats().Running == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Millisecond)
	defer cancel()
	rec, err := w.Generate(ctx, seqTokens(500, 20), 1)
	if !errors.Is(err, context.DeadlineExceeded) || !rec.Canceled {
		t.Fatalf("queued request: err %v, canceled %v; want deadline exceeded", err, rec.Canceled)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	s := w.Stats()
	if s.Requests != 1 || s.Canceled != 1 || s.PromptTokens != 20 || s.Waiting != 0 || len(s.Records) != 2 {
		t.Errorf("stats %+v: want 1 completed, 1 canceled, nothing waiting", s)
	}
}

// generateTogether starts one Generate of one output token per prompt at once and returns the
// records in prompt order once all have finished; an error fails the test.
func generateTogether(t *testing.T, w *Worker, prompts ...[]uint32) []RequestRecord {
	t.Helper()
	var wg sync.WaitGroup
	recs := make([]RequestRecord, len(prompts))
	for i, p := range prompts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if recs[i], err = w.Generate(context.Background(), p, 1); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	return recs
}

func TestSerialPrefill(t *testing.T) {
	// TimeScale 1 and a 300 ms prefill make the second request arrive while the first one is
	// still in prefill even on a loaded machine; the assertion compares wall-clock instants, so
	// late goroutine scheduling cannot make it fail.
	const prefill = 300 * time.Millisecond
	w := startWorker(t, Config{SerialPrefill: true, TimeScale: 1, PrefillOverhead: prefill})
	recs := generateTogether(t, w, seqTokens(0, 20), seqTokens(100, 20))
	if s := w.Stats(); s.PeakRunning != 2 {
		t.Errorf("peak running %d, want 2 (both admitted)", s.PeakRunning)
	}
	// Order by prefill start, not by arrival: a goroutine can take its arrival time and then be
	// descheduled before it queues, so the earlier arrival may legitimately be prefilled second.
	start := func(r RequestRecord) time.Time { return r.Arrival.Add(r.Queue) }
	slices.SortFunc(recs, func(a, b RequestRecord) int { return start(a).Compare(start(b)) })
	firstEnd := start(recs[0]).Add(prefill)
	if !recs[1].Arrival.Before(firstEnd) {
		t.Fatalf("the second request arrived %v after the first prefill ended; the test needs them to overlap", recs[1].Arrival.Sub(firstEnd))
	}
	secondStart := start(recs[1])
	if slack := 5 * time.Millisecond; secondStart.Before(firstEnd.Add(-slack)) {
		t.Errorf("the second prefill started %v before the first one ended: prefills overlapped", firstEnd.Sub(secondStart))
	}
}

func TestPrefixIsLookedUpWhenThePrefillIsScheduled(t *testing.T) {
	// Two identical prompts reach a serial-prefill worker together. The second waits for the lane
	// while the first computes and stores the prompt; its lookup happens when its own prefill
	// starts, so it hits every block but the last (at least one token is always computed).
	w := startWorker(t, Config{SerialPrefill: true, TimeScale: 1, PrefillOverhead: 100 * time.Millisecond})
	prompt := seqTokens(0, 64)
	recs := generateTogether(t, w, prompt, prompt)
	// Order by prefill start (arrival + queue), not by queue: a goroutine can take its arrival
	// time and be descheduled before it queues, so on a loaded machine the request that waited
	// less can be the one prefilled second (this ordering by queue alone was flaky).
	start := func(r RequestRecord) time.Time { return r.Arrival.Add(r.Queue) }
	slices.SortFunc(recs, func(a, b RequestRecord) int { return start(a).Compare(start(b)) })
	if recs[0].CachedTokens != 0 || recs[1].CachedTokens != 48 {
		t.Fatalf("cached tokens %d then %d, want 0 then 48 (3 of 4 blocks)", recs[0].CachedTokens, recs[1].CachedTokens)
	}
}

func TestCloseShutsDownCleanly(t *testing.T) {
	w, err := Start(Config{TimeScale: 1, DecodePerToken: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	sub := subscribe(t, w)
	req, _ := http.NewRequest(http.MethodPost, w.Endpoint()+"/v1/completions",
		strings.NewReader(`{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"max_tokens":5,"stream":true}`))
	resp, err := testClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	r := bufio.NewReader(resp.Body)
	if line, err := r.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first stream line %q, %v", line, err)
	}
	sub.next(t) // the request's BlockStored batch

	closed := make(chan error, 1)
	go func() { closed <- w.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return while a stream was in flight")
	}
	rest, _ := bufio.NewReader(r).ReadString(0)
	if strings.Contains(rest, "[DONE]") {
		t.Error("a stream cut by Close must not end with [DONE]")
	}
	if err := w.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := w.Generate(context.Background(), seqTokens(0, 4), 1); !errors.Is(err, ErrClosed) {
		t.Errorf("Generate after Close: %v, want ErrClosed", err)
	}
	if err := w.Reset(); !errors.Is(err, ErrClosed) {
		t.Errorf("Reset after Close: %v, want ErrClosed", err)
	}
	if _, err := testClient.Get(w.Endpoint() + "/health"); err == nil {
		t.Error("the HTTP server still answers after Close")
	}
	if s := w.Stats(); s.Canceled != 1 || s.Running != 0 || s.PinnedBlocks != 0 {
		t.Errorf("stats after Close %+v: want the stream canceled and no pinned blocks", s)
	}
}

func TestPool(t *testing.T) {
	p, err := NewPool(3, Config{Name: "sim", TimeScale: 0.001})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Error(err)
		}
	})
	if p.Len() != 3 || len(p.Workers()) != 3 || p.Worker(2).Name() != "sim-2" || p.Worker(3) != nil || p.Worker(-1) != nil {
		t.Fatalf("pool of %d, worker 2 named %q", p.Len(), p.Worker(2).Name())
	}
	eps := p.Endpoints()
	if len(eps) != 3 || eps[0] == eps[1] || eps[1] == eps[2] {
		t.Errorf("endpoints %v are not distinct", eps)
	}
	prompt := seqTokens(0, 40)
	if h0, h1 := p.Worker(0).cache.blockHashes(prompt), p.Worker(1).cache.blockHashes(prompt); h0[0] == h1[0] {
		t.Error("workers must use different engine hashes for the same block")
	}
	ctx := context.Background()
	for _, i := range []int{0, 0, 1} {
		if _, err := p.Worker(i).Generate(ctx, prompt, 2); err != nil {
			t.Fatal(err)
		}
	}
	s := p.Stats()
	if s.Requests != 3 || s.PromptTokens != 120 || s.CachedPromptTokens != 32 || s.OutputTokens != 6 {
		t.Errorf("pool stats %+v", s)
	}
	if got, want := s.HitRate(), 32.0/120; got != want {
		t.Errorf("hit rate %v, want %v", got, want)
	}
	if s.Workers[0].HitRate() != 32.0/80 || s.Workers[2].Requests != 0 {
		t.Errorf("per-worker stats %+v", s.Workers)
	}
	if err := p.Reset(); err != nil {
		t.Fatal(err)
	}
	if s := p.Stats(); s.Workers[0].CachedBlocks != 0 {
		t.Errorf("worker 0 still caches %d blocks after Reset", s.Workers[0].CachedBlocks)
	}
	if _, err := NewPool(0, Config{}); err == nil {
		t.Error("NewPool(0) succeeded")
	}
	if _, err := NewPoolFrom([]Config{{}, {BlockSize: -1}}); err == nil || !strings.Contains(err.Error(), "worker 1") {
		t.Errorf("NewPoolFrom with a bad second config: %v, want an error naming worker 1", err)
	}
}
