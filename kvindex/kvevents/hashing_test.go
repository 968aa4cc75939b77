package kvevents_test

import (
	"testing"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

// applyBatches converts batches of one worker (rank 0, block size 4) and applies them to ix,
// failing the test on any drop or index error.
func applyBatches(t *testing.T, ix *kvindex.Index, worker uint64, batches ...[]kt.Event) {
	t.Helper()
	conv := kvevents.NewConverter(worker, 0, 4, false)
	for seq, events := range batches {
		evs, errs := conv.Convert(decode(t, nil, events...), uint64(seq), nil)
		if len(errs) != 0 {
			t.Fatalf("batch %d dropped events: %v", seq, errs)
		}
		for _, ev := range evs {
			if err := ix.Apply(ev); err != nil {
				t.Fatalf("batch %d: %v", seq, err)
			}
		}
	}
}

// deviceOf returns worker's device overlap with q.
func deviceOf(ix *kvindex.Index, worker uint64, q []uint64) uint32 {
	for _, m := range ix.FindMatches(q, nil) {
		if m.Candidate.WorkerID == worker {
			return m.Device
		}
	}
	return 0
}

// TestQueryHashingEqualsEventHashing (§17.2, §8.4, §8.5): a prompt hashed on the query side with
// kvindex.Seed(lora, namespace) and its multimodal hashes matches exactly the blocks an engine
// reported for the same salt and items, and a query with any other salt matches nothing.
func TestQueryHashingEqualsEventHashing(t *testing.T) {
	toks := []uint32{0, 1, 2, 3, 4, 5, 6, 7}
	query := func(lora, ns string, mm [][]uint64) []uint64 {
		return kvindex.AppendBlockHashes(nil, toks, 4, kvindex.Seed(lora, ns), mm)
	}
	both := kt.Stored(nil, []uint64{11, 12}, toks, 4)
	tests := []struct {
		name    string
		batches [][]kt.Event
		match   []uint64   // must match both blocks
		others  [][]uint64 // must match nothing
	}{
		{
			name:    "an unsalted store matches the unsalted query only",
			batches: [][]kt.Event{{both}},
			match:   query("", "", nil),
			others:  [][]uint64{query("adapter-a", "", nil), query("", "tenant-a", nil)},
		},
		{
			name:    "a LoRA store matches only a query salted with that LoRA",
			batches: [][]kt.Event{{both.WithLoraName("adapter-a")}},
			match:   query("adapter-a", "", nil),
			others:  [][]uint64{query("", "", nil), query("adapter-b", "", nil), query("adapter-a", "tenant-a", nil)},
		},
		{
			name:    "a map-form cache_salt store matches only that namespace",
			batches: [][]kt.Event{{both.WithCacheSalt("tenant-a")}},
			match:   query("", "tenant-a", nil),
			others:  [][]uint64{query("", "", nil), query("", "tenant-b", nil)},
		},
		{
			name:    "vLLM's extra_keys cache salt matches that namespace",
			batches: [][]kt.Event{{both.WithExtraKeys([]any{"tenant-a"}, nil)}},
			match:   query("", "tenant-a", nil),
			others:  [][]uint64{query("", "", nil)},
		},
		{
			name:    "LoRA and namespace together match only both",
			batches: [][]kt.Event{{both.WithLoraName("adapter-a").WithExtraKeys([]any{"dynamo-cache-salt:tenant-a"}, nil)}},
			match:   query("adapter-a", "tenant-a", nil),
			others:  [][]uint64{query("adapter-a", "", nil), query("", "tenant-a", nil)},
		},
		{
			name: "a child store inherits its parent's namespace across batches",
			batches: [][]kt.Event{
				{kt.Stored(nil, []uint64{11}, toks[:4], 4).WithCacheSalt("tenant-a")},
				{kt.Stored(kt.Parent(11), []uint64{12}, toks[4:], 4)},
			},
			match:  query("", "tenant-a", nil),
			others: [][]uint64{query("", "", nil)},
		},
		{
			name:    "multimodal blocks match the query with the same items, sorted",
			batches: [][]kt.Event{{both.WithExtraKeys([]any{sha256Of7}, []any{sha256Of42, sha256Of7})}},
			match:   query("", "", [][]uint64{{7}, {7, 42}}),
			others:  [][]uint64{query("", "", nil), query("", "", [][]uint64{{42}, {7, 42}})},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix := kvindex.New(kvindex.Config{BlockSize: 4})
			applyBatches(t, ix, workerID, tt.batches...)
			if d := deviceOf(ix, workerID, tt.match); d != 2 {
				t.Errorf("matching query: device overlap %d, want 2", d)
			}
			for i, q := range tt.others {
				if d := deviceOf(ix, workerID, q); d != 0 {
					t.Errorf("other query %d: device overlap %d, want 0", i, d)
				}
			}
		})
	}
}

// TestEngineHashesAreNeverMatched (§17.1, §4): matching uses local hashes re-computed from
// token ids; engine block hashes are per-worker external ids only.
func TestEngineHashesAreNeverMatched(t *testing.T) {
	toks := []uint32{0, 1, 2, 3, 4, 5, 6, 7}
	other := []uint32{9, 9, 9, 9, 8, 8, 8, 8}
	local := kvindex.BlockHashes(toks, 4, kvindex.BaseSeed)
	ix := kvindex.New(kvindex.Config{BlockSize: 4})
	// Workers 1 and 2 hold the same tokens under unrelated engine hashes (vLLM's NONE_HASH is
	// random per process); worker 3 holds other tokens under worker 1's engine hashes.
	applyBatches(t, ix, 1, []kt.Event{kt.Stored(nil, []uint64{0xaaaa0001, 0xaaaa0002}, toks, 4).WithHashEncoding(kt.HashBytes)})
	applyBatches(t, ix, 2, []kt.Event{kt.Stored(nil, []uint64{1 << 63, 1<<63 + 1}, toks, 4).WithHashEncoding(kt.HashInt64)})
	applyBatches(t, ix, 3, []kt.Event{kt.Stored(nil, []uint64{0xaaaa0001, 0xaaaa0002}, other, 4)})

	tests := []struct {
		name  string
		query []uint64
		want  map[uint64]uint32
	}{
		{"workers with different engine hashes for the same tokens both match the local hashes",
			local, map[uint64]uint32{1: 2, 2: 2, 3: 0}},
		{"a query of engine hashes matches nothing",
			[]uint64{0xaaaa0001, 0xaaaa0002}, map[uint64]uint32{1: 0, 2: 0, 3: 0}},
		{"the worker whose engine hashes collide with another's matches only its own tokens",
			kvindex.BlockHashes(other, 4, kvindex.BaseSeed), map[uint64]uint32{1: 0, 2: 0, 3: 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for w, want := range tt.want {
				if d := deviceOf(ix, w, tt.query); d != want {
					t.Errorf("worker %d: device overlap %d, want %d", w, d, want)
				}
			}
		})
	}
	t.Run("each worker's kv_hint ids are its own engine hashes", func(t *testing.T) {
		got := ix.ExternalHashes(kvindex.Candidate{WorkerID: 2}, local, 2)
		if len(got) != 2 || got[0] != 1<<63 || got[1] != 1<<63+1 {
			t.Errorf("worker 2 external hashes = %v", got)
		}
	})
}
