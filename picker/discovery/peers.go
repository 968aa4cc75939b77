package discovery

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync"

	"github.com/rs/zerolog"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// Named ports of the peer Service (epp.md §10.4).
const (
	// PeerPortReplica is the port name of a peer's replica-sync PUB socket.
	PeerPortReplica = "replica-agg"
	// PeerPortSelection is the port name of a peer's selection HTTP side port (GET /dump).
	PeerPortSelection = "selection-http"
)

// PeerConfig configures peer-EPP discovery from EndpointSlices (epp.md §10.4).
type PeerConfig struct {
	// Namespace is POD_NAMESPACE: where the peer Service and its EndpointSlices live.
	Namespace string
	// Service is DYN_EPP_PEER_SERVICE: the Service whose EndpointSlices list the peer EPPs.
	Service string
	// PodIP is POD_IP: this replica's own address, never a peer.
	PodIP string
	// ReplicaPort is DYN_EPP_REPLICA_SYNC_PORT, used when a slice has no replica-agg port.
	ReplicaPort int
	// SelectionPort is DYN_EPP_SELECTION_HTTP_PORT, used when a slice has no selection-http port.
	SelectionPort int
	// Logger receives membership changes.
	Logger zerolog.Logger
}

// PeerSink is the replica-sync membership the watcher drives (the replica manager, adapted by the
// composition root).
type PeerSink interface {
	// RegisterPeer adds a replica-sync endpoint; added is false when it was already registered.
	RegisterPeer(endpoint string) (added bool, err error)
	// DeregisterPeer removes a replica-sync endpoint.
	DeregisterPeer(endpoint string) error
}

// Peers is one view of the peer EPPs.
type Peers struct {
	// Replica are the replica-sync PUB endpoints, "tcp://<ip>:<replica-agg>", sorted.
	Replica []string
	// Selection are the selection side-port base URLs, "http://<ip>:<selection-http>", sorted:
	// the indexer-recovery peers of a starting replica (epp.md §11.1 step 4).
	Selection []string
}

// PeerWatcher turns the peer Service's EndpointSlices into replica-sync membership: every change
// re-lists the slices, registers the endpoints that appeared and deregisters the ones it had
// registered that disappeared (endpoints registered by anyone else — the static list, the HTTP
// API — are never deregistered by it). Endpoints marked ready: false and POD_IP are excluded. It is
// a controller-runtime reconciler; NewPeerWatcher builds it and SetupWithManager attaches it to a
// manager, which may be shared with other watchers (the InferencePool discovery). Safe for
// concurrent use.
type PeerWatcher struct {
	cfg    PeerConfig
	reader client.Reader
	sink   PeerSink

	mu    sync.Mutex
	owned map[string]bool // replica endpoints this watcher registered
	last  Peers
}

var _ reconcile.Reconciler = (*PeerWatcher)(nil)

// NewPeerWatcher returns a watcher that reads EndpointSlices through reader (a manager's cached
// client, or a fake client in tests) and drives sink. Errors: an empty Namespace or Service.
func NewPeerWatcher(cfg PeerConfig, reader client.Reader, sink PeerSink) (*PeerWatcher, error) {
	if cfg.Namespace == "" || cfg.Service == "" {
		return nil, fmt.Errorf("peer discovery needs a namespace and a service (got %q, %q)", cfg.Namespace, cfg.Service)
	}
	return &PeerWatcher{cfg: cfg, reader: reader, sink: sink, owned: map[string]bool{}}, nil
}

// PeerCacheOptions restricts a manager's EndpointSlice cache to the peer Service's slices, for the
// manager.Options.Cache.ByObject of a manager that runs the watcher.
func PeerCacheOptions(cfg PeerConfig) map[client.Object]cache.ByObject {
	return map[client.Object]cache.ByObject{
		&discoveryv1.EndpointSlice{}: {
			Namespaces: map[string]cache.Config{cfg.Namespace: {}},
			Label:      labels.SelectorFromSet(labels.Set{discoveryv1.LabelServiceName: cfg.Service}),
		},
	}
}

// SetupWithManager watches the peer Service's EndpointSlices with mgr; each event reconciles the
// whole peer set.
func (w *PeerWatcher) SetupWithManager(mgr manager.Manager) error {
	mine := predicate.NewPredicateFuncs(func(o client.Object) bool {
		return o.GetNamespace() == w.cfg.Namespace && o.GetLabels()[discoveryv1.LabelServiceName] == w.cfg.Service
	})
	return builder.ControllerManagedBy(mgr).Named("kvepp-peer-epps").
		For(&discoveryv1.EndpointSlice{}, builder.WithPredicates(mine)).Complete(w)
}

// Reconcile implements reconcile.Reconciler: it syncs the whole peer set whatever slice changed.
func (w *PeerWatcher) Reconcile(ctx context.Context, _ reconcile.Request) (reconcile.Result, error) {
	_, err := w.Sync(ctx)
	return reconcile.Result{}, err
}

// Sync lists the peer Service's EndpointSlices, applies the difference to the sink and returns
// the peers now seen. A register or deregister error is returned after the rest was applied (the
// reconciler retries with backoff).
func (w *PeerWatcher) Sync(ctx context.Context) (Peers, error) {
	w.mu.Lock() // one sync at a time, so an older listing never overwrites a newer one
	defer w.mu.Unlock()
	var list discoveryv1.EndpointSliceList
	if err := w.reader.List(ctx, &list, client.InNamespace(w.cfg.Namespace),
		client.MatchingLabels{discoveryv1.LabelServiceName: w.cfg.Service}); err != nil {
		return Peers{}, fmt.Errorf("list EndpointSlices of service %s/%s: %w", w.cfg.Namespace, w.cfg.Service, err)
	}
	peers := w.peersOf(list.Items)
	var firstErr error
	keep := func(err error) {
		if firstErr == nil {
			firstErr = err
		}
	}
	want := map[string]bool{}
	for _, ep := range peers.Replica {
		want[ep] = true
		if w.owned[ep] {
			continue
		}
		added, err := w.sink.RegisterPeer(ep)
		if err != nil {
			keep(fmt.Errorf("register replica peer %s: %w", ep, err))
			continue
		}
		if added {
			w.owned[ep] = true
			w.cfg.Logger.Info().Str("peer", ep).Msg("peer EPP discovered")
		}
	}
	for ep := range w.owned {
		if want[ep] {
			continue
		}
		if err := w.sink.DeregisterPeer(ep); err != nil {
			w.cfg.Logger.Debug().Err(err).Str("peer", ep).Msg("deregistering a vanished peer EPP")
		}
		delete(w.owned, ep)
		w.cfg.Logger.Info().Str("peer", ep).Msg("peer EPP gone")
	}
	w.last = peers
	return peers, firstErr
}

// Last returns the peers seen by the latest Sync.
func (w *PeerWatcher) Last() Peers {
	w.mu.Lock()
	defer w.mu.Unlock()
	return Peers{Replica: slices.Clone(w.last.Replica), Selection: slices.Clone(w.last.Selection)}
}

// peersOf extracts the peer endpoints of slices (epp.md §10.4).
func (w *PeerWatcher) peersOf(items []discoveryv1.EndpointSlice) Peers {
	rep, sel := map[string]bool{}, map[string]bool{}
	for i := range items {
		s := &items[i]
		if s.DeletionTimestamp != nil {
			continue
		}
		rport, hport := w.cfg.ReplicaPort, w.cfg.SelectionPort
		for _, p := range s.Ports {
			if p.Name == nil || p.Port == nil {
				continue
			}
			switch *p.Name {
			case PeerPortReplica:
				rport = int(*p.Port)
			case PeerPortSelection:
				hport = int(*p.Port)
			}
		}
		for _, ep := range s.Endpoints {
			if ep.Conditions.Ready != nil && !*ep.Conditions.Ready {
				continue
			}
			for _, addr := range ep.Addresses {
				if addr == "" || addr == w.cfg.PodIP {
					continue
				}
				rep["tcp://"+net.JoinHostPort(addr, strconv.Itoa(rport))] = true
				sel["http://"+net.JoinHostPort(addr, strconv.Itoa(hport))] = true
			}
		}
	}
	return Peers{Replica: sortedKeys(rep), Selection: sortedKeys(sel)}
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
