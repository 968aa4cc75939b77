package ledger

// GrowOutputBlocks raises the live booking id, booked under attempt, to target output blocks
// (selection-service.md §10.3 "output_block", applied n times at once under one lock). The blocks
// of an output_block hold fresh random hashes that no other booking holds, so each adds one
// distinct, exclusively held active block on the booking's candidate (weighted by the booking's
// decay_fraction) while block tracking is on; GrowOutputBlocks therefore keeps them as a count
// rather than one hash each — the same loads, in O(1) time and memory whatever target is. A
// booking that already has target or more output blocks is left unchanged: output only grows, and
// the blocks go with the booking on every release (Free, FreeAttempt, FreeWorker, expiry). It
// returns how many blocks it added (fewer than asked only at maxRankPrivateBlocks). The booking's decay_fraction is not touched. Errors:
// ErrNotFound when id is not live under attempt (freed, only claimed, or reused by a newer booking).
func (l *Ledger) GrowOutputBlocks(id string, attempt uint64, target uint32) (added uint32, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	idx, ok := l.ids[id]
	if !ok || idx == claimedSlot || l.slots[idx].b.Attempt != attempt {
		return 0, notFound(id)
	}
	s := l.slots[idx]
	if s.b.OutputBlocks >= target {
		return 0, nil
	}
	added = target - s.b.OutputBlocks
	if l.track {
		added = uint32(min(uint64(added), maxRankPrivateBlocks-s.rank.private))
		s.private += uint64(added)
		s.rank.private += uint64(added)
		s.rank.deficit += uint64(added) * s.q
	}
	s.b.OutputBlocks += added
	return added, nil
}

// maxRankPrivateBlocks bounds the counted output blocks of one candidate (2^31 − 1 blocks, far
// beyond any engine's KV pool), so that its active blocks in 2^-32 fixed point never overflow
// 64 bits; growth beyond it is not applied (GrowOutputBlocks returns what it added).
const maxRankPrivateBlocks = 1<<31 - 1
