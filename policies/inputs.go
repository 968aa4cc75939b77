package policies

import (
	"fmt"
	"strings"
)

// WorkerInputs is a set of optional per-candidate input groups (selection-service.md §17.3). A
// component declares the groups it reads through RequiredWorkerInputs; the host computes a group
// only when some component declares it and shows each component only the groups it declared.
// Combine groups with |, e.g. InputsCache | InputsLoad.
type WorkerInputs uint8

const (
	// InputsNone declares no optional group (upstream WorkerInputs::NONE).
	InputsNone WorkerInputs = 0
	// InputsCache is the CACHE group: raw tiered prefix overlap in blocks (CacheInputs).
	InputsCache WorkerInputs = 1 << 0
	// InputsLoad is the LOAD group: active prefill tokens, decode cost blocks, active requests (LoadInputs).
	InputsLoad WorkerInputs = 1 << 1
	// InputsRouting is the ROUTING group: the preferred-taint cost multiplier (RoutingInputs).
	InputsRouting WorkerInputs = 1 << 2
	// InputsAll is every group.
	InputsAll = InputsCache | InputsLoad | InputsRouting
)

// Has reports whether every group in g is in w.
func (w WorkerInputs) Has(g WorkerInputs) bool { return w&g == g }

// String renders the set as "NONE" or the group names joined by "|", e.g. "CACHE|LOAD".
func (w WorkerInputs) String() string {
	if w == InputsNone {
		return "NONE"
	}
	var parts []string
	for _, g := range []struct {
		bit  WorkerInputs
		name string
	}{{InputsCache, "CACHE"}, {InputsLoad, "LOAD"}, {InputsRouting, "ROUTING"}} {
		if w&g.bit != 0 {
			parts = append(parts, g.name)
		}
	}
	if rest := w &^ InputsAll; rest != 0 {
		parts = append(parts, fmt.Sprintf("0x%x", uint8(rest)))
	}
	return strings.Join(parts, "|")
}

// Worker is a candidate's identity: one (worker_id, dp_rank) pair.
type Worker struct {
	WorkerID uint64 // worker_id
	DPRank   uint32 // global data-parallel rank
}

// String renders the worker as "worker W dp_rank R".
func (w Worker) String() string { return fmt.Sprintf("worker %d dp_rank %d", w.WorkerID, w.DPRank) }

// CacheInputs is the CACHE group for one candidate: raw tier counts in blocks from the prefix
// index (selection-service.md §17.3). A missing tier or worker is 0; the weighted estimate of §9.1
// is never substituted.
type CacheInputs struct {
	device, host, disk, shared int
}

// NewCacheInputs builds the CACHE group (host side): deviceBlocks is the device-resident prefix,
// hostExtBlocks the host-pinned extension beyond it, diskExtBlocks the disk (+ external) extension
// beyond that, sharedBeyondDeviceBlocks the shared-cache hits beyond the device prefix (always 0 in
// kvepp). All in blocks.
func NewCacheInputs(deviceBlocks, hostExtBlocks, diskExtBlocks, sharedBeyondDeviceBlocks int) CacheInputs {
	return CacheInputs{device: deviceBlocks, host: hostExtBlocks, disk: diskExtBlocks, shared: sharedBeyondDeviceBlocks}
}

// DeviceOverlapBlocks is the device-resident prefix overlap in blocks.
func (c *CacheInputs) DeviceOverlapBlocks() int { return c.device }

// HostOverlapBlocks is the host-pinned extension beyond the device prefix, in blocks.
func (c *CacheInputs) HostOverlapBlocks() int { return c.host }

// DiskOverlapBlocks is the disk (+ external) extension beyond the host prefix, in blocks.
func (c *CacheInputs) DiskOverlapBlocks() int { return c.disk }

// SharedBeyondDeviceBlocks is the number of shared-cache hits beyond the device prefix, in blocks
// (always 0 in kvepp: no shared cache).
func (c *CacheInputs) SharedBeyondDeviceBlocks() int { return c.shared }

// LoadInputs is the LOAD group for one candidate (selection-service.md §10.3, §10.4, §17.3),
// with kvepp's engine extension (EngineLoad) when the host supplies it.
type LoadInputs struct {
	prefill, decode, requests int
	engine                    EngineLoad
}

// EngineLoad is kvepp's extension of the LOAD group: what the host measured about how the
// candidate's engine is doing, for policies that predict time to first token. The zero value
// means nothing is known.
type EngineLoad struct {
	// PrefillRequests is the number of live bookings whose prefill has not completed.
	PrefillRequests int
	// PrefillTokensPerSecond is the candidate's measured prefill rate: the prefill work requests
	// waited for (queued ahead of them plus their own, tokens) over the time from booking to
	// their first token, learned from the completions the host observed. 0 = not measured yet.
	PrefillTokensPerSecond float64
	// PrefillRateSamples is the number of observed completions behind PrefillTokensPerSecond.
	PrefillRateSamples int
	// PoolPrefillTokensPerSecond is the same estimate pooled over every worker of the partition
	// (tokens/s; 0 = not measured yet): a steadier figure when workers are alike.
	PoolPrefillTokensPerSecond float64
	// PoolArrivalsPerSecond is how many requests per second the partition books (recent mean;
	// 0 = not measured yet), and PoolCandidates the number of candidates sharing them.
	PoolArrivalsPerSecond float64
	PoolCandidates        int
	// ActiveBlocks is the KV blocks the candidate's live bookings hold (0 when blocks are not
	// tracked).
	ActiveBlocks int
	// TotalKVBlocks is the candidate's KV cache capacity, blocks (the worker record's
	// total_kv_blocks); 0 = unknown.
	TotalKVBlocks int
}

// WithEngine returns l with the engine extension e (host side).
func (l LoadInputs) WithEngine(e EngineLoad) LoadInputs {
	l.engine = e
	return l
}

// Engine returns the engine extension (kvepp; read-only, valid as long as l); its zero value
// means the host measured nothing.
func (l *LoadInputs) Engine() *EngineLoad { return &l.engine }

// NewLoadInputs builds the LOAD group (host side): activePrefillTokens in tokens, decodeCostBlocks
// = active blocks + this request's additional blocks (§10.4), activeRequests = live bookings.
func NewLoadInputs(activePrefillTokens, decodeCostBlocks, activeRequests int) LoadInputs {
	return LoadInputs{prefill: activePrefillTokens, decode: decodeCostBlocks, requests: activeRequests}
}

// ActivePrefillTokens is the tokens currently active in the candidate's prefill stage.
func (l *LoadInputs) ActivePrefillTokens() int { return l.prefill }

// DecodeCostBlocks is decode_cost_blocks: active blocks plus this request's additional blocks.
func (l *LoadInputs) DecodeCostBlocks() int { return l.decode }

// ActiveRequests is the number of live bookings on the candidate.
func (l *LoadInputs) ActiveRequests() int { return l.requests }

// RoutingInputs is the ROUTING group for one candidate (selection-service.md §9.3, §17.3).
// The zero value has no multiplier.
type RoutingInputs struct {
	multiplier float64
	present    bool
}

// NewRoutingInputs builds the ROUTING group (host side). present is false when the request has no
// preferred taints or is pinned; multiplier is exp(−tanh(S)) otherwise.
func NewRoutingInputs(multiplier float64, present bool) RoutingInputs {
	if !present {
		return RoutingInputs{}
	}
	return RoutingInputs{multiplier: multiplier, present: true}
}

// PreferredTaintMultiplier returns the preferred-taint cost multiplier exp(−tanh(S)) in
// (0.368, 2.718) and true, or (0, false) when the request has no preferred taints or is pinned.
func (r *RoutingInputs) PreferredTaintMultiplier() (float64, bool) { return r.multiplier, r.present }

// WorkerCandidate is what a filter or scorer sees for one candidate: its identity and the
// optional groups the calling component declared (others are nil). The host reuses one
// WorkerCandidate for every call, so a component must not retain the pointer (or the group
// pointers) after Keep or Score returns; each call gets a fresh copy of the group values, so
// modifying them affects nothing else.
type WorkerCandidate struct {
	worker  Worker
	mask    WorkerInputs
	cache   CacheInputs
	load    LoadInputs
	routing RoutingInputs
}

// NewWorkerCandidate builds a candidate exposing the groups in mask, for hosts other than Select
// and for unit-testing components.
func NewWorkerCandidate(w Worker, mask WorkerInputs, cache CacheInputs, load LoadInputs, routing RoutingInputs) *WorkerCandidate {
	return &WorkerCandidate{worker: w, mask: mask & InputsAll, cache: cache, load: load, routing: routing}
}

// Worker returns the candidate's (worker_id, dp_rank).
func (c *WorkerCandidate) Worker() Worker { return c.worker }

// Cache returns the CACHE group, or nil unless the calling component declared InputsCache.
func (c *WorkerCandidate) Cache() *CacheInputs {
	if c.mask&InputsCache == 0 {
		return nil
	}
	return &c.cache
}

// Load returns the LOAD group, or nil unless the calling component declared InputsLoad.
func (c *WorkerCandidate) Load() *LoadInputs {
	if c.mask&InputsLoad == 0 {
		return nil
	}
	return &c.load
}

// Routing returns the ROUTING group, or nil unless the calling component declared InputsRouting.
func (c *WorkerCandidate) Routing() *RoutingInputs {
	if c.mask&InputsRouting == 0 {
		return nil
	}
	return &c.routing
}

// ScoredWorkerCandidate is one picker row: a candidate and its total cost (the sum of every
// scorer's contribution; 0 when the policy has no scorers).
type ScoredWorkerCandidate struct {
	worker Worker
	cost   float64
}

// NewScoredWorkerCandidate builds a picker row (host side and tests).
func NewScoredWorkerCandidate(w Worker, cost float64) ScoredWorkerCandidate {
	return ScoredWorkerCandidate{worker: w, cost: cost}
}

// Worker returns the row's (worker_id, dp_rank).
func (s ScoredWorkerCandidate) Worker() Worker { return s.worker }

// Cost returns the row's summed scorer cost (lower is better by convention).
func (s ScoredWorkerCandidate) Cost() float64 { return s.cost }

// WorkerInputView is what the picker sees: every remaining candidate with its cost, and
// index-aligned columns of the groups the picker declared (selection-service.md §17.3). Rows are
// numbered 0..Len()-1 in Candidates() order. The view is valid only during Pick.
type WorkerInputView struct {
	candidates []ScoredWorkerCandidate
	rows       []int32 // row → index into the columns; nil means identity
	cache      []CacheInputs
	load       []LoadInputs
	routing    []RoutingInputs
	mask       WorkerInputs
}

// NewWorkerInputView builds a view over candidates exposing the groups in mask (host side and
// tests). Every column of a group in mask must have len(candidates) entries, index-aligned with
// candidates; columns of groups outside mask are ignored. Errors name the mismatched column.
func NewWorkerInputView(candidates []ScoredWorkerCandidate, mask WorkerInputs, cache []CacheInputs, load []LoadInputs, routing []RoutingInputs) (*WorkerInputView, error) {
	mask &= InputsAll
	n := len(candidates)
	if mask&InputsCache != 0 && len(cache) != n {
		return nil, fmt.Errorf("worker input view: cache column has %d rows, want %d", len(cache), n)
	}
	if mask&InputsLoad != 0 && len(load) != n {
		return nil, fmt.Errorf("worker input view: load column has %d rows, want %d", len(load), n)
	}
	if mask&InputsRouting != 0 && len(routing) != n {
		return nil, fmt.Errorf("worker input view: routing column has %d rows, want %d", len(routing), n)
	}
	return &WorkerInputView{candidates: candidates, cache: cache, load: load, routing: routing, mask: mask}, nil
}

// Len returns the number of rows.
func (v *WorkerInputView) Len() int { return len(v.candidates) }

// Candidates returns the rows (read-only; owned by the host).
func (v *WorkerInputView) Candidates() []ScoredWorkerCandidate { return v.candidates }

func (v *WorkerInputView) index(row int) (int, bool) {
	if row < 0 || row >= len(v.candidates) {
		return 0, false
	}
	if v.rows == nil {
		return row, true
	}
	return int(v.rows[row]), true
}

// Cache returns row's CACHE group, or nil if the picker did not declare InputsCache or row is out
// of range.
func (v *WorkerInputView) Cache(row int) *CacheInputs {
	i, ok := v.index(row)
	if !ok || v.mask&InputsCache == 0 {
		return nil
	}
	return &v.cache[i]
}

// Load returns row's LOAD group, or nil if the picker did not declare InputsLoad or row is out of
// range.
func (v *WorkerInputView) Load(row int) *LoadInputs {
	i, ok := v.index(row)
	if !ok || v.mask&InputsLoad == 0 {
		return nil
	}
	return &v.load[i]
}

// Routing returns row's ROUTING group, or nil if the picker did not declare InputsRouting or row
// is out of range.
func (v *WorkerInputView) Routing(row int) *RoutingInputs {
	i, ok := v.index(row)
	if !ok || v.mask&InputsRouting == 0 {
		return nil
	}
	return &v.routing[i]
}
