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
// index (Restore) reproduces every FindMatches device result. The shards are read-locked
// together and walked as one tree, so the output does not depend on how workers are sharded.
func (ix *Index) Dump() []DumpEvent {
	shards := ix.shards[:ix.opened.Load()]
	for _, sh := range shards {
		sh.mu.RLock()
		defer sh.mu.RUnlock()
	}
	return dumpShards(shards)
}

// dumpRef is one shard's node of a merged dump node, with the slots present on every node from
// the root to it (nil for the root: everyone).
type dumpRef struct {
	sh     int
	id     uint32
	rooted []uint64
}

// dumpChild is one child of a merged node during the walk.
type dumpChild struct {
	key    uint64
	ref    dumpRef
	parent uint32
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
		root[i] = dumpRef{sh: i, id: rootID}
	}
	queue := [][]dumpRef{root}
	var kids []dumpChild
	var items []dumpItem
	for qi := 0; qi < len(queue); qi++ {
		kids = kids[:0]
		for _, ref := range queue[qi] {
			shards[ref.sh].children(ref.id, kidsOf[ref.sh], func(key uint64, child uint32) {
				kids = append(kids, dumpChild{key: key, ref: dumpRef{sh: ref.sh, id: child, rooted: ref.rooted}, parent: ref.id})
			})
		}
		slices.SortFunc(kids, func(a, b dumpChild) int {
			return cmp.Or(cmp.Compare(a.key, b.key), cmp.Compare(a.ref.sh, b.ref.sh))
		})
		for len(kids) > 0 {
			n := 1
			for n < len(kids) && kids[n].key == kids[0].key {
				n++
			}
			group := make([]dumpRef, 0, n)
			items = items[:0]
			for _, k := range kids[:n] {
				sh := shards[k.ref.sh]
				rooted := sh.rootedBelow(k.ref.rooted, k.ref.id)
				if rooted == nil {
					continue
				}
				for w, v := range rooted {
					for ; v != 0; v &= v - 1 {
						s := uint32(w<<6 | bits.TrailingZeros64(v))
						it := dumpItem{cand: sh.slots[s].cand}
						it.ext, _ = sh.extOf(k.ref.id, s)
						if k.parent != rootID {
							it.parentExt, _ = sh.extOf(k.parent, s)
							it.hasParent = true
						}
						items = append(items, it)
					}
				}
				group = append(group, dumpRef{sh: k.ref.sh, id: k.ref.id, rooted: rooted})
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

// children calls f for every child of block id (or the root): the next id when it continues the
// chain, then id's kids entries (kidsOf from sortedKids).
func (sh *shard) children(id uint32, kidsOf []kidEntry, f func(key uint64, child uint32)) {
	if id != rootID {
		ci, ri := sh.locate(id)
		c := sh.chunks[ci]
		r := &c.runs[ri]
		o := uint16(id & chunkMask)
		if o+1 < r.off+r.n || primaryNext(c, ci, ri) >= 0 {
			f(c.keys[o+1], id+1)
		}
		if r.kids == 0 || o+1 < r.off+r.n {
			return
		}
	}
	i, _ := slices.BinarySearchFunc(kidsOf, id, func(e kidEntry, p uint32) int { return cmp.Compare(e.parent, p) })
	for ; i < len(kidsOf) && kidsOf[i].parent == id; i++ {
		f(kidsOf[i].key, kidsOf[i].child)
	}
}

// rootedBelow returns the slots on block id that are also in parent (nil = every slot), or nil
// when there are none. parent itself is returned when it is unchanged.
func (sh *shard) rootedBelow(parent []uint64, id uint32) []uint64 {
	ci, ri := sh.locate(id)
	h := sh.chunks[ci].runs[ri].holder
	if h == noHolder {
		return nil
	}
	set := make([]uint64, sh.nwords)
	sh.loadSet(set, h)
	same, any := true, false
	for w := range set {
		if parent != nil {
			p := uint64(0)
			if w < len(parent) {
				p = parent[w]
			}
			same = same && set[w]&p == p
			set[w] &= p
		}
		any = any || set[w] != 0
	}
	if !any {
		return nil
	}
	if parent != nil && same && len(parent) == len(set) {
		return parent
	}
	return set
}

// Restore applies dumped events in order with the normal rules (§14.2); applying to a non-empty
// index merges. Every event is attempted; the error, if any, reports how many failed and wraps the
// first failure. Runs of device-tier stores (what Dump emits) are regrouped per candidate into
// chains before they are applied, so a restored index is as compact as the dumped one; the
// result equals applying the events one by one (a candidate whose stores reuse an external hash
// or name a parent stored only later is applied event by event).
func (ix *Index) Restore(events []RouterEvent) error {
	r := restorer{ix: ix, firstAt: -1}
	for i := 0; i < len(events); {
		if !isDeviceStore(events[i]) {
			r.note(ix.Apply(Event(events[i])), i)
			i++
			continue
		}
		j := i + 1
		for j < len(events) && isDeviceStore(events[j]) {
			j++
		}
		r.stores(events[i:j], i)
		i = j
	}
	if r.first != nil {
		return fmt.Errorf("restore: %d of %d events failed, first: %w", r.failed, len(events), r.first)
	}
	return nil
}

func isDeviceStore(re RouterEvent) bool {
	return re.Kind == EventStored && re.Tier == TierDevice
}

// restorer is the state of one Restore.
type restorer struct {
	ix      *Index
	first   error // the failure of the earliest event (firstAt)
	firstAt int
	failed  int

	base   int            // event number of evs[0] in the current run of stores
	pos    map[uint64]int // a candidate's block hash → index of the event storing it
	kidsAt map[uint64][]int
	blocks []StoredBlock
}

// note records the outcome of event number at.
func (r *restorer) note(err error, at int) {
	if err == nil {
		return
	}
	r.failed++
	if r.firstAt < 0 || at < r.firstAt {
		r.first, r.firstAt = err, at
	}
}

// stores restores a run of device-tier Stored events (the first is event number base),
// candidate by candidate.
func (r *restorer) stores(evs []RouterEvent, base int) {
	r.base = base
	byCand := make(map[Candidate][]int32)
	var order []Candidate
	for i := range evs {
		c := Event(evs[i]).Candidate()
		if _, ok := byCand[c]; !ok {
			order = append(order, c)
		}
		byCand[c] = append(byCand[c], int32(i))
	}
	for _, c := range order {
		sh := r.ix.lockWorker(c.WorkerID, true)
		r.candidate(sh, evs, byCand[c])
		r.ix.unlockWorker(sh, c.WorkerID)
	}
}

// candidate restores one candidate's stores evs[idx...] (in order) into sh (write-locked).
func (r *restorer) candidate(sh *shard, evs []RouterEvent, idx []int32) {
	if r.pos == nil {
		r.pos, r.kidsAt = make(map[uint64]int), make(map[uint64][]int)
	}
	clear(r.pos)
	clear(r.kidsAt)
	valid := idx[:0:0]
	chainable := true
	for _, i := range idx {
		ev := Event(evs[i])
		if err := sh.checkStore(ev.Candidate(), ev); err != nil {
			sh.st.StoresInvalidSequence++
			r.note(err, r.base+int(i))
			continue
		}
		for _, b := range ev.Blocks {
			if _, dup := r.pos[b.BlockHash]; dup {
				chainable = false
			}
			r.pos[b.BlockHash] = len(valid)
		}
		if ev.HasParent {
			if _, ok := r.pos[ev.ParentHash]; ok {
				r.kidsAt[ev.ParentHash] = append(r.kidsAt[ev.ParentHash], len(valid))
			}
		}
		valid = append(valid, i)
	}
	for k, i := range valid {
		// A parent stored only by a later event would resolve differently once chained.
		if ev := evs[i]; ev.HasParent {
			if p, ok := r.pos[ev.ParentHash]; ok && p >= k {
				chainable = false
			}
		}
	}
	if !chainable {
		for _, i := range valid {
			r.note(sh.apply(Event(evs[i])), r.base+int(i))
		}
		return
	}
	for k, i := range valid {
		ev := Event(evs[i])
		if ev.HasParent {
			if _, inBatch := r.kidsAt[ev.ParentHash]; inBatch && r.pos[ev.ParentHash] < k {
				continue // applied as part of its parent's chain
			}
		}
		r.chain(sh, evs, valid, k)
	}
}

// chain applies event valid[k] and, depth first, the events stored below its blocks: the first
// child of a chain's last block continues it, other children start chains of their own.
func (r *restorer) chain(sh *shard, evs []RouterEvent, valid []int32, k int) {
	type start struct {
		k          int
		hasParent  bool
		parentHash uint64
	}
	ev0 := Event(evs[valid[k]])
	stack := []start{{k, ev0.HasParent, ev0.ParentHash}}
	var members []int
	for len(stack) > 0 {
		st := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		r.blocks = r.blocks[:0]
		members = members[:0]
		for k := st.k; ; {
			ev := Event(evs[valid[k]])
			members = append(members, k)
			r.blocks = append(r.blocks, ev.Blocks...)
			next := -1
			for bi, b := range ev.Blocks {
				kids := r.kidsAt[b.BlockHash]
				for ki, kk := range kids {
					if bi == len(ev.Blocks)-1 && ki == 0 {
						next = kk
						continue
					}
					stack = append(stack, start{kk, true, b.BlockHash})
				}
			}
			if next < 0 {
				break
			}
			k = next
		}
		c := Event(evs[valid[st.k]]).Candidate()
		chained := Event{WorkerID: c.WorkerID, DPRank: c.DPRank, Tier: TierDevice, EventID: evs[valid[st.k]].EventID,
			Kind: EventStored, HasParent: st.hasParent, ParentHash: st.parentHash, Blocks: r.blocks}
		saved := sh.st
		if err := sh.apply(chained); err != nil {
			// The chain's first parent is unknown: apply its events one by one, as given.
			sh.st = saved
			for _, m := range members {
				r.note(sh.apply(Event(evs[valid[m]])), r.base+int(valid[m]))
			}
			continue
		}
		sh.st.EventsApplied += uint64(len(members) - 1)
	}
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
