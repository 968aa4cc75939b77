package kvindex

import (
	"math/bits"
	"slices"
)

// node is one block of the device radix tree (§11.1). Its position (the path of tokens_hash keys
// from the root) identifies a token prefix. The candidates holding the block are a bitset of
// per-Index slot numbers: word 0 inline in bits0, words 1.. in x.spill. ext holds each present
// slot's external (engine) hash, ordered by slot number, so len(ext) is the number of candidates
// on the node (zero for a placeholder kept only for the entries below it). The node is 64 bytes;
// rarely needed fields live behind x.
type node struct {
	key    uint64 // tokens_hash of the edge from the parent
	parent *node  // nil for the root and for pruned nodes
	child0 *node  // first child: the single-child chain is the common case and needs no map
	x      *nodeExtra
	bits0  uint64
	ext    []uint64
}

// nodeExtra holds the fields most nodes never need.
type nodeExtra struct {
	kids  map[uint64]*node // children other than child0, by tokens_hash
	spill []uint64         // bitset words 1.. (slots 64 and up); no trailing zero words
}

// word returns bitset word w (slots 64w .. 64w+63).
func (n *node) word(w int) uint64 {
	if w == 0 {
		return n.bits0
	}
	if n.x != nil && w-1 < len(n.x.spill) {
		return n.x.spill[w-1]
	}
	return 0
}

// has reports whether slot s holds this block.
func (n *node) has(s uint32) bool {
	return n.word(int(s>>6))&(1<<(s&63)) != 0
}

// rank returns the number of present slots below s: the index of s's external hash in ext.
func (n *node) rank(s uint32) int {
	w := int(s >> 6)
	mask := uint64(1)<<(s&63) - 1
	if w == 0 {
		return bits.OnesCount64(n.bits0 & mask)
	}
	r := bits.OnesCount64(n.bits0)
	if n.x == nil {
		return r
	}
	for i := 0; i < w-1 && i < len(n.x.spill); i++ {
		r += bits.OnesCount64(n.x.spill[i])
	}
	if w-1 < len(n.x.spill) {
		r += bits.OnesCount64(n.x.spill[w-1] & mask)
	}
	return r
}

// extOf returns slot s's external hash on this node.
func (n *node) extOf(s uint32) (uint64, bool) {
	if !n.has(s) {
		return 0, false
	}
	return n.ext[n.rank(s)], true
}

// add puts slot s (not present) on the node with external hash ext.
func (n *node) add(s uint32, ext uint64) {
	r := n.rank(s)
	w := int(s >> 6)
	bit := uint64(1) << (s & 63)
	if w == 0 {
		n.bits0 |= bit
	} else {
		if n.x == nil {
			n.x = &nodeExtra{}
		}
		for len(n.x.spill) < w {
			n.x.spill = append(n.x.spill, 0)
		}
		n.x.spill[w-1] |= bit
	}
	if len(n.ext) == 0 && cap(n.ext) == 0 {
		n.ext = []uint64{ext}
		return
	}
	n.ext = slices.Insert(n.ext, r, ext)
}

// setExt replaces present slot s's external hash.
func (n *node) setExt(s uint32, ext uint64) {
	n.ext[n.rank(s)] = ext
}

// del removes present slot s from the node and returns its external hash.
func (n *node) del(s uint32) uint64 {
	r := n.rank(s)
	ext := n.ext[r]
	w := int(s >> 6)
	bit := uint64(1) << (s & 63)
	if w == 0 {
		n.bits0 &^= bit
	} else {
		sp := n.x.spill
		sp[w-1] &^= bit
		for len(sp) > 0 && sp[len(sp)-1] == 0 {
			sp = sp[:len(sp)-1]
		}
		n.x.spill = sp
		n.compactExtra()
	}
	n.ext = slices.Delete(n.ext, r, r+1)
	switch {
	case len(n.ext) == 0:
		n.ext = nil
	case cap(n.ext) >= 8 && len(n.ext) <= cap(n.ext)/4:
		n.ext = slices.Clip(slices.Clone(n.ext))
	}
	return ext
}

// count returns the number of candidates on the node.
func (n *node) count() int { return len(n.ext) }

// child returns the child reached by tokens_hash h, or nil.
func (n *node) child(h uint64) *node {
	if c := n.child0; c != nil && c.key == h {
		return c
	}
	if n.x != nil && n.x.kids != nil {
		return n.x.kids[h]
	}
	return nil
}

// addChild attaches c (whose key is not yet a child key) under n.
func (n *node) addChild(c *node) {
	c.parent = n
	if n.child0 == nil {
		n.child0 = c
		return
	}
	if n.x == nil {
		n.x = &nodeExtra{}
	}
	if n.x.kids == nil {
		n.x.kids = make(map[uint64]*node, 1)
	}
	n.x.kids[c.key] = c
}

// removeChild detaches c from n if it is n's child.
func (n *node) removeChild(c *node) {
	if n.child0 == c {
		n.child0 = nil
		if n.x != nil && len(n.x.kids) > 0 {
			for k, v := range n.x.kids {
				n.child0 = v
				delete(n.x.kids, k)
				break
			}
		}
	} else if n.x != nil && n.x.kids[c.key] == c {
		delete(n.x.kids, c.key)
	} else {
		return
	}
	if n.x != nil && len(n.x.kids) == 0 {
		n.x.kids = nil
		n.compactExtra()
	}
}

// compactExtra drops x when it holds nothing.
func (n *node) compactExtra() {
	if n.x != nil && n.x.kids == nil && len(n.x.spill) == 0 {
		n.x = nil
	}
}

// forEachChild calls f for every child of n.
func (n *node) forEachChild(f func(c *node)) {
	if n.child0 != nil {
		f(n.child0)
	}
	if n.x != nil {
		for _, c := range n.x.kids {
			f(c)
		}
	}
}

// numWords returns the number of bitset words the node uses.
func (n *node) numWords() int {
	if n.x == nil {
		return 1
	}
	return 1 + len(n.x.spill)
}
