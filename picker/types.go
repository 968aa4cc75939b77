package picker

import (
	"errors"
	"fmt"
)

// DefaultPartitionName is the model_name and routing_group a request or worker record gets when it
// omits them (selection-service.md §3).
const DefaultPartitionName = "default"

// PartitionKey names one partition: the pair (model_name, routing_group). Each partition owns its own
// prefix index, policy instance, load view and affinity table (selection-service.md §1, §3).
type PartitionKey struct {
	// ModelName is the partition model.
	ModelName string
	// RoutingGroup is the partition group.
	RoutingGroup string
}

// String renders the key as "model:group", the form used in error messages and /dump keys.
func (k PartitionKey) String() string { return k.ModelName + ":" + k.RoutingGroup }

// WorkerRank names one candidate: a worker and one of its global data-parallel ranks.
type WorkerRank struct {
	// WorkerID is the worker.
	WorkerID uint64 `json:"worker_id"`
	// DPRank is the global data-parallel rank.
	DPRank uint32 `json:"dp_rank"`
}

// Kind classifies a picker error. Each boundary (httpapi, extproc) maps kinds to its own status codes
// in one table (selection-service.md §2.1; epp.md §8).
type Kind string

// Error kinds, as the machine-readable strings of selection-service.md §2.1.
const (
	KindBadRequest    Kind = "bad_request"   // 400: prompt validation, invariants, pinned worker not allowed
	KindUnprocessable Kind = "unprocessable" // 422: valid JSON with a field that fails validation
	KindNotReady      Kind = "not_ready"     // 503: no schedulable worker, partition missing, shutting down, filters rejected all
	KindNotFound      Kind = "not_found"     // 404: unknown worker, reservation or pending selection
	KindConflict      Kind = "conflict"      // 409: live reservation id reused, booking conflict
	KindOverloaded    Kind = "overloaded"    // 429: overload or queue rejection (Details carries the queue limit)
	KindInternal      Kind = "internal"      // 500: internal error
	KindPolicy        Kind = "policy"        // 500: custom policy failure
)

// Error is the error type every picker operation returns for request-level failures. Message is the
// exact text the spec prescribes; Details, when non-nil, is emitted beside it (the 429 queue body).
type Error struct {
	// Kind selects the status code at each boundary.
	Kind Kind
	// Message is the exact spec text returned as {"error": Message}.
	Message string
	// Details, when non-nil, is emitted as "details" (the 429 queue body).
	Details any
	Err     error // optional wrapped cause
}

// Error returns Message.
func (e *Error) Error() string { return e.Message }

// Unwrap returns the wrapped cause, if any.
func (e *Error) Unwrap() error { return e.Err }

// Errorf builds an *Error of the given kind with a formatted message.
func Errorf(kind Kind, format string, args ...any) *Error {
	return &Error{Kind: kind, Message: fmt.Sprintf(format, args...)}
}

// KindOf reports the kind of err: the Kind of the first *Error in its chain, or KindInternal for any
// other non-nil error. KindOf(nil) is "".
func KindOf(err error) Kind {
	if err == nil {
		return ""
	}
	var pe *Error
	if errors.As(err, &pe) {
		return pe.Kind
	}
	return KindInternal
}

// Lifecycle values of a worker catalog record (selection-service.md §4.5).
const (
	LifecycleIncomplete    = "incomplete"
	LifecycleSchedulable   = "schedulable"
	LifecycleDraining      = "draining"
	LifecycleUnschedulable = "unschedulable"
)

// WorkerRecord is one worker registration, in the JSON schema of POST /workers (selection-service.md
// §4.1). Discovery sources (a workers file, Kubernetes) produce the same records. Optional numbers are
// pointers so "absent" differs from zero.
type WorkerRecord struct {
	// WorkerID is the service-wide worker id.
	WorkerID uint64 `json:"worker_id"`
	// ModelName is the partition model ("default" when empty).
	ModelName string `json:"model_name,omitempty"`
	// RoutingGroup is the partition group ("default" when empty).
	RoutingGroup string `json:"routing_group,omitempty"`
	// Endpoint is the URL callers contact, e.g. http://worker:8000.
	Endpoint string `json:"endpoint,omitempty"`
	// BlockSize is the KV block size in tokens (> 0, equal across the partition).
	BlockSize *uint32 `json:"block_size,omitempty"`
	// DataParallelStartRank is the first global dp_rank (default 0).
	DataParallelStartRank *uint32 `json:"data_parallel_start_rank,omitempty"`
	// DataParallelSize is the number of ranks (default 1, > 0).
	DataParallelSize *uint32 `json:"data_parallel_size,omitempty"`
	// KVEventsEndpoints maps a global rank (decimal) to its ZMQ PUB endpoint.
	KVEventsEndpoints map[string]string `json:"kv_events_endpoints,omitempty"`
	// KVEventsEndpoint is the single-rank shorthand (data_parallel_size 1, empty map).
	KVEventsEndpoint string `json:"kv_events_endpoint,omitempty"`
	// ReplayEndpoint is the ZMQ ROUTER for gap replay (data_parallel_size 1 only).
	ReplayEndpoint string `json:"replay_endpoint,omitempty"`
	// MaxNumBatchedTokens is the prefill capacity in tokens (required while queueing).
	MaxNumBatchedTokens *uint64 `json:"max_num_batched_tokens,omitempty"`
	// TotalKVBlocks is the decode capacity in blocks (enables decode_busy).
	TotalKVBlocks *uint64 `json:"total_kv_blocks,omitempty"`
	// IsEagle selects eagle hashing (equal across the partition).
	IsEagle bool `json:"is_eagle,omitempty"`
	// Taints are matched by routing_constraints.
	Taints []string `json:"taints,omitempty"`
	// StableRoutingID is stored and echoed only.
	StableRoutingID string `json:"stable_routing_id,omitempty"`
	// TopologyDomains is stored and echoed only.
	TopologyDomains map[string]string `json:"topology_domains,omitempty"`
	// KVTransferDomain is stored and echoed only.
	KVTransferDomain string `json:"kv_transfer_domain,omitempty"`
	// KVTransferEnforcement is stored and echoed only.
	KVTransferEnforcement string `json:"kv_transfer_enforcement,omitempty"`
	// KVTransferPreferredWeight is stored and echoed only.
	KVTransferPreferredWeight *float32 `json:"kv_transfer_preferred_weight,omitempty"`
	// RouterHintWorkerType marks a worker that can consume KV hints (§7.7).
	RouterHintWorkerType string `json:"router_hint_worker_type,omitempty"`
	// RouterHintSourceControlEndpoints maps a global rank to where hint targets fetch from this worker.
	RouterHintSourceControlEndpoints map[string]string `json:"router_hint_source_control_endpoints,omitempty"`
	// KVEventSourceMode "state_agent_v2" makes the worker a hint target only.
	KVEventSourceMode string `json:"kv_event_source_mode,omitempty"`

	// RankEndpoints, when set, gives each rank its own endpoint: rank DataParallelStartRank+i is
	// served at RankEndpoints[i] (an InferencePool pod serves dp_rank r on spec.targetPorts[r],
	// epp.md §10.3). Discovery sets it; it is never read from JSON (GET /workers shows it as
	// dp_rank_endpoints). It must list every rank with a valid endpoint, else the worker is
	// incomplete. A POST /workers replaces the record and with it this field; a PATCH that
	// changes endpoint or the rank range drops it. Empty: every rank is served at Endpoint.
	RankEndpoints []string `json:"-"`
}

// RankEndpoint returns the endpoint that serves global rank dpRank: RankEndpoints' entry for it
// when the record has one, else Endpoint.
func (r *WorkerRecord) RankEndpoint(dpRank uint32) string {
	start := uint32(0)
	if r.DataParallelStartRank != nil {
		start = *r.DataParallelStartRank
	}
	if dpRank >= start && uint64(dpRank-start) < uint64(len(r.RankEndpoints)) {
		return r.RankEndpoints[dpRank-start]
	}
	return r.Endpoint
}

// WorkerState is a catalog record as GET /workers, /ready and the worker routes return it: the record
// plus its lifecycle and the reasons it is not schedulable (omitted when empty).
type WorkerState struct {
	WorkerRecord
	// Lifecycle is incomplete, schedulable, draining or unschedulable.
	Lifecycle string `json:"lifecycle"`
	// NotSchedulableReasons are the §4.1 reasons (omitted when empty).
	NotSchedulableReasons []string `json:"not_schedulable_reasons,omitempty"`
	// Candidate is false while the worker is registered but withheld from picks (SetCandidate:
	// a discovered pod whose Ready condition is not True, epp.md §10.2); only candidates count
	// as schedulable in /ready. Always true without discovery. A kvepp addition to the §4.5
	// record.
	Candidate bool `json:"candidate"`
	// DPRankEndpoints maps each global rank (decimal) to its endpoint when the record's ranks
	// are served on their own ports (WorkerRecord.RankEndpoints; omitted otherwise). A kvepp
	// addition to the §4.5 record.
	DPRankEndpoints map[string]string `json:"dp_rank_endpoints,omitempty"`
	// Source is who registered the worker (not part of the JSON record, epp.md §11.3).
	Source Source `json:"-"`
}

// Source records who registered a worker: discovery reconciles only its own workers, while the HTTP
// API may update or delete any (epp.md §11.3).
type Source string

// Worker sources.
const (
	SourceAPI       Source = "api"
	SourceDiscovery Source = "discovery"
)

// Prompt is a request's prompt in one of the two forms of selection-service.md §6: token form
// (TokenIDs non-empty, hashed by the service) or hash form (HashForm true: BlockHashes, SequenceHashes
// and ISLTokens trusted as given).
type Prompt struct {
	// TokenIDs is the token form's prompt (after any mm routing_token_ids substitution).
	TokenIDs []uint32
	// BlockMMHashes, when non-nil, gives block i's multimodal hashes (token form only).
	BlockMMHashes [][]uint64
	// MMItems are multimodal items as token ranges (token form, used when BlockMMHashes is
	// nil): every block overlapping an item's [Start, End) hashes with its Hash
	// (kv-events-index.md §1.3), so the partition's block size decides which blocks they are.
	MMItems []MMItem
	// LoraName and CacheSalt salt the block hashes of the token form (kv-events-index.md §1.2).
	LoraName string
	// CacheSalt is the cache namespace (token form).
	CacheSalt string
	// IsEagle overrides the partition's eagle hashing when non-nil.
	IsEagle *bool
	// HashMemo, when non-nil, holds the block hashes of the first HashMemo.Tokens() token ids,
	// which an earlier request shared (a conversation prefix, tokenizer.ConversationCache): the
	// token form then hashes only the blocks after them. Not part of the HTTP API.
	HashMemo BlockHashMemo

	// HashForm marks the precomputed form; the fields below are then used as-is.
	HashForm bool
	// BlockHashes are the local block hashes (hash form; index lookups).
	BlockHashes []uint64
	// SequenceHashes are the tracking hashes booked as active blocks (hash form).
	SequenceHashes []uint64
	// ISLTokens is the input length in tokens of the hash form (must be > 0).
	ISLTokens uint64
	// ISLTokensSet marks isl_tokens as supplied, so an explicit 0 is reported as
	// "isl_tokens must be greater than 0" rather than as missing (§6.3). A non-zero ISLTokens
	// counts as supplied either way.
	ISLTokensSet bool
}

// BlockHashMemo keeps the block hashes of a token prefix shared by several prompts (epp issue 15:
// hashing reuse for continuing conversations). A prompt carrying one promises that its first
// Tokens() token ids are the memo's; the picker loads what was computed before and stores what it
// computes, per hashing key (block size and seed: LoRA name and cache namespace). Implementations
// are safe for concurrent use.
type BlockHashMemo interface {
	// Tokens is the length of the memo's token prefix, tokens.
	Tokens() int
	// LoadBlockHashes returns the local block hashes and their sequence hashes (equal lengths)
	// known for key, covering the first len(local) blocks of the prefix; nil when none are.
	LoadBlockHashes(key BlockHashKey) (local, seq []uint64)
	// StoreBlockHashes keeps the hashes of the prefix's first len(local) blocks for key. The
	// slices are not modified afterwards; the memo may keep them.
	StoreBlockHashes(key BlockHashKey, local, seq []uint64)
}

// BlockHashKey is what block hashes depend on besides the tokens (kv-events-index.md §1.1, §1.2).
type BlockHashKey struct {
	// BlockSize is tokens per block.
	BlockSize uint32
	// Seed is kvindex.Seed(lora_name, cache namespace).
	Seed uint64
}

// MMItem is one multimodal item of a token-form prompt: the token range [Start, End) it occupies
// and its u64 mm hash (kvindex.HashMMIdentifier of the engine's identifier, or a request-unique
// value for content kvepp cannot hash as the engine does, which makes those blocks uncached).
type MMItem struct {
	Start, End int
	Hash       uint64
}

// blockMMHashes spreads items over the blocks of a prompt of n tokens at block size bs: block i
// gets the hash of every item overlapping [i*bs, (i+1)*bs), in item order. Only full blocks are
// hashed, so items past the last full block are ignored. nil when no item overlaps a block.
func blockMMHashes(items []MMItem, n int, bs uint32) [][]uint64 {
	blocks := n / int(bs)
	var out [][]uint64
	for _, it := range items {
		if it.End <= it.Start {
			continue
		}
		first, last := it.Start/int(bs), (it.End-1)/int(bs)
		for b := max(first, 0); b <= last && b < blocks; b++ {
			if out == nil {
				out = make([][]uint64, blocks)
			}
			out[b] = append(out[b], it.Hash)
		}
	}
	return out
}

// RouterConfigOverride is the per-request router_config_override (selection-service.md §9.5). Nil
// fields leave the configured value in place.
type RouterConfigOverride struct {
	// OverlapScoreCredit replaces the device-overlap credit (finite >= 0).
	OverlapScoreCredit *float64 `json:"overlap_score_credit,omitempty"`
	// PrefillLoadScale replaces the prefill scale (finite >= 0).
	PrefillLoadScale *float64 `json:"prefill_load_scale,omitempty"`
	// OverlapScoreWeight is deprecated: sets the scale, and a zero credit when 0 (§9.6).
	OverlapScoreWeight *float64 `json:"overlap_score_weight,omitempty"`
	// RouterTemperature replaces the picker temperature (finite >= 0).
	RouterTemperature *float64 `json:"router_temperature,omitempty"`
	// AssumeKVReuse selects chained (true) or random (false) tracking hashes.
	AssumeKVReuse *bool `json:"assume_kv_reuse,omitempty"`
	// TrackPrefillTokens decides prefill tracking for this request.
	TrackPrefillTokens *bool `json:"track_prefill_tokens,omitempty"`
	// SharedCacheMultiplier is accepted in [0, 1] with no effect (no shared cache).
	SharedCacheMultiplier *float64 `json:"shared_cache_multiplier,omitempty"`
}

// SessionContext is the structured session_context of selection-service.md §12.2.
type SessionContext struct {
	// SessionID drives the affinity table when enabled (required).
	SessionID string `json:"session_id"`
	// ParentSessionID is the subagent parent.
	ParentSessionID string `json:"parent_session_id,omitempty"`
	// SessionFinal is the terminal marker.
	SessionFinal bool   `json:"session_final,omitempty"`
	InputTrigger string `json:"input_trigger,omitempty"` // "user_message" | "tool_result" | "other" | ""
	// AgentHeaders are upstream-captured header names to ordered values, uninterpreted.
	AgentHeaders map[string][]string `json:"agent_headers,omitempty"`
	// KVHints carries evict_session for policies.
	KVHints *SessionKVHints `json:"kv_hints,omitempty"`
}

// SessionKVHints is session_context.kv_hints.
type SessionKVHints struct {
	// EvictSession asks policies to evict the session.
	EvictSession bool `json:"evict_session"`
}

// RoutingConstraints filters candidates by required taints and scales cost by preferred taints
// (selection-service.md §8, §9.3).
type RoutingConstraints struct {
	// RequiredTaints must all be carried by a worker to be eligible.
	RequiredTaints []string `json:"required_taints,omitempty"`
	// PreferredTaints scale cost by exp(−tanh(Σ weights carried)).
	PreferredTaints map[string]float32 `json:"preferred_taints,omitempty"`
}

// AffinityTarget is an exact-target preference: a worker and optionally one rank (§8 step 6).
type AffinityTarget struct {
	// WorkerID is the target worker.
	WorkerID uint64 `json:"worker_id"`
	// DPRank narrows to one rank when non-nil.
	DPRank *uint32 `json:"dp_rank,omitempty"`
}

// SelectRequest is the input of Select and SelectAndReserve (selection-service.md §7.1), shared by the
// HTTP API and the ext_proc server.
type SelectRequest struct {
	ModelName    string // "" means "default"
	RoutingGroup string // "" means "default"
	// SelectionID is the booking id (SelectAndReserve generates a UUIDv4 when empty) and, for Select,
	// the pending-selection cache key.
	SelectionID string
	// Prompt is the request prompt (§6).
	Prompt Prompt
	// Override is router_config_override (§9.5).
	Override *RouterConfigOverride
	// ExpectedOutputTokens is a policy input and booking metadata (tokens).
	ExpectedOutputTokens *uint32
	// PriorityJump is the queue ordering boost.
	PriorityJump float64
	// StrictPriority is the strict queue tier (larger first).
	StrictPriority uint32
	// Session is session_context (or a legacy session_id mapped to a context with only SessionID).
	Session *SessionContext
	// AffinityTarget is the exact-target preference (§8 step 6).
	AffinityTarget *AffinityTarget
	// PinnedWorker is the hard pin (§8 step 4).
	PinnedWorker *WorkerRank
	// AllowedWorkerIDs restricts candidates when AllowedSet is true; an empty list then allows none.
	AllowedWorkerIDs []uint64
	// AllowedSet marks allowed_worker_ids as present.
	AllowedSet bool
	// RoutingConstraints are the required and preferred taints.
	RoutingConstraints RoutingConstraints
	// Advisory selects from current state without queue admission and adds WorkerLoad (Select only).
	Advisory bool
	// PolicyClass is the x-dynamo-meta-policy-class family (queue admission).
	PolicyClass string
	// DoNotQueue turns a would-be queue wait into an overload error (epp.md §5.5).
	DoNotQueue bool
	// Fallbacks is how many unbooked alternative destinations (distinct workers, next-lowest cost) to
	// return beside the chosen one (epp.md §5.9: DYN_EPP_MAX_DESTINATIONS − 1).
	Fallbacks int
	// PrefillUnobserved marks a request whose caller will not see the engine's first token (the
	// ext_proc server sets it for a response that is not streamed): with
	// Config.EstimatePrefillCompletion the booking's prefill part is released when the worker has
	// most likely finished it, estimated from its measured prefill rate, instead of when the
	// response ends; and its late prefill signal does not train that rate. kvepp extension.
	PrefillUnobserved bool
}

// Overlap is the raw tiered overlap summary of the chosen worker, all values in matched tokens
// (selection-service.md §7.5). DP has an entry for every rank of the chosen worker, keyed by the rank
// in decimal.
type Overlap struct {
	// LongestMatched = max(GPU, CPU, Disk).
	LongestMatched uint64 `json:"longest_matched"`
	// GPU is the longest device match over the ranks.
	GPU uint64 `json:"gpu"`
	// DP is each rank's device match.
	DP map[string]uint64 `json:"dp"`
	// CPU is the longest device + host match.
	CPU uint64 `json:"cpu"`
	// Disk is the longest device + host + disk + external match.
	Disk uint64 `json:"disk"`
}

// WorkerLoad is the advisory select's projected load of the chosen rank (selection-service.md §7.6).
type WorkerLoad struct {
	// ActivePrefillTokens is the rank's pre-admission prefill load.
	ActivePrefillTokens uint64 `json:"active_prefill_tokens"`
	// PrefillTokenCapacity is max_num_batched_tokens, or 10,000,000.
	PrefillTokenCapacity uint64 `json:"prefill_token_capacity"`
	// TotalKVBlocks is omitted when unknown.
	TotalKVBlocks *uint64 `json:"total_kv_blocks,omitempty"`
	// PrefillBusy is omitted without a prefill busy threshold.
	PrefillBusy *bool `json:"prefill_busy,omitempty"`
}

// KVHint is the kv_hint envelope attached to bookings (selection-service.md §7.7).
type KVHint struct {
	// ProtocolVersion is "0.1".
	ProtocolVersion string `json:"protocol_version"`
	// MessageID is the selection id.
	MessageID string `json:"message_id"`
	// Actions holds one kv.fetch action.
	Actions []KVHintAction `json:"actions"`
}

// KVHintAction is one action of a KVHint.
type KVHintAction struct {
	// ActionID is "a1".
	ActionID string `json:"action_id"`
	// ActionType is "kv.fetch".
	ActionType string `json:"action_type"`
	// ActionVersion is "1.0".
	ActionVersion string `json:"action_version"`
	// Payload says where and what to fetch.
	Payload KVFetchAction `json:"payload"`
}

// KVFetchAction is the payload of a kv.fetch action: where to fetch and the source's external block
// hashes for request blocks 0..n-1 (emitted as unsigned decimal).
type KVFetchAction struct {
	// SourceControlEndpoint is the source rank's control endpoint.
	SourceControlEndpoint string `json:"source_control_endpoint"`
	// BlockHashes are the source's external hashes of request blocks 0..n-1.
	BlockHashes []uint64 `json:"block_hashes"`
}

// Selection is the result of Select and SelectAndReserve (selection-service.md §7.4). Booking-only
// fields (SequenceHashes, ISLTokens, TrackPrefillTokens, KVHint) are set by SelectAndReserve; the HTTP
// layer decides which fields each route emits.
type Selection struct {
	// SelectionID is the booking id (Select: as supplied).
	SelectionID string
	// ModelName is the partition model.
	ModelName string
	// RoutingGroup is the partition group.
	RoutingGroup string
	// WorkerID is the chosen worker.
	WorkerID uint64
	// DPRank is the chosen global rank.
	DPRank uint32
	// Endpoint is the endpoint serving the chosen rank (WorkerRecord.RankEndpoint).
	Endpoint string
	// BlockSize is the partition block size in tokens.
	BlockSize uint32
	// Overlap is the raw tier summary in tokens (§7.5).
	Overlap Overlap
	// EffectivePrefillTokens is the booked prefill value (§9.1).
	EffectivePrefillTokens uint64
	// PotentialDecodeBlocks is decode_cost_blocks plus the partial tail block (§10.4).
	PotentialDecodeBlocks uint64
	// DecodeBusy is nil without a threshold or total_kv_blocks.
	DecodeBusy *bool
	// WorkerLoad is set by advisory selects.
	WorkerLoad *WorkerLoad
	// KVHint is set on bookings when §7.7 allows.
	KVHint *KVHint
	// Booked marks a SelectAndReserve result: the reservation SelectionID is live and must be freed.
	Booked bool
	// SequenceHashes are the booked tracking hashes.
	SequenceHashes []uint64
	// ISLTokens is the normalised input length.
	ISLTokens uint64
	// TrackPrefillTokens reports whether prefill was booked.
	TrackPrefillTokens bool
	// Cost is the chosen candidate's cost (observability only).
	Cost float64
	// Fallbacks are the next-lowest-cost candidates on distinct workers, in cost order, when the
	// request asked for them (epp.md §5.9); they are not booked.
	Fallbacks []Fallback
}

// Fallback is an unbooked alternative destination.
type Fallback struct {
	// WorkerID is the alternative worker.
	WorkerID uint64
	// DPRank is its rank.
	DPRank uint32
	// Endpoint is the endpoint serving that rank (WorkerRecord.RankEndpoint).
	Endpoint string
}
