// Package runner is kvepp's composition root: it reads the configuration (environment through
// caarlos0/env plus flags), builds the selection core, the KV-event manager, the tokenizers, the
// ext_proc server, the health, selection and metrics servers and discovery (a workers file or a
// Kubernetes InferencePool), starts them in the order of epp.md §11.1 and shuts them down
// gracefully (epp.md §9).
//
// cmd/epp is runner.Run(ctx, catalog.Builtins(), os.Args[1:]); a custom binary that links its own
// worker-selection policies registers them on a catalog.Registry and calls Run the same way. Tests
// use Start with a Config to run the real process on loopback (ports 0 are allowed; Instance.Addrs
// reports the bound addresses).
package runner

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"k8s.io/client-go/rest"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/tokenizer"
	"github.com/kvepp/kvepp/internal/zmqtcp"
	"github.com/kvepp/kvepp/kvindex/kvevents"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/discovery"
	"github.com/kvepp/kvepp/picker/httpapi"
)

// init draws every UUIDv4 of the process — two per exchange: the generated x-request-id and the
// selection id of the booking — from google/uuid's pool of crypto/rand bytes, refilled every 16
// ids, instead of a getrandom system call (and an allocation) each. The ids are as random; they
// identify requests and reservations and protect nothing, so the pool's bytes on the heap are no
// concern. EnableRandPool must run before any id is made, hence init of the composition root.
func init() { uuid.EnableRandPool() }

// SelectServiceCommand is the subcommand that runs only the HTTP selection service.
const SelectServiceCommand = "select-service"

// shutdownGrace bounds each server's graceful stop after the drain window.
const shutdownGrace = 2 * time.Second

// Run is the whole EPP process: it loads the configuration from the environment and args, starts
// every component (Start), waits until ctx is cancelled (SIGTERM/SIGINT in cmd/epp) or a server
// fails, and then shuts down gracefully (Instance.Stop). args[0] == "select-service" runs only the
// HTTP selection service instead (RunSelectService), args[0] == "route" plays Envoy for one
// request against a running EPP (RunRoute). -h prints the commands and flags and returns nil.
// registry holds the worker-selection policy providers; nil means catalog.Builtins().
func Run(ctx context.Context, registry *catalog.Registry, args []string) error {
	if len(args) > 0 && args[0] == SelectServiceCommand {
		return RunSelectService(ctx, registry, args[1:])
	}
	if len(args) > 0 && args[0] == RouteCommand {
		return RunRoute(ctx, args[1:], os.Stdout, os.Stderr)
	}
	cfg, err := LoadConfig(os.Environ(), args, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	inst, err := Start(ctx, Options{Config: cfg, Registry: registry})
	if err != nil {
		if ctx.Err() != nil {
			return nil // stopped by a signal while starting
		}
		return err
	}
	select {
	case <-ctx.Done():
	case <-inst.Failed():
	}
	stopErr := inst.Stop(context.Background())
	if err := inst.Err(); err != nil {
		return err
	}
	return stopErr
}

// Options configures Start.
type Options struct {
	// Config is the process configuration; Start validates it.
	Config Config
	// Registry holds the worker-selection policy providers; nil means catalog.Builtins().
	Registry *catalog.Registry
	// Logger overrides the JSON logger on stderr built from Config.LogLevel.
	Logger *zerolog.Logger
	// WorkersFileDebounce overrides the workers-file event debounce (tests; default 200 ms).
	WorkersFileDebounce time.Duration
	// HTTPTimeouts bounds the connections of the selection side port and the metrics port; zero
	// fields take DefaultHTTPTimeouts' values.
	HTTPTimeouts HTTPTimeouts
	// KubeRestConfig reaches the Kubernetes API server for InferencePool and peer-EPP discovery
	// (tests: an envtest control plane); nil = in-cluster service account, KUBECONFIG or
	// ~/.kube/config.
	KubeRestConfig *rest.Config
}

// HTTPTimeouts bounds the connections of every HTTP server the runner starts (the selection side
// port and the metrics port) so a slow or stalled client cannot hold a connection and its
// goroutine: a request whose headers, or whole body, do not arrive in time is dropped, as is a
// keep-alive connection idle for too long. Handler time after the body is read (a queued POST
// /select) and response writing are not bounded.
type HTTPTimeouts struct {
	// ReadHeader bounds reading one request's headers (http.Server.ReadHeaderTimeout).
	ReadHeader time.Duration
	// Read bounds reading one whole request, headers and body (http.Server.ReadTimeout).
	Read time.Duration
	// Idle bounds the wait for the next request on a keep-alive connection (http.Server.IdleTimeout).
	Idle time.Duration
}

// DefaultHTTPTimeouts returns the HTTP server bounds used where Options.HTTPTimeouts leaves a
// field zero: 10 s for the headers, 30 s for the whole request, 120 s idle.
func DefaultHTTPTimeouts() HTTPTimeouts {
	return HTTPTimeouts{ReadHeader: 10 * time.Second, Read: 30 * time.Second, Idle: 120 * time.Second}
}

// withDefaults fills zero (or negative) fields from DefaultHTTPTimeouts.
func (t HTTPTimeouts) withDefaults() HTTPTimeouts {
	d := DefaultHTTPTimeouts()
	if t.ReadHeader <= 0 {
		t.ReadHeader = d.ReadHeader
	}
	if t.Read <= 0 {
		t.Read = d.Read
	}
	if t.Idle <= 0 {
		t.Idle = d.Idle
	}
	return t
}

// Addrs are the bound listener addresses ("host:port") of a running Instance.
type Addrs struct {
	// GRPC is the ext_proc port (also serving grpc.health.v1).
	GRPC string
	// Health is the plaintext gRPC health port.
	Health string
	// Selection is the selection HTTP API port.
	Selection string
	// Metrics is the Prometheus port.
	Metrics string
	// ReplicaSync is the replica-sync PUB socket ("" when replica sync is off).
	ReplicaSync string
}

// Instance is a running EPP. Stop it with Stop (graceful) exactly once; Failed reports a server
// that stopped on its own.
type Instance struct {
	cfg   Config
	log   zerolog.Logger
	addrs Addrs

	// Service is the embedded selection core (exposed for tests and custom binaries).
	Service *picker.Service
	// Health is the gRPC health service (epp.md §9).
	Health *extproc.Health
	// ExtProc is the ext_proc server.
	ExtProc *extproc.Server
	// Metrics is the Prometheus registry served on the metrics port.
	Metrics *prometheus.Registry

	events     *kvevents.Manager
	discovery  *discovery.FileSource
	replica    *replicaSync
	grpcServer *grpc.Server
	healthSrv  *grpc.Server
	httpSrv    *http.Server
	metricsSrv *http.Server
	runCancel  context.CancelFunc
	runDone    chan struct{}

	// recoveryPeers are the selection base URLs startup recovery tries (DYN_EPP_INDEXER_PEERS and
	// the peer EPPs discovered from DYN_EPP_PEER_SERVICE).
	recoveryPeers []string
	// kube and kubeDone are the Kubernetes cache shared by InferencePool and peer discovery (nil
	// without DYN_EPP_INFERENCE_POOL_NAME and DYN_EPP_PEER_SERVICE); pool is InferencePool
	// discovery (nil without a pool); poolServing turns true when startup finished, after which
	// readiness follows the pool.
	kube        *discovery.Kube
	pool        *discovery.PoolSource
	kubeDone    chan struct{}
	poolServing atomic.Bool

	failOnce sync.Once
	failed   chan struct{}
	failErr  error

	stopOnce sync.Once
	stopErr  error
}

// Addrs returns the bound listener addresses.
func (i *Instance) Addrs() Addrs { return i.addrs }

// Failed is closed when a server stopped unexpectedly; Err then returns why.
func (i *Instance) Failed() <-chan struct{} { return i.failed }

// Err returns the error of a server that stopped unexpectedly, or nil.
func (i *Instance) Err() error {
	select {
	case <-i.failed:
		return i.failErr
	default:
		return nil
	}
}

func (i *Instance) fail(err error) {
	i.failOnce.Do(func() {
		i.failErr = err
		close(i.failed)
	})
}

// newLogger builds the zerolog JSON logger on stderr at level.
func newLogger(level string) zerolog.Logger {
	lvl, err := zerolog.ParseLevel(strings.ToLower(level))
	if err != nil {
		lvl = zerolog.InfoLevel
	}
	return zerolog.New(os.Stderr).Level(lvl).With().Timestamp().Str("service", "kvepp").Logger()
}

// listen binds host:port on TCP.
func listen(host string, port int, setting string) (net.Listener, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return nil, fmt.Errorf("listen on %s %d: %w", setting, port, err)
	}
	return ln, nil
}

// Start validates cfg and starts the EPP in the order of epp.md §11.1: the policy configuration is
// resolved first and the tokenizers start loading in the background (errors stop startup); then the
// metrics server and the health server (readiness NOT_SERVING); the selection core with the
// KV-event manager; the selection side port; discovery (the workers file's initial snapshot is
// applied before continuing); once the tokenizers are loaded, the ext_proc gRPC server (TLS or h2c,
// health service also registered on it, max receive size = body cap + 1 MiB); finally readiness
// SERVING. With DYN_EPP_INFERENCE_POOL_NAME, Start returns with readiness NOT_SERVING: the pool's
// pods register in the background and readiness turns on once they are (and the index is
// recovered), then follows the pool (kubernetes.go). On any error everything already started is
// stopped and the error is returned. The returned Instance runs until Stop; ctx only bounds
// startup.
func Start(ctx context.Context, opts Options) (*Instance, error) {
	cfg := opts.Config
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := newLogger(cfg.LogLevel)
	if opts.Logger != nil {
		log = *opts.Logger
	}
	registry := opts.Registry
	if registry == nil {
		registry = catalog.Builtins()
	}
	if cfg.BlockSize == 1 {
		log.Warn().Msg("DYN_KV_CACHE_BLOCK_SIZE=1: every token is a block; index memory tracks only engine-reported blocks")
	}

	inst := &Instance{cfg: cfg, log: log, failed: make(chan struct{}), runDone: make(chan struct{})}
	var cleanups []func()
	started := false
	defer func() {
		if !started {
			for i := len(cleanups) - 1; i >= 0; i-- {
				cleanups[i]()
			}
		}
	}()

	// 1. Policy configuration and router settings.
	pcfg, err := pickerConfig(cfg, registry, log)
	if err != nil {
		return nil, err
	}
	// Tokenizers: loaded once per model and shared by every stream. Loading takes seconds, so it
	// runs while the other components start; ext_proc waits for it.
	type tokResult struct {
		set *tokenizerSet
		err error
	}
	tokDone := make(chan tokResult, 1)
	go func() {
		set, err := loadTokenizers(cfg, log)
		tokDone <- tokResult{set, err}
	}()

	// 2. Metrics and health servers (NOT_SERVING).
	inst.Metrics = prometheus.NewRegistry()
	inst.Metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	inst.Metrics.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvepp_zmq_oversized_frames_total",
		Help: "ZeroMQ connections (KV events, replica sync) closed because the peer declared a frame or message above its bound (16 MiB; 4 KiB from a replica-sync subscriber) or a message of more than 64 parts."},
		func() float64 { return float64(zmqtcp.OversizedFrames()) }))
	inst.Metrics.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvepp_tokenizer_inexact_pieces_total",
		Help: "Text the local tokenizer estimated instead of encoding — a pre-tokenized piece (a word, a run of spaces or punctuation) longer than 16 KiB, or a prompt's text after 1,048,576 added-token segments: the request was routed with the ids from there on booked as uncached, or refused where exact ids are required (/tokenize)."},
		func() float64 { return float64(tokenizer.InexactPieces()) }))
	registerBudgetMetrics(inst.Metrics)
	metricsLn, err := listen(cfg.BindAddress, cfg.MetricsPort, cfg.name("DYN_EPP_METRICS_PORT"))
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(inst.Metrics, promhttp.HandlerOpts{Registry: inst.Metrics}))
	timeouts := opts.HTTPTimeouts.withDefaults()
	inst.metricsSrv = &http.Server{Handler: mux, ReadHeaderTimeout: timeouts.ReadHeader, ReadTimeout: timeouts.Read, IdleTimeout: timeouts.Idle}
	inst.addrs.Metrics = metricsLn.Addr().String()
	go inst.serveHTTP(inst.metricsSrv, metricsLn, "metrics")
	cleanups = append(cleanups, func() { _ = inst.metricsSrv.Close() })

	inst.Health = extproc.NewHealth()
	healthLn, err := listen(cfg.BindAddress, cfg.GRPCHealthPort, cfg.name("DYN_EPP_GRPC_HEALTH_PORT"))
	if err != nil {
		return nil, err
	}
	inst.healthSrv = grpc.NewServer()
	inst.Health.Register(inst.healthSrv)
	inst.addrs.Health = healthLn.Addr().String()
	go inst.serveGRPC(inst.healthSrv, healthLn, "health")
	cleanups = append(cleanups, inst.healthSrv.Stop)

	// The ext_proc port is bound now, so a port conflict stops startup before the slow steps; it is
	// served in step 6.
	grpcLn, err := listen(cfg.BindAddress, cfg.GRPCPort, cfg.name("DYN_EPP_GRPC_PORT"))
	if err != nil {
		return nil, err
	}
	grpcServing := false
	cleanups = append(cleanups, func() {
		if !grpcServing {
			_ = grpcLn.Close()
		}
	})

	// Selection core with the KV-event source.
	if cfg.UseKVEvents {
		inst.events = kvevents.NewManager(kvevents.ManagerConfig{Logger: log})
		pcfg.EventSource = kvEventSource{m: inst.events}
		cleanups = append(cleanups, func() { _ = inst.events.Close() })
	}
	// Replica sync: the PUB socket is bound before the core is built (epp.md §11.1 step 2).
	if inst.replica, err = bindReplicaSync(cfg, &pcfg, log); err != nil {
		return nil, err
	}
	inst.addrs.ReplicaSync = inst.replica.addr()
	cleanups = append(cleanups, func() { _ = inst.replica.close() })
	pcfg.Logger = log.With().Str("component", "picker").Logger()
	inst.Service, err = picker.New(pcfg)
	if err != nil {
		return nil, err
	}
	runCtx, runCancel := context.WithCancel(context.Background())
	inst.runCancel = runCancel
	go func() {
		defer close(inst.runDone)
		_ = inst.Service.Run(runCtx)
	}()
	cleanups = append(cleanups, func() { runCancel(); <-inst.runDone })

	// Selection side port.
	selLn, err := listen(cfg.BindAddress, cfg.SelectionHTTPPort, cfg.name("DYN_EPP_SELECTION_HTTP_PORT"))
	if err != nil {
		return nil, err
	}
	// POST /tokenize and /detokenize (vLLM's shape) sit in front of the selection API; they answer
	// 503 until the tokenizers are loaded.
	tokAPI := newTokenizeAPI(httpapi.New(inst.Service, httpapi.Options{
		Logger: log.With().Str("component", "httpapi").Logger(),
		// During the SIGTERM drain the side port answers as shut down (selection-service.md
		// §2) while ext_proc keeps routing through the core (epp.md §9).
		Draining: inst.Health.Draining,
		// /ready agrees with gRPC readiness: NOT_SERVING until startup (index recovery,
		// tokenizers, an InferencePool's first sync) is done, and while the pool is gone.
		Ready:   inst.Health.Ready,
		Replica: inst.replica.peers(),
	}), cfg, inst.Service)
	inst.httpSrv = &http.Server{
		// Oversized headers get the API's JSON 431 (httpapi.LimitHeaders), not net/http's text.
		Handler:           httpapi.LimitHeaders(tokAPI),
		MaxHeaderBytes:    httpapi.HeaderReadLimit,
		ReadHeaderTimeout: timeouts.ReadHeader,
		ReadTimeout:       timeouts.Read,
		IdleTimeout:       timeouts.Idle,
	}
	inst.addrs.Selection = selLn.Addr().String()
	go inst.serveHTTP(inst.httpSrv, selLn, "selection")
	cleanups = append(cleanups, func() { _ = inst.httpSrv.Close() })

	// The process's one Kubernetes cache (with a pool or a peer Service), then the peer EPPs
	// discovered from the peer Service's EndpointSlices join the recovery peers.
	if err := inst.startKube(runCtx, cfg, opts.KubeRestConfig, log); err != nil {
		return nil, err
	}
	if inst.kubeDone != nil {
		cleanups = append(cleanups, func() { runCancel(); <-inst.kubeDone })
	}
	discovered, err := inst.replica.discoverPeers(ctx, runCtx, cfg, inst.kube, log)
	if err != nil {
		return nil, err
	}
	recoveryPeers := append(slices.Clone(cfg.IndexerPeers), discovered...)

	// KV listeners buffer their events while the index is recovered from a peer (§11.1 step 3).
	if len(recoveryPeers) > 0 && inst.events != nil {
		inst.events.HoldEvents()
	}

	// 3. Discovery: the workers file's first snapshot is registered before ext_proc starts.
	if cfg.WorkersFile != "" {
		inst.discovery, err = discovery.NewFileSource(discovery.FileConfig{
			Path:     cfg.WorkersFile,
			Defaults: workerDefaults(cfg),
			Debounce: opts.WorkersFileDebounce,
			Logger:   log,
		}, inst.Service)
		if err != nil {
			return nil, fmt.Errorf("invalid %s %q: %w", cfg.name("DYN_EPP_WORKERS_FILE"), cfg.WorkersFile, err)
		}
		// The source lives until Stop (runCtx), not just for startup.
		if err := inst.discovery.Start(runCtx); err != nil {
			return nil, fmt.Errorf("invalid %s %q: %w", cfg.name("DYN_EPP_WORKERS_FILE"), cfg.WorkersFile, err)
		}
		cleanups = append(cleanups, func() { _ = inst.discovery.Close() })
	}
	// 3. Kubernetes discovery: the pool's pods register in the background; readiness waits.
	if cfg.InferencePoolName != "" {
		if err := inst.startPoolDiscovery(runCtx, cfg, log); err != nil {
			return nil, err
		}
		cleanups = append(cleanups, func() { _ = inst.pool.Close() })
	}

	// 4-5. Recovery from a peer's /dump, then the buffered KV events are released (for an
	// InferencePool, after its pods are registered: awaitPoolReady).
	inst.recoveryPeers = recoveryPeers
	if len(recoveryPeers) > 0 && inst.pool == nil {
		recovered := recoverIndex(ctx, inst.Service, recoveryPeers, cfg, log)
		if inst.events != nil {
			inst.events.ReleaseEvents(recovered)
		}
	}
	// 5. The replica SUBs start once the index is recovered (epp.md §11.1 step 5).
	if err := inst.replica.start(inst.Service); err != nil {
		return nil, err
	}
	if inst.replica != nil {
		inst.Metrics.MustRegister(replicaCollector{m: inst.replica.m})
	}

	inst.Metrics.MustRegister(&statsCollector{svc: inst.Service, events: inst.events, disc: inst.discovery})
	inst.Metrics.MustRegister(&poolCollector{svc: inst.Service, pool: inst.pool, name: cfg.InferencePoolName})

	// 6. ext_proc server (TLS or h2c), with the health service registered on it too.
	var toks tokResult
	select {
	case toks = <-tokDone:
	case <-ctx.Done():
		return nil, fmt.Errorf("startup cancelled while loading tokenizers: %w", ctx.Err())
	}
	if toks.err != nil {
		return nil, toks.err
	}
	tokAPI.set.Store(toks.set)
	inst.ExtProc, err = extproc.NewServer(extproc.Config{
		Picker:              inst.Service,
		Tokenizers:          toks.set,
		ModelName:           cfg.ModelName,
		MaxRequestBodyBytes: cfg.MaxRequestBodyBytes,
		MaxInflight:         cfg.MaxInflightRequests,
		MaxDestinations:     cfg.MaxDestinations,
		RequestBodyTimeout:  cfg.RequestBodyTimeout.Duration(),
		Ready:               inst.Health.Ready,
		Logger:              log.With().Str("component", "extproc").Logger(),
		// The conformance hooks name the pool; without one they still work on the workers file.
		ConformanceTestHooks: bool(cfg.ConformanceTestHooks),
		PoolName:             inst.poolName(),
	})
	if err != nil {
		return nil, err
	}
	grpcOpts := append(inst.ExtProc.GRPCServerOptions(),
		grpc.WaitForHandlers(true),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	)
	if cfg.SecureServing {
		tlsCfg, err := serverTLSConfig(cfg.CertPath, log)
		if err != nil {
			return nil, err
		}
		grpcOpts = append(grpcOpts, grpc.Creds(credentials.NewTLS(tlsCfg)))
	}
	inst.grpcServer = grpc.NewServer(grpcOpts...)
	inst.ExtProc.Register(inst.grpcServer)
	inst.Health.Register(inst.grpcServer)
	inst.addrs.GRPC = grpcLn.Addr().String()
	grpcServing = true
	go inst.serveGRPC(inst.grpcServer, grpcLn, "ext_proc")
	cleanups = append(cleanups, inst.grpcServer.Stop)

	inst.Metrics.MustRegister(inst.ExtProc.Metrics())
	if c := toks.set.convCache; c != nil {
		inst.Metrics.MustRegister(conversationCacheCollector{c})
	}

	// Ready (an InferencePool EPP once its pods are registered: awaitPoolReady).
	started = true
	if inst.pool != nil {
		go inst.awaitPoolReady(runCtx, cfg, log)
		log.Info().
			Str("ext_proc", inst.addrs.GRPC).Bool("tls", bool(cfg.SecureServing)).
			Str("health", inst.addrs.Health).Str("selection", inst.addrs.Selection).Str("metrics", inst.addrs.Metrics).
			Str("inference_pool", cfg.PodNamespace+"/"+cfg.InferencePoolName).Str("tokenizer_protocol", cfg.EffectiveTokenizerProtocol()).
			Bool("use_kv_events", bool(cfg.UseKVEvents)).
			Msg("kvepp started: readiness NOT_SERVING until the InferencePool is synced")
		return inst, nil
	}
	inst.Health.SetReady(true)
	log.Info().
		Str("ext_proc", inst.addrs.GRPC).Bool("tls", bool(cfg.SecureServing)).
		Str("health", inst.addrs.Health).Str("selection", inst.addrs.Selection).Str("metrics", inst.addrs.Metrics).
		Str("replica_sync", inst.addrs.ReplicaSync).
		Str("workers_file", cfg.WorkersFile).Str("tokenizer_protocol", cfg.EffectiveTokenizerProtocol()).
		Bool("use_kv_events", bool(cfg.UseKVEvents)).
		Msg("kvepp ready")
	if cfg.EffectiveTokenizerProtocol() == TokenizerProtocolNone {
		log.Warn().Msg("DYN_EPP_TOKENIZER_PROTOCOL=none: prompts are hashed from their raw bytes (approximate mode only); cache hits are learned from kvepp's own routing")
	}
	return inst, nil
}

// serveGRPC runs a gRPC server; an unexpected stop marks the instance failed.
func (i *Instance) serveGRPC(s *grpc.Server, ln net.Listener, name string) {
	if err := s.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		i.log.Error().Err(err).Str("server", name).Msg("gRPC server stopped")
		i.fail(fmt.Errorf("%s server: %w", name, err))
	}
}

// serveHTTP runs an HTTP server; an unexpected stop marks the instance failed.
func (i *Instance) serveHTTP(s *http.Server, ln net.Listener, name string) {
	if err := s.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		i.log.Error().Err(err).Str("server", name).Msg("HTTP server stopped")
		i.fail(fmt.Errorf("%s server: %w", name, err))
	}
}

// Stop shuts the instance down gracefully (epp.md §9): readiness → NOT_SERVING (liveness stays
// SERVING) while existing and new streams keep being served for DYN_EPP_DRAIN_TIMEOUT_SECS (cut
// short when ctx ends); then the ext_proc server stops gracefully, and streams still open after a
// short grace are closed, their bookings freed before Stop continues; then discovery stops, the
// selection core rejects new work, and the side port, metrics, KV listeners and health server are
// closed. Only the first call does the work; later calls return its result.
func (i *Instance) Stop(ctx context.Context) error {
	i.stopOnce.Do(func() { i.stopErr = i.stop(ctx) })
	return i.stopErr
}

func (i *Instance) stop(ctx context.Context) error {
	i.log.Info().Int64("drain_ms", i.cfg.DrainTimeout.Duration().Milliseconds()).Msg("shutting down: readiness NOT_SERVING, draining")
	i.Health.Drain()
	if d := i.cfg.DrainTimeout.Duration(); d > 0 {
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
	}
	// Stop ext_proc: graceful for a short grace, then force; WaitForHandlers makes Stop wait for
	// every stream handler, so each open stream's booking is freed before we continue.
	stopGRPC(i.grpcServer, shutdownGrace)
	if i.discovery != nil {
		_ = i.discovery.Close()
	}
	if i.pool != nil {
		_ = i.pool.Close()
	}
	i.Service.BeginShutdown()

	var errs []error
	sctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancel()
	if err := i.httpSrv.Shutdown(sctx); err != nil {
		_ = i.httpSrv.Close()
	}
	if i.events != nil {
		if err := i.events.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close KV event listeners: %w", err))
		}
	}
	if err := i.replica.close(); err != nil {
		errs = append(errs, fmt.Errorf("close replica sync: %w", err))
	}
	i.runCancel()
	<-i.runDone
	if i.kubeDone != nil {
		<-i.kubeDone
	}
	if err := i.metricsSrv.Shutdown(sctx); err != nil {
		_ = i.metricsSrv.Close()
	}
	stopGRPC(i.healthSrv, shutdownGrace)
	i.log.Info().Msg("kvepp stopped")
	return errors.Join(errs...)
}

// stopGRPC stops s gracefully, forcing Stop after grace.
func stopGRPC(s *grpc.Server, grace time.Duration) {
	done := make(chan struct{})
	go func() {
		s.GracefulStop()
		close(done)
	}()
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		s.Stop()
		<-done
	}
}

// workerDefaults are the workers-file defaults from the configuration.
func workerDefaults(cfg Config) discovery.Defaults {
	d := discovery.Defaults{BlockSize: uint32(cfg.BlockSize), ModelName: cfg.ModelName}
	if cfg.MaxNumBatchedTokens.Set {
		d.MaxNumBatchedTokens = uint64(cfg.MaxNumBatchedTokens.Value)
	}
	if cfg.TotalKVBlocks.Set {
		d.TotalKVBlocks = uint64(cfg.TotalKVBlocks.Value)
	}
	return d
}

// routerSettings maps the configuration to the core's router settings (selection-service.md
// §19.2: weights, tracking, approximate-mode TTL, size cap and cache policy, queue threshold,
// queue policy and overlap refresh, busy thresholds), applying the deprecated overlap score
// weight of §9.6.
func routerSettings(cfg Config, log zerolog.Logger) picker.RouterSettings {
	r := picker.DefaultRouterSettings()
	r.OverlapScoreCredit = cfg.OverlapScoreCredit
	r.OverlapScoreCreditDecay = cfg.OverlapScoreCreditDecay
	r.PrefillLoadScale = cfg.PrefillLoadScale
	r.DecodeActiveRequestWeight = cfg.DecodeActiveRequestWeight
	r.HostCacheHitWeight = cfg.HostCacheHitWeight
	r.DiskCacheHitWeight = cfg.DiskCacheHitWeight
	r.RouterTemperature = cfg.RouterTemperature
	r.TrackActiveBlocks = bool(cfg.TrackActiveBlocks)
	r.TrackOutputBlocks = bool(cfg.TrackOutputBlocks)
	r.AssumeKVReuse = bool(cfg.AssumeKVReuse)
	r.TrackPrefillTokens = bool(cfg.TrackPrefillTokens)
	r.UseKVEvents = bool(cfg.UseKVEvents)
	r.ActiveRequestExpirySecs = cfg.ActiveRequestExpiry.Duration().Seconds()
	r.ApproxTTLSecs = cfg.ApproximateTTL.Duration().Seconds()
	r.MaxTreeSize = cfg.MaxTreeSize
	r.PruneTargetRatio = cfg.PruneTargetRatio
	if cfg.OverlapScoreWeight.Set {
		w := cfg.OverlapScoreWeight.Value
		log.Warn().Float64("value", w).Msg("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT is deprecated: it sets the prefill load scale (and a zero credit when 0); use DYN_ROUTER_PREFILL_LOAD_SCALE and DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT")
		r.PrefillLoadScale = w
		if w == 0 {
			r.OverlapScoreCredit = 0
		}
	}
	if cfg.QueueThreshold.Set {
		v := cfg.QueueThreshold.Value
		r.QueueThreshold = &v
	}
	if cfg.PrefillBusyThreshold.Set {
		v := cfg.PrefillBusyThreshold.Value
		r.ConditionalDisaggPrefillBusyThreshold = &v
	}
	if cfg.DecodeBusyThreshold.Set {
		v := cfg.DecodeBusyThreshold.Value
		r.ConditionalDisaggDecodeBusyThreshold = &v
	}
	r.QueuePolicy = cfg.QueuePolicy
	r.OverlapRefreshAfterSecs = cfg.OverlapRefreshAfter.Duration().Seconds()
	r.ApproximateCachePolicy = cfg.ApproximateCachePolicy
	if cfg.ApproximateCachePolicy == picker.ApproxCachePolicyLRU {
		log.Info().Msg("DYN_ROUTER_APPROXIMATE_CACHE_POLICY=lru: each worker rank keeps at most total_kv_blocks approximate blocks; workers without total_kv_blocks use TTL eviction only")
	}
	return r
}
