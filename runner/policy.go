package runner

import (
	"fmt"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/picker"
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
	res, err := catalog.Resolve(registry, pol, cfg.WorkerSelectionPolicy)
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
	log.Info().Str("policy", res.Name).Str("type", res.Type).Str("selected_by", res.Source).Msg("worker-selection policy resolved")
	return pc, nil
}
