package kvindex

import (
	"fmt"
	"math/bits"
)

// checkInvariants recounts the index's structure and compares it with its counters:
//   - every lookup entry points to a node holding the slot under that external hash, and the
//     nodes reachable from lookups hold exactly those (node, slot) pairs (the lookup is a bijection);
//   - each node's ext slice has one entry per set bit, and spill words have no trailing zeros;
//   - device and lower-tier entry counts equal the recount; the lower maps are inverse;
//   - slot bookkeeping (slotOf, used, lowerBits, Candidates) is consistent, with no empty slot;
//   - every node in a lookup is attached (its parent chain reaches the root); every attached node
//     points back to its parent, and an empty attached node has children (a placeholder).
func checkInvariants(ix *Index) error {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var device uint64
	var lower [numTiers]uint64
	seen := map[*node]bool{}
	pairs := 0
	for c, s := range ix.slotOf {
		if int(s) >= len(ix.slots) || ix.slots[s].cand != c {
			return fmt.Errorf("slotOf[%v]=%d inconsistent", c, s)
		}
		if ix.used[s>>6]&(1<<(s&63)) == 0 {
			return fmt.Errorf("slot %d of %v not marked used", s, c)
		}
		st := &ix.slots[s]
		hasLower := false
		for t, ls := range st.lower {
			if ls == nil {
				continue
			}
			hasLower = true
			if len(ls.rev) == 0 || len(ls.rev) != len(ls.edges) {
				return fmt.Errorf("%v tier %d: %d edges, %d reverse entries", c, t+1, len(ls.edges), len(ls.rev))
			}
			for k, x := range ls.edges {
				if ls.rev[x] != k {
					return fmt.Errorf("%v tier %d: reverse map disagrees for %d", c, t+1, x)
				}
			}
			lower[t+1] += uint64(len(ls.rev))
		}
		if hasLower != (ix.lowerBits[s>>6]&(1<<(s&63)) != 0) {
			return fmt.Errorf("%v: lowerBits %v, has lower stores %v", c, !hasLower, hasLower)
		}
		if len(st.lookup) == 0 && !hasLower {
			return fmt.Errorf("%v holds slot %d with no entries", c, s)
		}
		for ext, n := range st.lookup {
			got, ok := n.extOf(s)
			if !ok || got != ext {
				return fmt.Errorf("%v: lookup %d points to a node holding (%v, %d)", c, ext, ok, got)
			}
			device++
			if !seen[n] {
				seen[n] = true
				pairs += n.count()
			}
		}
	}
	if uint64(pairs) != device {
		return fmt.Errorf("nodes reachable from lookups hold %d pairs, lookups have %d", pairs, device)
	}
	for n := range seen {
		if err := checkNode(n); err != nil {
			return err
		}
		a := n
		for a.parent != nil {
			if a.parent.child(a.key) != a {
				return fmt.Errorf("node %d is not its parent's child", a.key)
			}
			a = a.parent
		}
		if a != ix.root {
			return fmt.Errorf("node %d in a lookup is not attached to the root", n.key)
		}
	}
	if device != ix.st.TierEntries[TierDevice] {
		return fmt.Errorf("device entries counter %d, recount %d", ix.st.TierEntries[TierDevice], device)
	}
	for t := TierHostPinned; t < numTiers; t++ {
		if lower[t] != ix.st.TierEntries[t] {
			return fmt.Errorf("%s entries counter %d, recount %d", t, ix.st.TierEntries[t], lower[t])
		}
	}
	used := 0
	for w, v := range ix.used {
		used += bits.OnesCount64(v)
		if v != 0 && w >= ix.nwords {
			return fmt.Errorf("used word %d beyond nwords %d", w, ix.nwords)
		}
	}
	if used != len(ix.slotOf) || used != ix.st.Candidates {
		return fmt.Errorf("used slots %d, slotOf %d, Candidates %d", used, len(ix.slotOf), ix.st.Candidates)
	}
	// Attached nodes are linked both ways; empty ones are placeholders with children.
	stack := []*node{ix.root}
	for len(stack) > 0 {
		n := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		var err error
		n.forEachChild(func(c *node) {
			if c.parent != n && err == nil {
				err = fmt.Errorf("child %d does not point back to its parent", c.key)
			}
			if c.count() == 0 && c.child0 == nil && err == nil {
				err = fmt.Errorf("empty childless node %d is still attached", c.key)
			}
			if c.count() > 0 && !seen[c] && err == nil {
				err = fmt.Errorf("attached node %d is in no candidate's lookup", c.key)
			}
			stack = append(stack, c)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

func checkNode(n *node) error {
	ones := 0
	for w := 0; w < n.numWords(); w++ {
		ones += bits.OnesCount64(n.word(w))
	}
	if ones != len(n.ext) {
		return fmt.Errorf("node %d: %d bits, %d external hashes", n.key, ones, len(n.ext))
	}
	if n.x != nil {
		if sp := n.x.spill; len(sp) > 0 && sp[len(sp)-1] == 0 {
			return fmt.Errorf("node %d: trailing zero spill word", n.key)
		}
		if n.x.kids != nil && len(n.x.kids) == 0 {
			return fmt.Errorf("node %d: empty kids map kept", n.key)
		}
		if n.child0 == nil && len(n.x.kids) > 0 {
			return fmt.Errorf("node %d: kids without child0", n.key)
		}
	}
	return nil
}
