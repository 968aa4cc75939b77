// Package selectservice runs the standalone selection service (`epp select-service`,
// selection-service.md §16, §19.1): it parses the documented command-line flags, builds the
// picker core, recovers the KV index from --indexer-peers, and serves the HTTP API of
// picker/httpapi until its context ends, then shuts down gracefully.
//
// The composition root (runner) owns the environment configuration (DYN_ROUTER_*, the
// policy registry, the KV-event manager) and passes it in as a picker.Config; this package adds
// what the flags control and the service's lifecycle.
package selectservice

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/httpapi"
)

// Defaults of the standalone service's flags (selection-service.md §19.1).
const (
	DefaultPort    = 8092
	DefaultThreads = 4
	// TrackingHashPublic is the only supported --router-tracking-hash (§6.4).
	TrackingHashPublic = "public-xxh3-v1"
	// DefaultShutdownGrace bounds how long in-flight HTTP calls may finish after shutdown begins.
	DefaultShutdownGrace = 5 * time.Second
	// DefaultRecoveryTimeout bounds one peer's GET /dump during startup recovery.
	DefaultRecoveryTimeout = 30 * time.Second
)

// Config is what the select-service flags control (selection-service.md §19.1). Build it with
// DefaultConfig and RegisterFlags, or ParseFlags; check it with Validate.
type Config struct {
	// Port is the HTTP port (--port, default 8092; 0 = an ephemeral port).
	Port int
	// BindAddress is the host to bind ("" = 0.0.0.0, all interfaces).
	BindAddress string
	// Threads is the number of indexer worker threads (--threads, ≥ 1, default 4): KV events are
	// applied by one goroutine per listener, so it bounds the partitions restored in parallel
	// during startup recovery.
	Threads int
	// IndexerPeers are HTTP base URLs whose GET /dump seeds the index at startup, tried in order
	// (--indexer-peers, comma list).
	IndexerPeers []string
	// SelectionCacheTTL is the pending-selection TTL (--selection-cache-ttl-secs, > 0, 120 s).
	SelectionCacheTTL time.Duration
	// SelectionCacheMaxEntries caps pending selections (--selection-cache-max-entries, ≥ 1, 4096).
	SelectionCacheMaxEntries int
	// SelectionCacheMaxBytes caps their summed size in bytes (--selection-cache-max-bytes, ≥ 1,
	// 268,435,456).
	SelectionCacheMaxBytes int64
	// SessionAffinityTTL enables session affinity (--session-affinity-ttl-secs, whole seconds in
	// 1 … 31,536,000); 0 = off.
	SessionAffinityTTL time.Duration
	// AssumeKVReuse overrides DYN_ROUTER_ASSUME_KV_REUSE when non-nil
	// (--router-assume-kv-reuse / --no-router-assume-kv-reuse).
	AssumeKVReuse *bool
	// TrackingHash is --router-tracking-hash; only "public-xxh3-v1" is supported.
	TrackingHash string
	// TrackingKeyFile is --router-tracking-key-file; keyed tracking hashes are rejected.
	TrackingKeyFile string
	// TrackingKeyID is --router-tracking-key-id; keyed tracking hashes are rejected.
	TrackingKeyID string
	// ReplicaSyncPort is --replica-sync-port (1–65535): replica sync binds tcp://*:<port>
	// (§15.1); 0 = replica sync off.
	ReplicaSyncPort int
	// ReplicaSyncPeers are --replica-sync-peers (comma list of ZMQ endpoints); they need the port.
	ReplicaSyncPeers []string
	// DumpLimits bound what recovery accepts from one peer's /dump (zero fields: the picker
	// defaults; `epp select-service` sets them from DYN_EPP_RECOVERY_MAX_BYTES and
	// DYN_EPP_RECOVERY_MAX_EVENTS).
	DumpLimits picker.DumpLimits
	// replicaPortGiven records that --replica-sync-port was given (0 given is an error).
	replicaPortGiven bool

	// invalid records a flag value that could not be parsed, reported by Validate.
	invalid []string
}

// DefaultConfig returns the §19.1 defaults: port 8092, 4 threads, a 120 s / 4096 entries /
// 256 MiB selection cache, session affinity off, KV reuse from the environment.
func DefaultConfig() Config {
	return Config{
		Port:                     DefaultPort,
		Threads:                  DefaultThreads,
		SelectionCacheTTL:        ledger.DefaultPendingTTL,
		SelectionCacheMaxEntries: ledger.DefaultPendingMaxEntries,
		SelectionCacheMaxBytes:   ledger.DefaultPendingMaxBytes,
		TrackingHash:             TrackingHashPublic,
	}
}

// RegisterFlags binds the documented flags to c on fs (values already in c are the defaults):
// --port, --threads, --indexer-peers, --selection-cache-ttl-secs,
// --selection-cache-max-entries, --selection-cache-max-bytes, --session-affinity-ttl-secs,
// --router-assume-kv-reuse, --no-router-assume-kv-reuse, --router-tracking-hash,
// --router-tracking-key-file, --router-tracking-key-id. Parse errors of individual values are
// reported by Validate, naming the flag.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.IntVar(&c.Port, "port", c.Port, "HTTP port of the selection API")
	fs.IntVar(&c.Threads, "threads", c.Threads, "indexer worker threads (>= 1)")
	fs.Func("indexer-peers", "comma list of HTTP base URLs whose GET /dump seeds the index at startup", commaList(&c.IndexerPeers))
	fs.Func("selection-cache-ttl-secs", "pending-selection TTL in seconds (> 0, default 120)", func(s string) error {
		v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
		if err != nil || !(v > 0) || math.IsInf(v, 0) || v*float64(time.Second) > math.MaxInt64 {
			c.invalid = append(c.invalid, fmt.Sprintf("--selection-cache-ttl-secs must be a number > 0, got %q", s))
			return nil
		}
		c.SelectionCacheTTL = time.Duration(v * float64(time.Second))
		return nil
	})
	fs.Func("selection-cache-max-entries", "pending selections kept at most (>= 1, default 4096)", func(s string) error {
		v, err := strconv.ParseInt(strings.TrimSpace(s), 10, 0)
		if err != nil || v < 1 {
			c.invalid = append(c.invalid, fmt.Sprintf("--selection-cache-max-entries must be an integer >= 1, got %q", s))
			return nil
		}
		c.SelectionCacheMaxEntries = int(v)
		return nil
	})
	fs.Func("selection-cache-max-bytes", "pending-selection byte budget (>= 1, default 268435456)", func(s string) error {
		v, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil || v < 1 {
			c.invalid = append(c.invalid, fmt.Sprintf("--selection-cache-max-bytes must be an integer >= 1, got %q", s))
			return nil
		}
		c.SelectionCacheMaxBytes = v
		return nil
	})
	fs.Func("session-affinity-ttl-secs", "session affinity TTL in seconds, 1..31536000 (unset = off)", func(s string) error {
		v, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil || v < 1 || time.Duration(v)*time.Second > ledger.MaxAffinityTTL {
			c.invalid = append(c.invalid, fmt.Sprintf("--session-affinity-ttl-secs must be an integer between 1 and 31536000, got %q", s))
			return nil
		}
		c.SessionAffinityTTL = time.Duration(v) * time.Second
		return nil
	})
	fs.BoolFunc("router-assume-kv-reuse", "assume KV reuse of shared prefixes (overrides DYN_ROUTER_ASSUME_KV_REUSE)", func(s string) error {
		v, err := strconv.ParseBool(s)
		if err != nil {
			c.invalid = append(c.invalid, fmt.Sprintf("--router-assume-kv-reuse must be a boolean, got %q", s))
			return nil
		}
		c.AssumeKVReuse = &v
		return nil
	})
	fs.BoolFunc("no-router-assume-kv-reuse", "do not assume KV reuse: random tracking hashes per block", func(s string) error {
		v, err := strconv.ParseBool(s)
		if err != nil {
			c.invalid = append(c.invalid, fmt.Sprintf("--no-router-assume-kv-reuse must be a boolean, got %q", s))
			return nil
		}
		v = !v
		c.AssumeKVReuse = &v
		return nil
	})
	fs.Func("replica-sync-port", "replica-sync ZeroMQ PUB port, 1..65535 (unset = replica sync off)", func(s string) error {
		v, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			c.invalid = append(c.invalid, fmt.Sprintf("--replica-sync-port must be an integer in 1..65535, got %q", s))
			return nil
		}
		c.ReplicaSyncPort, c.replicaPortGiven = v, true
		return nil
	})
	fs.Func("replica-sync-peers", "comma list of peer replica-sync endpoints (tcp://host:port); needs --replica-sync-port", commaList(&c.ReplicaSyncPeers))
	fs.StringVar(&c.TrackingHash, "router-tracking-hash", c.TrackingHash, "tracking hash (only public-xxh3-v1)")
	fs.StringVar(&c.TrackingKeyFile, "router-tracking-key-file", c.TrackingKeyFile, "keyed tracking hash key file (not supported)")
	fs.StringVar(&c.TrackingKeyID, "router-tracking-key-id", c.TrackingKeyID, "keyed tracking hash key id (not supported)")
}

// commaList returns a flag setter that replaces *dst with the non-empty, trimmed entries of a
// comma list.
func commaList(dst *[]string) func(string) error {
	return func(s string) error {
		*dst = nil
		for _, p := range strings.Split(s, ",") {
			if p = strings.TrimSpace(p); p != "" {
				*dst = append(*dst, p)
			}
		}
		return nil
	}
}

// ParseFlags parses args (without the program and subcommand names) into a validated Config.
// -h / --help prints usage to usage (nil = io.Discard) and returns flag.ErrHelp. Errors start
// with "invalid KV router configuration: " and name the flag (selection-service.md §16 step 1).
func ParseFlags(args []string, usage io.Writer) (Config, error) {
	if usage == nil {
		usage = io.Discard
	}
	c := DefaultConfig()
	fs := flag.NewFlagSet("epp select-service", flag.ContinueOnError)
	fs.SetOutput(usage)
	c.RegisterFlags(fs)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c, err
		}
		return c, fmt.Errorf("invalid KV router configuration: %w", err)
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("invalid KV router configuration: unexpected argument %q", fs.Arg(0))
	}
	return c, c.Validate()
}

// Validate checks every field (selection-service.md §19.1) and returns the first violation as
// "invalid KV router configuration: <flag> …".
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("invalid KV router configuration: "+format, args...)
	}
	if len(c.invalid) > 0 {
		return bad("%s", c.invalid[0])
	}
	switch {
	case c.Port < 0 || c.Port > 65535:
		return bad("--port must be a port in 0..65535, got %d", c.Port)
	case c.Threads < 1:
		return bad("--threads must be >= 1, got %d", c.Threads)
	case c.SelectionCacheTTL <= 0:
		return bad("--selection-cache-ttl-secs must be > 0, got %v", c.SelectionCacheTTL.Seconds())
	case c.SelectionCacheMaxEntries < 1:
		return bad("--selection-cache-max-entries must be >= 1, got %d", c.SelectionCacheMaxEntries)
	case c.SelectionCacheMaxBytes < 1:
		return bad("--selection-cache-max-bytes must be >= 1, got %d", c.SelectionCacheMaxBytes)
	case c.SessionAffinityTTL != 0 && (c.SessionAffinityTTL < time.Second || c.SessionAffinityTTL > ledger.MaxAffinityTTL):
		return bad("--session-affinity-ttl-secs must be between 1 and 31536000, got %v", c.SessionAffinityTTL.Seconds())
	case c.TrackingHash == "keyed-xxh3-v1":
		return bad("tracking hash keyed-xxh3-v1 is not supported")
	case c.TrackingHash != TrackingHashPublic:
		return bad("--router-tracking-hash must be %s, got %q", TrackingHashPublic, c.TrackingHash)
	case c.TrackingKeyFile != "" || c.TrackingKeyID != "":
		return bad("--router-tracking-key-file and --router-tracking-key-id are not supported (only public-xxh3-v1 tracking hashes are supported, selection-service.md §6.4)")
	}
	for _, p := range c.IndexerPeers {
		if !strings.HasPrefix(p, "http://") && !strings.HasPrefix(p, "https://") {
			return bad("--indexer-peers: peer %q must be an http(s) base URL", p)
		}
	}
	return c.validateReplica(bad)
}

// validateReplica checks the replica-sync flags (§15.1): port in 1..65535 when given (0 is an
// error), peers valid endpoints (§15.5) and only with a port.
func (c Config) validateReplica(bad func(string, ...any) error) error {
	if (c.replicaPortGiven || c.ReplicaSyncPort != 0) && (c.ReplicaSyncPort < 1 || c.ReplicaSyncPort > 65535) {
		return bad("--replica-sync-port must be in 1..65535, got %d", c.ReplicaSyncPort)
	}
	if len(c.ReplicaSyncPeers) > 0 && c.ReplicaSyncPort == 0 {
		return bad("--replica-sync-peers requires --replica-sync-port")
	}
	for _, p := range c.ReplicaSyncPeers {
		if err := httpapi.ValidateReplicaEndpoint(p); err != nil {
			return bad("--replica-sync-peers: %v", err)
		}
	}
	return nil
}

// ApplyTo sets the flag-controlled parts of a picker configuration: the selection cache bounds,
// the session-affinity TTL and, when given, assume_kv_reuse. Everything else the composition root
// put in pc (the other router settings such as the queue policy, overlap refresh and approximate
// cache policy, the policy-class profiles, the policy factory) is left as it is.
func (c Config) ApplyTo(pc *picker.Config) {
	pc.SelectionCache = ledger.PendingConfig{TTL: c.SelectionCacheTTL, MaxEntries: c.SelectionCacheMaxEntries, MaxBytes: c.SelectionCacheMaxBytes}
	pc.SessionAffinityTTL = c.SessionAffinityTTL
	if c.AssumeKVReuse != nil {
		pc.Router.AssumeKVReuse = *c.AssumeKVReuse
	}
}

// EventGate is the KV-event ingestion as the service lifecycle drives it; *kvevents.Manager
// satisfies it. Live events are held during recovery (§16 step 4) and the listeners are closed on
// shutdown.
type EventGate interface {
	// HoldEvents buffers live KV events until ReleaseEvents.
	HoldEvents()
	// ReleaseEvents applies the buffered events; bootstrapped reports a restored index.
	ReleaseEvents(bootstrapped bool)
	// Close stops every KV-event listener.
	Close() error
}

// Options are the parts of Run the composition root provides.
type Options struct {
	// Picker is the core configuration from the environment (router settings, policy factory,
	// KV event source). Run applies the Config on top of it.
	Picker picker.Config
	// Events, when non-nil, is held during recovery and closed on shutdown.
	Events EventGate
	// Logger receives lifecycle logs.
	Logger zerolog.Logger
	// Listener, when non-nil, is served instead of binding BindAddress:Port (Run closes it).
	Listener net.Listener
	// HTTPClient fetches peers' /dump (nil = a client with DefaultRecoveryTimeout).
	HTTPClient *http.Client
	// ShutdownGrace bounds in-flight HTTP calls after shutdown begins (0 = DefaultShutdownGrace).
	ShutdownGrace time.Duration
	// Replica manages replica-sync peers for /replica_sync/* (nil = replica sync disabled).
	Replica httpapi.ReplicaPeers
	// ReplicaSync, when non-nil, is started on the core after recovery (§16 step 5) and closed on
	// shutdown; its PUB socket is bound by the caller before Run (§16 step 2).
	ReplicaSync ReplicaSync
	// Started, when non-nil, is called once the service serves, with its bound address and core.
	Started func(addr string, svc *picker.Service)
}

// ReplicaSync is the replica mesh as the service lifecycle drives it.
type ReplicaSync interface {
	// Start connects to the peers and applies their events to svc.
	Start(svc *picker.Service) error
	// Close stops the replica sockets.
	Close() error
}

// Run runs the standalone selection service until ctx ends (selection-service.md §16): validate
// cfg, build the core, recover the index from the first --indexer-peers peer that answers (live
// events held meanwhile; failures are logged and the service starts empty), then serve the HTTP
// API and the core's maintenance loop. When ctx ends, new work gets 503, KV listeners stop,
// in-flight calls get ShutdownGrace to finish and every socket is released. It returns nil after
// a clean shutdown, or the startup or serving error.
func Run(ctx context.Context, cfg Config, opts Options) (err error) {
	if err := cfg.Validate(); err != nil {
		return err
	}
	log := opts.Logger
	if opts.ReplicaSync != nil {
		defer func() { // every exit releases the replica sockets (§16)
			if cerr := opts.ReplicaSync.Close(); cerr != nil {
				log.Warn().Err(cerr).Msg("closing replica sync")
			}
		}()
	}
	pc := opts.Picker
	cfg.ApplyTo(&pc)
	eventsClosed := false
	closeEvents := func() {
		if opts.Events != nil && !eventsClosed {
			eventsClosed = true
			if cerr := opts.Events.Close(); cerr != nil {
				log.Warn().Err(cerr).Msg("closing KV event listeners")
			}
		}
	}
	defer closeEvents()
	svc, err := picker.New(pc)
	if err != nil {
		return err
	}
	ln := opts.Listener
	if ln == nil {
		if ln, err = net.Listen("tcp", net.JoinHostPort(cfg.BindAddress, strconv.Itoa(cfg.Port))); err != nil {
			return fmt.Errorf("select-service: listen on port %d (--port): %w", cfg.Port, err)
		}
	}
	if len(cfg.IndexerPeers) > 0 {
		if opts.Events != nil {
			opts.Events.HoldEvents()
		}
		recovered := Recover(ctx, svc, cfg.IndexerPeers, cfg.Threads, cfg.DumpLimits, opts.HTTPClient, log)
		if opts.Events != nil {
			opts.Events.ReleaseEvents(recovered)
		}
	}
	if opts.ReplicaSync != nil {
		if err := opts.ReplicaSync.Start(svc); err != nil {
			return fmt.Errorf("select-service: replica sync: %w", err)
		}
	}
	runCtx, stopRun := context.WithCancel(context.Background())
	runDone := make(chan struct{})
	go func() {
		defer close(runDone)
		_ = svc.Run(runCtx)
	}()
	defer func() {
		stopRun()
		<-runDone
	}()
	srv := &http.Server{
		Handler:           httpapi.LimitHeaders(httpapi.New(svc, httpapi.Options{Logger: log, Replica: opts.Replica})),
		MaxHeaderBytes:    httpapi.HeaderReadLimit,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,  // a whole request, body included: a stalled upload is dropped
		IdleTimeout:       120 * time.Second, // keep-alive connections waiting for their next request
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	log.Info().Str("addr", ln.Addr().String()).Msg("selection service serving")
	if opts.Started != nil {
		opts.Started(ln.Addr().String(), svc)
	}
	select {
	case <-ctx.Done():
	case err := <-serveErr:
		return fmt.Errorf("select-service: HTTP server stopped: %w", err)
	}
	svc.BeginShutdown()
	closeEvents()
	grace := opts.ShutdownGrace
	if grace <= 0 {
		grace = DefaultShutdownGrace
	}
	sctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	if err := <-serveErr; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("select-service: HTTP server stopped: %w", err)
	}
	log.Info().Msg("selection service stopped")
	return nil
}

// Recover seeds svc's partitions from the first peer whose GET <peer>/dump answers 200 with a
// valid snapshot within lim (selection-service.md §16 step 4; RecoverFrom), peers tried in order,
// up to threads partitions restored at a time. Failures are logged; it reports whether a snapshot
// was applied. client nil = a client with DefaultRecoveryTimeout.
func Recover(ctx context.Context, svc *picker.Service, peers []string, threads int, lim picker.DumpLimits, client *http.Client, log zerolog.Logger) bool {
	if client == nil {
		client = &http.Client{Timeout: DefaultRecoveryTimeout}
	}
	for _, peer := range peers {
		if err := RecoverFrom(ctx, svc, client, peer, lim, threads, log); err != nil {
			log.Warn().Err(err).Str("peer", excerpt.Of(peer)).Msg("index recovery from peer failed")
			continue
		}
		return true
	}
	if len(peers) > 0 {
		log.Warn().Int("peers", len(peers)).Msg("no indexer peer answered; starting with an empty index")
	}
	return false
}

// maxLoggedPartitions bounds the log lines about skipped or incomplete partitions of one dump.
const maxLoggedPartitions = 10

// RecoverFrom fetches one peer's /dump (FetchDump, within lim) and restores it into svc, threads
// partitions at a time (picker.Service.RestoreDump). Entries the dump holds that are bad on their
// own (an invalid key or block_size, an event that does not decode) and partitions whose restore
// was refused or incomplete are logged, at most maxLoggedPartitions lines of each, with the
// summary. The error is FetchDump's (nothing is restored then): an unreachable peer, a non-200
// answer, malformed JSON, or a dump over lim (picker.ErrDumpTooLarge).
func RecoverFrom(ctx context.Context, svc *picker.Service, client *http.Client, peer string, lim picker.DumpLimits, threads int, log zerolog.Logger) error {
	d, err := FetchDump(ctx, client, peer, lim)
	if err != nil {
		return err
	}
	peer = excerpt.Of(peer)
	for i, sk := range d.Skipped {
		if i == maxLoggedPartitions {
			log.Warn().Str("peer", peer).Int("more", len(d.Skipped)-i).Msg("index recovery: more dump entries skipped")
			break
		}
		log.Warn().Str("peer", peer).Str("partition", sk.Key).Str("reason", sk.Reason).Msg("index recovery: dump entry skipped")
	}
	fails := svc.RestoreDump(d, threads)
	for i, f := range fails {
		if i == maxLoggedPartitions {
			log.Warn().Str("peer", peer).Int("more", len(fails)-i).Msg("index recovery: more partitions incomplete")
			break
		}
		log.Warn().Err(f.Err).Str("peer", peer).Str("partition", excerpt.Of(f.Key.String())).Msg("index recovery: partition restore incomplete")
	}
	log.Info().Str("peer", peer).Int("partitions", len(d.Partitions)).Int("events", d.Events).
		Int("skipped", len(d.Skipped)).Int("incomplete", len(fails)).Msg("index recovered from peer /dump")
	return nil
}

// FetchDump GETs <peer>/dump and decodes it as it arrives (picker.DecodeDump: at most
// lim.MaxBytes bytes and lim.MaxEvents events). Errors name the peer (at most 100 bytes of it):
// the request failing, a status other than 200 (with at most 200 bytes of the body, control
// characters dropped), or DecodeDump's error.
func FetchDump(ctx context.Context, client *http.Client, peer string, lim picker.DumpLimits) (*picker.RecoveredDump, error) {
	base := strings.TrimRight(peer, "/")
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/dump", nil)
	if err != nil {
		return nil, fmt.Errorf("peer %q: %w", excerpt.Of(peer), err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("GET %s/dump: %w", excerpt.Of(base), err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return nil, fmt.Errorf("GET %s/dump: status %d: %s", excerpt.Of(base), resp.StatusCode, excerpt.Clean(string(body), 200))
	}
	d, err := picker.DecodeDump(resp.Body, lim)
	if err != nil {
		return nil, fmt.Errorf("GET %s/dump: %w", excerpt.Of(base), err)
	}
	return d, nil
}
