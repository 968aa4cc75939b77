package picker_test

import (
	"strconv"
	"testing"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/policytest"
	"github.com/kvepp/kvepp/policies/predictedttft"
)

// BenchmarkSelectAndReserveFree measures one in-process SelectAndReserve plus its Free on a
// partition of 32 single-rank workers (block size 16, a 512-token prompt = 32 blocks), with 16
// workers holding device prefixes of the prompt of 2..32 blocks and 8 background bookings live,
// with the built-in policy and with predicted-ttft (the EPP's default). Goal: ≤ 20 µs per
// iteration.
func BenchmarkSelectAndReserveFree(b *testing.B) {
	ttft, err := predictedttft.Provider(policytest.Params(b, ""))
	if err != nil {
		b.Fatal(err)
	}
	for _, pol := range []struct {
		name    string
		factory policies.PolicyFactory // nil: the built-in dynamo-default-cost-fn
	}{{"dynamo-default-cost-fn", nil}, {predictedttft.TypeName, ttft}} {
		for _, mode := range []string{"kv_events", "approximate"} {
			benchSelectAndReserveFree(b, pol.name, pol.factory, mode)
		}
	}
}

// benchSelectAndReserveFree is one BenchmarkSelectAndReserveFree case (sub-benchmark
// policy=…/mode): 32 workers, half of them caching part of the prompt.
func benchSelectAndReserveFree(b *testing.B, policy string, factory policies.PolicyFactory, mode string) {
	b.Run("policy="+policy+"/"+mode, func(b *testing.B) {
		ev := pickertest.NewEventSource()
		mods := []func(*picker.Config){func(c *picker.Config) { c.Policy = factory }}
		if mode == "kv_events" {
			mods = append(mods, withEvents(ev))
		}
		s := newService(b, mods...)
		toks := tokens(512)
		local := kvindex.BlockHashes(toks, 16, kvindex.BaseSeed)
		for id := uint64(1); id <= 32; id++ {
			mustUpsert(b, s, worker(id, func(r *picker.WorkerRecord) {
				r.BlockSize = u32(16)
				r.KVEventsEndpoint = "tcp://w:" + strconv.FormatUint(id, 10)
			}))
			if mode == "kv_events" && id <= 16 {
				ev.Store(b, id, 0, kvindex.TierDevice, nil, local[:2*id]...)
			}
		}
		for i := 0; i < 8; i++ {
			if _, err := s.SelectAndReserve(ctxb(), tokenReq(tokens(100+i))); err != nil {
				b.Fatal(err)
			}
		}
		req := tokenReq(toks, func(r *picker.SelectRequest) { r.SelectionID = "bench" })
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if _, err := s.SelectAndReserve(ctxb(), req); err != nil {
				b.Fatal(err)
			}
			if err := s.Free(ctxb(), "bench"); err != nil {
				b.Fatal(err)
			}
		}
	})
}
