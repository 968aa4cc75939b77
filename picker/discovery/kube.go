package discovery

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/go-logr/zerologr"
	"github.com/rs/zerolog"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/cluster"
	inferencev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
)

// Scheme returns the API types kvepp reads from Kubernetes: the client-go built-ins (pods,
// EndpointSlices, …) and the InferencePool v1 types (inference.networking.k8s.io).
func Scheme() *runtime.Scheme {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		panic("discovery: client-go scheme: " + err.Error()) // static type registration cannot fail
	}
	if err := inferencev1.Install(s); err != nil {
		panic("discovery: InferencePool scheme: " + err.Error())
	}
	return s
}

// KubeConfig configures NewKube.
type KubeConfig struct {
	// RestConfig reaches the API server (in cluster: the pod's ServiceAccount).
	RestConfig *rest.Config
	// Namespace is POD_NAMESPACE: the one namespace the cache lists and watches.
	Namespace string
	// Logger receives cache and watch errors.
	Logger zerolog.Logger
}

// Kube is the single controller-runtime cluster of an EPP process: one client, one scheme and one
// shared informer cache scoped to POD_NAMESPACE. Every Kubernetes watcher of the process
// registers its informers on it — InferencePool discovery (WatchInferencePool) and any other
// watcher (GetCache) — so each object kind is listed and watched once. NewKube builds it without
// contacting the API server; Start runs it.
type Kube struct {
	cl  cluster.Cluster
	ns  string
	log zerolog.Logger

	mu        sync.Mutex
	watchErrs map[string]string // type description → last list/watch problem
}

// NewKube builds the cluster: a cache of cfg.Namespace (managed fields stripped to save memory)
// whose list/watch failures are logged with the reason an operator can act on (missing RBAC,
// missing CRD). The informers retry with backoff; nothing here panics or exits.
func NewKube(cfg KubeConfig) (*Kube, error) {
	if cfg.RestConfig == nil {
		return nil, errors.New("Kubernetes discovery needs a REST config (in-cluster service account or KUBECONFIG)")
	}
	if cfg.Namespace == "" {
		return nil, errors.New("Kubernetes discovery needs a namespace (POD_NAMESPACE)")
	}
	k := &Kube{ns: cfg.Namespace, log: cfg.Logger.With().Str("component", "kubernetes").Logger(), watchErrs: map[string]string{}}
	zl := k.log
	cl, err := cluster.New(cfg.RestConfig, func(o *cluster.Options) {
		o.Scheme = Scheme()
		o.Logger = zerologr.New(&zl)
		o.Cache.DefaultNamespaces = map[string]cache.Config{cfg.Namespace: {}}
		o.Cache.DefaultTransform = cache.TransformStripManagedFields()
		o.Cache.DefaultWatchErrorHandler = k.watchError
	})
	if err != nil {
		return nil, fmt.Errorf("build Kubernetes client for namespace %s: %w", cfg.Namespace, err)
	}
	k.cl = cl
	return k, nil
}

// Cluster returns the underlying controller-runtime cluster (client, cache, scheme).
func (k *Kube) Cluster() cluster.Cluster { return k.cl }

// Reader returns the cache-backed reader. Reads of a kind block until its informer has synced, so
// read only after the informer reports HasSynced (WatchInferencePool does).
func (k *Kube) Reader() client.Reader { return k.cl.GetClient() }

// GetCache returns the shared informer cache, for further watchers.
func (k *Kube) GetCache() cache.Cache { return k.cl.GetCache() }

// Start runs the cache until ctx ends. It returns nil on a clean stop.
func (k *Kube) Start(ctx context.Context) error {
	if err := k.cl.Start(ctx); err != nil && ctx.Err() == nil {
		return fmt.Errorf("Kubernetes cache: %w", err)
	}
	return nil
}

// watchError logs a failed list or watch with what the operator must fix; the informer backs off
// and retries by itself.
func (k *Kube) watchError(_ context.Context, r *toolscache.Reflector, err error) {
	what := r.TypeDescription()
	var msg string
	switch {
	case apierrors.IsForbidden(err):
		msg = fmt.Sprintf("RBAC forbids listing or watching %s in namespace %s: the EPP's ServiceAccount needs get, list and watch on it (manifests/base/rbac.yaml); not ready, retrying", what, k.ns)
	case meta.IsNoMatchError(err) || apierrors.IsNotFound(err):
		msg = fmt.Sprintf("the API server does not serve %s: install its CRD (manifests/README.md); not ready, retrying", what)
	case errors.Is(err, context.Canceled):
		return
	default:
		msg = fmt.Sprintf("listing or watching %s in namespace %s failed; retrying", what, k.ns)
	}
	k.mu.Lock()
	k.watchErrs[what] = msg
	k.mu.Unlock()
	k.log.Error().Err(err).Str("type", what).Msg(msg)
}

// lastWatchError returns the most recent list/watch problem of any informer ("" = none).
func (k *Kube) lastWatchError() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, m := range k.watchErrs {
		return m
	}
	return ""
}

// clearWatchErrors forgets the recorded problems (the informers synced).
func (k *Kube) clearWatchErrors() {
	k.mu.Lock()
	clear(k.watchErrs)
	k.mu.Unlock()
}

// WatchInferencePool feeds src from the shared cache: it registers the InferencePool and Pod
// informers (retrying with backoff while the InferencePool CRD is not installed), triggers src on
// every pool or pod event, and triggers the first snapshot once both informers have synced — src
// never reads an unsynced cache. It returns at once; the work runs until ctx ends. Start may be
// called before or after.
func (k *Kube) WatchInferencePool(ctx context.Context, src *PoolSource) {
	go k.watchInferencePool(ctx, src)
}

func (k *Kube) watchInferencePool(ctx context.Context, src *PoolSource) {
	handler := toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { src.Trigger() },
		UpdateFunc: func(any, any) { src.Trigger() },
		DeleteFunc: func(any) { src.Trigger() },
	}
	backoff := time.Second
	var informers []cache.Informer
	for _, obj := range []client.Object{&inferencev1.InferencePool{}, &corev1.Pod{}} {
		for {
			inf, err := k.cl.GetCache().GetInformer(ctx, obj, cache.BlockUntilSynced(false))
			if err == nil {
				if _, err := inf.AddEventHandler(handler); err != nil {
					k.log.Error().Err(err).Msg("cannot add an informer event handler")
				}
				informers = append(informers, inf)
				break
			}
			if ctx.Err() != nil {
				return
			}
			note := fmt.Sprintf("cannot watch %T: %v; not ready, retrying", obj, err)
			if meta.IsNoMatchError(err) {
				note = "the InferencePool CRD (inference.networking.k8s.io/v1) is not installed; install the Gateway API Inference Extension CRDs (manifests/README.md); not ready, retrying"
			}
			src.SetWaitingFor(note)
			k.log.Error().Err(err).Dur("retry_in", backoff).Msg(note)
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 30*time.Second)
		}
	}
	src.SetWaitingFor("waiting for the InferencePool and pod caches to sync")
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		synced := true
		for _, inf := range informers {
			synced = synced && inf.HasSynced()
		}
		if synced {
			break
		}
		if m := k.lastWatchError(); m != "" {
			src.SetWaitingFor(m)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
	k.clearWatchErrors()
	src.SetWaitingFor("")
	k.log.Info().Msg("InferencePool and pod caches synced")
	src.Trigger()
}
