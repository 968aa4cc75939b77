package predictedttft_test

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
	"github.com/kvepp/kvepp/policies/policytest"
	"github.com/kvepp/kvepp/policies/predictedttft"
)

// BenchmarkSelect runs one selection of predicted-ttft and, for comparison in the same run,
// the built-in dynamo-default-cost-fn, over N candidates with random overlaps and loads
// (benchstat: policy=predicted-ttft vs policy=dynamo-default-cost-fn).
func BenchmarkSelect(b *testing.B) {
	for _, n := range []int{2, 32, 1024, 10000} {
		gen := rand.New(rand.NewPCG(1, 2))
		s := make(policytest.Source, n)
		for i := range s {
			s[i] = policytest.Candidate{Worker: policies.Worker{WorkerID: uint64(i)}, Device: gen.IntN(32), Prefill: gen.IntN(4096),
				DecodeCost: 100 + gen.IntN(300), Requests: gen.IntN(20),
				Engine: policies.EngineLoad{PrefillTokensPerSecond: 9000 + 2000*gen.Float64(), PrefillRateSamples: 40,
					PoolPrefillTokensPerSecond: 10000, PoolArrivalsPerSecond: 3, PoolCandidates: n, ActiveBlocks: 100, TotalKVBlocks: 20000}}
		}
		cfg := policies.DefaultRouterConfig()
		for _, pol := range []struct {
			name    string
			factory policies.PolicyFactory
		}{
			{predictedttft.TypeName, func() policies.PolicyFactory {
				f, err := predictedttft.Provider(policytest.Params(b, ""))
				if err != nil {
					b.Fatal(err)
				}
				return f
			}()},
			{defaultcost.TypeName, defaultcost.Builtin()},
		} {
			b.Run(fmt.Sprintf("policy=%s/N=%d", pol.name, n), func(b *testing.B) {
				p, err := pol.factory(cfg, "select", policies.PartitionID{})
				if err != nil {
					b.Fatal(err)
				}
				ctx := policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 1024, BlockSize: bs, TracksPrefillTokens: true,
					Rand: rand.New(rand.NewPCG(1, 1))})
				policytest.BenchSelect(b, p, ctx, s)
			})
		}
	}
}
