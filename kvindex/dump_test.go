package kvindex

import (
	"encoding/json"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestDumpFormat(t *testing.T) {
	ix := New(Config{BlockSize: 4})
	applyAll(t, ix,
		store(wB, TierDevice, nil, chainBlocks(200, 1)),
		store(wA, TierDevice, nil, chainBlocks(100, 1, 2)),
		store(wA, TierDevice, nil, chainBlocks(100, 5)),
		store(wA, TierHostPinned, p(102), chainBlocks(100, 3)))
	got, err := json.Marshal(ix.Dump())
	if err != nil {
		t.Fatal(err)
	}
	want := `[` +
		`{"worker_id":1,"storage_tier":"device","event":{"event_id":0,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":101,"tokens_hash":1}]}},"dp_rank":0}},` +
		`{"worker_id":2,"storage_tier":"device","event":{"event_id":1,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":201,"tokens_hash":1}]}},"dp_rank":0}},` +
		`{"worker_id":1,"storage_tier":"device","event":{"event_id":2,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":105,"tokens_hash":5}]}},"dp_rank":0}},` +
		`{"worker_id":1,"storage_tier":"device","event":{"event_id":3,"data":{"stored":{"parent_hash":101,"blocks":[{"block_hash":102,"tokens_hash":2}]}},"dp_rank":0}}` +
		`]`
	t.Run("dump is breadth-first single-block device stores with per-worker parents and sequential ids", func(t *testing.T) {
		if string(got) != want {
			t.Fatalf("got\n%s\nwant\n%s", got, want)
		}
	})
	t.Run("dumping does not change the index", func(t *testing.T) {
		again, _ := json.Marshal(ix.Dump())
		if string(again) != want {
			t.Fatal("second dump differs")
		}
	})
}

func TestDumpSkipsOrphans(t *testing.T) {
	ix := New(Config{})
	applyAll(t, ix,
		store(wA, TierDevice, nil, chainBlocks(100, 1, 2, 3)),
		store(wB, TierDevice, nil, chainBlocks(200, 1, 2, 3)),
		removed(wB, TierDevice, 201)) // B keeps 2 and 3 below a node it left
	var who []Candidate
	for _, ev := range ix.Dump() {
		if ev.WorkerID == wB.WorkerID {
			who = append(who, Event(ev).Candidate())
		}
	}
	if len(who) != 0 {
		t.Fatalf("orphaned entries of B were dumped: %v", who)
	}
	restored := New(Config{})
	if err := restored.Restore(ix.Dump()); err != nil {
		t.Fatalf("restore of a dump with orphans skipped failed: %v", err)
	}
	if diff := cmp.Diff(matches(ix, 1, 2, 3), matches(restored, 1, 2, 3)); diff != "" {
		t.Fatal(diff)
	}
}

func TestRouterEventJSON(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want Event
	}{
		{
			name: "a stored event with a parent decodes every field",
			in:   `{"worker_id":7,"storage_tier":"host_pinned","event":{"event_id":9,"dp_rank":2,"data":{"stored":{"parent_hash":18446744073709551615,"blocks":[{"block_hash":18446744073709551614,"tokens_hash":12345678901234567890}]}}}}`,
			want: Event{WorkerID: 7, DPRank: 2, Tier: TierHostPinned, EventID: 9, Kind: EventStored, HasParent: true,
				ParentHash: 18446744073709551615, Blocks: []StoredBlock{{BlockHash: 18446744073709551614, TokensHash: 12345678901234567890}}},
		},
		{
			name: "a missing storage tier defaults to device and unknown upstream fields are ignored",
			in:   `{"worker_id":1,"residency_domain":"x","event":{"event_id":0,"dp_rank":0,"state_source":"y","data":{"stored":{"parent_hash":null,"start_position":3,"blocks":[{"block_hash":1,"tokens_hash":2,"mm_extra_info":{"a":1}}]}}}}`,
			want: Event{WorkerID: 1, Tier: TierDevice, Kind: EventStored, Blocks: []StoredBlock{{BlockHash: 1, TokensHash: 2}}},
		},
		{
			name: "a removed event decodes its hashes",
			in:   `{"worker_id":3,"storage_tier":"disk","event":{"event_id":4,"dp_rank":1,"data":{"removed":{"block_hashes":[5,18446744073709551615]}}}}`,
			want: Event{WorkerID: 3, DPRank: 1, Tier: TierDisk, EventID: 4, Kind: EventRemoved, BlockHashes: []uint64{5, 18446744073709551615}},
		},
		{
			name: "cleared is a bare string",
			in:   `{"worker_id":3,"storage_tier":"external","event":{"event_id":4,"dp_rank":1,"data":"cleared"}}`,
			want: Event{WorkerID: 3, DPRank: 1, Tier: TierExternal, EventID: 4, Kind: EventCleared},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name+" and re-encodes to the same event", func(t *testing.T) {
			var re RouterEvent
			if err := json.Unmarshal([]byte(tt.in), &re); err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.want, Event(re)); diff != "" {
				t.Fatalf("(-want +got):\n%s", diff)
			}
			b, err := json.Marshal(re)
			if err != nil {
				t.Fatal(err)
			}
			var back RouterEvent
			if err := json.Unmarshal(b, &back); err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.want, Event(back)); diff != "" {
				t.Fatalf("round trip (-want +got):\n%s", diff)
			}
		})
	}
	bad := []struct {
		name, in, wantErr string
	}{
		{"an unknown data variant is rejected", `{"worker_id":1,"event":{"event_id":0,"dp_rank":0,"data":{"moved":{}}}}`, `unknown event.data variant "moved"`},
		{"an unknown string variant is rejected", `{"worker_id":1,"event":{"event_id":0,"dp_rank":0,"data":"wiped"}}`, `unknown event.data variant "wiped"`},
		{"two variants at once are rejected", `{"worker_id":1,"event":{"event_id":0,"dp_rank":0,"data":{"stored":{"blocks":[]},"removed":{"block_hashes":[]}}}}`, "exactly one variant"},
		{"missing data is rejected", `{"worker_id":1,"event":{"event_id":0,"dp_rank":0}}`, "missing event.data"},
		{"an unknown storage tier is rejected", `{"worker_id":1,"storage_tier":"tape","event":{"event_id":0,"dp_rank":0,"data":"cleared"}}`, `unknown storage_tier "tape"`},
		{"a negative hash is rejected", `{"worker_id":1,"event":{"event_id":0,"dp_rank":0,"data":{"removed":{"block_hashes":[-1]}}}}`, "removed"},
		{"a float hash is rejected", `{"worker_id":1,"event":{"event_id":0,"dp_rank":0,"data":{"removed":{"block_hashes":[1.5]}}}}`, "removed"},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			var re RouterEvent
			err := json.Unmarshal([]byte(tt.in), &re)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
	t.Run("marshalling an invalid kind or tier is an error", func(t *testing.T) {
		if _, err := json.Marshal(RouterEvent{Kind: 9}); !errors.Is(err, ErrInvalidEvent) {
			t.Fatalf("kind: %v", err)
		}
		if _, err := json.Marshal(RouterEvent{Kind: EventCleared, Tier: 9}); !errors.Is(err, ErrInvalidEvent) {
			t.Fatalf("tier: %v", err)
		}
	})
}

func TestTierNames(t *testing.T) {
	for _, tt := range []struct {
		tier Tier
		name string
	}{{TierDevice, "device"}, {TierHostPinned, "host_pinned"}, {TierDisk, "disk"}, {TierExternal, "external"}} {
		t.Run(tt.name+" round-trips through ParseTier", func(t *testing.T) {
			if tt.tier.String() != tt.name {
				t.Fatalf("String %q", tt.tier.String())
			}
			got, err := ParseTier(tt.name)
			if err != nil || got != tt.tier {
				t.Fatalf("ParseTier %v %v", got, err)
			}
		})
	}
	t.Run("the empty name is the device default", func(t *testing.T) {
		if got, err := ParseTier(""); err != nil || got != TierDevice {
			t.Fatalf("%v %v", got, err)
		}
	})
	t.Run("an unknown name is an error naming it", func(t *testing.T) {
		if _, err := ParseTier("GPU"); err == nil || !strings.Contains(err.Error(), `"GPU"`) {
			t.Fatalf("%v", err)
		}
	})
}

// deviceOnly reduces matches to their device part, dropping candidates with no device blocks.
func deviceOnly(ms []Match) []Match {
	var out []Match
	for _, m := range ms {
		if m.Device > 0 {
			out = append(out, Match{Candidate: m.Candidate, Device: m.Device})
		}
	}
	return out
}

// TestDumpRestoreProperty: random event streams (several workers and ranks, stores with parents,
// removals, clears, lower tiers) applied, dumped, JSON-encoded, decoded and restored into an empty
// index give identical device-tier FindMatches for random prompts.
func TestDumpRestoreProperty(t *testing.T) {
	cfgs := []genConfig{
		{workers: 4, ranks: 2, toks: 4, exts: 8, lowerTiers: true},
		{workers: 40, ranks: 3, toks: 6, exts: 12},
	}
	for ci, cfg := range cfgs {
		for seed := uint64(0); seed < 30; seed++ {
			r := rand.New(rand.NewPCG(seed, uint64(ci)))
			ix := New(Config{BlockSize: 16})
			for _, ev := range genEvents(r, cfg, 400) {
				_ = ix.Apply(ev)
			}
			raw, err := json.Marshal(ix.Dump())
			if err != nil {
				t.Fatal(err)
			}
			var evs []RouterEvent
			if err := json.Unmarshal(raw, &evs); err != nil {
				t.Fatal(err)
			}
			restored := New(Config{BlockSize: 16})
			if err := restored.Restore(evs); err != nil {
				t.Fatalf("config %d seed %d: restore: %v", ci, seed, err)
			}
			for _, q := range genPrompts(r, ix, cfg.toks, 40) {
				want := matches(ix, q...)
				if cfg.lowerTiers {
					want = deviceOnly(want) // lower tiers are not dumped (§14.1)
				}
				got := matches(restored, q...)
				if diff := cmp.Diff(want, got); diff != "" {
					t.Fatalf("config %d seed %d query %v (-original +restored):\n%s", ci, seed, q, diff)
				}
				for _, m := range got {
					if diff := cmp.Diff(ix.ExternalHashes(m.Candidate, q, len(q)), restored.ExternalHashes(m.Candidate, q, len(q))); diff != "" {
						t.Fatalf("config %d seed %d query %v: external hashes of %v (-original +restored):\n%s", ci, seed, q, m.Candidate, diff)
					}
				}
			}
			// A second dump of the restored index is identical: the dump is canonical.
			raw2, _ := json.Marshal(restored.Dump())
			if string(raw2) != string(raw) {
				t.Fatalf("config %d seed %d: dump of the restored index differs", ci, seed)
			}
		}
	}
}

func TestRestoreReportsFailuresAndAppliesTheRest(t *testing.T) {
	ix := New(Config{})
	evs := []RouterEvent{
		RouterEvent(store(wA, TierDevice, p(77), chainBlocks(100, 1))), // unknown parent
		RouterEvent(store(wB, TierDevice, nil, chainBlocks(200, 1))),
		RouterEvent(removed(wB, TierDevice, 999)), // unknown block
	}
	err := ix.Restore(evs)
	if !errors.Is(err, ErrParentBlockNotFound) || !strings.Contains(err.Error(), "2 of 3 events failed") {
		t.Fatalf("error %v", err)
	}
	if diff := cmp.Diff([]Match{{Candidate: wB, Device: 1}}, matches(ix, 1)); diff != "" {
		t.Fatal(diff)
	}
}

func TestNamesAndAccessors(t *testing.T) {
	tests := []struct{ name, got, want string }{
		{"event kinds render as their JSON tags", EventStored.String() + "," + EventRemoved.String() + "," + EventCleared.String(), "stored,removed,cleared"},
		{"an unknown kind renders its number", EventKind(9).String(), "kind(9)"},
		{"an unknown tier renders its number", Tier(7).String(), "tier(7)"},
		{"a candidate renders with the field's terms", cand(7, 3).String(), "worker 7 dp_rank 3"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.got != tt.want {
				t.Fatalf("got %q want %q", tt.got, tt.want)
			}
		})
	}
	t.Run("a tier marshals as its JSON name and an invalid one fails", func(t *testing.T) {
		b, err := json.Marshal(TierDisk)
		if err != nil || string(b) != `"disk"` {
			t.Fatalf("%s %v", b, err)
		}
		if _, err := json.Marshal(Tier(9)); err == nil {
			t.Fatal("invalid tier marshalled")
		}
	})
	t.Run("block size is reported as configured", func(t *testing.T) {
		if New(Config{BlockSize: 16}).BlockSize() != 16 || NewApprox(ApproxConfig{BlockSize: 32}).BlockSize() != 32 {
			t.Fatal("block size lost")
		}
	})
}

// TestCanonicalDecodeMatchesEncodingJSON: for random events of every kind and tier, the direct
// scan of the canonical encoding and the generic encoding/json path decode to the same event, and
// the scan declines (leaving the generic path to decide) every input that is not exactly
// canonical.
func TestCanonicalDecodeMatchesEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 9))
	hash := func() uint64 {
		switch r.IntN(4) {
		case 0:
			return 0
		case 1:
			return ^uint64(0)
		}
		return r.Uint64() >> r.IntN(64)
	}
	for i := 0; i < 2000; i++ {
		ev := Event{WorkerID: hash(), DPRank: uint32(hash()), Tier: Tier(r.IntN(numTiers)), EventID: hash(), Kind: EventKind(1 + r.IntN(3))}
		switch ev.Kind {
		case EventStored:
			ev.HasParent = r.IntN(2) == 0
			if ev.HasParent {
				ev.ParentHash = hash()
			}
			ev.Blocks = []StoredBlock{}
			for n := r.IntN(4); n > 0; n-- {
				ev.Blocks = append(ev.Blocks, StoredBlock{BlockHash: hash(), TokensHash: hash()})
			}
		case EventRemoved:
			ev.BlockHashes = []uint64{}
			for n := r.IntN(4); n > 0; n-- {
				ev.BlockHashes = append(ev.BlockHashes, hash())
			}
		}
		b, err := json.Marshal(RouterEvent(ev))
		if err != nil {
			t.Fatal(err)
		}
		var fast RouterEvent
		if !decodeCanonical(b, &fast) {
			t.Fatalf("canonical encoding %s was not scanned", b)
		}
		generic := decodeGeneric(t, b)
		if diff := cmp.Diff(generic, Event(fast)); diff != "" {
			t.Fatalf("%s (-encoding/json +scan):\n%s", b, diff)
		}
		if diff := cmp.Diff(ev, Event(fast)); diff != "" {
			t.Fatalf("%s (-encoded +decoded):\n%s", b, diff)
		}
		// Any single-byte change is either still exactly canonical (and then decoded like
		// encoding/json decodes it) or declined.
		m := []byte(string(b))
		m[r.IntN(len(m))] = "0123456789 ,:{}[]\"-.enul"[r.IntN(24)]
		var got RouterEvent
		if decodeCanonical(m, &got) {
			if diff := cmp.Diff(decodeGeneric(t, m), Event(got)); diff != "" {
				t.Fatalf("mutated %s (-encoding/json +scan):\n%s", m, diff)
			}
		}
	}
}

// decodeGeneric decodes b with the encoding/json path of RouterEvent.UnmarshalJSON.
func decodeGeneric(t *testing.T, b []byte) Event {
	t.Helper()
	var re RouterEvent
	if err := re.unmarshalGeneric(b); err != nil {
		t.Fatalf("encoding/json rejects %s: %v", b, err)
	}
	return Event(re)
}
