package runner

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/runner/selectservice"
)

// RunSelectService runs `epp select-service`: only the HTTP selection service of
// selection-service.md (no ext_proc, no discovery, no tokenizer), served by runner/selectservice.
// The router settings, the policy configuration and the log level come from the environment as
// for the EPP (DYN_ROUTER_*, DYN_LOG; DYN_EPP_SELECTION_HTTP_PORT and DYN_EPP_BIND_ADDRESS give
// the defaults of --port and the bind host); the command-line flags are the standalone service's
// of §19.1 (--port, --threads, --indexer-peers, --selection-cache-*, --session-affinity-ttl-secs,
// --[no-]router-assume-kv-reuse, --router-tracking-hash …). Workers are registered over POST
// /workers. It returns nil after a graceful shutdown when ctx ends (SIGTERM/SIGINT), or the
// startup error naming the setting or flag. -h prints the flags and returns nil.
func RunSelectService(ctx context.Context, registry *catalog.Registry, args []string) error {
	return runSelectService(ctx, registry, os.Environ(), args, os.Stderr, nil, nil)
}

// runSelectService is RunSelectService with its inputs explicit: logger overrides the stderr
// logger and started (optional) is called with the bound address and the core once it serves.
func runSelectService(ctx context.Context, registry *catalog.Registry, environ, args []string, usage io.Writer,
	logger *zerolog.Logger, started func(addr string, svc *picker.Service)) error {
	cfg, err := LoadSelectServiceConfig(environ)
	if err != nil {
		return err
	}
	scfg := selectservice.DefaultConfig()
	scfg.Port = cfg.SelectionHTTPPort
	scfg.BindAddress = cfg.BindAddress
	scfg.IndexerPeers = cfg.IndexerPeers
	scfg.DumpLimits = cfg.dumpLimits()
	if cfg.SessionAffinityTTL.Set {
		scfg.SessionAffinityTTL = time.Duration(cfg.SessionAffinityTTL.Value) * time.Second
	}
	fs := flag.NewFlagSet("epp select-service", flag.ContinueOnError)
	if usage == nil {
		usage = os.Stderr
	}
	fs.SetOutput(usage)
	scfg.RegisterFlags(fs)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return fmt.Errorf("invalid KV router configuration: %w", err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("invalid KV router configuration: unexpected argument %q", fs.Arg(0))
	}
	if err := scfg.Validate(); err != nil {
		return err
	}

	log := newLogger(cfg.LogLevel)
	if logger != nil {
		log = *logger
	}
	if registry == nil {
		registry = catalog.Builtins()
	}
	pcfg, err := pickerConfig(cfg, registry, log)
	if err != nil {
		return err
	}
	pcfg.Logger = log.With().Str("component", "picker").Logger()
	opts := selectservice.Options{Logger: log, Started: started}
	if cfg.UseKVEvents {
		events := kvevents.NewManager(kvevents.ManagerConfig{Logger: log})
		pcfg.EventSource = kvEventSource{m: events}
		opts.Events = events
	}
	if scfg.ReplicaSyncPort != 0 {
		// The PUB socket is bound before the core is built (§16 step 2).
		rcfg := cfg
		rcfg.ReplicaSyncPort, rcfg.ReplicaSyncPeers = OptPort{Set: true, Value: scfg.ReplicaSyncPort}, scfg.ReplicaSyncPeers
		rs, err := bindReplicaSync(rcfg, &pcfg, log)
		if err != nil {
			return fmt.Errorf("invalid KV router configuration: --replica-sync-port: %w", err)
		}
		opts.Replica, opts.ReplicaSync = rs.peers(), selectReplica{rs}
	}
	opts.Picker = pcfg
	return selectservice.Run(ctx, scfg, opts)
}

// selectReplica adapts the runner's replica mesh to selectservice.ReplicaSync.
type selectReplica struct{ r *replicaSync }

// Start implements selectservice.ReplicaSync.
func (s selectReplica) Start(svc *picker.Service) error { return s.r.start(svc) }

// Close implements selectservice.ReplicaSync.
func (s selectReplica) Close() error { return s.r.close() }
