package policies

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
)

// RouterConfig is the router configuration a policy factory receives (selection-service.md §9,
// §19.2). Weights are dimensionless, temperature ≥ 0.
type RouterConfig struct {
	// OverlapScoreCredit is overlap_score_credit (DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT, default 1).
	OverlapScoreCredit float64
	// PrefillLoadScale is prefill_load_scale (DYN_ROUTER_PREFILL_LOAD_SCALE, default 1).
	PrefillLoadScale float64
	// RouterTemperature is router_temperature (DYN_ROUTER_TEMPERATURE, default 0 = argmin).
	RouterTemperature float64
	// OverlapScoreCreditDecay is overlap_score_credit_decay (default 0 = disabled).
	OverlapScoreCreditDecay float64
	// DecodeActiveRequestWeight is decode_active_request_weight (default 0).
	DecodeActiveRequestWeight float64
	// HostCacheHitWeight is host_cache_hit_weight (default 0.75).
	HostCacheHitWeight float64
	// DiskCacheHitWeight is disk_cache_hit_weight (default 0.25; also weights the external tier).
	DiskCacheHitWeight float64
	// SharedCacheMultiplier is shared_cache_multiplier (default 0; accepted, no effect in kvepp).
	SharedCacheMultiplier float64
}

// DefaultRouterConfig returns the §19.2 defaults: credit 1, scale 1, temperature 0, decay 0,
// request weight 0, host 0.75, disk 0.25, shared-cache multiplier 0.
func DefaultRouterConfig() RouterConfig {
	return RouterConfig{
		OverlapScoreCredit: 1,
		PrefillLoadScale:   1,
		HostCacheHitWeight: 0.75,
		DiskCacheHitWeight: 0.25,
	}
}

// Validate checks that every field is finite and ≥ 0; the error names the first offending field
// by its parameter name.
func (c RouterConfig) Validate() error {
	for _, f := range []struct {
		name string
		v    float64
	}{
		{"overlap_score_credit", c.OverlapScoreCredit},
		{"prefill_load_scale", c.PrefillLoadScale},
		{"router_temperature", c.RouterTemperature},
		{"overlap_score_credit_decay", c.OverlapScoreCreditDecay},
		{"decode_active_request_weight", c.DecodeActiveRequestWeight},
		{"host_cache_hit_weight", c.HostCacheHitWeight},
		{"disk_cache_hit_weight", c.DiskCacheHitWeight},
		{"shared_cache_multiplier", c.SharedCacheMultiplier},
	} {
		if math.IsNaN(f.v) || math.IsInf(f.v, 0) || f.v < 0 {
			return fmt.Errorf("%s must be a finite number ≥ 0, got %v", f.name, f.v)
		}
	}
	return nil
}

// PartitionID identifies a routing partition (model_name, routing_group), selection-service.md §3.
type PartitionID struct {
	ModelName    string // model_name ("default" when omitted by requests)
	RoutingGroup string // routing_group ("default" when omitted by requests)
}

// String renders the partition as "model:group".
func (p PartitionID) String() string { return p.ModelName + ":" + p.RoutingGroup }

// PolicyFactory builds one policy instance per partition (selection-service.md §17.4). workerType
// is "select" in kvepp (standalone service and standalone EPP). Errors stop partition creation.
type PolicyFactory func(cfg RouterConfig, workerType string, partition PartitionID) (*WorkerSelectionPolicy, error)

// Provider parses and validates an instance's parameters once at startup and returns the factory
// (selection-service.md §17.4). Errors stop startup.
type Provider func(params PolicyParameters) (PolicyFactory, error)

// PolicyParameters is an instance's `parameters` mapping from the policy YAML, held as a JSON
// object (the catalog converts YAML to JSON). The zero value is the empty mapping.
type PolicyParameters struct {
	raw []byte
}

// NewPolicyParameters wraps raw JSON. Empty input or JSON null is the empty mapping; anything but
// a JSON object is an error.
func NewPolicyParameters(raw []byte) (PolicyParameters, error) {
	trimmed := bytes.TrimSpace(raw)
	if len(trimmed) == 0 || bytes.Equal(trimmed, []byte("null")) {
		return PolicyParameters{}, nil
	}
	if trimmed[0] != '{' || !json.Valid(trimmed) {
		return PolicyParameters{}, fmt.Errorf("policy parameters must be a mapping, got %.40q", trimmed)
	}
	return PolicyParameters{raw: append([]byte(nil), trimmed...)}, nil
}

// Raw returns a copy of the JSON object ("{}" for the empty mapping).
func (p PolicyParameters) Raw() []byte {
	if len(p.raw) == 0 {
		return []byte("{}")
	}
	return append([]byte(nil), p.raw...)
}

// Decode decodes the parameters strictly into v (a pointer to a struct with json tags): unknown
// fields, type mismatches and trailing data are errors naming the offending field.
func (p PolicyParameters) Decode(v any) error {
	raw := p.raw
	if len(raw) == 0 {
		raw = []byte("{}")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("invalid policy parameters: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("invalid policy parameters: trailing data after the mapping")
	}
	return nil
}
