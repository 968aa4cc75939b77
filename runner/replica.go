package runner

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/ledger/replica"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/discovery"
	"github.com/kvepp/kvepp/picker/httpapi"
)

// DefaultReplicaSyncPort is DYN_EPP_REPLICA_SYNC_PORT's default (epp.md §1).
const DefaultReplicaSyncPort = 9092

// OptPort is an optional port setting: Set is false when the variable is unset or empty.
type OptPort struct {
	// Set is true when a value was given.
	Set bool
	// Value is the port (0 = ephemeral); meaningful only when Set.
	Value int
}

// UnmarshalText implements encoding.TextUnmarshaler; the value must be an integer in 0..65535.
func (o *OptPort) UnmarshalText(text []byte) error {
	s := strings.TrimSpace(string(text))
	if s == "" {
		*o = OptPort{}
		return nil
	}
	v, err := strconv.Atoi(s)
	if err != nil || v < 0 || v > 65535 {
		return errors.New("must be a port in 0..65535")
	}
	*o = OptPort{Set: true, Value: v}
	return nil
}

// String renders the port, or "" when unset.
func (o OptPort) String() string {
	if !o.Set {
		return ""
	}
	return strconv.Itoa(o.Value)
}

// ReplicaSyncEnabled reports whether replica sync runs (epp.md §2, §11.2): when
// DYN_EPP_REPLICA_SYNC_PORT, DYN_EPP_REPLICA_SYNC_PEERS or DYN_EPP_PEER_SERVICE is set. Without
// them the EPP is a single replica and the /replica_sync routes answer "replica sync is disabled".
func (c *Config) ReplicaSyncEnabled() bool {
	return c.ReplicaSyncPort.Set || len(c.ReplicaSyncPeers) > 0 || c.PeerService != ""
}

// replicaSyncPort is the effective replica-sync port.
func (c *Config) replicaSyncPort() int {
	if c.ReplicaSyncPort.Set {
		return c.ReplicaSyncPort.Value
	}
	return DefaultReplicaSyncPort
}

// validateReplicaSync checks the replica-sync and peer settings: peers are valid endpoints
// (selection-service.md §15.5), a peer service needs POD_NAMESPACE and POD_IP, and the port is
// not another listener's.
func (c *Config) validateReplicaSync() error {
	for _, p := range c.ReplicaSyncPeers {
		if err := httpapi.ValidateReplicaEndpoint(p); err != nil {
			return c.invalid("DYN_EPP_REPLICA_SYNC_PEERS", strings.Join(c.ReplicaSyncPeers, ","), "%v", err)
		}
	}
	if c.PeerService != "" {
		if c.PodNamespace == "" {
			return c.invalid("POD_NAMESPACE", "", "is required with DYN_EPP_PEER_SERVICE")
		}
		if c.PodIP == "" {
			return c.invalid("POD_IP", "", "is required with DYN_EPP_PEER_SERVICE (the own address is excluded from the peers)")
		}
	}
	if !c.ReplicaSyncEnabled() {
		return nil
	}
	port := c.replicaSyncPort()
	for key, v := range map[string]int{"DYN_EPP_GRPC_PORT": c.GRPCPort, "DYN_EPP_GRPC_HEALTH_PORT": c.GRPCHealthPort,
		"DYN_EPP_SELECTION_HTTP_PORT": c.SelectionHTTPPort, "DYN_EPP_METRICS_PORT": c.MetricsPort} {
		if port != 0 && v == port {
			return c.invalid("DYN_EPP_REPLICA_SYNC_PORT", port, "port is already used by %s", c.name(key))
		}
	}
	return nil
}

// newRouterID returns a random non-zero 64-bit replica id (selection-service.md §15.2 router_id,
// also the session-binding writer_id of §12.1).
func newRouterID() uint64 {
	var b [8]byte
	for {
		if _, err := rand.Read(b[:]); err != nil {
			b = [8]byte{}
			binary.LittleEndian.PutUint64(b[:], uint64(time.Now().UnixNano()))
		}
		if id := binary.LittleEndian.Uint64(b[:]); id != 0 {
			return id
		}
	}
}

// replicaSync is the running replica mesh of an Instance and its peer discovery.
type replicaSync struct {
	m *replica.Manager
	// watcher is peer discovery (nil without DYN_EPP_PEER_SERVICE); the shared Kubernetes cache
	// it reads belongs to the Instance.
	watcher *discovery.PeerWatcher
}

// bindReplicaSync binds the replica PUB socket (epp.md §11.1 step 2) when replica sync is enabled
// and wires the core's publishers and writer id into pcfg; nil when disabled.
func bindReplicaSync(cfg Config, pcfg *picker.Config, log zerolog.Logger) (*replicaSync, error) {
	if !cfg.ReplicaSyncEnabled() {
		return nil, nil
	}
	host := cfg.BindAddress
	if host == "" {
		host = "*"
	}
	bind := "tcp://" + net.JoinHostPort(host, strconv.Itoa(cfg.replicaSyncPort()))
	id := newRouterID()
	m, err := replica.New(replica.Config{Bind: bind, RouterID: id, Peers: cfg.ReplicaSyncPeers,
		Logger: log.With().Str("component", "replica").Logger()})
	if err != nil {
		return nil, fmt.Errorf("%s %d: %w", cfg.name("DYN_EPP_REPLICA_SYNC_PORT"), cfg.replicaSyncPort(), err)
	}
	pub := replicaPublisher{m: m}
	pcfg.SlotPublisher, pcfg.AffinityPublisher, pcfg.ReplicaWriterID = pub, pub, id
	return &replicaSync{m: m}, nil
}

// addr is the bound PUB address ("" when disabled).
func (r *replicaSync) addr() string {
	if r == nil {
		return ""
	}
	return r.m.Addr()
}

// peers is the /replica_sync/* membership (nil when disabled, so the routes answer 409).
func (r *replicaSync) peers() httpapi.ReplicaPeers {
	if r == nil {
		return nil
	}
	return replicaPeers{m: r.m}
}

// discoverPeers starts peer-EPP discovery from the EndpointSlices of DYN_EPP_PEER_SERVICE (epp.md
// §10.4) on the process's shared Kubernetes cache, running until runCtx ends or close, and
// returns the selection URLs of the peers seen by the first sync: the recovery peers of epp.md
// §11.1 step 4. It waits for that sync at most DYN_EPP_RECOVERY_TIMEOUT_SECS (at least 1 s; ctx
// bounds it too) and otherwise starts without recovery peers, saying why (e.g. missing RBAC); the
// watch goes on. It returns nil without a peer service.
func (r *replicaSync) discoverPeers(ctx, runCtx context.Context, cfg Config, kube *discovery.Kube, log zerolog.Logger) ([]string, error) {
	if r == nil || cfg.PeerService == "" {
		return nil, nil
	}
	pc := discovery.PeerConfig{Namespace: cfg.PodNamespace, Service: cfg.PeerService, PodIP: cfg.PodIP,
		ReplicaPort: cfg.replicaSyncPort(), SelectionPort: cfg.SelectionHTTPPort, Logger: log.With().Str("component", "peer-discovery").Logger()}
	w, err := discovery.NewPeerWatcher(pc, kube.Reader(), replicaPeers{m: r.m})
	if err == nil {
		err = w.Start(runCtx)
	}
	if err == nil {
		r.watcher = w
		err = kube.WatchPeers(runCtx, w)
	}
	if err != nil {
		return nil, fmt.Errorf("%s %q: %w", cfg.name("DYN_EPP_PEER_SERVICE"), cfg.PeerService, err)
	}
	sctx, cancel := context.WithTimeout(ctx, max(cfg.RecoveryTimeout.Duration(), time.Second))
	defer cancel()
	peers, err := w.WaitSynced(sctx)
	if err != nil {
		log.Warn().Str("peer_service", cfg.PeerService).Str("reason", w.Problem()).
			Msg("peer EndpointSlices not listed in time; starting without recovery peers (the watch goes on)")
		return nil, nil
	}
	if p := w.Problem(); p != "" {
		log.Warn().Str("reason", p).Msg("peer discovery: first sync incomplete; retrying")
	}
	log.Info().Strs("replica_peers", peers.Replica).Strs("recovery_peers", peers.Selection).Msg("peer EPPs discovered")
	return peers.Selection, nil
}

// start connects the SUBs to the peers and applies their events to svc (epp.md §11.1 step 5).
func (r *replicaSync) start(svc *picker.Service) error {
	if r == nil {
		return nil
	}
	return r.m.Start(replicaApplier{svc: svc})
}

// close stops peer discovery and the replica sockets. Safe to call more than once.
func (r *replicaSync) close() error {
	if r == nil {
		return nil
	}
	if r.watcher != nil {
		_ = r.watcher.Close() // before the manager closes, so no sync registers on a closed one
	}
	return r.m.Close()
}

// replicaPublisher adapts *replica.Manager to picker.SlotPublisher and picker.AffinityPublisher.
type replicaPublisher struct{ m *replica.Manager }

var (
	_ picker.SlotPublisher     = replicaPublisher{}
	_ picker.AffinityPublisher = replicaPublisher{}
)

// PublishSlot implements picker.SlotPublisher.
func (p replicaPublisher) PublishSlot(key picker.PartitionKey, bs uint32, ev ledger.SlotEvent) {
	p.m.PublishSlot(replica.Partition(key), bs, ev)
}

// PublishAffinity implements picker.AffinityPublisher.
func (p replicaPublisher) PublishAffinity(key picker.PartitionKey, u ledger.AffinityUpdate) {
	p.m.PublishAffinity(replica.Partition(key), u)
}

// replicaApplier adapts *picker.Service to replica.Applier.
type replicaApplier struct{ svc *picker.Service }

var _ replica.Applier = replicaApplier{}

// HasPartition implements replica.Applier.
func (a replicaApplier) HasPartition(p replica.Partition) bool {
	return a.svc.HasPartition(picker.PartitionKey(p))
}

// remoteDrops maps the core's outcomes to the replica drop reasons.
var remoteDrops = map[picker.RemoteOutcome]replica.DropReason{
	picker.RemoteUnknownPartition:   replica.DropUnknownPartition,
	picker.RemoteBlockSizeMismatch:  replica.DropBlockSizeMismatch,
	picker.RemoteUnknownWorker:      replica.DropUnknownWorker,
	picker.RemoteUnknownRank:        replica.DropUnknownRank,
	picker.RemoteUnknownReservation: replica.DropUnknownReservation,
	picker.RemoteConflict:           replica.DropConflict,
	picker.RemoteInvalid:            replica.DropInvalid,
}

// ApplySlot implements replica.Applier.
func (a replicaApplier) ApplySlot(p replica.Partition, bs uint32, ev ledger.SlotEvent) (bool, replica.DropReason) {
	o := a.svc.ApplyRemoteSlot(picker.PartitionKey(p), bs, ev)
	if o == picker.RemoteApplied {
		return true, 0
	}
	if r, ok := remoteDrops[o]; ok {
		return false, r
	}
	return false, replica.DropInvalid
}

// ForgetReplica implements replica.Applier.
func (a replicaApplier) ForgetReplica(origin uint64) int { return a.svc.ForgetReplica(origin) }

// ApplyAffinity implements replica.Applier.
func (a replicaApplier) ApplyAffinity(p replica.Partition, u ledger.AffinityUpdate) bool {
	return a.svc.ApplyRemoteAffinity(picker.PartitionKey(p), u)
}

// replicaPeers adapts *replica.Manager to httpapi.ReplicaPeers and discovery.PeerSink, turning
// its errors into the picker kinds the HTTP API maps (selection-service.md §15.5: 404 "peer not
// found", 503 "replica peer manager is unavailable").
type replicaPeers struct{ m *replica.Manager }

var (
	_ httpapi.ReplicaPeers = replicaPeers{}
	_ discovery.PeerSink   = replicaPeers{}
)

func peerError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, replica.ErrPeerNotFound):
		return picker.Errorf(picker.KindNotFound, "peer not found")
	case errors.Is(err, replica.ErrClosed):
		return picker.Errorf(picker.KindNotReady, "replica peer manager is unavailable")
	case errors.Is(err, replica.ErrTooManyPeers):
		return picker.Errorf(picker.KindBadRequest, "%v", err)
	}
	return picker.Errorf(picker.KindInternal, "%v", err)
}

// RegisterPeer implements httpapi.ReplicaPeers.
func (p replicaPeers) RegisterPeer(ep string) (bool, error) {
	added, err := p.m.RegisterPeer(ep)
	return added, peerError(err)
}

// DeregisterPeer implements httpapi.ReplicaPeers.
func (p replicaPeers) DeregisterPeer(ep string) error { return peerError(p.m.DeregisterPeer(ep)) }

// Peers implements httpapi.ReplicaPeers.
func (p replicaPeers) Peers() []string { return p.m.Peers() }
