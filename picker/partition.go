package picker

import (
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/picker/queue"
	"github.com/kvepp/kvepp/policies"
)

// partition is one (model_name, routing_group) (selection-service.md §1, §3): its prefix index,
// its policy instance, its schedulable-worker view and the mutex that serializes selection and
// booking. The catalog (under Service.catalogMu) swaps views and indexes under mu, so a selection
// never observes a half-applied catalog update and no booking lands on a worker after the view
// that removed it was published.
type partition struct {
	key PartitionKey

	// mu serializes selection + booking (and the policy, which may hold unlocked state) and view
	// swaps.
	mu     sync.Mutex
	policy *policies.WorkerSelectionPolicy
	// builtin is the built-in policy instance for the pinned and exact-target paths (§8 steps 4,
	// 6); it is policy itself when no custom factory is configured.
	builtin *policies.WorkerSelectionPolicy
	rng     *rand.Rand
	sc      selScratch

	// view is the current immutable snapshot; written under mu, readable without it.
	view atomic.Pointer[partView]

	// members are the catalog's worker ids in this partition; guarded by Service.catalogMu.
	members     map[uint64]*workerEntry
	memberCount atomic.Int64

	// affinity is the session-affinity table (§12.1); nil when session affinity is off.
	affinity *ledger.AffinityTable

	// q is the partition's policy-class queue (§13), guarded by mu; nil when queueing is off or
	// no class of profile can queue (every admission is then immediate).
	q       *queue.Queue[*waiter]
	profile *queue.Profile
	// pendingCount and pendingISL mirror q's totals (requests, raw ISL tokens) for /loads and
	// the lock-free "anything queued?" check of lifecycle calls.
	pendingCount atomic.Uint64
	pendingISL   atomic.Uint64
}

// KVEventSourceStateAgentV2 is the kv_event_source_mode of a worker whose KV events come from a
// state agent: it can receive KV hints but is never a hint source (selection-service.md §4.1, §7.7).
const KVEventSourceStateAgentV2 = "state_agent_v2"

// prefixIndex is the lookup side shared by the event-driven index and the approximate index.
type prefixIndex interface {
	BlockSize() int
	FindMatches(localHashes []uint64, dst []kvindex.Match) []kvindex.Match
	ExternalHashes(c kvindex.Candidate, localHashes []uint64, n int) []uint64
	RemoveWorker(workerID uint64)
	Dump() []kvindex.DumpEvent
}

// partIndex is a partition's prefix index: event-driven (events, fed by the KVEventSource) or
// approximate (approx, fed by bookings, kv-events-index.md §15.1). lookup is whichever is set.
type partIndex struct {
	lookup prefixIndex
	events *kvindex.Index
	approx *kvindex.Approx
}

// clearRank drops one rank's rows: a Cleared event on the event-driven index; the approximate
// index has no per-rank removal, so the whole worker's approximate rows go (they are re-learnt
// from the next bookings).
func (ix *partIndex) clearRank(workerID uint64, rank uint32) {
	if ix.events != nil {
		_ = ix.events.Apply(kvindex.Event{WorkerID: workerID, DPRank: rank, Kind: kvindex.EventCleared})
		return
	}
	ix.approx.RemoveWorker(workerID)
}

// partView is an immutable snapshot of a partition's schedulable workers and its index.
type partView struct {
	index     *partIndex // nil until a worker with an accepted block_size joined
	blockSize uint32
	isEagle   bool

	workers []*schedWorker      // schedulable workers sorted by worker_id
	cands   []kvindex.Candidate // every rank of every schedulable worker, in worker order
	owner   []int32             // cands[i] belongs to workers[owner[i]]
	pos     map[kvindex.Candidate]int32
	byID    map[uint64]int32
}

// schedWorker is the selection-time view of one schedulable worker.
type schedWorker struct {
	id       uint64
	endpoint string
	// rankEndpoints are the per-rank endpoints (WorkerRecord.RankEndpoints; nil: every rank at
	// endpoint).
	rankEndpoints []string
	start         uint32
	size          uint32
	firstCand     int32
	taints        []string // sorted, deduplicated
	maxBatch      *uint64
	totalKV       *uint64
	// hintType is router_hint_worker_type ("" = cannot consume or serve KV hints, §7.7).
	hintType string
	// stateAgent marks kv_event_source_mode "state_agent_v2" (never a hint source).
	stateAgent bool
	// hintSources maps a global rank to router_hint_source_control_endpoints[rank].
	hintSources map[uint32]string
}

// endpointOf returns the endpoint serving global rank r.
func (w *schedWorker) endpointOf(r uint32) string {
	if r >= w.start && int(r-w.start) < len(w.rankEndpoints) {
		return w.rankEndpoints[r-w.start]
	}
	return w.endpoint
}

// hasRank reports whether rank r is in the worker's range.
func (w *schedWorker) hasRank(r uint32) bool { return r >= w.start && r-w.start < w.size }

func (w *schedWorker) hasTaint(t string) bool {
	_, ok := slices.BinarySearch(w.taints, t)
	return ok
}

// worker returns the schedulable worker with id, or nil.
func (v *partView) worker(id uint64) *schedWorker {
	if i, ok := v.byID[id]; ok {
		return v.workers[i]
	}
	return nil
}

// buildView makes a view from the partition's members (schedulable ones only), sorted by id.
func buildView(index *partIndex, bs uint32, eagle bool, members map[uint64]*workerEntry) *partView {
	v := &partView{index: index, blockSize: bs, isEagle: eagle, byID: make(map[uint64]int32)}
	ids := make([]uint64, 0, len(members))
	for id, e := range members {
		if e.state.Lifecycle == LifecycleSchedulable {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	n := 0
	for _, id := range ids {
		n += int(members[id].size)
	}
	v.cands = make([]kvindex.Candidate, 0, n)
	v.owner = make([]int32, 0, n)
	v.pos = make(map[kvindex.Candidate]int32, n)
	for _, id := range ids {
		e := members[id]
		w := &schedWorker{
			id:       id,
			endpoint: e.state.Endpoint,
			// Entries are immutable once published, so the view may share the slice.
			rankEndpoints: e.state.RankEndpoints,
			start:         e.start,
			size:          e.size,
			firstCand:     int32(len(v.cands)),
			maxBatch:      e.state.MaxNumBatchedTokens,
			totalKV:       e.state.TotalKVBlocks,

			hintType:   e.state.RouterHintWorkerType,
			stateAgent: e.state.KVEventSourceMode == KVEventSourceStateAgentV2,
		}
		for k, ep := range e.state.RouterHintSourceControlEndpoints {
			if r, err := strconv.ParseUint(k, 10, 32); err == nil && ep != "" {
				if w.hintSources == nil {
					w.hintSources = make(map[uint32]string, len(e.state.RouterHintSourceControlEndpoints))
				}
				w.hintSources[uint32(r)] = ep
			}
		}
		w.taints = slices.Compact(slices.Sorted(slices.Values(e.state.Taints)))
		wi := int32(len(v.workers))
		v.workers = append(v.workers, w)
		v.byID[id] = wi
		for r := uint32(0); r < e.size; r++ {
			c := kvindex.Candidate{WorkerID: id, DPRank: e.start + r}
			v.pos[c] = int32(len(v.cands))
			v.cands = append(v.cands, c)
			v.owner = append(v.owner, wi)
		}
	}
	return v
}
