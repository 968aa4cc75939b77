package kvindex

import "fmt"

// Restore applies dumped events in order with the normal rules (§14.2); applying to a non-empty
// index merges. Every event is attempted; the error, if any, reports how many failed and wraps the
// failure of the earliest failing event. Runs of device-tier stores (what Dump emits: one block
// per event, breadth first) are regrouped per candidate into chains before they are applied, so a
// restored index is as compact as the dumped one; the result, counters included, equals applying
// the events one by one (a candidate whose stores repeat a block hash, or name a parent stored
// only by a later event, is applied event by event).
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

// restoreYield is how many events a candidate's restore checks between yield points.
const restoreYield = 256

// restorer is the state of one Restore. Per candidate, valid[k] is the k-th well-formed store
// (an index into the current run of events); the stores hanging below a block of store k form
// the list kidHead[k] → kidNext[…], each with kidBlock = the parent block's position in store k.
type restorer struct {
	ix      *Index
	first   error // the failure of the earliest failing event (number firstAt)
	firstAt int
	failed  int
	base    int // event number of the first event of the current run of stores

	where                     posTable
	valid                     []int32
	kidHead, kidTail, kidNext []int32
	kidBlock                  []int32
	blocks                    []StoredBlock
	stack                     []chainStart
}

// chainStart is a chain to apply: from store k, below parentHash (or the root).
type chainStart struct {
	k          int32
	hasParent  bool
	parentHash uint64
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
		l, ok := byCand[c]
		if !ok {
			order = append(order, c)
		}
		byCand[c] = append(l, int32(i))
	}
	for _, c := range order {
		sh := r.ix.lockWorker(c.WorkerID, true)
		r.candidate(sh, evs, byCand[c])
		r.ix.unlockWorker(sh, c.WorkerID)
	}
}

// candidate restores one candidate's stores evs[idx...] (in order) into sh (write-locked).
func (r *restorer) candidate(sh *shard, evs []RouterEvent, idx []int32) {
	r.valid = r.valid[:0]
	nblocks := 0
	for j, i := range idx {
		if j%restoreYield == restoreYield-1 {
			sh.yield() // nothing is stored yet; a dumped candidate may have a million events
		}
		ev := Event(evs[i])
		if err := sh.checkStore(ev.Candidate(), ev); err != nil {
			sh.st.StoresInvalidSequence++
			r.note(err, r.base+int(i))
			continue
		}
		r.valid = append(r.valid, i)
		nblocks += len(ev.Blocks)
	}
	n := len(r.valid)
	r.where.reset(nblocks)
	r.kidHead, r.kidTail = fill(r.kidHead, n, -1), fill(r.kidTail, n, -1)
	r.kidNext, r.kidBlock = fill(r.kidNext, n, -1), fill(r.kidBlock, n, -1)
	chainable := true
	for k, i := range r.valid {
		if k%restoreYield == restoreYield-1 {
			sh.yield()
		}
		for j, b := range evs[i].Blocks {
			if !r.where.put(b.BlockHash, int32(k), int32(j)) {
				chainable = false // a block hash stored twice: its later store moves it
			}
		}
	}
	for k, i := range r.valid {
		ev := &evs[i]
		if !ev.HasParent {
			continue
		}
		pk, pj, ok := r.where.get(ev.ParentHash)
		if !ok {
			continue
		}
		if int(pk) >= k {
			chainable = false // the parent is stored by a later store
			break
		}
		r.kidBlock[k] = pj
		if r.kidTail[pk] < 0 {
			r.kidHead[pk] = int32(k)
		} else {
			r.kidNext[r.kidTail[pk]] = int32(k)
		}
		r.kidTail[pk] = int32(k)
	}
	if !chainable {
		for _, i := range r.valid {
			r.note(sh.apply(Event(evs[i])), r.base+int(i))
		}
		return
	}
	for k := range r.valid {
		if r.kidBlock[k] < 0 {
			ev := &evs[r.valid[k]]
			r.chain(sh, evs, chainStart{int32(k), ev.HasParent, ev.ParentHash})
		}
	}
}

// chain applies store s.k as the start of a chain and, depth first, the stores below its blocks:
// the first store below a chain's last block continues the chain, the others start their own.
func (r *restorer) chain(sh *shard, evs []RouterEvent, s chainStart) {
	r.stack = append(r.stack[:0], s)
	for len(r.stack) > 0 {
		st := r.stack[len(r.stack)-1]
		r.stack = r.stack[:len(r.stack)-1]
		r.blocks = r.blocks[:0]
		first := len(r.blocks)
		members := 0
		for k := st.k; k >= 0; {
			blocks := evs[r.valid[k]].Blocks
			r.blocks = append(r.blocks, blocks...)
			members++
			next := int32(-1)
			for c := r.kidHead[k]; c >= 0; c = r.kidNext[c] {
				if next < 0 && int(r.kidBlock[c]) == len(blocks)-1 {
					next = c
					continue
				}
				r.stack = append(r.stack, chainStart{c, true, blocks[r.kidBlock[c]].BlockHash})
			}
			k = next
		}
		e0 := Event(evs[r.valid[st.k]])
		chained := Event{WorkerID: e0.WorkerID, DPRank: e0.DPRank, Tier: TierDevice, EventID: e0.EventID,
			Kind: EventStored, HasParent: st.hasParent, ParentHash: st.parentHash, Blocks: r.blocks[first:]}
		// The chain's block hashes are distinct and none is its parent (checked above), so it
		// needs no store validation of its own.
		if err := sh.storeDevice(chained.Candidate(), chained); err != nil {
			// The chain's parent is unknown: apply its stores one by one, as given.
			for k, m := st.k, 0; m < members; m++ {
				r.note(sh.apply(Event(evs[r.valid[k]])), r.base+int(r.valid[k]))
				next := int32(-1)
				for c := r.kidHead[k]; c >= 0; c = r.kidNext[c] {
					if int(r.kidBlock[c]) == len(evs[r.valid[k]].Blocks)-1 {
						next = c
						break
					}
				}
				k = next
			}
			continue
		}
		sh.st.EventsApplied += uint64(members)
	}
}

func fill(s []int32, n int, v int32) []int32 {
	if cap(s) < n {
		s = make([]int32, n)
	}
	s = s[:n]
	for i := range s {
		s[i] = v
	}
	return s
}

// posTable maps block hashes to their (store, block) position; reset is O(1) unless it grows.
type posTable struct {
	keys       []uint64
	k, j       []int32
	stamp      []uint32
	gen, shift uint32
}

func (t *posTable) reset(n int) {
	size := 16
	for size < 2*n {
		size *= 2
	}
	if len(t.keys) < size {
		t.keys, t.k, t.j, t.stamp, t.gen = make([]uint64, size), make([]int32, size), make([]int32, size), make([]uint32, size), 0
	}
	t.shift = 64
	for s := len(t.keys); s > 1; s >>= 1 {
		t.shift--
	}
	if t.gen++; t.gen == 0 {
		clear(t.stamp)
		t.gen = 1
	}
}

// put records key at (k, j) and reports false when key was already present (it keeps the first).
func (t *posTable) put(key uint64, k, j int32) bool {
	mask := uint64(len(t.keys) - 1)
	for i := extHash(key) >> t.shift; ; i = (i + 1) & mask {
		if t.stamp[i] != t.gen {
			t.stamp[i], t.keys[i], t.k[i], t.j[i] = t.gen, key, k, j
			return true
		}
		if t.keys[i] == key {
			return false
		}
	}
}

func (t *posTable) get(key uint64) (k, j int32, ok bool) {
	mask := uint64(len(t.keys) - 1)
	for i := extHash(key) >> t.shift; ; i = (i + 1) & mask {
		if t.stamp[i] != t.gen {
			return 0, 0, false
		}
		if t.keys[i] == key {
			return t.k[i], t.j[i], true
		}
	}
}
