package main

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestParseTrace(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 1000, "output_length": 7, "hash_ids": [0, 1]}
{"timestamp": 2500, "input_length": 1100, "output_length": 0, "hash_ids": [0, 1, 2]}

{"timestamp": 1000, "input_length": 512, "output_length": 3, "hash_ids": [0]}
`
	t.Run("hash ids become 512-token segments truncated to input_length, sorted by arrival", func(t *testing.T) {
		w, err := parseTrace(strings.NewReader(good), 0, 0, 1)
		if err != nil {
			t.Fatal(err)
		}
		if len(w.Requests) != 3 {
			t.Fatalf("%d requests", len(w.Requests))
		}
		r0, r1, r2 := w.Requests[0], w.Requests[1], w.Requests[2]
		if r0.Arrival != 0 || r1.Arrival != time.Second || r2.Arrival != 2500*time.Millisecond {
			t.Fatalf("arrivals %v %v %v", r0.Arrival, r1.Arrival, r2.Arrival)
		}
		want := []Segment{{Key: 0, Content: 0, Len: 512}, {Key: 1, Content: 1, Len: 488}}
		if !reflect.DeepEqual(r0.Segments, want) || r0.InputTokens != 1000 || r0.OutputTokens != 7 {
			t.Fatalf("first request %+v", r0)
		}
		if r2.OutputTokens != 1 {
			t.Fatalf("output_length 0 became max_tokens %d, want 1", r2.OutputTokens)
		}
		if got := len(r2.AppendTokens(nil, 1)); got != 1100 {
			t.Fatalf("%d prompt tokens, want 1100", got)
		}
	})
	t.Run("equal hash ids give equal tokens and a truncated block is a prefix of the full one", func(t *testing.T) {
		w, _ := parseTrace(strings.NewReader(good), 0, 0, 1)
		a := w.Requests[0].AppendTokens(nil, 1) // blocks 0, 1[:488]
		b := w.Requests[2].AppendTokens(nil, 1) // blocks 0, 1, 2[:76]
		if !reflect.DeepEqual(a, b[:1000]) {
			t.Fatal("shared hash ids did not produce shared tokens")
		}
		if reflect.DeepEqual(b[512:1024], b[1024:1100]) {
			t.Fatal("different hash ids produced equal tokens")
		}
		other, _ := parseTrace(strings.NewReader(good), 0, 0, 2)
		if reflect.DeepEqual(other.Requests[0].AppendTokens(nil, 2), a) {
			t.Fatal("the seed does not change the synthesized tokens")
		}
	})
	t.Run("a smaller block size scales every prompt down and keeps the sharing", func(t *testing.T) {
		w, err := parseTrace(strings.NewReader(good), 0, 64, 1)
		if err != nil {
			t.Fatal(err)
		}
		r0, r2 := w.Requests[0], w.Requests[2]
		// 1000 tokens = 512 + 488 → 64 + ceil(488·64/512) = 64 + 61.
		if r0.InputTokens != 125 || r0.Segments[1].Len != 61 || r2.InputTokens != 64+64+10 {
			t.Fatalf("scaled lengths %d (%+v) and %d", r0.InputTokens, r0.Segments, r2.InputTokens)
		}
		if a, b := r0.AppendTokens(nil, 1), r2.AppendTokens(nil, 1); !reflect.DeepEqual(a, b[:125]) {
			t.Fatal("scaled prompts no longer share their prefix")
		}
		if _, err := parseTrace(strings.NewReader(good), 0, 513, 1); err == nil {
			t.Fatal("a block of 513 tokens was accepted")
		}
	})
	t.Run("limit keeps the first requests of the file", func(t *testing.T) {
		w, err := parseTrace(strings.NewReader(good), 2, 0, 1)
		if err != nil || len(w.Requests) != 2 || w.Requests[1].InputTokens != 1100 {
			t.Fatalf("limit 2: %v %+v", err, w)
		}
	})
	bad := []struct{ name, line, want string }{
		{"a malformed line is reported with its number", `{"timestamp": 0,`, "line 1"},
		{"a missing hash_ids field is an error", `{"timestamp": 0, "input_length": 5, "output_length": 1}`, "hash_ids is missing"},
		{"a hash_ids count that does not match input_length is an error", `{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}`, "want ceil(513/512) = 2"},
		{"a negative timestamp is an error", `{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}`, "timestamp -1"},
		{"an empty trace is an error", ``, "no requests"},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseTrace(strings.NewReader(tc.line), 0, 0, 1)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func seg(key uint64, n int) Segment { return Segment{Key: key, Content: key, Len: n} }

func TestIdealReuse(t *testing.T) {
	cases := []struct {
		name string
		bs   int
		reqs [][]Segment
		want []int64
	}{
		{"a repeated prompt hits every full block but the one holding the last token", 16,
			[][]Segment{{seg(1, 64)}, {seg(1, 64)}}, []int64{0, 48}},
		{"a longer prompt with the same prefix hits the stored full blocks", 16,
			[][]Segment{{seg(1, 40)}, {seg(1, 40), seg(2, 100)}}, []int64{0, 32}},
		{"a different first segment shares nothing", 16,
			[][]Segment{{seg(1, 64)}, {seg(9, 64)}}, []int64{0, 0}},
		{"counting stops at the first miss", 16,
			[][]Segment{{seg(1, 32), seg(2, 32)}, {seg(1, 32), seg(3, 32), seg(4, 32)}}, []int64{0, 32}},
		{"blocks that straddle segments are identified by the later segment", 16,
			[][]Segment{{seg(1, 20), seg(2, 30)}, {seg(1, 20), seg(2, 30), seg(3, 50)}}, []int64{0, 48}},
		{"a truncated block stored earlier only covers its full blocks", 512,
			[][]Segment{{seg(0, 512), seg(1, 300)}, {seg(0, 512), seg(1, 512), seg(2, 10)}}, []int64{0, 512}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w := &Workload{}
			for _, segs := range tc.reqs {
				r := Request{Segments: segs}
				for _, s := range segs {
					r.InputTokens += s.Len
				}
				w.Requests = append(w.Requests, r)
			}
			if got := IdealReuse(w, tc.bs); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("ideal %v, want %v", got, tc.want)
			}
		})
	}
}

func TestIdealReuseMatchesTheSimulatorsBlockHashes(t *testing.T) {
	// Brute force: hash every block of the synthesized tokens and count hits in a set, exactly as
	// an unbounded cache would; IdealReuse must agree on the synthetic chat workload.
	w, err := SyntheticChat(DefaultChat, 7, 200)
	if err != nil {
		t.Fatal(err)
	}
	const bs = 16
	got := IdealReuse(w, bs)
	seen := map[string]bool{}
	for i := range w.Requests {
		toks := w.Requests[i].AppendTokens(nil, w.Seed)
		maxHit := (len(toks) - 1) / bs
		hits, missed := 0, false
		var key strings.Builder
		for b := 0; b < len(toks)/bs; b++ {
			fmt.Fprint(&key, toks[b*bs:(b+1)*bs])
			k := key.String()
			if !missed && b < maxHit && seen[k] {
				hits++
			} else {
				missed = true
			}
			seen[k] = true
		}
		if int64(hits*bs) != got[i] {
			t.Fatalf("request %d: IdealReuse %d, brute force %d", i, got[i], hits*bs)
		}
	}
}

func TestSyntheticChat(t *testing.T) {
	a, err := SyntheticChat(DefaultChat, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := SyntheticChat(DefaultChat, 1, 0)
	c, _ := SyntheticChat(DefaultChat, 2, 0)
	t.Run("the same seed gives the same workload", func(t *testing.T) {
		if !reflect.DeepEqual(a, b) {
			t.Fatal("two workloads from seed 1 differ")
		}
	})
	t.Run("another seed gives another workload", func(t *testing.T) {
		if reflect.DeepEqual(a.Requests, c.Requests) {
			t.Fatal("seeds 1 and 2 gave the same workload")
		}
	})
	t.Run("turns extend their own history and share system prompts", func(t *testing.T) {
		first := map[uint64]int{}
		byKey := map[uint64]bool{}
		extended := 0
		for _, r := range a.Requests {
			first[r.Segments[0].Key]++
			if len(r.Segments) > 2 && byKey[r.Segments[len(r.Segments)-3].Key] {
				extended++ // the previous turn's prompt (history without the answer and new message) was sent before
			}
			byKey[r.Segments[len(r.Segments)-1].Key] = true
		}
		if len(first) > DefaultChat.SystemPrompts || len(first) < 2 {
			t.Fatalf("%d distinct system prompts", len(first))
		}
		if extended < len(a.Requests)/2 {
			t.Fatalf("only %d of %d requests extend an earlier prompt", extended, len(a.Requests))
		}
	})
	t.Run("requests are sorted by arrival with unique ids", func(t *testing.T) {
		ids := map[string]bool{}
		for i, r := range a.Requests {
			if i > 0 && r.Arrival < a.Requests[i-1].Arrival {
				t.Fatalf("request %d arrives before %d", i, i-1)
			}
			if ids[r.ID] {
				t.Fatalf("duplicate id %s", r.ID)
			}
			ids[r.ID] = true
		}
	})
	t.Run("an invalid configuration is refused", func(t *testing.T) {
		bad := DefaultChat
		bad.Turns = [2]int{3, 2}
		if _, err := SyntheticChat(bad, 1, 0); err == nil {
			t.Fatal("an inverted turn range was accepted")
		}
	})
}

func TestCompletionBody(t *testing.T) {
	w, _ := SyntheticChat(DefaultChat, 3, 5)
	r := &w.Requests[4]
	var body struct {
		Model     string   `json:"model"`
		Prompt    []uint32 `json:"prompt"`
		MaxTokens int      `json:"max_tokens"`
		Stream    bool     `json:"stream"`
	}
	if err := json.Unmarshal(completionBody(nil, "m", r, w.Seed, true), &body); err != nil {
		t.Fatal(err)
	}
	if body.Model != "m" || !body.Stream || body.MaxTokens != r.OutputTokens || !reflect.DeepEqual(body.Prompt, r.AppendTokens(nil, w.Seed)) {
		t.Fatalf("body %+v does not carry the request", body)
	}
}

func TestPercentile(t *testing.T) {
	ds := []time.Duration{5, 1, 4, 2, 3, 10, 9, 8, 7, 6}
	s := sortedDurations(ds)
	cases := []struct {
		p    float64
		want time.Duration
	}{{0.5, 5}, {0.9, 9}, {0.99, 10}, {0, 1}, {1, 10}}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("p%v of 1..10 is %d by nearest rank", tc.p, tc.want), func(t *testing.T) {
			if got := percentile(s, tc.p); got != tc.want {
				t.Fatalf("got %d", got)
			}
		})
	}
	if percentile(nil, 0.5) != 0 {
		t.Fatal("percentile of nothing is not 0")
	}
}

func TestPooledLRUReuse(t *testing.T) {
	w := &Workload{}
	for _, segs := range [][]Segment{{seg(1, 64)}, {seg(2, 64)}, {seg(1, 64)}, {seg(1, 64)}} {
		w.Requests = append(w.Requests, Request{Segments: segs, InputTokens: 64})
	}
	cases := []struct {
		name     string
		capacity int
		want     []int64
	}{
		{"an ample cache matches the unbounded ideal", 100, []int64{0, 0, 48, 48}},
		{"a cache too small for two prompts loses the first to the second", 5, []int64{0, 0, 0, 48}},
		{"zero capacity means unbounded", 0, []int64{0, 0, 48, 48}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := PooledLRUReuse(w, 16, tc.capacity); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestOptimalReuse(t *testing.T) {
	// Prompts of 4 blocks: A, B, A, B, A.
	w := &Workload{}
	for _, k := range []uint64{1, 2, 1, 2, 1} {
		w.Requests = append(w.Requests, Request{Segments: []Segment{seg(k, 64)}, InputTokens: 64})
	}
	cases := []struct {
		name     string
		capacity func(i int) int
		want     []int64
	}{
		// With room for one prompt, keeping A (needed at request 2) beats taking B (needed at 3),
		// and B is never cached, so every A after the first hits: 2 of 5 requests, where LRU
		// (which always takes the newest prompt) hits none.
		{"one prompt's room keeps the prompt needed first", func(int) int { return 4 }, []int64{0, 0, 64, 0, 64}},
		{"room for both keeps both", func(int) int { return 8 }, []int64{0, 0, 64, 64, 64}},
		{"no room caches nothing", func(int) int { return 0 }, []int64{0, 0, 0, 0, 0}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := OptimalReuse(w, 16, tc.capacity); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
	t.Run("capacity that shrinks to nothing evicts everything", func(t *testing.T) {
		capacity := func(i int) int {
			if i == 2 {
				return 0
			}
			return 8
		}
		// Request 2 finds nothing and caches nothing; B is gone by request 3; request 4's A was
		// not cached at request 2, so it misses too.
		if got, want := OptimalReuse(w, 16, capacity), []int64{0, 0, 0, 0, 0}; !reflect.DeepEqual(got, want) {
			t.Fatalf("got %v, want %v", got, want)
		}
	})
	if lru := PooledLRUReuse(w, 16, 4); !reflect.DeepEqual(lru, []int64{0, 0, 0, 0, 0}) {
		t.Fatalf("LRU with one prompt's room: %v, want no hits", lru)
	}
}
