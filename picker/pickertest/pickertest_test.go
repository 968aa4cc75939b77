package pickertest_test

import (
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/internal/helpertest"
	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
)

// twoRanks is worker 1 with ranks 0 and 1 at block size 4.
func twoRanks() picker.WorkerEventSpec {
	return picker.WorkerEventSpec{WorkerID: 1, BlockSize: 4, DPSize: 2,
		Endpoints: map[uint32]string{0: "tcp://w:1", 1: "tcp://w:2"}}
}

// deviceBlocks returns the device overlap of (worker 1, rank) for local hashes 10, 11.
func deviceBlocks(idx *kvindex.Index, rank uint32) uint32 {
	for _, m := range idx.FindMatches([]uint64{10, 11}, nil) {
		if m.Candidate == (kvindex.Candidate{WorkerID: 1, DPRank: rank}) {
			return m.Device
		}
	}
	return 0
}

func TestEventSourceReconcilesReattachesRankByRank(t *testing.T) {
	for _, tc := range []struct {
		name         string
		change       func(s *picker.WorkerEventSpec)
		keep0, keep1 bool
	}{
		{"an unchanged spec keeps both ranks", func(*picker.WorkerEventSpec) {}, true, true},
		{"a changed endpoint clears only its rank", func(s *picker.WorkerEventSpec) { s.Endpoints = map[uint32]string{0: "tcp://w:1", 1: "tcp://w:9"} }, true, false},
		{"a changed replay endpoint clears every rank", func(s *picker.WorkerEventSpec) { s.ReplayEndpoint = "tcp://w:3" }, false, false},
		{"a changed block size clears every rank", func(s *picker.WorkerEventSpec) { s.BlockSize = 8 }, false, false},
		{"a changed eagle flag clears every rank", func(s *picker.WorkerEventSpec) { s.IsEagle = true }, false, false},
		{"a rank that leaves the range is cleared", func(s *picker.WorkerEventSpec) { s.DPSize = 1 }, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := pickertest.NewEventSource()
			idx := kvindex.New(kvindex.Config{BlockSize: 4})
			if err := src.AttachWorker(twoRanks(), idx); err != nil {
				t.Fatal(err)
			}
			src.Store(t, 1, 0, kvindex.TierDevice, nil, 10, 11)
			src.Store(t, 1, 1, kvindex.TierDevice, nil, 10)
			if deviceBlocks(idx, 0) != 2 || deviceBlocks(idx, 1) != 1 {
				t.Fatalf("stored blocks not in the index: %d, %d", deviceBlocks(idx, 0), deviceBlocks(idx, 1))
			}
			spec := twoRanks()
			tc.change(&spec)
			if err := src.AttachWorker(spec, idx); err != nil {
				t.Fatal(err)
			}
			if got := [2]bool{deviceBlocks(idx, 0) == 2, deviceBlocks(idx, 1) == 1}; got != [2]bool{tc.keep0, tc.keep1} {
				t.Fatalf("ranks kept %v, want %v", got, [2]bool{tc.keep0, tc.keep1})
			}
			if got, ok := src.Attached(1); !ok || got.BlockSize != spec.BlockSize || got.DPSize != spec.DPSize {
				t.Fatalf("Attached = %+v %v, want the new spec", got, ok)
			}
		})
	}
	t.Run("a move to another index clears the old one", func(t *testing.T) {
		src := pickertest.NewEventSource()
		old, moved := kvindex.New(kvindex.Config{BlockSize: 4}), kvindex.New(kvindex.Config{BlockSize: 4})
		_ = src.AttachWorker(twoRanks(), old)
		src.Store(t, 1, 0, kvindex.TierDevice, nil, 10, 11)
		_ = src.AttachWorker(twoRanks(), moved)
		if deviceBlocks(old, 0) != 0 || src.Index(1) != moved {
			t.Fatalf("old index still holds %d blocks", deviceBlocks(old, 0))
		}
	})
}

func TestEventSourceAttachFailuresAndDetach(t *testing.T) {
	src := pickertest.NewEventSource()
	idx := kvindex.New(kvindex.Config{BlockSize: 4})
	boom := errors.New("listener start failed")
	src.FailAttach(func(s picker.WorkerEventSpec) error {
		if s.WorkerID == 1 {
			return boom
		}
		return nil
	})
	if err := src.AttachWorker(twoRanks(), idx); !errors.Is(err, boom) {
		t.Fatalf("AttachWorker = %v, want the injected error", err)
	}
	if _, ok := src.Attached(1); ok {
		t.Fatal("a failed attach attached the worker")
	}
	if msgs := helpertest.Failures(t, func(tb testing.TB) { src.Store(tb, 1, 0, kvindex.TierDevice, nil, 10) }); len(msgs) != 1 || !strings.Contains(msgs[0], "worker 1 is not attached") {
		t.Fatalf("Store on a detached worker: %q", msgs)
	}
	src.FailAttach(nil)
	if err := src.AttachWorker(twoRanks(), idx); err != nil {
		t.Fatal(err)
	}
	src.DetachWorker(1)
	if _, ok := src.Attached(1); ok || src.Index(1) != nil {
		t.Fatal("DetachWorker left the worker attached")
	}
}

func TestClock(t *testing.T) {
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	c := pickertest.NewClock(t0)
	if c.Now() != t0 {
		t.Fatalf("Now = %v", c.Now())
	}
	if got := c.Advance(90 * time.Second); got != t0.Add(90*time.Second) || c.Now() != got {
		t.Fatalf("Advance = %v, Now = %v", got, c.Now())
	}
}

func TestRandSourceAndConfig(t *testing.T) {
	draw := func(s rand.Source) []uint64 {
		r := rand.New(s)
		return []uint64{r.Uint64(), r.Uint64()}
	}
	next := pickertest.RandSource(11, 3)
	for n := uint64(1); n <= 3; n++ {
		if got, want := draw(next()), draw(rand.NewPCG(11+n, 3)); !slices.Equal(got, want) {
			t.Fatalf("call %d drew %v, want PCG(%d, 3)'s %v", n, got, 11+n, want)
		}
	}
	cfg := pickertest.Config(1, 42)
	if cfg.Router.UseKVEvents || cfg.RandSource == nil {
		t.Fatalf("Config: KV events %v, RandSource set %v", cfg.Router.UseKVEvents, cfg.RandSource != nil)
	}
	if got, want := draw(cfg.RandSource()), draw(rand.NewPCG(2, 42)); !slices.Equal(got, want) {
		t.Fatalf("Config's first source drew %v, want %v", got, want)
	}
}
