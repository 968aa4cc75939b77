package kvevents_test

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

const (
	hashTokens0123                = 9143094415614847814  // tokens [0,1,2,3], bs 4, no salt (§3)
	hashTokens0123Lora            = 6665157333201000639  // LoRA "adapter-a"
	hashTokens0123Tenant          = 17009624042690211646 // namespace "tenant-a"
	hashTokens0123Both            = 8269515957840517240  // LoRA "adapter-a" + namespace "tenant-a"
	hashTokens1234Tenant          = 5738685477468498325  // namespace "tenant-a", tokens [1,2,3,4]
	hashTokens0123MM42            = 18280081842874931122 // + mm_hash [42]
	hashTokens0123MM42And7        = 4581426371996505827  // + mm_hashes {42, 7}
	hashOpaqueImage               = 14437604544409538977 // hash_mm_identifier("opaque-renderer-image-0")
	sha256Of42                    = "000000000000002a000000000000000000000000000000000000000000000000"
	sha256Of7                     = "0000000000000007ffffffffffffffffffffffffffffffffffffffffffffffff"
	workerID               uint64 = 7
)

var tok0123 = []uint32{0, 1, 2, 3}

// decode encodes events into a batch (optionally with a dp_rank) and decodes it back, so
// converter tests run on exactly what the wire would deliver.
func decode(t testing.TB, rank *uint32, events ...kt.Event) kvevents.Batch {
	t.Helper()
	b, err := kvevents.DecodeBatch(kt.Batch{TS: 1, DPRank: rank, Events: events}.Encode())
	if err != nil {
		t.Fatalf("DecodeBatch: %v", err)
	}
	return b
}

func stored(rank uint32, tier kvindex.Tier, seq uint64, parent *uint64, blocks ...kvindex.StoredBlock) kvindex.Event {
	ev := kvindex.Event{WorkerID: workerID, DPRank: rank, Tier: tier, EventID: seq, Kind: kvindex.EventStored, Blocks: blocks}
	if parent != nil {
		ev.HasParent, ev.ParentHash = true, *parent
	}
	return ev
}

func blk(ext, local uint64) kvindex.StoredBlock {
	return kvindex.StoredBlock{BlockHash: ext, TokensHash: local}
}

func plain(tokens ...uint32) uint64 { return kvindex.BlockHash(tokens, kvindex.BaseSeed, nil) }

type convStep struct {
	rank   *uint32
	events []kt.Event
}

type convCase struct {
	name      string
	blockSize int
	eagle     bool
	rankStart uint32
	rankSize  uint32
	steps     []convStep
	want      []kvindex.Event
	wantDrops []kvevents.DropReason
}

func step(events ...kt.Event) convStep { return convStep{events: events} }

func stepRank(rank uint32, events ...kt.Event) convStep { return convStep{rank: &rank, events: events} }

func runConvCases(t *testing.T, cases []convCase) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			bs := c.blockSize
			if bs == 0 {
				bs = 4
			}
			conv := kvevents.NewConverter(workerID, c.rankStart, bs, c.eagle)
			if c.rankSize > 0 {
				conv.SetRankRange(c.rankStart, c.rankSize)
			}
			var got []kvindex.Event
			var drops []kvevents.DropReason
			for i, s := range c.steps {
				var errs []error
				got, errs = conv.Convert(decode(t, s.rank, s.events...), uint64(100+i), got)
				for _, err := range errs {
					var de *kvevents.DropError
					if !errors.As(err, &de) {
						t.Fatalf("Convert error %v is not a *DropError", err)
					}
					drops = append(drops, de.Reason)
				}
			}
			if d := cmp.Diff(c.want, got, cmpopts.EquateEmpty()); d != "" {
				t.Errorf("events mismatch (-want +got):\n%s", d)
			}
			if d := cmp.Diff(c.wantDrops, drops, cmpopts.EquateEmpty()); d != "" {
				t.Errorf("drop reasons mismatch (-want +got):\n%s", d)
			}
		})
	}
}

func TestConverterMapsEventsToIndexUpdates(t *testing.T) {
	runConvCases(t, []convCase{
		{
			name:  "a stored chain is re-hashed from its token ids with event id = seq",
			steps: []convStep{step(kt.Stored(kt.Parent(5), []uint64{11, 12}, []uint32{0, 1, 2, 3, 4, 5, 6, 7}, 4))},
			want:  []kvindex.Event{stored(0, kvindex.TierDevice, 100, kt.Parent(5), blk(11, hashTokens0123), blk(12, plain(4, 5, 6, 7)))},
		},
		{
			name:  "a removal keeps the engine hashes and its tier",
			steps: []convStep{step(kt.Removed(11, 12).WithMedium("CPU"))},
			want: []kvindex.Event{{WorkerID: workerID, Tier: kvindex.TierHostPinned, EventID: 100, Kind: kvindex.EventRemoved,
				BlockHashes: []uint64{11, 12}}},
		},
		{
			name:  "AllBlocksCleared clears the rank",
			steps: []convStep{step(kt.Cleared())},
			want:  []kvindex.Event{{WorkerID: workerID, EventID: 100, Kind: kvindex.EventCleared}},
		},
		{
			name:      "the batch dp_rank overrides the registered rank",
			rankStart: 0, rankSize: 4,
			steps: []convStep{stepRank(2, kt.Stored(nil, []uint64{11}, tok0123, 4), kt.Cleared())},
			want: []kvindex.Event{stored(2, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123)),
				{WorkerID: workerID, DPRank: 2, EventID: 100, Kind: kvindex.EventCleared}},
		},
		{
			name:      "a batch dp_rank outside the worker's range drops every event",
			rankStart: 0, rankSize: 2,
			steps:     []convStep{stepRank(2, kt.Stored(nil, []uint64{11}, tok0123, 4), kt.Cleared())},
			wantDrops: []kvevents.DropReason{kvevents.DropRankOutOfRange, kvevents.DropRankOutOfRange},
		},
		{
			name:      "an unknown medium is dropped and counted",
			steps:     []convStep{step(kt.Stored(nil, []uint64{11}, tok0123, 4).WithMedium("TAPE"), kt.Removed(1).WithMedium("floppy"))},
			wantDrops: []kvevents.DropReason{kvevents.DropUnknownMedium, kvevents.DropUnknownMedium},
		},
		{
			name: "LOCAL or absent locality is accepted and any other is dropped",
			steps: []convStep{step(kt.Removed(1).WithLocality("local"), kt.Removed(2),
				kt.Removed(3).WithLocality("REMOTE"), kt.Removed(4).WithLocality("elsewhere"))},
			want: []kvindex.Event{
				{WorkerID: workerID, EventID: 100, Kind: kvindex.EventRemoved, BlockHashes: []uint64{1}},
				{WorkerID: workerID, EventID: 100, Kind: kvindex.EventRemoved, BlockHashes: []uint64{2}}},
			wantDrops: []kvevents.DropReason{kvevents.DropNotLocal, kvevents.DropNotLocal},
		},
		{
			name: "decoding failures surface as drops with their reason",
			steps: []convStep{step(kt.Raw([]any{"BlockStored", []any{1}, nil, []any{-1}, 1}), kt.Raw([]any{"Mystery"}),
				kt.Raw([]any{"BlockRemoved"}))},
			wantDrops: []kvevents.DropReason{kvevents.DropTokenIDOutOfRange, kvevents.DropUnknownType, kvevents.DropInvalidEvent},
		},
	})
}

func TestConverterFiltersAttentionGroups(t *testing.T) {
	runConvCases(t, []convCase{
		{
			name: "sliding-window and mamba groups are skipped",
			steps: []convStep{step(
				kt.Stored(nil, []uint64{11}, tok0123, 4).WithGroup(1, "sliding_window").WithSlidingWindow(1024),
				kt.Stored(nil, []uint64{12}, tok0123, 4).WithGroup(2, "mamba"),
				kt.Removed(11).WithGroup(1, "sliding_window"))},
			wantDrops: []kvevents.DropReason{kvevents.DropGroupKind, kvevents.DropGroupKind, kvevents.DropGroupKind},
		},
		{
			name: "the first indexed group is learned and other groups are dropped",
			steps: []convStep{
				step(kt.Stored(nil, []uint64{11}, tok0123, 4).WithGroup(1, "full_attention")),
				step(kt.Stored(nil, []uint64{12}, tok0123, 4).WithGroup(0, "full_attention"),
					kt.Stored(kt.Parent(11), []uint64{13}, tok0123, 4).WithGroup(1, "full_attention"),
					kt.Removed(11).WithGroup(3, "mla_attention"),
					kt.Removed(13).WithGroup(1, "FULL_ATTENTION"))},
			want: []kvindex.Event{
				stored(0, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123)),
				stored(0, kvindex.TierDevice, 101, kt.Parent(11), blk(13, hashTokens0123)),
				{WorkerID: workerID, EventID: 101, Kind: kvindex.EventRemoved, BlockHashes: []uint64{13}}},
			wantDrops: []kvevents.DropReason{kvevents.DropGroupMismatch, kvevents.DropGroupMismatch},
		},
		{
			name: "absent kind and group mean full attention group 0",
			steps: []convStep{step(kt.Stored(nil, []uint64{11}, tok0123, 4),
				kt.Stored(nil, []uint64{12}, tok0123, 4).WithGroup(1, "sink_full_attention"))},
			want:      []kvindex.Event{stored(0, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123))},
			wantDrops: []kvevents.DropReason{kvevents.DropGroupMismatch},
		},
		{
			name:      "each rank learns its own group",
			rankStart: 0, rankSize: 2,
			steps: []convStep{
				stepRank(0, kt.Stored(nil, []uint64{11}, tok0123, 4).WithGroup(1, "full_attention")),
				stepRank(1, kt.Stored(nil, []uint64{11}, tok0123, 4).WithGroup(2, "full_attention"))},
			want: []kvindex.Event{stored(0, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123)),
				stored(1, kvindex.TierDevice, 101, nil, blk(11, hashTokens0123))},
		},
	})
}

func TestConverterValidatesStores(t *testing.T) {
	runConvCases(t, []convCase{
		{
			name:      "a block_size other than the registered one is dropped",
			steps:     []convStep{step(kt.Stored(nil, []uint64{11}, []uint32{1, 2}, 2))},
			wantDrops: []kvevents.DropReason{kvevents.DropBlockSize},
		},
		{
			name: "a token count other than blocks x block_size is dropped",
			steps: []convStep{step(kt.Stored(nil, []uint64{11, 12}, []uint32{1, 2, 3, 4, 5}, 4),
				kt.Stored(nil, []uint64{11}, []uint32{1, 2, 3, 4, 5}, 4))},
			wantDrops: []kvevents.DropReason{kvevents.DropTokenCount, kvevents.DropTokenCount},
		},
		{
			name:      "a store without blocks is dropped",
			steps:     []convStep{step(kt.Stored(nil, []uint64{}, []uint32{}, 4))},
			wantDrops: []kvevents.DropReason{kvevents.DropInvalidEvent},
		},
		{
			name: "duplicate hashes or a block equal to its parent drop the whole store",
			steps: []convStep{step(kt.Stored(nil, []uint64{11, 11}, []uint32{0, 1, 2, 3, 0, 1, 2, 3}, 4),
				kt.Stored(kt.Parent(12), []uint64{12}, tok0123, 4))},
			wantDrops: []kvevents.DropReason{kvevents.DropInvalidSequence, kvevents.DropInvalidSequence},
		},
		{
			name:  "an Eagle worker needs blocks x block_size + 1 tokens and hashes overlapping windows",
			eagle: true, blockSize: 2,
			steps: []convStep{step(kt.Stored(nil, []uint64{21, 22}, []uint32{0, 1, 2, 3, 4}, 2),
				kt.Stored(nil, []uint64{23, 24}, []uint32{0, 1, 2, 3}, 2))},
			want: []kvindex.Event{stored(0, kvindex.TierDevice, 100, nil,
				blk(21, 11646242937812223497), blk(22, 9948816348502404300))},
			wantDrops: []kvevents.DropReason{kvevents.DropTokenCount},
		},
		{
			name:  "Eagle bigram token pairs are normalized before hashing",
			eagle: true, blockSize: 2,
			steps: []convStep{step(kt.Stored(nil, []uint64{21, 22}, []uint32{0, 1, 2, 3, 4}, 2).AsBigrams())},
			want: []kvindex.Event{stored(0, kvindex.TierDevice, 100, nil,
				blk(21, 11646242937812223497), blk(22, 9948816348502404300))},
		},
		{
			name:      "bigram pairs sent to a non-Eagle worker fail the token count",
			blockSize: 2,
			steps:     []convStep{step(kt.Stored(nil, []uint64{21, 22}, []uint32{0, 1, 2, 3, 4}, 2).AsBigrams())},
			wantDrops: []kvevents.DropReason{kvevents.DropTokenCount},
		},
	})
}

func TestConverterSaltsHashesWithLoraAndNamespace(t *testing.T) {
	s := func(ev kt.Event) convStep { return step(ev) }
	base := kt.Stored(nil, []uint64{11}, tok0123, 4)
	want := func(local uint64) []kindexEvents {
		return []kindexEvents{stored(0, kvindex.TierDevice, 100, nil, blk(11, local))}
	}
	sglang := func(ev kt.Event, salt string) kt.Event {
		ev.LoraName = map[string]any{"cache_salt": salt, "rid": "r-1"}
		return ev
	}
	runConvCases(t, []convCase{
		{name: "no LoRA and no namespace hash with the base seed", steps: []convStep{s(base)}, want: want(hashTokens0123)},
		{name: "lora_name salts the hash", steps: []convStep{s(base.WithLoraName("adapter-a"))}, want: want(hashTokens0123Lora)},
		{name: "lora_id without a name hashes as the base model", steps: []convStep{s(base.WithLoraID(3))}, want: want(hashTokens0123)},
		{name: "map-form cache_salt is the namespace", steps: []convStep{s(base.WithCacheSalt("tenant-a"))}, want: want(hashTokens0123Tenant)},
		{name: "a dynamo-cache-salt extra key is the namespace", steps: []convStep{s(base.WithExtraKeys([]any{"dynamo-cache-salt:tenant-a"}))}, want: want(hashTokens0123Tenant)},
		{name: "vLLM's plain extra_keys string is the namespace", steps: []convStep{s(base.WithExtraKeys([]any{"tenant-a"}))}, want: want(hashTokens0123Tenant)},
		{name: "an extra key equal to lora_name is not a namespace", steps: []convStep{s(base.WithLoraName("adapter-a").WithExtraKeys([]any{"adapter-a"}))}, want: want(hashTokens0123Lora)},
		{name: "LoRA and namespace combine", steps: []convStep{s(base.WithLoraName("adapter-a").WithExtraKeys([]any{"adapter-a", "tenant-a"}))}, want: want(hashTokens0123Both)},
		{name: "an SGLang map in the lora_name slot gives the namespace and no LoRA", steps: []convStep{s(sglang(base, "tenant-a"))}, want: want(hashTokens0123Tenant)},
		{name: "cache_salt wins over a dynamo-cache-salt key", steps: []convStep{s(base.WithExtraKeys([]any{"dynamo-cache-salt:other"}).WithCacheSalt("tenant-a"))}, want: want(hashTokens0123Tenant)},
		{name: "a dynamo-cache-salt key wins over a plain string", steps: []convStep{s(base.WithExtraKeys([]any{"other", "dynamo-cache-salt:tenant-a"}))}, want: want(hashTokens0123Tenant)},
		{name: "a plain string wins over the SGLang map", steps: []convStep{s(sglang(base.WithExtraKeys([]any{"tenant-a"}), "other"))}, want: want(hashTokens0123Tenant)},
		{name: "only the first block's extra keys name the namespace", steps: []convStep{s(kt.Stored(nil, []uint64{11, 12}, []uint32{0, 1, 2, 3, 1, 2, 3, 4}, 4).WithExtraKeys(nil, []any{"tenant-a"}))},
			want: []kindexEvents{stored(0, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123), blk(12, plain(1, 2, 3, 4)))}},
		{
			name: "a child store inherits its parent's namespace",
			steps: []convStep{s(base.WithCacheSalt("tenant-a")),
				s(kt.Stored(kt.Parent(11), []uint64{12}, []uint32{1, 2, 3, 4}, 4))},
			want: []kindexEvents{stored(0, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123Tenant)),
				stored(0, kvindex.TierDevice, 101, kt.Parent(11), blk(12, hashTokens1234Tenant))},
		},
		{
			name: "inheritance follows chains across stores",
			steps: []convStep{s(base.WithExtraKeys([]any{"tenant-a"})),
				s(kt.Stored(kt.Parent(11), []uint64{12}, []uint32{0, 1, 2, 3}, 4)),
				s(kt.Stored(kt.Parent(12), []uint64{13}, []uint32{1, 2, 3, 4}, 4))},
			want: []kindexEvents{stored(0, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123Tenant)),
				stored(0, kvindex.TierDevice, 101, kt.Parent(11), blk(12, hashTokens0123Tenant)),
				stored(0, kvindex.TierDevice, 102, kt.Parent(12), blk(13, hashTokens1234Tenant))},
		},
		{
			name: "a removed parent's namespace is forgotten",
			steps: []convStep{s(base.WithCacheSalt("tenant-a")), s(kt.Removed(11)),
				s(kt.Stored(kt.Parent(11), []uint64{12}, []uint32{1, 2, 3, 4}, 4))},
			want: []kindexEvents{stored(0, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123Tenant)),
				{WorkerID: workerID, EventID: 101, Kind: kvindex.EventRemoved, BlockHashes: []uint64{11}},
				stored(0, kvindex.TierDevice, 102, kt.Parent(11), blk(12, plain(1, 2, 3, 4)))},
		},
		{
			name: "a namespace survives the removal of one of two tiers holding the block",
			steps: []convStep{s(base.WithCacheSalt("tenant-a")), s(base.WithCacheSalt("tenant-a").WithMedium("CPU")),
				s(kt.Removed(11)), s(kt.Stored(kt.Parent(11), []uint64{12}, []uint32{1, 2, 3, 4}, 4).WithMedium("CPU"))},
			want: []kindexEvents{stored(0, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123Tenant)),
				stored(0, kvindex.TierHostPinned, 101, nil, blk(11, hashTokens0123Tenant)),
				{WorkerID: workerID, EventID: 102, Kind: kvindex.EventRemoved, BlockHashes: []uint64{11}},
				stored(0, kvindex.TierHostPinned, 103, kt.Parent(11), blk(12, hashTokens1234Tenant))},
		},
		{
			name: "AllBlocksCleared forgets the rank's namespaces",
			steps: []convStep{s(base.WithCacheSalt("tenant-a")), s(kt.Cleared()),
				s(kt.Stored(kt.Parent(11), []uint64{12}, []uint32{1, 2, 3, 4}, 4))},
			want: []kindexEvents{stored(0, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123Tenant)),
				{WorkerID: workerID, EventID: 101, Kind: kvindex.EventCleared},
				stored(0, kvindex.TierDevice, 102, kt.Parent(11), blk(12, plain(1, 2, 3, 4)))},
		},
		{
			name:      "namespaces are remembered per rank",
			rankStart: 0, rankSize: 2,
			steps: []convStep{stepRank(0, base.WithCacheSalt("tenant-a")),
				stepRank(1, kt.Stored(kt.Parent(11), []uint64{12}, []uint32{1, 2, 3, 4}, 4))},
			want: []kindexEvents{stored(0, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123Tenant)),
				stored(1, kvindex.TierDevice, 101, kt.Parent(11), blk(12, plain(1, 2, 3, 4)))},
		},
		{
			name: "a child's own namespace wins over inheritance",
			steps: []convStep{s(base.WithCacheSalt("other")),
				s(kt.Stored(kt.Parent(11), []uint64{12}, []uint32{1, 2, 3, 4}, 4).WithCacheSalt("tenant-a"))},
			want: []kindexEvents{stored(0, kvindex.TierDevice, 100, nil, blk(11, kvindex.BlockHash(tok0123, kvindex.Seed("", "other"), nil))),
				stored(0, kvindex.TierDevice, 101, kt.Parent(11), blk(12, hashTokens1234Tenant))},
		},
	})
}

// kindexEvents shortens table literals.
type kindexEvents = kvindex.Event

func TestConverterHashesMultimodalExtraKeys(t *testing.T) {
	base := kt.Stored(nil, []uint64{11}, tok0123, 4)
	want := func(local uint64) []kindexEvents {
		return []kindexEvents{stored(0, kvindex.TierDevice, 100, nil, blk(11, local))}
	}
	runConvCases(t, []convCase{
		{name: "a sha256 identifier adds its mm hash to the block", steps: []convStep{step(base.WithExtraKeys([]any{sha256Of42}))}, want: want(hashTokens0123MM42)},
		{name: "several mm hashes are sorted before hashing", steps: []convStep{step(base.WithExtraKeys([]any{sha256Of42, sha256Of7}))}, want: want(hashTokens0123MM42And7)},
		{name: "an [identifier, offset] pair adds its mm hash", steps: []convStep{step(base.WithExtraKeys([]any{[]any{sha256Of42, 0}}))}, want: want(hashTokens0123MM42)},
		{name: "an opaque identifier pair hashes the identifier", steps: []convStep{step(base.WithExtraKeys([]any{[]any{"opaque-renderer-image-0", 2}}))},
			want: want(kvindex.BlockHash(tok0123, kvindex.BaseSeed, []uint64{hashOpaqueImage}))},
		{name: "mm keys and a namespace combine", steps: []convStep{step(base.WithExtraKeys([]any{"tenant-a", sha256Of42}))},
			want: want(kvindex.BlockHash(tok0123, kvindex.Seed("", "tenant-a"), []uint64{42}))},
		{name: "unrecognized keys are ignored", steps: []convStep{step(base.WithExtraKeys([]any{int64(5), []any{1, 2}, []any{"x", "y"}, nil}))}, want: want(hashTokens0123)},
		{
			name:  "only blocks carrying mm keys get an mm suffix",
			steps: []convStep{step(kt.Stored(nil, []uint64{11, 12}, []uint32{0, 1, 2, 3, 0, 1, 2, 3}, 4).WithExtraKeys(nil, []any{sha256Of42}))},
			want:  []kindexEvents{stored(0, kvindex.TierDevice, 100, nil, blk(11, hashTokens0123), blk(12, hashTokens0123MM42))},
		},
	})
	t.Run("a multimodal block never matches a text query of the same tokens", func(t *testing.T) {
		conv := kvevents.NewConverter(workerID, 0, 4, false)
		evs, errs := conv.Convert(decode(t, nil, base.WithExtraKeys([]any{sha256Of42})), 1, nil)
		if len(errs) != 0 || len(evs) != 1 {
			t.Fatalf("Convert = %v, %v", evs, errs)
		}
		ix := kvindex.New(kvindex.Config{BlockSize: 4})
		if err := ix.Apply(evs[0]); err != nil {
			t.Fatal(err)
		}
		if m := ix.FindMatches([]uint64{hashTokens0123}, nil); len(m) != 0 {
			t.Errorf("text query matched the image block: %+v", m)
		}
		if m := ix.FindMatches([]uint64{hashTokens0123MM42}, nil); len(m) != 1 || m[0].Device != 1 {
			t.Errorf("mm query = %+v, want one device match", m)
		}
	})
}

func TestMediumTierFollowsTheSpecTable(t *testing.T) {
	cases := map[string]kvindex.Tier{
		"": kvindex.TierDevice, "GPU": kvindex.TierDevice, "gpu": kvindex.TierDevice, "DEVICE": kvindex.TierDevice,
		"CPU": kvindex.TierHostPinned, "cpu_pinned": kvindex.TierHostPinned, "CPU_TIER1": kvindex.TierHostPinned,
		"CPU_TIER2": kvindex.TierDisk, "DISK": kvindex.TierDisk, "NVME": kvindex.TierDisk, "storage": kvindex.TierDisk,
		"EXTERNAL": kvindex.TierExternal, "NETWORK": kvindex.TierExternal, "REMOTE": kvindex.TierExternal, "Shared": kvindex.TierExternal,
	}
	for m, want := range cases {
		t.Run("medium "+m+" maps to "+want.String(), func(t *testing.T) {
			got, ok := kvevents.MediumTier(m)
			if !ok || got != want {
				t.Errorf("MediumTier(%q) = %v, %v; want %v, true", m, got, ok, want)
			}
		})
	}
	t.Run("an unknown medium is rejected", func(t *testing.T) {
		if _, ok := kvevents.MediumTier("HBM3"); ok {
			t.Error("MediumTier(HBM3) accepted")
		}
	})
}

func TestConverterLimitsItsWarnings(t *testing.T) {
	t.Run("a block-size mismatch warns at most 3 times per worker", func(t *testing.T) {
		var buf bytes.Buffer
		conv := kvevents.NewConverter(workerID, 0, 4, false)
		conv.SetLogger(zerolog.New(&buf))
		for i := 0; i < 6; i++ {
			_, errs := conv.Convert(decode(t, nil, kt.Stored(nil, []uint64{11}, []uint32{1, 2}, 2)), uint64(i), nil)
			if len(errs) != 1 {
				t.Fatalf("batch %d: %d drops, want 1", i, len(errs))
			}
		}
		if n := strings.Count(buf.String(), "block_size differs"); n != 3 {
			t.Errorf("%d block-size warnings, want 3; log:\n%s", n, buf.String())
		}
	})
	t.Run("lora_id without a name is logged once", func(t *testing.T) {
		var buf bytes.Buffer
		conv := kvevents.NewConverter(workerID, 0, 4, false)
		conv.SetLogger(zerolog.New(&buf))
		for i := 0; i < 3; i++ {
			conv.Convert(decode(t, nil, kt.Stored(nil, []uint64{11}, tok0123, 4).WithLoraID(9)), uint64(i), nil)
		}
		if n := strings.Count(buf.String(), "lora_id without lora_name"); n != 1 {
			t.Errorf("%d lora_id notes, want 1; log:\n%s", n, buf.String())
		}
	})
}

func TestDropErrorNamesTheEventAndReason(t *testing.T) {
	conv := kvevents.NewConverter(workerID, 0, 4, false)
	_, errs := conv.Convert(decode(t, nil, kt.Cleared(), kt.Stored(nil, []uint64{11}, []uint32{1, 2}, 2)), 1, nil)
	if len(errs) != 1 {
		t.Fatalf("got %d errors, want 1", len(errs))
	}
	msg := errs[0].Error()
	for _, want := range []string{"event 1", "BlockStored", "block_size_mismatch", "block_size 2", "block_size 4"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not contain %q", msg, want)
		}
	}
	if kvevents.DropBlockSize.String() != "block_size_mismatch" || kvevents.NumDropReasons.String() == "" {
		t.Error("drop reason labels are wrong")
	}
}
