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
	// anon counts blocks held by running requests without a cached hash (the vLLM engine model's
	// partially filled, not yet stored and generated-token blocks). They occupy capacity like
	// cached blocks but are never looked up or evicted. Always 0 in the simple engine.
	anon int
	// deadHeld counts blocks dropped by clear that requests still hold: they stay in GPU memory
	// until released. Only the vLLM engine model's occupancy reads it.
	deadHeld int

	stored, evicted uint64 // counters, in blocks
}

type cacheBlock struct {
	hash uint64
	refs int
	elem *list.Element // non-nil while unpinned and cached
	dead bool          // evicted or cleared; a holder only drops its reference
	held bool          // dead but still held by a request (counted in deadHeld)
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
		if len(c.blocks)+c.anon >= c.capacity {
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
		if b.refs == 0 && b.dead && b.held {
			b.held = false
			c.deadHeld--
		}
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
		if b.refs > 0 {
			b.held = true
			c.deadHeld++
		}
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

// The methods below serve the vLLM engine model (vllm.go), where the cache is the worker's whole
// KV block pool: running requests hold blocks (cached prompt blocks pinned, every other block
// anonymous), free blocks are either unused or cached and unpinned (evictable, LRU).

// freeBlocks is the number of blocks an allocation can take now: unused ones plus cached blocks
// no running request holds.
func (c *prefixCache) freeBlocks() int {
	return c.capacity - len(c.blocks) - c.anon - c.deadHeld + c.lru.Len()
}

// usedBlocks is the number of blocks running requests hold (pinned cached plus anonymous).
func (c *prefixCache) usedBlocks() int { return len(c.blocks) - c.lru.Len() + c.anon + c.deadHeld }

// lookup returns the length of the cached prefix of hashes, in blocks, capped at maxHit, and how
// many of those blocks no request holds (pinning them takes them off the free list).
func (c *prefixCache) lookup(hashes []uint64, maxHit int) (hit, unpinned int) {
	for _, h := range hashes[:min(maxHit, len(hashes))] {
		b, ok := c.blocks[h]
		if !ok {
			break
		}
		hit++
		if b.refs == 0 {
			unpinned++
		}
	}
	return hit, unpinned
}

// pinPrefix pins the first n blocks of hashes (all cached, as lookup found) and appends them to
// dst.
func (c *prefixCache) pinPrefix(hashes []uint64, n int, dst []*cacheBlock) []*cacheBlock {
	for _, h := range hashes[:n] {
		b := c.blocks[h]
		c.pin(b)
		dst = append(dst, b)
	}
	return dst
}

// allocAnon takes n anonymous blocks, evicting least recently used unpinned cached blocks when no
// unused block is left, and appends the evicted hashes to removed. The caller has checked
// freeBlocks() ≥ n.
func (c *prefixCache) allocAnon(n int, removed []uint64) []uint64 {
	for i := 0; i < n; i++ {
		if len(c.blocks)+c.anon+c.deadHeld >= c.capacity {
			front := c.lru.Front()
			if front == nil {
				panic("enginesim: KV block pool overcommitted") // the scheduler checks freeBlocks first
			}
			victim := front.Value.(*cacheBlock)
			c.remove(victim)
			c.evicted++
			removed = append(removed, victim.hash)
		}
		c.anon++
	}
	return removed
}

// releaseAnon returns n anonymous blocks to the pool.
func (c *prefixCache) releaseAnon(n int) { c.anon -= n }

// storeAnon caches block h for a request that computed it in one of its anonymous blocks and
// returns the block, pinned by the request. If h is cached already (another request computed the
// same block meanwhile, or the request's own prompt was cached in full and its last block was
// recomputed) the request pins that copy and its anonymous block is freed: one copy per hash.
func (c *prefixCache) storeAnon(h uint64) *cacheBlock {
	c.anon--
	if b, ok := c.blocks[h]; ok {
		c.pin(b)
		return b
	}
	b := &cacheBlock{hash: h, refs: 1}
	c.blocks[h] = b
	c.stored++
	return b
}
