package main

import "container/heap"

// blockIDs appends to dst the identity of each full block of r's prompt (blockSize tokens each,
// aligned from the first token): the segment holding the block's last token and how many tokens
// of it the block covers, mixed into one id. Equal ids mean equal prompt prefixes.
func blockIDs(dst []uint64, r *Request, blockSize int) []uint64 {
	full := r.InputTokens / blockSize
	seg, off := 0, 0 // off = first token of Segments[seg]
	for b := 0; b < full; b++ {
		end := (b + 1) * blockSize
		for off+r.Segments[seg].Len < end {
			off += r.Segments[seg].Len
			seg++
		}
		dst = append(dst, splitmix64(r.Segments[seg].Key^uint64(end-off)*0x9e3779b97f4a7c15))
	}
	return dst
}

// OptimalReuse bounds the reuse any router can reach on w: the prompt tokens one prefix cache
// would serve with offline-optimal eviction (Belady's MIN: evict the block whose next use is
// furthest away, and do not cache a block at all when every cached one is needed sooner),
// requests taken in arrival order. capacity(i) is the cache's size in blocks when request i
// arrives (≤ 0: nothing is cached); a pool of workers holds at most the sum of their capacities
// in distinct blocks, so with that sum no router and no eviction order serves more, and with the
// sum less the KV blocks running requests hold at each arrival it bounds an engine whose running
// requests share the pool with the cache. Every reuse of a cached block counts (not only up to a
// prompt's first miss, and not capped at ⌊(len−1)/bs⌋ blocks), which only loosens the bound. It
// returns the tokens per request, in workload order.
func OptimalReuse(w *Workload, blockSize int, capacity func(i int) int) []int64 {
	out := make([]int64, len(w.Requests))
	if blockSize <= 0 {
		return out
	}
	// The reference stream and, per reference, the position of the next reference to its block.
	var ids []uint64
	starts := make([]int, len(w.Requests)+1)
	for i := range w.Requests {
		starts[i] = len(ids)
		ids = blockIDs(ids, &w.Requests[i], blockSize)
	}
	starts[len(w.Requests)] = len(ids)
	const never = int(^uint(0) >> 1)
	next := make([]int, len(ids))
	last := make(map[uint64]int, len(ids)/4)
	for p := len(ids) - 1; p >= 0; p-- {
		if q, ok := last[ids[p]]; ok {
			next[p] = q
		} else {
			next[p] = never
		}
		last[ids[p]] = p
	}
	cached := make(map[uint64]int, 1<<16) // block → position of its next reference
	var h nextUseHeap
	evictFurthest := func() int { // pops stale entries; returns the evicted block's next use
		for {
			e := heap.Pop(&h).(nextUse)
			if q, ok := cached[e.id]; ok && q == e.next {
				delete(cached, e.id)
				return e.next
			}
		}
	}
	for i := range w.Requests {
		c := max(capacity(i), 0)
		for len(cached) > c {
			evictFurthest()
		}
		hits := 0
		for p := starts[i]; p < starts[i+1]; p++ {
			id := ids[p]
			if _, ok := cached[id]; ok {
				hits++
			} else if next[p] == never || c == 0 {
				continue // never used again (or no room at all): not worth caching
			} else if len(cached) >= c {
				// Full: keep the new block only if some cached one is needed later than it.
				for len(h) > 0 {
					if q, ok := cached[h[0].id]; ok && q == h[0].next {
						break
					}
					heap.Pop(&h)
				}
				if len(h) == 0 || h[0].next < next[p] {
					continue
				}
				evictFurthest()
			}
			if next[p] == never {
				delete(cached, id)
				continue
			}
			cached[id] = next[p]
			heap.Push(&h, nextUse{id: id, next: next[p]})
		}
		out[i] = int64(hits * blockSize)
	}
	return out
}

// nextUse is one entry of OptimalReuse's eviction heap: a cached block and its next reference.
type nextUse struct {
	id   uint64
	next int
}

// nextUseHeap is a max-heap on the next reference (entries go stale when a block is referenced
// again or evicted; OptimalReuse skips them).
type nextUseHeap []nextUse

func (h nextUseHeap) Len() int           { return len(h) }
func (h nextUseHeap) Less(i, j int) bool { return h[i].next > h[j].next }
func (h nextUseHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *nextUseHeap) Push(x any)        { *h = append(*h, x.(nextUse)) }
func (h *nextUseHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}
