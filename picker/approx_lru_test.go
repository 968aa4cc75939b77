package picker_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
)

// withApproxPolicy sets router_approximate_cache_policy (KV events stay off) and a fixed clock.
func withApproxPolicy(policy string) func(*picker.Config) {
	return func(c *picker.Config) {
		c.Router.ApproximateCachePolicy = policy
		c.Now = func() time.Time { return time0 }
	}
}

// seqTokens returns n tokens starting at first (first, first+1, …).
func seqTokens(first uint32, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = first + uint32(i)
	}
	return out
}

// bookOn books toks on (worker, rank) through a hard pin.
func bookOn(t *testing.T, s *picker.Service, w uint64, rank uint32, toks []uint32) {
	t.Helper()
	if _, err := s.SelectAndReserve(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) {
		r.PinnedWorker = &picker.WorkerRank{WorkerID: w, DPRank: rank}
	})); err != nil {
		t.Fatalf("book %d tokens on worker %d dp_rank %d: %v", len(toks), w, rank, err)
	}
}

// rankOverlap returns each rank's device overlap (tokens) of toks on worker w, by dp_rank.
func rankOverlap(t *testing.T, s *picker.Service, w uint64, toks []uint32) map[string]uint64 {
	t.Helper()
	sel, err := s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: w} }))
	if err != nil {
		t.Fatalf("select: %v", err)
	}
	return sel.Overlap.DP
}

// TestApproximateLRUBoundsEachRankByTotalKVBlocks covers kv-events-index.md §15.1's LRU variant:
// with block size 4 and total_kv_blocks 4, prompt A (4 blocks) then prompt B (2 blocks) booked on
// rank 0 leave A's two deepest blocks evicted (the least recently inserted), while rank 1 keeps
// its copy of A, and the ttl policy evicts nothing.
func TestApproximateLRUBoundsEachRankByTotalKVBlocks(t *testing.T) {
	a, b := seqTokens(1, 16), seqTokens(101, 8)
	tests := []struct {
		name          string
		policy        string
		totalKV       *uint64
		wantA0, want1 uint64 // tokens of A still matched on rank 0 and rank 1
	}{
		{"lru evicts the least-recently-inserted blocks of the full rank only", picker.ApproxCachePolicyLRU, u64(4), 8, 16},
		{"lru without total_kv_blocks bounds by the TTL only", picker.ApproxCachePolicyLRU, nil, 16, 16},
		{"ttl ignores total_kv_blocks", picker.ApproxCachePolicyTTL, u64(4), 16, 16},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := newService(t, withApproxPolicy(tc.policy))
			mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) {
				r.DataParallelSize = u32(2)
				r.TotalKVBlocks = tc.totalKV
			}))
			bookOn(t, s, 1, 0, a)
			bookOn(t, s, 1, 1, a)
			bookOn(t, s, 1, 0, b)
			gotA := rankOverlap(t, s, 1, a)
			if gotA["0"] != tc.wantA0 || gotA["1"] != tc.want1 {
				t.Fatalf("prompt A overlap by rank = %v, want rank 0 %d and rank 1 %d tokens", gotA, tc.wantA0, tc.want1)
			}
			if gotB := rankOverlap(t, s, 1, b); gotB["0"] != 8 {
				t.Fatalf("the newest booking B lost blocks: overlap by rank %v, want rank 0 8 tokens", gotB)
			}
		})
	}
}

func TestApproximateLRUCapacityFollowsWorkerUpdates(t *testing.T) {
	a := seqTokens(1, 16)
	t.Run("a PATCH lowering total_kv_blocks trims a rank at once", func(t *testing.T) {
		s := newService(t, withApproxPolicy(picker.ApproxCachePolicyLRU))
		mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.TotalKVBlocks = u64(8) }))
		bookOn(t, s, 1, 0, a)
		if got := rankOverlap(t, s, 1, a)["0"]; got != 16 {
			t.Fatalf("within capacity overlap = %d tokens, want 16", got)
		}
		st, err := s.PatchWorker(ctxb(), 1, picker.WorkerPatch{TotalKVBlocks: u64(1)})
		if err != nil || st.Lifecycle != picker.LifecycleSchedulable {
			t.Fatalf("patch: %+v %v", st, err)
		}
		if got := rankOverlap(t, s, 1, a)["0"]; got != 4 {
			t.Fatalf("after PATCH total_kv_blocks=1 overlap = %d tokens, want 4 (only the first block kept)", got)
		}
	})
	t.Run("a PATCH raising total_kv_blocks lets later bookings keep more blocks", func(t *testing.T) {
		s := newService(t, withApproxPolicy(picker.ApproxCachePolicyLRU))
		mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.TotalKVBlocks = u64(2) }))
		bookOn(t, s, 1, 0, a)
		if got := rankOverlap(t, s, 1, a)["0"]; got != 8 {
			t.Fatalf("capacity 2 overlap = %d tokens, want 8", got)
		}
		if _, err := s.PatchWorker(ctxb(), 1, picker.WorkerPatch{TotalKVBlocks: u64(4)}); err != nil {
			t.Fatal(err)
		}
		bookOn(t, s, 1, 0, a)
		if got := rankOverlap(t, s, 1, a)["0"]; got != 16 {
			t.Fatalf("capacity 4 overlap = %d tokens, want 16", got)
		}
	})
	t.Run("a re-registration that clears a departed rank keeps the capacity", func(t *testing.T) {
		s := newService(t, withApproxPolicy(picker.ApproxCachePolicyLRU))
		two := func(r *picker.WorkerRecord) { r.DataParallelSize = u32(2); r.TotalKVBlocks = u64(2) }
		mustUpsert(t, s, worker(1, two))
		mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.TotalKVBlocks = u64(2) })) // rank 1 leaves
		bookOn(t, s, 1, 0, a)
		if got := rankOverlap(t, s, 1, a)["0"]; got != 8 {
			t.Fatalf("overlap = %d tokens, want 8 (capacity 2 blocks)", got)
		}
	})
}

func TestApproximateCachePolicyIsValidated(t *testing.T) {
	tests := []struct {
		name    string
		mod     func(*picker.Config)
		wantErr string
	}{
		{"lru with KV events is rejected", func(c *picker.Config) {
			c.Router.UseKVEvents = true
			c.EventSource = pickertest.NewEventSource()
			c.Router.ApproximateCachePolicy = picker.ApproxCachePolicyLRU
		}, "router_approximate_cache_policy lru requires use_kv_events=false"},
		{"an unknown policy is rejected", func(c *picker.Config) { c.Router.ApproximateCachePolicy = "fifo" },
			`router_approximate_cache_policy must be ttl or lru, got "fifo"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := picker.DefaultConfig()
			cfg.Router.UseKVEvents = false
			tc.mod(&cfg)
			_, err := picker.New(cfg)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("New error = %v, want it to contain %q", err, tc.wantErr)
			}
		})
	}
	t.Run("an empty policy means ttl", func(t *testing.T) {
		cfg := picker.DefaultConfig()
		cfg.Router.UseKVEvents = false
		cfg.Router.ApproximateCachePolicy = ""
		if _, err := picker.New(cfg); err != nil {
			t.Fatal(err)
		}
	})
}
