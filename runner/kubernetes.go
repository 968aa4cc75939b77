package runner

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/zerologr"
	"github.com/rs/zerolog"
	"k8s.io/client-go/rest"
	ctrlconfig "sigs.k8s.io/controller-runtime/pkg/client/config"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/kvepp/kvepp/picker/discovery"
)

// notReadyLogInterval is how often a starting EPP repeats why it is not ready yet.
const notReadyLogInterval = 30 * time.Second

// controllerRuntimeLogOnce routes controller-runtime's process-wide logger to zerolog once, so
// its messages are JSON like ours (and it never warns that no logger was set).
var controllerRuntimeLogOnce sync.Once

// kubeRestConfig returns the API server configuration: override (tests), else controller-runtime's
// usual lookup (the --kubeconfig flag of the default flag set, KUBECONFIG, the in-cluster service
// account, ~/.kube/config). what names the settings that need it, for the error.
func kubeRestConfig(override *rest.Config, what string) (*rest.Config, error) {
	if override != nil {
		return rest.CopyConfig(override), nil
	}
	cfg, err := ctrlconfig.GetConfig()
	if err != nil {
		return nil, fmt.Errorf("Kubernetes discovery (%s) needs API server access: %w", what, err)
	}
	cfg.UserAgent = "kvepp-epp"
	return cfg, nil
}

// kubeEnabled reports whether the EPP reads Kubernetes: an InferencePool or a peer Service is
// configured (epp.md §10).
func (c *Config) kubeEnabled() bool { return c.InferencePoolName != "" || c.PeerService != "" }

// startKube builds and starts the process's one Kubernetes cluster (discovery.NewKube: one client
// and one informer cache of POD_NAMESPACE, the EndpointSlice cache narrowed to the peer Service)
// when kubeEnabled, with override as its REST config when set (tests). InferencePool discovery
// (startPoolDiscovery) and peer discovery (replicaSync.discoverPeers) both watch through it. The
// cache runs until runCtx ends; i.kubeDone is closed when it and its watch goroutines stopped. An
// unexpected stop marks the instance failed.
func (i *Instance) startKube(runCtx context.Context, cfg Config, override *rest.Config, log zerolog.Logger) error {
	if !cfg.kubeEnabled() {
		return nil
	}
	controllerRuntimeLogOnce.Do(func() {
		zl := log.With().Str("component", "controller-runtime").Logger()
		ctrllog.SetLogger(zerologr.New(&zl))
	})
	var what []string
	if cfg.InferencePoolName != "" {
		what = append(what, cfg.name("DYN_EPP_INFERENCE_POOL_NAME"))
	}
	if cfg.PeerService != "" {
		what = append(what, cfg.name("DYN_EPP_PEER_SERVICE"))
	}
	restCfg, err := kubeRestConfig(override, strings.Join(what, ", "))
	if err != nil {
		return err
	}
	i.kube, err = discovery.NewKube(discovery.KubeConfig{RestConfig: restCfg, Namespace: cfg.PodNamespace, PeerService: cfg.PeerService, Logger: log})
	if err != nil {
		return err
	}
	i.kubeDone = make(chan struct{})
	go func() {
		defer close(i.kubeDone)
		if err := i.kube.Start(runCtx); err != nil {
			// The cache stopped on its own: the EPP can no longer follow its pool or peers.
			i.log.Error().Err(err).Msg("Kubernetes cache stopped")
			i.fail(err)
		}
	}()
	return nil
}

// startPoolDiscovery wires InferencePool discovery (epp.md §10.1–10.3) on the process's Kubernetes
// cluster (startKube): the InferencePool source driving the selection core, and the informers
// feeding it. It returns at once; the source becomes ready in the background. Health readiness
// follows the source after startup (awaitPoolReady).
func (i *Instance) startPoolDiscovery(runCtx context.Context, cfg Config, log zerolog.Logger) error {
	var err error
	pc := discovery.PoolConfig{
		Namespace:         cfg.PodNamespace,
		Name:              cfg.InferencePoolName,
		ModelName:         cfg.ModelName,
		BlockSize:         uint32(cfg.BlockSize),
		KVEventPort:       cfg.KVEventPort,
		KVEventReplayPort: cfg.KVEventReplayPort,
		Logger:            log,
		OnReadyChange: func(ready bool) {
			if i.poolServing.Load() {
				i.Health.SetReady(ready)
			}
		},
	}
	d := workerDefaults(cfg)
	pc.MaxNumBatchedTokens, pc.TotalKVBlocks = d.MaxNumBatchedTokens, d.TotalKVBlocks
	i.pool, err = discovery.NewPoolSource(pc, i.kube.Reader(), i.Service)
	if err != nil {
		return err
	}
	i.kube.WatchInferencePool(runCtx, i.pool)
	return i.pool.Start(runCtx)
}

// awaitPoolReady finishes startup in the background for an InferencePool EPP (epp.md §11.1 steps
// 3–6): it waits until the pool was read and its pods registered (logging why not every 30 s; a
// missing pool, CRD or RBAC never stops the process), recovers the prefix index from a peer and
// releases the buffered KV events, and then turns readiness on. From then on readiness follows
// the pool (a deleted pool → NOT_SERVING until it is back).
func (i *Instance) awaitPoolReady(runCtx context.Context, cfg Config, log zerolog.Logger) {
	tick := time.NewTicker(notReadyLogInterval)
	defer tick.Stop()
	waitCtx, cancel := context.WithCancel(runCtx)
	defer cancel()
	ready := make(chan error, 1)
	go func() { ready <- i.pool.WaitReady(waitCtx) }()
	for waiting := true; waiting; {
		select {
		case err := <-ready:
			if err != nil {
				return // stopping
			}
			waiting = false
		case <-tick.C:
			log.Warn().Str("reason", i.pool.Stats().Problem).Msg("not ready yet: waiting for the InferencePool")
		}
	}
	if len(i.recoveryPeers) > 0 {
		recovered := recoverIndex(runCtx, i.Service, i.recoveryPeers, cfg, log)
		if i.events != nil {
			i.events.ReleaseEvents(recovered)
		}
	}
	if runCtx.Err() != nil {
		return
	}
	i.poolServing.Store(true)
	i.Health.SetReady(i.pool.Ready())
	st := i.pool.Stats()
	log.Info().Str("inference_pool", cfg.PodNamespace+"/"+cfg.InferencePoolName).Int("registered_pods", st.Registered).
		Int("ready_pods", st.Candidates).Msg("kvepp ready")
}

// poolName is "namespace/name" of the served InferencePool, or "" without one.
func (i *Instance) poolName() string {
	if i.pool == nil {
		return ""
	}
	return i.cfg.PodNamespace + "/" + i.cfg.InferencePoolName
}

// Pool returns the InferencePool discovery source, or nil without DYN_EPP_INFERENCE_POOL_NAME.
func (i *Instance) Pool() *discovery.PoolSource { return i.pool }
