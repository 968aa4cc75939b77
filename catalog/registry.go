// Package catalog maps policy type names to providers (the registry), parses the policy
// configuration file (DYN_ROUTER_POLICY_CONFIG, selection-service.md §18), and resolves the
// worker-selection policy to use, honouring DYN_ROUTER_WORKER_SELECTION_POLICY
// (selection-service.md §17.4, §18.1; custom-routing-strategies.txt).
//
// A binary that links its own policies builds a registry with Builtins(), registers its types,
// and hands the registry to the runner:
//
//	reg := catalog.Builtins()
//	if err := reg.Register("least-busy", leastbusy.Provider); err != nil { … }
package catalog

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"

	"github.com/kvepp/kvepp/policies"
	"github.com/kvepp/kvepp/policies/defaultcost"
	"github.com/kvepp/kvepp/policies/leastactiverequests"
	"github.com/kvepp/kvepp/policies/leastbusy"
	"github.com/kvepp/kvepp/policies/predictedttft"
	"github.com/kvepp/kvepp/policies/random"
	"github.com/kvepp/kvepp/policies/roundrobin"
	"github.com/kvepp/kvepp/policies/softmaxsampling"
	"github.com/kvepp/kvepp/policies/stackedloadcache"
	"github.com/kvepp/kvepp/policies/subagentgroupaffinity"
	"github.com/kvepp/kvepp/policies/toolresultcachelocal"
	"github.com/kvepp/kvepp/policies/twotiercacheaware"
)

// DefaultName is the reserved name of the built-in policy: it cannot be registered as a type or
// used as an instance name, and as worker_selection.default or DYN_ROUTER_WORKER_SELECTION_POLICY
// it selects the built-in policy.
const DefaultName = "default"

// Registration errors (test with errors.Is; returned errors name the type).
var (
	// ErrEmptyTypeName: the type name is empty or only whitespace.
	ErrEmptyTypeName = errors.New("policy type name must not be empty")
	// ErrReservedTypeName: the type name is "default".
	ErrReservedTypeName = errors.New(`policy type name "default" is reserved`)
	// ErrDuplicateType: the type is already registered (built-in types included).
	ErrDuplicateType = errors.New("policy type is already registered")
	// ErrNilProvider: the provider is nil.
	ErrNilProvider = errors.New("policy provider must not be nil")
)

// Registry maps policy type names to providers (upstream WorkerSelectionPolicyRegistry). The
// built-in type dynamo-default-cost-fn is always registered. Safe for concurrent use.
type Registry struct {
	mu        sync.RWMutex
	providers map[string]policies.Provider
}

// NewRegistry returns a registry holding only the always-registered built-in type
// dynamo-default-cost-fn.
func NewRegistry() *Registry {
	r := &Registry{providers: map[string]policies.Provider{}}
	r.providers[defaultcost.TypeName] = defaultcost.Provider
	return r
}

// Register adds a provider under typeName. Errors: ErrEmptyTypeName, ErrReservedTypeName,
// ErrNilProvider, ErrDuplicateType (including a built-in type name), each naming the type.
func (r *Registry) Register(typeName string, p policies.Provider) error {
	switch {
	case strings.TrimSpace(typeName) == "":
		return fmt.Errorf("register policy type %q: %w", typeName, ErrEmptyTypeName)
	case typeName == DefaultName:
		return fmt.Errorf("register policy type %q: %w", typeName, ErrReservedTypeName)
	case p == nil:
		return fmt.Errorf("register policy type %q: %w", typeName, ErrNilProvider)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.providers[typeName]; ok {
		return fmt.Errorf("register policy type %q: %w", typeName, ErrDuplicateType)
	}
	r.providers[typeName] = p
	return nil
}

// Lookup returns the provider registered under typeName.
func (r *Registry) Lookup(typeName string) (policies.Provider, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	p, ok := r.providers[typeName]
	return p, ok
}

// Types returns the registered type names, sorted.
func (r *Registry) Types() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]string, 0, len(r.providers))
	for t := range r.providers {
		out = append(out, t)
	}
	sort.Strings(out)
	return out
}

// Register registers every compiled-in policy type into r beyond the always-registered
// dynamo-default-cost-fn (none yet; policies/<name> packages add theirs here). It follows the
// catalog-package convention `Register(*Registry) error` of selection-service.md §17.4.
func Register(r *Registry) error {
	for _, b := range compiledIn {
		if err := r.Register(b.typeName, b.provider); err != nil {
			return err
		}
	}
	return nil
}

// compiledIn lists the compiled-in policy types other than the always-registered built-in.
var compiledIn = []struct {
	typeName string
	provider policies.Provider
}{
	{leastbusy.TypeName, leastbusy.Provider},
	{toolresultcachelocal.TypeName, toolresultcachelocal.Provider},
	{stackedloadcache.TypeName, stackedloadcache.Provider},
	{subagentgroupaffinity.TypeName, subagentgroupaffinity.Provider},
	{softmaxsampling.TypeName, softmaxsampling.Provider},
	{twotiercacheaware.TypeName, twotiercacheaware.Provider},
	{roundrobin.TypeName, roundrobin.Provider},
	{random.TypeName, random.Provider},
	{leastactiverequests.TypeName, leastactiverequests.Provider},
	{predictedttft.TypeName, predictedttft.Provider},
}

// Builtins returns a new registry holding every compiled-in policy type (`cmd/epp` passes it to
// the runner). It panics only if the compiled-in list itself is inconsistent (a duplicate name),
// which the package tests rule out.
func Builtins() *Registry {
	r := NewRegistry()
	if err := Register(r); err != nil {
		panic("catalog: compiled-in policy types are inconsistent: " + err.Error())
	}
	return r
}
