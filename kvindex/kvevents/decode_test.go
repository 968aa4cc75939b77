package kvevents_test

import (
	"encoding/hex"
	"errors"
	"math"
	"runtime"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvepp/kvepp/internal/sharedtest"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

func u32p(v uint32) *uint32 { return &v }
func i64p(v int64) *int64   { return &v }

// cmpBatch compares batches, treating errors as equal when both are nil or both wrap the same
// sentinel.
var cmpBatch = cmp.Options{
	cmpopts.EquateEmpty(),
	cmp.Comparer(func(a, b error) bool {
		if a == nil || b == nil {
			return a == nil && b == nil
		}
		for _, s := range []error{kvevents.ErrUnknownEventType, kvevents.ErrInvalidEvent, kvevents.ErrTokenIDOutOfRange} {
			if errors.Is(a, s) || errors.Is(b, s) {
				return errors.Is(a, s) && errors.Is(b, s)
			}
		}
		return a.Error() == b.Error()
	}),
}

func TestGoldenVectorsDecodeToTheirStatedMeaning(t *testing.T) {
	stored := kvevents.RawEvent{Type: "BlockStored", BlockHashes: []uint64{11}, TokenIDs: []uint32{10, 11}, BlockSize: 2, Medium: "GPU"}
	want := map[string]kvevents.Batch{
		"stored-array-form": {TS: 1.5, DPRank: u32p(0), Events: []kvevents.RawEvent{stored}},
		"stored-map-form":   {TS: 1.5, DPRank: u32p(0), Events: []kvevents.RawEvent{stored}},
		"removed-array-form": {TS: 1.5, DPRank: u32p(0), Events: []kvevents.RawEvent{
			{Type: "BlockRemoved", BlockHashes: []uint64{11}, Medium: "GPU"}}},
		"cleared":                      {TS: 1.5, DPRank: u32p(0), Events: []kvevents.RawEvent{{Type: "AllBlocksCleared"}}},
		"two-element-batch-no-dp-rank": {TS: 1.5, Events: []kvevents.RawEvent{{Type: "AllBlocksCleared"}}},
		"uint64-hash-above-2^63": {TS: 1.5, DPRank: u32p(0), Events: []kvevents.RawEvent{
			{Type: "BlockStored", BlockHashes: []uint64{18446744073709551611}, TokenIDs: []uint32{1, 2}, BlockSize: 2}}},
		"signed-int64-hash-sglang": {TS: 1.5, DPRank: u32p(0), Events: []kvevents.RawEvent{
			{Type: "BlockStored", BlockHashes: []uint64{18446744073709551611}, TokenIDs: []uint32{1, 2}, BlockSize: 2}}},
		"cpu-medium-trailing-fields": {TS: 1.5, DPRank: u32p(0), Events: []kvevents.RawEvent{
			{Type: "BlockStored", BlockHashes: []uint64{12}, HasParent: true, ParentHash: 11, TokenIDs: []uint32{3, 4},
				BlockSize: 2, Medium: "CPU", KVCacheSpecKind: "full_attention"}}},
	}
	for _, v := range sharedtest.KVEventVectors(t) {
		t.Run("vector "+v.Name+" decodes as stated", func(t *testing.T) {
			w, ok := want[v.Name]
			if !ok {
				t.Fatalf("no expectation for golden vector %q; add one", v.Name)
			}
			payload, err := hex.DecodeString(v.Hex)
			if err != nil {
				t.Fatal(err)
			}
			got, err := kvevents.DecodeBatch(payload)
			if err != nil {
				t.Fatalf("DecodeBatch: %v", err)
			}
			if d := cmp.Diff(w, got, cmpBatch); d != "" {
				t.Errorf("decoded batch mismatch (-want +got):\n%s", d)
			}
		})
	}
}

func TestGoldenArrayAndMapFormsMatchThePublisherEncoding(t *testing.T) {
	byName := map[string]string{}
	for _, v := range sharedtest.KVEventVectors(t) {
		byName[v.Name] = v.Hex
	}
	ev := kt.Stored(nil, []uint64{11}, []uint32{10, 11}, 2).WithMedium("GPU")
	cases := []struct {
		name  string
		batch kt.Batch
	}{
		{"stored-array-form", kt.Batch{TS: 1.5, DPRank: u32p(0), Events: []kt.Event{ev}}},
		{"stored-map-form", kt.Batch{TS: 1.5, DPRank: u32p(0), Events: []kt.Event{ev.AsMap()}}},
		{"removed-array-form", kt.Batch{TS: 1.5, DPRank: u32p(0), Events: []kt.Event{kt.Removed(11).WithMedium("GPU")}}},
		{"cleared", kt.Batch{TS: 1.5, DPRank: u32p(0), Events: []kt.Event{kt.Cleared()}}},
		{"two-element-batch-no-dp-rank", kt.Batch{TS: 1.5, TwoElements: true, Events: []kt.Event{kt.Cleared()}}},
	}
	for _, c := range cases {
		t.Run("kveventstest encodes "+c.name+" byte for byte", func(t *testing.T) {
			if got := hex.EncodeToString(c.batch.Encode()); got != byName[c.name] {
				t.Errorf("encoding differs from the golden vector:\n got %s\nwant %s", got, byName[c.name])
			}
		})
	}
}

func mustMarshal(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDecodeBatchToleratesEveryWireVariant(t *testing.T) {
	stored := kt.Stored(kt.Parent(7), []uint64{1, 2}, []uint32{1, 2, 3, 4}, 2)
	wantStored := kvevents.RawEvent{Type: "BlockStored", BlockHashes: []uint64{1, 2}, HasParent: true, ParentHash: 7,
		TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 2}
	cases := []struct {
		name    string
		payload []byte
		want    kvevents.Batch
	}{
		{
			name:    "array and map events mix in one batch",
			payload: kt.Batch{TS: 2, DPRank: u32p(3), Events: []kt.Event{stored, stored.AsMap(), kt.Removed(1).AsMap(), kt.Cleared().AsMap()}}.Encode(),
			want: kvevents.Batch{TS: 2, DPRank: u32p(3), Events: []kvevents.RawEvent{wantStored, wantStored,
				{Type: "BlockRemoved", BlockHashes: []uint64{1}}, {Type: "AllBlocksCleared"}}},
		},
		{
			name:    "a map batch decodes like an array batch",
			payload: kt.Batch{TS: 2, DPRank: u32p(1), MapForm: true, Events: []kt.Event{stored}}.Encode(),
			want:    kvevents.Batch{TS: 2, DPRank: u32p(1), Events: []kvevents.RawEvent{wantStored}},
		},
		{
			name:    "a map batch missing keys takes defaults",
			payload: mustMarshal(t, map[string]any{"events": []any{}, "other": 1}),
			want:    kvevents.Batch{Events: []kvevents.RawEvent{}},
		},
		{
			name:    "batch elements after the third are ignored",
			payload: mustMarshal(t, []any{1.5, []any{[]any{"AllBlocksCleared"}}, 2, "extra", []any{1}}),
			want:    kvevents.Batch{TS: 1.5, DPRank: u32p(2), Events: []kvevents.RawEvent{{Type: "AllBlocksCleared"}}},
		},
		{
			name:    "an integer or float32 timestamp is accepted",
			payload: mustMarshal(t, []any{float32(0.5), []any{}, nil}),
			want:    kvevents.Batch{TS: 0.5, Events: []kvevents.RawEvent{}},
		},
		{
			name:    "an integer timestamp is accepted",
			payload: mustMarshal(t, []any{1700000000, []any{}, nil}),
			want:    kvevents.Batch{TS: 1700000000, Events: []kvevents.RawEvent{}},
		},
		{
			name:    "a negative data_parallel_rank is treated as absent",
			payload: mustMarshal(t, []any{1, []any{}, -1}),
			want:    kvevents.Batch{TS: 1, Events: []kvevents.RawEvent{}},
		},
		{
			name:    "a BlockStored of exactly 5 elements takes defaults for the rest",
			payload: kt.Batch{Events: []kt.Event{stored.WithElements(5)}}.Encode(),
			want:    kvevents.Batch{Events: []kvevents.RawEvent{wantStored}},
		},
		{
			name: "elements after the known BlockStored fields are ignored",
			payload: kt.Batch{Events: []kt.Event{stored.WithGroup(1, "full_attention").WithSlidingWindow(4096).
				WithLocality("LOCAL").WithElements(16)}}.Encode(),
			want: kvevents.Batch{Events: []kvevents.RawEvent{func() kvevents.RawEvent {
				e := wantStored
				e.GroupIdx, e.KVCacheSpecKind, e.SlidingWindow, e.Locality = 1, "full_attention", i64p(4096), "LOCAL"
				return e
			}()}},
		},
		{
			name: "every optional BlockStored field decodes in array form",
			payload: kt.Batch{Events: []kt.Event{stored.WithLoraID(3).WithMedium("cpu").WithLoraName("adapter-a").
				WithExtraKeys([]any{"ns", []any{"img", 0}}, nil).WithGroup(2, "mla_attention").WithLocality("local")}}.Encode(),
			want: kvevents.Batch{Events: []kvevents.RawEvent{func() kvevents.RawEvent {
				e := wantStored
				e.LoraID, e.Medium, e.LoraName = i64p(3), "cpu", "adapter-a"
				e.ExtraKeys = [][]any{{"ns", []any{"img", int64(0)}}, nil}
				e.GroupIdx, e.KVCacheSpecKind, e.Locality = 2, "mla_attention", "local"
				return e
			}()}},
		},
		{
			name:    "map-form cache_salt is read",
			payload: kt.Batch{Events: []kt.Event{stored.WithCacheSalt("tenant-a")}}.Encode(),
			want: kvevents.Batch{Events: []kvevents.RawEvent{func() kvevents.RawEvent {
				e := wantStored
				e.CacheSalt = "tenant-a"
				return e
			}()}},
		},
		{
			name: "an SGLang map in the lora_name slot yields its cache_salt and no LoRA",
			payload: kt.Batch{Events: []kt.Event{func() kt.Event {
				e := stored
				e.LoraName = map[string]any{"cache_salt": "tenant-b", "other": 1}
				return e
			}()}}.Encode(),
			want: kvevents.Batch{Events: []kvevents.RawEvent{func() kvevents.RawEvent {
				e := wantStored
				e.LoraMetaCacheSalt = "tenant-b"
				return e
			}()}},
		},
		{
			name:    "signed, bytes and unsigned hashes of one block decode to one id",
			payload: kt.Batch{Events: []kt.Event{kt.Removed(1 << 63).WithHashEncoding(kt.HashInt64), kt.Removed(1 << 63).WithHashEncoding(kt.HashBytes), kt.Removed(1 << 63)}}.Encode(),
			want: kvevents.Batch{Events: []kvevents.RawEvent{
				{Type: "BlockRemoved", BlockHashes: []uint64{1 << 63}},
				{Type: "BlockRemoved", BlockHashes: []uint64{1 << 63}},
				{Type: "BlockRemoved", BlockHashes: []uint64{1 << 63}}}},
		},
		{
			name:    "a short bytes hash is left-padded with zeros",
			payload: mustMarshal(t, []any{0, []any{[]any{"BlockRemoved", []any{[]byte{1, 2, 3}, "\x01"}}}}),
			want: kvevents.Batch{Events: []kvevents.RawEvent{
				{Type: "BlockRemoved", BlockHashes: []uint64{0x010203, 1}}}},
		},
		{
			name:    "Eagle bigram token pairs are normalized",
			payload: kt.Batch{Events: []kt.Event{kt.Stored(nil, []uint64{1}, []uint32{5, 6, 7}, 2).AsBigrams()}}.Encode(),
			want: kvevents.Batch{Events: []kvevents.RawEvent{
				{Type: "BlockStored", BlockHashes: []uint64{1}, TokenIDs: []uint32{5, 6, 7}, Bigram: true, BlockSize: 2}}},
		},
		{
			name:    "token id 2^32-1 is valid",
			payload: kt.Batch{Events: []kt.Event{kt.Stored(nil, []uint64{1}, []uint32{math.MaxUint32}, 1)}}.Encode(),
			want: kvevents.Batch{Events: []kvevents.RawEvent{
				{Type: "BlockStored", BlockHashes: []uint64{1}, TokenIDs: []uint32{math.MaxUint32}, BlockSize: 1}}},
		},
		{
			name: "optional fields of the wrong type are treated as absent",
			payload: mustMarshal(t, []any{0, []any{[]any{"BlockStored", []any{1}, nil, []any{1, 2}, 2, "not-an-id", 5, 7,
				"not-a-list", "not-an-int", 3, "not-an-int", 9}}}),
			want: kvevents.Batch{Events: []kvevents.RawEvent{
				{Type: "BlockStored", BlockHashes: []uint64{1}, TokenIDs: []uint32{1, 2}, BlockSize: 2}}},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := kvevents.DecodeBatch(c.payload)
			if err != nil {
				t.Fatalf("DecodeBatch: %v", err)
			}
			if d := cmp.Diff(c.want, got, cmpBatch); d != "" {
				t.Errorf("mismatch (-want +got):\n%s", d)
			}
		})
	}
}

func TestDecodeBatchDropsOnlyTheBadEvent(t *testing.T) {
	good := []any{"AllBlocksCleared"}
	cases := []struct {
		name    string
		bad     any
		wantErr error
		wantTyp string
	}{
		{"a negative token id drops the event", []any{"BlockStored", []any{1}, nil, []any{1, -2}, 2}, kvevents.ErrTokenIDOutOfRange, "BlockStored"},
		{"a token id above 2^32-1 drops the event", []any{"BlockStored", []any{1}, nil, []any{1, uint64(1) << 32}, 2}, kvevents.ErrTokenIDOutOfRange, "BlockStored"},
		{"a float token id drops the event", []any{"BlockStored", []any{1}, nil, []any{1, 2.5}, 2}, kvevents.ErrInvalidEvent, "BlockStored"},
		{"a malformed bigram drops the event", []any{"BlockStored", []any{1}, nil, []any{[]any{1, 2}, []any{3}}, 2}, kvevents.ErrInvalidEvent, "BlockStored"},
		{"a BlockStored shorter than 5 elements drops the event", []any{"BlockStored", []any{1}, nil, []any{1, 2}}, kvevents.ErrInvalidEvent, "BlockStored"},
		{"a BlockRemoved without hashes drops the event", []any{"BlockRemoved"}, kvevents.ErrInvalidEvent, "BlockRemoved"},
		{"block_hashes that are not a list drop the event", []any{"BlockRemoved", "x"}, kvevents.ErrInvalidEvent, "BlockRemoved"},
		{"a hash of the wrong type drops the event", []any{"BlockRemoved", []any{1, 2.5}}, kvevents.ErrInvalidEvent, "BlockRemoved"},
		{"a string block_size drops the event", []any{"BlockStored", []any{1}, nil, []any{1, 2}, "2"}, kvevents.ErrInvalidEvent, "BlockStored"},
		{"a negative block_size drops the event", []any{"BlockStored", []any{1}, nil, []any{1, 2}, -2}, kvevents.ErrInvalidEvent, "BlockStored"},
		{"an unknown tag is skipped", []any{"BlockUpdated", []any{1}, map[string]any{"x": []any{1, 2}}}, kvevents.ErrUnknownEventType, "BlockUpdated"},
		{"a map event without type is skipped", map[string]any{"block_hashes": []any{1}}, kvevents.ErrUnknownEventType, ""},
		{"a map BlockStored without token_ids drops the event", map[string]any{"type": "BlockStored", "block_hashes": []any{1}, "block_size": 2}, kvevents.ErrInvalidEvent, "BlockStored"},
		{"an event that is an integer is dropped", 42, kvevents.ErrInvalidEvent, ""},
		{"an empty event array is dropped", []any{}, kvevents.ErrInvalidEvent, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			payload := mustMarshal(t, []any{1.0, []any{good, c.bad, good}, 0})
			b, err := kvevents.DecodeBatch(payload)
			if err != nil {
				t.Fatalf("DecodeBatch dropped the whole batch: %v", err)
			}
			if len(b.Events) != 3 {
				t.Fatalf("got %d events, want 3", len(b.Events))
			}
			for _, i := range []int{0, 2} {
				if b.Events[i].Err != nil || b.Events[i].Type != "AllBlocksCleared" {
					t.Errorf("neighbour event %d = %+v, want a valid AllBlocksCleared", i, b.Events[i])
				}
			}
			if !errors.Is(b.Events[1].Err, c.wantErr) {
				t.Errorf("bad event Err = %v, want %v", b.Events[1].Err, c.wantErr)
			}
			if b.Events[1].Type != c.wantTyp {
				t.Errorf("bad event Type = %q, want %q", b.Events[1].Type, c.wantTyp)
			}
		})
	}
}

func TestDecodeBatchRejectsInvalidPayloads(t *testing.T) {
	// [0, [["X", [[[…nil…]]]]], 0]: valid except for its nesting depth.
	deep := []byte{0x93, 0x00, 0x91, 0x92, 0xa1, 'X'}
	for i := 0; i < 100; i++ {
		deep = append(deep, 0x91)
	}
	deep = append(deep, 0xc0, 0x00)
	cases := []struct {
		name    string
		payload []byte
	}{
		{"an empty payload", nil},
		{"a bare integer", []byte{0x05}},
		{"a one-element array", mustMarshal(t, []any{1.5})},
		{"events that are not an array", mustMarshal(t, []any{1.5, "events", 0})},
		{"a truncated batch", kt.Batch{Events: []kt.Event{kt.Stored(nil, []uint64{1}, []uint32{1, 2}, 2)}}.Encode()[:20]},
		{"an array header claiming 4 billion events", []byte{0x93, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff}},
		{"a token list claiming 4 billion entries", []byte{0x93, 0x00, 0x91, 0x95, 0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd', 0x91, 0x01, 0xc0, 0xdd, 0xff, 0xff, 0xff, 0xff}},
		{"a map header claiming 4 billion entries", []byte{0x93, 0x00, 0x91, 0xdf, 0xff, 0xff, 0xff, 0xff}},
		{"a string claiming 4 GiB", []byte{0x93, 0x00, 0x91, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff}},
		{"nesting deeper than 32 levels", deep},
		{"a reserved msgpack code", []byte{0x93, 0x00, 0x91, 0x92, 0xa1, 'X', 0xc1}},
	}
	for _, c := range cases {
		t.Run(c.name+" is an invalid batch", func(t *testing.T) {
			_, err := kvevents.DecodeBatch(c.payload)
			if !errors.Is(err, kvevents.ErrInvalidBatch) {
				t.Fatalf("DecodeBatch error = %v, want ErrInvalidBatch", err)
			}
		})
	}
}

func TestForgedLengthsDoNotGrowDecoderMemory(t *testing.T) {
	// Each payload declares a 3 GiB string, bin or extension inside an unknown event; msgpack's own
	// readers would grow a pooled buffer by 1 MiB per call.
	payloads := [][]byte{
		{0x93, 0x00, 0x91, 0x92, 0xa1, 'X', 0xdb, 0xc0, 0x00, 0x00, 0x00, 0x00},
		{0x93, 0x00, 0x91, 0x92, 0xa1, 'X', 0xc6, 0xc0, 0x00, 0x00, 0x00, 0x00},
		{0x93, 0x00, 0x91, 0x92, 0xa1, 'X', 0xc9, 0xc0, 0x00, 0x00, 0x00, 0x01, 0x00},
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := 0; i < 300; i++ {
		for _, p := range payloads {
			if _, err := kvevents.DecodeBatch(p); !errors.Is(err, kvevents.ErrInvalidBatch) {
				t.Fatalf("DecodeBatch = %v, want ErrInvalidBatch", err)
			}
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if grown := int64(after.TotalAlloc - before.TotalAlloc); grown > 16<<20 {
		t.Errorf("900 forged payloads allocated %d MiB", grown>>20)
	}
}
