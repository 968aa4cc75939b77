package queue_test

import (
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/picker/queue"
)

var epoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

func u64(v uint64) *uint64   { return &v }
func f64(v float64) *float64 { return &v }

// at returns the instant s seconds after the epoch.
func at(s float64) time.Time { return epoch.Add(time.Duration(s * float64(time.Second))) }

// matrix builds a profile of one bucket "all" where each class is its own family.
func matrix(t testing.TB, classes ...queue.Class) *queue.Profile {
	t.Helper()
	for i := range classes {
		if classes[i].Family == "" {
			classes[i].Family, classes[i].Bucket = classes[i].Name, "all"
		}
		if classes[i].Quantum == 0 {
			classes[i].Quantum = 1
		}
	}
	p, err := queue.NewProfile(queue.ProfileSpec{
		DefaultFamily: classes[0].Family,
		Buckets:       []queue.Bucket{{Name: "all"}},
		Classes:       classes,
	})
	if err != nil {
		t.Fatal(err)
	}
	return p.WithDefaultPolicy(queue.FCFS)
}

// push enqueues value v into class with raw/cached tokens at arrival offset s (seconds) and
// fails the test on error.
func push(t testing.TB, q *queue.Queue[string], class, endpoints int, raw, cached uint64, s float64, v string) *queue.Entry[string] {
	t.Helper()
	e, err := q.Enqueue(class, endpoints, queue.NewSnapshot(raw, cached), 0, 0, at(s), v)
	if err != nil {
		t.Fatalf("enqueue %s: %v", v, err)
	}
	return e
}

func all(int, *queue.Entry[string]) bool { return true }

// popAll pops until nothing is dispatchable and returns the values in order.
func popAll(q *queue.Queue[string], ok func(int, *queue.Entry[string]) bool) []string {
	var out []string
	for e := q.PopNext(ok); e != nil; e = q.PopNext(ok) {
		out = append(out, e.Value)
	}
	return out
}

func TestScore(t *testing.T) {
	cases := []struct {
		name   string
		policy queue.Policy
		jump   float64
		offset float64
		cost   uint64
		want   float64
	}{
		{"fcfs is priority_jump minus the arrival offset", queue.FCFS, 2, 5, 7, -3},
		{"lcfs is priority_jump plus the arrival offset", queue.LCFS, 2, 5, 7, 7},
		{"wspt is one plus priority_jump over the cost", queue.WSPT, 1, 5, 8, 0.25},
		{"a negative priority_jump counts as zero", queue.FCFS, -4, 1, 1, -1},
		{"a NaN priority_jump counts as zero", queue.LCFS, math.NaN(), 1, 1, 1},
		{"a negative arrival offset counts as zero", queue.FCFS, 1, -3, 1, 1},
		{"an unset policy scores as fcfs", queue.PolicyUnset, 0, 2, 1, -2},
		{"a zero cost counts as one", queue.WSPT, 0, 0, 0, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := queue.Score(tc.policy, tc.jump, tc.offset, tc.cost); got != tc.want {
				t.Fatalf("Score = %v, want %v", got, tc.want)
			}
		})
	}
	t.Run("an infinite priority_jump never yields NaN", func(t *testing.T) {
		for _, p := range []queue.Policy{queue.FCFS, queue.LCFS, queue.WSPT} {
			if s := queue.Score(p, math.Inf(1), math.Inf(1), 3); math.IsNaN(s) {
				t.Fatalf("%v score is NaN", p)
			}
		}
	})
}

// TestAcceptance67WSPTKeys is §20 item 67's WSPT checks: isl 1024, bs 16, best overlap 60 blocks
// → 1/64; pinned overlap 1 block → 1/1008; full overlap → 1/1.
func TestAcceptance67WSPTKeys(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cached uint64
		want   float64
	}{
		{"a best overlap of 60 blocks keys 1/64", 60 * 16, 1.0 / 64},
		{"a pinned overlap of 1 block keys 1/1008", 16, 1.0 / 1008},
		{"a full overlap keys 1/1", 1024, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sn := queue.NewSnapshot(1024, tc.cached)
			if got := queue.Score(queue.WSPT, 0, 0, sn.Cost()); got != tc.want {
				t.Fatalf("key = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestSnapshot(t *testing.T) {
	for _, tc := range []struct {
		name                string
		raw, cached         uint64
		wantCached, uncache uint64
		cost                uint64
	}{
		{"cached tokens are clamped to the raw length", 10, 25, 10, 0, 1},
		{"the cost is the uncached length", 100, 40, 40, 60, 60},
		{"a fully cached request still costs one token", 5, 5, 5, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := queue.NewSnapshot(tc.raw, tc.cached)
			if s.CachedTokens != tc.wantCached || s.Uncached() != tc.uncache || s.Cost() != tc.cost {
				t.Fatalf("%+v uncached %d cost %d", s, s.Uncached(), s.Cost())
			}
		})
	}
}

// TestAcceptance67OrderingWithinAClass is §13.2: (strict_priority, policy_score) higher first,
// then earlier enqueue.
func TestAcceptance67OrderingWithinAClass(t *testing.T) {
	type req struct {
		name   string
		at     float64
		jump   float64
		strict uint32
		raw    uint64
	}
	cases := []struct {
		name   string
		policy queue.Policy
		reqs   []req
		want   []string
	}{
		{"fcfs dispatches earlier arrivals first", queue.FCFS,
			[]req{{"b", 2, 0, 0, 1}, {"a", 1, 0, 0, 1}, {"c", 3, 0, 0, 1}}, []string{"a", "b", "c"}},
		{"fcfs lets priority_jump seconds overtake", queue.FCFS,
			[]req{{"a", 1, 0, 0, 1}, {"b", 3, 2.5, 0, 1}}, []string{"b", "a"}},
		{"lcfs dispatches later arrivals first", queue.LCFS,
			[]req{{"a", 1, 0, 0, 1}, {"b", 2, 0, 0, 1}, {"c", 3, 0, 0, 1}}, []string{"c", "b", "a"}},
		{"wspt dispatches the cheapest uncached work first", queue.WSPT,
			[]req{{"big", 0, 0, 0, 1000}, {"small", 1, 0, 0, 10}, {"mid", 2, 0, 0, 100}}, []string{"small", "mid", "big"}},
		{"wspt weighs priority_jump against cost", queue.WSPT,
			[]req{{"small", 0, 0, 0, 10}, {"boosted", 1, 19, 0, 100}}, []string{"boosted", "small"}},
		{"a higher strict priority wins over any score", queue.FCFS,
			[]req{{"early", 0, 100, 0, 1}, {"strict", 9, 0, 1, 1}}, []string{"strict", "early"}},
		{"equal keys keep enqueue order", queue.WSPT,
			[]req{{"x", 5, 0, 0, 10}, {"y", 1, 0, 0, 10}, {"z", 3, 0, 0, 10}}, []string{"x", "y", "z"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			q := queue.New[string](matrix(t, queue.Class{Name: "c", Policy: tc.policy, Quantum: 1 << 20}), epoch)
			for _, r := range tc.reqs {
				if _, err := q.Enqueue(0, 1, queue.NewSnapshot(r.raw, 0), r.jump, r.strict, at(r.at), r.name); err != nil {
					t.Fatal(err)
				}
			}
			got := make([]string, 0, len(tc.reqs))
			for _, e := range q.Entries(0) {
				got = append(got, e.Value)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Fatalf("Entries order (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tc.want, popAll(q, all)); diff != "" {
				t.Fatalf("dispatch order (-want +got):\n%s", diff)
			}
		})
	}
}

// TestAcceptance68PolicyClassQueue is §20 item 68 on the pure queue.
func TestAcceptance68PolicyClassQueue(t *testing.T) {
	t.Run("per-worker caps scale with the endpoint count and are checked before adding", func(t *testing.T) {
		q := queue.New[string](matrix(t, queue.Class{Name: "capped", Quantum: 10, RequestLimitPerWorker: u64(1),
			RawISLTokenLimitPerWorker: u64(5), CachedTokenLimitPerWorker: u64(3)}), epoch)
		push(t, q, 0, 2, 8, 4, 0, "first")
		push(t, q, 0, 2, 100, 100, 1, "oversized") // crosses every cap, still accepted
		_, err := q.Enqueue(0, 2, queue.NewSnapshot(1, 0), 0, 0, at(2), "rejected")
		var rej *queue.Rejection
		if !errors.As(err, &rej) {
			t.Fatalf("third enqueue err = %v, want a *Rejection", err)
		}
		if diff := cmp.Diff(queue.Rejection{Class: "capped", Kind: queue.LimitRequests, Current: 2, Limit: 2}, *rej); diff != "" {
			t.Fatalf("rejection (-want +got):\n%s", diff)
		}
		if want := `router policy class "capped" queue requests limit reached (current=2, limit=2)`; err.Error() != want {
			t.Fatalf("message %q, want %q", err.Error(), want)
		}
		if s := q.Stats(0); s != (queue.Stats{Requests: 2, RawISLTokens: 108, CachedTokens: 104}) || q.Len() != 2 {
			t.Fatalf("stats %+v len %d", s, q.Len())
		}
	})
	t.Run("token caps follow capacity without evicting", func(t *testing.T) {
		q := queue.New[string](matrix(t,
			queue.Class{Name: "raw", RawISLTokenLimitPerWorker: u64(10)},
			queue.Class{Name: "cached", CachedTokenLimitPerWorker: u64(5)}), epoch)
		push(t, q, 0, 2, 11, 0, 0, "raw-queued")
		expectRejection(t, q, 0, 1, queue.NewSnapshot(1, 0), queue.LimitRawISLTokens, 11, 10)
		if q.Stats(0).RawISLTokens != 11 || q.Len() != 1 {
			t.Fatalf("a shrunken limit evicted: %+v", q.Stats(0))
		}
		push(t, q, 0, 2, 10, 0, 2, "raw-after-growth")
		expectRejection(t, q, 0, 2, queue.NewSnapshot(1, 0), queue.LimitRawISLTokens, 21, 20)
		push(t, q, 1, 2, 8, 6, 0, "cached-queued")
		expectRejection(t, q, 1, 1, queue.NewSnapshot(1, 1), queue.LimitCachedTokens, 6, 5)
	})
	t.Run("a zero limit and zero endpoints reject every enqueue", func(t *testing.T) {
		q := queue.New[string](matrix(t,
			queue.Class{Name: "zero", RequestLimitPerWorker: u64(0)},
			queue.Class{Name: "no-workers", RequestLimitPerWorker: u64(1)},
			queue.Class{Name: "no-workers-tokens", RawISLTokenLimitPerWorker: u64(1000)}), epoch)
		expectRejection(t, q, 0, 4, queue.NewSnapshot(1, 0), queue.LimitRequests, 0, 0)
		expectRejection(t, q, 1, 0, queue.NewSnapshot(1, 0), queue.LimitRequests, 0, 0)
		expectRejection(t, q, 2, 0, queue.NewSnapshot(1, 0), queue.LimitRawISLTokens, 0, 0)
		if q.Len() != 0 {
			t.Fatalf("len %d", q.Len())
		}
	})
	t.Run("limit multiplication saturates instead of wrapping", func(t *testing.T) {
		q := queue.New[string](matrix(t, queue.Class{Name: "capped", RequestLimitPerWorker: u64(math.MaxUint64)}), epoch)
		push(t, q, 0, 2, 1, 0, 0, "queued")
		push(t, q, 0, math.MaxInt, 1, 0, 0, "queued again")
	})
	t.Run("limits are checked in the order requests, raw ISL tokens, cached tokens", func(t *testing.T) {
		q := queue.New[string](matrix(t,
			queue.Class{Name: "all", RequestLimitPerWorker: u64(1), RawISLTokenLimitPerWorker: u64(1), CachedTokenLimitPerWorker: u64(1)},
			queue.Class{Name: "tokens", RequestLimitPerWorker: u64(9), RawISLTokenLimitPerWorker: u64(1), CachedTokenLimitPerWorker: u64(1)},
			queue.Class{Name: "cached", RequestLimitPerWorker: u64(9), RawISLTokenLimitPerWorker: u64(9), CachedTokenLimitPerWorker: u64(1)}), epoch)
		for c := 0; c < 3; c++ {
			push(t, q, c, 1, 5, 5, 0, "big")
		}
		expectRejection(t, q, 0, 1, queue.NewSnapshot(1, 1), queue.LimitRequests, 1, 1)
		expectRejection(t, q, 1, 1, queue.NewSnapshot(1, 1), queue.LimitRawISLTokens, 5, 1)
		expectRejection(t, q, 2, 1, queue.NewSnapshot(1, 1), queue.LimitCachedTokens, 5, 1)
	})
	t.Run("fcfs and wspt order only within their class", func(t *testing.T) {
		q := queue.New[string](matrix(t,
			queue.Class{Name: "fcfs", Policy: queue.FCFS, Quantum: 50},
			queue.Class{Name: "wspt", Policy: queue.WSPT, Quantum: 50}), epoch)
		push(t, q, 0, 1, 50, 0, 0, "fcfs-long")
		push(t, q, 0, 1, 1, 0, 1, "fcfs-short")
		push(t, q, 1, 1, 50, 0, 0, "wspt-long")
		push(t, q, 1, 1, 1, 0, 1, "wspt-short")
		if got := popAll(q, all); !cmp.Equal(got[:2], []string{"fcfs-long", "wspt-short"}) {
			t.Fatalf("dispatch %v, want fcfs-long then wspt-short first", got)
		}
	})
	t.Run("drr gives exact quantum ratios for equal-cost backlogs", func(t *testing.T) {
		q := queue.New[string](matrix(t, queue.Class{Name: "one", Quantum: 1}, queue.Class{Name: "three", Quantum: 3}), epoch)
		for i := 0; i < 20; i++ {
			push(t, q, 0, 1, 1, 0, float64(i), "one")
		}
		for i := 0; i < 60; i++ {
			push(t, q, 1, 1, 1, 0, float64(i), "three")
		}
		got := popAll(q, all)
		if len(got) != 80 {
			t.Fatalf("dispatched %d of 80", len(got))
		}
		for r := 0; r < 20; r++ {
			if round := got[4*r : 4*r+4]; !cmp.Equal(round, []string{"one", "three", "three", "three"}) {
				t.Fatalf("round %d = %v, want [one three three three]", r, round)
			}
		}
	})
	t.Run("drr skips a blocked class without crediting it", func(t *testing.T) {
		q := queue.New[string](matrix(t, queue.Class{Name: "slow", Quantum: 1}, queue.Class{Name: "fast", Quantum: 3}), epoch)
		for i := 0; i < 6; i++ {
			push(t, q, 0, 1, 1, 0, float64(i), "slow")
			push(t, q, 1, 1, 1, 0, float64(i), "fast")
		}
		fast := 0
		for i := 0; i < 6; i++ {
			if q.PopNext(all).Value == "fast" {
				fast++
			}
		}
		if fast < 3 {
			t.Fatalf("fast got %d of the first six", fast)
		}
		kept := q.Deficit(1)
		onlySlow := func(c int, _ *queue.Entry[string]) bool { return c == 0 }
		for i := 0; i < 3; i++ {
			if e := q.PopNext(onlySlow); e == nil || e.Value != "slow" {
				t.Fatalf("pop %d with fast blocked = %v, want slow", i, e)
			}
			if q.Deficit(1) != kept {
				t.Fatalf("blocked class deficit moved from %d to %d", kept, q.Deficit(1))
			}
		}
	})
	t.Run("a fully blocked ring accrues no deficit", func(t *testing.T) {
		q := queue.New[string](matrix(t, queue.Class{Name: "first", Quantum: 7}, queue.Class{Name: "second", Quantum: 11}), epoch)
		push(t, q, 0, 1, 100, 0, 0, "first")
		push(t, q, 1, 1, 100, 0, 0, "second")
		none := func(int, *queue.Entry[string]) bool { return false }
		for i := 0; i < 10_000; i++ {
			if e := q.PopNext(none); e != nil {
				t.Fatalf("popped %v from a blocked ring", e.Value)
			}
		}
		if q.Deficit(0) != 0 || q.Deficit(1) != 0 || q.Len() != 2 {
			t.Fatalf("deficits %d %d len %d", q.Deficit(0), q.Deficit(1), q.Len())
		}
	})
	t.Run("an oversized head makes bounded progress in one call", func(t *testing.T) {
		q := queue.New[string](matrix(t, queue.Class{Name: "large", Quantum: 4}, queue.Class{Name: "blocked", Quantum: 100}), epoch)
		push(t, q, 0, 1, 101, 0, 0, "large")
		push(t, q, 0, 1, 101, 0, 1, "large-2")
		push(t, q, 1, 1, 1, 0, 0, "blocked")
		calls := 0
		onlyLarge := func(c int, _ *queue.Entry[string]) bool { calls++; return c == 0 }
		e := q.PopNext(onlyLarge)
		if e == nil || e.Value != "large" || q.Len() != 2 {
			t.Fatalf("popped %v len %d", e, q.Len())
		}
		// 26 whole rounds of 4 = 104 tokens of credit; 101 spent, 3 left for the next head.
		if q.Deficit(0) != 3 || q.Deficit(1) != 0 {
			t.Fatalf("deficits %d %d, want 3 0", q.Deficit(0), q.Deficit(1))
		}
		if calls > 2 {
			t.Fatalf("dispatchable asked %d times for two classes", calls)
		}
	})
	t.Run("a class that can afford its next head keeps the cursor", func(t *testing.T) {
		q := queue.New[string](matrix(t, queue.Class{Name: "a", Quantum: 10}, queue.Class{Name: "b", Quantum: 10}), epoch)
		for i := 0; i < 3; i++ {
			push(t, q, 0, 1, 5, 0, float64(i), "a")
			push(t, q, 1, 1, 5, 0, float64(i), "b")
		}
		if diff := cmp.Diff([]string{"a", "a", "b", "b", "a", "b"}, popAll(q, all)); diff != "" {
			t.Fatalf("(-want +got):\n%s", diff)
		}
	})
}

func expectRejection(t *testing.T, q *queue.Queue[string], class, endpoints int, sn queue.Snapshot, kind queue.LimitKind, current, limit uint64) {
	t.Helper()
	before := q.Stats(class)
	_, err := q.Enqueue(class, endpoints, sn, 0, 0, epoch, "rejected")
	var rej *queue.Rejection
	if !errors.As(err, &rej) {
		t.Fatalf("enqueue err = %v, want a *Rejection", err)
	}
	if rej.Kind != kind || rej.Current != current || rej.Limit != limit {
		t.Fatalf("rejection %+v, want kind %v current %d limit %d", *rej, kind, current, limit)
	}
	if q.Stats(class) != before {
		t.Fatalf("a rejection changed the stats: %+v → %+v", before, q.Stats(class))
	}
}

func TestRemoveAndDrain(t *testing.T) {
	t.Run("removing an entry updates the totals and resets an emptied class's deficit", func(t *testing.T) {
		q := queue.New[string](matrix(t, queue.Class{Name: "a", Quantum: 2}, queue.Class{Name: "b", Quantum: 2}), epoch)
		a1 := push(t, q, 0, 1, 10, 2, 0, "a1")
		a2 := push(t, q, 0, 1, 3, 1, 1, "a2")
		push(t, q, 1, 1, 3, 0, 2, "b")
		// Block b so a earns credit without being able to pay for a1 (cost 8) in one visit.
		if e := q.PopNext(func(c int, _ *queue.Entry[string]) bool { return c == 0 }); e != a1 {
			t.Fatalf("popped %v", e)
		}
		if !a2.Queued() || a1.Queued() {
			t.Fatal("Queued flags wrong")
		}
		if !q.Remove(a2) || q.Remove(a2) || q.Remove(a1) {
			t.Fatal("Remove must succeed exactly once for a queued entry")
		}
		if q.Deficit(0) != 0 || q.Stats(0) != (queue.Stats{}) || q.Len() != 1 || q.HasBacklog(0) || !q.HasBacklog(1) {
			t.Fatalf("deficit %d stats %+v len %d", q.Deficit(0), q.Stats(0), q.Len())
		}
		if got := popAll(q, all); !cmp.Equal(got, []string{"b"}) {
			t.Fatalf("rest %v", got)
		}
	})
	t.Run("drain returns every entry in dispatch order and empties the queue", func(t *testing.T) {
		q := queue.New[string](matrix(t, queue.Class{Name: "a"}, queue.Class{Name: "b"}), epoch)
		push(t, q, 1, 1, 1, 0, 0, "b1")
		push(t, q, 0, 1, 1, 0, 2, "a2")
		push(t, q, 0, 1, 1, 0, 1, "a1")
		var got []string
		for _, e := range q.Drain() {
			if e.Queued() {
				t.Fatal("drained entry still queued")
			}
			got = append(got, e.Value)
		}
		if !cmp.Equal(got, []string{"a1", "a2", "b1"}) || q.Len() != 0 || q.Total() != (queue.Stats{}) {
			t.Fatalf("drained %v len %d", got, q.Len())
		}
		if q.PopNext(all) != nil {
			t.Fatal("pop after drain")
		}
	})
	t.Run("an unknown class index is an error, not a panic", func(t *testing.T) {
		q := queue.New[string](matrix(t, queue.Class{Name: "a"}), epoch)
		if _, err := q.Enqueue(3, 1, queue.NewSnapshot(1, 0), 0, 0, epoch, "x"); err == nil || !strings.Contains(err.Error(), "class index 3") {
			t.Fatalf("err = %v", err)
		}
		if q.HasBacklog(-1) || q.Entries(9) != nil || q.Remove(nil) {
			t.Fatal("unknown class accessors")
		}
	})
}

// TestRandomOperationsKeepTheInvariants drives random enqueues, removals and pops and checks
// that totals match the entries, that every class pops in key order, and that nothing is lost.
func TestRandomOperationsKeepTheInvariants(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 9))
	q := queue.New[int](matrix(t, queue.Class{Name: "a", Quantum: 3}, queue.Class{Name: "b", Quantum: 17, Policy: queue.WSPT},
		queue.Class{Name: "c", Quantum: 1, Policy: queue.LCFS}), epoch)
	live := map[int]*queue.Entry[int]{}
	next := 0
	for step := 0; step < 20_000; step++ {
		switch op := r.IntN(10); {
		case op < 5:
			c := r.IntN(3)
			e, err := q.Enqueue(c, 1, queue.NewSnapshot(uint64(r.IntN(200)), uint64(r.IntN(100))), float64(r.IntN(3)), uint32(r.IntN(2)), at(float64(step)/10), next)
			if err != nil {
				t.Fatal(err)
			}
			live[next] = e
			next++
		case op < 7:
			for id, e := range live {
				if !q.Remove(e) {
					t.Fatalf("live entry %d not removable", id)
				}
				delete(live, id)
				break
			}
		default:
			blocked := r.IntN(3)
			e := q.PopNext(func(c int, head *queue.Entry[int]) bool {
				for _, other := range q.Entries(c) {
					if other != head && other.Queued() && orderedBefore(other, head) {
						t.Fatalf("class %d head %d is not first", c, head.Value)
					}
				}
				return c != blocked
			})
			if e != nil {
				if e.Class() == blocked || live[e.Value] != e {
					t.Fatalf("popped %d of blocked class %d", e.Value, e.Class())
				}
				delete(live, e.Value)
			}
		}
		if q.Len() != len(live) || q.Total().Requests != uint64(len(live)) {
			t.Fatalf("step %d: len %d total %d live %d", step, q.Len(), q.Total().Requests, len(live))
		}
	}
}

func orderedBefore(a, b *queue.Entry[int]) bool {
	if a.StrictPriority() != b.StrictPriority() {
		return a.StrictPriority() > b.StrictPriority()
	}
	if a.PolicyScore() != b.PolicyScore() {
		return a.PolicyScore() > b.PolicyScore()
	}
	return a.Seq() < b.Seq()
}

// BenchmarkEnqueuePop measures one Enqueue plus one PopNext on a three-class queue holding a
// steady backlog of 1,000 entries.
func BenchmarkEnqueuePop(b *testing.B) {
	q := queue.New[int](matrix(b, queue.Class{Name: "a", Quantum: 64}, queue.Class{Name: "b", Quantum: 128, Policy: queue.WSPT},
		queue.Class{Name: "c", Quantum: 256}), epoch)
	for i := 0; i < 1000; i++ {
		if _, err := q.Enqueue(i%3, 8, queue.NewSnapshot(uint64(100+i%500), uint64(i%50)), 0, 0, at(float64(i)), i); err != nil {
			b.Fatal(err)
		}
	}
	ok := func(int, *queue.Entry[int]) bool { return true }
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := q.Enqueue(i%3, 8, queue.NewSnapshot(uint64(100+i%500), uint64(i%50)), 0, 0, at(float64(1000+i)), i); err != nil {
			b.Fatal(err)
		}
		if q.PopNext(ok) == nil {
			b.Fatal("nothing popped")
		}
	}
}
