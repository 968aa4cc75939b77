package discovery

import (
	rbacv1 "k8s.io/api/rbac/v1"
	inferencev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
)

// RBACRules are the namespaced permissions kvepp's Kubernetes discovery needs in POD_NAMESPACE,
// and nothing more (epp.md §10.4): get, list and watch on pods and inferencepools (InferencePool
// discovery, this package) and on endpointslices (peer EPP discovery). manifests/base/rbac.yaml
// grants exactly these; a test keeps the two equal.
func RBACRules() []rbacv1.PolicyRule {
	verbs := []string{"get", "list", "watch"}
	return []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: verbs},
		{APIGroups: []string{inferencev1.GroupName}, Resources: []string{"inferencepools"}, Verbs: verbs},
		{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: verbs},
	}
}
