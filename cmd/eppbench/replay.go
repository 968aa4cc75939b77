package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvepp/kvepp/enginesim"
	"github.com/kvepp/kvepp/enginesim/frontproxy"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/runner"
	"github.com/zeebo/xxh3"
)

// Baseline is one router configuration under test.
type Baseline struct {
	// Name labels the baseline in the report.
	Name string
	// Instance is the worker_selection instance kvepp selects: "" for nothing (what the EPP runs
	// out of the box), "default" for the built-in cost policy, otherwise a catalog policy type (the
	// generated config has one instance per type, named after it).
	Instance string
	// UseKVEvents selects event-driven indexing (true) or approximate mode (false).
	UseKVEvents bool
	// Type is the catalog policy type of Instance ("" for the built-in policy).
	Type string
	// Params are the instance's parameters as a JSON object (nil = none).
	Params json.RawMessage
	// Source names where the router was asked for, e.g. `--policies "least-busy"`, for errors.
	Source string
	// Env are KEY=VALUE kvepp settings for this baseline only (from "kvepp:key=value,…"); they
	// are applied after --kvepp-env, so they win.
	Env []string
}

// SimConfig is the simulated worker pool. Durations are simulated time.
type SimConfig struct {
	// Workers is the number of simulated vLLM workers.
	Workers int
	// BlockSize is the KV block size, tokens (kvepp and the workers agree).
	BlockSize int
	// CapacityBlocks is each worker's prefix-cache capacity, blocks.
	CapacityBlocks int
	// PrefillPerToken is the prefill time per uncached prompt token.
	PrefillPerToken time.Duration
	// PrefillOverhead is a fixed time added to every prefill.
	PrefillOverhead time.Duration
	// DecodePerToken is the time per output token after the first.
	DecodePerToken time.Duration
	// BatchLimit is the number of requests a worker runs at once (vLLM max_num_seqs).
	BatchLimit int
	// StreamInterval is the number of output tokens per streamed chunk after the first.
	StreamInterval int
	// SerialPrefill runs one prefill at a time per worker (a compute-bound GPU).
	SerialPrefill bool
	// Engine is the simulated engine (vllm or simple); PrefillPerToken, PrefillOverhead,
	// DecodePerToken and SerialPrefill apply to the simple one only.
	Engine enginesim.Engine
	// Profile is the vllm engine's step-time curve and scheduler limits.
	Profile enginesim.StepProfile
}

// RunConfig is one benchmark run: a workload replayed once per baseline.
type RunConfig struct {
	// Workload is replayed for every baseline.
	Workload *Workload
	// Speedup compresses time: wall = simulated / Speedup, for arrivals and the simulator alike.
	Speedup float64
	// Concurrency caps requests in flight from the load generator (0 = unlimited).
	Concurrency int
	// StreamFraction is the fraction of requests sent with "stream": true (1 = all, 0 = none);
	// which ones is fixed by the request id and the seed (streamed).
	StreamFraction float64
	// Seed seeds the simulator's engine hashes (the workload has its own seed).
	Seed uint64
	// Sim is the worker pool.
	Sim SimConfig
	// Model is the served model name.
	Model string
	// TokenizerDir is given to kvepp (see writeStubTokenizer).
	TokenizerDir string
	// PolicyConfig is the generated policy YAML path.
	PolicyConfig string
	// WorkDir holds the workers files and kvepp logs.
	WorkDir string
	// LogLevel is kvepp's DYN_LOG.
	LogLevel string
	// Progress receives the progress display (nil = none).
	Progress io.Writer
	// ProgressTTY selects an in-place bar (true) or periodic lines (false).
	ProgressTTY bool
	// Buckets is the number of time buckets of the hit-rate timeline.
	Buckets int
	// Coalesce is the proxy's ResponseCoalesce (wall-clock).
	Coalesce time.Duration
	// KveppEnv are extra KEY=VALUE settings for every kvepp instance.
	KveppEnv []string
	// KveppProfileDir, when set, receives one CPU profile per kvepp instance.
	KveppProfileDir string
	// Virtual replays in simulated time (--virtual): kvepp's clock is then the simulated one.
	Virtual bool
}

// kveppClockSpeedup is how many simulated seconds pass per second of kvepp's clock: Speedup when
// kvepp runs on the wall clock, 1 in a virtual replay, whose selection core reads the simulated
// clock. kvepp's time-valued settings (the approximate TTL, the assumed prefill rate) are scaled
// by it so they mean the same simulated time either way.
func (rc RunConfig) kveppClockSpeedup() float64 {
	if rc.Virtual {
		return 1
	}
	return rc.Speedup
}

// requestResult is what the benchmark learned about one request.
type requestResult struct {
	status      int
	clientErr   string
	decision    time.Duration // at the proxy
	immediate   int
	worker      string // simulator worker name
	ttft        time.Duration
	queue       time.Duration
	e2e         time.Duration
	streamed    bool // sent with "stream": true
	preemptions int  // vllm engine recompute preemptions
	prompt      int
	cached      int
	output      int
	done        bool // the simulator completed it
	sent        time.Time
	finished    time.Time
	dispatchLag time.Duration
}

// failure describes why the request failed, or returns "" when it completed: the client's error,
// else the status and whether the simulator completed it.
func (r *requestResult) failure() string {
	switch {
	case r.clientErr != "":
		return r.clientErr
	case r.status != 200 || !r.done:
		return fmt.Sprintf("status %d (simulator completed: %v)", r.status, r.done)
	}
	return ""
}

// baselineRun is the raw outcome of replaying the workload for one baseline.
type baselineRun struct {
	baseline  Baseline
	results   []requestResult
	start     time.Time
	end       time.Time
	cpu       time.Duration
	cpuMethod string
	peakRSS   int64
	metrics   map[string]float64
	pool      enginesim.PoolStats
	workers   []string
	startup   time.Duration
}

// engineConfig is the configuration of every simulated worker of run rc.
func (sim SimConfig) engineConfig(rc RunConfig) enginesim.Config {
	cfg := enginesim.Config{
		Name:           "w",
		Model:          rc.Model,
		BlockSize:      sim.BlockSize,
		CapacityBlocks: sim.CapacityBlocks,
		MaxRunning:     sim.BatchLimit,
		StreamInterval: sim.StreamInterval,
		TimeScale:      1 / rc.Speedup,
		HashSeed:       rc.Seed,
		ReplayBuffer:   100000,
		RecordLimit:    len(rc.Workload.Requests) + 16,
		Engine:         sim.Engine,
	}
	if sim.Engine == enginesim.EngineVLLM {
		cfg.Profile = sim.Profile
		cfg.MaxRunning = sim.Profile.MaxNumSeqs
	} else {
		cfg.PrefillPerToken, cfg.PrefillOverhead, cfg.DecodePerToken = sim.PrefillPerToken, sim.PrefillOverhead, sim.DecodePerToken
		cfg.SerialPrefill = sim.SerialPrefill
	}
	return cfg
}

// streamed reports whether request id is sent with "stream": true under fraction f: a fixed
// pseudo-random choice per (id, seed), the same for every router.
func streamed(id string, seed uint64, f float64) bool {
	switch {
	case f >= 1:
		return true
	case f <= 0:
		return false
	}
	return float64(xxh3.HashStringSeed(id, seed)>>11)/(1<<53) < f
}

// workersFile is the path of baseline b's generated workers file.
func (rc RunConfig) workersFile(b Baseline) string {
	return filepath.Join(rc.WorkDir, "workers-"+fileSlug(b.Name)+".yaml")
}

// scaledAssumedRate is kvepp's default DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND (tokens per
// second of kvepp's clock) for a pool whose simulated clock runs speedup times faster than
// kvepp's (RunConfig.kveppClockSpeedup): 10,000 tokens per simulated second, as the EPP assumes on
// real hardware. Unscaled, a non-streamed booking would be released speedup times later than the
// default intends; scaled in a virtual replay, whose kvepp reads the simulated clock, speedup
// times earlier. It comes first among
// the extra settings, so a value given with --kvepp-env or a router's settings replaces it (as
// written, in wall-clock tokens/s).
func scaledAssumedRate(speedup float64) []string {
	if speedup <= 0 {
		return nil
	}
	return []string{"DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND=" +
		strconv.FormatFloat(picker.DefaultAssumedPrefillTokensPerSecond*speedup, 'f', -1, 64)}
}

// kveppSpecFor is the kvepp configuration of baseline b in this run, with workersFile as its
// workers file.
func (rc RunConfig) kveppSpecFor(b Baseline, workersFile string) kveppSpec {
	slug := fileSlug(b.Name)
	return kveppSpec{
		Instance:     b.Instance,
		PolicyConfig: rc.PolicyConfig,
		UseKVEvents:  b.UseKVEvents,
		WorkersFile:  workersFile,
		Model:        rc.Model,
		BlockSize:    rc.Sim.BlockSize,
		TokenizerDir: rc.TokenizerDir,
		ApproxTTL:    time.Duration(float64(120*time.Second) / rc.kveppClockSpeedup()),
		LogLevel:     rc.LogLevel,
		LogFile:      filepath.Join(rc.WorkDir, "kvepp-"+slug+".log"),
		Extra:        append(append(scaledAssumedRate(rc.kveppClockSpeedup()), rc.KveppEnv...), b.Env...),
		CPUProfile:   profilePath(rc.KveppProfileDir, slug),
	}
}

// checkKveppConfigs loads every baseline's kvepp configuration the way the kvepp process will
// (runner.LoadConfig over the same environment) before anything runs, so a bad setting value, e.g.
// "kvepp:overlap_score_credit=abc", fails at once with kvepp's own message instead of after the
// routers before it have run.
func checkKveppConfigs(rc RunConfig, baselines []Baseline) error {
	// The run-wide settings first, so their errors name the flags that gave them, not a router.
	plain := rc.kveppSpecFor(Baseline{Name: "kvepp", UseKVEvents: true}, filepath.Join(rc.WorkDir, "workers.yaml"))
	if _, err := runner.LoadConfig(plain.environ(), nil, io.Discard); err != nil {
		return fmt.Errorf("the settings for every router (--kvepp-env, --log-level, --tokenizer-dir): %w", err)
	}
	for _, b := range baselines {
		spec := rc.kveppSpecFor(b, rc.workersFile(b))
		if _, err := runner.LoadConfig(spec.environ(), nil, io.Discard); err != nil {
			return fmt.Errorf("%s: %w", b.Source, err)
		}
	}
	return nil
}

// runBaseline replays rc.Workload through a fresh kvepp (a child process built from the real
// runner) and a fresh simulated pool, via the front proxy.
func runBaseline(ctx context.Context, rc RunConfig, b Baseline) (*baselineRun, error) {
	began := time.Now()
	sim := rc.Sim
	pool, err := enginesim.NewPool(sim.Workers, sim.engineConfig(rc))
	if err != nil {
		return nil, err
	}
	defer pool.Close()

	// Workers file: worker i is worker_id i+1.
	var yml strings.Builder
	for i, w := range pool.Workers() {
		fmt.Fprintf(&yml, "- worker_id: %d\n  model_name: %q\n  endpoint: %q\n  block_size: %d\n  total_kv_blocks: %d\n", i+1, rc.Model, w.Endpoint(), sim.BlockSize, sim.CapacityBlocks)
		if b.UseKVEvents {
			fmt.Fprintf(&yml, "  kv_events_endpoint: %q\n  replay_endpoint: %q\n", w.KVEventsEndpoint(), w.ReplayEndpoint())
		}
	}
	workersFile := rc.workersFile(b)
	if err := os.WriteFile(workersFile, []byte(yml.String()), 0o644); err != nil {
		return nil, err
	}
	kp, err := startKvepp(rc.kveppSpecFor(b, workersFile), 60*time.Second)
	if err != nil {
		return nil, fmt.Errorf("baseline %s: %w", b.Name, err)
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = kp.stop()
		}
	}()
	if b.UseKVEvents {
		if err := waitSubscribed(ctx, pool, kp, 30*time.Second); err != nil {
			return nil, fmt.Errorf("baseline %s: %w", b.Name, err)
		}
	}

	conn, err := frontproxy.Dial(kp.addrs.GRPC, false)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	index := make(map[string]int, len(rc.Workload.Requests))
	for i := range rc.Workload.Requests {
		index[rc.Workload.Requests[i].ID] = i
	}
	results := make([]requestResult, len(rc.Workload.Requests))
	var obsMu sync.Mutex
	observed := make(map[int]frontproxy.Exchange, len(results))
	proxy, err := frontproxy.New(frontproxy.Config{
		ExtProc:          conn,
		ResponseCoalesce: rc.Coalesce,
		Observe: func(ex frontproxy.Exchange) {
			if i, ok := index[ex.RequestID]; ok {
				obsMu.Lock()
				observed[i] = ex
				obsMu.Unlock()
			}
		},
	})
	if err != nil {
		return nil, err
	}
	srv, err := frontproxy.Start("", proxy)
	if err != nil {
		return nil, err
	}
	defer srv.Close()

	run := &baselineRun{baseline: b, startup: time.Since(began)}
	cpu0, procOK := kp.cpuTime()
	run.start = time.Now()
	if err := replay(ctx, rc, b.Name, srv.URL(), results, kp); err != nil {
		return nil, fmt.Errorf("baseline %s: %w", b.Name, err)
	}
	run.end = time.Now()
	_ = srv.Close() // waits for every exchange, so every observation is in
	obsMu.Lock()
	for i, ex := range observed {
		results[i].decision, results[i].immediate = ex.Decision, ex.Immediate
	}
	obsMu.Unlock()
	if cpu1, ok := kp.cpuTime(); ok && procOK {
		run.cpu, run.cpuMethod = cpu1-cpu0, "proc-replay-window"
	}
	run.peakRSS = kp.peakRSS()
	run.metrics, _ = scrapeMetrics(kp.addrs.Metrics, "kvepp_kv_events_total", "kvepp_kv_event_gaps_total",
		"kvepp_requests_total", "kvepp_immediate_responses_total")
	stopped = true
	if err := kp.stop(); err != nil {
		return nil, fmt.Errorf("baseline %s: %w", b.Name, err)
	}
	if run.cpuMethod == "" {
		run.cpu, run.cpuMethod = kp.lifetimeCPU(), "rusage-lifetime"
	}

	run.pool = pool.Stats()
	for _, ws := range pool.Workers() {
		run.workers = append(run.workers, ws.Name())
	}
	for wi, ws := range run.pool.Workers {
		for _, rec := range ws.Records {
			i, ok := index[rec.ID]
			if !ok {
				continue
			}
			r := &results[i]
			r.worker = run.workers[wi]
			r.ttft, r.queue, r.e2e, r.preemptions = rec.TTFT, rec.Queue, rec.E2E, rec.Preemptions
			r.prompt, r.cached, r.output = rec.PromptTokens, rec.CachedTokens, rec.OutputTokens
			r.done = !rec.Canceled
		}
	}
	run.results = results
	return run, nil
}

// waitSubscribed waits until kvepp's KV-event subscriber is connected to every worker, so no
// event is published before anyone listens (kvepp would recover it by replay, but the first
// requests would be routed blind meanwhile).
func waitSubscribed(ctx context.Context, pool *enginesim.Pool, kp *kveppProcess, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		all := true
		for _, w := range pool.Workers() {
			if !w.HasSubscriber() {
				all = false
				break
			}
		}
		if all {
			return nil
		}
		if kp.exited() {
			return errors.New("kvepp exited while subscribing to KV events")
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kvepp did not subscribe to every worker's KV events within %v%s", timeout, kp.logWarnings())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// replay sends every request at its arrival time (simulated arrival / speedup after the start),
// at most rc.Concurrency at once, and waits for all responses.
func replay(ctx context.Context, rc RunConfig, name, proxyURL string, results []requestResult, kp *kveppProcess) error {
	reqs := rc.Workload.Requests
	client := &http.Client{Transport: &http.Transport{
		Proxy:               nil,
		ReadBufferSize:      64 << 10,
		DialContext:         (&net.Dialer{Timeout: 60 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 4096,
		DisableCompression:  true,
	}}
	defer client.CloseIdleConnections()
	var sem chan struct{}
	if rc.Concurrency > 0 {
		sem = make(chan struct{}, rc.Concurrency)
	}
	prog := newProgress(rc.Progress, rc.ProgressTTY, name, len(reqs))
	defer prog.finish()
	var completed atomic.Int64
	var wg sync.WaitGroup
	url := proxyURL + "/v1/completions"
	base := reqs[0].Arrival
	start := time.Now()
	var dispatchErr error
	for i := range reqs {
		target := start.Add(time.Duration(float64(reqs[i].Arrival-base) / rc.Speedup))
		if err := sleepUntil(ctx, target, prog, &completed); err != nil {
			dispatchErr = err
			break
		}
		if kp.exited() {
			dispatchErr = errors.New("kvepp exited during the replay")
			break
		}
		if sem != nil {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				dispatchErr = ctx.Err()
			}
			if dispatchErr != nil {
				break
			}
		}
		results[i].sent = time.Now()
		results[i].dispatchLag = results[i].sent.Sub(target)
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			defer func() {
				if sem != nil {
					<-sem
				}
				completed.Add(1)
			}()
			send(ctx, client, url, rc, &reqs[i], &results[i])
		}(i)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for waiting := true; waiting; {
		select {
		case <-done:
			waiting = false
		case <-tick.C:
			prog.update(int(completed.Load()))
		}
	}
	prog.update(int(completed.Load()))
	return dispatchErr
}

// sleepUntil waits for t, updating the progress display meanwhile.
func sleepUntil(ctx context.Context, t time.Time, prog *progress, completed *atomic.Int64) error {
	for {
		d := time.Until(t)
		if d <= 0 {
			return nil
		}
		prog.update(int(completed.Load()))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(min(d, 200*time.Millisecond)):
		}
	}
}

// send posts one request as /v1/completions with a token-id prompt, streamed (SSE, read to
// [DONE]) or not (one JSON answer) as streamed chooses, and records the outcome.
func send(ctx context.Context, client *http.Client, url string, rc RunConfig, req *Request, res *requestResult) {
	res.streamed = streamed(req.ID, rc.Seed, rc.StreamFraction)
	body := completionBody(nil, rc.Model, req, rc.Workload.Seed, res.streamed)
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		res.clientErr = err.Error()
		return
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("X-Request-Id", req.ID)
	resp, err := client.Do(hr)
	if err != nil {
		res.clientErr = err.Error()
		res.finished = time.Now()
		return
	}
	defer resp.Body.Close()
	res.status = resp.StatusCode
	if resp.StatusCode != http.StatusOK {
		// An error answer (kvepp's ImmediateResponse or the worker's) carries its reason as
		// {"error": …}; keep it, so the CSV says why without a debug log.
		data, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
		res.clientErr = fmt.Sprintf("status %d: %s", resp.StatusCode, errorText(data))
		res.finished = time.Now()
		return
	}
	if !res.streamed {
		var answer struct {
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
		}
		err := json.NewDecoder(resp.Body).Decode(&answer)
		res.finished = time.Now()
		if err != nil || answer.Usage == nil {
			res.clientErr = fmt.Sprintf("non-streamed answer without usage: %v", err)
		}
		return
	}
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	var sawDone bool
	for {
		line, err := br.ReadSlice('\n')
		if bytes.HasPrefix(line, []byte("data: [DONE]")) {
			sawDone = true
		}
		if err != nil {
			if errors.Is(err, bufio.ErrBufferFull) {
				continue
			}
			if !errors.Is(err, io.EOF) {
				res.clientErr = err.Error()
			}
			break
		}
	}
	res.finished = time.Now()
	if res.status == http.StatusOK && !sawDone && res.clientErr == "" {
		res.clientErr = "stream ended without [DONE]"
	}
}

// errorText is the message of an OpenAI- or kvepp-style error body ({"error": "…"} or
// {"error": {"message": "…"}}), else the body itself, trimmed.
func errorText(body []byte) string {
	var e struct {
		Error json.RawMessage `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil && len(e.Error) > 0 {
		var msg string
		if json.Unmarshal(e.Error, &msg) == nil {
			return msg
		}
		var obj struct {
			Message string `json:"message"`
		}
		if json.Unmarshal(e.Error, &obj) == nil && obj.Message != "" {
			return obj.Message
		}
	}
	return strings.TrimSpace(string(body))
}

// completionBody renders {"model","prompt":[ids],"max_tokens","stream"} for req.
func completionBody(dst []byte, model string, req *Request, seed uint64, stream bool) []byte {
	dst = append(dst, `{"model":`...)
	dst = strconv.AppendQuote(dst, model)
	dst = append(dst, `,"prompt":[`...)
	first := true
	for _, s := range req.Segments {
		for k := 0; k < s.Len; k++ {
			if !first {
				dst = append(dst, ',')
			}
			first = false
			dst = strconv.AppendUint(dst, uint64(tokenAt(seed, s.Content, k)), 10)
		}
	}
	dst = append(dst, `],"max_tokens":`...)
	dst = strconv.AppendInt(dst, int64(req.OutputTokens), 10)
	if !stream {
		return append(dst, `,"stream":false}`...)
	}
	// continuous_usage_stats (vLLM): every chunk reports the output tokens so far, which kvepp's
	// response path uses for output blocks (DYN_ROUTER_TRACK_OUTPUT_BLOCKS) instead of estimating.
	dst = append(dst, `,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`...)
	return dst
}

// writeRequestsCSV writes one line per request of a baseline run: id, arrival (simulated s),
// worker, prompt/cached/ideal tokens, simulated queue and TTFT (ms), decision latency (µs) and
// any error — the raw data behind the summary, for analysis.
func writeRequestsCSV(path string, run *baselineRun, w *Workload, ideal []int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	bw := bufio.NewWriter(f)
	fmt.Fprintln(bw, "id,arrival_s,worker,streamed,prompt_tokens,cached_tokens,ideal_cached_tokens,output_tokens,queue_ms,ttft_ms,e2e_ms,preemptions,decision_us,status,error")
	for i := range run.results {
		r := &run.results[i]
		fmt.Fprintf(bw, "%s,%.3f,%s,%v,%d,%d,%d,%d,%.1f,%.1f,%.1f,%d,%d,%d,%q\n", w.Requests[i].ID, w.Requests[i].Arrival.Seconds(), r.worker, r.streamed,
			w.Requests[i].InputTokens, r.cached, ideal[i], r.output, float64(r.queue)/1e6, float64(r.ttft)/1e6, float64(r.e2e)/1e6, r.preemptions,
			r.decision.Microseconds(), r.status, r.failure())
	}
	if err := bw.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// profilePath is dir/kvepp-<slug>.pprof, or "" without a dir.
func profilePath(dir, slug string) string {
	if dir == "" {
		return ""
	}
	abs, err := filepath.Abs(filepath.Join(dir, "kvepp-"+slug+".pprof"))
	if err != nil {
		return ""
	}
	return abs
}

// fileSlug turns a baseline name into a file-name-safe string.
func fileSlug(name string) string {
	var b strings.Builder
	for _, r := range name {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	return b.String()
}

// sortedDurations returns a sorted copy.
func sortedDurations(ds []time.Duration) []time.Duration {
	out := append([]time.Duration(nil), ds...)
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// percentile returns the p-quantile (0 ≤ p ≤ 1) of sorted values by the nearest-rank method, 0
// for no values.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(p*float64(len(sorted))+0.999999999) - 1
	rank = max(0, min(rank, len(sorted)-1))
	return sorted[rank]
}
