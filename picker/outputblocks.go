package picker

import (
	"context"

	"github.com/kvepp/kvepp/internal/excerpt"
)

// TracksOutputBlocks reports whether the service grows bookings with the output KV of their
// responses (RouterSettings.TrackOutputBlocks, DYN_ROUTER_TRACK_OUTPUT_BLOCKS), i.e. whether
// OutputTokens does anything. Callers that must parse responses to count tokens ask first.
func (s *Service) TracksOutputBlocks() bool { return s.cfg.Router.TrackOutputBlocks }

// OutputTokens reports that the live booking selectionID has generated generated output tokens so
// far (a running total, not an increment) and, when TracksOutputBlocks, grows the booking to one
// output block per full block_size tokens (selection-service.md §10.3 "output_block": each holds
// a fresh random hash no other booking holds, so it adds one active block on the booked rank until
// the booking is freed; the ledger keeps these as a count, so growth costs O(1) whatever its size).
// That is the KV memory the engine allocates for the running request's output, which the
// request's prompt blocks do not include; policies read it through active blocks (decode load,
// KV pressure). Output only grows: a smaller total than before changes nothing.
//
// Bounded: a booking never holds more output blocks than outputBlockLimit allows (the booked
// worker's total_kv_blocks less the prompt's blocks, and at most MaxISLTokens / block_size), so a
// hostile or wrong token count cannot inflate the load beyond what the engine could hold; and one
// report adds at most MaxOutputBlocksPerReport blocks, so a single misreported count (an event
// claiming 2^64 tokens) moves the load by a bounded step and a true total beyond it is reached
// over the following reports.
// It returns the number of blocks added. Errors: KindNotFound "reservation {id} not found" (unknown,
// claimed but not booked, or freed). With tracking off it returns 0, nil without a lookup.
func (s *Service) OutputTokens(ctx context.Context, selectionID string, generated uint64) (int, error) {
	_ = ctx
	if !s.cfg.Router.TrackOutputBlocks || generated == 0 {
		return 0, nil
	}
	b, ok := s.ledger.Lookup(selectionID)
	if !ok {
		return 0, Errorf(KindNotFound, "reservation %s not found", excerpt.Of(selectionID))
	}
	bs, limit := s.outputBlockLimit(b.Partition, b.Candidate.WorkerID, uint64(len(b.SequenceHashes)))
	if bs == 0 {
		return 0, nil
	}
	target := min(generated/uint64(bs), limit)
	if target <= uint64(b.OutputBlocks) {
		return 0, nil
	}
	target = min(target, uint64(b.OutputBlocks)+MaxOutputBlocksPerReport)
	added, err := s.ledger.GrowOutputBlocks(selectionID, b.Attempt, uint32(target))
	if err != nil {
		return 0, ledgerError(err)
	}
	return int(added), nil
}

// outputBlockLimit returns the block size of partition name and the most output blocks a booking
// with promptBlocks tracked prompt blocks on worker workerID may hold: what the worker's KV pool
// has left after the prompt (total_kv_blocks, when the worker reports it) and never more than a
// maximal prompt's blocks (MaxISLTokens / block_size), within uint32. bs is 0 when the partition
// is gone or has no block size yet.
func (s *Service) outputBlockLimit(name string, workerID, promptBlocks uint64) (bs uint32, limit uint64) {
	s.mu.RLock()
	p := s.byName[name]
	s.mu.RUnlock()
	if p == nil {
		return 0, 0
	}
	v := p.view.Load()
	if v == nil || v.blockSize == 0 {
		return 0, 0
	}
	bs = v.blockSize
	limit = min(uint64(MaxISLTokens)/uint64(bs), uint64(^uint32(0)))
	if i, ok := v.byID[workerID]; ok {
		if kv := v.workers[i].totalKV; kv != nil {
			limit = min(limit, *kv-min(*kv, promptBlocks))
		}
	}
	return bs, limit
}

// MaxOutputBlocksPerReport is the most output blocks one OutputTokens call adds to a booking:
// 1,024 blocks (16,384 tokens at block size 16), far more than one response chunk of a real stream
// carries (vLLM sends an event per token, or per --stream-interval tokens), so exact counts are
// never held back in practice, while one misreported total cannot turn a booking into a whole KV
// pool (up to MaxISLTokens / block_size blocks without total_kv_blocks) in one step.
const MaxOutputBlocksPerReport = 1024
