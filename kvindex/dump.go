package kvindex

import (
	"bytes"
	"cmp"
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
// problem. Input in exactly the layout MarshalJSON writes (what /dump serves) is decoded by a
// direct scan, about 30 times faster; anything else goes through encoding/json.
func (re *RouterEvent) UnmarshalJSON(b []byte) error {
	if decodeCanonical(b, re) {
		return nil
	}
	return re.unmarshalGeneric(b)
}

// unmarshalGeneric is UnmarshalJSON through encoding/json, for any layout.
func (re *RouterEvent) unmarshalGeneric(b []byte) error {
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

// canonical is a byte scanner for decodeCanonical.
type canonical struct {
	b []byte
	i int
}

func (p *canonical) lit(s string) bool {
	if len(p.b)-p.i < len(s) || string(p.b[p.i:p.i+len(s)]) != s {
		return false
	}
	p.i += len(s)
	return true
}

// u64 scans a JSON unsigned integer (no sign, fraction, exponent or leading zero) in the u64 range.
func (p *canonical) u64() (uint64, bool) {
	start := p.i
	var v uint64
	for p.i < len(p.b) && p.b[p.i] >= '0' && p.b[p.i] <= '9' {
		d := uint64(p.b[p.i] - '0')
		if v > (^uint64(0)-d)/10 {
			return 0, false
		}
		v = v*10 + d
		p.i++
	}
	n := p.i - start
	if n == 0 || n > 1 && p.b[start] == '0' {
		return 0, false
	}
	if p.i < len(p.b) && (p.b[p.i] == '.' || p.b[p.i] == 'e' || p.b[p.i] == 'E') {
		return 0, false
	}
	return v, true
}

// decodeCanonical decodes b when it is exactly in the layout appendJSON writes (key order, no
// whitespace, unsigned decimal hashes); it reports false, leaving re alone, for anything else.
func decodeCanonical(b []byte, re *RouterEvent) bool {
	p := canonical{b: b}
	var ev Event
	var ok bool
	if !p.lit(`{"worker_id":`) {
		return false
	}
	if ev.WorkerID, ok = p.u64(); !ok || !p.lit(`,"storage_tier":"`) {
		return false
	}
	end := p.i
	for end < len(b) && b[end] != '"' {
		end++
	}
	tier := string(b[p.i:end])
	found := false
	for t, n := range tierNames {
		if tier == n {
			ev.Tier, found = Tier(t), true
		}
	}
	if p.i = end; !found || !p.lit(`","event":{"event_id":`) {
		return false
	}
	if ev.EventID, ok = p.u64(); !ok || !p.lit(`,"data":`) {
		return false
	}
	switch {
	case p.lit(`"cleared"`):
		ev.Kind = EventCleared
	case p.lit(`{"stored":{"parent_hash":`):
		ev.Kind = EventStored
		if !p.lit("null") {
			if ev.ParentHash, ok = p.u64(); !ok {
				return false
			}
			ev.HasParent = true
		}
		if !p.lit(`,"blocks":[`) {
			return false
		}
		ev.Blocks = []StoredBlock{}
		for !p.lit("]}}") {
			if len(ev.Blocks) > 0 && !p.lit(",") {
				return false
			}
			var blk StoredBlock
			if !p.lit(`{"block_hash":`) {
				return false
			}
			if blk.BlockHash, ok = p.u64(); !ok || !p.lit(`,"tokens_hash":`) {
				return false
			}
			if blk.TokensHash, ok = p.u64(); !ok || !p.lit("}") {
				return false
			}
			ev.Blocks = append(ev.Blocks, blk)
		}
	case p.lit(`{"removed":{"block_hashes":[`):
		ev.Kind = EventRemoved
		ev.BlockHashes = []uint64{}
		for !p.lit("]}}") {
			if len(ev.BlockHashes) > 0 && !p.lit(",") {
				return false
			}
			h, ok := p.u64()
			if !ok {
				return false
			}
			ev.BlockHashes = append(ev.BlockHashes, h)
		}
	default:
		return false
	}
	if !p.lit(`,"dp_rank":`) {
		return false
	}
	rank, ok := p.u64()
	if !ok || rank > uint64(^uint32(0)) || !p.lit("}}") || p.i != len(b) {
		return false
	}
	ev.DPRank = uint32(rank)
	*re = RouterEvent(ev)
	return true
}

// Dump returns the device tree as single-block Stored events (kv-events-index.md §14.1): a
// breadth-first walk from the root (children in tokens_hash order, candidates on a node in
// (worker, dp_rank) order) emitting, for each node and each candidate c on it, a device-tier
// event whose parent hash is c's external hash on the parent node (absent at the root) and whose
// block is {c's external hash, the edge's tokens_hash}; event_id counts from 0. Orphans — entries
// of a candidate missing from the parent or any other ancestor, which cannot match and could not
// be restored — are skipped, as are lower tiers. Applying the events in order to an empty
// index (Restore) reproduces every FindMatches device result. The shards are read-locked
// together and walked as one tree, so the output does not depend on how workers are sharded.
func (ix *Index) Dump() []DumpEvent {
	shards := ix.shards[:ix.opened.Load()]
	for _, sh := range shards {
		sh.rlock()
		defer sh.mu.RUnlock()
	}
	return dumpShards(shards)
}

// dumpRef is one shard's node of a merged dump node: the block, its run, and the slots present
// on every node from the root to it (nil for the root: everyone).
type dumpRef struct {
	sh     int32
	ri     int32
	id     uint32
	rooted []uint64
}

// dumpChild is one child of a merged node during the walk.
type dumpChild struct {
	key    uint64
	ref    dumpRef
	parent dumpRef
}

// dumpItem is one candidate's entry on a node.
type dumpItem struct {
	cand           Candidate
	ext, parentExt uint64
	hasParent      bool
}

func dumpShards(shards []*shard) []DumpEvent {
	entries := uint64(0)
	kidsOf := make([][]kidEntry, len(shards))
	for i, sh := range shards {
		entries += sh.st.TierEntries[TierDevice]
		kidsOf[i] = sh.sortedKids()
	}
	out := make([]DumpEvent, 0, entries)
	backing := make([]StoredBlock, 0, entries)
	root := make([]dumpRef, len(shards))
	for i := range shards {
		root[i] = dumpRef{sh: int32(i), ri: -1, id: rootID}
	}
	queue := [][]dumpRef{root}
	var kids []dumpChild
	var items []dumpItem
	for qi := 0; qi < len(queue); qi++ {
		kids = kids[:0]
		for _, ref := range queue[qi] {
			kids = shards[ref.sh].appendChildren(kids, ref, kidsOf[ref.sh])
		}
		slices.SortFunc(kids, func(a, b dumpChild) int {
			return cmp.Or(cmp.Compare(a.key, b.key), cmp.Compare(a.ref.sh, b.ref.sh))
		})
		for len(kids) > 0 {
			n := 1
			for n < len(kids) && kids[n].key == kids[0].key {
				n++
			}
			var group []dumpRef
			items = items[:0]
			for _, k := range kids[:n] {
				sh := shards[k.ref.sh]
				if k.ref.rooted = sh.rootedBelow(k.parent, k.ref); k.ref.rooted == nil {
					continue
				}
				c := sh.chunks[k.ref.id>>chunkBits]
				r := &c.runs[k.ref.ri]
				o := uint16(k.ref.id & chunkMask)
				for w, v := range k.ref.rooted {
					for ; v != 0; v &= v - 1 {
						s := uint32(w<<6 | bits.TrailingZeros64(v))
						it := dumpItem{cand: sh.cands[s]}
						it.ext, _ = sh.extAt(c, r, o, s)
						switch {
						case k.parent.id == rootID:
						case k.parent.ri == k.ref.ri && k.parent.id>>chunkBits == k.ref.id>>chunkBits:
							it.parentExt, _ = sh.extAt(c, r, o-1, s)
							it.hasParent = true
						default:
							it.parentExt, _ = sh.extOf(k.parent.id, s)
							it.hasParent = true
						}
						items = append(items, it)
					}
				}
				group = append(group, k.ref)
			}
			slices.SortFunc(items, func(a, b dumpItem) int { return cmpCandidate(a.cand, b.cand) })
			for _, it := range items {
				backing = append(backing, StoredBlock{BlockHash: it.ext, TokensHash: kids[0].key})
				out = append(out, DumpEvent{
					WorkerID: it.cand.WorkerID, DPRank: it.cand.DPRank, Tier: TierDevice,
					EventID: uint64(len(out)), Kind: EventStored,
					HasParent: it.hasParent, ParentHash: it.parentExt,
					Blocks: backing[len(backing)-1 : len(backing) : len(backing)],
				})
			}
			if len(group) > 0 {
				queue = append(queue, group)
			}
			kids = kids[n:]
		}
		queue[qi] = nil
	}
	return out
}

// kidEntry is one kids-map entry, for walking children in order.
type kidEntry struct {
	parent uint32
	key    uint64
	child  uint32
}

// sortedKids returns the kids map as entries sorted by parent.
func (sh *shard) sortedKids() []kidEntry {
	out := make([]kidEntry, 0, len(sh.kids)+len(sh.kidsOver))
	sh.forEachKid(func(p uint32, key uint64, c uint32) { out = append(out, kidEntry{p, key, c}) })
	slices.SortFunc(out, func(a, b kidEntry) int { return cmp.Compare(a.parent, b.parent) })
	return out
}

// appendChildren appends the children of ref (a block or the root): the next id when it continues
// the chain, then the block's kids entries (kidsOf from sortedKids).
func (sh *shard) appendChildren(dst []dumpChild, ref dumpRef, kidsOf []kidEntry) []dumpChild {
	id := ref.id
	if id != rootID {
		ci := id >> chunkBits
		c := sh.chunks[ci]
		ri := int(ref.ri)
		r := &c.runs[ri]
		o := uint16(id & chunkMask)
		if o+1 < r.off+r.n {
			return append(dst, dumpChild{key: c.keys[o+1], ref: dumpRef{sh: ref.sh, ri: ref.ri, id: id + 1, rooted: ref.rooted}, parent: ref})
		}
		if nri := primaryNext(c, ci, ri); nri >= 0 {
			dst = append(dst, dumpChild{key: c.keys[o+1], ref: dumpRef{sh: ref.sh, ri: int32(nri), id: id + 1, rooted: ref.rooted}, parent: ref})
		}
		if r.kids == 0 {
			return dst
		}
	}
	i, _ := slices.BinarySearchFunc(kidsOf, id, func(e kidEntry, p uint32) int { return cmp.Compare(e.parent, p) })
	for ; i < len(kidsOf) && kidsOf[i].parent == id; i++ {
		_, kri := sh.locate(kidsOf[i].child)
		dst = append(dst, dumpChild{key: kidsOf[i].key, ref: dumpRef{sh: ref.sh, ri: int32(kri), id: kidsOf[i].child, rooted: ref.rooted}, parent: ref})
	}
	return dst
}

// rootedBelow returns the slots of child's rooted set (its parent's, carried in child.rooted;
// nil = everyone) that hold child, or nil when none does. The parent's set itself is returned
// when it is unchanged (always inside a run), so sets are shared, not copied.
func (sh *shard) rootedBelow(parent, child dumpRef) []uint64 {
	if parent.id != rootID && parent.ri == child.ri && parent.id>>chunkBits == child.id>>chunkBits {
		return child.rooted
	}
	h := sh.chunks[child.id>>chunkBits].runs[child.ri].holder
	if h == noHolder {
		return nil
	}
	in := child.rooted
	if in != nil {
		// Unchanged when every rooted slot holds the child.
		same := true
		for w, v := range in {
			for ; v != 0 && same; v &= v - 1 {
				same = sh.hasHolder(h, uint32(w<<6|bits.TrailingZeros64(v)))
			}
		}
		if same {
			return in
		}
	}
	set := make([]uint64, sh.nwords)
	sh.loadSet(set, h)
	if in == nil && sh.ndead > 0 {
		sh.maskDead(set) // cleared slots awaiting burial hold nothing
	}
	any := false
	for w := range set {
		if in != nil {
			if w < len(in) {
				set[w] &= in[w]
			} else {
				set[w] = 0
			}
		}
		any = any || set[w] != 0
	}
	if !any {
		return nil
	}
	return set
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
