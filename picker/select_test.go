package picker_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
)

func i64(v int64) uint64 { return uint64(v) }

func TestPromptNormalisation(t *testing.T) {
	cases := []struct {
		name     string
		mod      func(*picker.Config)
		prompt   picker.Prompt
		override *picker.RouterConfigOverride
		wantSeq  []uint64
		wantISL  uint64
	}{
		{name: "one full block hashes to the golden sequence hash",
			prompt: picker.Prompt{TokenIDs: []uint32{1, 2, 3, 4}}, wantSeq: []uint64{i64(-3803038269031200164)}, wantISL: 4},
		{name: "cache_salt salts the hashes",
			prompt: picker.Prompt{TokenIDs: []uint32{1, 2, 3, 4}, CacheSalt: "tenant-a"}, wantSeq: []uint64{5738685477468498325}, wantISL: 4},
		{name: "the partial tail block is dropped",
			prompt:  picker.Prompt{TokenIDs: tokens(10)},
			wantSeq: []uint64{14643705804678351452, 4945711292740353085}, wantISL: 10},
		{name: "the hash form is used as given",
			prompt:  picker.Prompt{HashForm: true, BlockHashes: []uint64{11, 12}, SequenceHashes: []uint64{21, 22}, ISLTokens: 512},
			wantSeq: []uint64{21, 22}, wantISL: 512},
		{name: "the hash form is used as given even without KV reuse",
			mod:     func(c *picker.Config) { c.Router.AssumeKVReuse = false },
			prompt:  picker.Prompt{HashForm: true, BlockHashes: []uint64{11}, SequenceHashes: []uint64{21}, ISLTokens: 3},
			wantSeq: []uint64{21}, wantISL: 3},
		{name: "a prompt shorter than a block has no hashes",
			prompt: picker.Prompt{TokenIDs: []uint32{1, 2}}, wantSeq: []uint64{}, wantISL: 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			mods := []func(*picker.Config){}
			if tc.mod != nil {
				mods = append(mods, tc.mod)
			}
			s := newService(t, mods...)
			mustUpsert(t, s, worker(1))
			sel, err := s.SelectAndReserve(ctxb(), picker.SelectRequest{ModelName: "model", Prompt: tc.prompt, Override: tc.override})
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.wantSeq, sel.SequenceHashes); diff != "" {
				t.Errorf("sequence hashes (-want +got):\n%s", diff)
			}
			if sel.ISLTokens != tc.wantISL {
				t.Errorf("isl = %d, want %d", sel.ISLTokens, tc.wantISL)
			}
		})
	}
}

func TestPromptSaltsChangeTheHashes(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(1))
	base := picker.Prompt{TokenIDs: tokens(8)}
	seqOf := func(p picker.Prompt) []uint64 {
		t.Helper()
		sel, err := s.SelectAndReserve(ctxb(), picker.SelectRequest{ModelName: "model", Prompt: p})
		if err != nil {
			t.Fatal(err)
		}
		return sel.SequenceHashes
	}
	want := seqOf(base)
	for _, tc := range []struct {
		name string
		mod  func(*picker.Prompt)
	}{
		{"lora_name", func(p *picker.Prompt) { p.LoraName = "adapter-a" }},
		{"cache_salt", func(p *picker.Prompt) { p.CacheSalt = "tenant-a" }},
		{"is_eagle", func(p *picker.Prompt) { p.IsEagle = boolp(true) }},
		{"multimodal hashes", func(p *picker.Prompt) { p.BlockMMHashes = [][]uint64{nil, {42}} }},
	} {
		t.Run("changing "+tc.name+" changes the sequence hashes", func(t *testing.T) {
			p := base
			tc.mod(&p)
			got := seqOf(p)
			if cmp.Equal(got, want) {
				t.Errorf("hashes unchanged: %v", got)
			}
		})
	}
	t.Run("without KV reuse tracking hashes are random per block", func(t *testing.T) {
		o := &picker.RouterConfigOverride{AssumeKVReuse: boolp(false)}
		a, err1 := s.SelectAndReserve(ctxb(), picker.SelectRequest{ModelName: "model", Prompt: base, Override: o})
		b, err2 := s.SelectAndReserve(ctxb(), picker.SelectRequest{ModelName: "model", Prompt: base, Override: o})
		if err1 != nil || err2 != nil {
			t.Fatal(err1, err2)
		}
		if len(a.SequenceHashes) != 2 || cmp.Equal(a.SequenceHashes, b.SequenceHashes) || cmp.Equal(a.SequenceHashes, want) {
			t.Errorf("random hashes %v and %v (chain %v)", a.SequenceHashes, b.SequenceHashes, want)
		}
	})
}

func TestPromptValidation(t *testing.T) {
	cases := []struct {
		name   string
		prompt picker.Prompt
		msg    string
	}{
		{"empty token_ids", picker.Prompt{TokenIDs: []uint32{}}, "token_ids must not be empty"},
		{"no block_hashes", picker.Prompt{HashForm: true, SequenceHashes: []uint64{1}, ISLTokens: 4}, "block_hashes is required without token_ids"},
		{"no sequence_hashes", picker.Prompt{HashForm: true, BlockHashes: []uint64{1}, ISLTokens: 4}, "sequence_hashes is required without token_ids"},
		{"no isl_tokens", picker.Prompt{HashForm: true, BlockHashes: []uint64{1}, SequenceHashes: []uint64{1}}, "isl_tokens is required without token_ids"},
		{"isl_tokens 0", picker.Prompt{HashForm: true, BlockHashes: []uint64{1}, SequenceHashes: []uint64{1}, ISLTokensSet: true}, "isl_tokens must be greater than 0"},
		{"1 block hash and 2 sequence hashes", picker.Prompt{HashForm: true, BlockHashes: []uint64{1}, SequenceHashes: []uint64{1, 2}, ISLTokens: 8},
			"block_hashes length 1 must match sequence_hashes length 2"},
		{"nothing at all", picker.Prompt{HashForm: true}, "block_hashes is required without token_ids"},
	}
	for _, tc := range cases {
		t.Run(tc.name+" is a bad request", func(t *testing.T) {
			s := newService(t)
			mustUpsert(t, s, worker(1))
			_, err := s.Select(ctxb(), picker.SelectRequest{ModelName: "model", Prompt: tc.prompt})
			wantKind(t, err, picker.KindBadRequest, tc.msg)
			_, err = s.SelectAndReserve(ctxb(), picker.SelectRequest{ModelName: "model", Prompt: tc.prompt, SelectionID: "x"})
			wantKind(t, err, picker.KindBadRequest, tc.msg)
			// Nothing stays claimed.
			if _, err := s.SelectAndReserve(ctxb(), tokenReq([]uint32{1, 2, 3, 4}, func(r *picker.SelectRequest) { r.SelectionID = "x" })); err != nil {
				t.Fatalf("id x still claimed: %v", err)
			}
		})
	}
}

func TestReadinessErrors(t *testing.T) {
	s := newService(t)
	_, err := s.Select(ctxb(), tokenReq([]uint32{1, 2, 3, 4}))
	wantKind(t, err, picker.KindNotReady, "no schedulable workers are available")
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.RoutingGroup = "g" }))
	_, err = s.SelectAndReserve(ctxb(), tokenReq([]uint32{1, 2, 3, 4}))
	wantKind(t, err, picker.KindNotReady, "no schedulable workers for model:default: there is no partition model:default (registered models: model)")
	mustUpsert(t, s, worker(2, func(r *picker.WorkerRecord) { r.Endpoint = "" }))
	_, err = s.Select(ctxb(), tokenReq([]uint32{1, 2, 3, 4}))
	wantKind(t, err, picker.KindNotReady, "no schedulable workers for model:default: its only worker is not schedulable (worker 2: endpoint is required)")
	s.BeginShutdown()
	_, err = s.Select(ctxb(), tokenReq([]uint32{1, 2, 3, 4}, func(r *picker.SelectRequest) { r.RoutingGroup = "g" }))
	wantKind(t, err, picker.KindNotReady, "selection service is shutting down")
}

// eligibilityFixture: worker 1 (ranks 0-1, taint gpu), worker 2 (rank 0, taints gpu+fast), worker 3
// (incomplete), worker 2 carries load so the policy prefers worker 1.
func eligibilityFixture(t *testing.T, mods ...func(*picker.Config)) *picker.Service {
	s := newService(t, mods...)
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.DataParallelSize = u32(2); r.Taints = []string{"gpu"} }))
	mustUpsert(t, s, worker(2, func(r *picker.WorkerRecord) { r.Taints = []string{"gpu", "fast"} }))
	mustUpsert(t, s, worker(3, func(r *picker.WorkerRecord) { r.Endpoint = "" }))
	for i := 0; i < 3; i++ {
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(64), func(r *picker.SelectRequest) {
			r.PinnedWorker = &picker.WorkerRank{WorkerID: 2}
		})); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

func TestEligibility(t *testing.T) {
	cases := []struct {
		name    string
		mod     func(*picker.SelectRequest)
		workers []uint64 // acceptable chosen workers
		rank    *uint32
		kind    picker.Kind
		msg     string
	}{
		{name: "the policy picks the least loaded worker", workers: []uint64{1}},
		{name: "allowed_worker_ids keeps only listed workers",
			mod: func(r *picker.SelectRequest) { r.AllowedSet, r.AllowedWorkerIDs = true, []uint64{2, 3} }, workers: []uint64{2}},
		{name: "an empty allowed_worker_ids allows nothing",
			mod: func(r *picker.SelectRequest) { r.AllowedSet = true }, kind: picker.KindNotReady, msg: "no endpoints available to route work"},
		{name: "required taints keep workers carrying all of them",
			mod: func(r *picker.SelectRequest) { r.RoutingConstraints.RequiredTaints = []string{"gpu", "fast"} }, workers: []uint64{2}},
		{name: "an unmatched required taint leaves no endpoint",
			mod: func(r *picker.SelectRequest) { r.RoutingConstraints.RequiredTaints = []string{"tpu"} }, kind: picker.KindNotReady, msg: "no endpoints available to route work"},
		{name: "a pinned worker is chosen despite its load",
			mod: func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 2} }, workers: []uint64{2}, rank: u32(0)},
		{name: "a pinned rank is honoured",
			mod: func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 1, DPRank: 1} }, workers: []uint64{1}, rank: u32(1)},
		{name: "a pinned worker outside allowed_worker_ids is a bad request",
			mod: func(r *picker.SelectRequest) {
				r.PinnedWorker = &picker.WorkerRank{WorkerID: 9}
				r.AllowedSet, r.AllowedWorkerIDs = true, []uint64{1}
			}, kind: picker.KindBadRequest, msg: "pinned worker 9 is not in allowed_worker_ids"},
		{name: "an unknown pinned worker has no endpoint",
			mod: func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 9} }, kind: picker.KindNotReady, msg: "no endpoints available to route work"},
		{name: "an incomplete pinned worker has no endpoint",
			mod: func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 3} }, kind: picker.KindNotReady, msg: "no endpoints available to route work"},
		{name: "a pinned rank outside the range has no endpoint",
			mod: func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 2, DPRank: 1} }, kind: picker.KindNotReady, msg: "no endpoints available to route work"},
		{name: "a pinned worker failing required taints has no endpoint",
			mod: func(r *picker.SelectRequest) {
				r.PinnedWorker = &picker.WorkerRank{WorkerID: 1}
				r.RoutingConstraints.RequiredTaints = []string{"fast"}
			}, kind: picker.KindNotReady, msg: "no endpoints available to route work"},
		{name: "an affinity target narrows to its worker",
			mod: func(r *picker.SelectRequest) { r.AffinityTarget = &picker.AffinityTarget{WorkerID: 2} }, workers: []uint64{2}},
		{name: "an affinity target with a rank narrows to that rank",
			mod: func(r *picker.SelectRequest) { r.AffinityTarget = &picker.AffinityTarget{WorkerID: 1, DPRank: u32(1)} }, workers: []uint64{1}, rank: u32(1)},
		{name: "an ineligible affinity target is ignored",
			mod: func(r *picker.SelectRequest) {
				r.AffinityTarget = &picker.AffinityTarget{WorkerID: 2}
				r.AllowedSet, r.AllowedWorkerIDs = true, []uint64{1}
			}, workers: []uint64{1}},
		{name: "an affinity target rank outside the range is ignored",
			mod: func(r *picker.SelectRequest) { r.AffinityTarget = &picker.AffinityTarget{WorkerID: 2, DPRank: u32(5)} }, workers: []uint64{1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := eligibilityFixture(t)
			req := tokenReq(tokens(8))
			if tc.mod != nil {
				tc.mod(&req)
			}
			sel, err := s.Select(ctxb(), req)
			if tc.kind != "" {
				wantKind(t, err, tc.kind, tc.msg)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !contains(tc.workers, sel.WorkerID) {
				t.Errorf("chose worker %d, want one of %v", sel.WorkerID, tc.workers)
			}
			if tc.rank != nil && sel.DPRank != *tc.rank {
				t.Errorf("chose rank %d, want %d", sel.DPRank, *tc.rank)
			}
		})
	}
}

func contains(xs []uint64, v uint64) bool {
	for _, x := range xs {
		if x == v {
			return true
		}
	}
	return false
}

func TestExactTargetAndPinBypassTheCustomPolicy(t *testing.T) {
	failing := policytest.Picker{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) {
		return 0, policies.Failed("custom picker consulted")
	}}
	s := eligibilityFixture(t, withPolicy(nil, nil, failing))
	_, err := s.Select(ctxb(), tokenReq(tokens(8)))
	wantKind(t, err, picker.KindPolicy, "custom picker consulted")
	for _, tc := range []struct {
		name string
		mod  func(*picker.SelectRequest)
	}{
		{"the affinity target path", func(r *picker.SelectRequest) { r.AffinityTarget = &picker.AffinityTarget{WorkerID: 1} }},
		{"the pinned path", func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 1} }},
	} {
		t.Run(tc.name+" uses the built-in picker", func(t *testing.T) {
			sel, err := s.Select(ctxb(), tokenReq(tokens(8), tc.mod))
			if err != nil || sel.WorkerID != 1 {
				t.Fatalf("got %+v, %v", sel, err)
			}
		})
	}
}

func TestPolicyFailures(t *testing.T) {
	rejectAll := policytest.Filter{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (bool, error) { return false, nil }}
	nan := policytest.Scorer{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerCandidate) (float64, error) {
		return math.NaN(), nil
	}}
	row := func(r int) policytest.Picker {
		return policytest.Picker{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) { return r, nil }}
	}
	panics := policytest.Picker{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) { panic("kaboom") }}
	cases := []struct {
		name    string
		mod     func(*picker.Config)
		kind    picker.Kind
		msg     string
		contain string
	}{
		{name: "filters rejecting every worker are unavailable",
			mod:  withPolicy([]policies.WorkerFilter{rejectAll}, nil, lowestCost),
			kind: picker.KindNotReady, msg: "all eligible workers were rejected by policy filters"},
		{name: "a non-finite cost is a policy failure",
			mod: withPolicy(nil, []policies.WorkerScorer{nan}, lowestCost), kind: picker.KindPolicy, contain: "non-finite"},
		{name: "a picker row out of range is a policy failure",
			mod: withPolicy(nil, nil, row(7)), kind: picker.KindPolicy, msg: "picker returned row 7 but there are 2 candidates"},
		{name: "a negative picker row is a policy failure",
			mod: withPolicy(nil, nil, row(-1)), kind: picker.KindPolicy, contain: "row -1"},
		{name: "a policy-raised error keeps its message",
			mod: withPolicy(nil, nil, policytest.Picker{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) {
				return 0, policies.Failed("no GPU left")
			}}), kind: picker.KindPolicy, msg: "no GPU left"},
		{name: "a panicking policy is a policy failure", mod: withPolicy(nil, nil, panics), kind: picker.KindPolicy, contain: "kaboom"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newService(t, tc.mod)
			mustUpsert(t, s, worker(1))
			mustUpsert(t, s, worker(2))
			_, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(8), func(r *picker.SelectRequest) { r.SelectionID = "id" }))
			wantKind(t, err, tc.kind, tc.msg)
			if !strings.Contains(err.Error(), tc.contain) {
				t.Errorf("error %q does not contain %q", err, tc.contain)
			}
			for _, w := range []uint64{1, 2} {
				if l := loadOf(t, s, "model", "default", w, 0); l.ActiveRequests != 0 {
					t.Errorf("worker %d was booked: %+v", w, l)
				}
			}
			if err := s.Free(ctxb(), "id"); picker.KindOf(err) != picker.KindNotFound {
				t.Errorf("Free(id) = %v, want not found", err)
			}
		})
	}
}

func TestCustomPolicyInputs(t *testing.T) {
	ev := pickertest.NewEventSource()
	var (
		gotCache   map[uint64][3]int
		gotSession string
		gotBlocks  int
	)
	filter := policytest.Filter{In: policies.InputsCache, Fn: func(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
		ch := c.Cache()
		gotCache[c.Worker().WorkerID] = [3]int{ch.DeviceOverlapBlocks(), ch.HostOverlapBlocks(), ch.DiskOverlapBlocks()}
		if sc := ctx.SessionContext(); sc != nil {
			gotSession = sc.SessionID() + "/" + sc.InputTrigger().String()
		}
		gotBlocks = ctx.RequestBlocks()
		return true, nil
	}}
	s := newService(t, withEvents(ev), withPolicy([]policies.WorkerFilter{filter}, nil, lowestCost),
		func(c *picker.Config) { c.Router.HostCacheHitWeight = 0.5 })
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.KVEventsEndpoint = "tcp://w:1" }))
	mustUpsert(t, s, worker(2, func(r *picker.WorkerRecord) { r.KVEventsEndpoint = "tcp://w:2" }))
	local := kvindex.BlockHashes(tokens(16), 4, kvindex.BaseSeed)
	ev.Store(t, 1, 0, kvindex.TierDevice, nil, local[:2]...)
	parent := local[1] + 1
	ev.Store(t, 1, 0, kvindex.TierHostPinned, &parent, local[2])
	ev.Store(t, 2, 0, kvindex.TierDisk, nil, local[:1]...)

	gotCache = map[uint64][3]int{}
	_, err := s.Select(ctxb(), tokenReq(tokens(18), func(r *picker.SelectRequest) {
		r.Session = &picker.SessionContext{SessionID: "s1", InputTrigger: "tool_result"}
	}))
	if err != nil {
		t.Fatal(err)
	}
	want := map[uint64][3]int{1: {2, 1, 0}, 2: {0, 0, 1}}
	if diff := cmp.Diff(want, gotCache); diff != "" {
		t.Errorf("raw cache inputs (-want +got):\n%s", diff)
	}
	if gotSession != "s1/tool_result" || gotBlocks != 5 {
		t.Errorf("context session %q request blocks %d", gotSession, gotBlocks)
	}
	t.Run("an unknown input_trigger is unprocessable", func(t *testing.T) {
		_, err := s.Select(ctxb(), tokenReq(tokens(8), func(r *picker.SelectRequest) {
			r.Session = &picker.SessionContext{SessionID: "s1", InputTrigger: "dream"}
		}))
		wantKind(t, err, picker.KindUnprocessable, "")
	})
}

// workedExample builds §9.7: bs 16, worker A (1) with device 8 / host ext 4 blocks of the request,
// 1024 active prefill tokens and 100 active blocks; worker B (2) idle prefill, 50 active blocks;
// worker C (3) idle prefill, 500 active blocks.
func workedExample(t *testing.T, mods ...func(*picker.Config)) (*picker.Service, []uint32) {
	ev := pickertest.NewEventSource()
	s := newService(t, append([]func(*picker.Config){withEvents(ev)}, mods...)...)
	for id := uint64(1); id <= 3; id++ {
		mustUpsert(t, s, worker(id, func(r *picker.WorkerRecord) {
			r.BlockSize = u32(16)
			r.KVEventsEndpoint = "tcp://w:" + itoa(id)
		}))
	}
	toks := tokens(512)
	local := kvindex.BlockHashes(toks, 16, kvindex.BaseSeed)
	ev.Store(t, 1, 0, kvindex.TierDevice, nil, local[:8]...)
	parent := local[7] + 1
	ev.Store(t, 1, 0, kvindex.TierHostPinned, &parent, local[8:12]...)
	book := func(id uint64, blocks int, isl uint64, completePrefill bool) {
		seq := make([]uint64, blocks)
		for i := range seq {
			seq[i] = id<<32 | uint64(i)
		}
		sel, err := s.SelectAndReserve(ctxb(), picker.SelectRequest{ModelName: "model",
			Prompt:       picker.Prompt{HashForm: true, BlockHashes: seq, SequenceHashes: seq, ISLTokens: isl},
			PinnedWorker: &picker.WorkerRank{WorkerID: id}})
		if err != nil {
			t.Fatal(err)
		}
		if completePrefill {
			if err := s.PrefillComplete(ctxb(), sel.SelectionID); err != nil {
				t.Fatal(err)
			}
		}
	}
	book(1, 100, 1024, false)
	book(2, 50, 16, true)
	book(3, 500, 16, true)
	return s, toks
}

func TestBuiltInCostWorkedExample(t *testing.T) {
	s, toks := workedExample(t)
	if l := loadOf(t, s, "model", "default", 1, 0); l.PotentialPrefillTokens != 1024 || l.PotentialDecodeBlocks != 100 {
		t.Fatalf("worker A load %+v", l)
	}
	t.Run("worker B is chosen with cost 114", func(t *testing.T) {
		sel, err := s.Select(ctxb(), tokenReq(toks))
		if err != nil {
			t.Fatal(err)
		}
		if sel.WorkerID != 2 || sel.Cost != 114 || sel.EffectivePrefillTokens != 512 || sel.PotentialDecodeBlocks != 82 {
			t.Errorf("got worker %d cost %v ept %d pdb %d, want 2 / 114 / 512 / 82", sel.WorkerID, sel.Cost, sel.EffectivePrefillTokens, sel.PotentialDecodeBlocks)
		}
	})
	t.Run("worker A costs 217 with effective prefill 336", func(t *testing.T) {
		sel, err := s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 1} }))
		if err != nil {
			t.Fatal(err)
		}
		if sel.Cost != 217 || sel.EffectivePrefillTokens != 336 || sel.PotentialDecodeBlocks != 132 {
			t.Errorf("got cost %v ept %d pdb %d, want 217 / 336 / 132", sel.Cost, sel.EffectivePrefillTokens, sel.PotentialDecodeBlocks)
		}
		want := picker.Overlap{LongestMatched: 192, GPU: 128, CPU: 192, Disk: 192, DP: map[string]uint64{"0": 128}}
		if diff := cmp.Diff(want, sel.Overlap); diff != "" {
			t.Errorf("overlap (-want +got):\n%s", diff)
		}
	})
	t.Run("with credit decay 1 worker A costs 222.33", func(t *testing.T) {
		s, toks := workedExample(t, func(c *picker.Config) { c.Router.OverlapScoreCreditDecay = 1 })
		sel, err := s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) {
			r.AllowedSet, r.AllowedWorkerIDs = true, []uint64{1, 3}
		}))
		if err != nil {
			t.Fatal(err)
		}
		if sel.WorkerID != 1 || math.Abs(sel.Cost-(85+132+16.0/3)) > 1e-9 {
			t.Errorf("got worker %d cost %v, want 1 / 222.33", sel.WorkerID, sel.Cost)
		}
	})
	t.Run("per-request overrides change the selection", func(t *testing.T) {
		// With prefill_load_scale 0 only decode blocks count: A 132, B 82, C 532 → B; with the
		// deprecated overlap_score_weight 0 too. With a huge credit A's prefill vanishes: A 132 → B still
		// cheaper, so restrict to A and C to see the credit flip the choice.
		sel, err := s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) {
			r.AllowedSet, r.AllowedWorkerIDs = true, []uint64{1, 3}
			r.Override = &picker.RouterConfigOverride{PrefillLoadScale: f64(0)}
		}))
		if err != nil || sel.WorkerID != 1 || sel.Cost != 132 {
			t.Fatalf("scale 0: %+v %v", sel, err)
		}
		sel, err = s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) {
			r.AllowedSet, r.AllowedWorkerIDs = true, []uint64{1, 3}
			r.Override = &picker.RouterConfigOverride{PrefillLoadScale: f64(10)}
		}))
		if err != nil || sel.WorkerID != 3 {
			t.Fatalf("scale 10 should prefer the prefill-idle worker C: %+v %v", sel, err)
		}
		sel, err = s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) {
			r.AllowedSet, r.AllowedWorkerIDs = true, []uint64{1, 3}
			r.Override = &picker.RouterConfigOverride{OverlapScoreWeight: f64(0)}
		}))
		if err != nil || sel.WorkerID != 1 || sel.Cost != 132 {
			t.Fatalf("deprecated weight 0: %+v %v", sel, err)
		}
	})
}

func TestOverrideValidation(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(1))
	for _, tc := range []struct {
		name string
		o    picker.RouterConfigOverride
		msg  string
	}{
		{"a negative credit", picker.RouterConfigOverride{OverlapScoreCredit: f64(-1)}, "router_config_override.overlap_score_credit must be a finite number >= 0, got -1"},
		{"an infinite temperature", picker.RouterConfigOverride{RouterTemperature: f64(math.Inf(1))}, "router_config_override.router_temperature must be a finite number >= 0, got +Inf"},
		{"a NaN scale", picker.RouterConfigOverride{PrefillLoadScale: f64(math.NaN())}, "router_config_override.prefill_load_scale must be a finite number >= 0, got NaN"},
		{"a shared cache multiplier above 1", picker.RouterConfigOverride{SharedCacheMultiplier: f64(1.5)}, "router_config_override.shared_cache_multiplier must be between 0 and 1, got 1.5"},
	} {
		t.Run(tc.name+" is unprocessable", func(t *testing.T) {
			o := tc.o
			_, err := s.Select(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.Override = &o }))
			wantKind(t, err, picker.KindUnprocessable, tc.msg)
		})
	}
}

func TestOverlapSummaryCoversEveryRank(t *testing.T) {
	ev := pickertest.NewEventSource()
	s := newService(t, withEvents(ev))
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) {
		r.BlockSize = u32(16)
		r.DataParallelSize = u32(3)
		r.KVEventsEndpoints = map[string]string{"0": "tcp://w:0", "1": "tcp://w:1", "2": "tcp://w:2"}
	}))
	toks := tokens(16 * 10)
	local := kvindex.BlockHashes(toks, 16, kvindex.BaseSeed)
	ev.Store(t, 1, 0, kvindex.TierDevice, nil, local[:4]...)
	p := local[3] + 1
	ev.Store(t, 1, 0, kvindex.TierHostPinned, &p, local[4:6]...)
	p = local[5] + 1
	ev.Store(t, 1, 0, kvindex.TierDisk, &p, local[6:8]...)
	ev.Store(t, 1, 1, kvindex.TierDevice, nil, local[:2]...)
	sel, err := s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 1, DPRank: 2} }))
	if err != nil {
		t.Fatal(err)
	}
	want := picker.Overlap{LongestMatched: 128, GPU: 64, CPU: 96, Disk: 128, DP: map[string]uint64{"0": 64, "1": 32, "2": 0}}
	if diff := cmp.Diff(want, sel.Overlap); diff != "" {
		t.Errorf("overlap (-want +got):\n%s", diff)
	}
	t.Run("a zero-overlap response lists the selected rank at 0", func(t *testing.T) {
		sel, err := s.Select(ctxb(), tokenReq([]uint32{9, 9, 9, 9}))
		if err != nil {
			t.Fatal(err)
		}
		want := picker.Overlap{DP: map[string]uint64{"0": 0, "1": 0, "2": 0}}
		if diff := cmp.Diff(want, sel.Overlap); diff != "" {
			t.Errorf("overlap (-want +got):\n%s", diff)
		}
	})
}

func TestDecodeProjection(t *testing.T) {
	s := newService(t, func(c *picker.Config) {
		c.Router.ConditionalDisaggDecodeBusyThreshold = f64(0)
		c.Router.ConditionalDisaggPrefillBusyThreshold = f64(0.5)
	})
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.TotalKVBlocks = u64(10); r.MaxNumBatchedTokens = u64(1024) }))
	toks := tokens(6) // one full block and a partial one
	sel, err := s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) { r.Advisory = true }))
	if err != nil {
		t.Fatal(err)
	}
	if sel.PotentialDecodeBlocks != 2 {
		t.Errorf("potential_decode_blocks = %d, want 1 new + 1 partial", sel.PotentialDecodeBlocks)
	}
	if sel.DecodeBusy == nil || !*sel.DecodeBusy {
		t.Errorf("decode_busy = %v, want true at threshold 0", sel.DecodeBusy)
	}
	wantLoad := &picker.WorkerLoad{ActivePrefillTokens: 0, PrefillTokenCapacity: 1024, TotalKVBlocks: u64(10), PrefillBusy: boolp(false)}
	if diff := cmp.Diff(wantLoad, sel.WorkerLoad); diff != "" {
		t.Errorf("worker_load (-want +got):\n%s", diff)
	}
	if _, err := s.SelectAndReserve(ctxb(), tokenReq(toks)); err != nil {
		t.Fatal(err)
	}
	sel, err = s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) { r.Advisory = true }))
	if err != nil {
		t.Fatal(err)
	}
	if sel.PotentialDecodeBlocks != 2 {
		t.Errorf("with the prefix live potential_decode_blocks = %d, want 1 active + 0 new + 1 partial", sel.PotentialDecodeBlocks)
	}
	if sel.WorkerLoad.ActivePrefillTokens != 6 {
		t.Errorf("advisory active prefill = %d, want the pre-admission 6", sel.WorkerLoad.ActivePrefillTokens)
	}
	t.Run("busy flags are absent without thresholds or capacity", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		sel, err := s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) { r.Advisory = true }))
		if err != nil {
			t.Fatal(err)
		}
		want := &picker.WorkerLoad{PrefillTokenCapacity: picker.DefaultPrefillTokenCapacity}
		if sel.DecodeBusy != nil || !cmp.Equal(want, sel.WorkerLoad) {
			t.Errorf("decode_busy %v worker_load %+v", sel.DecodeBusy, sel.WorkerLoad)
		}
	})
	t.Run("a non-advisory select has no worker_load", func(t *testing.T) {
		sel, err := s.Select(ctxb(), tokenReq(toks))
		if err != nil || sel.WorkerLoad != nil {
			t.Errorf("worker_load %+v, %v", sel.WorkerLoad, err)
		}
	})
}

func TestFallbacksAreNextCheapestDistinctWorkers(t *testing.T) {
	s := newService(t)
	for id := uint64(1); id <= 4; id++ {
		mustUpsert(t, s, worker(id, func(r *picker.WorkerRecord) { r.DataParallelSize = u32(2) }))
	}
	// Load worker w with n bookings on rank 0 so costs order 1 < 2 < 3 < 4.
	for w, n := range map[uint64]int{2: 1, 3: 2, 4: 3} {
		for i := 0; i < n; i++ {
			if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(40), func(r *picker.SelectRequest) {
				r.PinnedWorker = &picker.WorkerRank{WorkerID: w, DPRank: 0}
			})); err != nil {
				t.Fatal(err)
			}
			if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(40), func(r *picker.SelectRequest) {
				r.PinnedWorker = &picker.WorkerRank{WorkerID: w, DPRank: 1}
			})); err != nil {
				t.Fatal(err)
			}
		}
	}
	sel, err := s.Select(ctxb(), tokenReq(tokens(8), func(r *picker.SelectRequest) { r.Fallbacks = 2 }))
	if err != nil {
		t.Fatal(err)
	}
	if sel.WorkerID != 1 || len(sel.Fallbacks) != 2 || sel.Fallbacks[0].WorkerID != 2 || sel.Fallbacks[1].WorkerID != 3 ||
		sel.Fallbacks[0].Endpoint != "http://worker-2:8000" {
		t.Errorf("chose %d with fallbacks %+v", sel.WorkerID, sel.Fallbacks)
	}
}

func TestSelectAndReserveBooking(t *testing.T) {
	t.Run("a generated selection_id is a UUIDv4", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		sel, err := s.SelectAndReserve(ctxb(), tokenReq([]uint32{1, 2, 3, 4}))
		if err != nil {
			t.Fatal(err)
		}
		u, err := uuid.Parse(sel.SelectionID)
		if err != nil || u.Version() != 4 || !sel.Booked {
			t.Errorf("selection_id %q (%v), booked %v", sel.SelectionID, err, sel.Booked)
		}
	})
	t.Run("prefill tracking books effective_prefill_tokens", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(10)))
		if err != nil || !sel.TrackPrefillTokens {
			t.Fatal(err, sel.TrackPrefillTokens)
		}
		if l := loadOf(t, s, "model", "default", 1, 0); l.PotentialPrefillTokens != 10 || l.PotentialDecodeBlocks != 2 || l.ActiveRequests != 1 {
			t.Errorf("load %+v", l)
		}
	})
	t.Run("an override turning tracking off books no prefill", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		sel, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(10), func(r *picker.SelectRequest) {
			r.Override = &picker.RouterConfigOverride{TrackPrefillTokens: boolp(false)}
		}))
		if err != nil || sel.TrackPrefillTokens || sel.EffectivePrefillTokens != 10 {
			t.Fatal(err, sel)
		}
		if l := loadOf(t, s, "model", "default", 1, 0); l.PotentialPrefillTokens != 0 || l.ActiveRequests != 1 {
			t.Errorf("load %+v", l)
		}
	})
	t.Run("a live id conflicts, in any partition", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		mustUpsert(t, s, worker(2, func(r *picker.WorkerRecord) { r.RoutingGroup = "g" }))
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "dup" })); err != nil {
			t.Fatal(err)
		}
		_, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "dup" }))
		wantKind(t, err, picker.KindConflict, "selection dup is already reserved or being reserved")
		_, err = s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "dup"; r.RoutingGroup = "g" }))
		wantKind(t, err, picker.KindConflict, "selection dup is already reserved or being reserved")
		if err := s.Free(ctxb(), "dup"); err != nil {
			t.Fatal(err)
		}
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "dup"; r.RoutingGroup = "g" })); err != nil {
			t.Fatalf("reuse after free: %v", err)
		}
	})
	t.Run("a cancelled context books nothing", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		ctx, cancel := context.WithCancel(ctxb())
		cancel()
		_, err := s.SelectAndReserve(ctx, tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "c" }))
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v", err)
		}
		if l := loadOf(t, s, "model", "default", 1, 0); l.ActiveRequests != 0 {
			t.Errorf("booked %+v", l)
		}
	})
	t.Run("a caller cancelled while selecting gets its booking freed", func(t *testing.T) {
		ctx, cancel := context.WithCancel(ctxb())
		cancelling := policytest.Picker{Fn: func(*policies.WorkerSelectionContext, *policies.WorkerInputView) (int, error) {
			cancel()
			return 0, nil
		}}
		s := newService(t, withPolicy(nil, nil, cancelling), func(c *picker.Config) { c.Router.UseKVEvents = false })
		mustUpsert(t, s, worker(1))
		_, err := s.SelectAndReserve(ctx, tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "c" }))
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v", err)
		}
		if l := loadOf(t, s, "model", "default", 1, 0); l.ActiveRequests != 0 || l.PotentialPrefillTokens != 0 {
			t.Errorf("booking leaked: %+v", l)
		}
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(4), func(r *picker.SelectRequest) { r.SelectionID = "c" })); err != nil {
			t.Errorf("claim leaked: %v", err)
		}
	})
}

func TestApproximateModeRecordsBookingsOnly(t *testing.T) {
	now := time0
	s := newService(t, func(c *picker.Config) { c.Now = func() time.Time { return now } })
	mustUpsert(t, s, worker(1))
	mustUpsert(t, s, worker(2))
	toks := []uint32{1, 2, 3, 4}
	sel, err := s.Select(ctxb(), tokenReq(toks))
	if err != nil || sel.Overlap.LongestMatched != 0 {
		t.Fatalf("%+v %v", sel, err)
	}
	sel, err = s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: sel.WorkerID} }))
	if err != nil || sel.Overlap.LongestMatched != 0 {
		t.Fatalf("a query-only select recorded: %+v %v", sel, err)
	}
	booked, err := s.SelectAndReserve(ctxb(), tokenReq(toks))
	if err != nil {
		t.Fatal(err)
	}
	sel, err = s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: booked.WorkerID} }))
	if err != nil || sel.Overlap.LongestMatched != 4 {
		t.Fatalf("after a booking longest_matched = %d (%v), want 4", sel.Overlap.LongestMatched, err)
	}
	t.Run("recorded blocks expire after the TTL", func(t *testing.T) {
		now = now.Add(121 * time.Second)
		sel, err := s.Select(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: booked.WorkerID} }))
		if err != nil || sel.Overlap.LongestMatched != 0 {
			t.Fatalf("after the TTL longest_matched = %d (%v), want 0", sel.Overlap.LongestMatched, err)
		}
	})
	t.Run("an event-driven index never records bookings", func(t *testing.T) {
		ev := pickertest.NewEventSource()
		s := newService(t, withEvents(ev))
		mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.KVEventsEndpoint = "tcp://w:1" }))
		if _, err := s.SelectAndReserve(ctxb(), tokenReq(toks)); err != nil {
			t.Fatal(err)
		}
		sel, err := s.Select(ctxb(), tokenReq(toks))
		if err != nil || sel.Overlap.LongestMatched != 0 {
			t.Fatalf("longest_matched = %d (%v), want 0", sel.Overlap.LongestMatched, err)
		}
	})
}

func TestExtremeHashFormInputsNeverPanic(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(1))
	for _, tc := range []struct {
		name    string
		prompt  picker.Prompt
		wantPDB uint64
	}{
		{"the largest isl adds its partial blocks to potential_decode_blocks",
			picker.Prompt{HashForm: true, BlockHashes: []uint64{1}, SequenceHashes: []uint64{1}, ISLTokens: picker.MaxISLTokens}, picker.MaxISLTokens / 4},
		{"more sequence hashes than blocks add no partial block",
			picker.Prompt{HashForm: true, BlockHashes: []uint64{7, 8, 9}, SequenceHashes: []uint64{1, 2, 3}, ISLTokens: 1}, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sel, err := s.SelectAndReserve(ctxb(), picker.SelectRequest{ModelName: "model", Prompt: tc.prompt})
			if err != nil {
				t.Fatal(err)
			}
			if sel.PotentialDecodeBlocks != tc.wantPDB {
				t.Errorf("potential_decode_blocks = %d, want %d", sel.PotentialDecodeBlocks, tc.wantPDB)
			}
			if sel.EffectivePrefillTokens != tc.prompt.ISLTokens {
				t.Errorf("effective_prefill_tokens = %d", sel.EffectivePrefillTokens)
			}
			if err := s.Free(ctxb(), sel.SelectionID); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestAnISLOverTheLimitIsABadRequest(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(1))
	_, err := s.SelectAndReserve(ctxb(), picker.SelectRequest{ModelName: "model", Prompt: picker.Prompt{
		HashForm: true, BlockHashes: []uint64{1}, SequenceHashes: []uint64{1}, ISLTokens: math.MaxUint64}})
	wantKind(t, err, picker.KindBadRequest, "isl_tokens 18446744073709551615 exceeds the limit of 16777216 tokens")
	_, err = s.Select(ctxb(), picker.SelectRequest{ModelName: "model", Prompt: picker.Prompt{TokenIDs: make([]uint32, picker.MaxISLTokens+1)}})
	wantKind(t, err, picker.KindBadRequest, "token_ids holds 16777217 tokens; the limit is 16777216 tokens")
}

func TestApproximateRowsOfDepartedRanksAreDropped(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.DataParallelSize = u32(2) }))
	toks := []uint32{1, 2, 3, 4}
	if _, err := s.SelectAndReserve(ctxb(), tokenReq(toks, func(r *picker.SelectRequest) {
		r.PinnedWorker = &picker.WorkerRank{WorkerID: 1, DPRank: 1}
	})); err != nil {
		t.Fatal(err)
	}
	pinned := func(r *picker.SelectRequest) { r.PinnedWorker = &picker.WorkerRank{WorkerID: 1} }
	if sel, err := s.Select(ctxb(), tokenReq(toks, pinned)); err != nil || sel.Overlap.DP["1"] != 4 {
		t.Fatalf("before the shrink %+v %v", sel.Overlap, err)
	}
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.DataParallelSize = u32(2); r.TotalKVBlocks = u64(9) }))
	if sel, err := s.Select(ctxb(), tokenReq(toks, pinned)); err != nil || sel.Overlap.DP["1"] != 4 {
		t.Fatalf("a metadata-only update dropped the rows: %+v %v", sel.Overlap, err)
	}
	mustUpsert(t, s, worker(1))
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.DataParallelSize = u32(2) }))
	if sel, err := s.Select(ctxb(), tokenReq(toks, pinned)); err != nil || sel.Overlap.DP["1"] != 0 {
		t.Fatalf("rank 1 rows survived leaving the range: %+v %v", sel.Overlap, err)
	}
}

// TestNotReadyMessagesQuoteNamesBriefly: a 503 names the requested partition and the registered
// models with at most 100 bytes of each (README "Limits").
func TestNotReadyMessagesQuoteNamesBriefly(t *testing.T) {
	s := newService(t)
	long := strings.Repeat("m", 256)
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.ModelName = long }))
	_, err := s.Select(ctxb(), tokenReq([]uint32{1, 2, 3, 4}, func(r *picker.SelectRequest) { r.ModelName = long[:255] + "x" }))
	var pe *picker.Error
	if !errors.As(err, &pe) || pe.Kind != picker.KindNotReady {
		t.Fatalf("err %v, want not ready", err)
	}
	if strings.Contains(pe.Error(), strings.Repeat("m", 101)) || !strings.Contains(pe.Error(), strings.Repeat("m", 100)+"…") {
		t.Fatalf("message quotes more than 100 bytes of a name: %q", pe.Error())
	}
}
