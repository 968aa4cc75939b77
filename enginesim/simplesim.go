package enginesim

import (
	"slices"
	"time"
)

// simpleReq is one request of the simple engine model in virtual time ([Sim] with EngineSimple).
type simpleReq struct {
	id        string
	tokens    []uint32
	hashes    []uint64
	maxTokens int
	arrival   time.Duration
	start     time.Duration // prefill start (after the running slot and the prefill lane)
	firstTok  time.Duration // prefill end: the first token
	finishAt  time.Duration // the last token
	pinned    []*cacheBlock
	cached    int // prefix-hit tokens
}

// simpleSim is [EngineSimple] as a pure state machine, what [Worker.execute] does with goroutines
// and timers: FIFO admission to MaxRunning running slots; with SerialPrefill, a FIFO prefill lane
// of one; the prefix looked up (and pinned) when the prefill starts; the prefill taking
// PrefillOverhead + PrefillPerToken × uncached tokens; the prompt committed to the cache (its KV
// events) when it ends, which is the first token; the last token (MaxTokens − 1) ×
// DecodePerToken later, when the request unpins its blocks and frees its slot. Not safe for
// concurrent use.
type simpleSim struct {
	cfg        Config
	cache      *prefixCache
	waiting    []*simpleReq // for a running slot, FIFO
	lane       []*simpleReq // holding a slot, waiting for the serial prefill lane, FIFO
	prefilling []*simpleReq // prefill started (at most one with SerialPrefill)
	decoding   []*simpleReq // first token sent, last one pending
	peak       int
	changes    uint64        // state changes applied (Stats.Steps)
	busy       time.Duration // simulated prefill time (Stats.BusyTime)
}

// running is the number of requests holding a running slot.
func (s *simpleSim) running() int { return len(s.lane) + len(s.prefilling) + len(s.decoding) }

// idle reports whether nothing is pending.
func (s *simpleSim) idle() bool { return len(s.waiting) == 0 && s.running() == 0 }

// admit gives free running slots to waiting requests in order and starts the prefills the lane
// allows, at simulated time now.
func (s *simpleSim) admit(now time.Duration) {
	for len(s.waiting) > 0 && s.running() < s.cfg.MaxRunning {
		s.lane = append(s.lane, s.waiting[0])
		s.waiting = s.waiting[1:]
	}
	s.peak = max(s.peak, s.running())
	for len(s.lane) > 0 && (!s.cfg.SerialPrefill || len(s.prefilling) == 0) {
		r := s.lane[0]
		s.lane = s.lane[1:]
		r.start = now
		r.pinned = s.cache.admit(r.hashes, len(r.tokens))
		r.cached = len(r.pinned) * s.cfg.BlockSize
		d := s.cfg.PrefillOverhead + time.Duration(len(r.tokens)-r.cached)*s.cfg.PrefillPerToken
		r.firstTok = now + d
		r.finishAt = r.firstTok + time.Duration(r.maxTokens-1)*s.cfg.DecodePerToken
		s.busy += d
		s.prefilling = append(s.prefilling, r)
	}
}

// next returns the time of the next state change (a prefill ending or a request finishing), or
// false when nothing runs.
func (s *simpleSim) next() (time.Duration, bool) {
	at, ok := time.Duration(0), false
	earliest := func(t time.Duration) {
		if !ok || t < at {
			at, ok = t, true
		}
	}
	for _, r := range s.prefilling {
		earliest(r.firstTok)
	}
	for _, r := range s.decoding {
		earliest(r.finishAt)
	}
	return at, ok
}

// apply applies every state change due at now: requests that finish unpin their blocks (last
// block first) and free their slots; prefills that end commit their prompts to the cache, giving
// the returned KV events, and emit their first token (a request with one output token finishes
// there too); then waiting requests take the free slots and the lane. first and finished list the
// requests that got their first and their last token.
func (s *simpleSim) apply(now time.Duration) (events []Event, first, finished []*simpleReq) {
	s.changes++
	s.decoding = slices.DeleteFunc(s.decoding, func(r *simpleReq) bool {
		if r.finishAt > now {
			return false
		}
		s.cache.release(r.pinned)
		finished = append(finished, r)
		return true
	})
	bs := s.cfg.BlockSize
	s.prefilling = slices.DeleteFunc(s.prefilling, func(r *simpleReq) bool {
		if r.firstTok > now {
			return false
		}
		res := s.cache.commit(r.pinned, r.hashes)
		r.pinned = res.pinned
		if len(res.removed) > 0 {
			events = append(events, Event{Kind: BlockRemoved, BlockHashes: res.removed})
		}
		if n := len(res.pinned) - res.start; n > 0 {
			ev := Event{Kind: BlockStored, BlockHashes: r.hashes[res.start:len(res.pinned)], TokenIDs: r.tokens[res.start*bs : len(res.pinned)*bs], BlockSize: bs}
			if res.start > 0 {
				ev.HasParent, ev.ParentHash = true, r.hashes[res.start-1]
			}
			events = append(events, ev)
		}
		first = append(first, r)
		if r.finishAt <= now {
			s.cache.release(r.pinned)
			finished = append(finished, r)
		} else {
			s.decoding = append(s.decoding, r)
		}
		return true
	})
	s.admit(now)
	return events, first, finished
}

// record is r's RequestRecord once it finished.
func (r *simpleReq) record(cfg *Config) RequestRecord {
	queue := r.start - r.arrival
	ttft := r.firstTok - r.arrival
	return RequestRecord{
		ID: r.id, PromptTokens: len(r.tokens), CachedTokens: r.cached, OutputTokens: r.maxTokens,
		Queue: queue, TTFT: ttft, E2E: ttft + time.Duration(r.maxTokens-1)*cfg.DecodePerToken,
	}
}
