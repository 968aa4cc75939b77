package defaultcost

import (
	"math"

	"github.com/kvepp/kvepp/policies"
)

// TypeName is the registered policy type of the built-in cost (selection-service.md §17.4).
const TypeName = "dynamo-default-cost-fn"

// Scorer is the §9.2 cost as a policies.WorkerScorer. It declares CACHE | LOAD | ROUTING, reads
// the request size, block size and prefill-tracking decision from the context, asks the host for
// MinActivePrefillTokens only when tracking and OverlapScoreCreditDecay > 0, and multiplies by the
// preferred-taint multiplier when the ROUTING group carries one (§9.3).
type Scorer struct {
	params    Params
	overrides bool
}

var _ policies.WorkerScorer = (*Scorer)(nil)

// NewScorer returns a scorer with fixed parameters (per-request overrides are ignored, as for a
// configured instance of dynamo-default-cost-fn).
func NewScorer(p Params) *Scorer { return &Scorer{params: p} }

// Params returns the scorer's parameters.
func (s *Scorer) Params() Params { return s.params }

// RequiredWorkerInputs declares CACHE | LOAD | ROUTING.
func (s *Scorer) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsAll }

// Score returns Cost for the candidate. It fails with a policies.PolicyError if the host did not
// supply the CACHE or LOAD group.
func (s *Scorer) Score(ctx *policies.WorkerSelectionContext, c *policies.WorkerCandidate) (float64, error) {
	cache, load := c.Cache(), c.Load()
	if cache == nil || load == nil {
		return 0, policies.Failed(TypeName + ": cache and load inputs are required")
	}
	p := &s.params
	var local Params // the parameters with this request's overrides, only when it has some
	if s.overrides {
		credit, okCredit := ctx.OverlapScoreCreditOverride()
		scale, okScale := ctx.PrefillLoadScaleOverride()
		if okCredit || okScale {
			local = s.params
			if okCredit {
				local.OverlapScoreCredit = credit
			}
			if okScale {
				local.PrefillLoadScale = scale
			}
			p = &local
		}
	}
	track := ctx.TracksPrefillTokens()
	var minActive int
	if track && p.OverlapScoreCreditDecay > 0 {
		minActive = ctx.MinActivePrefillTokens()
	}
	var taint float64
	var hasTaint bool
	if r := c.Routing(); r != nil {
		taint, hasTaint = r.PreferredTaintMultiplier()
	}
	return cost(p, ctx.ISLTokens(), ctx.BlockSize(), track, cache.DeviceOverlapBlocks(), cache.HostOverlapBlocks(),
		cache.DiskOverlapBlocks(), load.ActivePrefillTokens(), minActive, load.DecodeCostBlocks(),
		load.ActiveRequests(), taint, hasTaint), nil
}

// Picker is the §9.4 picking rule as a policies.WorkerPicker: minimum cost with uniform random
// tie-break at temperature 0, softmax over normalised costs at T > 0, using ctx.Rand(). It
// declares no input group. Its cost buffer is reused, so it allocates only when the candidate
// count grows.
type Picker struct {
	temperature float64
	overrides   bool
	costs       []float64
}

var _ policies.WorkerPicker = (*Picker)(nil)

// NewPicker returns a picker with a fixed temperature (per-request overrides ignored).
func NewPicker(temperature float64) *Picker { return &Picker{temperature: temperature} }

// RequiredWorkerInputs declares no group.
func (p *Picker) RequiredWorkerInputs() policies.WorkerInputs { return policies.InputsNone }

// Pick returns the chosen row.
func (p *Picker) Pick(ctx *policies.WorkerSelectionContext, view *policies.WorkerInputView) (int, error) {
	t := p.temperature
	if p.overrides {
		if v, ok := ctx.RouterTemperatureOverride(); ok {
			t = v
		}
	}
	p.costs = p.costs[:0]
	for _, c := range view.Candidates() {
		p.costs = append(p.costs, c.Cost())
	}
	row := Pick(ctx.Rand(), p.costs, t)
	if row < 0 {
		return 0, policies.Failed(TypeName + ": no candidate to pick")
	}
	return row, nil
}

// NewPolicy builds the built-in policy (one Scorer, one Picker) with parameters p. When
// honorOverrides is true the scorer and picker apply the request's overlap_score_credit,
// prefill_load_scale and router_temperature overrides from the context (the built-in "default"
// policy, §9.5); configured instances pass false (§17.4). Errors: invalid parameters, naming
// the parameter.
func NewPolicy(cfg policies.RouterConfig, workerType string, p Params, honorOverrides bool) (*policies.WorkerSelectionPolicy, error) {
	if err := p.Validate(); err != nil {
		return nil, errorf("%w", err)
	}
	return policies.NewPolicy(cfg, workerType,
		[]policies.WorkerScorer{&Scorer{params: p, overrides: honorOverrides}},
		&Picker{temperature: p.RouterTemperature, overrides: honorOverrides})
}

// Builtin returns the factory of the built-in policy used when no custom instance is selected
// (`default`): parameters come from the router configuration and per-request overrides apply.
func Builtin() policies.PolicyFactory {
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return NewPolicy(cfg, workerType, cfg, true)
	}
}

// Parameters are the YAML parameters of a dynamo-default-cost-fn instance (§17.4). Every field is
// optional; an omitted one inherits the router configuration. Unknown fields are rejected.
type Parameters struct {
	OverlapScoreCredit        *float64 `json:"overlap_score_credit,omitempty"`         // Params.OverlapScoreCredit
	PrefillLoadScale          *float64 `json:"prefill_load_scale,omitempty"`           // Params.PrefillLoadScale
	RouterTemperature         *float64 `json:"router_temperature,omitempty"`           // Params.RouterTemperature
	OverlapScoreCreditDecay   *float64 `json:"overlap_score_credit_decay,omitempty"`   // Params.OverlapScoreCreditDecay
	DecodeActiveRequestWeight *float64 `json:"decode_active_request_weight,omitempty"` // Params.DecodeActiveRequestWeight
	HostCacheHitWeight        *float64 `json:"host_cache_hit_weight,omitempty"`        // Params.HostCacheHitWeight
	DiskCacheHitWeight        *float64 `json:"disk_cache_hit_weight,omitempty"`        // Params.DiskCacheHitWeight
	SharedCacheMultiplier     *float64 `json:"shared_cache_multiplier,omitempty"`      // Params.SharedCacheMultiplier (no effect)
}

// apply overlays the set parameters on p.
func (v Parameters) apply(p Params) Params {
	set := func(dst *float64, src *float64) {
		if src != nil {
			*dst = *src
		}
	}
	set(&p.OverlapScoreCredit, v.OverlapScoreCredit)
	set(&p.PrefillLoadScale, v.PrefillLoadScale)
	set(&p.RouterTemperature, v.RouterTemperature)
	set(&p.OverlapScoreCreditDecay, v.OverlapScoreCreditDecay)
	set(&p.DecodeActiveRequestWeight, v.DecodeActiveRequestWeight)
	set(&p.HostCacheHitWeight, v.HostCacheHitWeight)
	set(&p.DiskCacheHitWeight, v.DiskCacheHitWeight)
	set(&p.SharedCacheMultiplier, v.SharedCacheMultiplier)
	return p
}

// validate checks every supplied parameter is finite and ≥ 0, naming the first that is not.
func (v Parameters) validate() error {
	for _, f := range []struct {
		name string
		v    *float64
	}{
		{"overlap_score_credit", v.OverlapScoreCredit},
		{"prefill_load_scale", v.PrefillLoadScale},
		{"router_temperature", v.RouterTemperature},
		{"overlap_score_credit_decay", v.OverlapScoreCreditDecay},
		{"decode_active_request_weight", v.DecodeActiveRequestWeight},
		{"host_cache_hit_weight", v.HostCacheHitWeight},
		{"disk_cache_hit_weight", v.DiskCacheHitWeight},
		{"shared_cache_multiplier", v.SharedCacheMultiplier},
	} {
		if f.v != nil && (math.IsNaN(*f.v) || math.IsInf(*f.v, 0) || *f.v < 0) {
			return errorf("parameter %s must be a finite number ≥ 0, got %v", f.name, *f.v)
		}
	}
	return nil
}

// Provider is the policies.Provider of type dynamo-default-cost-fn: it decodes and validates the
// parameters once (strictly: unknown fields are errors), and returns a factory building, per
// partition, the built-in scorer and picker with the parameters overlaid on the factory's router
// configuration. Per-request overrides do not apply to such an instance (§17.4).
func Provider(params policies.PolicyParameters) (policies.PolicyFactory, error) {
	var v Parameters
	if err := params.Decode(&v); err != nil {
		return nil, errorf("%w", err)
	}
	if err := v.validate(); err != nil {
		return nil, err
	}
	return func(cfg policies.RouterConfig, workerType string, _ policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
		return NewPolicy(cfg, workerType, v.apply(cfg), false)
	}, nil
}
