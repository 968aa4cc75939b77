package picker

import (
	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
)

// builtinFactory is the built-in dynamo-default-cost-fn policy (selection-service.md §9) with
// per-request overrides honoured; it is used when Config.Policy is nil and always for the pinned
// and exact-target paths (§8 steps 4 and 6).
func builtinFactory() policies.PolicyFactory { return defaultcost.Builtin() }

// effectivePrefill is effective_prefill_tokens (§9.1): isl − min(cached_tokens, isl) where
// cached_tokens = max(0, round((device + host_w × host_ext + disk_w × disk_ext) × bs)), with the
// configured (non-overridable) tier weights. Tokens.
func (s *Service) effectivePrefill(isl uint64, t tierMatch, bs uint32) uint64 {
	p := defaultcost.Params{HostCacheHitWeight: s.cfg.Router.HostCacheHitWeight, DiskCacheHitWeight: s.cfg.Router.DiskCacheHitWeight}
	cached := uint64(defaultcost.CachedTokens(p, int(t.device), int(t.host), int(t.disk), int(bs)))
	return isl - min(cached, isl)
}
