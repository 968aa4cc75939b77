package main

import (
	"bufio"
	"container/list"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"sort"
	"strconv"
	"time"
)

// TraceBlockTokens is the size of one Mooncake hash_id block, tokens (traces/README.md).
const TraceBlockTokens = 512

// tokenVocab bounds the synthesized token ids: ids are in [0, tokenVocab).
const tokenVocab = 1 << 17

// Segment is a run of prompt tokens. Token k of the run is tokenAt(seed, Content, k), so two runs
// with the same Content share their tokens and a shorter run is a prefix of a longer one. Key
// identifies the whole prompt up to and including this segment: equal keys mean equal tokens from
// the first prompt token to the end of the segment (a Mooncake hash_id has exactly that meaning).
type Segment struct {
	// Key is the chained identity of the prompt prefix ending with this segment.
	Key uint64
	// Content names the segment's token run.
	Content uint64
	// Len is the segment's length, tokens (≥ 1).
	Len int
}

// Request is one request of a workload. Prompt tokens are synthesized on demand from Segments, so
// a workload of millions of tokens costs only its segment lists in memory.
type Request struct {
	// ID is unique within the workload ("r00042"); it is sent as x-request-id.
	ID string
	// Arrival is the simulated time since the start of the workload.
	Arrival time.Duration
	// Segments make up the prompt, in order.
	Segments []Segment
	// InputTokens is the prompt length, tokens (the sum of the segment lengths).
	InputTokens int
	// OutputTokens is the number of tokens to generate (max_tokens, ≥ 1).
	OutputTokens int
}

// AppendTokens appends the request's prompt token ids to dst.
func (r *Request) AppendTokens(dst []uint32, seed uint64) []uint32 {
	for _, s := range r.Segments {
		for k := 0; k < s.Len; k++ {
			dst = append(dst, tokenAt(seed, s.Content, k))
		}
	}
	return dst
}

// Workload is a replayable list of requests sorted by arrival.
type Workload struct {
	// Name describes the source: "synthetic chat" or the trace file name.
	Name string
	// Requests are sorted by Arrival.
	Requests []Request
	// Seed is the token-synthesis seed.
	Seed uint64
}

// Span returns the simulated time from the first to the last arrival.
func (w *Workload) Span() time.Duration {
	if len(w.Requests) == 0 {
		return 0
	}
	return w.Requests[len(w.Requests)-1].Arrival - w.Requests[0].Arrival
}

// Totals returns the prompt and output token totals.
func (w *Workload) Totals() (prompt, output int64) {
	for i := range w.Requests {
		prompt += int64(w.Requests[i].InputTokens)
		output += int64(w.Requests[i].OutputTokens)
	}
	return prompt, output
}

// splitmix64 is the SplitMix64 finalizer, a fast bijective mixer.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// tokenAt is token k of the run named content under seed.
func tokenAt(seed, content uint64, k int) uint32 {
	return uint32(splitmix64(splitmix64(seed^content*0x9e3779b97f4a7c15)+uint64(k)) % tokenVocab)
}

// chainKey derives a segment key from the previous key, the content and the length.
func chainKey(prev, content uint64, n int) uint64 {
	return splitmix64(prev*0xff51afd7ed558ccd ^ splitmix64(content) ^ uint64(n)<<1)
}

// traceLine is one Mooncake JSONL record.
type traceLine struct {
	Timestamp    *float64  `json:"timestamp"`
	InputLength  *int      `json:"input_length"`
	OutputLength *int      `json:"output_length"`
	HashIDs      *[]uint64 `json:"hash_ids"`
}

// LoadTrace reads a Mooncake trace (JSONL: timestamp in ms, input_length, output_length,
// hash_ids of 512-token prefix blocks; traces/README.md). Each hash_id becomes a segment of 512
// tokens whose content is the id itself (the last one truncated to input_length), so equal ids
// give equal tokens; output_length becomes max_tokens (at least 1). limit > 0 keeps the first
// limit requests. blockTokens (1..512; 0 means 512) scales the replay down: each hash_id becomes
// blockTokens tokens instead of 512 and the last block is scaled alike (rounded up), so every
// prompt shrinks by blockTokens/512 while the reuse structure — which requests share which
// prefixes — stays the same; tests use it to replay a long slice cheaply. Errors name the line: a
// malformed record, a missing field, a negative length, or len(hash_ids) ≠ ceil(input_length/512).
func LoadTrace(path string, limit, blockTokens int, seed uint64) (*Workload, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open trace: %w", err)
	}
	defer f.Close()
	w, err := parseTrace(f, limit, blockTokens, seed)
	if err != nil {
		return nil, fmt.Errorf("trace %s: %w", path, err)
	}
	w.Name = path
	return w, nil
}

func parseTrace(r io.Reader, limit, blockTokens int, seed uint64) (*Workload, error) {
	if blockTokens == 0 {
		blockTokens = TraceBlockTokens
	}
	if blockTokens < 1 || blockTokens > TraceBlockTokens {
		return nil, fmt.Errorf("trace block tokens %d must be in 1..%d", blockTokens, TraceBlockTokens)
	}
	w := &Workload{Seed: seed}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	line := 0
	for sc.Scan() {
		line++
		text := sc.Bytes()
		if len(trimSpace(text)) == 0 {
			continue
		}
		if limit > 0 && len(w.Requests) >= limit {
			break
		}
		var tl traceLine
		if err := json.Unmarshal(text, &tl); err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
		switch {
		case tl.Timestamp == nil:
			return nil, fmt.Errorf("line %d: timestamp is missing", line)
		case tl.InputLength == nil:
			return nil, fmt.Errorf("line %d: input_length is missing", line)
		case tl.OutputLength == nil:
			return nil, fmt.Errorf("line %d: output_length is missing", line)
		case tl.HashIDs == nil:
			return nil, fmt.Errorf("line %d: hash_ids is missing", line)
		}
		ts, in, out, ids := *tl.Timestamp, *tl.InputLength, *tl.OutputLength, *tl.HashIDs
		if math.IsNaN(ts) || math.IsInf(ts, 0) || ts < 0 || ts > MaxTraceTimestampMs {
			return nil, fmt.Errorf("line %d: timestamp %v must be a finite number of ms in 0..%g", line, ts, float64(MaxTraceTimestampMs))
		}
		if in < 1 || out < 0 {
			return nil, fmt.Errorf("line %d: input_length %d must be ≥ 1 and output_length %d ≥ 0", line, in, out)
		}
		if want := (in + TraceBlockTokens - 1) / TraceBlockTokens; len(ids) != want {
			return nil, fmt.Errorf("line %d: %d hash_ids for input_length %d, want ceil(%d/512) = %d", line, len(ids), in, in, want)
		}
		req := Request{
			ID:           fmt.Sprintf("r%06d", len(w.Requests)),
			Arrival:      time.Duration(ts * float64(time.Millisecond)),
			OutputTokens: max(out, 1),
			Segments:     make([]Segment, len(ids)),
		}
		for i, id := range ids {
			n := blockTokens
			if i == len(ids)-1 {
				last := in - TraceBlockTokens*(len(ids)-1) // 1..512
				n = (last*blockTokens + TraceBlockTokens - 1) / TraceBlockTokens
			}
			req.Segments[i] = Segment{Key: id, Content: id, Len: n}
			req.InputTokens += n
		}
		w.Requests = append(w.Requests, req)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("line %d: %w", line+1, err)
	}
	if len(w.Requests) == 0 {
		return nil, errors.New("no requests")
	}
	sort.SliceStable(w.Requests, func(i, j int) bool { return w.Requests[i].Arrival < w.Requests[j].Arrival })
	return w, nil
}

func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t' || b[0] == '\r' || b[0] == '\n') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t' || b[len(b)-1] == '\r' || b[len(b)-1] == '\n') {
		b = b[:len(b)-1]
	}
	return b
}

// ChatConfig shapes the built-in synthetic multi-turn chat workload. Lengths are tokens, times are
// simulated.
type ChatConfig struct {
	// SystemPrompts is the number of distinct system prompts shared by the conversations.
	SystemPrompts int
	// SystemTokens is the range of system prompt lengths.
	SystemTokens [2]int
	// Conversations is the number of conversations.
	Conversations int
	// Turns is the range of turns per conversation.
	Turns [2]int
	// UserTokens is the range of user message lengths.
	UserTokens [2]int
	// OutputTokens is the range of answer lengths (max_tokens); each answer becomes part of the
	// conversation's next prompt.
	OutputTokens [2]int
	// StartWindow is the window in which conversations start (uniformly).
	StartWindow time.Duration
	// ThinkTime is the range of gaps between a turn's arrival and the next turn's.
	ThinkTime [2]time.Duration
}

// DefaultChat is the default synthetic workload: 4 system prompts of 0.5–1.5k tokens shared by 64
// conversations of 4–9 turns (≈ 420 requests over ≈ 120 s of simulated time). Every turn's prompt
// is the system prompt, the whole history (earlier questions and answers) and a new user message,
// so most of a prompt is the conversation's own history.
var DefaultChat = ChatConfig{
	SystemPrompts: 4,
	SystemTokens:  [2]int{2000, 6000},
	Conversations: 120,
	Turns:         [2]int{4, 9},
	UserTokens:    [2]int{200, 2000},
	OutputTokens:  [2]int{100, 400},
	StartWindow:   60 * time.Second,
	ThinkTime:     [2]time.Duration{6 * time.Second, 12 * time.Second},
}

// SyntheticChat generates the multi-turn chat workload of cfg deterministically from seed.
// limit > 0 keeps the first limit requests by arrival.
func SyntheticChat(cfg ChatConfig, seed uint64, limit int) (*Workload, error) {
	if cfg.SystemPrompts < 1 || cfg.Conversations < 1 || cfg.Turns[0] < 1 || cfg.Turns[1] < cfg.Turns[0] ||
		cfg.SystemTokens[0] < 1 || cfg.UserTokens[0] < 1 || cfg.OutputTokens[0] < 1 ||
		cfg.SystemTokens[1] < cfg.SystemTokens[0] || cfg.UserTokens[1] < cfg.UserTokens[0] ||
		cfg.OutputTokens[1] < cfg.OutputTokens[0] || cfg.ThinkTime[1] < cfg.ThinkTime[0] || cfg.ThinkTime[0] < 0 ||
		cfg.StartWindow < 0 {
		return nil, fmt.Errorf("synthetic chat config %+v: every count ≥ 1, every range ordered", cfg)
	}
	rng := rand.New(rand.NewPCG(seed, 0x636861742d776b6c)) // "chat-wkl"
	between := func(r [2]int) int { return r[0] + rng.IntN(r[1]-r[0]+1) }
	betweenDur := func(r [2]time.Duration) time.Duration {
		return r[0] + time.Duration(rng.Int64N(int64(r[1]-r[0])+1))
	}
	nextContent := uint64(1 << 40) // content ids of generated runs (trace ids are small)
	newContent := func() uint64 { nextContent++; return nextContent }

	systems := make([]Segment, cfg.SystemPrompts)
	for i := range systems {
		c := newContent()
		n := between(cfg.SystemTokens)
		systems[i] = Segment{Key: chainKey(0, c, n), Content: c, Len: n}
	}
	w := &Workload{Name: "synthetic chat", Seed: seed}
	for conv := 0; conv < cfg.Conversations; conv++ {
		history := []Segment{systems[rng.IntN(len(systems))]}
		at := time.Duration(rng.Int64N(int64(cfg.StartWindow) + 1))
		turns := between(cfg.Turns)
		for turn := 0; turn < turns; turn++ {
			if turn > 0 {
				at += betweenDur(cfg.ThinkTime)
			}
			user := newContent()
			n := between(cfg.UserTokens)
			history = append(history, Segment{Key: chainKey(history[len(history)-1].Key, user, n), Content: user, Len: n})
			req := Request{Arrival: at, OutputTokens: between(cfg.OutputTokens), Segments: append([]Segment(nil), history...)}
			for _, s := range req.Segments {
				req.InputTokens += s.Len
			}
			w.Requests = append(w.Requests, req)
			// The answer joins the history of the next turn.
			answer := newContent()
			history = append(history, Segment{Key: chainKey(history[len(history)-1].Key, answer, req.OutputTokens), Content: answer, Len: req.OutputTokens})
		}
	}
	sort.SliceStable(w.Requests, func(i, j int) bool { return w.Requests[i].Arrival < w.Requests[j].Arrival })
	if limit > 0 && len(w.Requests) > limit {
		w.Requests = w.Requests[:limit]
	}
	for i := range w.Requests {
		w.Requests[i].ID = "r" + leftPad(strconv.Itoa(i), 6)
	}
	return w, nil
}

func leftPad(s string, n int) string {
	for len(s) < n {
		s = "0" + s
	}
	return s
}

// IdealReuse computes, per request, the prompt tokens an unbounded single prefix cache would
// serve, with the simulator's rules (enginesim "Prefix cache"): cache entries are full blocks of
// blockSize tokens aligned from the first prompt token; a block hits when an earlier request
// stored it, counted up to the first miss; at most floor((len−1)/blockSize) blocks hit; and every
// request stores all of its full blocks. It returns the hit tokens per request, in workload order.
//
// A block is identified by the segment holding its last token and how many tokens of that segment
// it covers (the segment key fixes everything before it), so the memory is one entry per distinct
// segment, not per block.
func IdealReuse(w *Workload, blockSize int) []int64 {
	out := make([]int64, len(w.Requests))
	if blockSize <= 0 {
		return out
	}
	stored := make(map[uint64]int) // segment key → tokens of it covered by stored blocks
	for i := range w.Requests {
		r := &w.Requests[i]
		maxHit := 0
		if r.InputTokens > 0 {
			maxHit = (r.InputTokens - 1) / blockSize
		}
		full := r.InputTokens / blockSize
		// Walk the full blocks: block b ends at token (b+1)*bs − 1.
		hits, seg, off := 0, 0, 0 // off = first token of Segments[seg]
		missed := false
		for b := 0; b < full; b++ {
			end := (b + 1) * blockSize // exclusive
			for off+r.Segments[seg].Len < end {
				off += r.Segments[seg].Len
				seg++
			}
			s := r.Segments[seg]
			covered := end - off
			if !missed && b < maxHit && stored[s.Key] >= covered {
				hits++
			} else {
				missed = true
			}
			if stored[s.Key] < covered {
				stored[s.Key] = covered
			}
		}
		out[i] = int64(hits * blockSize)
	}
	return out
}

// PooledLRUReuse computes, per request, the prompt tokens one shared LRU prefix cache of
// capacityBlocks blocks would serve, with the block rules of IdealReuse and requests taken one
// at a time in arrival order. It is a reference for limited capacity: the reuse a router could
// reach if the pool's whole capacity acted as a single cache. A request touches all of its full
// blocks (most recently used last) and inserts the missing ones, evicting least recently used
// blocks beyond the capacity. capacityBlocks ≤ 0 means unbounded (IdealReuse).
func PooledLRUReuse(w *Workload, blockSize, capacityBlocks int) []int64 {
	if capacityBlocks <= 0 {
		return IdealReuse(w, blockSize)
	}
	out := make([]int64, len(w.Requests))
	if blockSize <= 0 {
		return out
	}
	lru := list.New() // front = least recently used
	// The map never holds more than the workload's blocks: size it by those, not by the capacity
	// (--workers × --capacity-blocks reached 2^28 blocks, 9.7 GB, for a 3-request trace).
	distinct := 0
	for i := range w.Requests {
		distinct += w.Requests[i].InputTokens / blockSize
		if distinct >= capacityBlocks {
			break
		}
	}
	where := make(map[uint64]*list.Element, min(distinct, capacityBlocks))
	var ids []uint64
	for i := range w.Requests {
		r := &w.Requests[i]
		maxHit := 0
		if r.InputTokens > 0 {
			maxHit = (r.InputTokens - 1) / blockSize
		}
		ids = blockIDs(ids[:0], r, blockSize)
		hits, missed := 0, false
		for b, id := range ids {
			if e, ok := where[id]; ok {
				if !missed && b < maxHit {
					hits++
				}
				lru.MoveToBack(e)
				continue
			}
			missed = true
			where[id] = lru.PushBack(id)
			if lru.Len() > capacityBlocks {
				front := lru.Front()
				lru.Remove(front)
				delete(where, front.Value.(uint64))
			}
		}
		out[i] = int64(hits * blockSize)
	}
	return out
}

// MaxTraceTimestampMs is the largest trace timestamp accepted, ms (10^12 ms ≈ 31.7 years): a
// time.Duration holds at most ~9.2·10^12 ms, and beyond it a timestamp wrapped to a negative
// arrival (a negative span and TTFT in the table) or, at 1e300, silently to 0.
const MaxTraceTimestampMs = 1e12
