package runner

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/policies/predictedttft"
)

// pickerConfig builds the selection core's configuration: router settings from the environment,
// the policy-class profiles of DYN_ROUTER_POLICY_CONFIG (policy_classes, models,
// uncached_isl_buckets, default_policy_family; selection-service.md §13.4, §18.2; configured
// classes turn queueing on) and the worker-selection policy resolved through the catalog from
// DYN_ROUTER_POLICY_CONFIG and DYN_ROUTER_WORKER_SELECTION_POLICY (§17.4, §18.1). The EPP and
// `epp select-service` both build their core from it. Any policy error stops startup with a
// message naming the setting.
func pickerConfig(cfg Config, registry *catalog.Registry, log zerolog.Logger) (picker.Config, error) {
	pc := picker.DefaultConfig()
	pc.Router = routerSettings(cfg, log)
	if cfg.SessionAffinityTTL.Set {
		pc.SessionAffinityTTL = time.Duration(cfg.SessionAffinityTTL.Value) * time.Second
	}
	var pol *catalog.Config
	policyConfig := fmt.Sprintf("%s %q", cfg.name("DYN_ROUTER_POLICY_CONFIG"), cfg.PolicyConfig)
	if cfg.PolicyConfig != "" {
		c, err := catalog.LoadConfigFile(cfg.PolicyConfig)
		if err != nil {
			return picker.Config{}, fmt.Errorf("invalid %s: %w", policyConfig, err)
		}
		ps, err := c.QueueProfiles()
		if err != nil {
			return picker.Config{}, fmt.Errorf("invalid %s: %w", policyConfig, err)
		}
		pc.PolicyProfiles = ps
		pol = c
	}
	res, err := catalog.ResolveWithDefaultParams(registry, pol, cfg.WorkerSelectionPolicy, defaultPolicyType(cfg), defaultPolicyParams(cfg))
	if err != nil {
		// Name only the settings that were given (both when both were).
		var named []string
		if cfg.PolicyConfig != "" {
			named = append(named, policyConfig)
		}
		if cfg.WorkerSelectionPolicy != "" || cfg.PolicyConfig == "" {
			named = append(named, fmt.Sprintf("%s %q", cfg.name("DYN_ROUTER_WORKER_SELECTION_POLICY"), cfg.WorkerSelectionPolicy))
		}
		return picker.Config{}, fmt.Errorf("invalid %s: %w", strings.Join(named, " / "), err)
	}
	if !res.Builtin {
		pc.Policy = res.Factory
	}
	pc.EstimatePrefillCompletion = bool(cfg.EstimatePrefillCompletion)
	pc.AssumedPrefillTokensPerSecond = cfg.AssumedPrefillTokensPerSecond
	pc.PrefillAttentionTokens = cfg.PrefillAttentionTokens
	ev := log.Info().Str("policy", res.Name).Str("type", res.Type).Str("selected_by", res.Source)
	if res.Source == catalog.SourceHostDefault {
		if p := defaultPolicyParams(cfg); p != nil {
			ev = ev.RawJSON("params", p)
		}
	}
	ev.Msg("worker-selection policy resolved")
	return pc, nil
}

// defaultPolicyType is the policy type a host runs when nothing selects one: the EPP runs
// predicted-ttft (it predicts time to first token from queued prefill work, uncached tokens and
// measured prefill rates; README "Routing policy"); `epp select-service` keeps the documented
// built-in dynamo-default-cost-fn so Dynamo clients see Dynamo's behaviour. Either gets the other
// with DYN_ROUTER_WORKER_SELECTION_POLICY=default (built-in) or a worker_selection instance.
func defaultPolicyType(cfg Config) string {
	if cfg.selectService {
		return ""
	}
	return predictedttft.TypeName
}

// defaultPolicyParams are the parameters of the host's default policy: predicted-ttft assumes
// DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND for a worker whose prefill rate it has not measured,
// the same rate the estimated prefill release uses, so the two agree (with the default 10,000
// both are predictedttft.DefaultPrefillTokensPerSecond); 0 (no assumed rate) keeps the policy's own
// default. nil = none.
func defaultPolicyParams(cfg Config) []byte {
	if defaultPolicyType(cfg) != predictedttft.TypeName || !(cfg.AssumedPrefillTokensPerSecond > 0) {
		return nil
	}
	return []byte(`{"prefill_tokens_per_second":` + strconv.FormatFloat(cfg.AssumedPrefillTokensPerSecond, 'g', -1, 64) + `}`)
}

// PickerConfig builds the selection core's configuration from cfg exactly as the EPP does (router
// settings, policy file and policy selection, prefill-completion estimates), without an event
// source, logger or clock, which the caller adds. eppbench's virtual replay runs the EPP's
// selection core in-process with it. Errors: as startup's, naming the setting.
func PickerConfig(cfg Config, registry *catalog.Registry) (picker.Config, error) {
	return pickerConfig(cfg, registry, zerolog.Nop())
}
