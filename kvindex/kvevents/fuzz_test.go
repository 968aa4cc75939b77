package kvevents_test

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

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
