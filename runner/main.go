package runner

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// Main is the main function of an EPP binary (cmd/epp, cmd/epp-custom): it calls run with the
// command-line arguments after the program name and a context cancelled by the first SIGTERM or
// SIGINT, after which the default signal handling is restored so a second signal ends the process
// at once instead of waiting for the drain window (epp.md §9). When run fails, Main prints
// "name: <error>" to standard error and exits with status 1; otherwise it returns.
func Main(name string, run func(ctx context.Context, args []string) error) {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		<-ctx.Done()
		stop()
	}()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		os.Exit(1)
	}
}
