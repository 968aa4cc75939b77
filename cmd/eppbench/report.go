package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/kvepp/kvepp/enginesim"
)

// Result is the JSON result file (eppbench-out/result.json).
type Result struct {
	// Workload describes what was replayed.
	Workload WorkloadInfo `json:"workload"`
	// Setup is the simulated pool and replay settings.
	Setup SetupInfo `json:"setup"`
	// Baselines are the routers compared, in run order.
	Baselines []BaselineResult `json:"baselines"`
	// Started is when the run began (RFC 3339).
	Started string `json:"started"`
	// WallSeconds is the whole run's wall-clock time.
	WallSeconds float64 `json:"wall_seconds"`
	// Warnings are printed under the table, e.g. a saturated router (see saturationWarning).
	Warnings []string `json:"warnings,omitempty"`
}

// WorkloadInfo describes the replayed workload.
type WorkloadInfo struct {
	// Name is the trace path or "synthetic chat".
	Name string `json:"name"`
	// Requests is the number of requests replayed.
	Requests int `json:"requests"`
	// SpanSeconds is the simulated time from the first to the last arrival.
	SpanSeconds float64 `json:"span_seconds"`
	// PromptTokens and OutputTokens are the workload's token totals.
	PromptTokens int64 `json:"prompt_tokens"`
	// OutputTokens is the sum of max_tokens.
	OutputTokens int64 `json:"output_tokens"`
	// Seed is the workload and simulator seed.
	Seed uint64 `json:"seed"`
	// IdealHitRate is IdealHitTokens / PromptTokens: the reuse of one unbounded cache with the
	// simulator's block rules (IdealReuse).
	IdealHitRate float64 `json:"ideal_hit_rate"`
	// IdealHitTokens is the prompt tokens an unbounded cache would serve.
	IdealHitTokens int64 `json:"ideal_hit_tokens"`
	// PooledLRUHitRate is the reuse of one LRU cache holding the pool's whole capacity
	// (workers × capacity blocks), requests taken one at a time: a reference for limited capacity.
	PooledLRUHitRate float64 `json:"pooled_lru_hit_rate"`
	// OptimalEvictionHitRate bounds every router: the reuse of one cache holding the pool's whole
	// capacity with offline-optimal eviction (OptimalReuse). When it is near the ideal while
	// PooledLRUHitRate is far below, capacity is not what limits the hit rate: LRU eviction is.
	OptimalEvictionHitRate float64 `json:"optimal_eviction_hit_rate"`
}

// SetupInfo is the simulated pool and replay settings. Times are simulated unless named wall.
type SetupInfo struct {
	// Workers is the number of simulated workers.
	Workers int `json:"workers"`
	// BlockSize is the KV block size, tokens.
	BlockSize int `json:"block_size_tokens"`
	// CapacityBlocks is each worker's prefix-cache capacity, blocks.
	CapacityBlocks int `json:"capacity_blocks_per_worker"`
	// PrefillUsPerToken is the prefill time per uncached token, µs.
	PrefillUsPerToken float64 `json:"prefill_us_per_token"`
	// PrefillOverheadMs is the fixed prefill time per request, ms.
	PrefillOverheadMs float64 `json:"prefill_overhead_ms"`
	// DecodeUsPerToken is the time per output token, µs.
	DecodeUsPerToken float64 `json:"decode_us_per_token"`
	// BatchLimit is the number of requests a worker runs at once.
	BatchLimit int `json:"batch_limit"`
	// StreamInterval is the number of output tokens per streamed chunk after the first.
	StreamInterval int `json:"stream_interval_tokens"`
	// SerialPrefill reports one prefill lane per worker.
	SerialPrefill bool `json:"serial_prefill"`
	// Speedup is simulated time per wall time.
	Speedup float64 `json:"speedup"`
	// Concurrency is the load generator's in-flight cap (0 = none).
	Concurrency int `json:"concurrency_cap"`
	// SimSeed seeds the simulator's engine hashes.
	SimSeed uint64 `json:"sim_seed"`
	// CoalesceMs is the least simulated time between response chunks through ext_proc.
	CoalesceMs float64 `json:"response_coalesce_ms"`
	// ThroughputTimeBasis says which clock the throughput figures use.
	ThroughputTimeBasis string `json:"throughput_time_basis"`
	// CPUMethod says how kvepp's CPU time is measured.
	CPUMethod string `json:"cpu_method"`
	// KveppEnv are the extra kvepp settings (--kvepp-env).
	KveppEnv []string `json:"kvepp_env,omitempty"`
	// Engine is the simulated engine: "vllm" (step-based, timed by Profile) or "simple" (timed by
	// the prefill/decode fields above, which the vllm engine ignores).
	Engine string `json:"engine"`
	// Profile is the vllm engine's step-time curve and scheduler limits (nil for simple).
	Profile *enginesim.StepProfile `json:"step_profile,omitempty"`
	// StreamedFraction is the fraction of requests sent with "stream": true.
	StreamedFraction float64 `json:"streamed_fraction"`
	// Virtual reports a --virtual replay: simulated time, kvepp's selection core in-process
	// (decision latency is then the in-process call; kvepp CPU is not measured).
	Virtual bool `json:"virtual"`
}

// Quantiles are nearest-rank percentiles, maximum and mean of a latency, in the unit the field
// name gives (ms or µs).
type Quantiles struct {
	P50  float64 `json:"p50"`  // median
	P90  float64 `json:"p90"`  // 90th percentile
	P99  float64 `json:"p99"`  // 99th percentile
	Max  float64 `json:"max"`  // maximum
	Mean float64 `json:"mean"` // arithmetic mean
}

// WorkerShare is one worker's part of a baseline's traffic (completed requests).
type WorkerShare struct {
	Name         string  `json:"name"`          // simulator worker name
	Requests     int     `json:"requests"`      // requests served
	PromptTokens int64   `json:"prompt_tokens"` // their prompt tokens
	HitRate      float64 `json:"hit_rate"`      // their cached / prompt tokens
}

// TimelinePoint is the hit rate of the requests that arrived in one time bucket.
type TimelinePoint struct {
	StartSeconds float64 `json:"start_seconds"`  // bucket start, simulated seconds since the first arrival
	Requests     int     `json:"requests"`       // completed requests that arrived in the bucket
	HitRate      float64 `json:"hit_rate"`       // their cached / prompt tokens
	IdealHitRate float64 `json:"ideal_hit_rate"` // their ideal (unbounded) reuse / prompt tokens
}

// BaselineResult is one router's figures. Latencies named _ms are simulated unless noted; counts
// cover the requests of the workload.
type BaselineResult struct {
	Name        string `json:"name"`            // router name (--baselines / --policies)
	Instance    string `json:"policy_instance"` // worker_selection instance selected in kvepp
	UseKVEvents bool   `json:"use_kv_events"`   // DYN_ROUTER_USE_KV_EVENTS
	// KveppEnv are this baseline's own kvepp settings (KEY=VALUE, from "kvepp:key=value,…"),
	// applied after the run-wide --kvepp-env settings.
	KveppEnv []string `json:"kvepp_env,omitempty"`

	Requests  int `json:"requests"`            // requests sent
	Completed int `json:"completed"`           // answered 200 with [DONE] and completed by the simulator
	Errors    int `json:"errors"`              // the others
	Immediate int `json:"immediate_responses"` // kvepp ImmediateResponses

	PromptTokens int64   `json:"prompt_tokens"`     // prompt tokens of completed requests (simulator)
	CachedTokens int64   `json:"cached_tokens"`     // of them served from the prefix caches
	HitRate      float64 `json:"hit_rate"`          // CachedTokens / PromptTokens
	OfIdeal      float64 `json:"fraction_of_ideal"` // HitRate / WorkloadInfo.IdealHitRate

	TTFTms  Quantiles `json:"ttft_ms"`  // simulated time to first token
	QueueMs Quantiles `json:"queue_ms"` // simulated wait until the engine first scheduled the request
	E2Ems   Quantiles `json:"e2e_ms"`   // simulated end-to-end latency
	// ITLms are the gaps between consecutive output tokens over every token of every request
	// (simulated; from the workers' histograms, each quantile within 4.4 %).
	ITLms Quantiles `json:"itl_ms"`
	// TPOTms is each request's mean time per output token after the first, (E2E − TTFT) /
	// (output tokens − 1), over requests with at least two output tokens.
	TPOTms Quantiles `json:"tpot_ms"`
	// TTFTStreamedMs and TTFTNonStreamedMs split TTFT by how the response was sent (each only when
	// the run had such requests).
	TTFTStreamedMs    *Quantiles `json:"ttft_streamed_ms,omitempty"`
	TTFTNonStreamedMs *Quantiles `json:"ttft_non_streamed_ms,omitempty"`
	// Preemptions is the vllm engine's recompute preemptions over all workers.
	Preemptions uint64 `json:"preemptions"`
	// EngineLagSeconds is the simulated time the workers' steps started late because the machine
	// fell behind, summed over workers; it inflates every latency.
	EngineLagSeconds float64 `json:"engine_lag_seconds"`
	// MaxOverMeanRequests is the busiest worker's completed requests over the mean per worker.
	MaxOverMeanRequests float64 `json:"max_over_mean_requests"`

	MakespanSeconds    float64            `json:"makespan_seconds"`         // simulated: first send to last completion
	RequestsPerSecond  float64            `json:"requests_per_second"`      // completed / makespan
	OutputTokensPerSec float64            `json:"output_tokens_per_second"` // output tokens / makespan
	PromptTokensPerSec float64            `json:"prompt_tokens_per_second"` // prompt tokens / makespan
	WallSeconds        float64            `json:"wall_seconds"`             // replay wall time
	StartupWallSeconds float64            `json:"startup_wall_seconds"`     // pool + kvepp startup wall time
	DecisionUs         Quantiles          `json:"decision_us"`              // wall, at the proxy
	KveppCPUSeconds    float64            `json:"kvepp_cpu_seconds"`        // kvepp process CPU during the replay
	KveppCPUMethod     string             `json:"kvepp_cpu_method"`         // how it was measured
	KveppPeakRSSBytes  int64              `json:"kvepp_peak_rss_bytes"`     // kvepp process VmHWM
	DispatchLagMs      Quantiles          `json:"dispatch_lag_ms"`          // wall: how late requests left the load generator
	KveppMetrics       map[string]float64 `json:"kvepp_metrics"`            // selected counters scraped at the end of the replay
	Workers            []WorkerShare      `json:"workers"`                  // per-worker shares
	Timeline           []TimelinePoint    `json:"timeline"`                 // hit rate over time
	FirstErrors        []string           `json:"first_errors,omitempty"`   // up to 5 error descriptions
}

// histogramQuantiles summarizes a simulator latency histogram in milliseconds.
func histogramQuantiles(h *enginesim.LatencyHistogram) Quantiles {
	if h.Count() == 0 {
		return Quantiles{}
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	return Quantiles{P50: ms(h.Quantile(0.5)), P90: ms(h.Quantile(0.9)), P99: ms(h.Quantile(0.99)), Max: ms(h.Quantile(1)), Mean: ms(h.Mean())}
}

func quantiles(ds []time.Duration, unit time.Duration) Quantiles {
	if len(ds) == 0 {
		return Quantiles{}
	}
	s := sortedDurations(ds)
	var sum float64
	for _, d := range s {
		sum += float64(d)
	}
	f := func(d time.Duration) float64 { return float64(d) / float64(unit) }
	return Quantiles{
		P50: f(percentile(s, 0.50)), P90: f(percentile(s, 0.90)), P99: f(percentile(s, 0.99)),
		Max: f(s[len(s)-1]), Mean: sum / float64(len(s)) / float64(unit),
	}
}

// summarize turns a baseline run into its figures. ideal holds the ideal hit tokens per request.
func summarize(run *baselineRun, w *Workload, ideal []int64, speedup float64, buckets int) BaselineResult {
	br := BaselineResult{
		Name: run.baseline.Name, Instance: run.baseline.Instance, UseKVEvents: run.baseline.UseKVEvents, KveppEnv: run.baseline.Env,
		Requests:           len(run.results),
		PromptTokens:       run.pool.PromptTokens,
		CachedTokens:       run.pool.CachedPromptTokens,
		HitRate:            run.pool.HitRate(),
		WallSeconds:        run.end.Sub(run.start).Seconds(),
		StartupWallSeconds: run.startup.Seconds(),
		KveppCPUSeconds:    run.cpu.Seconds(),
		KveppCPUMethod:     run.cpuMethod,
		KveppPeakRSSBytes:  run.peakRSS,
		KveppMetrics:       run.metrics,
	}
	var ttft, queue, e2e, decision, lag, tpot, ttftS, ttftN []time.Duration
	var idealTokens, promptAll int64
	first, last := time.Time{}, time.Time{}
	perWorker := map[string]*WorkerShare{}
	for _, name := range run.workers {
		perWorker[name] = &WorkerShare{Name: name}
	}
	workerCached := map[string]int64{}
	for i := range run.results {
		r := &run.results[i]
		promptAll += int64(w.Requests[i].InputTokens)
		idealTokens += ideal[i]
		if !r.sent.IsZero() {
			lag = append(lag, r.dispatchLag)
			if first.IsZero() || r.sent.Before(first) {
				first = r.sent
			}
		}
		if r.decision > 0 {
			decision = append(decision, r.decision)
		}
		if r.immediate != 0 {
			br.Immediate++
		}
		if msg := r.failure(); msg != "" {
			br.Errors++
			if len(br.FirstErrors) < 5 {
				br.FirstErrors = append(br.FirstErrors, w.Requests[i].ID+": "+msg)
			}
			continue
		}
		br.Completed++
		ttft = append(ttft, r.ttft)
		queue = append(queue, r.queue)
		e2e = append(e2e, r.e2e)
		if r.output > 1 {
			tpot = append(tpot, (r.e2e-r.ttft)/time.Duration(r.output-1))
		}
		if r.streamed {
			ttftS = append(ttftS, r.ttft)
		} else {
			ttftN = append(ttftN, r.ttft)
		}
		if r.finished.After(last) {
			last = r.finished
		}
		if ws := perWorker[r.worker]; ws != nil {
			ws.Requests++
			ws.PromptTokens += int64(r.prompt)
			workerCached[r.worker] += int64(r.cached)
		}
	}
	if promptAll > 0 && idealTokens > 0 {
		br.OfIdeal = br.HitRate / (float64(idealTokens) / float64(promptAll))
	}
	// Simulated time = wall × speedup (the simulator's TimeScale is 1/speedup).
	if !first.IsZero() && last.After(first) {
		br.MakespanSeconds = last.Sub(first).Seconds() * speedup
		br.RequestsPerSecond = float64(br.Completed) / br.MakespanSeconds
		br.OutputTokensPerSec = float64(run.pool.OutputTokens) / br.MakespanSeconds
		br.PromptTokensPerSec = float64(run.pool.PromptTokens) / br.MakespanSeconds
	}
	br.TTFTms = quantiles(ttft, time.Millisecond)
	br.QueueMs = quantiles(queue, time.Millisecond)
	br.E2Ems = quantiles(e2e, time.Millisecond)
	br.DecisionUs = quantiles(decision, time.Microsecond)
	br.TPOTms = quantiles(tpot, time.Millisecond)
	br.ITLms = histogramQuantiles(&run.pool.ITL)
	if len(ttftS) > 0 && len(ttftN) > 0 {
		qs, qn := quantiles(ttftS, time.Millisecond), quantiles(ttftN, time.Millisecond)
		br.TTFTStreamedMs, br.TTFTNonStreamedMs = &qs, &qn
	}
	br.Preemptions = run.pool.Preemptions
	br.EngineLagSeconds = run.pool.EngineLag.Seconds()
	br.DispatchLagMs = quantiles(lag, time.Millisecond)
	most := 0
	for _, name := range run.workers {
		ws := perWorker[name]
		if ws.PromptTokens > 0 {
			ws.HitRate = float64(workerCached[name]) / float64(ws.PromptTokens)
		}
		br.Workers = append(br.Workers, *ws)
		most = max(most, ws.Requests)
	}
	if br.Completed > 0 && len(run.workers) > 0 {
		br.MaxOverMeanRequests = float64(most) / (float64(br.Completed) / float64(len(run.workers)))
	}
	br.Timeline = timeline(run, w, ideal, buckets)
	return br
}

// timeline buckets the completed requests by arrival time and returns each bucket's hit rate
// (cached / prompt tokens) beside the ideal one.
func timeline(run *baselineRun, w *Workload, ideal []int64, buckets int) []TimelinePoint {
	if buckets < 1 || len(w.Requests) == 0 {
		return nil
	}
	span := w.Span()
	width := span / time.Duration(buckets)
	if width <= 0 {
		width = time.Second
		buckets = 1
	}
	base := w.Requests[0].Arrival
	type acc struct {
		n                     int
		prompt, cached, ideal int64
	}
	accs := make([]acc, buckets)
	for i := range run.results {
		r := &run.results[i]
		if r.failure() != "" {
			continue
		}
		b := int((w.Requests[i].Arrival - base) / width)
		b = min(max(b, 0), buckets-1)
		accs[b].n++
		accs[b].prompt += int64(r.prompt)
		accs[b].cached += int64(r.cached)
		accs[b].ideal += ideal[i]
	}
	out := make([]TimelinePoint, buckets)
	for b, a := range accs {
		out[b] = TimelinePoint{StartSeconds: (time.Duration(b) * width).Seconds(), Requests: a.n}
		if a.prompt > 0 {
			out[b].HitRate = float64(a.cached) / float64(a.prompt)
			out[b].IdealHitRate = float64(a.ideal) / float64(a.prompt)
		}
	}
	return out
}

// writeTable prints the markdown comparison table.
func writeTable(out io.Writer, res *Result) {
	fmt.Fprintf(out, "\n### eppbench: %s — %d requests over %.0f s (simulated), %d workers × %d blocks of %d tokens, speedup %g\n\n",
		res.Workload.Name, res.Workload.Requests, res.Workload.SpanSeconds, res.Setup.Workers, res.Setup.CapacityBlocks,
		res.Setup.BlockSize, res.Setup.Speedup)
	fmt.Fprintf(out, "Ideal reuse (unbounded single cache): %.1f %% of prompt tokens; one cache of the pool's total capacity: %.1f %% with LRU eviction, at most %.1f %% with optimal (offline) eviction.\n\n",
		100*res.Workload.IdealHitRate, 100*res.Workload.PooledLRUHitRate, 100*res.Workload.OptimalEvictionHitRate)
	fmt.Fprintln(out, "| router | hit rate | of ideal | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p99 | E2E p50 | out tok/s | max/mean req | decision p50 | decision p99 | kvepp CPU | errors |")
	fmt.Fprintln(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, b := range res.Baselines {
		if b.Completed == 0 {
			// Nothing completed, so there is nothing to measure: dashes, not zeros.
			fmt.Fprintf(out, "| %s | — | — | — | — | — | — | — | — | — | — | %s | %s | %.2f s | %d |\n",
				b.Name, fmtUs(b.DecisionUs.P50), fmtUs(b.DecisionUs.P99), b.KveppCPUSeconds, b.Errors)
			continue
		}
		fmt.Fprintf(out, "| %s | %.1f %% | %.0f %% | %s | %s | %s | %s | %s | %s | %.0f | %.2f | %s | %s | %.2f s | %d |\n",
			b.Name, 100*b.HitRate, 100*b.OfIdeal, fmtMs(b.TTFTms.P50), fmtMs(b.TTFTms.P90), fmtMs(b.TTFTms.P99),
			fmtMs(b.ITLms.P50), fmtMs(b.ITLms.P99), fmtMs(b.E2Ems.P50), b.OutputTokensPerSec, b.MaxOverMeanRequests,
			fmtUs(b.DecisionUs.P50), fmtUs(b.DecisionUs.P99), b.KveppCPUSeconds, b.Errors)
	}
	fmt.Fprintln(out)
	fmt.Fprintln(out, "Hit rate = prompt tokens served from the simulated workers' prefix caches / prompt tokens. TTFT, ITL")
	fmt.Fprintln(out, "(gap between consecutive output tokens, over all tokens), E2E and output tok/s are in simulated time")
	fmt.Fprintln(out, "(wall × speedup). max/mean req = the busiest worker's requests over the mean. Decision = kvepp's routing")
	fmt.Fprintln(out, "latency measured at the proxy in wall time (body end_of_stream sent → routing reply). kvepp CPU = the")
	fmt.Fprintln(out, "kvepp process's user+system CPU seconds during the replay.")
	if p := res.Setup.Profile; p != nil {
		fmt.Fprintf(out, "Engine: vLLM V1 scheduler model, profile %s (step %.3g ms + %.3g µs/token + %.3g ns/attention pair + %.3g ns/decode context token; %d tokens per step, %d sequences).\n",
			p.Name, p.StepMs, p.PerTokenUs, p.AttentionPairNs, p.ContextTokenNs, p.MaxNumBatchedTokens, p.MaxNumSeqs)
	}
	if f := res.Setup.StreamedFraction; f < 1 {
		fmt.Fprintf(out, "Responses: %.0f %% streamed; TTFT of a non-streamed response is the simulator's (its client sees only the whole answer).\n", 100*f)
	}
	for _, w := range res.Warnings {
		fmt.Fprintf(out, "\n**Warning:** %s\n", w)
	}
}

// Saturation thresholds (saturationWarning).
const (
	saturatedThroughput = 0.9 // completion rate below this fraction of the arrival rate
	saturatedQueueShare = 0.5 // median queue wait above this fraction of median TTFT
)

// saturationWarnings returns one warning per saturated router of res, and one per router whose
// requests failed (errors or immediate responses), since its hit rate and TTFT then describe only
// the requests that got through.
func saturationWarnings(res *Result) []string {
	var out []string
	for _, b := range res.Baselines {
		if b.Errors > 0 {
			cover := "so its figures cover only the rest"
			if b.Completed == 0 {
				cover = "so it has no figures"
			}
			why := ""
			if len(b.FirstErrors) > 0 {
				why = " First: " + b.FirstErrors[0] + "."
			}
			out = append(out, fmt.Sprintf("router %q: %d of %d requests failed, %s.%s The error of each is in work/requests-%s.csv.",
				b.Name, b.Errors, b.Requests, cover, why, fileSlug(b.Name)))
		}
		if w := saturationWarning(b, res.Workload); w != "" {
			out = append(out, w)
		}
		if w := machineWarning(b, res.Setup.Workers); w != "" {
			out = append(out, w)
		}
	}
	return out
}

// saturationWarning reports, or returns "", that router b's simulated workers were saturated:
// requests arrived faster than they completed (completion rate < 0.9 × arrival rate), or queue
// wait dominates TTFT (median queue > half the median TTFT). The arrival rate counts the workload's
// requests over its span plus one median service time (E2E − queue, p50), so the drain of the
// last requests after the last arrival is not mistaken for saturation.
func saturationWarning(b BaselineResult, w WorkloadInfo) string {
	if b.Completed == 0 || w.SpanSeconds <= 0 || w.Requests == 0 {
		return ""
	}
	// Failed requests never reach a worker (or end early), so only the completed ones are
	// expected to complete: comparing with every arrival would call a router that rejects
	// requests saturated.
	arrival := float64(b.Completed) / w.SpanSeconds
	service := max(0, b.E2Ems.P50-b.QueueMs.P50) / 1000
	expected := float64(b.Completed) / (w.SpanSeconds + service)
	var why []string
	if b.RequestsPerSecond < saturatedThroughput*expected {
		why = append(why, fmt.Sprintf("completes %.2f req/s while %.2f req/s arrive", b.RequestsPerSecond, arrival))
	}
	if b.TTFTms.P50 > 0 && b.QueueMs.P50 > saturatedQueueShare*b.TTFTms.P50 {
		why = append(why, fmt.Sprintf("queue wait p50 %s is %.0f %% of TTFT p50 %s", fmtMs(b.QueueMs.P50), 100*b.QueueMs.P50/b.TTFTms.P50, fmtMs(b.TTFTms.P50)))
	}
	if len(why) == 0 {
		return ""
	}
	return fmt.Sprintf("router %q saturated the simulated workers (%s, simulated time); its figures are unstable from run to run. "+
		"Use more --workers, fewer requests (--limit) or a cheaper timing model (--prefill-us-per-token); if dispatch_lag_ms "+
		"in result.json is high, the machine is the bottleneck: lower --speedup.", b.Name, strings.Join(why, "; "))
}

// machineLagShare is the share of a run's simulated time the engines may lose to a machine that
// falls behind before machineWarning speaks.
const machineLagShare = 0.05

// machineWarning reports, or returns "", that the machine running the benchmark fell behind during
// router b's replay: its simulated engines lost more than 5 % of the run to steps that started late
// (engine_lag_seconds per worker over the makespan), which slows every request and makes the
// figures describe the machine rather than the router.
func machineWarning(b BaselineResult, workers int) string {
	if workers < 1 || b.MakespanSeconds <= 0 {
		return ""
	}
	share := b.EngineLagSeconds / float64(workers) / b.MakespanSeconds
	if share <= machineLagShare {
		return ""
	}
	return fmt.Sprintf("router %q: the machine fell behind, so the simulated engines lost %.0f %% of the run to late steps "+
		"(engine_lag_seconds in result.json); its latencies describe the machine, not the router. Rerun on a quieter machine, "+
		"lower --speedup, or use --virtual.", b.Name, 100*share)
}

func fmtMs(ms float64) string {
	switch {
	case ms >= 10000:
		return fmt.Sprintf("%.1f s", ms/1000)
	case ms >= 100:
		return fmt.Sprintf("%.0f ms", ms)
	default:
		return fmt.Sprintf("%.1f ms", ms)
	}
}

func fmtUs(us float64) string {
	if us >= 1000 {
		return fmt.Sprintf("%.2f ms", us/1000)
	}
	return fmt.Sprintf("%.0f µs", us)
}

// writeJSON writes the result file.
func writeJSON(path string, res *Result) error {
	data, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(data, '\n'), 0o644)
}

// describe is a one-line summary of a baseline for logs.
func describe(b BaselineResult) string {
	if b.Completed == 0 {
		return fmt.Sprintf("%s: no request completed, errors %d", b.Name, b.Errors)
	}
	return strings.TrimSpace(fmt.Sprintf("%s: hit %.1f%% (%.0f%% of ideal), TTFT p50 %s, errors %d",
		b.Name, 100*b.HitRate, 100*b.OfIdeal, fmtMs(b.TTFTms.P50), b.Errors))
}
