package kvevents_test

import (
	"testing"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

// benchPayloads returns a batch of 16 stored blocks of 16 tokens, as one 16-block BlockStored
// (vLLM's usual shape) or as 16 single-block stores.
func benchPayload(oneEvent bool) []byte {
	const bs, n = 16, 16
	tokens := make([]uint32, bs*n)
	for i := range tokens {
		tokens[i] = uint32(1000 + i*7)
	}
	hashes := make([]uint64, n)
	for i := range hashes {
		hashes[i] = 0x9e3779b97f4a7c15 * uint64(i+1)
	}
	rank := uint32(0)
	if oneEvent {
		return kt.Batch{TS: 1.5, DPRank: &rank, Events: []kt.Event{kt.Stored(kt.Parent(7), hashes, tokens, bs).WithMedium("GPU")}}.Encode()
	}
	events := make([]kt.Event, n)
	parent := uint64(7)
	for i := range events {
		events[i] = kt.Stored(kt.Parent(parent), hashes[i:i+1], tokens[i*bs:(i+1)*bs], bs).WithMedium("GPU")
		parent = hashes[i]
	}
	return kt.Batch{TS: 1.5, DPRank: &rank, Events: events}.Encode()
}

// BenchmarkDecodeConvert measures DecodeBatch + Converter.Convert of a batch of 16 stored
// 16-token blocks; blocks/s is the throughput of one listener goroutine before the index.
func BenchmarkDecodeConvert(b *testing.B) {
	for _, c := range []struct {
		name     string
		oneEvent bool
	}{{"one_16-block_store", true}, {"16_one-block_stores", false}} {
		b.Run(c.name, func(b *testing.B) {
			payload := benchPayload(c.oneEvent)
			conv := kvevents.NewConverter(1, 0, 16, false)
			var dst []kvindex.Event
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			for b.Loop() {
				batch, err := kvevents.DecodeBatch(payload)
				if err != nil {
					b.Fatal(err)
				}
				var errs []error
				dst, errs = conv.Convert(batch, 1, dst[:0])
				if len(errs) != 0 || len(dst) == 0 {
					b.Fatalf("convert: %d events, errors %v", len(dst), errs)
				}
			}
			b.ReportMetric(float64(16*b.N)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}
