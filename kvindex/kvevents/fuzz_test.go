package kvevents_test

import (
	"encoding/binary"
	"encoding/json"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

// meaning keeps the fields an event's type gives meaning to, so a batch can be compared with
// its re-encoding (which drops fields foreign to the type).
func meaning(ev kvevents.RawEvent) kvevents.RawEvent {
	switch ev.Type {
	case kvevents.TypeAllBlocksCleared:
		return kvevents.RawEvent{Type: ev.Type}
	case kvevents.TypeBlockRemoved:
		return kvevents.RawEvent{Type: ev.Type, BlockHashes: ev.BlockHashes, Medium: ev.Medium, GroupIdx: ev.GroupIdx,
			KVCacheSpecKind: ev.KVCacheSpecKind, SlidingWindow: ev.SlidingWindow, Locality: ev.Locality}
	}
	ev.Err = nil
	return ev
}

// reencode turns a decoded event back into wire form with kveventstest.
func reencode(ev kvevents.RawEvent) kt.Event {
	var e kt.Event
	switch ev.Type {
	case kvevents.TypeAllBlocksCleared:
		return kt.Cleared()
	case kvevents.TypeBlockRemoved:
		e = kt.Removed(ev.BlockHashes...)
	default:
		var parent *uint64
		if ev.HasParent {
			parent = kt.Parent(ev.ParentHash)
		}
		e = kt.Stored(parent, ev.BlockHashes, ev.TokenIDs, ev.BlockSize)
		e.Bigram = ev.Bigram
		e.LoraID = ev.LoraID
		switch {
		case ev.LoraName != "":
			e = e.WithLoraName(ev.LoraName)
		case ev.LoraMetaCacheSalt != "":
			e.LoraName = map[string]any{"cache_salt": ev.LoraMetaCacheSalt}
		}
		if ev.ExtraKeys != nil {
			e = e.WithExtraKeys(ev.ExtraKeys...)
		}
		if ev.CacheSalt != "" {
			e = e.WithCacheSalt(ev.CacheSalt)
		}
	}
	if ev.Medium != "" {
		e = e.WithMedium(ev.Medium)
	}
	if ev.GroupIdx != 0 || ev.KVCacheSpecKind != "" {
		e = e.WithGroup(ev.GroupIdx, ev.KVCacheSpecKind)
	}
	e.SlidingWindow = ev.SlidingWindow
	if ev.Locality != "" {
		e = e.WithLocality(ev.Locality)
	}
	return e
}

func validMeaning(b kvevents.Batch) kvevents.Batch {
	out := kvevents.Batch{TS: b.TS, DPRank: b.DPRank}
	for _, ev := range b.Events {
		if ev.Err == nil {
			out.Events = append(out.Events, meaning(ev))
		}
	}
	return out
}

// FuzzDecodeBatch checks that no input makes DecodeBatch or Convert panic, and that every batch
// that decodes keeps its meaning when re-encoded and decoded again. The committed seed corpus in
// testdata/fuzz/FuzzDecodeBatch holds the golden vectors of shared/golden/kv-events.json.
func FuzzDecodeBatch(f *testing.F) {
	rank := uint32(2)
	f.Add(kt.Batch{TS: 3, DPRank: &rank, Events: []kt.Event{
		kt.Stored(kt.Parent(9), []uint64{1, 2}, []uint32{1, 2, 3, 4, 5, 6, 7, 8}, 4).WithLoraName("a").
			WithExtraKeys([]any{"tenant", []any{"img", 3}}, nil).WithGroup(1, "full_attention").WithLocality("LOCAL"),
		kt.Stored(nil, []uint64{3}, []uint32{1, 2, 3, 4, 5}, 4).AsBigrams().WithCacheSalt("ns").WithHashEncoding(kt.HashBytes),
		kt.Removed(1<<63, 5).WithMedium("CPU").WithHashEncoding(kt.HashInt64),
		kt.Cleared().AsMap(),
	}}.Encode())
	f.Add(kt.Batch{MapForm: true, Events: []kt.Event{kt.Removed(1)}}.Encode())
	f.Add(kt.Batch{TwoElements: true, Events: []kt.Event{kt.Raw([]any{"Unknown", 1})}}.Encode())

	f.Fuzz(func(t *testing.T, payload []byte) {
		b, err := kvevents.DecodeBatch(payload)
		for _, eagle := range []bool{false, true} {
			conv := kvevents.NewConverter(1, 0, 4, eagle)
			conv.SetRankRange(0, 4)
			conv.Convert(b, 1, nil)
		}
		if err != nil {
			return
		}
		events := make([]kt.Event, 0, len(b.Events))
		for _, ev := range b.Events {
			if ev.Err == nil {
				events = append(events, reencode(ev))
			}
		}
		again, err := kvevents.DecodeBatch(kt.Batch{TS: b.TS, DPRank: b.DPRank, Events: events}.Encode())
		if err != nil {
			t.Fatalf("re-encoded batch does not decode: %v", err)
		}
		if d := cmp.Diff(validMeaning(b), validMeaning(again), cmpopts.EquateEmpty(), cmpopts.EquateNaNs()); d != "" {
			t.Fatalf("meaning changed by a round trip (-first +second):\n%s", d)
		}
	})
}

// framePayloads joins payloads as the input of FuzzApplyDecodedBatches: each is prefixed by its
// length as a 2-byte big-endian integer.
func framePayloads(payloads ...[]byte) []byte {
	var out []byte
	for _, p := range payloads {
		out = binary.BigEndian.AppendUint16(out, uint16(len(p)))
		out = append(out, p...)
	}
	return out
}

// pipelineSeeds are event streams for FuzzApplyDecodedBatches: chains across batches with
// namespaces, LoRA, multimodal keys, lower tiers, removals, clears and a dp_rank override.
func pipelineSeeds() [][]byte {
	r1 := uint32(1)
	return [][]byte{
		framePayloads(
			kt.Batch{Events: []kt.Event{storeChain(1, 0, 2).WithCacheSalt("tenant")}}.Encode(),
			kt.Batch{Events: []kt.Event{storeChain(1, 2, 4), storeChain(1, 4, 5).WithMedium("CPU")}}.Encode(),
			kt.Batch{Events: []kt.Event{kt.Removed(ext(1, 1)), storeChain(1, 5, 6).WithMedium("DISK")}}.Encode(),
			kt.Batch{DPRank: &r1, Events: []kt.Event{storeChain(2, 0, 3).WithLoraName("adapter")}}.Encode(),
		),
		framePayloads(
			kt.Batch{Events: []kt.Event{storeChain(3, 0, 2).WithExtraKeys([]any{sha256Of42}, []any{"tenant"})}}.Encode(),
			kt.Batch{Events: []kt.Event{kt.Cleared(), storeChain(3, 0, 1), storeChain(3, 1, 3).AsMap()}}.Encode(),
			kt.Batch{Events: []kt.Event{kt.Removed(ext(3, 0)).WithMedium("GPU"), storeChain(3, 3, 4)}}.Encode(),
		),
	}
}

// FuzzApplyDecodedBatches drives the whole ingestion path — DecodeBatch, a Converter (worker 1,
// ranks [0, 2), block size 4) and Index.Apply — with a stream of payloads, then checks: nothing
// panics; every match is cumulative (gpu ≤ cpu ≤ disk) and no longer than its query, for queries
// following every stored block's parent chain from the root; and the index's dump survives JSON
// and restores to the same device answers. The committed seed corpus is in
// testdata/fuzz/FuzzApplyDecodedBatches.
func FuzzApplyDecodedBatches(f *testing.F) {
	for _, s := range pipelineSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		type link struct {
			parent    uint64
			hasParent bool
			local     uint64
		}
		type key struct {
			rank uint32
			ext  uint64
		}
		ix := kvindex.New(kvindex.Config{BlockSize: 4})
		conv := kvevents.NewConverter(1, 0, 4, false)
		conv.SetRankRange(0, 2)
		links := map[key]link{}
		var evs []kvindex.Event
		for seq := uint64(0); len(data) >= 2 && seq < 64; seq++ {
			n := min(int(binary.BigEndian.Uint16(data)), len(data)-2)
			payload := data[2 : 2+n]
			data = data[2+n:]
			b, err := kvevents.DecodeBatch(payload)
			if err != nil {
				continue
			}
			evs, _ = conv.Convert(b, seq, evs[:0])
			for _, ev := range evs {
				_ = ix.Apply(ev)
				if ev.Kind != kvindex.EventStored {
					continue
				}
				parent, has := ev.ParentHash, ev.HasParent
				for _, blk := range ev.Blocks {
					links[key{ev.DPRank, blk.BlockHash}] = link{parent: parent, hasParent: has, local: blk.TokensHash}
					parent, has = blk.BlockHash, true
				}
			}
		}
		var queries [][]uint64
		for k := range links {
			var q []uint64
			for cur, ok := k, true; ok && len(q) < 64; {
				l, found := links[cur]
				if !found {
					break
				}
				q = append(q, l.local)
				cur, ok = key{k.rank, l.parent}, l.hasParent
			}
			slices.Reverse(q)
			queries = append(queries, q)
		}
		raw, err := json.Marshal(ix.Dump())
		if err != nil {
			t.Fatal(err)
		}
		var dumped []kvindex.RouterEvent
		if err := json.Unmarshal(raw, &dumped); err != nil {
			t.Fatal(err)
		}
		restored := kvindex.New(kvindex.Config{BlockSize: 4})
		if err := restored.Restore(dumped); err != nil {
			t.Fatalf("restore: %v", err)
		}
		for _, q := range queries {
			var device []kvindex.Match
			for _, m := range sortMatches(ix.FindMatches(q, nil)) {
				gpu, cpu, disk := m.CumulativeTokens(4)
				if m.Blocks() > uint32(len(q)) || gpu > cpu || cpu > disk {
					t.Fatalf("query %v: match %+v (gpu %d cpu %d disk %d)", q, m, gpu, cpu, disk)
				}
				if m.Device > 0 {
					device = append(device, kvindex.Match{Candidate: m.Candidate, Device: m.Device})
				}
			}
			if d := cmp.Diff(device, sortMatches(restored.FindMatches(q, nil)), cmpopts.EquateEmpty()); d != "" {
				t.Fatalf("query %v: restored dump answers differently (-original +restored):\n%s", q, d)
			}
		}
	})
}
