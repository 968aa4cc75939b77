package discovery

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/zerologr"
	"github.com/rs/zerolog"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/apiutil"
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
	// PeerService is DYN_EPP_PEER_SERVICE ("" = none): when set, the EndpointSlice cache holds
	// only the slices labelled kubernetes.io/service-name=<PeerService>, so the namespace's other
	// Services' slices are never listed or kept, and WatchPeers accepts only that Service.
	PeerService string
	// Logger receives cache and watch errors.
	Logger zerolog.Logger
}

// Kube is the single controller-runtime cluster of an EPP process: one client, one scheme and one
// shared informer cache scoped to POD_NAMESPACE. Every Kubernetes watcher of the process
// registers its informers on it — InferencePool discovery (WatchInferencePool), peer-EPP discovery
// (WatchPeers) and any other watcher (GetCache) — so each object kind is listed and watched once,
// and every list/watch failure is reported the same way. NewKube builds it without contacting the
// API server; Start runs it.
type Kube struct {
	cl          cluster.Cluster
	ns          string
	peerService string
	log         zerolog.Logger

	stopped chan struct{}  // closed when Start's cache stopped: the watch goroutines end
	watches sync.WaitGroup // the goroutines of WatchInferencePool and WatchPeers

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
	k := &Kube{ns: cfg.Namespace, peerService: cfg.PeerService, log: cfg.Logger.With().Str("component", "kubernetes").Logger(),
		stopped: make(chan struct{}), watchErrs: map[string]string{}}
	zl := k.log
	cl, err := cluster.New(cfg.RestConfig, func(o *cluster.Options) {
		o.Scheme = Scheme()
		o.Logger = zerologr.New(&zl)
		o.Cache.DefaultNamespaces = map[string]cache.Config{cfg.Namespace: {}}
		o.Cache.DefaultTransform = cache.TransformStripManagedFields()
		o.Cache.DefaultWatchErrorHandler = k.watchError
		if cfg.PeerService != "" {
			// Namespaces and transform default to the cache-wide ones above. The cache asks the
			// mapper whether a ByObject kind is namespaced while it is built; the static answer
			// keeps NewKube from contacting the API server (an unreachable one is retried by the
			// informers, not a startup error).
			o.Cache.ByObject = map[client.Object]cache.ByObject{&discoveryv1.EndpointSlice{}: {
				Label: labels.SelectorFromSet(labels.Set{discoveryv1.LabelServiceName: cfg.PeerService}),
			}}
			o.MapperProvider = func(c *rest.Config, hc *http.Client) (meta.RESTMapper, error) {
				m, err := apiutil.NewDynamicRESTMapper(c, hc)
				return endpointSliceMapper{m}, err
			}
		}
	})
	if err != nil {
		return nil, fmt.Errorf("build Kubernetes client for namespace %s: %w", cfg.Namespace, err)
	}
	k.cl = cl
	return k, nil
}

// endpointSliceGVK is the one EndpointSlice version kvepp reads (discovery.k8s.io/v1, GA since
// Kubernetes 1.21).
var endpointSliceGVK = discoveryv1.SchemeGroupVersion.WithKind("EndpointSlice")

// endpointSliceMapper answers the REST mapping of discovery.k8s.io/v1 EndpointSlice (namespaced,
// resource endpointslices) without API discovery and asks its RESTMapper for everything else.
type endpointSliceMapper struct{ meta.RESTMapper }

// RESTMapping implements meta.RESTMapper.
func (m endpointSliceMapper) RESTMapping(gk schema.GroupKind, versions ...string) (*meta.RESTMapping, error) {
	if gk == endpointSliceGVK.GroupKind() && (len(versions) == 0 || slices.Contains(versions, endpointSliceGVK.Version)) {
		return &meta.RESTMapping{
			Resource:         discoveryv1.SchemeGroupVersion.WithResource("endpointslices"),
			GroupVersionKind: endpointSliceGVK,
			Scope:            meta.RESTScopeNamespace,
		}, nil
	}
	return m.RESTMapper.RESTMapping(gk, versions...)
}

// Cluster returns the underlying controller-runtime cluster (client, cache, scheme).
func (k *Kube) Cluster() cluster.Cluster { return k.cl }

// Reader returns the cache-backed reader. Reads of a kind block until its informer has synced, so
// read only after the informer reports HasSynced (WatchInferencePool does).
func (k *Kube) Reader() client.Reader { return k.cl.GetClient() }

// GetCache returns the shared informer cache, for further watchers.
func (k *Kube) GetCache() cache.Cache { return k.cl.GetCache() }

// Start runs the cache until ctx ends, then ends the goroutines of WatchInferencePool and
// WatchPeers and waits for them, so none of Kube's own goroutines outlive it. Call it once. It returns
// nil on a clean stop, else the error that stopped the cache.
func (k *Kube) Start(ctx context.Context) error {
	err := k.cl.Start(ctx)
	k.mu.Lock()
	close(k.stopped) // under mu: goWatch adds no goroutine after this
	k.mu.Unlock()
	k.watches.Wait()
	if err != nil && ctx.Err() == nil {
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

// typeDescription names obj's kind the way its informer's reflector does (client-go's
// description of a typed object: its Go type, e.g. "*v1.EndpointSlice"), so a watcher finds the
// list/watch problems of its own kinds.
func typeDescription(obj client.Object) string { return reflect.TypeOf(obj).String() }

// lastWatchError returns the most recent list/watch problem of one of objs' informers ("" = none).
func (k *Kube) lastWatchError(objs []client.Object) string {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, o := range objs {
		if m := k.watchErrs[typeDescription(o)]; m != "" {
			return m
		}
	}
	return ""
}

// clearWatchErrors forgets the recorded problems of objs' informers (they synced).
func (k *Kube) clearWatchErrors(objs []client.Object) {
	k.mu.Lock()
	for _, o := range objs {
		delete(k.watchErrs, typeDescription(o))
	}
	k.mu.Unlock()
}

// informerWatch is one watcher's use of the shared cache.
type informerWatch struct {
	// what names the watched objects in logs and notes ("InferencePool and pod").
	what string
	// objs are the kinds whose informers the watcher needs.
	objs []client.Object
	// noMatch is the note when the API server does not serve a kind (a missing CRD); "" = a
	// generic one.
	noMatch string
	// trigger is called on every add, update and delete, and once when all informers synced.
	trigger func()
	// waiting records why the watcher has nothing to read yet ("" once synced).
	waiting func(note string)
}

// watch registers w's informers and handlers on the shared cache (retrying with backoff, 1 s to
// 30 s, while a kind cannot be watched, e.g. its CRD is missing), reports through w.waiting why it
// is not synced yet (the list/watch problems of its kinds, such as missing RBAC), and triggers w
// once every informer has synced. It runs on the calling goroutine until then, or until ctx ends
// or the cache stops.
func (k *Kube) watch(ctx context.Context, w informerWatch) {
	handler := toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { w.trigger() },
		UpdateFunc: func(any, any) { w.trigger() },
		DeleteFunc: func(any) { w.trigger() },
	}
	sleep := func(d time.Duration) bool {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return false
		case <-k.stopped:
			return false
		case <-t.C:
			return true
		}
	}
	backoff := time.Second
	var informers []cache.Informer
	for _, obj := range w.objs {
		for {
			inf, err := k.cl.GetCache().GetInformer(ctx, obj, cache.BlockUntilSynced(false))
			if err == nil {
				if _, err := inf.AddEventHandler(handler); err != nil {
					k.log.Error().Err(err).Str("watch", w.what).Msg("cannot add an informer event handler")
				}
				informers = append(informers, inf)
				break
			}
			if ctx.Err() != nil {
				return
			}
			note := fmt.Sprintf("cannot watch %s: %v; not ready, retrying", typeDescription(obj), err)
			if meta.IsNoMatchError(err) {
				note = fmt.Sprintf("the API server does not serve %s: install its CRD (manifests/README.md); not ready, retrying", typeDescription(obj))
				if w.noMatch != "" {
					note = w.noMatch
				}
			}
			w.waiting(note)
			k.log.Error().Err(err).Dur("retry_in", backoff).Msg(note)
			if !sleep(backoff) {
				return
			}
			backoff = min(2*backoff, 30*time.Second)
		}
	}
	w.waiting("waiting for the " + w.what + " caches to sync")
	for {
		synced := true
		for _, inf := range informers {
			synced = synced && inf.HasSynced()
		}
		if synced {
			break
		}
		if m := k.lastWatchError(w.objs); m != "" {
			w.waiting(m)
		}
		if !sleep(100 * time.Millisecond) {
			return
		}
	}
	k.clearWatchErrors(w.objs)
	w.waiting("")
	k.log.Info().Str("watch", w.what).Msg(w.what + " caches synced")
	w.trigger()
}

// goWatch runs watch on a goroutine that Start waits for (none once the cache stopped).
func (k *Kube) goWatch(ctx context.Context, w informerWatch) {
	k.mu.Lock()
	defer k.mu.Unlock()
	select {
	case <-k.stopped:
		return
	default:
	}
	k.watches.Add(1)
	go func() {
		defer k.watches.Done()
		k.watch(ctx, w)
	}()
}

// WatchInferencePool feeds src from the shared cache: it registers the InferencePool and Pod
// informers (retrying with backoff while the InferencePool CRD is not installed), triggers src on
// every pool or pod event, and triggers the first snapshot once both informers have synced — src
// never reads an unsynced cache. It returns at once; the work runs until ctx ends or the cache
// stops. Start may be called before or after.
func (k *Kube) WatchInferencePool(ctx context.Context, src *PoolSource) {
	k.goWatch(ctx, informerWatch{
		what:    "InferencePool and pod",
		objs:    []client.Object{&inferencev1.InferencePool{}, &corev1.Pod{}},
		noMatch: "the InferencePool CRD (inference.networking.k8s.io/v1) is not installed; install the Gateway API Inference Extension CRDs (manifests/README.md); not ready, retrying",
		trigger: src.Trigger,
		waiting: src.SetWaitingFor,
	})
}

// WatchPeers feeds w from the shared cache (epp.md §10.4): it registers the EndpointSlice
// informer, triggers w on every slice event and once the informer has synced (w's first Sync, the
// one WaitSynced waits for). Problems listing or watching the slices (missing RBAC) are logged
// like the pool's and reported by w.Problem. It returns at once; the work runs until ctx ends or
// the cache stops. Start may be called before or after. Errors: w watches another namespace than
// the cache, or another Service than KubeConfig.PeerService narrowed the cache to.
func (k *Kube) WatchPeers(ctx context.Context, w *PeerWatcher) error {
	if w.cfg.Namespace != k.ns {
		return fmt.Errorf("peer discovery in namespace %s, but the Kubernetes cache holds namespace %s", w.cfg.Namespace, k.ns)
	}
	if k.peerService != "" && w.cfg.Service != k.peerService {
		return fmt.Errorf("peer discovery of service %s, but the EndpointSlice cache holds service %s", w.cfg.Service, k.peerService)
	}
	k.goWatch(ctx, informerWatch{
		what:    "peer EndpointSlice",
		objs:    []client.Object{&discoveryv1.EndpointSlice{}},
		trigger: w.Trigger,
		waiting: w.SetWaitingFor,
	})
	return nil
}
