package discovery

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/rs/zerolog"
	discoveryv1 "k8s.io/api/discovery/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
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
	// RetryInterval is the wait before retrying a failed sync (a failed list or registration)
	// when no slice event comes first; it doubles up to 30 s. 0 = 1 s.
	RetryInterval time.Duration
	// Logger receives membership changes.
	Logger zerolog.Logger
}

// peerRetryMax bounds the backoff of failed peer syncs.
const peerRetryMax = 30 * time.Second

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
// API — are never deregistered by it). POD_IP is excluded. Every endpoint a slice lists is a
// replica-sync peer, ready or not (a draining or briefly unready replica still holds bookings);
// only ready ones are recovery peers (Selection).
//
// It reads through a controller-runtime client.Reader: the shared informer cache of the process's
// Kube (Kube.WatchPeers triggers it on every slice event and once the cache has synced), or a fake
// client in tests. Build it with NewPeerWatcher, call Start once, and Close when done; Sync may
// also be called directly. Safe for concurrent use.
type PeerWatcher struct {
	cfg    PeerConfig
	reader client.Reader
	sink   PeerSink

	trigger  chan struct{}
	synced   chan struct{} // closed after the first Sync that listed the slices
	syncOnce sync.Once
	done     chan struct{} // closed when the loop ended

	runMu  sync.Mutex
	cancel context.CancelFunc // the loop's, nil before Start
	closed bool

	mu    sync.Mutex      // held for a whole Sync
	owned map[string]bool // replica endpoints this watcher registered
	last  Peers

	noteMu   sync.Mutex
	waitNote string // why the cache cannot be read yet (set by Kube.WatchPeers)
	syncErr  string // the latest failed sync ("" after a successful one)
}

// NewPeerWatcher returns a watcher that reads EndpointSlices through reader (the shared cache's
// reader, or a fake client in tests) and drives sink. Errors: an empty Namespace or Service, a
// nil reader or sink.
func NewPeerWatcher(cfg PeerConfig, reader client.Reader, sink PeerSink) (*PeerWatcher, error) {
	if cfg.Namespace == "" || cfg.Service == "" {
		return nil, fmt.Errorf("peer discovery needs a namespace and a service (got %q, %q)", cfg.Namespace, cfg.Service)
	}
	if reader == nil || sink == nil {
		return nil, errors.New("peer discovery needs a Kubernetes reader and a peer sink")
	}
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = time.Second
	}
	return &PeerWatcher{cfg: cfg, reader: reader, sink: sink, owned: map[string]bool{},
		trigger: make(chan struct{}, 1), synced: make(chan struct{}), done: make(chan struct{})}, nil
}

// Trigger asks for a sync. Calls coalesce (at most one is queued) and never block; informer event
// handlers call it.
func (w *PeerWatcher) Trigger() {
	select {
	case w.trigger <- struct{}{}:
	default:
	}
}

// Start starts the watcher's loop and returns at once: each Trigger runs a Sync, and a failed Sync
// is retried after RetryInterval (doubling up to 30 s) unless a trigger comes first. The loop runs
// until ctx ends or Close is called. Errors: a second Start.
func (w *PeerWatcher) Start(ctx context.Context) error {
	w.runMu.Lock()
	defer w.runMu.Unlock()
	if w.cancel != nil || w.closed {
		return errors.New("peer discovery already started or closed")
	}
	runCtx, cancel := context.WithCancel(ctx)
	w.cancel = cancel
	go w.loop(runCtx)
	return nil
}

// Close stops the loop and waits for it; the registered peers stay registered (the process is
// exiting). Safe to call more than once, and before Start (which then fails).
func (w *PeerWatcher) Close() error {
	w.runMu.Lock()
	cancel, first := w.cancel, !w.closed
	w.closed = true
	w.runMu.Unlock()
	if cancel != nil && first {
		cancel()
	}
	if cancel != nil {
		<-w.done
	}
	return nil
}

func (w *PeerWatcher) loop(ctx context.Context) {
	defer close(w.done)
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	defer retry.Stop()
	backoff := w.cfg.RetryInterval
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.trigger:
		case <-retry.C:
		}
		_, err := w.Sync(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			w.cfg.Logger.Warn().Err(err).Dur("retry_in", backoff).Msg("peer discovery sync failed; will retry")
			retry.Reset(backoff)
			backoff = min(2*backoff, max(peerRetryMax, w.cfg.RetryInterval))
			continue
		}
		retry.Stop()
		backoff = w.cfg.RetryInterval
	}
}

// WaitSynced blocks until the first Sync that listed the peer Service's slices (with the shared
// cache: the first one after it synced) and returns the peers it saw — a starting replica's
// recovery peers (epp.md §11.1 step 4). Errors: ctx's, when it ends first.
func (w *PeerWatcher) WaitSynced(ctx context.Context) (Peers, error) {
	select {
	case <-w.synced:
		return w.Last(), nil
	case <-ctx.Done():
		return Peers{}, ctx.Err()
	}
}

// SetWaitingFor records why the slices cannot be listed yet ("" = they can); Problem reports it.
func (w *PeerWatcher) SetWaitingFor(note string) {
	w.noteMu.Lock()
	w.waitNote = note
	w.noteMu.Unlock()
}

// Problem says why the watcher has not synced or why its latest sync failed ("" = none): the
// cache's list/watch problem (missing RBAC) before the first listing, then the sync error.
func (w *PeerWatcher) Problem() string {
	w.noteMu.Lock()
	defer w.noteMu.Unlock()
	if w.syncErr != "" {
		return w.syncErr
	}
	select {
	case <-w.synced: // listed: what the cache said before is stale
		return ""
	default:
		return w.waitNote
	}
}

func (w *PeerWatcher) setSyncErr(err error) {
	w.noteMu.Lock()
	w.syncErr = ""
	if err != nil {
		w.syncErr = err.Error()
	}
	w.noteMu.Unlock()
}

// Sync lists the peer Service's EndpointSlices, applies the difference to the sink and returns
// the peers now seen. A register error is returned after the rest was applied (the loop retries
// with backoff); so is a failed list, which changes nothing.
func (w *PeerWatcher) Sync(ctx context.Context) (peers Peers, err error) {
	w.mu.Lock() // one sync at a time, so an older listing never overwrites a newer one
	defer w.mu.Unlock()
	defer func() { w.setSyncErr(err) }()
	var list discoveryv1.EndpointSliceList
	if err := w.reader.List(ctx, &list, client.InNamespace(w.cfg.Namespace),
		client.MatchingLabels{discoveryv1.LabelServiceName: w.cfg.Service}); err != nil {
		return Peers{}, fmt.Errorf("list EndpointSlices of service %s/%s: %w", w.cfg.Namespace, w.cfg.Service, err)
	}
	peers = w.peersOf(list.Items)
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
	w.syncOnce.Do(func() { close(w.synced) })
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
			// Every listed replica is followed, ready or not: one that is draining
			// (terminating) still publishes the Free events of its last streams, and one that
			// failed a readiness probe or two still holds its bookings — deregistering it would
			// release their mirrors here and under-count its load once it is ready again. It
			// leaves when it leaves the slice (then the manager releases its mirrors). Only a
			// ready replica serves the recovery dump.
			ready := ep.Conditions.Ready == nil || *ep.Conditions.Ready
			for _, addr := range ep.Addresses {
				if addr == "" || addr == w.cfg.PodIP {
					continue
				}
				rep["tcp://"+net.JoinHostPort(addr, strconv.Itoa(rport))] = true
				if ready {
					sel["http://"+net.JoinHostPort(addr, strconv.Itoa(hport))] = true
				}
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
