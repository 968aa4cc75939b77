package kvindex

import (
	"fmt"
	"slices"
)

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

// knows reports whether ext is an external hash of slot s in any tier.
func (sh *shard) knows(s uint32, ext uint64) bool {
	if _, _, _, ok := sh.extFind(s, ext); ok {
		return true
	}
	for _, ls := range sh.slots[s].lower {
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
func (sh *shard) storeLower(c Candidate, ev Event) error {
	s, ok := sh.slotOf[c]
	if ev.HasParent && (!ok || !sh.knows(s, ev.ParentHash)) {
		return fmt.Errorf("%v event %d: %s parent block hash %d: %w", c, ev.EventID, ev.Tier, ev.ParentHash, ErrParentBlockNotFound)
	}
	if len(ev.Blocks) == 0 {
		return nil
	}
	if !ok {
		s = sh.allocSlot(c)
	}
	st := &sh.slots[s]
	ls := st.lower[ev.Tier-1]
	if ls == nil {
		ls = &lowerStore{
			edges: make(map[edgeKey]uint64, len(ev.Blocks)),
			rev:   make(map[uint64]edgeKey, len(ev.Blocks)),
		}
		st.lower[ev.Tier-1] = ls
		sh.syncLower(s)
	}
	k := edgeKey{parent: ev.ParentHash, root: !ev.HasParent}
	for i, b := range ev.Blocks {
		if i%yieldBlocks == yieldBlocks-1 {
			sh.yield() // the edges so far are stored: a shorter event's state
		}
		k.tok = b.TokensHash
		if k2, ok := ls.rev[b.BlockHash]; ok && k2 != k {
			// The id now names another block: drop its old edge.
			delete(ls.edges, k2)
			sh.st.TierEntries[ev.Tier]--
			sh.unrefRoot(k2, s)
		}
		if old, ok := ls.edges[k]; ok {
			if old != b.BlockHash {
				delete(ls.rev, old)
			}
		} else {
			sh.st.TierEntries[ev.Tier]++
			sh.refRoot(k, s)
		}
		ls.edges[k] = b.BlockHash
		ls.rev[b.BlockHash] = k
		k = edgeKey{parent: b.BlockHash}
	}
	return nil
}

// removeLower removes slot s's tier-t edge whose external hash is ext and reports whether it
// existed.
func (sh *shard) removeLower(s uint32, t Tier, ext uint64) bool {
	ls := sh.slots[s].lower[t-1]
	if ls == nil {
		return false
	}
	k, ok := ls.rev[ext]
	if !ok {
		return false
	}
	delete(ls.rev, ext)
	delete(ls.edges, k)
	sh.st.TierEntries[t]--
	sh.unrefRoot(k, s)
	if len(ls.rev) == 0 {
		sh.slots[s].lower[t-1] = nil
		sh.syncLower(s)
	}
	return true
}

// dropLower discards slot s's store for lower tier t.
func (sh *shard) dropLower(s uint32, t Tier) {
	ls := sh.slots[s].lower[t-1]
	if ls == nil {
		return
	}
	sh.st.TierEntries[t] -= uint64(len(ls.rev))
	for k := range ls.edges {
		sh.unrefRoot(k, s)
	}
	sh.slots[s].lower[t-1] = nil
	sh.syncLower(s)
}

func (sh *shard) refRoot(k edgeKey, s uint32) {
	if !k.root {
		return
	}
	r := rootRef{k.tok, s}
	if sh.lowerRefs[r]++; sh.lowerRefs[r] == 1 {
		l := sh.lowerRoot[k.tok]
		i, _ := slices.BinarySearch(l, s)
		sh.lowerRoot[k.tok] = slices.Insert(l, i, s)
	}
}

func (sh *shard) unrefRoot(k edgeKey, s uint32) {
	if !k.root {
		return
	}
	r := rootRef{k.tok, s}
	if sh.lowerRefs[r]--; sh.lowerRefs[r] > 0 {
		return
	}
	delete(sh.lowerRefs, r)
	l := sh.lowerRoot[k.tok]
	if i, ok := slices.BinarySearch(l, s); ok {
		l = slices.Delete(l, i, i+1)
	}
	if len(l) == 0 {
		delete(sh.lowerRoot, k.tok)
	} else {
		sh.lowerRoot[k.tok] = l
	}
}

// extend fills m's lower-tier extensions (§12.2) for slot s, starting at cursor (or the root) at
// depth d.
func (sh *shard) extend(m *Match, s uint32, cursor uint64, root bool, local []uint64, d int) {
	st := &sh.slots[s]
	for t := TierHostPinned; t < numTiers; t++ {
		ls := st.lower[t-1]
		if ls == nil {
			continue
		}
		steps := uint32(0)
		for d < len(local) {
			x, ok := ls.edges[edgeKey{parent: cursor, tok: local[d], root: root}]
			if !ok {
				break
			}
			cursor, root = x, false
			d++
			steps++
		}
		switch t {
		case TierHostPinned:
			m.HostExt = steps
		case TierDisk:
			m.DiskExt = steps
		case TierExternal:
			m.ExternalExt = steps
		}
	}
}
