package kvindex

import "fmt"

// edgeKey is one lower-tier edge source (§12.1): the parent's external hash, or the root, and the
// local hash of the block below it.
type edgeKey struct {
	parent uint64
	tok    uint64
	root   bool
}

// lowerStore is one candidate's store for one lower tier (§12.1): edges
// (parent external hash | ROOT, tokens_hash) → external hash, and the reverse map used by
// removals. The two maps are kept inverse to each other.
type lowerStore struct {
	edges map[edgeKey]uint64
	rev   map[uint64]edgeKey
}

// put records edge k → ext and returns how the entry count changed (-1, 0 or +1).
func (ls *lowerStore) put(k edgeKey, ext uint64) int {
	delta := 0
	if k2, ok := ls.rev[ext]; ok && k2 != k {
		// The id now names another block: drop its old edge.
		delete(ls.edges, k2)
		delta--
	}
	if old, ok := ls.edges[k]; ok {
		if old != ext {
			delete(ls.rev, old)
		}
	} else {
		delta++
	}
	ls.edges[k] = ext
	ls.rev[ext] = k
	return delta
}

// remove deletes the edge whose external hash is ext and reports whether it existed.
func (ls *lowerStore) remove(ext uint64) bool {
	k, ok := ls.rev[ext]
	if !ok {
		return false
	}
	delete(ls.rev, ext)
	delete(ls.edges, k)
	return true
}

// knows reports whether ext is an external hash of slot s in any tier.
func (ix *Index) knows(s uint32, ext uint64) bool {
	st := &ix.slots[s]
	if _, ok := st.lookup[ext]; ok {
		return true
	}
	for _, ls := range st.lower {
		if ls != nil {
			if _, ok := ls.rev[ext]; ok {
				return true
			}
		}
	}
	return false
}

// storeLower applies a validated lower-tier Stored event (§12.1). The parent must be the root or
// an external hash the candidate holds in any tier.
func (ix *Index) storeLower(c Candidate, ev Event) error {
	s, ok := ix.slotOf[c]
	if ev.HasParent && (!ok || !ix.knows(s, ev.ParentHash)) {
		return fmt.Errorf("%v event %d: %s parent block hash %d: %w", c, ev.EventID, ev.Tier, ev.ParentHash, ErrParentBlockNotFound)
	}
	if len(ev.Blocks) == 0 {
		return nil
	}
	if !ok {
		s = ix.allocSlot(c)
	}
	st := &ix.slots[s]
	ls := st.lower[ev.Tier-1]
	if ls == nil {
		ls = &lowerStore{
			edges: make(map[edgeKey]uint64, len(ev.Blocks)),
			rev:   make(map[uint64]edgeKey, len(ev.Blocks)),
		}
		st.lower[ev.Tier-1] = ls
		ix.lowerBits[s>>6] |= 1 << (s & 63)
	}
	k := edgeKey{parent: ev.ParentHash, root: !ev.HasParent}
	for _, b := range ev.Blocks {
		k.tok = b.TokensHash
		ix.st.TierEntries[ev.Tier] += uint64(ls.put(k, b.BlockHash))
		k = edgeKey{parent: b.BlockHash}
	}
	return nil
}

// dropLower discards slot s's store for lower tier t.
func (ix *Index) dropLower(s uint32, t Tier) {
	st := &ix.slots[s]
	ls := st.lower[t-1]
	if ls == nil {
		return
	}
	ix.st.TierEntries[t] -= uint64(len(ls.rev))
	st.lower[t-1] = nil
	for _, other := range st.lower {
		if other != nil {
			return
		}
	}
	ix.lowerBits[s>>6] &^= 1 << (s & 63)
}
