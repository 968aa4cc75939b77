// Command epp is kvepp's endpoint picker: an Envoy ext_proc server that routes LLM inference
// requests to the worker holding the most of their KV cache, weighed against load. Configuration
// comes from DYN_* environment variables and flags (epp -h); see README.md.
//
//	epp                    run the EPP (ext_proc, health, selection side port, metrics, discovery)
//	epp select-service     run only the HTTP selection service (--port, default 8092)
//	epp route              play Envoy for one request against a running EPP and print the decision
package main

import (
	"context"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/runner"
)

func main() {
	runner.Main("epp", func(ctx context.Context, args []string) error {
		return runner.Run(ctx, catalog.Builtins(), args)
	})
}
