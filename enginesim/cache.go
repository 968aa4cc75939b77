package enginesim

import (
	"container/list"
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// prefixCache is the simulator's block cache (see the package documentation,
// "Prefix cache"). It is not safe for concurrent use; the worker guards it.
type prefixCache struct {
	bs       int
	capacity int
	seed     uint64
	none     uint64 // parent hash of the first block (vLLM's NONE_HASH)

	blocks map[uint64]*cacheBlock
	lru    *list.List // unpinned blocks; Front is evicted first

	stored, evicted uint64 // counters, in blocks
}

type cacheBlock struct {
	hash uint64
	refs int
	elem *list.Element // non-nil while unpinned and cached
	dead bool          // evicted or cleared; a holder only drops its reference
}

func newPrefixCache(blockSize, capacity int, seed uint64) *prefixCache {
	return &prefixCache{
		bs:       blockSize,
		capacity: capacity,
		seed:     seed,
		none:     xxh3.HashStringSeed("enginesim:none", seed),
		blocks:   make(map[uint64]*cacheBlock),
		lru:      list.New(),
	}
}

// blockHashes returns the chained engine hashes of the full blocks of tokens.
func (c *prefixCache) blockHashes(tokens []uint32) []uint64 {
	n := len(tokens) / c.bs
	out := make([]uint64, n)
	buf := make([]byte, 8+4*c.bs)
	parent := c.none
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint64(buf, parent)
		for j, t := range tokens[i*c.bs : (i+1)*c.bs] {
			binary.LittleEndian.PutUint32(buf[8+4*j:], t)
		}
		parent = xxh3.HashSeed(buf, c.seed)
		out[i] = parent
	}
	return out
}

// admit counts the prefix hit of a prompt of promptLen tokens whose full-block
// hashes are given (at most floor((promptLen-1)/bs) blocks, like vLLM), pins the
// hit blocks and returns them.
func (c *prefixCache) admit(hashes []uint64, promptLen int) []*cacheBlock {
	maxHit := 0
	if promptLen > 0 {
		maxHit = (promptLen - 1) / c.bs
	}
	if maxHit > len(hashes) {
		maxHit = len(hashes)
	}
	var pinned []*cacheBlock
	for _, h := range hashes[:maxHit] {
		b, ok := c.blocks[h]
		if !ok {
			break
		}
		c.pin(b)
		pinned = append(pinned, b)
	}
	return pinned
}

func (c *prefixCache) pin(b *cacheBlock) {
	if b.elem != nil {
		c.lru.Remove(b.elem)
		b.elem = nil
	}
	b.refs++
}

// commitResult describes what a commit changed.
type commitResult struct {
	pinned  []*cacheBlock // all blocks the request now holds, in prompt order
	start   int           // index of the first stored block (the surviving hit length)
	removed []uint64      // evicted block hashes, in eviction order
}

// commit stores the prompt's full blocks after the surviving hit prefix of
// pinned (see the package documentation) and returns the new holdings. Stored
// blocks are hashes[start:len(res.pinned)].
func (c *prefixCache) commit(pinned []*cacheBlock, hashes []uint64) commitResult {
	start := 0
	for start < len(pinned) && !pinned[start].dead {
		start++
	}
	// Blocks after a dead one (only possible after a clear) are dropped.
	for _, b := range pinned[start:] {
		c.unpin(b)
	}
	res := commitResult{pinned: pinned[:start:start], start: start}
	for _, h := range hashes[start:] {
		if b, ok := c.blocks[h]; ok {
			c.pin(b)
			res.pinned = append(res.pinned, b)
			continue
		}
		if len(c.blocks) >= c.capacity {
			front := c.lru.Front()
			if front == nil {
				break // everything is pinned: the rest of the prompt is not cached
			}
			victim := front.Value.(*cacheBlock)
			c.remove(victim)
			c.evicted++
			res.removed = append(res.removed, victim.hash)
		}
		b := &cacheBlock{hash: h, refs: 1}
		c.blocks[h] = b
		c.stored++
		res.pinned = append(res.pinned, b)
	}
	return res
}

func (c *prefixCache) remove(b *cacheBlock) {
	if b.elem != nil {
		c.lru.Remove(b.elem)
		b.elem = nil
	}
	delete(c.blocks, b.hash)
	b.dead = true
}

func (c *prefixCache) unpin(b *cacheBlock) {
	if b.refs > 0 {
		b.refs--
	}
	if b.refs == 0 && !b.dead && b.elem == nil {
		b.elem = c.lru.PushBack(b)
	}
}

// release drops a request's references, last block first, so a prompt's tail
// is evicted before its head.
func (c *prefixCache) release(pinned []*cacheBlock) {
	for i := len(pinned) - 1; i >= 0; i-- {
		c.unpin(pinned[i])
	}
}

// clear drops every cached block; holders keep only dead references.
func (c *prefixCache) clear() {
	for _, b := range c.blocks {
		b.dead = true
		b.elem = nil
	}
	c.blocks = make(map[uint64]*cacheBlock)
	c.lru.Init()
}

// contains reports whether the block with engine hash h is cached.
func (c *prefixCache) contains(h uint64) bool {
	_, ok := c.blocks[h]
	return ok
}

// size returns the number of cached blocks and how many of them are pinned.
func (c *prefixCache) size() (cached, pinned int) {
	return len(c.blocks), len(c.blocks) - c.lru.Len()
}
