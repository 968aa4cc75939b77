// Command epp-custom is kvepp's EPP with one extra, separately written worker-selection policy
// linked in: examples/custompolicy (type acme-least-kv) next to every compiled-in policy of the
// standard catalog. It is started and configured exactly like cmd/epp (same flags, DYN_*
// settings and `select-service` subcommand); DYN_ROUTER_POLICY_CONFIG selects the policy. It is
// the template a policy author copies: see README.md.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/examples/custompolicy"
	"github.com/kvepp/kvepp/extproc/runner"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		// After the first signal, restore the default handling so a second one ends the process
		// at once instead of waiting for the drain window.
		<-ctx.Done()
		stop()
	}()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "epp-custom:", err)
		os.Exit(1)
	}
}

// run registers the custom policy on the standard catalog and runs the standard EPP.
func run(ctx context.Context, args []string) error {
	reg := catalog.Builtins()
	if err := custompolicy.Register(reg); err != nil {
		return err
	}
	return runner.Run(ctx, reg, args)
}
