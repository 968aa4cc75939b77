package kvindex

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/bits"
	"slices"
	"strconv"
)

// RouterEvent is an Event with the RouterEvent JSON encoding of kv-events-index.md §10, as served
// by /dump (§14.3):
//
//	{"worker_id":1,"storage_tier":"device","event":{"event_id":0,"data":D,"dp_rank":0}}
//
// where D is {"stored":{"parent_hash":u64|null,"blocks":[{"block_hash":u64,"tokens_hash":u64}]}},
// {"removed":{"block_hashes":[u64]}} or "cleared". Hashes are unsigned decimal u64. Decoding
// defaults a missing storage_tier to "device" and ignores unknown fields (residency_domain,
// state_source, start_position, mm_extra_info, …). Convert with Event(re) / RouterEvent(ev).
type RouterEvent Event

// DumpEvent is the element type of Index.Dump: a RouterEvent.
type DumpEvent = RouterEvent

// MarshalJSON encodes the event in the §10 shape. An out-of-range tier or kind is an error.
func (re RouterEvent) MarshalJSON() ([]byte, error) {
	return re.appendJSON(make([]byte, 0, 160))
}

func (re RouterEvent) appendJSON(b []byte) ([]byte, error) {
	if re.Tier >= numTiers {
		return nil, fmt.Errorf("router event for %v: storage tier %d: %w", Event(re).Candidate(), uint8(re.Tier), ErrInvalidEvent)
	}
	b = append(b, `{"worker_id":`...)
	b = strconv.AppendUint(b, re.WorkerID, 10)
	b = append(b, `,"storage_tier":"`...)
	b = append(b, tierNames[re.Tier]...)
	b = append(b, `","event":{"event_id":`...)
	b = strconv.AppendUint(b, re.EventID, 10)
	b = append(b, `,"data":`...)
	switch re.Kind {
	case EventStored:
		b = append(b, `{"stored":{"parent_hash":`...)
		if re.HasParent {
			b = strconv.AppendUint(b, re.ParentHash, 10)
		} else {
			b = append(b, "null"...)
		}
		b = append(b, `,"blocks":[`...)
		for i, blk := range re.Blocks {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, `{"block_hash":`...)
			b = strconv.AppendUint(b, blk.BlockHash, 10)
			b = append(b, `,"tokens_hash":`...)
			b = strconv.AppendUint(b, blk.TokensHash, 10)
			b = append(b, '}')
		}
		b = append(b, "]}}"...)
	case EventRemoved:
		b = append(b, `{"removed":{"block_hashes":[`...)
		for i, h := range re.BlockHashes {
			if i > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendUint(b, h, 10)
		}
		b = append(b, "]}}"...)
	case EventCleared:
		b = append(b, `"cleared"`...)
	default:
		return nil, fmt.Errorf("router event for %v: kind %d: %w", Event(re).Candidate(), uint8(re.Kind), ErrInvalidEvent)
	}
	b = append(b, `,"dp_rank":`...)
	b = strconv.AppendUint(b, uint64(re.DPRank), 10)
	b = append(b, "}}"...)
	return b, nil
}

type jsonRouterEvent struct {
	WorkerID    uint64 `json:"worker_id"`
	StorageTier Tier   `json:"storage_tier"`
	Event       struct {
		EventID uint64          `json:"event_id"`
		DPRank  uint32          `json:"dp_rank"`
		Data    json.RawMessage `json:"data"`
	} `json:"event"`
}

type jsonStored struct {
	ParentHash *uint64 `json:"parent_hash"`
	Blocks     []struct {
		BlockHash  uint64 `json:"block_hash"`
		TokensHash uint64 `json:"tokens_hash"`
	} `json:"blocks"`
}

type jsonRemoved struct {
	BlockHashes []uint64 `json:"block_hashes"`
}

// UnmarshalJSON decodes the §10 shape. Hashes must be JSON integers in the u64 range; the data
// variant must be exactly one of stored, removed or "cleared"; otherwise an error names the
// problem.
func (re *RouterEvent) UnmarshalJSON(b []byte) error {
	var j jsonRouterEvent
	if err := json.Unmarshal(b, &j); err != nil {
		return fmt.Errorf("router event: %w", err)
	}
	ev := Event{WorkerID: j.WorkerID, DPRank: j.Event.DPRank, Tier: j.StorageTier, EventID: j.Event.EventID}
	data := bytes.TrimSpace(j.Event.Data)
	if len(data) == 0 || bytes.Equal(data, []byte("null")) {
		return fmt.Errorf("router event for worker %d: missing event.data", j.WorkerID)
	}
	if data[0] == '"' {
		var tag string
		if err := json.Unmarshal(data, &tag); err != nil {
			return fmt.Errorf("router event for worker %d: event.data: %w", j.WorkerID, err)
		}
		if tag != "cleared" {
			return fmt.Errorf("router event for worker %d: unknown event.data variant %q", j.WorkerID, tag)
		}
		ev.Kind = EventCleared
		*re = RouterEvent(ev)
		return nil
	}
	var variants map[string]json.RawMessage
	if err := json.Unmarshal(data, &variants); err != nil {
		return fmt.Errorf("router event for worker %d: event.data: %w", j.WorkerID, err)
	}
	if len(variants) != 1 {
		return fmt.Errorf("router event for worker %d: event.data must have exactly one variant, got %d", j.WorkerID, len(variants))
	}
	for tag, raw := range variants {
		switch tag {
		case "stored":
			var s jsonStored
			if err := json.Unmarshal(raw, &s); err != nil {
				return fmt.Errorf("router event for worker %d: stored: %w", j.WorkerID, err)
			}
			ev.Kind = EventStored
			if s.ParentHash != nil {
				ev.HasParent, ev.ParentHash = true, *s.ParentHash
			}
			ev.Blocks = make([]StoredBlock, len(s.Blocks))
			for i, blk := range s.Blocks {
				ev.Blocks[i] = StoredBlock{BlockHash: blk.BlockHash, TokensHash: blk.TokensHash}
			}
		case "removed":
			var r jsonRemoved
			if err := json.Unmarshal(raw, &r); err != nil {
				return fmt.Errorf("router event for worker %d: removed: %w", j.WorkerID, err)
			}
			ev.Kind = EventRemoved
			ev.BlockHashes = r.BlockHashes
		default:
			return fmt.Errorf("router event for worker %d: unknown event.data variant %q", j.WorkerID, tag)
		}
	}
	*re = RouterEvent(ev)
	return nil
}

// Dump returns the device tree as single-block Stored events (kv-events-index.md §14.1): a
// breadth-first walk from the root (children in tokens_hash order, candidates on a node in
// (worker, dp_rank) order) emitting, for each node and each candidate c on it, a device-tier
// event whose parent hash is c's external hash on the parent node (absent at the root) and whose
// block is {c's external hash, the edge's tokens_hash}; event_id counts from 0. Orphans — entries
// of a candidate missing from the parent or any other ancestor, which cannot match and could not
// be restored — are skipped, as are lower tiers. Applying the events in order to an empty
// index (Restore) reproduces every FindMatches device result.
func (ix *Index) Dump() []DumpEvent {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	nw := max(ix.nwords, 1)
	// Each queue item carries the slots present on every node from the root to it.
	type item struct {
		n   *node
		off int // rooted set in sets[off : off+nw]; the root's set is all slots
	}
	sets := make([]uint64, nw)
	for w := range sets {
		sets[w] = ^uint64(0)
	}
	queue := []item{{n: ix.root}}
	// Every emitted event is one device entry: size the output and the blocks' backing once.
	entries := ix.st.TierEntries[TierDevice]
	out := make([]DumpEvent, 0, entries)
	backing := make([]StoredBlock, 0, entries)
	var kids []*node
	var slotsHere []uint32
	for qi := 0; qi < len(queue); qi++ {
		it := queue[qi]
		kids = kids[:0]
		it.n.forEachChild(func(c *node) { kids = append(kids, c) })
		slices.SortFunc(kids, func(a, b *node) int { return cmpU64(a.key, b.key) })
		for _, c := range kids {
			off := len(sets)
			nonEmpty := false
			for w := 0; w < nw; w++ {
				v := sets[it.off+w] & c.word(w)
				sets = append(sets, v)
				nonEmpty = nonEmpty || v != 0
			}
			if !nonEmpty {
				sets = sets[:off]
				continue
			}
			slotsHere = slotsHere[:0]
			for w := 0; w < nw; w++ {
				for v := sets[off+w]; v != 0; v &= v - 1 {
					slotsHere = append(slotsHere, uint32(w*64+bits.TrailingZeros64(v)))
				}
			}
			slices.SortFunc(slotsHere, func(a, b uint32) int { return cmpCandidate(ix.slots[a].cand, ix.slots[b].cand) })
			for _, s := range slotsHere {
				cand := ix.slots[s].cand
				ext, _ := c.extOf(s)
				backing = append(backing, StoredBlock{BlockHash: ext, TokensHash: c.key})
				ev := DumpEvent{
					WorkerID: cand.WorkerID, DPRank: cand.DPRank, Tier: TierDevice,
					EventID: uint64(len(out)), Kind: EventStored,
					Blocks: backing[len(backing)-1 : len(backing) : len(backing)],
				}
				if it.n != ix.root {
					ev.HasParent = true
					ev.ParentHash, _ = it.n.extOf(s)
				}
				out = append(out, ev)
			}
			queue = append(queue, item{n: c, off: off})
		}
	}
	return out
}

// Restore applies dumped events in order with the normal rules (§14.2); applying to a non-empty
// index merges. Every event is attempted; the error, if any, reports how many failed and wraps the
// first failure.
func (ix *Index) Restore(events []RouterEvent) error {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	var first error
	failed := 0
	for _, re := range events {
		if err := ix.applyLocked(Event(re)); err != nil {
			failed++
			if first == nil {
				first = err
			}
		}
	}
	if first != nil {
		return fmt.Errorf("restore: %d of %d events failed, first: %w", failed, len(events), first)
	}
	return nil
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func cmpCandidate(a, b Candidate) int {
	if c := cmpU64(a.WorkerID, b.WorkerID); c != 0 {
		return c
	}
	return cmpU64(uint64(a.DPRank), uint64(b.DPRank))
}
