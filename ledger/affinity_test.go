package ledger

import (
	"errors"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"
)

func ranked(w uint64, r uint32) AffinityTarget {
	return AffinityTarget{WorkerID: w, DPRank: r, HasRank: true}
}

func allValid(AffinityTarget) bool { return true }

func newTable(ttl time.Duration) *AffinityTable {
	return NewAffinityTable(AffinityConfig{TTL: ttl, WriterID: 7})
}

// bind runs one booking of session id on dispatched through Acquire and Commit.
func bind(t *testing.T, tab *AffinityTable, id, res string, dispatched AffinityTarget, now time.Time) AffinityHold {
	t.Helper()
	h, err := tab.Acquire(id, now, allValid)
	if err != nil {
		t.Fatalf("Acquire(%q): %v", id, err)
	}
	if _, _, err := tab.Commit(h, res, dispatched, h.Kind == HoldBound, now, allValid); err != nil {
		t.Fatalf("Commit(%q): %v", id, err)
	}
	return h
}

func wantBinding(t *testing.T, tab *AffinityTable, id string, now time.Time, want AffinityTarget, leases int) {
	t.Helper()
	got, n, ok := tab.Binding(id, now)
	if !ok || got != want || n != leases {
		t.Fatalf("Binding(%q) = %v leases %d ok %v, want %v leases %d", id, got, n, ok, want, leases)
	}
}

func TestAffinityTableLifecycle(t *testing.T) {
	const ttl = 10 * time.Second
	t.Run("a vacant session initializes and the commit binds it with one lease", func(t *testing.T) {
		tab := newTable(ttl)
		h, err := tab.Acquire("s", t0, allValid)
		if err != nil || h.Kind != HoldInitializing {
			t.Fatalf("Acquire = %+v %v", h, err)
		}
		if _, ok, _ := tab.Lookup("s", t0, allValid); ok {
			t.Fatal("an initializing entry steers a query-only select")
		}
		u, changed, err := tab.Commit(h, "r1", ranked(1, 0), false, t0, allValid)
		if err != nil || !changed || u.Target != ranked(1, 0) || u.Version.WriterID != 7 || u.Version.Sequence == 0 {
			t.Fatalf("Commit = %+v %v %v", u, changed, err)
		}
		wantBinding(t, tab, "s", t0, ranked(1, 0), 1)
	})
	t.Run("a bound session steers and each booking adds a lease", func(t *testing.T) {
		tab := newTable(ttl)
		bind(t, tab, "s", "r1", ranked(1, 0), t0)
		h := bind(t, tab, "s", "r2", ranked(1, 0), t0)
		if h.Kind != HoldBound || h.Target != ranked(1, 0) {
			t.Fatalf("second hold = %+v", h)
		}
		wantBinding(t, tab, "s", t0, ranked(1, 0), 2)
		if tgt, ok, _ := tab.Lookup("s", t0, allValid); !ok || tgt != ranked(1, 0) {
			t.Fatalf("Lookup = %v %v", tgt, ok)
		}
	})
	t.Run("the idle TTL starts when the last lease is released", func(t *testing.T) {
		tab := newTable(ttl)
		bind(t, tab, "s", "r1", ranked(1, 0), t0)
		bind(t, tab, "s", "r2", ranked(1, 0), t0)
		tab.Release("s", "r1", t0.Add(time.Hour))
		if _, _, ok := tab.Binding("s", t0.Add(2*time.Hour)); !ok {
			t.Fatal("a binding with a live lease expired")
		}
		if _, ok := tab.Release("s", "r1", t0); ok {
			t.Fatal("a lease was released twice")
		}
		last := t0.Add(3 * time.Hour)
		tab.Release("s", "r2", last)
		if _, _, ok := tab.Binding("s", last.Add(ttl)); !ok {
			t.Fatal("binding expired at its deadline (it expires past it)")
		}
		if _, _, ok := tab.Binding("s", last.Add(ttl+time.Nanosecond)); ok {
			t.Fatal("idle binding alive past its deadline")
		}
		if tab.Len() != 0 {
			t.Fatalf("lazy expiry left %d entries", tab.Len())
		}
	})
	t.Run("the reaper drops idle bindings past their deadline only", func(t *testing.T) {
		tab := newTable(ttl)
		for i := range 3 {
			id := strconv.Itoa(i)
			bind(t, tab, id, "r"+id, ranked(1, 0), t0)
			tab.Release(id, "r"+id, t0.Add(time.Duration(i)*time.Second))
		}
		bind(t, tab, "busy", "rb", ranked(1, 0), t0)
		if n := tab.Reap(t0.Add(ttl + 1500*time.Millisecond)); n != 2 {
			t.Fatalf("Reap dropped %d, want 2", n)
		}
		if tab.Len() != 2 {
			t.Fatalf("Len = %d, want the last idle and the busy one", tab.Len())
		}
		if tab.ReapInterval() != ttl {
			t.Fatalf("ReapInterval = %v", tab.ReapInterval())
		}
		if got := newTable(time.Hour).ReapInterval(); got != 30*time.Second {
			t.Fatalf("ReapInterval for a 1 h TTL = %v, want 30 s", got)
		}
	})
	t.Run("a session id over 256 bytes is rejected", func(t *testing.T) {
		tab := newTable(ttl)
		if _, err := tab.Acquire(strings.Repeat("x", 257), t0, allValid); !errors.Is(err, ErrSessionIDTooLong) {
			t.Fatalf("Acquire = %v", err)
		}
		if _, _, err := tab.Lookup(strings.Repeat("x", 257), t0, allValid); !errors.Is(err, ErrSessionIDTooLong) {
			t.Fatalf("Lookup = %v", err)
		}
		if _, err := tab.Acquire(strings.Repeat("x", 256), t0, allValid); err != nil {
			t.Fatalf("256 bytes rejected: %v", err)
		}
	})
	t.Run("a full table routes new sessions unpinned and commits nothing", func(t *testing.T) {
		tab := NewAffinityTable(AffinityConfig{TTL: ttl, MaxEntries: 2})
		bind(t, tab, "a", "ra", ranked(1, 0), t0)
		bind(t, tab, "b", "rb", ranked(1, 0), t0)
		h, err := tab.Acquire("c", t0, allValid)
		if err != nil || h.Kind != HoldUnpinned {
			t.Fatalf("Acquire on a full table = %+v %v", h, err)
		}
		if _, changed, err := tab.Commit(h, "rc", ranked(2, 0), false, t0, allValid); changed || err != nil {
			t.Fatal("an unpinned hold committed")
		}
		if tab.Len() != 2 {
			t.Fatalf("Len = %d", tab.Len())
		}
		// Once an idle binding expires there is room again.
		tab.Release("a", "ra", t0)
		if h, _ := tab.Acquire("c", t0.Add(ttl+time.Second), allValid); h.Kind != HoldInitializing {
			t.Fatalf("Acquire after expiry = %+v", h)
		}
	})
	t.Run("the default cap is 65,536 entries per table", func(t *testing.T) {
		tab := newTable(ttl)
		for i := range DefaultAffinityMaxEntries {
			h, _ := tab.Acquire(strconv.Itoa(i), t0, allValid)
			if h.Kind != HoldInitializing {
				t.Fatalf("entry %d not admitted", i)
			}
		}
		if h, _ := tab.Acquire("one-more", t0, allValid); h.Kind != HoldUnpinned {
			t.Fatalf("entry 65,537 = %+v", h)
		}
	})
	t.Run("an aborted initialization leaves the session vacant", func(t *testing.T) {
		tab := newTable(ttl)
		h, _ := tab.Acquire("s", t0, allValid)
		tab.Abort(h, t0)
		if tab.Len() != 0 {
			t.Fatal("aborted initialization kept its entry")
		}
	})
	t.Run("an aborted bound hold gives its lease back", func(t *testing.T) {
		tab := newTable(ttl)
		bind(t, tab, "s", "r1", ranked(1, 0), t0)
		h, _ := tab.Acquire("s", t0, allValid)
		wantBinding(t, tab, "s", t0, ranked(1, 0), 2)
		tab.Abort(h, t0)
		wantBinding(t, tab, "s", t0, ranked(1, 0), 1)
	})
	t.Run("lease sweep releases leases whose reservation is gone", func(t *testing.T) {
		tab := newTable(ttl)
		bind(t, tab, "s", "r1", ranked(1, 0), t0)
		bind(t, tab, "s", "r2", ranked(1, 0), t0)
		n := tab.SweepLeases(func(_, r string) bool { return r == "r2" }, t0)
		if n != 1 {
			t.Fatalf("swept %d", n)
		}
		wantBinding(t, tab, "s", t0, ranked(1, 0), 1)
		tab.SweepLeases(func(string, string) bool { return false }, t0)
		if _, _, ok := tab.Binding("s", t0.Add(ttl+time.Second)); ok {
			t.Fatal("the idle TTL did not start after the sweep released the last lease")
		}
	})
}

// Acceptance 50 and 52-53 at the table level: departures re-initialize, hard-mode conflicts drop
// the binding, and failovers behind an initializing hold keep the committed replacement.
func TestAffinityTableHardMode(t *testing.T) {
	const ttl = time.Minute
	t.Run("a departed target re-initializes and the session rebinds", func(t *testing.T) {
		tab := newTable(ttl)
		bind(t, tab, "s", "r1", ranked(1, 0), t0)
		gone := func(tg AffinityTarget) bool { return tg.WorkerID != 1 }
		if _, ok, _ := tab.Lookup("s", t0, gone); ok {
			t.Fatal("Lookup steers to a departed worker")
		}
		h, _ := tab.Acquire("s", t0, gone)
		if h.Kind != HoldInitializing {
			t.Fatalf("Acquire with a departed target = %+v", h)
		}
		if _, _, err := tab.Commit(h, "r2", ranked(2, 0), false, t0, gone); err != nil {
			t.Fatal(err)
		}
		wantBinding(t, tab, "s", t0, ranked(2, 0), 1)
		// The old reservation's release does not touch the new binding.
		tab.Release("s", "r1", t0)
		wantBinding(t, tab, "s", t0, ranked(2, 0), 1)
	})
	t.Run("a dispatch away from the binding conflicts and drops it", func(t *testing.T) {
		tab := newTable(ttl)
		bind(t, tab, "s", "r1", ranked(1, 0), t0)
		for _, tc := range []struct {
			name       string
			dispatched AffinityTarget
		}{
			{"another worker", ranked(2, 0)},
			{"another rank", ranked(1, 1)},
		} {
			t.Run(tc.name, func(t *testing.T) {
				bind(t, tab, "s", "r1", ranked(1, 0), t0)
				h, _ := tab.Acquire("s", t0, allValid)
				_, _, err := tab.Commit(h, "r9", tc.dispatched, false, t0, allValid)
				if !errors.Is(err, ErrAffinityConflict) || !strings.HasPrefix(err.Error(), "session affinity conflict: ") {
					t.Fatalf("Commit = %v", err)
				}
				if _, _, ok := tab.Binding("s", t0); ok {
					t.Fatal("conflicting binding kept")
				}
				// The next request re-initializes.
				if h, _ := tab.Acquire("s", t0, allValid); h.Kind != HoldInitializing {
					t.Fatalf("next Acquire = %+v", h)
				}
				tab.Abort(h, t0)
			})
		}
	})
	t.Run("a worker-only binding accepts any rank it steered to but not an added rank", func(t *testing.T) {
		tab := newTable(ttl)
		tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: AffinityTarget{WorkerID: 1}, Version: AffinityVersion{1, 99}}, t0)
		h, _ := tab.Acquire("s", t0, allValid)
		if h.Kind != HoldBound || h.Target.HasRank {
			t.Fatalf("Acquire = %+v", h)
		}
		if _, _, err := tab.Commit(h, "r1", ranked(1, 3), true, t0, allValid); err != nil {
			t.Fatalf("steered dispatch: %v", err)
		}
		wantBinding(t, tab, "s", t0, AffinityTarget{WorkerID: 1}, 1)
		h, _ = tab.Acquire("s", t0, allValid)
		if _, _, err := tab.Commit(h, "r2", ranked(1, 3), false, t0, allValid); !errors.Is(err, ErrAffinityConflict) {
			t.Fatalf("unsteered dispatch adding a rank = %v", err)
		}
	})
	t.Run("a worker departing after the hold re-binds to the new worker", func(t *testing.T) {
		tab := newTable(ttl)
		bind(t, tab, "s", "r1", ranked(1, 0), t0)
		h, _ := tab.Acquire("s", t0, allValid) // worker 1 still there at hold time
		gone := func(tg AffinityTarget) bool { return tg.WorkerID != 1 }
		if _, _, err := tab.Commit(h, "r2", ranked(2, 0), false, t0, gone); err != nil {
			t.Fatalf("Commit after departure: %v", err)
		}
		// A fresh binding: leases of reservations on the departed worker do not carry over.
		wantBinding(t, tab, "s", t0, ranked(2, 0), 1)
	})
	t.Run("concurrent holds on a departed worker both land on the replacement", func(t *testing.T) {
		tab := newTable(ttl)
		bind(t, tab, "s", "r0", ranked(1, 0), t0)
		gone := func(tg AffinityTarget) bool { return tg.WorkerID != 1 }
		first, _ := tab.Acquire("s", t0, gone)
		second, _ := tab.Acquire("s", t0, gone) // joins the re-initialization
		if first.Kind != HoldInitializing || second.Kind != HoldInitializing {
			t.Fatalf("holds = %+v / %+v", first, second)
		}
		if _, _, err := tab.Commit(first, "r1", ranked(2, 0), false, t0, gone); err != nil {
			t.Fatal(err)
		}
		// The failover commit behind the initializing hold keeps a lease on the replacement.
		if _, _, err := tab.Commit(second, "r2", ranked(2, 0), false, t0, gone); err != nil {
			t.Fatal(err)
		}
		wantBinding(t, tab, "s", t0, ranked(2, 0), 2)
	})
	t.Run("a late failover mismatch preserves the committed replacement", func(t *testing.T) {
		tab := newTable(ttl)
		first, _ := tab.Acquire("s", t0, allValid)
		second, _ := tab.Acquire("s", t0, allValid)
		if _, _, err := tab.Commit(first, "r1", ranked(2, 0), false, t0, allValid); err != nil {
			t.Fatal(err)
		}
		if _, _, err := tab.Commit(second, "r2", ranked(3, 0), false, t0, allValid); !errors.Is(err, ErrAffinityConflict) {
			t.Fatalf("late mismatch = %v", err)
		}
		wantBinding(t, tab, "s", t0, ranked(2, 0), 1)
	})
}

// The replication apply rules of §12.1 (the seam replica sync plugs into).
func TestAffinityApplyRemote(t *testing.T) {
	const ttl = time.Minute
	v := func(seq, w uint64) AffinityVersion { return AffinityVersion{Sequence: seq, WriterID: w} }
	t.Run("vacant inserts an idle binding", func(t *testing.T) {
		tab := newTable(ttl)
		if !tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: ranked(1, 0), Version: v(5, 9)}, t0) {
			t.Fatal("not applied")
		}
		wantBinding(t, tab, "s", t0, ranked(1, 0), 0)
		if _, _, ok := tab.Binding("s", t0.Add(ttl+time.Second)); ok {
			t.Fatal("remote binding without leases did not expire after the TTL")
		}
	})
	t.Run("a peer's sequence of 2^64-1 does not make the next local version wrap to 0", func(t *testing.T) {
		tab := newTable(ttl)
		tab.ApplyRemote(AffinityUpdate{SessionID: "other", Target: ranked(1, 0), Version: v(math.MaxUint64, 9)}, t0)
		h, err := tab.Acquire("s", t0, allValid)
		if err != nil {
			t.Fatal(err)
		}
		u, _, err := tab.Commit(h, "r1", ranked(1, 0), false, t0, allValid)
		if err != nil || u.Version.Sequence != math.MaxUint64 {
			t.Fatalf("local version %+v, %v; want the saturated sequence 2^64-1", u.Version, err)
		}
	})
	t.Run("own writer id is dropped", func(t *testing.T) {
		tab := newTable(ttl)
		if tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: ranked(1, 0), Version: v(5, 7)}, t0) {
			t.Fatal("own update applied")
		}
	})
	t.Run("different target needs a strictly newer version", func(t *testing.T) {
		tab := newTable(ttl)
		tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: ranked(1, 0), Version: v(5, 9)}, t0)
		if tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: ranked(2, 0), Version: v(5, 9)}, t0) {
			t.Fatal("equal version replaced the target")
		}
		if tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: ranked(2, 0), Version: v(4, 99)}, t0) {
			t.Fatal("older version replaced the target")
		}
		if !tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: ranked(2, 0), Version: v(5, 10)}, t0) {
			t.Fatal("newer version did not replace")
		}
		wantBinding(t, tab, "s", t0, ranked(2, 0), 0)
	})
	t.Run("same target with an equal or newer version refreshes the deadline", func(t *testing.T) {
		tab := newTable(ttl)
		tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: ranked(1, 0), Version: v(5, 9)}, t0)
		later := t0.Add(ttl / 2)
		if !tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: ranked(1, 0), Version: v(5, 9)}, later) {
			t.Fatal("refresh not applied")
		}
		if _, _, ok := tab.Binding("s", t0.Add(ttl+time.Second)); !ok {
			t.Fatal("deadline not refreshed")
		}
	})
	t.Run("a local initializing entry ignores remote updates", func(t *testing.T) {
		tab := newTable(ttl)
		h, _ := tab.Acquire("s", t0, allValid)
		if tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: ranked(2, 0), Version: v(1<<62, 9)}, t0) {
			t.Fatal("remote update overrode an initializing entry")
		}
		tab.Commit(h, "r1", ranked(1, 0), false, t0, allValid)
		wantBinding(t, tab, "s", t0, ranked(1, 0), 1)
	})
	t.Run("local versions are bumped past observed remote sequences", func(t *testing.T) {
		tab := newTable(ttl)
		far := uint64(t0.UnixNano()) + 1_000_000
		tab.ApplyRemote(AffinityUpdate{SessionID: "x", Target: ranked(1, 0), Version: v(far, 9)}, t0)
		h, _ := tab.Acquire("s", t0, allValid)
		u, _, _ := tab.Commit(h, "r1", ranked(1, 0), false, t0, allValid)
		if u.Version.Sequence <= far {
			t.Fatalf("local sequence %d not past remote %d", u.Version.Sequence, far)
		}
	})
	t.Run("an expired entry is replaced", func(t *testing.T) {
		tab := newTable(ttl)
		tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: ranked(1, 0), Version: v(5, 9)}, t0)
		if !tab.ApplyRemote(AffinityUpdate{SessionID: "s", Target: ranked(2, 0), Version: v(1, 9)}, t0.Add(2*ttl)) {
			t.Fatal("expired entry not replaced")
		}
	})
}

// BenchmarkAffinityBindRelease measures one booking's Acquire + Commit + Release on a bound
// session in a table of 65,536 sessions.
func BenchmarkAffinityBindRelease(b *testing.B) {
	tab := newTable(time.Minute)
	for i := range DefaultAffinityMaxEntries - 1 {
		h, _ := tab.Acquire(strconv.Itoa(i), t0, allValid)
		tab.Commit(h, "r", ranked(1, 0), false, t0, allValid)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		h, _ := tab.Acquire("bench", t0, allValid)
		tab.Commit(h, "r", ranked(1, 0), h.Kind == HoldBound, t0, allValid)
		tab.Release("bench", "r", t0)
	}
}
