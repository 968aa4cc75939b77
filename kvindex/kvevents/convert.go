package kvevents

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/kvindex"
)

// DropReason classifies why an event was not turned into an index update
// (kv-events-index.md §7.3, §8, §9). Its String form is a stable snake_case label for metrics.
type DropReason uint8

// Event drop reasons, in the order the checks run.
const (
	// DropUnknownType: unknown tag or type (§7.3 rule 5).
	DropUnknownType DropReason = iota
	// DropInvalidEvent: not an array or map, too short, or a required field missing or of the
	// wrong type (§7.3 rule 4); also a BlockStored without blocks.
	DropInvalidEvent
	// DropTokenIDOutOfRange: a token id is negative or above 2^32−1 (§7.3 rule 4).
	DropTokenIDOutOfRange
	// DropRankOutOfRange: the batch's data_parallel_rank is outside the worker's registered
	// range [start, start+size) (§9 step 1).
	DropRankOutOfRange
	// DropUnknownMedium: the medium is not in the table of §8.1.
	DropUnknownMedium
	// DropNotLocal: locality is REMOTE or unknown (§8.2).
	DropNotLocal
	// DropGroupKind: the attention kind is not indexed (sliding window, mamba, other; §8.3).
	DropGroupKind
	// DropGroupMismatch: group_idx differs from the group learned for this (worker, rank) (§8.3).
	DropGroupMismatch
	// DropBlockSize: block_size differs from the worker's registered block size (§9 step 3).
	DropBlockSize
	// DropTokenCount: len(token_ids) ≠ len(block_hashes) × block_size (eagle: + 1) (§9 step 3).
	DropTokenCount
	// DropInvalidSequence: duplicate block hashes in one store, or a block hash equal to the
	// parent hash (§9 step 3).
	DropInvalidSequence

	// NumDropReasons is the number of DropReason values (array size for per-reason counters).
	NumDropReasons
)

var dropReasonNames = [NumDropReasons]string{
	"unknown_type", "invalid_event", "token_id_out_of_range", "dp_rank_out_of_range",
	"unknown_medium", "not_local", "non_indexed_group_kind", "group_idx_mismatch",
	"block_size_mismatch", "token_count_mismatch", "invalid_block_sequence",
}

// String returns the reason's metric label, e.g. "block_size_mismatch".
func (r DropReason) String() string {
	if r < NumDropReasons {
		return dropReasonNames[r]
	}
	return fmt.Sprintf("drop_reason(%d)", uint8(r))
}

// DropError reports one event of a batch that Convert dropped. Unwrap returns the underlying
// cause (for decoding failures an error wrapping ErrUnknownEventType, ErrInvalidEvent or
// ErrTokenIDOutOfRange).
type DropError struct {
	// Index is the event's position in Batch.Events.
	Index int
	// Type is the event's tag.
	Type string
	// Reason classifies the drop.
	Reason DropReason
	// Err describes it, naming the offending value.
	Err error
}

// Error renders "event 2 (BlockStored) dropped (block_size_mismatch): …".
func (e *DropError) Error() string {
	return fmt.Sprintf("event %d (%s) dropped (%s): %v", e.Index, e.Type, e.Reason, e.Err)
}

// Unwrap returns the cause.
func (e *DropError) Unwrap() error { return e.Err }

// defaultNamespaceLimit bounds the namespace memory of one Converter (entries over all ranks).
const defaultNamespaceLimit = 1 << 20

// maxBlockSizeWarnings is the number of block-size mismatch warnings logged per worker (§9).
const maxBlockSizeWarnings = 3

// workerNotes is per-worker logging state shared by the converters of all of a worker's ranks.
type workerNotes struct {
	blockSizeWarnings atomic.Int32
	loraIDLogged      atomic.Bool
	nsOverflowLogged  atomic.Bool
}

// nsEntry is the cache namespace recorded for one external block hash and the tiers holding it.
type nsEntry struct {
	ns    string
	tiers uint8
}

// Converter turns decoded batches of one (worker, registered dp_rank) listener into index
// events (kv-events-index.md §8, §9). It holds the per-(worker, rank) state the rules need: the
// learned attention group (§8.3) and the cache namespace recorded per external block hash for
// inheritance by child stores (§8.4). A Converter is not safe for concurrent use; a listener owns
// one and calls it from its goroutine.
type Converter struct {
	workerID  uint64
	rank      uint32
	rankStart uint32
	rankSize  uint32
	blockSize int
	eagle     bool
	log       zerolog.Logger
	notes     *workerNotes
	stats     *counters

	groups    map[uint32]int
	ns        map[uint32]map[uint64]nsEntry
	nsEntries int
	nsLimit   int

	mm     [][]uint64
	hashes []uint64
}

// NewConverter returns a converter for worker workerID whose listener is registered for dp_rank
// registeredRank, with the worker's registered block size in tokens and Eagle (bigram) hashing
// flag. The accepted rank range is [registeredRank, registeredRank+1) until SetRankRange widens
// it; logs are discarded until SetLogger.
func NewConverter(workerID uint64, registeredRank uint32, blockSize int, isEagle bool) *Converter {
	return &Converter{
		workerID:  workerID,
		rank:      registeredRank,
		rankStart: registeredRank,
		rankSize:  1,
		blockSize: blockSize,
		eagle:     isEagle,
		log:       zerolog.Nop(),
		notes:     &workerNotes{},
		groups:    make(map[uint32]int),
		ns:        make(map[uint32]map[uint64]nsEntry),
		nsLimit:   defaultNamespaceLimit,
	}
}

// SetRankRange sets the worker's registered dp_rank range [start, start+size); a batch whose
// data_parallel_rank falls outside it is dropped (§9 step 1).
func (c *Converter) SetRankRange(start, size uint32) {
	c.rankStart, c.rankSize = start, size
}

// SetLogger sets the logger for the converter's warnings (block-size mismatches, LoRA ids
// without names, namespace memory overflow). The converter adds only what the event says
// (batch_dp_rank, the event's block size, …): l should already carry worker_id and dp_rank, as a
// listener's logger does.
func (c *Converter) SetLogger(l zerolog.Logger) {
	c.log = l
}

// Convert appends to dst the index events of batch b received with sequence number seq and
// returns the extended slice, plus one *DropError per event that was dropped (nil when none).
// Event ids are seq (§9 step 6). The dp_rank of every event is the batch's data_parallel_rank
// when set, else the registered rank. Convert never fails as a whole.
func (c *Converter) Convert(b Batch, seq uint64, dst []kvindex.Event) ([]kvindex.Event, []error) {
	rank := c.rank
	if b.DPRank != nil {
		rank = *b.DPRank
	}
	inRange := rank >= c.rankStart && rank-c.rankStart < c.rankSize
	var errs []error
	drop := func(i int, ev *RawEvent, r DropReason, err error) {
		errs = append(errs, &DropError{Index: i, Type: ev.Type, Reason: r, Err: err})
	}
	for i := range b.Events {
		ev := &b.Events[i]
		if ev.Err != nil {
			drop(i, ev, decodeReason(ev.Err), ev.Err)
			continue
		}
		if !inRange {
			drop(i, ev, DropRankOutOfRange, fmt.Errorf("dp_rank %d outside worker %d's range [%d, %d)",
				rank, c.workerID, c.rankStart, c.rankStart+c.rankSize))
			continue
		}
		if ev.Type == TypeAllBlocksCleared {
			dst = append(dst, kvindex.Event{WorkerID: c.workerID, DPRank: rank, Tier: kvindex.TierDevice,
				EventID: seq, Kind: kvindex.EventCleared})
			c.forgetRank(rank)
			continue
		}
		tier, ok := MediumTier(ev.Medium)
		if !ok {
			drop(i, ev, DropUnknownMedium, fmt.Errorf("unknown medium %q", ev.Medium))
			continue
		}
		if ev.Locality != "" && !strings.EqualFold(ev.Locality, "LOCAL") {
			drop(i, ev, DropNotLocal, fmt.Errorf("locality %q", ev.Locality))
			continue
		}
		if r, err := c.checkGroup(rank, ev); err != nil {
			drop(i, ev, r, err)
			continue
		}
		switch ev.Type {
		case TypeBlockRemoved:
			if len(ev.BlockHashes) == 0 {
				continue
			}
			dst = append(dst, kvindex.Event{WorkerID: c.workerID, DPRank: rank, Tier: tier, EventID: seq,
				Kind: kvindex.EventRemoved, BlockHashes: append([]uint64(nil), ev.BlockHashes...)})
			c.forgetHashes(rank, ev.BlockHashes, tier)
		case TypeBlockStored:
			out, r, err := c.stored(rank, tier, seq, ev)
			if err != nil {
				drop(i, ev, r, err)
				continue
			}
			dst = append(dst, out)
		}
	}
	return dst, errs
}

// decodeReason maps a RawEvent.Err to its drop reason.
func decodeReason(err error) DropReason {
	switch {
	case errors.Is(err, ErrUnknownEventType):
		return DropUnknownType
	case errors.Is(err, ErrTokenIDOutOfRange):
		return DropTokenIDOutOfRange
	}
	return DropInvalidEvent
}

// MediumTier maps an event's medium to its storage tier (kv-events-index.md §8.1,
// case-insensitive): "" (nil), GPU, DEVICE → device; CPU, CPU_PINNED, CPU_TIER1 → host_pinned;
// CPU_TIER2, DISK, NVME, STORAGE → disk; EXTERNAL, NETWORK, REMOTE, SHARED → external. ok is
// false for any other medium (the event is dropped and counted).
func MediumTier(medium string) (tier kvindex.Tier, ok bool) {
	switch strings.ToUpper(medium) {
	case "", "GPU", "DEVICE":
		return kvindex.TierDevice, true
	case "CPU", "CPU_PINNED", "CPU_TIER1":
		return kvindex.TierHostPinned, true
	case "CPU_TIER2", "DISK", "NVME", "STORAGE":
		return kvindex.TierDisk, true
	case "EXTERNAL", "NETWORK", "REMOTE", "SHARED":
		return kvindex.TierExternal, true
	}
	return 0, false
}

// indexedKind reports whether an attention kind is indexed (§8.3); "" means full attention.
func indexedKind(kind string) bool {
	switch {
	case kind == "",
		strings.EqualFold(kind, "full_attention"),
		strings.EqualFold(kind, "mla_attention"),
		strings.EqualFold(kind, "sink_full_attention"):
		return true
	}
	return false
}

// checkGroup applies §8.3: skip non-indexed kinds, learn the first indexed group per rank, drop
// other groups.
func (c *Converter) checkGroup(rank uint32, ev *RawEvent) (DropReason, error) {
	if !indexedKind(ev.KVCacheSpecKind) {
		return DropGroupKind, fmt.Errorf("kv_cache_spec_kind %q (group_idx %d) is not indexed", ev.KVCacheSpecKind, ev.GroupIdx)
	}
	learned, ok := c.groups[rank]
	if !ok {
		c.groups[rank] = ev.GroupIdx
		return 0, nil
	}
	if ev.GroupIdx != learned {
		return DropGroupMismatch, fmt.Errorf("group_idx %d differs from the indexed group %d", ev.GroupIdx, learned)
	}
	return 0, nil
}

// stored validates and re-hashes one BlockStored event (§9 step 3).
func (c *Converter) stored(rank uint32, tier kvindex.Tier, seq uint64, ev *RawEvent) (kvindex.Event, DropReason, error) {
	n := len(ev.BlockHashes)
	if ev.BlockSize != c.blockSize {
		err := fmt.Errorf("worker %d dp_rank %d: block_size %d does not match registered block_size %d",
			c.workerID, rank, ev.BlockSize, c.blockSize)
		if c.notes.blockSizeWarnings.Add(1) <= maxBlockSizeWarnings {
			c.log.Warn().Uint32("batch_dp_rank", rank).Int("event_block_size", ev.BlockSize).
				Int("registered_block_size", c.blockSize).
				Msg("dropping KV events whose block_size differs from the registered one; routing for this worker sees no cache hits")
		}
		return kvindex.Event{}, DropBlockSize, err
	}
	if n == 0 {
		return kvindex.Event{}, DropInvalidEvent, fmt.Errorf("%w: BlockStored without blocks", ErrInvalidEvent)
	}
	want := n * c.blockSize
	if c.eagle {
		want++
	}
	if len(ev.TokenIDs) != want {
		return kvindex.Event{}, DropTokenCount, fmt.Errorf("%d token ids for %d blocks of %d tokens (eagle %t), want %d",
			len(ev.TokenIDs), n, c.blockSize, c.eagle, want)
	}
	if err := checkSequence(ev); err != nil {
		return kvindex.Event{}, DropInvalidSequence, err
	}

	lora := ev.LoraName
	if lora == "" && ev.LoraID != nil && !c.notes.loraIDLogged.Swap(true) {
		c.log.Info().Int64("lora_id", *ev.LoraID).
			Msg("KV event carries lora_id without lora_name; hashing its blocks as the base model")
	}
	ns := c.namespace(rank, ev)
	seed := kvindex.Seed(lora, ns)
	mm := c.blockMM(ev.ExtraKeys, n)
	var local []uint64
	if c.eagle {
		local = kvindex.EagleBlockHashes(ev.TokenIDs, c.blockSize, seed, mm)
	} else {
		c.hashes = kvindex.AppendBlockHashes(c.hashes[:0], ev.TokenIDs, c.blockSize, seed, mm)
		local = c.hashes
	}
	blocks := make([]kvindex.StoredBlock, n)
	for i := range blocks {
		blocks[i] = kvindex.StoredBlock{BlockHash: ev.BlockHashes[i], TokensHash: local[i]}
	}
	c.recordNamespace(rank, ev.BlockHashes, tier, ns)
	return kvindex.Event{WorkerID: c.workerID, DPRank: rank, Tier: tier, EventID: seq, Kind: kvindex.EventStored,
		HasParent: ev.HasParent, ParentHash: ev.ParentHash, Blocks: blocks}, 0, nil
}

// checkSequence rejects duplicate block hashes in one store and a block equal to its parent.
func checkSequence(ev *RawEvent) error {
	hs := ev.BlockHashes
	for i, h := range hs {
		if ev.HasParent && h == ev.ParentHash {
			return fmt.Errorf("block_hashes[%d] = %d equals the parent hash", i, h)
		}
	}
	if len(hs) <= 64 {
		for i := 1; i < len(hs); i++ {
			for j := 0; j < i; j++ {
				if hs[i] == hs[j] {
					return fmt.Errorf("block hash %d appears twice (positions %d and %d)", hs[i], j, i)
				}
			}
		}
		return nil
	}
	seen := make(map[uint64]int, len(hs))
	for i, h := range hs {
		if j, dup := seen[h]; dup {
			return fmt.Errorf("block hash %d appears twice (positions %d and %d)", h, j, i)
		}
		seen[h] = i
	}
	return nil
}

// cacheSaltPrefix marks a namespace entry in extra_keys (§8.4 rule 2).
const cacheSaltPrefix = "dynamo-cache-salt:"

// namespace resolves a store's cache namespace, first match wins (§8.4).
func (c *Converter) namespace(rank uint32, ev *RawEvent) string {
	if ev.CacheSalt != "" {
		return ev.CacheSalt
	}
	var first []any
	if len(ev.ExtraKeys) > 0 {
		first = ev.ExtraKeys[0]
	}
	for _, k := range first {
		if s, ok := k.(string); ok && strings.HasPrefix(s, cacheSaltPrefix) && len(s) > len(cacheSaltPrefix) {
			return s[len(cacheSaltPrefix):]
		}
	}
	for _, k := range first {
		if s, ok := k.(string); ok && s != "" && !isHex64(s) && s != ev.LoraName && !strings.HasPrefix(s, cacheSaltPrefix) {
			return s
		}
	}
	if ev.LoraMetaCacheSalt != "" {
		return ev.LoraMetaCacheSalt
	}
	if ev.HasParent {
		if e, ok := c.ns[rank][ev.ParentHash]; ok {
			return e.ns
		}
	}
	return ""
}

// blockMM returns the per-block multimodal hashes of §8.5 for n blocks, or nil when no block has
// any. The result aliases converter scratch space.
func (c *Converter) blockMM(extra [][]any, n int) [][]uint64 {
	if len(extra) == 0 {
		return nil
	}
	if len(extra) > n {
		extra = extra[:n]
	}
	c.mm = c.mm[:0]
	found := false
	for _, keys := range extra {
		var hs []uint64
		for _, k := range keys {
			switch v := k.(type) {
			case string:
				if isHex64(v) {
					hs = append(hs, kvindex.HashMMIdentifier(v))
				}
			case []any:
				if len(v) != 2 {
					continue
				}
				id, ok := v[0].(string)
				if !ok {
					continue
				}
				switch v[1].(type) {
				case int64, uint64:
					hs = append(hs, kvindex.HashMMIdentifier(id))
				}
			}
		}
		found = found || len(hs) > 0
		c.mm = append(c.mm, hs)
	}
	if !found {
		return nil
	}
	return c.mm
}

// isHex64 reports whether s is exactly 64 hexadecimal characters (a sha256 identifier).
func isHex64(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		ch := s[i]
		if !(ch >= '0' && ch <= '9' || ch >= 'a' && ch <= 'f' || ch >= 'A' && ch <= 'F') {
			return false
		}
	}
	return true
}

// recordNamespace remembers ns for the store's blocks in tier (§8.4: only non-empty namespaces
// are stored) and forgets a stale namespace of a reused hash.
func (c *Converter) recordNamespace(rank uint32, hashes []uint64, tier kvindex.Tier, ns string) {
	bit := uint8(1) << tier
	m := c.ns[rank]
	if ns == "" {
		if m != nil {
			c.forgetHashes(rank, hashes, tier)
		}
		return
	}
	if m == nil {
		m = make(map[uint64]nsEntry)
		c.ns[rank] = m
	}
	for _, h := range hashes {
		e, ok := m[h]
		switch {
		case ok && e.ns == ns:
			e.tiers |= bit
		case ok:
			e = nsEntry{ns: ns, tiers: bit}
		default:
			if c.nsEntries >= c.nsLimit {
				if c.stats != nil {
					c.stats.namespaceOverflow.Add(1)
				}
				if !c.notes.nsOverflowLogged.Swap(true) {
					c.log.Warn().Int("limit", c.nsLimit).
						Msg("cache-namespace memory full; child stores without their own namespace may hash without it")
				}
				continue
			}
			c.nsEntries++
			e = nsEntry{ns: ns, tiers: bit}
		}
		m[h] = e
	}
}

// forgetHashes drops tier from the namespace entries of hashes (a removal in that tier).
func (c *Converter) forgetHashes(rank uint32, hashes []uint64, tier kvindex.Tier) {
	m := c.ns[rank]
	if m == nil {
		return
	}
	bit := uint8(1) << tier
	for _, h := range hashes {
		e, ok := m[h]
		if !ok {
			continue
		}
		e.tiers &^= bit
		if e.tiers == 0 {
			delete(m, h)
			c.nsEntries--
			continue
		}
		m[h] = e
	}
}

// forgetRank drops all namespace memory of rank (after AllBlocksCleared or a publisher restart).
func (c *Converter) forgetRank(rank uint32) {
	c.nsEntries -= len(c.ns[rank])
	delete(c.ns, rank)
}
