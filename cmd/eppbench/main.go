// Command eppbench replays request traces through kvepp's real ext_proc server against simulated
// vLLM workers and compares kvepp with the routers people would otherwise use. It reports each
// router's prefix-cache hit rate beside the ideal reuse of an unbounded cache, simulated time to
// first token, throughput, kvepp's decision latency and CPU, as a markdown table on stdout and a
// JSON file and an SVG chart in --out.
//
//	go run ./cmd/eppbench                                  # built-in multi-turn chat demo, < 1 min
//	go run ./cmd/eppbench --trace ../shared/traces/mooncake_conversation_trace.jsonl --workers 8
//
// Every baseline runs against a fresh kvepp process (this binary re-executed as the real runner,
// runner, configured through its DYN_* environment) and a fresh enginesim pool with the
// same seeds; requests go through enginesim/frontproxy, which speaks ext_proc to kvepp exactly as
// Envoy does. KV events travel from the simulated workers to kvepp over ZeroMQ. See README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/enginesim"
)

// Options are the command's settings, one per flag (see parseFlags for each flag's meaning).
// Times are simulated unless named otherwise.
type Options struct {
	Trace            string   // --trace: Mooncake JSONL path; "" = synthetic chat
	Limit            int      // --limit: first N requests (0 = all)
	Skip             int      // --skip: drop the first N requests of a trace before --limit
	Speedup          float64  // --speedup: simulated time per wall time (0 = workload default)
	Workers          int      // --workers
	CapacityBlocks   int      // --capacity-blocks: per worker (0 = workload default)
	BlockSize        int      // --block-size: tokens
	Baselines        string   // --baselines: comma list of routers
	Policies         string   // --policies: extra catalog policy types, name[:key=value,…]
	PolicyConfig     string   // --policy-config: worker_selection YAML whose instances are extra routers
	Seed             uint64   // --seed: workload and simulator seed
	Out              string   // --out: output directory
	PrefillUsPerTok  float64  // --prefill-us-per-token: µs
	PrefillOverheadM float64  // --prefill-overhead-ms: ms
	DecodeUsPerTok   float64  // --decode-us-per-token: µs
	BatchLimit       int      // --batch-limit: running requests per worker
	StreamInterval   int      // --stream-interval: output tokens per streamed chunk after the first
	SerialPrefill    bool     // --serial-prefill: one prefill lane per worker
	Concurrency      int      // --concurrency: in-flight cap of the load generator (0 = none)
	MaxOutputTokens  int      // --max-output-tokens: cap (0 = none)
	TokenizerDir     string   // --tokenizer-dir: "" = the stub
	LogLevel         string   // --log-level: kvepp DYN_LOG
	Buckets          int      // --buckets: timeline buckets
	Model            string   // served model name (fixed "sim-model")
	CPUProfile       string   // --cpuprofile: file
	CoalesceMs       float64  // --coalesce-ms: ms
	KveppEnv         []string // --kvepp-env: KEY=VALUE settings
	TraceBlockTokens int      // --trace-block-tokens: tokens per trace hash id
	KveppCPUProfile  string   // --kvepp-cpuprofile: directory
	Engine           string   // --engine: vllm (step-based vLLM model) or simple
	Profile          string   // --profile: step-time profile preset of the vllm engine
	MaxBatchedTokens int      // --max-num-batched-tokens: vllm engine token budget per step (0 = the profile's)
	Stream           string   // --stream: true, false, or the fraction of requests streamed
	Virtual          bool     // --virtual: replay in simulated time, in-process (no sockets, no wall clock)
	Conversations    int      // --conversations: chat demo conversations (0 = DefaultChat's)
	streamFraction   float64  // Stream parsed: 1 = every request streamed, 0 = none
}

// Workload-dependent defaults (a flag left at 0 takes these).
const (
	synthSpeedup  = 20     // the default chat demo: ≈ 120 s of simulated time in ≈ 6 s per router
	synthCapacity = 20000  // blocks of 16 tokens per worker: 320k tokens, the KV cache of the default profile's GPU; the 4 workers hold about a quarter of the demo's history
	traceSpeedup  = 20     // Mooncake traces: 300 requests (≈ 100 s of trace) in ≈ 5 s per router
	traceCapacity = 262144 // blocks of 16 tokens per worker: 4M tokens; 8 workers hold 36 % of the full conversation trace's 93M distinct tokens, and one LRU cache of that size keeps 98 % of the ideal reuse
)

// defaultBaselines are the routers compared when --baselines is not given.
const defaultBaselines = "kvepp,kvepp-dynamo,kvepp-approx,round-robin,random,least-active-requests"

func defaultOptions() Options {
	return Options{
		Workers:          4,
		BlockSize:        16,
		Baselines:        defaultBaselines,
		Seed:             1,
		Out:              "eppbench-out",
		PrefillUsPerTok:  200,
		PrefillOverheadM: 5,
		DecodeUsPerTok:   20000,
		Engine:           string(enginesim.EngineVLLM),
		Profile:          enginesim.DefaultProfile.Name,
		Stream:           "true",
		StreamInterval:   16,
		SerialPrefill:    true,
		Concurrency:      2048,
		LogLevel:         "warn",
		Buckets:          30,
		Model:            "sim-model",
		CoalesceMs:       100,
		TraceBlockTokens: TraceBlockTokens,
	}
}

// parseFlags reads args into Options.
func parseFlags(args []string, stderr io.Writer) (Options, error) {
	o := defaultOptions()
	fs := flag.NewFlagSet("eppbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.Trace, "trace", "", "Mooncake trace (JSONL); empty = the built-in synthetic multi-turn chat workload")
	fs.IntVar(&o.Limit, "limit", 0, "replay only the first N requests (0 = all)")
	fs.IntVar(&o.Conversations, "conversations", 0, fmt.Sprintf("chat demo: number of conversations (0 = %d); more conversations load the pool harder", DefaultChat.Conversations))
	fs.IntVar(&o.Skip, "skip", 0, "trace: skip the first N requests, so --limit takes a later window (caches start cold)")
	fs.Float64Var(&o.Speedup, "speedup", 0, fmt.Sprintf("time compression: wall = simulated / speedup (0 = %d for the chat demo, %d for traces)", synthSpeedup, traceSpeedup))
	fs.IntVar(&o.Workers, "workers", o.Workers, "simulated vLLM workers")
	fs.IntVar(&o.CapacityBlocks, "capacity-blocks", 0, fmt.Sprintf("prefix-cache capacity per worker, blocks (0 = %d for the chat demo, %d for traces)", synthCapacity, traceCapacity))
	fs.IntVar(&o.BlockSize, "block-size", o.BlockSize, "KV block size, tokens (for traces it must divide --trace-block-tokens)")
	fs.StringVar(&o.Baselines, "baselines", o.Baselines, "routers to compare, comma list: kvepp (what the EPP runs out of the box), kvepp-dynamo (the spec's built-in cost), kvepp-approx, or any catalog policy type, each optionally name:key=value[,key=value…] (kvepp settings for the kvepp routers, e.g. kvepp-dynamo:track_active_blocks=false,overlap_score_credit=6; policy parameters otherwise)")
	fs.StringVar(&o.Policies, "policies", "", "extra catalog policies to compare, comma list of name[:key=value[,key=value…]] (policy parameter values are YAML scalars; kvepp settings pass as written), e.g. least-busy:min_device_overlap_blocks=2 (added to --baselines)")
	fs.StringVar(&o.PolicyConfig, "policy-config", "", "worker_selection YAML file whose instances are compared as extra routers, named after each instance")
	fs.Uint64Var(&o.Seed, "seed", o.Seed, "seed of the workload and the simulator")
	fs.StringVar(&o.Out, "out", o.Out, "output directory (result.json, chart.svg, kvepp logs)")
	fs.StringVar(&o.Engine, "engine", o.Engine, "simulated engine: vllm (vLLM V1's scheduler: token budget per step, chunked prefill, KV block pool, preemption; timed by --profile) or simple (fixed prefill cost per token on one lane, fixed time per output token)")
	fs.StringVar(&o.Profile, "profile", o.Profile, "step-time profile of the vllm engine, one of: "+strings.Join(enginesim.ProfileNames(), ", "))
	fs.IntVar(&o.MaxBatchedTokens, "max-num-batched-tokens", 0, "vllm engine: token budget per step (vLLM max_num_batched_tokens; 0 = the profile's)")
	fs.BoolVar(&o.Virtual, "virtual", false, "replay in simulated time in-process: kvepp's selection core and policy on a simulated clock against the engine model (--engine), no sockets, no wall clock; deterministic and fast, but without the ext_proc/ZeroMQ wire path")
	fs.StringVar(&o.Stream, "stream", o.Stream, `responses: "true" (every request streamed), "false" (none), or the fraction of requests streamed, e.g. 0.5`)
	fs.Float64Var(&o.PrefillUsPerTok, "prefill-us-per-token", o.PrefillUsPerTok, "simple engine: simulated prefill time per uncached prompt token, µs")
	fs.Float64Var(&o.PrefillOverheadM, "prefill-overhead-ms", o.PrefillOverheadM, "simple engine: simulated fixed prefill time per request, ms")
	fs.Float64Var(&o.DecodeUsPerTok, "decode-us-per-token", o.DecodeUsPerTok, "simple engine: simulated time per output token, µs")
	fs.IntVar(&o.BatchLimit, "batch-limit", 0, fmt.Sprintf("requests a worker runs at once (vLLM max_num_seqs; 0 = the profile's for the vllm engine, %d for the simple one)", simpleBatchLimit))
	fs.IntVar(&o.StreamInterval, "stream-interval", o.StreamInterval, "output tokens per streamed chunk after the first (vLLM --stream-interval); token timing is unchanged, larger values save CPU")
	fs.BoolVar(&o.SerialPrefill, "serial-prefill", o.SerialPrefill, "simple engine: one prefill at a time per worker (compute-bound GPU)")
	fs.IntVar(&o.Concurrency, "concurrency", o.Concurrency, "cap on requests in flight from the load generator (0 = none)")
	fs.Float64Var(&o.CoalesceMs, "coalesce-ms", o.CoalesceMs, "least simulated time between two response chunks the proxy passes through ext_proc (0 = every upstream read; the first chunk is never delayed)")
	fs.IntVar(&o.TraceBlockTokens, "trace-block-tokens", TraceBlockTokens, "tokens per trace hash_id (1..512): smaller values shrink every prompt proportionally and keep the reuse structure")
	fs.IntVar(&o.MaxOutputTokens, "max-output-tokens", 0, "cap on each request's output tokens (0 = as the workload says)")
	fs.StringVar(&o.TokenizerDir, "tokenizer-dir", "", "tokenizer directory for kvepp (default: a stub; token-id prompts never call it)")
	fs.StringVar(&o.LogLevel, "log-level", o.LogLevel, "kvepp log level (logs go to <out>/work/kvepp-<router>.log)")
	fs.IntVar(&o.Buckets, "buckets", o.Buckets, "time buckets of the hit-rate timeline")
	fs.Func("kvepp-env", "extra KEY=VALUE setting for every kvepp instance, e.g. DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT=2 (repeatable; KEY as in kvepp:key=value routers)", func(v string) error {
		k, val, ok := strings.Cut(v, "=")
		if k, val = strings.TrimSpace(k), strings.TrimSpace(val); !ok || k == "" || val == "" {
			return fmt.Errorf("want KEY=VALUE, got %q", v)
		}
		name, err := resolveSetting(k)
		if err != nil {
			return err
		}
		for _, prev := range o.KveppEnv {
			if strings.HasPrefix(prev, name+"=") {
				return fmt.Errorf("%s is given twice", name)
			}
		}
		o.KveppEnv = append(o.KveppEnv, name+"="+val)
		return nil
	})
	fs.StringVar(&o.KveppCPUProfile, "kvepp-cpuprofile", "", "directory for a CPU profile of each kvepp process (kvepp-<router>.pprof)")
	fs.StringVar(&o.CPUProfile, "cpuprofile", "", "write a CPU profile of the benchmark process (not kvepp) to this file")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	return o, o.validate()
}

// validate checks the options; errors name the flag.
func (o *Options) validate() error {
	switch {
	case o.Limit < 0:
		return fmt.Errorf("--limit %d must be ≥ 0", o.Limit)
	case o.Conversations < 0 || (o.Conversations > 0 && o.Trace != ""):
		return fmt.Errorf("--conversations %d must be ≥ 0 and is for the chat demo (no --trace)", o.Conversations)
	case o.Skip < 0 || (o.Skip > 0 && o.Trace == ""):
		return fmt.Errorf("--skip %d must be ≥ 0 and needs --trace", o.Skip)
	case strings.TrimSpace(o.Out) == "":
		return errors.New("--out must name a directory")
	case o.Speedup != 0 && !(o.Speedup >= minSpeedup && o.Speedup <= maxSpeedup):
		return fmt.Errorf("--speedup %v must be 0 (the workload default) or in %g..%g", o.Speedup, minSpeedup, maxSpeedup)
	case o.Workers < 1 || o.Workers > 1024:
		return fmt.Errorf("--workers %d must be in 1..1024", o.Workers)
	case o.CapacityBlocks < 0:
		return fmt.Errorf("--capacity-blocks %d must be ≥ 0", o.CapacityBlocks)
	case o.BlockSize < 1:
		return fmt.Errorf("--block-size %d must be ≥ 1", o.BlockSize)
	case o.TraceBlockTokens < 1 || o.TraceBlockTokens > TraceBlockTokens:
		return fmt.Errorf("--trace-block-tokens %d must be in 1..512", o.TraceBlockTokens)
	case o.Trace != "" && o.TraceBlockTokens%o.BlockSize != 0:
		return fmt.Errorf("--block-size %d must divide the trace's %d-token blocks", o.BlockSize, o.TraceBlockTokens)
	case o.timingFlagError() != nil:
		return o.timingFlagError()
	case o.Conversations > maxConversations:
		return fmt.Errorf("--conversations %d must be ≤ %d: a replay holds the prompts of every queued request in memory, and the chat demo's 60 s start window queues most of them (2,000 conversations peaked at ~2.3 GB in a virtual replay)", o.Conversations, maxConversations)
	case o.BatchLimit < 0:
		return fmt.Errorf("--batch-limit %d must be ≥ 0", o.BatchLimit)
	case o.MaxBatchedTokens < 0:
		return fmt.Errorf("--max-num-batched-tokens %d must be ≥ 0", o.MaxBatchedTokens)
	case o.StreamInterval < 1:
		return fmt.Errorf("--stream-interval %d must be ≥ 1", o.StreamInterval)
	case o.Concurrency < 0:
		return fmt.Errorf("--concurrency %d must be ≥ 0", o.Concurrency)
	case o.MaxOutputTokens < 0:
		return fmt.Errorf("--max-output-tokens %d must be ≥ 0", o.MaxOutputTokens)
	case o.Buckets < 1:
		return fmt.Errorf("--buckets %d must be ≥ 1", o.Buckets)
	}
	switch enginesim.Engine(o.Engine) {
	case enginesim.EngineVLLM:
		if _, err := enginesim.ProfileByName(o.Profile); err != nil {
			return fmt.Errorf("--profile: %w", err)
		}
	case enginesim.EngineSimple:
		if o.BatchLimit == 0 {
			o.BatchLimit = simpleBatchLimit
		}
	default:
		return fmt.Errorf("--engine %q must be vllm or simple", o.Engine)
	}
	f, err := parseStream(o.Stream)
	if err != nil {
		return err
	}
	o.streamFraction = f
	if o.Speedup == 0 {
		o.Speedup = synthSpeedup
		if o.Trace != "" {
			o.Speedup = traceSpeedup
		}
	}
	if o.CapacityBlocks == 0 {
		o.CapacityBlocks = synthCapacity
		if o.Trace != "" {
			o.CapacityBlocks = traceCapacity
		}
	}
	_, err = o.baselines()
	return err
}

// simpleBatchLimit is the simple engine's default --batch-limit.
const simpleBatchLimit = 64

// parseStream parses --stream: "true" → 1, "false" → 0, or a fraction of requests in [0, 1].
func parseStream(s string) (float64, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "true":
		return 1, nil
	case "false":
		return 0, nil
	}
	f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || !(f >= 0 && f <= 1) {
		return 0, fmt.Errorf(`--stream %q must be true, false or a fraction of requests in [0, 1]`, s)
	}
	return f, nil
}

// simProfile is the step profile of o (vllm engine), with --max-num-batched-tokens and
// --batch-limit applied.
func (o *Options) simProfile() enginesim.StepProfile {
	p, _ := enginesim.ProfileByName(o.Profile) // validate checked the name
	if o.MaxBatchedTokens > 0 {
		p.MaxNumBatchedTokens = o.MaxBatchedTokens
	}
	if o.BatchLimit > 0 {
		p.MaxNumSeqs = o.BatchLimit
	}
	return p
}

func main() {
	if os.Getenv(childEnv) == "1" {
		os.Exit(runChild())
	}
	if len(os.Args) > 1 && os.Args[1] == "load" { // eppbench load: the ext_proc load benchmark (load.go)
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
		code := runLoadCommand(ctx, os.Args[2:], os.Stdout, os.Stderr)
		stop()
		os.Exit(code)
	}
	// The load generator, proxy and simulator allocate a prompt-sized body per request and hop;
	// a higher GC target trades memory for CPU the kvepp process can use, and a soft limit keeps
	// an overloaded replay (long queues of in-flight requests) from growing without bound. (kvepp
	// itself runs with Go's defaults.)
	debug.SetGCPercent(400)
	debug.SetMemoryLimit(3 << 30)
	opts, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "eppbench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if opts.CPUProfile != "" {
		f, err := os.Create(opts.CPUProfile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "eppbench: --cpuprofile:", err)
			os.Exit(2)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "eppbench: --cpuprofile:", err)
			os.Exit(2)
		}
		defer func() { pprof.StopCPUProfile(); f.Close() }()
	}
	res, err := Run(ctx, opts, os.Stderr, isTerminal(os.Stderr))
	if res != nil && len(res.Baselines) > 0 {
		writeTable(os.Stdout, res)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "eppbench:", err)
		pprof.StopCPUProfile()
		os.Exit(1)
	}
	fmt.Fprintf(os.Stderr, "eppbench: wrote %s and %s\n", filepath.Join(opts.Out, "result.json"), filepath.Join(opts.Out, "chart.svg"))
}

// isTerminal reports whether f is a character device (a terminal).
func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// loadWorkload builds the workload of o.
func loadWorkload(o Options) (*Workload, error) {
	var w *Workload
	var err error
	if o.Trace != "" {
		limit := o.Limit
		if limit > 0 {
			limit += o.Skip
		}
		w, err = LoadTrace(o.Trace, limit, o.TraceBlockTokens, o.Seed)
		if err == nil && o.Skip > 0 {
			if o.Skip >= len(w.Requests) {
				return nil, fmt.Errorf("--skip %d leaves none of the trace's %d requests", o.Skip, len(w.Requests))
			}
			w.Requests = w.Requests[o.Skip:]
		}
	} else {
		chat := DefaultChat
		if o.Conversations > 0 {
			chat.Conversations = o.Conversations
		}
		w, err = SyntheticChat(chat, o.Seed, o.Limit)
	}
	if err != nil {
		return nil, err
	}
	if o.MaxOutputTokens > 0 {
		for i := range w.Requests {
			w.Requests[i].OutputTokens = min(w.Requests[i].OutputTokens, o.MaxOutputTokens)
		}
	}
	return w, nil
}

// Run performs a whole benchmark: it loads the workload, replays it once per baseline, and writes
// result.json and chart.svg into o.Out. progress receives the progress display (tty selects the
// in-place bar). It returns the results gathered so far together with any error.
func Run(ctx context.Context, o Options, progress io.Writer, tty bool) (*Result, error) {
	began := time.Now()
	baselines, err := o.baselines()
	if err != nil {
		return nil, err
	}
	w, err := loadWorkload(o)
	if err != nil {
		return nil, err
	}
	ideal := IdealReuse(w, o.BlockSize)
	prompt, output := w.Totals()
	var idealTokens, pooledTokens int64
	for _, v := range ideal {
		idealTokens += v
	}
	for _, v := range PooledLRUReuse(w, o.BlockSize, o.Workers*o.CapacityBlocks) {
		pooledTokens += v
	}
	var optimalTokens int64
	for _, v := range OptimalReuse(w, o.BlockSize, func(int) int { return o.Workers * o.CapacityBlocks }) {
		optimalTokens += v
	}

	workDir := filepath.Join(o.Out, "work")
	if err := os.MkdirAll(workDir, 0o755); err != nil {
		return nil, fmt.Errorf("create --out %q: %w", o.Out, err)
	}
	absWork, err := filepath.Abs(workDir)
	if err != nil {
		return nil, err
	}
	if o.KveppCPUProfile != "" {
		if err := os.MkdirAll(o.KveppCPUProfile, 0o755); err != nil {
			return nil, fmt.Errorf("--kvepp-cpuprofile: %w", err)
		}
	}
	tokDir := o.TokenizerDir
	if tokDir == "" {
		if tokDir, err = writeStubTokenizer(filepath.Join(absWork, "tokenizer")); err != nil {
			return nil, err
		}
	}
	reg := catalog.Builtins()
	if err := checkBaselines(reg, baselines); err != nil {
		return nil, err
	}
	var instances []string
	for _, b := range baselines {
		instances = append(instances, b.Instance)
	}
	doc, err := policyConfig(policyInstances(baselines))
	if err != nil {
		return nil, fmt.Errorf("policy config: %w", err)
	}
	if err := validatePolicies(reg, doc, instances); err != nil {
		return nil, fmt.Errorf("policy config: %w", err)
	}
	policyPath := filepath.Join(absWork, "policies.yaml")
	if err := os.WriteFile(policyPath, doc, 0o644); err != nil {
		return nil, err
	}

	rc := RunConfig{
		Workload:    w,
		Speedup:     o.Speedup,
		Concurrency: o.Concurrency,
		Seed:        o.Seed,
		Sim: SimConfig{
			Workers:         o.Workers,
			BlockSize:       o.BlockSize,
			CapacityBlocks:  o.CapacityBlocks,
			PrefillPerToken: time.Duration(o.PrefillUsPerTok * float64(time.Microsecond)),
			PrefillOverhead: time.Duration(o.PrefillOverheadM * float64(time.Millisecond)),
			DecodePerToken:  time.Duration(o.DecodeUsPerTok * float64(time.Microsecond)),
			BatchLimit:      o.BatchLimit,
			StreamInterval:  o.StreamInterval,
			SerialPrefill:   o.SerialPrefill,
			Engine:          enginesim.Engine(o.Engine),
		},
		StreamFraction:  o.streamFraction,
		Model:           o.Model,
		TokenizerDir:    tokDir,
		PolicyConfig:    policyPath,
		WorkDir:         absWork,
		LogLevel:        o.LogLevel,
		Progress:        progress,
		ProgressTTY:     tty,
		Buckets:         o.Buckets,
		Coalesce:        time.Duration(o.CoalesceMs * float64(time.Millisecond) / o.Speedup),
		KveppEnv:        o.KveppEnv,
		KveppProfileDir: o.KveppCPUProfile,
		Virtual:         o.Virtual,
	}
	if rc.Sim.Engine == enginesim.EngineVLLM {
		rc.Sim.Profile = o.simProfile()
	}
	res := &Result{
		Started: began.UTC().Format(time.RFC3339),
		Workload: WorkloadInfo{
			Name: w.Name, Requests: len(w.Requests), SpanSeconds: w.Span().Seconds(),
			PromptTokens: prompt, OutputTokens: output, Seed: o.Seed,
			IdealHitTokens: idealTokens, IdealHitRate: float64(idealTokens) / float64(max(prompt, 1)),
			PooledLRUHitRate:       float64(pooledTokens) / float64(max(prompt, 1)),
			OptimalEvictionHitRate: float64(optimalTokens) / float64(max(prompt, 1)),
		},
		Setup: SetupInfo{
			Workers: o.Workers, BlockSize: o.BlockSize, CapacityBlocks: o.CapacityBlocks,
			PrefillUsPerToken: o.PrefillUsPerTok, PrefillOverheadMs: o.PrefillOverheadM, DecodeUsPerToken: o.DecodeUsPerTok,
			BatchLimit: o.BatchLimit, StreamInterval: o.StreamInterval, SerialPrefill: o.SerialPrefill, Speedup: o.Speedup, Concurrency: o.Concurrency,
			Engine: o.Engine, StreamedFraction: o.streamFraction, Virtual: o.Virtual,
			SimSeed:             o.Seed,
			CoalesceMs:          o.CoalesceMs,
			KveppEnv:            o.KveppEnv,
			ThroughputTimeBasis: "simulated seconds (wall × speedup), first request sent to last response completed",
			CPUMethod:           "user+system CPU of the separate kvepp process during the replay window (/proc/<pid>/stat), else its whole-life rusage",
		},
	}
	if rc.Sim.Engine == enginesim.EngineVLLM {
		p := rc.Sim.Profile
		res.Setup.Profile = &p
		res.Setup.BatchLimit = p.MaxNumSeqs
	}
	if progress != nil {
		fmt.Fprintf(progress, "eppbench: %s: %d requests over %.0f s simulated (%.0f s wall at speedup %g), ideal reuse %.1f %% (pooled LRU %.1f %%)\n",
			w.Name, len(w.Requests), w.Span().Seconds(), w.Span().Seconds()/o.Speedup, o.Speedup, 100*res.Workload.IdealHitRate,
			100*res.Workload.PooledLRUHitRate)
	}
	if err := checkKveppConfigs(rc, baselines); err != nil {
		return nil, err
	}
	var runErr error
	for _, b := range baselines {
		if ctx.Err() != nil {
			runErr = ctx.Err()
			break
		}
		var run *baselineRun
		var err error
		if o.Virtual {
			run, err = runVirtualBaseline(ctx, rc, b)
		} else {
			run, err = runBaseline(ctx, rc, b)
		}
		if err != nil {
			runErr = err
			break
		}
		timeScale := o.Speedup // simulated seconds per wall second of the results' stamps
		if o.Virtual {
			timeScale = 1 // stamped on the simulated clock (runVirtualBaseline)
		}
		br := summarize(run, w, ideal, timeScale, o.Buckets)
		if err := writeRequestsCSV(filepath.Join(absWork, "requests-"+fileSlug(b.Name)+".csv"), run, w, ideal); err != nil {
			runErr = err
			break
		}
		res.Baselines = append(res.Baselines, br)
		if progress != nil {
			fmt.Fprintf(progress, "eppbench: %s\n", describe(br))
		}
	}
	res.WallSeconds = time.Since(began).Seconds()
	res.Warnings = saturationWarnings(res)
	if len(res.Baselines) > 0 {
		if err := writeJSON(filepath.Join(o.Out, "result.json"), res); err != nil {
			return res, errors.Join(runErr, err)
		}
		if err := os.WriteFile(filepath.Join(o.Out, "chart.svg"), []byte(renderSVG(res)), 0o644); err != nil {
			return res, errors.Join(runErr, err)
		}
	}
	return res, runErr
}

// Bounds of the flags whose extreme values broke a replay rather than describing one.
const (
	// minSpeedup and maxSpeedup bound --speedup: beyond them wall = simulated / speedup rounds
	// to 0 or overflows a time.Duration.
	minSpeedup, maxSpeedup = 1e-3, 1e6
	// maxTimingFlag bounds the simple engine's timings and --coalesce-ms (µs per token, ms): 10^6
	// (a second per token, 17 minutes of overhead) keeps every step time of a 2^24-token prompt
	// within a time.Duration, where 1e300 came back as a negative duration.
	maxTimingFlag = 1e6
	// maxConversations bounds --conversations (the default chat demo has 120).
	maxConversations = 2000
)

// timingFlagError names the first timing flag that is NaN, infinite, negative or above
// maxTimingFlag, or returns nil.
func (o *Options) timingFlagError() error {
	for _, f := range []struct {
		name string
		v    float64
	}{{"--prefill-us-per-token", o.PrefillUsPerTok}, {"--prefill-overhead-ms", o.PrefillOverheadM},
		{"--decode-us-per-token", o.DecodeUsPerTok}, {"--coalesce-ms", o.CoalesceMs}} {
		if !(f.v >= 0 && f.v <= maxTimingFlag) {
			return fmt.Errorf("%s %v must be a finite number in 0..%g", f.name, f.v, float64(maxTimingFlag))
		}
	}
	return nil
}
