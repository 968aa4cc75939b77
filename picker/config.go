package picker

import (
	crand "crypto/rand"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/picker/queue"
	"github.com/kvepp/kvepp/policies"
)

// Default values of the router settings (selection-service.md §19.2).
const (
	DefaultOverlapScoreCredit      = 1.0
	DefaultPrefillLoadScale        = 1.0
	DefaultHostCacheHitWeight      = 0.75
	DefaultDiskCacheHitWeight      = 0.25
	DefaultActiveRequestExpirySecs = 300.0
	DefaultApproxTTLSecs           = 120.0
	DefaultMaxTreeSize             = 1 << 20
	DefaultPruneTargetRatio        = 0.8
	// DefaultExpirySweepInterval is how often Run sweeps stale bookings (§10.5: every 60 s).
	DefaultExpirySweepInterval = 60 * time.Second
	// DefaultQueuePolicy is router_queue_policy (DYN_ROUTER_QUEUE_POLICY, §13.2).
	DefaultQueuePolicy = "fcfs"
	// DefaultOverlapRefreshAfterSecs is DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS (§13.3): a request
	// queued at least this long has its overlap re-queried at dequeue.
	DefaultOverlapRefreshAfterSecs = 10.0
	// DefaultQueueRecheckInterval is how often Run re-runs queue dispatch in every partition
	// without a lifecycle event (§13.3: every 60 s).
	DefaultQueueRecheckInterval = 60 * time.Second
)

// Approximate-mode cache policies, the values of RouterSettings.ApproximateCachePolicy
// (router_approximate_cache_policy, DYN_ROUTER_APPROXIMATE_CACHE_POLICY; kv-events-index.md §15.1).
const (
	// ApproxCachePolicyTTL (the default; "" means the same): approximate entries expire
	// ApproxTTLSecs after their last insertion and the index is pruned above MaxTreeSize.
	ApproxCachePolicyTTL = "ttl"
	// ApproxCachePolicyLRU: additionally each (worker, dp_rank) holds at most its worker's
	// total_kv_blocks blocks; a booking that inserts beyond that evicts the rank's
	// least-recently-inserted blocks (kvindex.ApproxLRU). Workers without total_kv_blocks are
	// bounded by the TTL and size cap only. Requires UseKVEvents false.
	ApproxCachePolicyLRU = "lru"
)

// DefaultPrefillTokenCapacity is the advisory worker_load prefill_token_capacity reported for a
// worker without max_num_batched_tokens (selection-service.md §7.6: 10,000,000 tokens).
const DefaultPrefillTokenCapacity = 10_000_000

// MaxDataParallelSize bounds data_parallel_size (ranks per worker). Larger values leave the worker
// incomplete. Upstream has no limit; unspecified: choose 4096 so candidate expansion stays bounded.
const MaxDataParallelSize = 4096

// RouterSettings are the router configuration values the core reads (selection-service.md §19.2,
// DYN_ROUTER_*). Start from DefaultRouterSettings: the zero value turns every boolean off.
type RouterSettings struct {
	// OverlapScoreCredit is the device-overlap credit of the built-in cost (blocks per block), ≥ 0.
	OverlapScoreCredit float64
	// OverlapScoreCreditDecay dampens the credit of prefill-loaded candidates (§9.2); 0 disables.
	OverlapScoreCreditDecay float64
	// PrefillLoadScale multiplies the prefill term of the built-in cost, ≥ 0.
	PrefillLoadScale float64
	// DecodeActiveRequestWeight is the cost per active request (blocks per request), ≥ 0.
	DecodeActiveRequestWeight float64
	// HostCacheHitWeight and DiskCacheHitWeight weight lower-tier hits, each in [0, 1].
	HostCacheHitWeight float64
	// DiskCacheHitWeight weights disk and external extension hits, in [0, 1].
	DiskCacheHitWeight float64
	// RouterTemperature is the softmax temperature of the built-in picker (§9.4), ≥ 0.
	RouterTemperature float64
	// TrackActiveBlocks makes bookings hold their sequence hashes as active blocks (§10.3).
	TrackActiveBlocks bool
	// TrackOutputBlocks makes OutputTokens grow bookings with the output blocks of their
	// responses (the EPP reports streamed responses' generated tokens); output_block works
	// regardless (§10.3).
	TrackOutputBlocks bool
	// AssumeKVReuse makes token-form tracking hashes the sequence-hash chain; false makes them
	// fresh random values per block (§6.1).
	AssumeKVReuse bool
	// TrackPrefillTokens books effective_prefill_tokens as prefill load (§9.2, §10.3).
	TrackPrefillTokens bool
	// UseKVEvents selects the event-driven index (workers need kv_events endpoints and
	// Config.EventSource attaches listeners); false selects the approximate index fed by bookings.
	UseKVEvents bool
	// ActiveRequestExpirySecs is the booking expiry guard in seconds since admission (§10.5), > 0.
	ActiveRequestExpirySecs float64
	// ApproxTTLSecs, MaxTreeSize and PruneTargetRatio configure the approximate index
	// (kv-events-index.md §15.1): seconds, (node, candidate) entries, fraction in (0, 1).
	ApproxTTLSecs float64
	// MaxTreeSize is the approximate prune trigger in entries.
	MaxTreeSize int
	// PruneTargetRatio is the prune target fraction in (0, 1).
	PruneTargetRatio float64
	// ApproximateCachePolicy is router_approximate_cache_policy (kv-events-index.md §15.1):
	// ApproxCachePolicyTTL ("ttl", also "") or ApproxCachePolicyLRU ("lru", per-rank capacity =
	// the worker's total_kv_blocks, TTL and size cap remaining as fallbacks). "lru" with
	// UseKVEvents is a configuration error; any other value is too.
	ApproximateCachePolicy string
	// QueueThreshold is router_queue_threshold; non-nil enables queueing (§13.1), ≥ 0. It is
	// the prefill_busy_threshold_frac of the synthetic "default" policy class (§13.4): a rank is
	// busy when its active prefill tokens exceed QueueThreshold × max_num_batched_tokens.
	QueueThreshold *float64
	// QueuePolicy is router_queue_policy (§13.2): "fcfs" (also ""), "lcfs" or "wspt"; the policy
	// of the synthetic class and of configured classes without queue_policy.
	QueuePolicy string
	// OverlapRefreshAfterSecs is DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS (§13.3): a request that
	// waited in the queue at least this many seconds gets its overlap re-queried at dequeue;
	// shorter waits reuse the enqueue-time overlap. 0 disables the refresh. Finite ≥ 0.
	OverlapRefreshAfterSecs float64
	// ConditionalDisaggPrefillBusyThreshold enables advisory prefill_busy (§7.6), ≥ 0.
	ConditionalDisaggPrefillBusyThreshold *float64
	// ConditionalDisaggDecodeBusyThreshold enables decode_busy (§7.4), ≥ 0.
	ConditionalDisaggDecodeBusyThreshold *float64
}

// DefaultRouterSettings returns the §19.2 defaults: credit 1, scale 1, host weight 0.75, disk
// weight 0.25, temperature 0, active blocks, KV reuse, prefill tracking and KV events on, expiry
// 300 s, approximate TTL 120 s with the ttl cache policy, no queueing (queue policy fcfs, overlap refresh after 10 s), no
// busy thresholds.
func DefaultRouterSettings() RouterSettings {
	return RouterSettings{
		OverlapScoreCredit:      DefaultOverlapScoreCredit,
		PrefillLoadScale:        DefaultPrefillLoadScale,
		HostCacheHitWeight:      DefaultHostCacheHitWeight,
		DiskCacheHitWeight:      DefaultDiskCacheHitWeight,
		TrackActiveBlocks:       true,
		AssumeKVReuse:           true,
		TrackPrefillTokens:      true,
		UseKVEvents:             true,
		ActiveRequestExpirySecs: DefaultActiveRequestExpirySecs,
		ApproxTTLSecs:           DefaultApproxTTLSecs,
		MaxTreeSize:             DefaultMaxTreeSize,
		PruneTargetRatio:        DefaultPruneTargetRatio,
		ApproximateCachePolicy:  ApproxCachePolicyTTL,
		QueuePolicy:             DefaultQueuePolicy,
		OverlapRefreshAfterSecs: DefaultOverlapRefreshAfterSecs,
	}
}

// PolicyConfig returns the settings as the policies package's RouterConfig, the value a policy
// factory receives (selection-service.md §17.4).
func (r RouterSettings) PolicyConfig() policies.RouterConfig {
	return policies.RouterConfig{
		OverlapScoreCredit:        r.OverlapScoreCredit,
		PrefillLoadScale:          r.PrefillLoadScale,
		RouterTemperature:         r.RouterTemperature,
		OverlapScoreCreditDecay:   r.OverlapScoreCreditDecay,
		DecodeActiveRequestWeight: r.DecodeActiveRequestWeight,
		HostCacheHitWeight:        r.HostCacheHitWeight,
		DiskCacheHitWeight:        r.DiskCacheHitWeight,
	}
}

// validate checks every setting against §19.2 and returns the first violation, naming it.
func (r RouterSettings) validate() error {
	nonNeg := []struct {
		name string
		v    float64
	}{
		{"overlap_score_credit", r.OverlapScoreCredit},
		{"overlap_score_credit_decay", r.OverlapScoreCreditDecay},
		{"prefill_load_scale", r.PrefillLoadScale},
		{"decode_active_request_weight", r.DecodeActiveRequestWeight},
		{"router_temperature", r.RouterTemperature},
	}
	for _, f := range nonNeg {
		if !finiteNonNeg(f.v) {
			return fmt.Errorf("%s must be a finite number >= 0, got %v", f.name, f.v)
		}
	}
	for _, f := range []struct {
		name string
		v    float64
	}{{"host_cache_hit_weight", r.HostCacheHitWeight}, {"disk_cache_hit_weight", r.DiskCacheHitWeight}} {
		if !(f.v >= 0 && f.v <= 1) {
			return fmt.Errorf("%s must be between 0 and 1, got %v", f.name, f.v)
		}
	}
	if !(r.ActiveRequestExpirySecs > 0) || math.IsInf(r.ActiveRequestExpirySecs, 0) {
		return fmt.Errorf("active_request_expiry_secs must be a finite number > 0, got %v", r.ActiveRequestExpirySecs)
	}
	if !r.UseKVEvents {
		if !(r.ApproxTTLSecs > 0) || math.IsInf(r.ApproxTTLSecs, 0) {
			return fmt.Errorf("router_ttl_secs must be a finite number > 0, got %v", r.ApproxTTLSecs)
		}
		if r.MaxTreeSize <= 0 {
			return fmt.Errorf("max_tree_size must be > 0, got %d", r.MaxTreeSize)
		}
		if !(r.PruneTargetRatio > 0 && r.PruneTargetRatio < 1) {
			return fmt.Errorf("prune_target_ratio must be in (0, 1), got %v", r.PruneTargetRatio)
		}
	}
	switch r.ApproximateCachePolicy {
	case "", ApproxCachePolicyTTL:
	case ApproxCachePolicyLRU:
		if r.UseKVEvents {
			return fmt.Errorf("router_approximate_cache_policy lru requires use_kv_events=false")
		}
	default:
		return fmt.Errorf("router_approximate_cache_policy must be ttl or lru, got %q", r.ApproximateCachePolicy)
	}
	if _, err := queue.ParsePolicy(r.QueuePolicy); err != nil {
		return fmt.Errorf("router_queue_policy: %w", err)
	}
	if !finiteNonNeg(r.OverlapRefreshAfterSecs) || r.OverlapRefreshAfterSecs*float64(time.Second) > math.MaxInt64 {
		return fmt.Errorf("overlap_refresh_after_secs must be a finite number >= 0, got %v", r.OverlapRefreshAfterSecs)
	}
	for _, f := range []struct {
		name string
		v    *float64
	}{
		{"router_queue_threshold", r.QueueThreshold},
		{"conditional_disagg_prefill_busy_threshold", r.ConditionalDisaggPrefillBusyThreshold},
		{"conditional_disagg_decode_busy_threshold", r.ConditionalDisaggDecodeBusyThreshold},
	} {
		if f.v != nil && !finiteNonNeg(*f.v) {
			return fmt.Errorf("%s must be a finite number >= 0, got %v", f.name, *f.v)
		}
	}
	return nil
}

func finiteNonNeg(v float64) bool { return v >= 0 && !math.IsInf(v, 1) }

// WorkerEventSpec is what a KVEventSource needs to subscribe to one worker's KV events
// (kv-events-index.md §5, §13): one ZMQ PUB endpoint per global rank in
// [DPStartRank, DPStartRank+DPSize), an optional replay endpoint (DPSize 1 only), and the hashing
// parameters (tokens per block, eagle) of the worker's partition.
type WorkerEventSpec struct {
	// WorkerID is the worker.
	WorkerID uint64
	// Partition is its partition.
	Partition PartitionKey
	// BlockSize is the hashing block size in tokens.
	BlockSize int
	// IsEagle selects eagle hashing.
	IsEagle bool
	// DPStartRank is the first global rank.
	DPStartRank uint32
	// DPSize is the number of ranks.
	DPSize uint32
	// Endpoints maps each rank to its ZMQ PUB endpoint.
	Endpoints map[uint32]string
	// ReplayEndpoint is the optional ZMQ ROUTER for gap replay.
	ReplayEndpoint string
}

// KVEventSource is the KV-event ingestion the core drives when KV events are enabled
// (selection-service.md §4.1, §4.2). The runner adapts kvindex/kvevents.Manager to it.
type KVEventSource interface {
	// AttachWorker starts one listener per rank of spec applying events to idx, or reconciles an
	// attached worker rank by rank: a rank whose endpoint, replay endpoint, hashing parameters and
	// index are unchanged keeps its listener, watermark and index rows; a changed rank's old
	// listener is stopped and its rows cleared (a Cleared event on idx) before its new listener
	// starts; ranks that left the range are stopped and cleared. On error nothing of this attempt
	// stays running and the error names the offending rank or endpoint (the worker's reason
	// becomes "reconciliation failed: <error>"). kvindex/kvevents.Manager.Attach does all this.
	AttachWorker(spec WorkerEventSpec, idx *kvindex.Index) error
	// DetachWorker stops every listener of the worker; it does not touch the index.
	DetachWorker(workerID uint64)
}

// Config configures a Service. Start from DefaultConfig.
type Config struct {
	// Router holds the router settings (§19.2).
	Router RouterSettings
	// QueueingEnabled forces queueing on (§13.1) even without Router.QueueThreshold or
	// PolicyProfiles; a non-nil Router.QueueThreshold or configured PolicyProfiles enable it as
	// well. While enabled, workers need max_num_batched_tokens to be schedulable. A partition
	// whose classes have no busy threshold never queues.
	QueueingEnabled bool
	// PolicyProfiles are the policy-class profiles of the policy file (§13.4, §18.2; build them
	// with catalog.(*Config).QueueProfiles). Configured profiles enable queueing. A partition uses
	// its model's profile, else the root profile, else the synthetic class "default" built from
	// Router.QueueThreshold and Router.QueuePolicy.
	PolicyProfiles *queue.Profiles
	// QueueRecheckInterval is how often Run re-runs queue dispatch without a lifecycle event
	// (0 = DefaultQueueRecheckInterval, 60 s; §13.3).
	QueueRecheckInterval time.Duration
	// Policy builds one policy per partition with worker type "select" (§17.4). Nil selects the
	// built-in dynamo-default-cost-fn policy (§9), which honours per-request overrides.
	Policy policies.PolicyFactory
	// EventSource attaches KV-event listeners; required when Router.UseKVEvents, ignored otherwise.
	EventSource KVEventSource
	// Now is the clock (admission times, expiry, approximate TTL); nil = time.Now.
	Now func() time.Time
	// RandSource returns a new random source for each partition's picker and for load-only picks;
	// nil = ChaCha8 seeded from crypto/rand. Tests pass a seeded source for reproducibility.
	RandSource func() rand.Source
	// Logger receives catalog and booking diagnostics.
	Logger zerolog.Logger

	// SelectionCache bounds the pending-selection cache that replays a /select into a booking
	// (selection-service.md §11). Zero fields take the defaults: TTL 120 s, 4096 entries,
	// 268,435,456 bytes; negative values are a configuration error.
	SelectionCache ledger.PendingConfig
	// SessionAffinityTTL enables session affinity (§12.1) when non-zero: the idle lifetime of a
	// binding after its last lease is released, 1 s … 31,536,000 s (else New fails).
	SessionAffinityTTL time.Duration
	// SessionAffinityMaxEntries caps each partition's affinity table (0 = 65,536); when full, new
	// sessions route unpinned.
	SessionAffinityMaxEntries int
	// ReplicaWriterID identifies this process in session-binding versions (§12.1); 0 = a random
	// non-zero id.
	ReplicaWriterID uint64
	// AffinityPublisher, when non-nil, receives every local binding commit and lease release
	// (§12.1 replication; the replica-sync transport plugs in here). Expiry publishes nothing.
	AffinityPublisher AffinityPublisher
	// SlotPublisher, when non-nil, receives every admission, prefill completion and free made
	// through this Service (§15.2, §15.4 replication; the replica-sync transport plugs in here).
	// Output blocks, expiry and worker removal publish nothing.
	SlotPublisher SlotPublisher
	// EstimatePrefillCompletion releases the prefill part of a PrefillUnobserved booking (a
	// response that is not streamed) when its worker rank has most likely finished it: at
	// admission + (prefill queued ahead + its own, its own stretched by PrefillAttentionTokens) /
	// the rank's measured prefill rate, the rate
	// learned from observed completions (streamed first chunks, prefill_complete calls). Without
	// any measured rate in the partition it uses AssumedPrefillTokensPerSecond.
	// DefaultConfig turns it on; the EPP's DYN_EPP_ESTIMATE_PREFILL_COMPLETION turns it off.
	EstimatePrefillCompletion bool
	// AssumedPrefillTokensPerSecond is the prefill rate (tokens/s, finite ≥ 0) the estimate of
	// EstimatePrefillCompletion uses while neither the worker rank nor its partition has a
	// measured one — always, when no response is streamed. 0 keeps such a booking's prefill until
	// its response ends; but then, on traffic that is never streamed, every running request counts
	// as queued prefill for its whole answer, and the policies see long prefill queues on the
	// workers that decode the most and move conversations off the workers that cache them.
	// DefaultConfig sets DefaultAssumedPrefillTokensPerSecond (the EPP's
	// DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND).
	AssumedPrefillTokensPerSecond float64
	// PrefillAttentionTokens is the context length, tokens (finite ≥ 0), at which the estimate of
	// EstimatePrefillCompletion takes a prompt token to cost twice what the first token costs:
	// attention reads every token before it, so a token at context c costs 1 + c/this, and a long
	// uncached prompt prefills much slower than the rate measured over typical ones. 0 estimates
	// linearly. DefaultConfig sets DefaultPrefillAttentionTokens (the EPP's
	// DYN_EPP_PREFILL_ATTENTION_TOKENS).
	PrefillAttentionTokens float64
}

// DefaultPrefillAttentionTokens is the default Config.PrefillAttentionTokens, tokens. A dense
// transformer spends 4 × layers × hidden FLOPs per (token, earlier token) pair beside 2 × params
// per token, so attention matches the rest at 2 × params / (4 × layers × hidden) tokens: 29k for
// Llama-3.1-8B, 53k for Llama-3.1-70B; at the measured kernel efficiencies of enginesim's
// A100 profile 25k at the engine's peak rate. 48,000 had the lowest TTFT p50 and p90 among 24k,
// 32k, 48k and 64k on eppbench's virtual Mooncake replays (cmd/eppbench/README.md).
const DefaultPrefillAttentionTokens = 48000

// DefaultAssumedPrefillTokensPerSecond is the default Config.AssumedPrefillTokensPerSecond,
// tokens/s: the rate predicted-ttft assumes for a worker it has not measured
// (predictedttft.DefaultPrefillTokensPerSecond), about what one 8B model prefills on one
// A100/H100-class GPU.
const DefaultAssumedPrefillTokensPerSecond = 10000

// AffinityPublisher receives the session bindings a replica must share (selection-service.md
// §12.1, §15.3): each commit and each lease release of partition key. Called outside the
// partition's serialized context or not: implementations must not block.
type AffinityPublisher interface {
	// PublishAffinity hands one binding of partition key to the replica transport.
	PublishAffinity(key PartitionKey, u ledger.AffinityUpdate)
}

// DefaultConfig returns a Config with DefaultRouterSettings, the built-in policy, the real clock and
// a disabled logger. KV events are on, so the caller must set EventSource or turn UseKVEvents off.
func DefaultConfig() Config {
	return Config{Router: DefaultRouterSettings(), Logger: zerolog.Nop(), EstimatePrefillCompletion: true,
		AssumedPrefillTokensPerSecond: DefaultAssumedPrefillTokensPerSecond, PrefillAttentionTokens: DefaultPrefillAttentionTokens}
}

// validate checks the service-level settings beyond the router settings.
func (c *Config) validate() error {
	if err := c.Router.validate(); err != nil {
		return err
	}
	if err := c.SelectionCache.Validate(); err != nil {
		return err
	}
	if t := c.SessionAffinityTTL; t != 0 && (t < time.Second || t > ledger.MaxAffinityTTL) {
		return fmt.Errorf("session_affinity_ttl_secs must be between 1 and 31536000, got %v", t.Seconds())
	}
	if c.SessionAffinityMaxEntries < 0 {
		return fmt.Errorf("session affinity max entries must be >= 0, got %d", c.SessionAffinityMaxEntries)
	}
	if c.QueueRecheckInterval < 0 {
		return fmt.Errorf("queue recheck interval must be >= 0, got %v", c.QueueRecheckInterval)
	}
	if r := c.AssumedPrefillTokensPerSecond; math.IsNaN(r) || math.IsInf(r, 0) || r < 0 {
		return fmt.Errorf("assumed prefill rate must be a finite number of tokens/s >= 0, got %v", r)
	}
	if a := c.PrefillAttentionTokens; math.IsNaN(a) || math.IsInf(a, 0) || a < 0 {
		return fmt.Errorf("prefill attention tokens must be a finite number of tokens >= 0, got %v", a)
	}
	return nil
}

// queueing reports whether queueing is enabled (§13.1).
func (c *Config) queueing() bool {
	return c.QueueingEnabled || c.Router.QueueThreshold != nil || c.PolicyProfiles.Configured()
}

// queuePolicy is Router.QueuePolicy parsed (validated by New).
func (c *Config) queuePolicy() queue.Policy {
	p, _ := queue.ParsePolicy(c.Router.QueuePolicy)
	return p
}

func defaultRandSource() rand.Source {
	var seed [32]byte
	if _, err := crand.Read(seed[:]); err != nil {
		// crypto/rand never fails on supported platforms; fall back to the clock.
		binary.LittleEndian.PutUint64(seed[:], uint64(time.Now().UnixNano()))
	}
	return rand.NewChaCha8(seed)
}
