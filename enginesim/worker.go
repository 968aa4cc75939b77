package enginesim

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults applied by [Start] to zero-valued [Config] fields.
const (
	DefaultBlockSize      = 16                  // tokens per block
	DefaultCapacityBlocks = 8192                // blocks
	DefaultMaxRunning     = 256                 // concurrently running requests (vLLM max_num_seqs)
	DefaultMaxTokens      = 16                  // output tokens when a request sets none
	DefaultReplayBuffer   = 10000               // batches (vLLM buffer_steps)
	DefaultRecordLimit    = 1 << 20             // per-request records kept
	DefaultModel          = "sim-model"         // served model name
	DefaultHTTPAddr       = "127.0.0.1:0"       // host:port
	DefaultKVEventsAddr   = "tcp://127.0.0.1:0" // ZMQ endpoint
	DefaultReplayAddr     = "tcp://127.0.0.1:0" // ZMQ endpoint
)

const (
	maxRequestBodyBytes     = 64 << 20 // bytes
	maxPromptTokens         = 1 << 22  // tokens
	shutdownTimeout         = 5 * time.Second
	workerHeader            = "X-Enginesim-Worker"
	requestIDHeader         = "X-Request-Id"
	defaultWorkerNamePrefix = "enginesim"
)

// ErrClosed is returned by [Worker.Generate] and [Worker.Reset] after
// [Worker.Close].
var ErrClosed = errors.New("enginesim: worker is closed")

// Config configures one simulated vLLM server. Zero values take the defaults
// named on each field; negative or non-finite values make [Start] fail. All
// durations are simulated time (see the package documentation, "Timing model").
type Config struct {
	// Name labels the worker in the X-Enginesim-Worker response header and in
	// errors. Default "enginesim".
	Name string
	// Model is the served model name; requests naming another model get 404.
	// Default [DefaultModel].
	Model string
	// BlockSize is the KV block size in tokens. Default 16.
	BlockSize int
	// CapacityBlocks is the prefix-cache capacity in blocks. Default 8192.
	CapacityBlocks int
	// PrefillPerToken is the prefill time per uncached prompt token. Default 0.
	PrefillPerToken time.Duration
	// PrefillOverhead is a fixed time added to every request's prefill. Default 0.
	PrefillOverhead time.Duration
	// DecodePerToken is the time per output token after the first. Default 0.
	DecodePerToken time.Duration
	// MaxRunning is the batch limit: the number of requests running at once;
	// others wait FIFO. Default 256.
	MaxRunning int
	// SerialPrefill runs the prefills of running requests one at a time (FIFO),
	// modelling a compute-bound GPU; the wait counts as queueing. Default false:
	// prefills overlap.
	SerialPrefill bool
	// TimeScale is wall-clock time per simulated time: 0.01 runs 100× faster than
	// real time. Default 1.
	TimeScale float64
	// DefaultMaxTokens is the number of output tokens of a request that sets no
	// max_tokens. Default 16.
	DefaultMaxTokens int
	// HashSeed seeds the engine block hashes (vLLM's per-process NONE_HASH), so
	// different workers can use different ids for the same blocks. Default 0.
	HashSeed uint64
	// HTTPAddr is the HTTP listen address (host:port). Default "127.0.0.1:0".
	HTTPAddr string
	// KVEventsAddr is the ZMQ PUB bind endpoint. Default "tcp://127.0.0.1:0".
	KVEventsAddr string
	// ReplayAddr is the ZMQ ROUTER bind endpoint. Default "tcp://127.0.0.1:0".
	ReplayAddr string
	// ReplayBuffer is the number of recent batches kept for replay. Default 10000.
	ReplayBuffer int
	// RecordLimit caps the per-request records kept for [Worker.Stats]; later
	// requests are still counted. Default 1<<20.
	RecordLimit int
	// StreamInterval is the number of output tokens per streamed chunk after the
	// first, as vLLM's --stream-interval: the first token is always sent alone at
	// its emission time, then each chunk carries up to StreamInterval tokens and
	// is sent when its last token is generated. Token timing (and so TTFT and
	// end-to-end latency) is unchanged; larger values only cut per-chunk work,
	// which matters when a 2-core machine simulates many fast streams. Default 1.
	StreamInterval int
	// Engine selects the timing model: [EngineSimple] (the default) or [EngineVLLM]. See
	// the package documentation, "Timing model".
	Engine Engine
	// Profile is [EngineVLLM]'s step-time curve and scheduler limits; the zero value
	// means [DefaultProfile]. Ignored by EngineSimple.
	Profile StepProfile
	// MaxNumBatchedTokens is [EngineVLLM]'s token budget per step (vLLM
	// max_num_batched_tokens), tokens. Default Profile.MaxNumBatchedTokens. With
	// EngineVLLM, a zero MaxRunning defaults to Profile.MaxNumSeqs, and
	// CapacityBlocks is the whole KV block pool (vLLM num_gpu_blocks).
	MaxNumBatchedTokens int
}

// Engine names a timing model.
type Engine string

const (
	// EngineSimple is the fast model: a fixed prefill cost per uncached token, a fixed time per
	// output token, running requests that do not slow each other down, and a prefix cache of
	// CapacityBlocks whose pinned blocks are the only memory limit.
	EngineSimple Engine = "simple"
	// EngineVLLM models vLLM V1's scheduler: waiting and running queues sharing a token budget
	// per step with chunked prefill, a step time set by what the step computes ([StepProfile]),
	// a KV block pool of CapacityBlocks where running requests' blocks are not evictable,
	// recompute preemption when it is full, and prefix caching on the free blocks (LRU).
	EngineVLLM Engine = "vllm"
)

// withDefaults validates cfg and fills in defaults.
func (cfg Config) withDefaults() (Config, error) {
	switch cfg.Engine {
	case "":
		cfg.Engine = EngineSimple
	case EngineSimple:
	case EngineVLLM:
		if cfg.Profile == (StepProfile{}) {
			cfg.Profile = DefaultProfile
		}
		if err := cfg.Profile.validate(); err != nil {
			return cfg, err
		}
		if cfg.MaxNumBatchedTokens < 0 {
			return cfg, fmt.Errorf("enginesim: MaxNumBatchedTokens %d is negative", cfg.MaxNumBatchedTokens)
		}
		if cfg.MaxNumBatchedTokens == 0 {
			cfg.MaxNumBatchedTokens = cfg.Profile.MaxNumBatchedTokens
		}
		if cfg.MaxRunning == 0 {
			cfg.MaxRunning = cfg.Profile.MaxNumSeqs
		}
	default:
		return cfg, fmt.Errorf("enginesim: Engine %q must be %q or %q", cfg.Engine, EngineSimple, EngineVLLM)
	}
	ints := []struct {
		name string
		v    *int
		def  int
	}{
		{"BlockSize", &cfg.BlockSize, DefaultBlockSize},
		{"CapacityBlocks", &cfg.CapacityBlocks, DefaultCapacityBlocks},
		{"MaxRunning", &cfg.MaxRunning, DefaultMaxRunning},
		{"DefaultMaxTokens", &cfg.DefaultMaxTokens, DefaultMaxTokens},
		{"ReplayBuffer", &cfg.ReplayBuffer, DefaultReplayBuffer},
		{"RecordLimit", &cfg.RecordLimit, DefaultRecordLimit},
		{"StreamInterval", &cfg.StreamInterval, 1},
	}
	for _, f := range ints {
		if *f.v < 0 {
			return cfg, fmt.Errorf("enginesim: %s %d is negative", f.name, *f.v)
		}
		if *f.v == 0 {
			*f.v = f.def
		}
	}
	durs := []struct {
		name string
		v    time.Duration
	}{
		{"PrefillPerToken", cfg.PrefillPerToken},
		{"PrefillOverhead", cfg.PrefillOverhead},
		{"DecodePerToken", cfg.DecodePerToken},
	}
	for _, d := range durs {
		if d.v < 0 {
			return cfg, fmt.Errorf("enginesim: %s %v is negative", d.name, d.v)
		}
	}
	if math.IsNaN(cfg.TimeScale) || math.IsInf(cfg.TimeScale, 0) || cfg.TimeScale < 0 {
		return cfg, fmt.Errorf("enginesim: TimeScale %v must be a finite non-negative number", cfg.TimeScale)
	}
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 1
	}
	if cfg.Name == "" {
		cfg.Name = defaultWorkerNamePrefix
	}
	if cfg.Model == "" {
		cfg.Model = DefaultModel
	}
	if cfg.HTTPAddr == "" {
		cfg.HTTPAddr = DefaultHTTPAddr
	}
	if cfg.KVEventsAddr == "" {
		cfg.KVEventsAddr = DefaultKVEventsAddr
	}
	if cfg.ReplayAddr == "" {
		cfg.ReplayAddr = DefaultReplayAddr
	}
	return cfg, nil
}

// RequestRecord describes one request a worker ran. Token counts are in
// tokens; Queue, TTFT and E2E are simulated durations; Arrival and Finished are
// wall-clock times.
type RequestRecord struct {
	ID           string // X-Request-Id header, else "<worker name>-<n>"
	Path         string // "/v1/completions", "/v1/chat/completions", or "" for Generate
	PromptTokens int
	CachedTokens int // prefix-hit tokens (hit blocks × block size)
	OutputTokens int // tokens generated (0 if canceled before the first)
	Arrival      time.Time
	Finished     time.Time
	// Queue is the time spent waiting for a running slot (and the serial
	// prefill lane), measured and converted to simulated time; with EngineVLLM, the
	// time until the scheduler first scheduled the request.
	Queue time.Duration
	// TTFT = Queue + PrefillOverhead + PrefillPerToken × uncached tokens; with
	// EngineVLLM, arrival to the end of the step that sampled the first token.
	TTFT time.Duration
	// E2E = TTFT + (OutputTokens − 1) × DecodePerToken; with EngineVLLM, arrival
	// to the end of the step that sampled the last token.
	E2E time.Duration
	// Preemptions counts how often EngineVLLM preempted the request (recompute).
	Preemptions int
	// Canceled is true when the client went away or the worker closed before
	// the last token; such requests are not in the aggregate token counters.
	Canceled bool
}

// Stats is a snapshot of a worker's counters. Token counters cover completed
// (not canceled) requests.
type Stats struct {
	Requests           int64 // completed requests
	Canceled           int64 // requests that ended early
	PromptTokens       int64
	CachedPromptTokens int64
	OutputTokens       int64
	Running            int    // requests holding a running slot now
	Waiting            int    // requests queued for a running slot now
	PeakRunning        int    // most requests ever running at once
	CachedBlocks       int    // blocks in the prefix cache now
	PinnedBlocks       int    // cached blocks held by running requests
	BlocksStored       uint64 // blocks ever inserted
	BlocksEvicted      uint64 // blocks ever evicted (not counting Reset)
	EventBatches       uint64 // KV event batches published (the next seq)
	RecordsDropped     int64  // records not kept because of RecordLimit
	Records            []RequestRecord
	// ITL counts every gap between two consecutive output tokens of a request, simulated
	// (completed and canceled requests).
	ITL LatencyHistogram
	// The fields below are EngineVLLM's (zero with EngineSimple).
	UsedBlocks  int           // KV blocks running requests hold now
	Preemptions uint64        // recompute preemptions so far
	Steps       uint64        // scheduler steps run
	BusyTime    time.Duration // simulated time spent in steps
	// EngineLag is the simulated time steps started late because the machine running the
	// simulation fell behind (goroutines woke late); it delays every request, so a large value
	// means the figures describe the machine, not the model.
	EngineLag time.Duration
}

// HitRate returns CachedPromptTokens / PromptTokens, or 0 with no prompt tokens.
func (s Stats) HitRate() float64 {
	if s.PromptTokens == 0 {
		return 0
	}
	return float64(s.CachedPromptTokens) / float64(s.PromptTokens)
}

// Worker is one running simulated vLLM server (data-parallel rank 0). It is safe
// for concurrent use. Stop it with [Worker.Close].
type Worker struct {
	cfg    Config
	ctx    context.Context // canceled by Close
	cancel context.CancelFunc

	srv       *http.Server
	endpoint  string
	serveDone chan struct{}
	pub       *publisher

	slots   *fifoSem
	prefill *fifoSem    // nil unless SerialPrefill
	vllm    *vllmEngine // nil unless Engine is EngineVLLM
	ids     atomic.Uint64

	mu      sync.Mutex
	closed  bool
	cache   *prefixCache
	running int
	peak    int
	stats   Stats // counters and records only
	itl     LatencyHistogram

	closeOnce sync.Once
	closeErr  error
}

// Start validates cfg, binds the HTTP, ZMQ PUB and ZMQ ROUTER sockets and starts
// serving. Errors name the offending setting or address; on error nothing is
// left running.
func Start(cfg Config) (*Worker, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return nil, fmt.Errorf("enginesim: worker %s: listen on HTTPAddr %q: %w", cfg.Name, cfg.HTTPAddr, err)
	}
	pub, err := newPublisher(cfg.KVEventsAddr, cfg.ReplayAddr, cfg.ReplayBuffer)
	if err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("enginesim: worker %s: %w", cfg.Name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	w := &Worker{
		cfg:       cfg,
		ctx:       ctx,
		cancel:    cancel,
		endpoint:  "http://" + ln.Addr().String(),
		serveDone: make(chan struct{}),
		pub:       pub,
		slots:     newFIFOSem(cfg.MaxRunning),
		cache:     newPrefixCache(cfg.BlockSize, cfg.CapacityBlocks, cfg.HashSeed),
	}
	if cfg.SerialPrefill {
		w.prefill = newFIFOSem(1)
	}
	if cfg.Engine == EngineVLLM {
		w.vllm = newVLLMEngine(w)
		go w.vllm.run(ctx)
	}
	w.srv = &http.Server{
		Handler:           w.routes(),
		BaseContext:       func(net.Listener) context.Context { return ctx },
		ReadHeaderTimeout: 10 * time.Second,
	}
	go func() {
		defer close(w.serveDone)
		_ = w.srv.Serve(ln)
	}()
	return w, nil
}

// Name returns the worker's name (Config.Name or its default).
func (w *Worker) Name() string { return w.cfg.Name }

// Config returns the worker's effective configuration (defaults filled in).
func (w *Worker) Config() Config { return w.cfg }

// Endpoint returns the HTTP base URL, "http://127.0.0.1:port".
func (w *Worker) Endpoint() string { return w.endpoint }

// KVEventsEndpoint returns the ZMQ PUB endpoint of live KV events,
// "tcp://127.0.0.1:port" (kv-events-index.md §5).
func (w *Worker) KVEventsEndpoint() string { return w.pub.pubEndpoint }

// ReplayEndpoint returns the ZMQ ROUTER replay endpoint,
// "tcp://127.0.0.1:port" (kv-events-index.md §6).
func (w *Worker) ReplayEndpoint() string { return w.pub.replayEndpoint }

// HasSubscriber reports whether some ZMQ SUB client has connected to the KV
// event socket and subscribed. Batches published before that are only
// available through replay.
func (w *Worker) HasSubscriber() bool { return w.pub.hasSubscriber() }

// Stats returns a snapshot of the worker's counters and a copy of its records.
func (w *Worker) Stats() Stats {
	w.mu.Lock()
	s := w.stats
	s.Records = append([]RequestRecord(nil), w.stats.Records...)
	s.Running = w.running
	s.PeakRunning = w.peak
	s.CachedBlocks, s.PinnedBlocks = w.cache.size()
	s.BlocksStored, s.BlocksEvicted = w.cache.stored, w.cache.evicted
	s.ITL = w.itl
	s.Waiting = w.slots.waiting()
	if e := w.vllm; e != nil {
		sc := e.sched
		s.Running, s.Waiting, s.PeakRunning = len(sc.running), len(sc.waiting), sc.peak
		s.UsedBlocks, s.Preemptions, s.Steps, s.BusyTime, s.EngineLag = w.cache.usedBlocks(), sc.preemptions, sc.steps, sc.busy, e.lag
	}
	w.mu.Unlock()
	s.EventBatches = w.pub.sequence()
	return s
}

// Reset drops the whole prefix cache and publishes AllBlocksCleared, like
// vLLM's reset_prefix_cache. Running requests keep running; their blocks are
// stored again from the first block when their prefill ends. It returns
// ErrClosed after Close.
func (w *Worker) Reset() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return ErrClosed
	}
	if w.vllm != nil {
		w.vllm.sched.reset()
	} else {
		w.cache.clear()
	}
	_, err := w.pub.publish(nowSeconds(), []Event{{Kind: AllBlocksCleared}})
	return err
}

// Close stops the worker: in-flight requests are canceled (their streams end
// without [DONE]), the HTTP server shuts down, and both ZMQ sockets close. It
// waits for the worker's goroutines and is idempotent; it returns the first
// shutdown error.
func (w *Worker) Close() error {
	w.closeOnce.Do(func() {
		w.mu.Lock()
		w.closed = true
		w.mu.Unlock()
		w.cancel()
		ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
		defer cancel()
		err := w.srv.Shutdown(ctx)
		if err != nil {
			err = errors.Join(err, w.srv.Close())
		}
		<-w.serveDone
		if w.vllm != nil {
			<-w.vllm.done
		}
		if perr := w.pub.close(); perr != nil {
			err = errors.Join(err, perr)
		}
		if err != nil {
			w.closeErr = fmt.Errorf("enginesim: close worker %s: %w", w.cfg.Name, err)
		}
	})
	return w.closeErr
}

// Generate runs one request with the given prompt token ids and maxTokens
// output tokens (≤ 0 means Config.DefaultMaxTokens) through the same
// scheduler, prefix cache, KV events and timing as the HTTP API, without
// streaming, and returns its record. It returns ErrClosed after Close, an error
// for an empty prompt, and ctx.Err() (with a record marked Canceled) when ctx
// ends first.
func (w *Worker) Generate(ctx context.Context, tokens []uint32, maxTokens int) (RequestRecord, error) {
	if len(tokens) == 0 {
		return RequestRecord{}, errors.New("enginesim: prompt has no tokens")
	}
	if maxTokens <= 0 {
		maxTokens = w.cfg.DefaultMaxTokens
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(w.ctx, cancel)
	defer stop()
	return w.execute(ctx, &genRequest{
		id:        w.newID(""),
		tokens:    tokens,
		maxTokens: maxTokens,
		arrival:   time.Now(),
	}, nil)
}

type genRequest struct {
	id        string
	path      string
	tokens    []uint32
	maxTokens int
	arrival   time.Time
}

func (w *Worker) newID(header string) string {
	if header = strings.TrimSpace(header); header != "" {
		return header
	}
	return fmt.Sprintf("%s-%d", w.cfg.Name, w.ids.Add(1))
}

func (w *Worker) wall(d time.Duration) time.Duration {
	return time.Duration(float64(d) * w.cfg.TimeScale)
}

func (w *Worker) sim(d time.Duration) time.Duration {
	return time.Duration(float64(d) / w.cfg.TimeScale)
}

// execute runs a request: FIFO admission, prefix lookup, prefill, cache
// commit with KV events, then output tokens paced at DecodePerToken. onTokens,
// if non-nil, is called for each chunk of output tokens [from, to) at the
// emission time of token to−1: first for token 0 alone, then for up to
// [Config.StreamInterval] tokens at a time; an error from it cancels the
// request.
func (w *Worker) execute(ctx context.Context, req *genRequest, onTokens func(from, to int) error) (rec RequestRecord, err error) {
	if w.vllm != nil {
		return w.executeVLLM(ctx, req, onTokens)
	}
	rec = RequestRecord{ID: req.id, Path: req.path, PromptTokens: len(req.tokens), Arrival: req.arrival}
	w.mu.Lock()
	closed := w.closed
	w.mu.Unlock()
	if closed {
		return rec, ErrClosed
	}
	defer func() {
		rec.Finished = time.Now()
		if err != nil {
			rec.Canceled = true
		}
		w.finish(rec)
	}()
	hashes := w.cache.blockHashes(req.tokens) // reads only immutable fields

	if err := w.slots.acquire(ctx); err != nil {
		rec.Queue = w.sim(time.Since(req.arrival))
		return rec, err
	}
	defer w.slots.release()

	w.mu.Lock()
	w.running++
	if w.running > w.peak {
		w.peak = w.running
	}
	w.mu.Unlock()
	var pinned []*cacheBlock
	defer func() {
		w.mu.Lock()
		w.cache.release(pinned)
		w.running--
		w.mu.Unlock()
	}()

	if w.prefill != nil {
		if err := w.prefill.acquire(ctx); err != nil {
			rec.Queue = w.sim(time.Since(req.arrival))
			return rec, err
		}
	}
	// The prefix is looked up when the prefill is scheduled, as vLLM's scheduler does, so a
	// request that waited behind another with the same prefix hits the blocks that one stored.
	w.mu.Lock()
	pinned = w.cache.admit(hashes, len(req.tokens))
	w.mu.Unlock()
	bs := w.cfg.BlockSize
	rec.CachedTokens = len(pinned) * bs
	uncached := len(req.tokens) - rec.CachedTokens
	rec.Queue = w.sim(time.Since(req.arrival))
	prefill := w.cfg.PrefillOverhead + time.Duration(uncached)*w.cfg.PrefillPerToken
	if err = sleepFor(ctx, w.wall(prefill)); err != nil {
		if w.prefill != nil {
			w.prefill.release()
		}
		return rec, err
	}
	rec.TTFT = rec.Queue + prefill

	w.mu.Lock()
	res := w.cache.commit(pinned, hashes)
	pinned = res.pinned
	var events []Event
	if len(res.removed) > 0 {
		events = append(events, Event{Kind: BlockRemoved, BlockHashes: res.removed})
	}
	if n := len(res.pinned) - res.start; n > 0 {
		ev := Event{
			Kind:        BlockStored,
			BlockHashes: hashes[res.start:len(res.pinned)],
			TokenIDs:    req.tokens[res.start*bs : len(res.pinned)*bs],
			BlockSize:   bs,
		}
		if res.start > 0 {
			ev.HasParent, ev.ParentHash = true, hashes[res.start-1]
		}
		events = append(events, ev)
	}
	if len(events) > 0 {
		// Publishing under the lock keeps batch order equal to cache order. The
		// only failure is a closed publisher, i.e. a closing worker.
		_, _ = w.pub.publish(nowSeconds(), events)
	}
	w.mu.Unlock()
	// The prefill lane is handed on only now that its blocks are in the cache: a request waiting
	// for the lane with the same prefix must find them when it is scheduled.
	if w.prefill != nil {
		w.prefill.release()
	}

	first := time.Now()
	step := w.wall(w.cfg.DecodePerToken)
	for from := 0; onTokens != nil && from < req.maxTokens; {
		to := min(from+w.cfg.StreamInterval, req.maxTokens)
		if from == 0 {
			to = 1
		} else if err := sleepUntil(ctx, first.Add(time.Duration(to-1)*step)); err != nil {
			return rec, err
		}
		if err := onTokens(from, to); err != nil {
			return rec, err
		}
		rec.OutputTokens = to
		from = to
	}
	if onTokens == nil {
		if err := sleepUntil(ctx, first.Add(time.Duration(req.maxTokens-1)*step)); err != nil {
			return rec, err
		}
		rec.OutputTokens = req.maxTokens
	}
	rec.E2E = rec.TTFT + time.Duration(rec.OutputTokens-1)*w.cfg.DecodePerToken
	return rec, nil
}

// finish folds a request's record into the stats.
func (w *Worker) finish(rec RequestRecord) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if rec.OutputTokens > 1 {
		w.itl.Add(w.cfg.DecodePerToken, rec.OutputTokens-1)
	}
	w.finishLocked(rec)
}

// finishLocked is finish with w.mu held (the ITL gaps are the caller's).
func (w *Worker) finishLocked(rec RequestRecord) {
	s := &w.stats
	if rec.Canceled {
		s.Canceled++
	} else {
		s.Requests++
		s.PromptTokens += int64(rec.PromptTokens)
		s.CachedPromptTokens += int64(rec.CachedTokens)
		s.OutputTokens += int64(rec.OutputTokens)
	}
	if len(s.Records) < w.cfg.RecordLimit {
		s.Records = append(s.Records, rec)
	} else {
		s.RecordsDropped++
	}
}

func nowSeconds() float64 {
	return float64(time.Now().UnixNano()) / 1e9
}

func sleepFor(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func sleepUntil(ctx context.Context, deadline time.Time) error {
	return sleepFor(ctx, time.Until(deadline))
}
