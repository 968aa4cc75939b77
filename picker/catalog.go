package picker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/picker/queue"
	"github.com/kvepp/kvepp/policies"
)

// WorkerTypeSelect is the worker type every policy factory receives in this service
// (selection-service.md §17.4, acceptance 35).
const WorkerTypeSelect = "select"

// workerEntry is the catalog's state of one worker. Entries are immutable once published (readers
// take them under Service.mu.RLock); every change installs a new entry.
type workerEntry struct {
	state WorkerState
	key   PartitionKey
	start uint32 // first global dp_rank
	size  uint32 // number of ranks (valid only when the record's size is acceptable)
	// events is the KV event endpoint per global rank (KV events on, schedulable only).
	events map[uint32]string
	replay string
	// attached reports that the event source holds listeners for this worker.
	attached bool
	// bsAccepted reports that block_size > 0 and it (with is_eagle) matched the partition: the
	// worker defines the partition's invariants.
	bsAccepted bool
	blockSize  uint32
}

// WorkerPatch is the body of PATCH /workers/{worker_id} (selection-service.md §4.3): every
// WorkerRecord field except worker_id, all optional. Only non-nil fields overwrite; maps and
// slices replace wholesale (a non-nil empty value clears them). A patch cannot move a worker
// between partitions: ModelName and RoutingGroup may only repeat the worker's own ("" meaning
// "default"), as a client sending the whole record does.
type WorkerPatch struct {
	// ModelName, when non-nil, must equal the worker's model_name (else 400).
	ModelName *string `json:"model_name,omitempty"`
	// RoutingGroup, when non-nil, must equal the worker's routing_group (else 400).
	RoutingGroup *string `json:"routing_group,omitempty"`
	// Endpoint is the URL callers contact, e.g. http://worker:8000. Nil leaves it unchanged.
	Endpoint *string `json:"endpoint,omitempty"`
	// BlockSize is the KV block size in tokens (> 0, equal across the partition). Nil leaves it unchanged.
	BlockSize *uint32 `json:"block_size,omitempty"`
	// DataParallelStartRank is the first global dp_rank (default 0). Nil leaves it unchanged.
	DataParallelStartRank *uint32 `json:"data_parallel_start_rank,omitempty"`
	// DataParallelSize is the number of ranks (default 1, > 0). Nil leaves it unchanged.
	DataParallelSize *uint32 `json:"data_parallel_size,omitempty"`
	// KVEventsEndpoints maps a global rank (decimal) to its ZMQ PUB endpoint. Nil leaves it unchanged.
	KVEventsEndpoints map[string]string `json:"kv_events_endpoints,omitempty"`
	// KVEventsEndpoint is the single-rank shorthand (data_parallel_size 1, empty map). Nil leaves it unchanged.
	KVEventsEndpoint *string `json:"kv_events_endpoint,omitempty"`
	// ReplayEndpoint is the ZMQ ROUTER for gap replay (data_parallel_size 1 only). Nil leaves it unchanged.
	ReplayEndpoint *string `json:"replay_endpoint,omitempty"`
	// MaxNumBatchedTokens is the prefill capacity in tokens (required while queueing). Nil leaves it unchanged.
	MaxNumBatchedTokens *uint64 `json:"max_num_batched_tokens,omitempty"`
	// TotalKVBlocks is the decode capacity in blocks (enables decode_busy). Nil leaves it unchanged.
	TotalKVBlocks *uint64 `json:"total_kv_blocks,omitempty"`
	// IsEagle selects eagle hashing (equal across the partition). Nil leaves it unchanged.
	IsEagle *bool `json:"is_eagle,omitempty"`
	// Taints are matched by routing_constraints. Nil leaves it unchanged.
	Taints []string `json:"taints,omitempty"`
	// StableRoutingID is stored and echoed only. Nil leaves it unchanged.
	StableRoutingID *string `json:"stable_routing_id,omitempty"`
	// TopologyDomains is stored and echoed only. Nil leaves it unchanged.
	TopologyDomains map[string]string `json:"topology_domains,omitempty"`
	// KVTransferDomain is stored and echoed only. Nil leaves it unchanged.
	KVTransferDomain *string `json:"kv_transfer_domain,omitempty"`
	// KVTransferEnforcement is stored and echoed only. Nil leaves it unchanged.
	KVTransferEnforcement *string `json:"kv_transfer_enforcement,omitempty"`
	// KVTransferPreferredWeight is stored and echoed only. Nil leaves it unchanged.
	KVTransferPreferredWeight *float32 `json:"kv_transfer_preferred_weight,omitempty"`
	// RouterHintWorkerType marks a worker that can consume KV hints (§7.7). Nil leaves it unchanged.
	RouterHintWorkerType *string `json:"router_hint_worker_type,omitempty"`
	// RouterHintSourceControlEndpoints maps a global rank to where hint targets fetch from this worker. Nil leaves it unchanged.
	RouterHintSourceControlEndpoints map[string]string `json:"router_hint_source_control_endpoints,omitempty"`
	// KVEventSourceMode "state_agent_v2" makes the worker a hint target only. Nil leaves it unchanged.
	KVEventSourceMode *string `json:"kv_event_source_mode,omitempty"`
}

// apply overwrites rec's fields with the supplied fields of p. A patch that changes the endpoint
// or the rank range drops the record's per-rank endpoints (WorkerRecord.RankEndpoints): they
// were the discovered ports of the old endpoint.
func (p *WorkerPatch) apply(rec *WorkerRecord) {
	if (p.Endpoint != nil && *p.Endpoint != rec.Endpoint) ||
		(p.DataParallelStartRank != nil && !equalPtr(p.DataParallelStartRank, rec.DataParallelStartRank)) ||
		(p.DataParallelSize != nil && !equalPtr(p.DataParallelSize, rec.DataParallelSize)) {
		rec.RankEndpoints = nil
	}
	setStr := func(dst *string, v *string) {
		if v != nil {
			*dst = *v
		}
	}
	setStr(&rec.Endpoint, p.Endpoint)
	if p.BlockSize != nil {
		rec.BlockSize = p.BlockSize
	}
	if p.DataParallelStartRank != nil {
		rec.DataParallelStartRank = p.DataParallelStartRank
	}
	if p.DataParallelSize != nil {
		rec.DataParallelSize = p.DataParallelSize
	}
	if p.KVEventsEndpoints != nil {
		rec.KVEventsEndpoints = p.KVEventsEndpoints
	}
	setStr(&rec.KVEventsEndpoint, p.KVEventsEndpoint)
	setStr(&rec.ReplayEndpoint, p.ReplayEndpoint)
	if p.MaxNumBatchedTokens != nil {
		rec.MaxNumBatchedTokens = p.MaxNumBatchedTokens
	}
	if p.TotalKVBlocks != nil {
		rec.TotalKVBlocks = p.TotalKVBlocks
	}
	if p.IsEagle != nil {
		rec.IsEagle = *p.IsEagle
	}
	if p.Taints != nil {
		rec.Taints = p.Taints
	}
	setStr(&rec.StableRoutingID, p.StableRoutingID)
	if p.TopologyDomains != nil {
		rec.TopologyDomains = p.TopologyDomains
	}
	setStr(&rec.KVTransferDomain, p.KVTransferDomain)
	setStr(&rec.KVTransferEnforcement, p.KVTransferEnforcement)
	if p.KVTransferPreferredWeight != nil {
		rec.KVTransferPreferredWeight = p.KVTransferPreferredWeight
	}
	setStr(&rec.RouterHintWorkerType, p.RouterHintWorkerType)
	if p.RouterHintSourceControlEndpoints != nil {
		rec.RouterHintSourceControlEndpoints = p.RouterHintSourceControlEndpoints
	}
	setStr(&rec.KVEventSourceMode, p.KVEventSourceMode)
}

// ReadyState is the body of GET /ready (selection-service.md §5): Ready is true iff the service is
// not shutting down and at least one worker is schedulable catalog-wide (and a candidate);
// SchedulableWorkers counts those workers (not ranks); Workers is the whole catalog sorted by
// worker_id.
type ReadyState struct {
	// Ready is the readiness verdict.
	Ready bool `json:"ready"`
	// SchedulableWorkers counts schedulable workers.
	SchedulableWorkers int `json:"schedulable_workers"`
	// Workers is the whole catalog by worker_id.
	Workers []WorkerState `json:"workers"`
}

// UpsertWorker registers or replaces the whole record of rec.WorkerID (selection-service.md §4.1,
// §4.2) and returns the stored record with its lifecycle ("schedulable" or "incomplete") and the
// exact not_schedulable_reasons of the §4.1 table. Missing metadata is not an error. Empty
// model_name / routing_group become "default". A changed partition drains the worker from the old
// one first (listeners detached, index rows dropped, live bookings released). With KV events on,
// a schedulable worker's listeners are (re)attached; the event source reconciles rank by rank so
// unchanged endpoints keep their index rows, while ranks that left the range are cleared. A
// failure becomes the reason "reconciliation failed: <error>" and leaves no listener of the worker.
// With the lru approximate cache policy, a schedulable worker's total_kv_blocks becomes the LRU
// capacity (blocks) of each of its ranks in the approximate index; ranks already above it are
// trimmed at once (kv-events-index.md §15.1).
//
// source records who registered the worker; a worker once owned by discovery stays owned by
// discovery (so discovery keeps reconciling it) even when the API updates it (epp.md §11.3).
//
// Errors: KindNotReady "selection service is shutting down"; KindBadRequest for a model_name or
// routing_group that ValidateName refuses and when the policy factory fails for a new partition;
// ctx's error (KindInternal) when ctx is already done.
func (s *Service) UpsertWorker(ctx context.Context, rec WorkerRecord, source Source) (WorkerState, error) {
	if s.shuttingDown.Load() {
		return WorkerState{}, errShuttingDown()
	}
	if err := ctx.Err(); err != nil {
		return WorkerState{}, &Error{Kind: KindInternal, Message: "worker update cancelled: " + err.Error(), Err: err}
	}
	if rec.ModelName == "" {
		rec.ModelName = DefaultPartitionName
	}
	if rec.RoutingGroup == "" {
		rec.RoutingGroup = DefaultPartitionName
	}
	if err := validatePartition(rec.ModelName, rec.RoutingGroup); err != nil {
		return WorkerState{}, err
	}
	if source == "" {
		source = SourceAPI
	}
	s.catalogMu.Lock()
	defer s.catalogMu.Unlock()
	return s.applyLocked(cloneRecord(rec), source)
}

// PatchWorker overwrites the supplied fields of an existing worker and re-evaluates it exactly as
// UpsertWorker does (selection-service.md §4.3); a patch cannot move partitions and keeps the
// record's source. Errors: KindNotFound "worker {id} not found"; KindNotReady while shutting down;
// KindBadRequest "PATCH cannot change model_name: …" (or routing_group) for a partition field that
// differs from the worker's.
func (s *Service) PatchWorker(ctx context.Context, workerID uint64, patch WorkerPatch) (WorkerState, error) {
	if s.shuttingDown.Load() {
		return WorkerState{}, errShuttingDown()
	}
	if err := ctx.Err(); err != nil {
		return WorkerState{}, &Error{Kind: KindInternal, Message: "worker update cancelled: " + err.Error(), Err: err}
	}
	s.catalogMu.Lock()
	defer s.catalogMu.Unlock()
	old := s.workers[workerID]
	if old == nil {
		return WorkerState{}, Errorf(KindNotFound, "worker %d not found", workerID)
	}
	for _, f := range [...]struct {
		name  string
		given *string
		have  string
	}{{"model_name", patch.ModelName, old.key.ModelName}, {"routing_group", patch.RoutingGroup, old.key.RoutingGroup}} {
		if f.given != nil && cmp.Or(*f.given, DefaultPartitionName) != f.have {
			return WorkerState{}, Errorf(KindBadRequest,
				"PATCH cannot change %s (%q → %q): a PATCH cannot move a worker between partitions (selection-service.md §4.3); register the whole record with POST /workers instead",
				f.name, excerpt.Of(f.have), excerpt.Of(*f.given))
		}
	}
	rec := cloneRecord(old.state.WorkerRecord)
	patch.apply(&rec)
	return s.applyLocked(cloneRecord(rec), old.state.Source)
}

// applyLocked is the upsert algorithm. Caller holds catalogMu.
func (s *Service) applyLocked(rec WorkerRecord, source Source) (WorkerState, error) {
	key := PartitionKey{ModelName: rec.ModelName, RoutingGroup: rec.RoutingGroup}
	old := s.workers[rec.WorkerID]
	if old != nil && old.state.Source == SourceDiscovery {
		source = SourceDiscovery
	}
	p, err := s.ensurePartition(key)
	if err != nil {
		return WorkerState{}, err
	}
	if old != nil && old.key != key {
		s.drainLocked(old, s.partition(old.key))
		old = nil
	}
	cur := p.view.Load()
	wasActive := old != nil && old.state.Lifecycle == LifecycleSchedulable

	rec.Taints = NormalizeTaints(rec.Taints)
	e := &workerEntry{key: key, replay: rec.ReplayEndpoint}
	reasons := s.staticReasons(&rec, e)

	// Partition invariants: block_size and is_eagle agree across the partition (§3).
	index, bs, eagle := cur.index, cur.blockSize, cur.isEagle
	indexChanged := false
	if rec.BlockSize != nil && *rec.BlockSize > 0 {
		e.blockSize = *rec.BlockSize
		ib, ie, defined := p.invariants(rec.WorkerID)
		switch {
		case defined && ib != *rec.BlockSize:
			reasons = append(reasons, fmt.Sprintf("reconciliation failed: worker %d block_size %d does not match partition %s block_size %d",
				rec.WorkerID, *rec.BlockSize, key, ib))
		case defined && ie != rec.IsEagle:
			reasons = append(reasons, fmt.Sprintf("reconciliation failed: worker %d is_eagle %t does not match partition %s is_eagle %t",
				rec.WorkerID, rec.IsEagle, key, ie))
		default:
			e.bsAccepted = true
			bs, eagle = *rec.BlockSize, rec.IsEagle
			if index == nil || index.lookup.BlockSize() != int(bs) {
				if index != nil {
					s.log.Warn().Str("partition", key.String()).Int("old_block_size", index.lookup.BlockSize()).
						Uint32("block_size", bs).Msg("partition block size changed; recreating its index")
				}
				index = s.newIndex(int(bs))
				indexChanged = true
			}
		}
	}
	hashingChanged := indexChanged || (old != nil && (old.blockSize != e.blockSize || old.state.IsEagle != rec.IsEagle))

	if wasActive && hashingChanged {
		// Rows and listeners use the old hashing parameters (or the old index): start over.
		if old.attached {
			s.events.DetachWorker(rec.WorkerID)
		}
		if cur.index != nil {
			cur.index.lookup.RemoveWorker(rec.WorkerID)
		}
		wasActive = false
	}
	nowActive := len(reasons) == 0
	if s.events != nil && nowActive {
		spec := WorkerEventSpec{
			WorkerID: rec.WorkerID, Partition: key, BlockSize: int(bs), IsEagle: eagle,
			DPStartRank: e.start, DPSize: e.size, Endpoints: e.events, ReplayEndpoint: e.replay,
		}
		if err := s.events.AttachWorker(spec, index.events); err != nil {
			reasons = append(reasons, "reconciliation failed: "+err.Error())
			nowActive = false
			s.events.DetachWorker(rec.WorkerID)
		} else {
			e.attached = true
		}
	}
	switch {
	case wasActive && !nowActive:
		if old.attached && !e.attached {
			s.events.DetachWorker(rec.WorkerID)
		}
		if cur.index != nil {
			cur.index.lookup.RemoveWorker(rec.WorkerID)
		}
	case wasActive && nowActive && s.events == nil:
		// Approximate rows of ranks that left the range go; bookings on ranks present in both
		// snapshots are kept (§4.2). With KV events the event source clears changed and departed
		// ranks itself, between stopping the old listener and starting the new one.
		for r := old.start; r-old.start < old.size; r++ {
			if r < e.start || r-e.start >= e.size {
				index.clearRank(rec.WorkerID, r)
				break // the approximate index drops the whole worker at once
			}
		}
	}
	if nowActive {
		// After the removals above (which drop the worker's capacity with its rows), so an
		// upsert or PATCH always leaves the current total_kv_blocks in force.
		s.setApproxCapacity(index, &rec)
	}
	e.state = WorkerState{WorkerRecord: rec, Source: source}
	if len(rec.RankEndpoints) > 0 {
		e.state.DPRankEndpoints = make(map[string]string, len(rec.RankEndpoints))
		for i, ep := range rec.RankEndpoints {
			e.state.DPRankEndpoints[strconv.FormatUint(uint64(e.start)+uint64(i), 10)] = ep
		}
	}
	if nowActive {
		e.state.Lifecycle = LifecycleSchedulable
	} else {
		e.state.Lifecycle = LifecycleIncomplete
		e.state.NotSchedulableReasons = reasons
	}
	s.commitLocked(p, e, index, bs, eagle)
	return s.outward(e.state), nil
}

// staticReasons computes the §4.1 reasons that depend only on the record and configuration, and
// fills e's rank range and per-rank event endpoints.
func (s *Service) staticReasons(rec *WorkerRecord, e *workerEntry) (reasons []string) {
	if rec.Endpoint == "" {
		reasons = append(reasons, "endpoint is required")
	} else if err := ValidateEndpoint(rec.Endpoint); err != nil {
		reasons = append(reasons, err.Error())
	}
	if rec.BlockSize == nil || *rec.BlockSize == 0 {
		reasons = append(reasons, "block_size must be greater than 0")
	}
	if rec.DataParallelStartRank != nil {
		e.start = *rec.DataParallelStartRank
	}
	size := uint32(1)
	if rec.DataParallelSize != nil {
		size = *rec.DataParallelSize
	}
	switch {
	case size == 0:
		reasons = append(reasons, "data_parallel_size must be greater than 0")
	case size > MaxDataParallelSize:
		reasons = append(reasons, fmt.Sprintf("data_parallel_size %d exceeds the limit of %d", size, MaxDataParallelSize))
	case uint64(e.start)+uint64(size) > 1<<32:
		reasons = append(reasons, fmt.Sprintf("data_parallel_start_rank %d + data_parallel_size %d exceeds the dp_rank range", e.start, size))
	default:
		e.size = size
	}
	sizeOK := e.size > 0
	if len(rec.RankEndpoints) > 0 {
		if sizeOK && len(rec.RankEndpoints) != int(e.size) {
			reasons = append(reasons, fmt.Sprintf("rank endpoints: %d given for data_parallel_size %d", len(rec.RankEndpoints), e.size))
		}
		for i, ep := range rec.RankEndpoints {
			if err := ValidateEndpoint(ep); err != nil {
				reasons = append(reasons, fmt.Sprintf("rank endpoint %d: %v", i, err))
			}
		}
	}
	reasons = append(reasons, badRankKeyReasons(rec.KVEventsEndpoints)...)
	if s.cfg.queueing() && rec.MaxNumBatchedTokens == nil {
		reasons = append(reasons, "max_num_batched_tokens is required while queueing is enabled")
	}
	if s.cfg.Router.UseKVEvents && sizeOK {
		e.events = make(map[uint32]string, e.size)
		if len(rec.KVEventsEndpoints) == 0 && e.size == 1 && rec.KVEventsEndpoint != "" {
			e.events[e.start] = rec.KVEventsEndpoint
		}
		for k, v := range rec.KVEventsEndpoints {
			r, err := strconv.ParseUint(k, 10, 32)
			if err != nil || v == "" || uint32(r) < e.start || uint32(r)-e.start >= e.size {
				continue
			}
			e.events[uint32(r)] = v
		}
		for r := e.start; r-e.start < e.size; r++ {
			if e.events[r] == "" {
				reasons = append(reasons, fmt.Sprintf("kv_events endpoint is required for dp_rank %d", r))
			}
		}
		if e.size > 1 && rec.ReplayEndpoint != "" {
			reasons = append(reasons, "replay_endpoint is supported only for data_parallel_size 1")
		}
	}
	return reasons
}

// ValidateEndpoint checks a worker endpoint (selection-service.md §4.1 "URL the caller contacts",
// e.g. http://worker:8000): an absolute http or https URL with a non-empty host, an optional port
// in 1..65535 (none means the scheme's default, so http://localhost is valid) and no surrounding
// whitespace. The error is the not_schedulable reason `endpoint "<endpoint>" is invalid: <why>`.
func ValidateEndpoint(endpoint string) error {
	why := endpointProblem(endpoint)
	if why == "" {
		return nil
	}
	return fmt.Errorf("endpoint %q is invalid: %s", excerpt.Of(endpoint), why)
}

// endpointProblem returns why endpoint is not a usable worker URL, or "".
func endpointProblem(endpoint string) string {
	if strings.TrimSpace(endpoint) != endpoint {
		return "it has leading or trailing whitespace"
	}
	if !strings.Contains(endpoint, "://") {
		return "missing scheme (want http://host[:port] or https://host[:port])"
	}
	u, err := url.Parse(endpoint)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // drop the "parse <url>:" prefix: the reason already names the endpoint
		}
		return "not a URL: " + err.Error()
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Sprintf("scheme %q is not http or https", u.Scheme)
	case u.Opaque != "" || u.Host == "":
		return "missing host (want " + u.Scheme + "://host[:port])"
	case u.Hostname() == "":
		return "empty host"
	}
	if strings.HasSuffix(u.Host, ":") {
		return "empty port (omit the colon for the scheme's default port)"
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.ParseUint(p, 10, 16); err != nil || n == 0 {
			return fmt.Sprintf("port %s is out of range 1..65535", p)
		}
	}
	return ""
}

// badRankKeyReasons returns one not_schedulable reason per kv_events_endpoints key that is not a
// global dp_rank (a decimal integer in 0..4294967295), in key order.
func badRankKeyReasons(endpoints map[string]string) []string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(endpoints)) {
		if _, err := strconv.ParseUint(k, 10, 32); err != nil {
			out = append(out, fmt.Sprintf("kv_events_endpoints key %q is not a dp_rank (want a decimal integer in 0..4294967295)", excerpt.Of(k)))
		}
	}
	return out
}

// NormalizeTaints returns taints as a set (§4.1 "set of string"): sorted, without duplicates. A
// nil or empty input is returned unchanged; the input slice is not modified.
func NormalizeTaints(taints []string) []string {
	if len(taints) == 0 {
		return taints
	}
	return slices.Compact(slices.Sorted(slices.Values(taints)))
}

// newIndex creates a partition index of block size bs: event-driven when KV events are on, else
// approximate with the configured TTL, size cap and cache policy (kv-events-index.md §15.1).
func (s *Service) newIndex(bs int) *partIndex {
	if s.cfg.Router.UseKVEvents {
		ix := kvindex.New(kvindex.Config{BlockSize: bs})
		return &partIndex{lookup: ix, events: ix}
	}
	policy := kvindex.ApproxTTL
	if s.approxLRU() {
		policy = kvindex.ApproxLRU
	}
	a := kvindex.NewApprox(kvindex.ApproxConfig{
		BlockSize:        bs,
		TTL:              time.Duration(s.cfg.Router.ApproxTTLSecs * float64(time.Second)),
		MaxTreeSize:      s.cfg.Router.MaxTreeSize,
		PruneTargetRatio: s.cfg.Router.PruneTargetRatio,
		Policy:           policy,
	})
	return &partIndex{lookup: a, approx: a}
}

// approxLRU reports whether approximate indexes bound each rank by total_kv_blocks (§15.1).
func (s *Service) approxLRU() bool {
	return !s.cfg.Router.UseKVEvents && s.cfg.Router.ApproximateCachePolicy == ApproxCachePolicyLRU
}

// setApproxCapacity gives every rank of rec's worker the LRU capacity total_kv_blocks (blocks) in
// index's approximate index, or no capacity (TTL and size cap only) when the record has none. A
// no-op unless the lru cache policy is configured. Caller holds catalogMu.
func (s *Service) setApproxCapacity(index *partIndex, rec *WorkerRecord) {
	if !s.approxLRU() || index == nil || index.approx == nil {
		return
	}
	blocks := 0
	if rec.TotalKVBlocks != nil {
		blocks = int(min(*rec.TotalKVBlocks, uint64(math.MaxInt)))
	}
	index.approx.SetWorkerCapacity(rec.WorkerID, blocks)
}

// invariants returns the partition's block_size and is_eagle as defined by its accepted members
// other than exclude; defined is false when there is none.
func (p *partition) invariants(exclude uint64) (bs uint32, eagle bool, defined bool) {
	for id, m := range p.members {
		if id != exclude && m.bsAccepted {
			return m.blockSize, m.state.IsEagle, true
		}
	}
	return 0, false, false
}

// commitLocked installs e in the catalog and its partition and publishes the partition's new view.
// Caller holds catalogMu.
func (s *Service) commitLocked(p *partition, e *workerEntry, index *partIndex, bs uint32, eagle bool) {
	id := e.state.WorkerID
	s.mu.Lock()
	prev := s.workers[id]
	s.workers[id] = e
	s.mu.Unlock()
	s.adjustSchedulable(prev, e)
	p.members[id] = e
	p.memberCount.Store(int64(len(p.members)))
	p.publish(index, bs, eagle)
	s.kick(p) // a worker added or updated may free capacity for queued requests (§13.3)
}

func (s *Service) adjustSchedulable(prev, next *workerEntry) {
	var d int64
	if prev != nil && prev.state.Lifecycle == LifecycleSchedulable {
		d--
	}
	if next != nil && next.state.Lifecycle == LifecycleSchedulable {
		d++
	}
	s.schedulable.Add(d)
}

// publish rebuilds and installs the partition view under the selection mutex, so no selection is
// between reading the old view and booking when the new one appears.
func (p *partition) publish(index *partIndex, bs uint32, eagle bool) {
	v := buildView(index, bs, eagle, p.members)
	p.mu.Lock()
	p.view.Store(v)
	p.mu.Unlock()
}

// drainLocked removes e from partition p: the view drops it, its listeners are detached, its index
// rows dropped and its live bookings released (§4.1 step 2, §4.4). Caller holds catalogMu.
func (s *Service) drainLocked(e *workerEntry, p *partition) {
	id := e.state.WorkerID
	delete(p.members, id)
	p.memberCount.Store(int64(len(p.members)))
	cur := p.view.Load()
	p.publish(cur.index, cur.blockSize, cur.isEagle)
	if e.attached {
		s.events.DetachWorker(id)
	}
	if cur.index != nil {
		cur.index.lookup.RemoveWorker(id)
	}
	released := s.ledger.FreeWorker(id)
	s.releaseLeases(released, true)
	s.kick(p)
	if len(released) > 0 {
		s.log.Info().Uint64("worker_id", id).Int("bookings", len(released)).Str("partition", p.key.String()).
			Msg("released the live bookings of a drained worker")
	}
	s.mu.Lock()
	if s.workers[id] == e {
		delete(s.workers, id)
	}
	s.mu.Unlock()
	s.adjustSchedulable(e, nil)
}

// DeleteWorker removes a worker (selection-service.md §4.4): it is marked draining and leaves the
// scheduler view, its listeners are detached and its index rows dropped, its live bookings are
// released, and it leaves the catalog. It returns the final record with lifecycle
// "unschedulable". Works during shutdown. Errors: KindNotFound "worker {id} not found".
func (s *Service) DeleteWorker(ctx context.Context, workerID uint64) (WorkerState, error) {
	_ = ctx // deletion always runs to completion once started: a half-deleted worker is worse
	s.catalogMu.Lock()
	defer s.catalogMu.Unlock()
	e := s.workers[workerID]
	if e == nil {
		return WorkerState{}, Errorf(KindNotFound, "worker %d not found", workerID)
	}
	p := s.partition(e.key)
	draining := *e
	draining.state = cloneState(e.state)
	draining.state.Lifecycle = LifecycleDraining
	draining.state.NotSchedulableReasons = nil
	s.mu.Lock()
	s.workers[workerID] = &draining
	s.mu.Unlock()
	s.adjustSchedulable(e, &draining)
	s.drainLocked(&draining, p)
	s.SetCandidate(workerID, true) // a later worker of this id starts as a candidate
	final := s.outward(draining.state)
	final.Lifecycle = LifecycleUnschedulable
	return final, nil
}

// Workers returns the catalog records sorted by worker_id, filtered by model and group when they
// are non-empty (selection-service.md §4.5). Never errors.
func (s *Service) Workers(model, group string) []WorkerState {
	s.mu.RLock()
	out := make([]WorkerState, 0, len(s.workers))
	for _, e := range s.workers {
		if (model == "" || e.key.ModelName == model) && (group == "" || e.key.RoutingGroup == group) {
			out = append(out, s.outward(e.state))
		}
	}
	s.mu.RUnlock()
	slices.SortFunc(out, func(a, b WorkerState) int {
		switch {
		case a.WorkerID < b.WorkerID:
			return -1
		case a.WorkerID > b.WorkerID:
			return 1
		}
		return 0
	})
	return out
}

// Worker returns the catalog record of workerID.
func (s *Service) Worker(workerID uint64) (WorkerState, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	e := s.workers[workerID]
	if e == nil {
		return WorkerState{}, false
	}
	return s.outward(e.state), true
}

// Ready reports readiness (selection-service.md §5): a worker counts as schedulable when its
// lifecycle is schedulable and it is a candidate (SetCandidate: a pod that is not Ready is
// registered but cannot be picked, so it cannot make the service ready either).
func (s *Service) Ready() ReadyState {
	ws := s.Workers("", "")
	n := 0
	for _, w := range ws {
		if w.Lifecycle == LifecycleSchedulable && w.Candidate {
			n++
		}
	}
	return ReadyState{Ready: n > 0 && !s.shuttingDown.Load(), SchedulableWorkers: n, Workers: ws}
}

// ensurePartition returns the partition of key, creating it (with its policy instance built once
// by the factory for worker type "select") on first use. Errors: KindBadRequest when the factory
// fails (§4.1 "router policy configuration cannot be evaluated for the worker"). Caller holds
// catalogMu.
func (s *Service) ensurePartition(key PartitionKey) (*partition, error) {
	if p := s.partition(key); p != nil {
		return p, nil
	}
	pol, err := s.buildPolicy(key)
	if err != nil {
		return nil, &Error{Kind: KindBadRequest, Message: fmt.Sprintf("router policy configuration cannot be evaluated for partition %s: %v", key, err), Err: err}
	}
	builtin := pol
	if s.cfg.Policy != nil {
		if builtin, err = builtinFactory()(s.cfg.Router.PolicyConfig(), WorkerTypeSelect,
			policies.PartitionID{ModelName: key.ModelName, RoutingGroup: key.RoutingGroup}); err != nil {
			return nil, &Error{Kind: KindBadRequest, Message: fmt.Sprintf("built-in policy cannot be built for partition %s: %v", key, err), Err: err}
		}
	}
	p := &partition{
		key:     key,
		policy:  pol,
		builtin: builtin,
		rng:     rand.New(s.cfg.RandSource()),
		members: make(map[uint64]*workerEntry),
	}
	if s.cfg.SessionAffinityTTL > 0 {
		p.affinity = ledger.NewAffinityTable(ledger.AffinityConfig{
			TTL: s.cfg.SessionAffinityTTL, MaxEntries: s.cfg.SessionAffinityMaxEntries, WriterID: s.writerID,
		})
	}
	if s.cfg.queueing() {
		prof := s.cfg.PolicyProfiles.For(key.ModelName)
		if prof == nil {
			prof = queue.Synthetic(s.cfg.Router.QueueThreshold, s.cfg.queuePolicy())
		}
		if prof = prof.WithDefaultPolicy(s.cfg.queuePolicy()); prof.AnyQueues() {
			p.profile = prof
			p.q = queue.New[*waiter](prof, s.now())
		}
	}
	p.view.Store(buildView(nil, 0, false, nil))
	s.mu.Lock()
	s.partitions[key] = p
	s.byName[key.String()] = p
	s.mu.Unlock()
	return p, nil
}

// buildPolicy calls the factory, recovering a panic as an error.
func (s *Service) buildPolicy(key PartitionKey) (pol *policies.WorkerSelectionPolicy, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("policy factory panicked: %v", r)
		}
	}()
	pol, err = s.factory(s.cfg.Router.PolicyConfig(), WorkerTypeSelect,
		policies.PartitionID{ModelName: key.ModelName, RoutingGroup: key.RoutingGroup})
	if err == nil && pol == nil {
		err = fmt.Errorf("policy factory returned no policy")
	}
	return pol, err
}

func cloneRecord(r WorkerRecord) WorkerRecord {
	r.RankEndpoints = slices.Clone(r.RankEndpoints)
	r.KVEventsEndpoints = maps.Clone(r.KVEventsEndpoints)
	r.Taints = slices.Clone(r.Taints)
	r.TopologyDomains = maps.Clone(r.TopologyDomains)
	r.RouterHintSourceControlEndpoints = maps.Clone(r.RouterHintSourceControlEndpoints)
	r.BlockSize = clonePtr(r.BlockSize)
	r.DataParallelStartRank = clonePtr(r.DataParallelStartRank)
	r.DataParallelSize = clonePtr(r.DataParallelSize)
	r.MaxNumBatchedTokens = clonePtr(r.MaxNumBatchedTokens)
	r.TotalKVBlocks = clonePtr(r.TotalKVBlocks)
	r.KVTransferPreferredWeight = clonePtr(r.KVTransferPreferredWeight)
	return r
}

// outward is a copy of a catalog state as the service hands it out, with the worker's current
// candidacy (the withheld set is kept apart from the entries).
func (s *Service) outward(st WorkerState) WorkerState {
	st = cloneState(st)
	st.Candidate = s.IsCandidate(st.WorkerID)
	return st
}

func cloneState(st WorkerState) WorkerState {
	st.WorkerRecord = cloneRecord(st.WorkerRecord)
	st.NotSchedulableReasons = slices.Clone(st.NotSchedulableReasons)
	st.DPRankEndpoints = maps.Clone(st.DPRankEndpoints)
	return st
}

// equalPtr reports whether two optional values are both absent or equal.
func equalPtr[T comparable](a, b *T) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

func clonePtr[T any](p *T) *T {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}
