package policies_test

import (
	"fmt"
	"math/rand/v2"

	"github.com/kvepp/kvepp/policies"
)

// The reference document's "least-busy" policy: keep candidates with enough device overlap,
// score by active requests, pick the lowest cost.
type exampleMinOverlap struct{ minBlocks int }

func (exampleMinOverlap) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsCache }
func (f exampleMinOverlap) Keep(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (bool, error) {
	cache := c.Cache()
	if cache == nil {
		return false, policies.Failed("cache input unavailable")
	}
	return cache.DeviceOverlapBlocks() >= f.minBlocks, nil
}

type exampleActiveRequests struct{}

func (exampleActiveRequests) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsLoad }
func (exampleActiveRequests) Score(_ *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	load := c.Load()
	if load == nil {
		return 0, policies.Failed("load input unavailable")
	}
	return float64(load.ActiveRequests()), nil
}

type exampleLowestCost struct{}

func (exampleLowestCost) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }
func (exampleLowestCost) Pick(_ *policies.WorkerSelectionContext, v *policies.WorkerInputView) (int, error) {
	if v.Len() == 0 {
		return 0, policies.Failed("no eligible worker")
	}
	best := 0
	for row, c := range v.Candidates() {
		if c.Cost() < v.Candidates()[best].Cost() {
			best = row
		}
	}
	return best, nil
}

type exampleSource struct{ device, requests []int }

func (s exampleSource) Cache(i int) policies.CacheInputs {
	return policies.NewCacheInputs(s.device[i], 0, 0, 0)
}
func (s exampleSource) Load(i int) policies.LoadInputs {
	return policies.NewLoadInputs(0, 0, s.requests[i])
}
func (s exampleSource) Routing(int) policies.RoutingInputs { return policies.RoutingInputs{} }

func Example() {
	// Provider: parse parameters once, capture them in the factory.
	provider := func(params policies.PolicyParameters) (policies.PolicyFactory, error) {
		var p struct {
			MinDeviceOverlapBlocks int `json:"min_device_overlap_blocks"`
		}
		if err := params.Decode(&p); err != nil {
			return nil, err
		}
		return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
			return policies.NewPolicyWithFilters(cfg, workerType,
				[]policies.WorkerFilter{exampleMinOverlap{p.MinDeviceOverlapBlocks}},
				[]policies.WorkerScorer{exampleActiveRequests{}},
				exampleLowestCost{})
		}, nil
	}
	params, _ := policies.NewPolicyParameters([]byte(`{"min_device_overlap_blocks": 1}`))
	factory, err := provider(params)
	if err != nil {
		panic(err)
	}
	policy, _ := factory(policies.DefaultRouterConfig(), "select", policies.PartitionID{ModelName: "m", RoutingGroup: "default"})

	// Host side: candidates, lazily computed inputs, a request context.
	workers := []policies.Worker{{WorkerID: 1}, {WorkerID: 2}, {WorkerID: 3}}
	src := exampleSource{device: []int{0, 4, 2}, requests: []int{0, 7, 3}}
	ctx := policies.NewWorkerSelectionContext(policies.ContextParams{ISLTokens: 64, BlockSize: 16,
		Rand: rand.New(rand.NewPCG(1, 2))})
	res, err := policy.Select(ctx, workers, src)
	fmt.Println(res.Worker, res.Cost, err)
	// Output: worker 3 dp_rank 0 3 <nil>
}
