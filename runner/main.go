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
// SIGINT. A second SIGTERM or SIGINT ends the process at once with status 128 + the signal's
// number (130 for SIGINT) instead of waiting for the drain window (epp.md §9). Both signals stay
// subscribed until exit, so this holds even when the process inherited SIGINT as ignored (a
// background job of a non-interactive shell), where restoring the default disposition would
// restore "ignored". The second signal is logged as a JSON warning on standard error. When run
// fails, Main prints "name: <error>" to standard error and exits with status 1; otherwise it
// returns.
func Main(name string, run func(ctx context.Context, args []string) error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sigs)
	go func() {
		first := <-sigs
		cancel()
		second := <-sigs
		// A JSON line like every other log line (the configured level is not known here; a
		// warning passes every level but error).
		log := newLogger("info")
		log.Warn().Str("command", name).Str("signal", second.String()).Str("first_signal", first.String()).
			Msg("second signal: exiting now, without waiting for the drain")
		code := 1
		if s, ok := second.(syscall.Signal); ok {
			code = 128 + int(s)
		}
		os.Exit(code)
	}()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		os.Exit(1)
	}
}
