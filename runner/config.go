package runner

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/url"
	"os"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/caarlos0/env/v11"
	"github.com/rs/zerolog"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/kvepp/kvepp/extproc/tokenizer"
	"github.com/kvepp/kvepp/picker"
)

// Tokenizer protocols accepted by DYN_EPP_TOKENIZER_PROTOCOL (epp.md §5.4).
const (
	TokenizerProtocolLocal      = "local"
	TokenizerProtocolVLLMRender = "vllm-render"
	TokenizerProtocolNone       = "none"
)

// Config is the complete, validated configuration of one kvepp process: every field has the DYN_*
// environment name of epp.md §2 / selection-service.md §19.2 in its `env` tag, a default in
// `envDefault`, and (where useful) a command-line flag in its `flag` tag. Flags win over the
// environment. Build one with LoadConfig (environment + flags) or DefaultConfig (defaults only, for
// tests) and check it with Validate; Start validates again.
type Config struct {
	// --- ports and listeners (epp.md §1) ---

	// BindAddress is the host every listener binds ("" = all interfaces; tests use "127.0.0.1").
	BindAddress string `env:"DYN_EPP_BIND_ADDRESS" flag:"bind-address" help:"host every listener binds (empty = all interfaces)"`
	// GRPCPort is the ext_proc gRPC port (0 = an ephemeral port, reported by Instance.Addrs).
	GRPCPort int `env:"DYN_EPP_GRPC_PORT" envDefault:"9002" flag:"grpc-port" help:"ext_proc gRPC port"`
	// GRPCHealthPort is the plaintext grpc.health.v1 port (epp.md §9).
	GRPCHealthPort int `env:"DYN_EPP_GRPC_HEALTH_PORT" envDefault:"9003" flag:"grpc-health-port" help:"plaintext gRPC health port"`
	// SelectionHTTPPort is the selection HTTP side port (epp.md §11.3).
	SelectionHTTPPort int `env:"DYN_EPP_SELECTION_HTTP_PORT" envDefault:"8092" flag:"selection-http-port" help:"selection HTTP API side port"`
	// MetricsPort serves GET /metrics (epp.md §12).
	MetricsPort int `env:"DYN_EPP_METRICS_PORT" envDefault:"9090" flag:"metrics-port" help:"Prometheus metrics port"`

	// --- mode and discovery (epp.md §2, §10) ---

	// Mode is DYN_EPP_MODE; only "standalone" is implemented.
	Mode string `env:"DYN_EPP_MODE" envDefault:"standalone" flag:"mode" help:"EPP mode (only standalone)"`
	// WorkersFile is the watched YAML/JSON workers file (picker/discovery).
	WorkersFile string `env:"DYN_EPP_WORKERS_FILE" flag:"workers-file" help:"YAML or JSON list of worker records, watched for changes"`
	// InferencePoolName selects Kubernetes discovery: the InferencePool (in POD_NAMESPACE) whose
	// pods are the workers (epp.md §10, picker/discovery).
	InferencePoolName string `env:"DYN_EPP_INFERENCE_POOL_NAME" flag:"inference-pool-name" help:"InferencePool to serve (Kubernetes discovery of its pods)"`
	// KubeDiscoveryMode is DYN_KUBE_DISCOVERY_MODE; only "pod".
	KubeDiscoveryMode string `env:"DYN_KUBE_DISCOVERY_MODE" envDefault:"pod" help:"Kubernetes discovery mode (only pod)"`

	// --- Kubernetes InferencePool discovery (epp.md §2, §10) ---

	// PodNamespace is POD_NAMESPACE: the EPP's own namespace (downward API), where the
	// InferencePool, its pods and the peer Service live; required with an InferencePool or a peer
	// service.
	PodNamespace string `env:"POD_NAMESPACE" flag:"pod-namespace" help:"namespace of the InferencePool, its pods and the peer Service"`
	// KVEventPort is DYN_EPP_KV_EVENT_PORT: rank r of a discovered pod publishes KV events on
	// port + r (vLLM --kv-events-config endpoint); pod annotation kvepp.io/kv-event-port overrides it.
	KVEventPort int `env:"DYN_EPP_KV_EVENT_PORT" envDefault:"5557" flag:"kv-event-port" help:"KV event port of rank 0 of discovered pods (rank r: port + r)"`
	// KVEventReplayPort is DYN_EPP_KV_EVENT_REPLAY_PORT: the KV event replay port of single-rank
	// discovered pods (0 or unset = no replay).
	KVEventReplayPort int `env:"DYN_EPP_KV_EVENT_REPLAY_PORT" flag:"kv-event-replay-port" help:"KV event replay port of single-rank discovered pods (unset = no replay)"`
	// ConformanceTestHooks enables the Gateway API Inference Extension conformance-suite hooks
	// (extproc.Config.ConformanceTestHooks): the test-epp-endpoint-selection request header
	// restricts candidates and responses carry x-conformance-test-served-endpoint. For
	// conformance runs only: any client could steer its requests with the header.
	ConformanceTestHooks Bool `env:"DYN_EPP_CONFORMANCE_TEST_HOOKS" envDefault:"false" flag:"conformance-test-hooks" help:"conformance-suite hooks: test-epp-endpoint-selection and x-conformance-test-served-endpoint (test clusters only)"`
	// ModelName is DYN_MODEL_NAME: the partition model of discovered workers and of workers-file
	// records that omit model_name, and the partition requests without a served model fall back to.
	ModelName string `env:"DYN_MODEL_NAME" flag:"model-name" help:"served model name (partition of discovered workers)"`
	// BlockSize is DYN_KV_CACHE_BLOCK_SIZE in tokens: the block size of discovered workers and of
	// worker records that omit one. Must be > 0; 1 is accepted with a warning (epp.md §13.8).
	BlockSize int `env:"DYN_KV_CACHE_BLOCK_SIZE" envDefault:"16" flag:"block-size" help:"KV cache block size in tokens for records that omit block_size"`
	// MaxNumBatchedTokens (tokens) is given to workers-file records without max_num_batched_tokens
	// (DYN_EPP_MAX_NUM_BATCHED_TOKENS); required by queueing.
	MaxNumBatchedTokens OptFloat `env:"DYN_EPP_MAX_NUM_BATCHED_TOKENS" help:"max_num_batched_tokens of records that omit it"`
	// TotalKVBlocks (blocks) is given to workers-file records without total_kv_blocks
	// (DYN_EPP_TOTAL_KV_BLOCKS).
	TotalKVBlocks OptFloat `env:"DYN_EPP_TOTAL_KV_BLOCKS" help:"total_kv_blocks of records that omit it"`
	// IndexerPeers is DYN_EPP_INDEXER_PEERS (comma list of base URLs for startup /dump recovery).
	IndexerPeers []string `env:"DYN_EPP_INDEXER_PEERS" flag:"indexer-peers" help:"comma list of peer selection base URLs for /dump recovery"`
	// RecoveryTimeout bounds startup recovery (DYN_EPP_RECOVERY_TIMEOUT_SECS, seconds).
	RecoveryTimeout Seconds `env:"DYN_EPP_RECOVERY_TIMEOUT_SECS" envDefault:"30" flag:"recovery-timeout-secs" help:"bound on startup /dump recovery, seconds"`
	// RecoveryMaxBytes bounds one peer's /dump body read by startup recovery
	// (DYN_EPP_RECOVERY_MAX_BYTES, bytes, > 0); a larger dump is refused and the next peer tried.
	RecoveryMaxBytes int64 `env:"DYN_EPP_RECOVERY_MAX_BYTES" envDefault:"1073741824" help:"largest peer /dump recovery reads, bytes"`
	// RecoveryMaxEvents bounds the events startup recovery accepts from one peer's /dump
	// (DYN_EPP_RECOVERY_MAX_EVENTS, > 0); a dump with more is refused and the next peer tried.
	RecoveryMaxEvents int `env:"DYN_EPP_RECOVERY_MAX_EVENTS" envDefault:"4194304" help:"most events recovery accepts from one peer /dump"`

	// --- replica sync and peer EPPs (epp.md §10.4, §11.2; selection-service.md §15) ---

	// ReplicaSyncPort is DYN_EPP_REPLICA_SYNC_PORT: the replica-sync PUB port (default 9092; 0 =
	// an ephemeral port). Setting it turns replica sync on.
	ReplicaSyncPort OptPort `env:"DYN_EPP_REPLICA_SYNC_PORT" flag:"replica-sync-port" help:"replica-sync ZeroMQ PUB port (default 9092; setting it enables replica sync)"`
	// ReplicaSyncPeers is DYN_EPP_REPLICA_SYNC_PEERS: static peer PUB endpoints (tcp://host:port,
	// ipc://…, inproc://…); turns replica sync on.
	ReplicaSyncPeers []string `env:"DYN_EPP_REPLICA_SYNC_PEERS" flag:"replica-sync-peers" help:"comma list of peer replica-sync endpoints (tcp://host:port); enables replica sync"`
	// PeerService is DYN_EPP_PEER_SERVICE: the Service whose EndpointSlices list the peer EPPs;
	// turns replica sync on and makes their selection ports the recovery peers.
	PeerService string `env:"DYN_EPP_PEER_SERVICE" flag:"peer-service" help:"Service whose EndpointSlices list peer EPPs (enables replica sync)"`
	// PodIP is POD_IP: this replica's address, excluded from the peers; required with a peer service.
	PodIP string `env:"POD_IP" help:"this pod's IP, excluded from the peer EPPs"`

	// --- tokenization (epp.md §5.4) ---

	// TokenizerProtocol is local, vllm-render or none; empty = derived (local when a tokenizer dir
	// is set, vllm-render when a service URL is set, else none).
	TokenizerProtocol string `env:"DYN_EPP_TOKENIZER_PROTOCOL" flag:"tokenizer-protocol" help:"local | vllm-render | none (default derived)"`
	// TokenizerDir is the default local tokenizer directory (tokenizer.json + tokenizer_config.json),
	// or a Hugging Face cache (HF_HOME, its hub/ folder, a models--org--name folder) in which
	// DYN_MODEL_NAME is resolved, or a model id resolved in $HF_HUB_CACHE / $HF_HOME/hub
	// (tokenizer.ResolveDir; nothing is downloaded).
	TokenizerDir string `env:"DYN_EPP_TOKENIZER_DIR" flag:"tokenizer-dir" help:"directory with tokenizer.json and tokenizer_config.json, a Hugging Face cache, or a model id in it"`
	// Tokenizers maps model name → tokenizer directory ("model=dir,model2=dir2").
	Tokenizers ModelDirs `env:"DYN_EPP_TOKENIZERS" flag:"tokenizers" help:"per-model tokenizer directories: model=dir,…"`
	// TokenizerServiceURL is the vLLM render API base URL (vllm-render mode).
	TokenizerServiceURL string `env:"DYN_EPP_TOKENIZER_SERVICE_URL" flag:"tokenizer-service-url" help:"vLLM render API base URL"`
	// TokenizationTimeout bounds one tokenizer call (DYN_EPP_TOKENIZATION_TIMEOUT_MS, milliseconds),
	// and a local tokenization's wait for room in TokenizeMaxInflightBytes.
	TokenizationTimeout Millis `env:"DYN_EPP_TOKENIZATION_TIMEOUT_MS" envDefault:"5000" help:"per tokenizer call, milliseconds"`
	// TokenizerServiceURLs maps model name → render base URL ("model=url,…") when several models
	// are served by different render servers (vllm-render mode); other models use
	// TokenizerServiceURL.
	TokenizerServiceURLs ModelDirs `env:"DYN_EPP_TOKENIZER_SERVICE_URLS" flag:"tokenizer-service-urls" help:"per-model vLLM render base URLs: model=url,…"`
	// TokenizerMaxResponseBytes bounds a render response (DYN_EPP_TOKENIZER_MAX_RESPONSE_BYTES,
	// bytes); larger → 502.
	TokenizerMaxResponseBytes int64 `env:"DYN_EPP_TOKENIZER_MAX_RESPONSE_BYTES" envDefault:"16777216" help:"largest accepted render response, bytes"`
	// ImageTokens is the number of tokens each image of a chat request is booked as (local mode;
	// the blocks from the first image on are uncached, epp.md §5.4 as extended by kvepp).
	ImageTokens int `env:"DYN_EPP_IMAGE_TOKENS" envDefault:"256" help:"tokens booked per image part in local mode"`
	// ConversationCacheBytes bounds the local tokenizers' conversation cache, which reuses the
	// tokens of a conversation's earlier turns (tokenizer.ConversationCache), in bytes; 0 disables
	// it (DYN_EPP_CONVERSATION_CACHE_BYTES).
	ConversationCacheBytes int64 `env:"DYN_EPP_CONVERSATION_CACHE_BYTES" envDefault:"134217728" help:"memory bound of the local tokenizers' conversation cache, bytes (0 = off)"`
	// TokenizeMaxInflightBytes bounds the request-body bytes the local tokenizers work on at once
	// (DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES, bytes, >= 0; 0 = unbounded): a request waits for room
	// up to DYN_EPP_TOKENIZATION_TIMEOUT_MS (then 504); a body larger than it runs alone.
	TokenizeMaxInflightBytes int64 `env:"DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES" envDefault:"67108864" help:"request-body bytes tokenized at once by the local tokenizers (0 = unbounded)"`

	// --- ext_proc limits and serving (epp.md §2, §5, §9) ---

	// MaxRequestBodyBytes caps an accumulated request body; larger → 413.
	MaxRequestBodyBytes int64 `env:"DYN_EPP_MAX_REQUEST_BODY_BYTES" envDefault:"67108864" flag:"max-request-body-bytes" help:"request body cap in bytes (larger → 413)"`
	// MaxInflightRequests caps requests in the routing phase; more → 429.
	MaxInflightRequests int `env:"DYN_EPP_MAX_INFLIGHT_REQUESTS" envDefault:"1024" flag:"max-inflight-requests" help:"concurrent requests in the routing phase"`
	// MaxDestinations is the destination list length (1 = primary only).
	MaxDestinations int `env:"DYN_EPP_MAX_DESTINATIONS" envDefault:"1" flag:"max-destinations" help:"destinations per routing reply (primary + fallbacks)"`
	// RequestBodyTimeout bounds the wait from a request's headers to the end of its body
	// (DYN_EPP_REQUEST_BODY_TIMEOUT_SECS, seconds, > 0); a body that has not ended by then → 408.
	RequestBodyTimeout Seconds `env:"DYN_EPP_REQUEST_BODY_TIMEOUT_SECS" envDefault:"60" flag:"request-body-timeout-secs" help:"bound on a request body's arrival, seconds (then 408)"`
	// DrainTimeout is the graceful drain window after SIGTERM (DYN_EPP_DRAIN_TIMEOUT_SECS, seconds).
	DrainTimeout Seconds `env:"DYN_EPP_DRAIN_TIMEOUT_SECS" envDefault:"15" flag:"drain-timeout-secs" help:"graceful drain window after SIGTERM, seconds"`
	// SecureServing enables TLS on the ext_proc port (alias DYN_SECURE_SERVING).
	SecureServing Bool `env:"DYN_EPP_SECURE_SERVING" envDefault:"true" flag:"secure-serving" help:"TLS on the ext_proc port (false = plaintext h2c)"`
	// CertPath is a directory with tls.crt/tls.key (reloaded on change); empty = self-signed.
	CertPath string `env:"DYN_EPP_CERT_PATH" flag:"cert-path" help:"directory with tls.crt and tls.key"`

	// --- prefill release for responses that are not streamed (kvepp extension) ---

	// EstimatePrefillCompletion releases the prefill part of a booking whose response is not
	// streamed when its worker has most likely finished the prefill, estimated from the prefill
	// work queued ahead of it, its own, and the worker's prefill rate learned from streamed
	// responses; false holds it until the response ends (epp.md §7).
	EstimatePrefillCompletion Bool `env:"DYN_EPP_ESTIMATE_PREFILL_COMPLETION" envDefault:"true" help:"release the prefill of a non-streamed response on an estimate from measured prefill rates (false = at response end)"`
	// AssumedPrefillTokensPerSecond is the prefill rate (tokens/s, finite ≥ 0) that estimate
	// uses while no rate is measured, as when no response is streamed at all; 0 holds the
	// prefill until the response ends then.
	AssumedPrefillTokensPerSecond float64 `env:"DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND" envDefault:"10000" help:"prefill rate, tokens/s, of that estimate until one is measured (0 = hold to the response end)"`
	// PrefillAttentionTokens is the context length (tokens, finite ≥ 0) at which that estimate
	// takes a prompt token to cost twice the first one (attention over the tokens before it);
	// 0 estimates linearly (picker.Config.PrefillAttentionTokens).
	PrefillAttentionTokens float64 `env:"DYN_EPP_PREFILL_ATTENTION_TOKENS" envDefault:"48000" help:"context length, tokens, at which that estimate doubles a prompt token's prefill cost (attention); 0 = linear"`

	// --- router configuration (selection-service.md §19.2) ---

	// OverlapScoreCredit is the credit per cached device block (finite ≥ 0).
	OverlapScoreCredit float64 `env:"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT" envDefault:"1.0" flag:"router-kv-overlap-score-credit" help:"cost credit per cached device block"`
	// OverlapScoreCreditDecay decays the credit (finite ≥ 0; 0 disables).
	OverlapScoreCreditDecay float64 `env:"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY" envDefault:"0.0" help:"overlap credit decay (0 disables)"`
	// PrefillLoadScale scales active prefill load in the cost (finite ≥ 0).
	PrefillLoadScale float64 `env:"DYN_ROUTER_PREFILL_LOAD_SCALE" envDefault:"1.0" flag:"router-prefill-load-scale" help:"prefill load scale"`
	// DecodeActiveRequestWeight weighs active requests in the decode cost (finite ≥ 0).
	DecodeActiveRequestWeight float64 `env:"DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT" envDefault:"0.0" help:"decode cost weight per active request"`
	// HostCacheHitWeight weighs host-pinned extension blocks, in [0, 1].
	HostCacheHitWeight float64 `env:"DYN_ROUTER_HOST_CACHE_HIT_WEIGHT" envDefault:"0.75" help:"weight of host-pinned cache hits [0,1]"`
	// DiskCacheHitWeight weighs disk extension blocks, in [0, 1].
	DiskCacheHitWeight float64 `env:"DYN_ROUTER_DISK_CACHE_HIT_WEIGHT" envDefault:"0.25" help:"weight of disk cache hits [0,1]"`
	// OverlapScoreWeight is the deprecated DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT (alias
	// DYN_OVERLAP_SCORE_WEIGHT): when set, prefill_load_scale = value and, if 0, credit = 0 (§9.6).
	OverlapScoreWeight OptFloat `env:"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT" help:"deprecated; see selection-service.md §9.6"`
	// RouterTemperature is the softmax temperature (finite ≥ 0; 0 = argmin).
	RouterTemperature float64 `env:"DYN_ROUTER_TEMPERATURE" envDefault:"0.0" flag:"router-temperature" help:"softmax sampling temperature (0 = lowest cost)"`
	// UseKVEvents selects event-driven indexing (alias DYN_USE_KV_EVENTS); false = approximate mode.
	UseKVEvents Bool `env:"DYN_ROUTER_USE_KV_EVENTS" envDefault:"true" flag:"use-kv-events" help:"index from worker KV events (false = approximate mode)"`
	// TrackActiveBlocks counts active blocks per worker rank.
	TrackActiveBlocks Bool `env:"DYN_ROUTER_TRACK_ACTIVE_BLOCKS" envDefault:"true" help:"track active blocks"`
	// TrackOutputBlocks grows bookings with output blocks; requires TrackActiveBlocks.
	TrackOutputBlocks Bool `env:"DYN_ROUTER_TRACK_OUTPUT_BLOCKS" envDefault:"false" help:"track output blocks (requires active blocks)"`
	// AssumeKVReuse assumes shared prefixes are reused on the worker.
	AssumeKVReuse Bool `env:"DYN_ROUTER_ASSUME_KV_REUSE" envDefault:"true" flag:"router-assume-kv-reuse" help:"assume KV reuse of shared active blocks"`
	// TrackPrefillTokens books prefill tokens until prefill completes.
	TrackPrefillTokens Bool `env:"DYN_ROUTER_TRACK_PREFILL_TOKENS" envDefault:"true" help:"track active prefill tokens"`
	// ActiveRequestExpiry is the booking expiry guard (DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS, > 0).
	ActiveRequestExpiry Seconds `env:"DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS" envDefault:"300" help:"expiry guard for bookings, seconds"`
	// ApproximateTTL is the approximate-mode block TTL (DYN_ROUTER_TTL_SECS, > 0).
	ApproximateTTL Seconds `env:"DYN_ROUTER_TTL_SECS" envDefault:"120" help:"approximate-mode block TTL, seconds"`
	// MaxTreeSize is the approximate-mode prune trigger in (node, candidate) entries (> 0).
	MaxTreeSize int `env:"DYN_ROUTER_MAX_TREE_SIZE" envDefault:"1048576" help:"approximate-mode index size that triggers pruning, entries"`
	// PruneTargetRatio is the fraction of MaxTreeSize pruning shrinks to, in (0, 1).
	PruneTargetRatio float64 `env:"DYN_ROUTER_PRUNE_TARGET_RATIO" envDefault:"0.8" help:"approximate-mode prune target, fraction of the max tree size"`
	// QueueThreshold enables queueing when set (router_queue_threshold, ≥ 0; selection-service.md §13).
	QueueThreshold OptFloat `env:"DYN_ROUTER_QUEUE_THRESHOLD" help:"queue threshold (unset = queueing off)"`
	// QueuePolicy is router_queue_policy (selection-service.md §13.2, §19.2): the order queued
	// requests leave a policy class's queue, fcfs, lcfs or wspt; also the default of policy
	// classes without queue_policy. Anything else stops startup.
	QueuePolicy string `env:"DYN_ROUTER_QUEUE_POLICY" envDefault:"fcfs" help:"queue order: fcfs | lcfs | wspt"`
	// OverlapRefreshAfter is DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS (seconds, ≥ 0; 0 disables;
	// §13.3): a request queued at least this long has its overlap re-queried at dequeue.
	OverlapRefreshAfter Seconds `env:"DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS" envDefault:"10" help:"re-query the overlap of requests queued at least this long, seconds (0 = never)"`
	// PrefillBusyThreshold enables the advisory prefill_busy flag (≥ 0).
	PrefillBusyThreshold OptFloat `env:"DYN_ROUTER_CONDITIONAL_DISAGG_PREFILL_BUSY_THRESHOLD" help:"prefill busy threshold (unset = off)"`
	// DecodeBusyThreshold enables the decode_busy flag (≥ 0).
	DecodeBusyThreshold OptFloat `env:"DYN_ROUTER_CONDITIONAL_DISAGG_DECODE_BUSY_THRESHOLD" help:"decode busy threshold (unset = off)"`
	// ApproximateCachePolicy is ttl or lru (kv-events-index.md §15.1). lru bounds each
	// (worker, dp_rank) of the approximate index by the worker's total_kv_blocks (blocks),
	// evicting its least-recently-inserted blocks; workers without total_kv_blocks keep TTL
	// eviction only. lru with KV events → startup error.
	ApproximateCachePolicy string `env:"DYN_ROUTER_APPROXIMATE_CACHE_POLICY" envDefault:"ttl" help:"approximate-mode cache policy (ttl | lru: per-rank capacity = total_kv_blocks)"`
	// PolicyConfig is the worker-selection policy YAML path (selection-service.md §18).
	PolicyConfig string `env:"DYN_ROUTER_POLICY_CONFIG" flag:"router-policy-config" help:"worker-selection policy YAML path"`
	// WorkerSelectionPolicy overrides the YAML's default instance name ("default" = built-in).
	WorkerSelectionPolicy string `env:"DYN_ROUTER_WORKER_SELECTION_POLICY" flag:"router-worker-selection-policy" help:"policy instance name (default = built-in)"`
	// SessionAffinityTTL enables session affinity when set (1–31,536,000 s).
	SessionAffinityTTL OptFloat `env:"DYN_ROUTER_SESSION_AFFINITY_TTL_SECS" flag:"session-affinity-ttl-secs" help:"session affinity TTL in seconds (unset = off)"`
	// SharedCacheType must be "none" (selection-service.md §19.2).
	SharedCacheType string `env:"DYN_SHARED_CACHE_TYPE" envDefault:"none" help:"shared cache type (only none)"`
	// TrackingHash must be "public-xxh3-v1".
	TrackingHash string `env:"DYN_ROUTER_TRACKING_HASH" envDefault:"public-xxh3-v1" flag:"router-tracking-hash" help:"tracking hash (only public-xxh3-v1)"`

	// --- logging ---

	// LogLevel is the zerolog level: trace, debug, info, warn, error.
	LogLevel string `env:"DYN_LOG" envDefault:"info" flag:"log-level" help:"log level: trace|debug|info|warn|error"`

	// raw remembers the text each setting was read from (the environment, a flag or the
	// default), and loaded the formatted field value it parsed to, so error messages quote the
	// user's text while the field is unchanged.
	raw, loaded map[string]string
	// flags maps a setting's env name to "--flag" when a command-line flag gave its value, so
	// errors name what the user typed.
	flags map[string]string
	// selectService marks a configuration for `epp select-service` (HTTP API only): the ext_proc,
	// tokenizer and discovery settings are not checked.
	selectService bool
}

// envAliases maps an alias to the canonical variable it stands for; the canonical name wins when
// both are set (epp.md §2, selection-service.md §19.2).
var envAliases = map[string]string{
	"DYN_USE_KV_EVENTS":        "DYN_ROUTER_USE_KV_EVENTS",
	"DYN_SECURE_SERVING":       "DYN_EPP_SECURE_SERVING",
	"DYN_OVERLAP_SCORE_WEIGHT": "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT",
	"DYN_LOG_LEVEL":            "DYN_LOG",
}

// Bool is a boolean setting that accepts true/false/1/0/yes/no in any letter case
// (selection-service.md §19.2); anything else is an error.
type Bool bool

// UnmarshalText implements encoding.TextUnmarshaler.
func (b *Bool) UnmarshalText(text []byte) error {
	v, err := ParseBool(string(text))
	if err != nil {
		return err
	}
	*b = Bool(v)
	return nil
}

// ParseBool parses true/false/1/0/yes/no case-insensitively (surrounding spaces ignored).
func ParseBool(s string) (bool, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "true", "1", "yes":
		return true, nil
	case "false", "0", "no":
		return false, nil
	}
	return false, errors.New("must be one of true, false, 1, 0, yes, no")
}

// Seconds is a duration setting written in (possibly fractional) seconds. Parsing accepts any
// finite number; each setting's range (> 0, or >= 0) is checked by Validate, so -1 and 0 of a
// setting that must be positive get the same message.
type Seconds time.Duration

// UnmarshalText implements encoding.TextUnmarshaler.
func (s *Seconds) UnmarshalText(text []byte) error {
	f, err := strconv.ParseFloat(strings.TrimSpace(string(text)), 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return errors.New("must be a finite number of seconds")
	}
	if math.Abs(f) > float64(math.MaxInt64)/float64(time.Second) {
		return errors.New("is too large")
	}
	*s = Seconds(time.Duration(f * float64(time.Second)))
	return nil
}

// Duration returns the value as a time.Duration.
func (s Seconds) Duration() time.Duration { return time.Duration(s) }

// Millis is a duration setting written in whole milliseconds.
type Millis time.Duration

// UnmarshalText implements encoding.TextUnmarshaler.
func (m *Millis) UnmarshalText(text []byte) error {
	v, err := strconv.ParseInt(strings.TrimSpace(string(text)), 10, 64)
	if errors.Is(err, strconv.ErrRange) {
		return errors.New("is too large")
	}
	if err != nil {
		return errors.New("must be an integer number of milliseconds")
	}
	if v <= 0 {
		return errors.New("must be > 0")
	}
	if v > math.MaxInt64/int64(time.Millisecond) {
		return errors.New("is too large")
	}
	*m = Millis(time.Duration(v) * time.Millisecond)
	return nil
}

// Duration returns the value as a time.Duration.
func (m Millis) Duration() time.Duration { return time.Duration(m) }

// OptFloat is an optional number: Set is false when the variable is unset or empty.
type OptFloat struct {
	// Set is true when a value was given.
	Set bool
	// Value is the number (meaningful only when Set).
	Value float64
}

// UnmarshalText implements encoding.TextUnmarshaler; the number must be finite.
func (o *OptFloat) UnmarshalText(text []byte) error {
	s := strings.TrimSpace(string(text))
	if s == "" {
		*o = OptFloat{}
		return nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if errors.Is(err, strconv.ErrRange) && !math.IsInf(f, 0) {
		err = nil // underflow: the nearest float (0 or a denormal) is the value
	}
	if errors.Is(err, strconv.ErrRange) {
		return errors.New("is out of range: must be a finite number")
	}
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return errors.New("must be a finite number")
	}
	*o = OptFloat{Set: true, Value: f}
	return nil
}

// ModelDirs maps a model name to a directory; written "model=dir,model2=dir2". Model names may
// contain '/', so only the first '=' of each entry splits.
type ModelDirs map[string]string

// UnmarshalText implements encoding.TextUnmarshaler. Empty entries are skipped; an entry without
// '=', with an empty side, or naming a model twice is an error.
func (m *ModelDirs) UnmarshalText(text []byte) error {
	out := ModelDirs{}
	for _, entry := range strings.Split(string(text), ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		model, dir, ok := strings.Cut(entry, "=")
		model, dir = strings.TrimSpace(model), strings.TrimSpace(dir)
		if !ok || model == "" || dir == "" {
			return fmt.Errorf("entry %q must be model=dir", entry)
		}
		if _, dup := out[model]; dup {
			return fmt.Errorf("model %q is listed twice", model)
		}
		out[model] = dir
	}
	*m = out
	return nil
}

// String renders the map in its input form, models sorted.
func (m ModelDirs) String() string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return strings.Join(parts, ",")
}

// parserFuncs replace env's built-in parsers so every message says what a valid value looks like.
var parserFuncs = map[reflect.Type]env.ParserFunc{
	reflect.TypeOf(false): func(v string) (any, error) { return ParseBool(v) },
	reflect.TypeOf(0): func(v string) (any, error) {
		n, err := parseInteger(v, strconv.IntSize)
		return int(n), err
	},
	reflect.TypeOf(int64(0)): func(v string) (any, error) { return parseInteger(v, 64) },
	reflect.TypeOf(0.0): func(v string) (any, error) {
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil {
			return nil, errors.New("must be a number")
		}
		return f, nil
	},
}

// parseInteger parses a decimal integer setting of bits bits; an integer too large for it is
// "out of range", anything else "must be an integer".
func parseInteger(v string, bits int) (int64, error) {
	n, err := strconv.ParseInt(strings.TrimSpace(v), 10, bits)
	if errors.Is(err, strconv.ErrRange) {
		lo, hi := int64(math.MinInt64)>>(64-bits), int64(math.MaxInt64)>>(64-bits)
		return 0, fmt.Errorf("is out of range: the integer must be in %d..%d", lo, hi)
	}
	if err != nil {
		return 0, errors.New("must be an integer")
	}
	return n, nil
}

// DefaultConfig returns the configuration with every default applied and nothing read from the
// process environment. It still needs a tokenizer (TokenizerDir) or UseKVEvents=false to validate.
func DefaultConfig() Config {
	cfg, err := parseEnv(map[string]string{}, nil)
	if err != nil {
		panic("runner: defaults do not parse: " + err.Error()) // a programming error in the tags
	}
	return cfg
}

// LoadConfig reads the configuration from environ (KEY=VALUE strings, as os.Environ returns) and
// then from args (flags, which override the environment), and validates it. Errors name the
// offending setting and value, e.g. `invalid DYN_KV_CACHE_BLOCK_SIZE "0": must be > 0`. A -h/-help
// flag returns flag.ErrHelp after printing usage to usage (nil = os.Stderr).
func LoadConfig(environ []string, args []string, usage io.Writer) (Config, error) {
	return loadConfig(environ, args, usage, false)
}

// LoadSelectServiceConfig reads the environment part of `epp select-service`'s configuration:
// the router settings, policy configuration, log level, DYN_EPP_SELECTION_HTTP_PORT and
// DYN_EPP_BIND_ADDRESS (the defaults of --port and the bind host). Only the settings that service
// uses are validated; its flags are parsed by runner/selectservice.
func LoadSelectServiceConfig(environ []string) (Config, error) {
	return loadConfig(environ, nil, io.Discard, true)
}

func loadConfig(environ []string, args []string, usage io.Writer, selectService bool) (Config, error) {
	vars := env.ToMap(environ)
	for alias, canonical := range envAliases {
		if v, ok := vars[alias]; ok {
			if _, set := vars[canonical]; !set {
				vars[canonical] = v
			}
		}
	}
	var flags map[string]string
	if !selectService {
		var err error
		if flags, err = applyFlags(vars, args, usage); err != nil {
			return Config{}, err
		}
	}
	cfg, err := parseEnv(vars, flags)
	if err != nil {
		return Config{}, err
	}
	cfg.selectService = selectService
	if err := cfg.Validate(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// settingField describes one Config field's environment name and flag.
type settingField struct {
	field, env, flag, help, def string
	isBool                      bool
}

// settingFields lists the Config fields that have an env tag, in declaration order.
func settingFields() []settingField {
	t := reflect.TypeOf(Config{})
	var out []settingField
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("env"), ",")
		if name == "" {
			continue
		}
		out = append(out, settingField{
			field: f.Name, env: name, flag: f.Tag.Get("flag"), help: f.Tag.Get("help"),
			def: f.Tag.Get("envDefault"), isBool: f.Type == reflect.TypeOf(Bool(false)),
		})
	}
	return out
}

// CanonicalSettingName returns the environment variable kvepp reads for name: name itself when it
// is a setting (for example DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT), the canonical variable when name
// is one of its documented aliases (DYN_LOG_LEVEL → DYN_LOG), and ok = false otherwise. Callers
// that start kvepp use it to check a setting before they pass it on.
func CanonicalSettingName(name string) (canonical string, ok bool) {
	if c, isAlias := envAliases[name]; isAlias {
		return c, true
	}
	for _, f := range settingFields() {
		if f.env == name {
			return name, true
		}
	}
	return "", false
}

// boolFlag is a flag.Value that records a boolean flag's text, allowing "--x" alone.
type boolFlag struct{ val *string }

// String implements flag.Value.
func (b boolFlag) String() string {
	if b.val == nil {
		return ""
	}
	return *b.val
}

// Set implements flag.Value.
func (b boolFlag) Set(s string) error { *b.val = s; return nil }

// IsBoolFlag lets the flag be given without a value ("--secure-serving" means true).
func (b boolFlag) IsBoolFlag() bool { return true }

// commandsUsage opens `epp -h`: the commands, then the EPP's flags.
const commandsUsage = `Usage:
  epp [flags]                   run the endpoint picker (ext_proc, health, selection side port, metrics)
  epp select-service [flags]    run only the HTTP selection service (epp select-service -h)
  epp route [flags]             play Envoy for one request against a running EPP and print the decision (epp route -h)

Every flag also has a DYN_* environment variable; flags win.

Flags of epp:
`

// applyFlags parses args and copies every flag that was given into vars under its env name. It
// returns env name → "--flag" for the settings the flags gave.
func applyFlags(vars map[string]string, args []string, usage io.Writer) (map[string]string, error) {
	if usage == nil {
		usage = os.Stderr
	}
	fs := flag.NewFlagSet("epp", flag.ContinueOnError)
	fs.SetOutput(usage)
	fs.Usage = func() {
		fmt.Fprint(usage, commandsUsage)
		fs.PrintDefaults()
	}
	values := map[string]*string{}
	byFlag := map[string]settingField{}
	for _, s := range settingFields() {
		if s.flag == "" {
			continue
		}
		v := new(string)
		values[s.flag] = v
		byFlag[s.flag] = s
		help := fmt.Sprintf("%s (env %s", s.help, s.env)
		if s.def != "" {
			help += ", default " + s.def
		}
		help += ")"
		if s.isBool {
			fs.Var(boolFlag{v}, s.flag, help)
		} else {
			fs.StringVar(v, s.flag, "", help)
		}
	}
	// The standalone service's negative form (selection-service.md §19.1).
	noReuse := new(string)
	fs.Var(boolFlag{noReuse}, "no-router-assume-kv-reuse", "disable assume KV reuse (overrides the env value)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	given := map[string]string{}
	var flagErr error
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "no-router-assume-kv-reuse" {
			v, err := ParseBool(*noReuse)
			if err != nil {
				flagErr = fmt.Errorf("invalid flag --no-router-assume-kv-reuse %q: %w", *noReuse, err)
				return
			}
			vars["DYN_ROUTER_ASSUME_KV_REUSE"] = strconv.FormatBool(!v)
			return
		}
		env := byFlag[f.Name].env
		vars[env] = *values[f.Name]
		given[env] = "--" + f.Name
	})
	return given, flagErr
}

// parseEnv fills a Config from vars (defaults for what is missing) without validating ranges.
// flags (env name → "--flag", may be nil) records which settings came from flags.
func parseEnv(vars, flags map[string]string) (Config, error) {
	var cfg Config
	err := env.ParseWithOptions(&cfg, env.Options{Environment: vars, FuncMap: parserFuncs})
	if err != nil {
		return Config{}, renameParseErrors(err, vars, flags)
	}
	cfg.raw = map[string]string{}
	cfg.loaded = map[string]string{}
	cfg.flags = flags
	rv := reflect.ValueOf(cfg)
	for _, f := range settingFields() {
		if v := vars[f.env]; v != "" { // env treats an empty value as unset: the default applies
			cfg.raw[f.env] = v
		} else {
			cfg.raw[f.env] = f.def
		}
		cfg.loaded[f.env] = fmt.Sprint(rv.FieldByName(f.field).Interface())
	}
	return cfg, nil
}

// settingName names a setting in an error: `--flag (DYN_X)` when the flag in flags gave its
// value, else `DYN_X`.
func settingName(key string, flags map[string]string) string {
	if f, ok := flags[key]; ok {
		return f + " (" + key + ")"
	}
	return key
}

// name is settingName for this configuration's flags.
func (c *Config) name(key string) string { return settingName(key, c.flags) }

// renameParseErrors turns env's field-named errors into `invalid DYN_X "value": reason` (`invalid
// --flag (DYN_X) "value": reason` when a flag gave the value).
func renameParseErrors(err error, vars, flags map[string]string) error {
	envOf := map[string]string{}
	for _, s := range settingFields() {
		envOf[s.field] = s.env
	}
	var agg env.AggregateError
	if !errors.As(err, &agg) {
		return err
	}
	var msgs []string
	for _, e := range agg.Errors {
		var pe env.ParseError
		if errors.As(e, &pe) {
			key := envOf[pe.Name]
			msgs = append(msgs, fmt.Sprintf("invalid %s %q: %v", settingName(key, flags), vars[key], pe.Err))
			continue
		}
		msgs = append(msgs, e.Error())
	}
	return errors.New(strings.Join(msgs, "; "))
}

// rawOf returns the text setting key was read from, as given (31536001, not 3.1536001e+07), while
// its field still holds the value parsed from it; otherwise (a Config built or changed in code)
// the formatted value v.
func (c *Config) rawOf(key string, v any) string {
	if s, ok := c.raw[key]; ok {
		for _, f := range settingFields() {
			if f.env == key && fmt.Sprint(reflect.ValueOf(*c).FieldByName(f.field).Interface()) == c.loaded[key] {
				return s
			}
		}
	}
	return fmt.Sprint(v)
}

// invalid formats a validation error naming the setting (and its flag when a flag gave it) and
// quoting its value as given: `invalid --block-size (DYN_KV_CACHE_BLOCK_SIZE) "0": must be > 0`.
func (c *Config) invalid(key string, v any, format string, args ...any) error {
	return fmt.Errorf("invalid %s %q: %s", c.name(key), c.rawOf(key, v), fmt.Sprintf(format, args...))
}

// Validate checks every setting and returns the first problem as an error naming the variable
// (epp.md §2: invalid or missing required values stop startup; no silent fallbacks). Cross-setting
// rules: vllm-render needs DYN_EPP_TOKENIZER_SERVICE_URL (or DYN_EPP_TOKENIZER_SERVICE_URLS),
// local needs a tokenizer directory, none needs DYN_ROUTER_USE_KV_EVENTS=false; at most one of
// DYN_EPP_WORKERS_FILE and DYN_EPP_INFERENCE_POOL_NAME.
func (c *Config) Validate() error {
	if c.selectService {
		if c.SelectionHTTPPort < 0 || c.SelectionHTTPPort > 65535 {
			return c.invalid("DYN_EPP_SELECTION_HTTP_PORT", c.SelectionHTTPPort, "must be a port in 0..65535")
		}
		return c.validateRouter()
	}
	ports := []struct {
		key string
		v   int
	}{
		{"DYN_EPP_GRPC_PORT", c.GRPCPort},
		{"DYN_EPP_GRPC_HEALTH_PORT", c.GRPCHealthPort},
		{"DYN_EPP_SELECTION_HTTP_PORT", c.SelectionHTTPPort},
		{"DYN_EPP_METRICS_PORT", c.MetricsPort},
	}
	seen := map[int]string{}
	for _, p := range ports {
		if p.v < 0 || p.v > 65535 {
			return c.invalid(p.key, p.v, "must be a port in 0..65535")
		}
		if other, dup := seen[p.v]; dup && p.v != 0 {
			return c.invalid(p.key, p.v, "port is already used by %s", c.name(other))
		}
		seen[p.v] = p.key
	}
	if c.Mode != "standalone" {
		return c.invalid("DYN_EPP_MODE", c.Mode, "only standalone is implemented")
	}
	if c.KubeDiscoveryMode != "pod" {
		return c.invalid("DYN_KUBE_DISCOVERY_MODE", c.KubeDiscoveryMode, "only pod is supported")
	}
	if err := c.validatePoolDiscovery(); err != nil {
		return err
	}
	if c.BlockSize <= 0 {
		return c.invalid("DYN_KV_CACHE_BLOCK_SIZE", c.BlockSize, "must be > 0")
	}
	if c.BlockSize > math.MaxUint32 {
		return c.invalid("DYN_KV_CACHE_BLOCK_SIZE", c.BlockSize, "must fit in 32 bits")
	}

	if err := c.validateTokenizer(); err != nil {
		return err
	}

	if c.MaxRequestBodyBytes <= 0 {
		return c.invalid("DYN_EPP_MAX_REQUEST_BODY_BYTES", c.MaxRequestBodyBytes, "must be > 0")
	}
	if c.MaxRequestBodyBytes > math.MaxInt32-(1<<20) {
		return c.invalid("DYN_EPP_MAX_REQUEST_BODY_BYTES", c.MaxRequestBodyBytes, "must be <= %d (the gRPC message limit is the body cap + 1 MiB)", math.MaxInt32-(1<<20))
	}
	if c.MaxInflightRequests <= 0 {
		return c.invalid("DYN_EPP_MAX_INFLIGHT_REQUESTS", c.MaxInflightRequests, "must be > 0")
	}
	if c.MaxDestinations < 1 {
		return c.invalid("DYN_EPP_MAX_DESTINATIONS", c.MaxDestinations, "must be >= 1")
	}
	if c.RequestBodyTimeout <= 0 {
		return c.invalid("DYN_EPP_REQUEST_BODY_TIMEOUT_SECS", c.RequestBodyTimeout.Duration().Seconds(), "must be > 0")
	}
	if c.DrainTimeout < 0 {
		return c.invalid("DYN_EPP_DRAIN_TIMEOUT_SECS", c.DrainTimeout.Duration().Seconds(), "must be >= 0")
	}
	if c.CertPath != "" && !bool(c.SecureServing) {
		return c.invalid("DYN_EPP_CERT_PATH", c.CertPath, "requires DYN_EPP_SECURE_SERVING=true")
	}
	for _, o := range []struct {
		key string
		v   OptFloat
	}{
		{"DYN_EPP_MAX_NUM_BATCHED_TOKENS", c.MaxNumBatchedTokens},
		{"DYN_EPP_TOTAL_KV_BLOCKS", c.TotalKVBlocks},
	} {
		if o.v.Set && (o.v.Value < 1 || o.v.Value != math.Trunc(o.v.Value) || o.v.Value > 1<<53) {
			return c.invalid(o.key, o.v.Value, "must be a whole number in 1..9007199254740992 (2^53)")
		}
	}
	if err := c.validateReplicaSync(); err != nil {
		return err
	}
	return c.validateRouter()
}

// validatePoolDiscovery checks the InferencePool discovery settings (epp.md §2): with
// DYN_EPP_INFERENCE_POOL_NAME (a DNS-1123 subdomain, as every Kubernetes object name),
// POD_NAMESPACE (a DNS-1123 label) and DYN_MODEL_NAME are required and DYN_EPP_WORKERS_FILE must
// be unset; the KV event ports are ports (the replay port may be 0 = off).
func (c *Config) validatePoolDiscovery() error {
	if c.KVEventPort < 1 || c.KVEventPort > 65535 {
		return c.invalid("DYN_EPP_KV_EVENT_PORT", c.KVEventPort, "must be a port in 1..65535")
	}
	if c.KVEventReplayPort < 0 || c.KVEventReplayPort > 65535 {
		return c.invalid("DYN_EPP_KV_EVENT_REPLAY_PORT", c.KVEventReplayPort, "must be a port in 1..65535 (or unset)")
	}
	if c.InferencePoolName == "" {
		return nil
	}
	if errs := validation.IsDNS1123Subdomain(c.InferencePoolName); len(errs) > 0 {
		return c.invalid("DYN_EPP_INFERENCE_POOL_NAME", c.InferencePoolName, "must be a Kubernetes object name (DNS-1123 subdomain: %s)", strings.Join(errs, "; "))
	}
	if c.PodNamespace != "" {
		if errs := validation.IsDNS1123Label(c.PodNamespace); len(errs) > 0 {
			return c.invalid("POD_NAMESPACE", c.PodNamespace, "must be a Kubernetes namespace name (DNS-1123 label: %s)", strings.Join(errs, "; "))
		}
	}
	switch {
	case c.WorkersFile != "":
		return c.invalid("DYN_EPP_INFERENCE_POOL_NAME", c.InferencePoolName, "set at most one of DYN_EPP_INFERENCE_POOL_NAME and DYN_EPP_WORKERS_FILE")
	case c.PodNamespace == "":
		return fmt.Errorf("%s is required with %s (set it from the downward API: fieldRef metadata.namespace)", c.name("POD_NAMESPACE"), c.name("DYN_EPP_INFERENCE_POOL_NAME"))
	case c.ModelName == "":
		return fmt.Errorf("%s is required with %s: it must equal vLLM's served model name", c.name("DYN_MODEL_NAME"), c.name("DYN_EPP_INFERENCE_POOL_NAME"))
	}
	return nil
}

// validateRouter checks the router settings (selection-service.md §19.2), the peers and logging.
func (c *Config) validateRouter() error {
	for _, peer := range c.IndexerPeers {
		if !strings.HasPrefix(peer, "http://") && !strings.HasPrefix(peer, "https://") {
			return c.invalid("DYN_EPP_INDEXER_PEERS", strings.Join(c.IndexerPeers, ","), "peer %q must be an http(s) base URL", peer)
		}
	}
	if (len(c.IndexerPeers) > 0 && c.RecoveryTimeout == 0) || c.RecoveryTimeout < 0 {
		return c.invalid("DYN_EPP_RECOVERY_TIMEOUT_SECS", c.RecoveryTimeout.Duration().Seconds(), "must be > 0")
	}
	if c.RecoveryMaxBytes <= 0 {
		return c.invalid("DYN_EPP_RECOVERY_MAX_BYTES", c.RecoveryMaxBytes, "must be > 0")
	}
	if c.RecoveryMaxEvents <= 0 {
		return c.invalid("DYN_EPP_RECOVERY_MAX_EVENTS", c.RecoveryMaxEvents, "must be > 0")
	}

	nonNeg := []struct {
		key string
		v   float64
	}{
		{"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", c.OverlapScoreCredit},
		{"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY", c.OverlapScoreCreditDecay},
		{"DYN_ROUTER_PREFILL_LOAD_SCALE", c.PrefillLoadScale},
		{"DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT", c.DecodeActiveRequestWeight},
		{"DYN_ROUTER_TEMPERATURE", c.RouterTemperature},
		{"DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND", c.AssumedPrefillTokensPerSecond},
		{"DYN_EPP_PREFILL_ATTENTION_TOKENS", c.PrefillAttentionTokens},
	}
	for _, f := range nonNeg {
		if math.IsNaN(f.v) || math.IsInf(f.v, 0) || f.v < 0 {
			return c.invalid(f.key, f.v, "must be a finite number >= 0")
		}
	}
	unit := []struct {
		key string
		v   float64
	}{
		{"DYN_ROUTER_HOST_CACHE_HIT_WEIGHT", c.HostCacheHitWeight},
		{"DYN_ROUTER_DISK_CACHE_HIT_WEIGHT", c.DiskCacheHitWeight},
	}
	for _, f := range unit {
		if math.IsNaN(f.v) || f.v < 0 || f.v > 1 {
			return c.invalid(f.key, f.v, "must be in [0, 1]")
		}
	}
	if c.OverlapScoreWeight.Set && c.OverlapScoreWeight.Value < 0 {
		return c.invalid("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", c.OverlapScoreWeight.Value, "must be a finite number >= 0")
	}
	if bool(c.TrackOutputBlocks) && !bool(c.TrackActiveBlocks) {
		return c.invalid("DYN_ROUTER_TRACK_OUTPUT_BLOCKS", c.TrackOutputBlocks, "requires DYN_ROUTER_TRACK_ACTIVE_BLOCKS=true")
	}
	if c.ActiveRequestExpiry <= 0 {
		return c.invalid("DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS", c.ActiveRequestExpiry.Duration().Seconds(), "must be > 0")
	}
	if c.ApproximateTTL <= 0 {
		return c.invalid("DYN_ROUTER_TTL_SECS", c.ApproximateTTL.Duration().Seconds(), "must be > 0")
	}
	if c.MaxTreeSize <= 0 {
		return c.invalid("DYN_ROUTER_MAX_TREE_SIZE", c.MaxTreeSize, "must be > 0")
	}
	if !(c.PruneTargetRatio > 0 && c.PruneTargetRatio < 1) {
		return c.invalid("DYN_ROUTER_PRUNE_TARGET_RATIO", c.PruneTargetRatio, "must be in (0, 1)")
	}
	for _, o := range []struct {
		key string
		v   OptFloat
	}{
		{"DYN_ROUTER_QUEUE_THRESHOLD", c.QueueThreshold},
		{"DYN_ROUTER_CONDITIONAL_DISAGG_PREFILL_BUSY_THRESHOLD", c.PrefillBusyThreshold},
		{"DYN_ROUTER_CONDITIONAL_DISAGG_DECODE_BUSY_THRESHOLD", c.DecodeBusyThreshold},
	} {
		if o.v.Set && o.v.Value < 0 {
			return c.invalid(o.key, o.v.Value, "must be a finite number >= 0")
		}
	}
	switch c.QueuePolicy {
	case "fcfs", "lcfs", "wspt":
	default:
		return c.invalid("DYN_ROUTER_QUEUE_POLICY", c.QueuePolicy, "must be fcfs, lcfs or wspt")
	}
	if d := c.OverlapRefreshAfter.Duration(); d < 0 {
		return c.invalid("DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS", d.Seconds(), "must be >= 0")
	}
	switch c.ApproximateCachePolicy {
	case "ttl":
	case "lru":
		if c.UseKVEvents {
			return c.invalid("DYN_ROUTER_APPROXIMATE_CACHE_POLICY", c.ApproximateCachePolicy, "lru is not allowed with DYN_ROUTER_USE_KV_EVENTS=true")
		}
	default:
		return c.invalid("DYN_ROUTER_APPROXIMATE_CACHE_POLICY", c.ApproximateCachePolicy, "must be ttl or lru")
	}
	if c.SessionAffinityTTL.Set {
		if v := c.SessionAffinityTTL.Value; v < 1 || v > 31536000 || v != math.Trunc(v) {
			return c.invalid("DYN_ROUTER_SESSION_AFFINITY_TTL_SECS", v, "must be a whole number of seconds in 1..31536000")
		}
	}
	if c.SharedCacheType != "none" {
		return c.invalid("DYN_SHARED_CACHE_TYPE", c.SharedCacheType, "only none is supported")
	}
	if c.TrackingHash != "public-xxh3-v1" {
		return c.invalid("DYN_ROUTER_TRACKING_HASH", c.TrackingHash, "only public-xxh3-v1 is supported")
	}
	if _, err := zerolog.ParseLevel(strings.ToLower(c.LogLevel)); err != nil || c.LogLevel == "" {
		return c.invalid("DYN_LOG", c.LogLevel, "must be one of trace, debug, info, warn, error")
	}
	return nil
}

// validateTokenizer resolves the effective tokenizer protocol and checks its requirements.
func (c *Config) validateTokenizer() error {
	switch c.EffectiveTokenizerProtocol() {
	case TokenizerProtocolLocal:
		if c.TokenizerDir == "" && len(c.Tokenizers) == 0 {
			return c.invalid("DYN_EPP_TOKENIZER_DIR", c.TokenizerDir, "is required when DYN_EPP_TOKENIZER_PROTOCOL=local (or set DYN_EPP_TOKENIZERS)")
		}
		if c.TokenizerDir != "" {
			if err := checkTokenizerDir(c.TokenizerDir, c.ModelName); err != nil {
				return fmt.Errorf("invalid %s %q: %w", c.name("DYN_EPP_TOKENIZER_DIR"), c.TokenizerDir, err)
			}
		}
		for model, dir := range c.Tokenizers {
			if err := checkTokenizerDir(dir, model); err != nil {
				return fmt.Errorf("invalid %s %q: %w", c.name("DYN_EPP_TOKENIZERS")+"["+model+"]", dir, err)
			}
		}
	case TokenizerProtocolVLLMRender:
		if c.TokenizerServiceURL == "" && len(c.TokenizerServiceURLs) == 0 {
			return c.invalid("DYN_EPP_TOKENIZER_SERVICE_URL", "", "is required when DYN_EPP_TOKENIZER_PROTOCOL=vllm-render (or set DYN_EPP_TOKENIZER_SERVICE_URLS)")
		}
		if c.TokenizerMaxResponseBytes <= 0 {
			return c.invalid("DYN_EPP_TOKENIZER_MAX_RESPONSE_BYTES", c.TokenizerMaxResponseBytes, "must be > 0")
		}
		if c.TokenizerServiceURL != "" {
			if err := checkRenderURL(c.TokenizerServiceURL); err != nil {
				return c.invalid("DYN_EPP_TOKENIZER_SERVICE_URL", c.TokenizerServiceURL, "%v", err)
			}
		}
		for model, u := range c.TokenizerServiceURLs {
			if err := checkRenderURL(u); err != nil {
				return fmt.Errorf("invalid %s[%s] %q: %v", c.name("DYN_EPP_TOKENIZER_SERVICE_URLS"), model, u, err)
			}
		}
	case TokenizerProtocolNone:
		if c.UseKVEvents && c.TokenizerProtocol == "" {
			return fmt.Errorf("no tokenizer is configured: set %s (a directory with tokenizer.json, or a Hugging Face cache), %s or %s; "+
				"only with DYN_ROUTER_USE_KV_EVENTS=false can kvepp route without one", c.name("DYN_EPP_TOKENIZER_DIR"),
				c.name("DYN_EPP_TOKENIZERS"), c.name("DYN_EPP_TOKENIZER_SERVICE_URL"))
		}
		if c.UseKVEvents {
			return fmt.Errorf("invalid %s %q: none is only allowed with DYN_ROUTER_USE_KV_EVENTS=false (set DYN_EPP_TOKENIZER_DIR for local tokenization)", c.name("DYN_EPP_TOKENIZER_PROTOCOL"), TokenizerProtocolNone)
		}
	default:
		return c.invalid("DYN_EPP_TOKENIZER_PROTOCOL", c.TokenizerProtocol, "must be local, vllm-render or none")
	}
	if c.TokenizationTimeout <= 0 {
		return c.invalid("DYN_EPP_TOKENIZATION_TIMEOUT_MS", c.TokenizationTimeout.Duration().Milliseconds(), "must be > 0")
	}
	if c.ImageTokens < 0 {
		return c.invalid("DYN_EPP_IMAGE_TOKENS", c.ImageTokens, "must be >= 0")
	}
	if c.TokenizeMaxInflightBytes < 0 {
		return c.invalid("DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES", c.TokenizeMaxInflightBytes, "must be >= 0")
	}
	if c.ConversationCacheBytes < 0 {
		return c.invalid("DYN_EPP_CONVERSATION_CACHE_BYTES", c.ConversationCacheBytes, "must be >= 0")
	}
	return nil
}

// checkTokenizerDir accepts an existing directory (Start resolves and loads it, reporting what
// is missing there) or a value tokenizer.ResolveDir finds in the Hugging Face cache (a model id).
func checkTokenizerDir(dir, model string) error {
	st, err := os.Stat(dir)
	if err == nil {
		if !st.IsDir() {
			return errors.New("not a directory")
		}
		return nil
	}
	if _, rerr := tokenizer.ResolveDir(dir, model); rerr != nil {
		return rerr
	}
	return nil
}

// checkRenderURL accepts an absolute http(s) URL with a host.
func checkRenderURL(s string) error {
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("must be an absolute http(s) URL such as http://vllm:8000")
	}
	return nil
}

// EffectiveTokenizerProtocol returns DYN_EPP_TOKENIZER_PROTOCOL, or when it is empty the derived
// default of epp.md §2: local with a tokenizer dir, vllm-render with a service URL, else none.
func (c *Config) EffectiveTokenizerProtocol() string {
	if c.TokenizerProtocol != "" {
		return strings.ToLower(c.TokenizerProtocol)
	}
	switch {
	case c.TokenizerDir != "" || len(c.Tokenizers) > 0:
		return TokenizerProtocolLocal
	case c.TokenizerServiceURL != "" || len(c.TokenizerServiceURLs) > 0:
		return TokenizerProtocolVLLMRender
	}
	return TokenizerProtocolNone
}

// dumpLimits are the bounds of a recovered /dump (DYN_EPP_RECOVERY_MAX_BYTES,
// DYN_EPP_RECOVERY_MAX_EVENTS).
func (c *Config) dumpLimits() picker.DumpLimits {
	return picker.DumpLimits{MaxBytes: c.RecoveryMaxBytes, MaxEvents: c.RecoveryMaxEvents}
}
