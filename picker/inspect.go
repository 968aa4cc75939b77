package picker

import (
	"cmp"
	"fmt"
	"math"
	"slices"

	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/ledger"
)

// InspectRequest is the body of POST /potential_loads and POST /overlap_scores
// (selection-service.md §14.2, §14.3): a partition, a prompt (§6) and an optional override.
type InspectRequest struct {
	ModelName    string // "" means "default"
	RoutingGroup string // "" means "default"
	// Prompt is the request's prompt in token or hash form (§6).
	Prompt Prompt
	// Override is the optional router_config_override (§9.5).
	Override *RouterConfigOverride
}

// inspection is a prompt's overlap with every candidate of a partition, computed from the
// immutable view without the partition's serialized context.
type inspection struct {
	key   PartitionKey
	v     *partView
	np    normPrompt
	eff   effective
	tiers []tierMatch // by view position
	// extra are matched index candidates that are not schedulable in the view.
	extra []kvindex.Match
}

// inspect validates an inspection request and matches its prompt: 503 shutting down or not
// ready, 422 bad override, 400 prompt errors.
func (s *Service) inspect(req *InspectRequest) (inspection, error) {
	if s.shuttingDown.Load() {
		return inspection{}, errShuttingDown()
	}
	in := inspection{key: PartitionKey{ModelName: req.ModelName, RoutingGroup: req.RoutingGroup}}
	if in.key.ModelName == "" {
		in.key.ModelName = DefaultPartitionName
	}
	if in.key.RoutingGroup == "" {
		in.key.RoutingGroup = DefaultPartitionName
	}
	if err := validatePartition(in.key.ModelName, in.key.RoutingGroup); err != nil {
		return in, err
	}
	var err error
	if in.eff, err = s.resolveOverride(req.Override); err != nil {
		return in, err
	}
	if err := validateHashForm(&req.Prompt); err != nil {
		return in, err
	}
	if err := s.readiness(in.key); err != nil {
		return in, err
	}
	in.v = s.partition(in.key).view.Load()
	if len(in.v.workers) == 0 {
		return in, s.notReady(in.key)
	}
	if in.np, err = normalizePrompt(&req.Prompt, in.v.blockSize, in.v.isEagle, in.eff.assumeReuse); err != nil {
		return in, err
	}
	in.tiers = make([]tierMatch, len(in.v.cands))
	if len(in.np.local) > 0 && in.v.index != nil {
		if in.v.index.approx != nil {
			in.v.index.approx.ExpireBefore(s.now())
		}
		for _, m := range in.v.index.lookup.FindMatches(in.np.local, nil) {
			if i, ok := in.v.pos[m.Candidate]; ok {
				in.tiers[i] = tierMatch{device: m.Device, host: m.HostExt, disk: m.DiskExt + m.ExternalExt}
			} else {
				in.extra = append(in.extra, m)
			}
		}
	}
	return in, nil
}

// PotentialLoads estimates every schedulable rank's load if the prompt were booked there,
// booking nothing (selection-service.md §14.2): potential_prefill_tokens = active prefill +
// effective_prefill_tokens(w) when prefill tracking is on (else active prefill),
// potential_decode_blocks = decode_cost_blocks(w) = active blocks + the prompt's blocks not live on
// w, active_requests. Rows are sorted by (worker_id, dp_rank). Errors: KindNotReady (shutdown,
// partition not ready), KindUnprocessable (override), KindBadRequest (prompt).
func (s *Service) PotentialLoads(req InspectRequest) ([]PotentialLoad, error) {
	in, err := s.inspect(&req)
	if err != nil {
		return nil, err
	}
	out := make([]PotentialLoad, len(in.v.cands))
	for i, c := range in.v.cands {
		ld, add := s.ledger.LoadAndAdditional(toLedger(c), in.np.seq)
		prefill := ld.ActivePrefillTokens
		if in.eff.track {
			prefill = satAdd(prefill, s.effectivePrefill(in.np.isl, in.tiers[i], in.v.blockSize))
		}
		out[i] = PotentialLoad{
			WorkerID: c.WorkerID, DPRank: c.DPRank,
			PotentialPrefillTokens: prefill,
			PotentialDecodeBlocks:  satAdd(ld.ActiveBlocks, uint64(add)),
			ActiveRequests:         ld.ActiveRequests,
		}
	}
	return out, nil
}

// OverlapScoreRow is one (worker, dp_rank) row of POST /overlap_scores (selection-service.md
// §14.3). Block counts are cumulative per tier: host_pinned = device + host extension, disk =
// host_pinned + disk extension (external included). SharedBeyondDeviceBlocks is always null (no
// shared cache). RouterCreditBlocks = credit × device + host_weight × host_ext + disk_weight ×
// disk_ext (the override's credit when given; no decay), in blocks, capped at the largest
// finite float64.
type OverlapScoreRow struct {
	// WorkerID is the worker.
	WorkerID uint64 `json:"worker_id"`
	// DPRank is the global rank.
	DPRank uint32 `json:"dp_rank"`
	// DeviceBlocks is the device-tier prefix match.
	DeviceBlocks uint64 `json:"device_blocks"`
	// HostPinnedBlocks = DeviceBlocks + HostPinnedExtensionBlocks.
	HostPinnedBlocks uint64 `json:"host_pinned_blocks"`
	// DiskBlocks = HostPinnedBlocks + DiskExtensionBlocks.
	DiskBlocks uint64 `json:"disk_blocks"`
	// HostPinnedExtensionBlocks continue the device prefix on the host tier.
	HostPinnedExtensionBlocks uint64 `json:"host_pinned_extension_blocks"`
	// DiskExtensionBlocks continue it on the disk and external tiers.
	DiskExtensionBlocks uint64 `json:"disk_extension_blocks"`
	// SharedBeyondDeviceBlocks is always nil (JSON null): no shared cache.
	SharedBeyondDeviceBlocks *uint64 `json:"shared_beyond_device_blocks"`
	// RouterCreditBlocks is the built-in overlap credit, in blocks.
	RouterCreditBlocks float64 `json:"router_credit_blocks"`
}

// SharedCacheStatus is the shared_cache block of POST /overlap_scores: shared caches are not
// supported, so always {"enabled":false,"total_hit_blocks":0,"ranges":[],"error":null}.
type SharedCacheStatus struct {
	// Enabled is always false.
	Enabled bool `json:"enabled"`
	// TotalHitBlocks is always 0.
	TotalHitBlocks uint64 `json:"total_hit_blocks"`
	// Ranges is always empty.
	Ranges [][2]uint64 `json:"ranges"`
	// Error is always null.
	Error *string `json:"error"`
}

// OverlapScores is the body of POST /overlap_scores (selection-service.md §14.3): the partition's
// block size (tokens), the prompt's number of full blocks looked up, and one row per schedulable
// (worker, dp_rank) plus any matched indexed candidate that is not schedulable, sorted by
// (worker_id, dp_rank); idle candidates have all-zero rows.
type OverlapScores struct {
	// BlockSize is the partition block size in tokens.
	BlockSize uint32 `json:"block_size"`
	// NumBlocks is the number of full prompt blocks looked up.
	NumBlocks int `json:"num_blocks"`
	// Workers are the rows sorted by (worker_id, dp_rank).
	Workers []OverlapScoreRow `json:"workers"`
	// SharedCache is always the disabled status.
	SharedCache SharedCacheStatus `json:"shared_cache"`
}

// OverlapScores reports the prompt's tiered overlap with every candidate (selection-service.md
// §14.3). Errors: as PotentialLoads.
func (s *Service) OverlapScores(req InspectRequest) (OverlapScores, error) {
	in, err := s.inspect(&req)
	if err != nil {
		return OverlapScores{}, err
	}
	credit := s.cfg.Router.OverlapScoreCredit
	if in.eff.credit != nil {
		credit = *in.eff.credit
	}
	hw, dw := s.cfg.Router.HostCacheHitWeight, s.cfg.Router.DiskCacheHitWeight
	row := func(c kvindex.Candidate, t tierMatch) OverlapScoreRow {
		dev, host, dsk := uint64(t.device), uint64(t.host), uint64(t.disk)
		return OverlapScoreRow{
			WorkerID: c.WorkerID, DPRank: c.DPRank,
			DeviceBlocks: dev, HostPinnedBlocks: dev + host, DiskBlocks: dev + host + dsk,
			HostPinnedExtensionBlocks: host, DiskExtensionBlocks: dsk,
			// An extreme (finite) override credit can overflow: report the largest finite value.
			RouterCreditBlocks: min(credit*float64(dev)+hw*float64(host)+dw*float64(dsk), math.MaxFloat64),
		}
	}
	out := OverlapScores{
		BlockSize:   in.v.blockSize,
		NumBlocks:   len(in.np.local),
		Workers:     make([]OverlapScoreRow, 0, len(in.v.cands)+len(in.extra)),
		SharedCache: SharedCacheStatus{Ranges: [][2]uint64{}},
	}
	for i, c := range in.v.cands {
		out.Workers = append(out.Workers, row(c, in.tiers[i]))
	}
	for _, m := range in.extra {
		out.Workers = append(out.Workers, row(m.Candidate, tierMatch{device: m.Device, host: m.HostExt, disk: m.DiskExt + m.ExternalExt}))
	}
	slices.SortFunc(out.Workers, func(a, b OverlapScoreRow) int {
		return cmp.Or(cmp.Compare(a.WorkerID, b.WorkerID), cmp.Compare(a.DPRank, b.DPRank))
	})
	return out, nil
}

// PartitionDump is one partition's entry of GET /dump (kv-events-index.md §14.3): its block size
// in tokens and its device-tier index snapshot as RouterEvents (never null).
type PartitionDump struct {
	// BlockSize is the partition block size in tokens.
	BlockSize int `json:"block_size"`
	// Events are the device-tier Stored events, breadth first.
	Events []kvindex.RouterEvent `json:"events"`
}

// Dump returns the index snapshot of every partition that has an index, keyed "model:group"
// (selection-service.md §14.4; the standalone-indexer recovery format of kv-events-index.md §14).
func (s *Service) Dump() map[string]PartitionDump {
	out := make(map[string]PartitionDump)
	for _, p := range s.partitionsSnapshot() {
		ix := p.view.Load().index
		if ix == nil {
			continue
		}
		evs := ix.lookup.Dump()
		if evs == nil {
			evs = []kvindex.RouterEvent{}
		}
		out[p.key.String()] = PartitionDump{BlockSize: ix.lookup.BlockSize(), Events: evs}
	}
	return out
}

// RestorePartition seeds partition key's index from a recovered /dump entry (selection-service.md
// §16 step 4): the partition is created if needed and, when it has no index yet (or one of
// another block size and no accepted worker), gets a fresh index of blockSize tokens; the events
// are then applied with the normal rules (approximate entries get a fresh TTL). A first worker
// registering a different block size later discards the recovered index. Errors: a name
// ValidateName refuses (a registration could not have made it), blockSize ≤ 0,
// a block size clash with the partition's workers, the policy factory failing, and the index's
// restore error (which reports how many events failed; the rest are applied).
func (s *Service) RestorePartition(key PartitionKey, blockSize int, events []kvindex.RouterEvent) error {
	index, err := s.prepareRestore(key, blockSize)
	if err != nil {
		return err
	}
	return s.restoreInto(index, events)
}

// prepareRestore validates a recovered partition and returns the index its events go into
// (restoreIndex).
func (s *Service) prepareRestore(key PartitionKey, blockSize int) (*partIndex, error) {
	if err := validatePartition(key.ModelName, key.RoutingGroup); err != nil {
		return nil, fmt.Errorf("restore %s: %w", excerpt.Of(key.String()), err)
	}
	if blockSize <= 0 {
		return nil, fmt.Errorf("restore %s: block_size must be greater than 0, got %d", key, blockSize)
	}
	return s.restoreIndex(key, blockSize)
}

// restoreInto applies recovered events to index. It runs outside the catalog lock so partitions
// restore in parallel; the index has its own lock, and a concurrent registration that replaces it
// only discards the restored rows.
func (s *Service) restoreInto(index *partIndex, events []kvindex.RouterEvent) error {
	if index.events != nil {
		return index.events.Restore(events)
	}
	return index.approx.Restore(events, s.now())
}

// restoreIndex returns the index RestorePartition fills, creating the partition and index.
func (s *Service) restoreIndex(key PartitionKey, blockSize int) (*partIndex, error) {
	s.catalogMu.Lock()
	defer s.catalogMu.Unlock()
	p, err := s.ensurePartition(key)
	if err != nil {
		return nil, fmt.Errorf("restore %s: %w", key, err)
	}
	cur := p.view.Load()
	index := cur.index
	if index == nil || index.lookup.BlockSize() != blockSize {
		if ib, _, defined := p.invariants(^uint64(0)); defined {
			return nil, fmt.Errorf("restore %s: dump block_size %d does not match the partition's block_size %d", key, blockSize, ib)
		}
		index = s.newIndex(blockSize)
		p.publish(index, cur.blockSize, cur.isEagle)
	}
	return index, nil
}

// toIndex converts a ledger candidate to the index's identical shape.
func toIndex(c ledger.Candidate) kvindex.Candidate { return kvindex.Candidate(c) }
