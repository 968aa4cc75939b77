package kvindex

import (
	"math/rand/v2"
	"testing"
)

// TestCumulativeTierTokens covers §12.3: lower tiers extend the device match, and the reported
// tokens are cumulative (gpu ≤ cpu ≤ disk) with the external tier folded into disk.
func TestCumulativeTierTokens(t *testing.T) {
	tests := []struct {
		name           string
		m              Match
		bs             int
		gpu, cpu, disk uint64
	}{
		{"the spec check: bs 16, device 2, host 1, disk 2 gives 32, 48, 80",
			Match{Device: 2, HostExt: 1, DiskExt: 2}, 16, 32, 48, 80},
		{"the external tier folds into disk",
			Match{Device: 1, ExternalExt: 3}, 4, 4, 4, 16},
		{"a candidate only in lower tiers has no gpu tokens",
			Match{HostExt: 2, DiskExt: 1, ExternalExt: 1}, 16, 0, 32, 64},
		{"a device-only match reports the same tokens in every tier",
			Match{Device: 5}, 16, 80, 80, 80},
		{"a block size of zero reports nothing",
			Match{Device: 5, HostExt: 1}, 0, 0, 0, 0},
		{"counts near the u32 limit do not overflow",
			Match{Device: 1<<32 - 1, HostExt: 1<<32 - 1, DiskExt: 1<<32 - 1, ExternalExt: 1<<32 - 1}, 1 << 20,
			(1<<32 - 1) << 20, 2 * (1<<32 - 1) << 20, 4 * (1<<32 - 1) << 20},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			gpu, cpu, disk := tt.m.CumulativeTokens(tt.bs)
			if gpu != tt.gpu || cpu != tt.cpu || disk != tt.disk {
				t.Fatalf("CumulativeTokens(%d) = %d, %d, %d; want %d, %d, %d", tt.bs, gpu, cpu, disk, tt.gpu, tt.cpu, tt.disk)
			}
		})
	}
	t.Run("tiered matches of random event streams are cumulative and never exceed the query", func(t *testing.T) {
		cfg := genConfig{workers: 5, ranks: 2, toks: 4, exts: 8, lowerTiers: true}
		for seed := uint64(0); seed < 20; seed++ {
			r := rand.New(rand.NewPCG(seed, 99))
			ix := New(Config{BlockSize: 16})
			for _, ev := range genEvents(r, cfg, 500) {
				_ = ix.Apply(ev)
			}
			for _, q := range genPrompts(r, ix, cfg.toks, 50) {
				for _, m := range ix.FindMatches(q, nil) {
					gpu, cpu, disk := m.CumulativeTokens(16)
					if !(gpu <= cpu && cpu <= disk && disk <= uint64(16*len(q))) || disk == 0 {
						t.Fatalf("seed %d query %v: match %+v gives gpu %d cpu %d disk %d", seed, q, m, gpu, cpu, disk)
					}
				}
			}
		}
	})
}

// TestLowerTiersExtendBlockByBlock walks one candidate's tiers block by block: each tier starts
// where the previous one stopped, and a tier that holds the next block under the wrong parent
// (another prefix) does not extend the match.
func TestLowerTiersExtendBlockByBlock(t *testing.T) {
	setup := []Event{
		store(wA, TierDevice, nil, chainBlocks(100, 1, 2)),
		store(wA, TierHostPinned, p(102), chainBlocks(100, 3)),
		store(wA, TierDisk, p(103), chainBlocks(100, 4)),
		store(wA, TierExternal, p(104), chainBlocks(100, 5)),
		// Block 6 on disk, but below another prefix (parent 109): it must not extend 1..5.
		store(wA, TierDisk, nil, chainBlocks(100, 9)),
		store(wA, TierDisk, p(109), chainBlocks(100, 6)),
	}
	tests := []struct {
		name  string
		query []uint64
		want  Match
	}{
		{"a query within the device prefix counts device only", []uint64{1, 2}, Match{Candidate: wA, Device: 2}},
		{"the host tier adds the next block", []uint64{1, 2, 3}, Match{Candidate: wA, Device: 2, HostExt: 1}},
		{"disk continues after host", []uint64{1, 2, 3, 4}, Match{Candidate: wA, Device: 2, HostExt: 1, DiskExt: 1}},
		{"external continues after disk", []uint64{1, 2, 3, 4, 5}, Match{Candidate: wA, Device: 2, HostExt: 1, DiskExt: 1, ExternalExt: 1}},
		{"a block stored below another prefix does not extend the match", []uint64{1, 2, 3, 4, 5, 6}, Match{Candidate: wA, Device: 2, HostExt: 1, DiskExt: 1, ExternalExt: 1}},
		{"a lower-tier prefix from the root matches on its own", []uint64{9, 6}, Match{Candidate: wA, DiskExt: 2}},
	}
	ix := New(Config{BlockSize: 16})
	applyAll(t, ix, setup...)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := ix.FindMatches(tt.query, nil)
			if len(got) != 1 || got[0] != tt.want {
				t.Fatalf("FindMatches(%v) = %+v, want [%+v]", tt.query, got, tt.want)
			}
		})
	}
}

// TestHashSetFindsDuplicates checks the duplicate detector of long stores against a map, across
// resets of different sizes (stale slots of earlier generations must read as empty) and across
// the wrap-around of the generation counter.
func TestHashSetFindsDuplicates(t *testing.T) {
	var h hashSet
	r := rand.New(rand.NewPCG(5, 5))
	for round, n := range []int{40, 1000, 33, 0, 500, 64, 2000, 40} {
		if round == 5 {
			h.gen = ^uint32(0) // the next reset wraps the generation
		}
		h.reset(n)
		seen := map[uint64]bool{}
		for i := 0; i < n; i++ {
			k := uint64(r.IntN(3 * n / 2)) // about a third of the keys repeat, 0 included
			if i%7 == 0 {
				k = uint64(i) << 58 // keys that differ only in the high bits
			}
			if got, want := h.add(k), !seen[k]; got != want {
				t.Fatalf("round %d (n %d): add(%d) = %t, want %t", round, n, k, got, want)
			}
			seen[k] = true
		}
	}
}

// TestApproxRecordsOnlyBookings (§15.1, §17.11): approximate mode learns from booked decisions
// only; lookups, kv_hint reads and dumps never insert anything.
func TestApproxRecordsOnlyBookings(t *testing.T) {
	a := NewApprox(ApproxConfig{BlockSize: 16})
	q := []uint64{1, 2, 3}
	for i := 0; i < 3; i++ {
		_ = a.FindMatches(q, nil)
		_ = a.ExternalHashes(wA, q, 3)
		_ = a.Dump()
	}
	if st := a.Stats(); st.Entries != 0 || st.Bookings != 0 || st.Candidates != 0 {
		t.Fatalf("queries recorded entries: %+v", st)
	}
	book(t, a, wA, at(0), q...)
	if got := a.FindMatches(q, nil); len(got) != 1 || got[0] != (Match{Candidate: wA, Device: 3}) {
		t.Fatalf("after one booking FindMatches = %+v", got)
	}
}
