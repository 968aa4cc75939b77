// Command epp is kvepp's endpoint picker: an Envoy ext_proc server that routes LLM inference
// requests to the worker holding the most of their KV cache, weighed against load. Configuration
// comes from DYN_* environment variables and flags (epp -h); see README.md.
//
//	epp                    run the EPP (ext_proc, health, selection side port, metrics, discovery)
//	epp select-service     run only the HTTP selection service (--port, default 8092)
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvepp/kvepp/catalog"
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
	if err := runner.Run(ctx, catalog.Builtins(), os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "epp:", err)
		os.Exit(1)
	}
}
