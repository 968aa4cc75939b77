package runner

import (
	"fmt"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/picker"
)

// pickerConfig builds the selection core's configuration: router settings from the environment
// and the worker-selection policy resolved through the catalog from DYN_ROUTER_POLICY_CONFIG and
// DYN_ROUTER_WORKER_SELECTION_POLICY (selection-service.md §17.4, §18). Any policy error stops
// startup with a message naming the setting.
func pickerConfig(cfg Config, registry *catalog.Registry, log zerolog.Logger) (picker.Config, error) {
	pc := picker.DefaultConfig()
	pc.Router = routerSettings(cfg, log)
	if cfg.SessionAffinityTTL.Set {
		pc.SessionAffinityTTL = time.Duration(cfg.SessionAffinityTTL.Value) * time.Second
	}
	var pol *catalog.Config
	if cfg.PolicyConfig != "" {
		c, err := catalog.LoadConfigFile(cfg.PolicyConfig)
		if err != nil {
			return picker.Config{}, fmt.Errorf("invalid DYN_ROUTER_POLICY_CONFIG %q: %w", cfg.PolicyConfig, err)
		}
		if len(c.PolicyClasses) > 0 || len(c.Models) > 0 || len(c.UncachedISLBuckets) > 0 || c.DefaultPolicyFamily != "" {
			return picker.Config{}, fmt.Errorf("invalid DYN_ROUTER_POLICY_CONFIG %q: policy classes (policy_classes, models, uncached_isl_buckets, default_policy_family) are not supported by this build yet; only worker_selection is", cfg.PolicyConfig)
		}
		pol = c
	}
	res, err := catalog.Resolve(registry, pol, cfg.WorkerSelectionPolicy)
	if err != nil {
		if cfg.PolicyConfig != "" {
			return picker.Config{}, fmt.Errorf("invalid DYN_ROUTER_POLICY_CONFIG %q / DYN_ROUTER_WORKER_SELECTION_POLICY %q: %w", cfg.PolicyConfig, cfg.WorkerSelectionPolicy, err)
		}
		return picker.Config{}, fmt.Errorf("invalid DYN_ROUTER_WORKER_SELECTION_POLICY %q: %w", cfg.WorkerSelectionPolicy, err)
	}
	if !res.Builtin {
		pc.Policy = res.Factory
	}
	log.Info().Str("policy", res.Name).Str("type", res.Type).Str("selected_by", res.Source).Msg("worker-selection policy resolved")
	return pc, nil
}
