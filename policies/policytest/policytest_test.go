package policytest_test

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/internal/helpertest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/leastbusy"
	"github.com/kvepp/kvepp/policies/policytest"
)

func TestSourceAnswersEachRowFromItsCandidate(t *testing.T) {
	s := policytest.Source{
		{Worker: policytest.W(1, 2), Device: 1, Host: 2, Disk: 3, SharedBeyondDevice: 4, Prefill: 5, DecodeCost: 6, Requests: 7,
			Multiplier: 0.5, HasMultiplier: true},
		{Worker: policytest.W(3, 0), Multiplier: 9},
	}
	c, l, r := s.Cache(0), s.Load(0), s.Routing(0)
	m, ok := r.PreferredTaintMultiplier()
	if got := []int{c.DeviceOverlapBlocks(), c.HostOverlapBlocks(), c.DiskOverlapBlocks(), c.SharedBeyondDeviceBlocks(),
		l.ActivePrefillTokens(), l.DecodeCostBlocks(), l.ActiveRequests()}; !slices.Equal(got, []int{1, 2, 3, 4, 5, 6, 7}) || m != 0.5 || !ok {
		t.Fatalf("row 0 inputs %v, multiplier %v %v", got, m, ok)
	}
	t.Run("a multiplier without HasMultiplier is absent", func(t *testing.T) {
		r := s.Routing(1)
		if m, ok := r.PreferredTaintMultiplier(); m != 0 || ok {
			t.Fatalf("multiplier %v %v", m, ok)
		}
	})
	t.Run("Workers lists the candidates' workers in row order", func(t *testing.T) {
		if got := s.Workers(); !slices.Equal(got, []policies.Worker{{WorkerID: 1, DPRank: 2}, {WorkerID: 3}}) {
			t.Fatalf("Workers = %v", got)
		}
	})
}

func TestShuffledPermutesACopy(t *testing.T) {
	var s policytest.Source
	for i := range 20 {
		s = append(s, policytest.Candidate{Worker: policytest.W(uint64(i), 0)})
	}
	orig := slices.Clone(s)
	got := s.Shuffled(rand.New(rand.NewPCG(1, 2)))
	if !slices.Equal(s, orig) {
		t.Fatal("Shuffled modified its source")
	}
	if slices.Equal(got, orig) {
		t.Fatal("20 candidates came back in their original order")
	}
	sorted := slices.SortedFunc(slices.Values(got), func(a, b policytest.Candidate) int { return int(a.Worker.WorkerID) - int(b.Worker.WorkerID) })
	if !slices.Equal(sorted, orig) {
		t.Fatalf("Shuffled returned %v, not a permutation", got)
	}
}

func TestSelectRunsThePolicyOverShuffledCandidates(t *testing.T) {
	p := policytest.NewPolicy(t, leastbusy.Provider, `{"min_device_overlap_blocks": 1}`)
	src := policytest.Source{
		{Worker: policytest.W(1, 0), Device: 0},              // filtered out
		{Worker: policytest.W(2, 0), Device: 4, Requests: 2}, // tied with 3
		{Worker: policytest.W(3, 0), Device: 1, Requests: 2},
		{Worker: policytest.W(4, 0), Device: 9, Requests: 5},
	}
	picks := func(seed uint64) []uint64 {
		rng := rand.New(rand.NewPCG(seed, 0))
		var out []uint64
		for range 200 {
			res, err := policytest.Select(p, policies.ContextParams{ISLTokens: 64, BlockSize: 16}, rng, src)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, res.Worker.WorkerID)
		}
		return out
	}
	a := picks(7)
	counts := map[uint64]int{}
	for _, id := range a {
		counts[id]++
	}
	if counts[1] != 0 || counts[4] != 0 || counts[2] < 60 || counts[3] < 60 {
		t.Fatalf("picks %v: want the tied workers 2 and 3 only, both often", counts)
	}
	if b := picks(7); !slices.Equal(a, b) {
		t.Fatal("the same rng seed gave different picks: Select must draw only from rng")
	}
}

func TestNoInputsFailsOnEveryGroup(t *testing.T) {
	msgs := helpertest.Failures(t, func(tb testing.TB) {
		src := policytest.NoInputs(tb)
		src.Cache(0)
		src.Load(0)
		src.Routing(0)
	})
	if !slices.Equal(msgs, []string{"CACHE computed", "LOAD computed", "ROUTING computed"}) {
		t.Fatalf("messages %q", msgs)
	}
}

func TestConstructionFailuresFailTheTest(t *testing.T) {
	for _, tc := range []struct {
		name, want string
		fn         func(tb testing.TB)
	}{
		{"parameters that are not a mapping", "parameters [1]", func(tb testing.TB) { policytest.Params(tb, `[1]`) }},
		{"parameters the provider rejects", `provider rejected {}`, func(tb testing.TB) { policytest.NewPolicy(tb, leastbusy.Provider, `{}`) }},
		{"parameters the provider accepts when a rejection is wanted", `err = <nil>, want it to name "min_device"`, func(tb testing.TB) {
			policytest.WantRejected(tb, leastbusy.Provider, leastbusy.TypeName, `{"min_device_overlap_blocks": 0}`, "min_device")
		}},
		{"a rejection that does not name the wanted parameter", `want it to name "max_groups"`, func(tb testing.TB) {
			policytest.WantRejected(tb, leastbusy.Provider, leastbusy.TypeName, `{}`, "max_groups")
		}},
		{"a factory error", "factory for partition m/g", func(tb testing.TB) {
			policytest.Partition(tb, func(policies.RouterConfig, string, policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
				return nil, fmt.Errorf("no")
			}, "g")
		}},
	} {
		t.Run(tc.name+" fail the test naming them", func(t *testing.T) {
			msgs := helpertest.Failures(t, tc.fn)
			if len(msgs) != 1 || !strings.Contains(msgs[0], tc.want) {
				t.Fatalf("messages %q, want one containing %q", msgs, tc.want)
			}
		})
	}
}

func TestWantRejectedPassesOnARejectionNamingTheParameterAndType(t *testing.T) {
	if msgs := helpertest.Failures(t, func(tb testing.TB) {
		policytest.WantRejected(tb, leastbusy.Provider, leastbusy.TypeName, `{}`, "min_device_overlap_blocks is required")
	}); len(msgs) != 0 {
		t.Fatalf("messages %q", msgs)
	}
}
