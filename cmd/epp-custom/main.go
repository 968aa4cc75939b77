// Command epp-custom is kvepp's EPP with one extra, separately written worker-selection policy
// linked in: examples/custompolicy (type acme-least-kv) next to every compiled-in policy of the
// standard catalog. It is started and configured exactly like cmd/epp (same flags, DYN_*
// settings and `select-service` subcommand); DYN_ROUTER_POLICY_CONFIG selects the policy. It is
// the template a policy author copies: see README.md.
package main

import (
	"context"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/examples/custompolicy"
	"github.com/kvepp/kvepp/runner"
)

func main() { runner.Main("epp-custom", run) }

// run registers the custom policy on the standard catalog and runs the standard EPP.
func run(ctx context.Context, args []string) error {
	reg := catalog.Builtins()
	if err := custompolicy.Register(reg); err != nil {
		return err
	}
	return runner.Run(ctx, reg, args)
}
