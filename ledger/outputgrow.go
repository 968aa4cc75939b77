package ledger

// GrowOutputBlocks raises the live booking id, booked under attempt, to target output blocks
// (selection-service.md §10.3 "output_block", applied n times at once under one lock): each block
// it adds holds a fresh hash from hash() for this booking only, so it adds one active block on the
// booking's candidate while block tracking is on. A booking that already has target or more output
// blocks is left unchanged: output only grows, and the blocks go with the booking on every release
// (Free, FreeAttempt, FreeWorker, expiry). It returns how many blocks it added. The booking's
// decay_fraction is not touched. Errors: ErrNotFound when id is not live under attempt (freed,
// only claimed, or reused by a newer booking).
func (l *Ledger) GrowOutputBlocks(id string, attempt uint64, target uint32, hash func() uint64) (added uint32, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	idx, ok := l.ids[id]
	if !ok || idx == claimedSlot || l.slots[idx].b.Attempt != attempt {
		return 0, notFound(id)
	}
	s := l.slots[idx]
	for s.b.OutputBlocks < target {
		s.b.OutputBlocks++
		added++
		if l.track {
			h := hash()
			s.outputs = append(s.outputs, h)
			l.hold(s.rank, s, idx, h)
		}
	}
	return added, nil
}
