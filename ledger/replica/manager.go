// Package replica is kvepp's replica sync (selection-service.md §15, epp.md §11.2): best-effort
// sharing of booking admissions, prefill completions, frees and session-affinity bindings between
// selector replicas over ZeroMQ PUB/SUB, with dynamic peer membership (§15.5).
//
// A Manager binds one PUB socket and keeps one SUB socket per peer, subscribed to
// dynamo.slot-tracker.v1 and dynamo.session-affinity.v1. Published events go through bounded
// outbound queues (100,000 slot events, 4,096 bindings; full → the newest is dropped and counted)
// to one sender goroutine, and from it to one bounded queue and writer per subscribed peer.
// Received events are decoded, this replica's own events and unknown partitions are dropped, and
// the rest go through a bounded queue per partition (100,000; full → dropped) to that partition's
// applier, which applies them to the local core (the Applier: the worker, rank, block-size and
// reservation checks are its own). Nothing is sequenced,
// acknowledged, replayed or resynchronized: loss, delay and reordering are accepted, and every
// drop is counted by reason. Output blocks, expiry, the KV index and the worker catalog are not
// synchronized (§15.4).
package replica

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/ledger"
)

// Defaults of Config (selection-service.md §15.1, §15.4).
const (
	DefaultOutboundCapacity         = 100_000
	DefaultAffinityOutboundCapacity = 4096
	DefaultInboundCapacity          = 100_000
	DefaultReconnectMin             = 100 * time.Millisecond
	DefaultReconnectMax             = 5 * time.Second
	DefaultDialTimeout              = 5 * time.Second
	// DefaultFreedWindow is how long a free of an id that was not live is remembered, so an
	// admission it overtook (sent by another peer) is not mirrored and leaked until expiry.
	DefaultFreedWindow = 10 * time.Second
	// maxFreedPerPartition bounds those remembered frees per partition.
	maxFreedPerPartition = 16_384
)

// Errors of the peer routes; test with errors.Is.
var (
	// ErrPeerNotFound: DeregisterPeer of an endpoint that is not registered.
	ErrPeerNotFound = errors.New("peer not found")
	// ErrClosed: the manager was closed.
	ErrClosed = errors.New("replica peer manager is unavailable")
	// ErrTooManyPeers: RegisterPeer when MaxPeers peers are registered.
	ErrTooManyPeers = fmt.Errorf("too many replica peers (the limit is %d)", MaxPeers)
)

// MaxPeers bounds the registered peers (each is a SUB socket and a goroutine that keeps
// re-dialling): far more EPP replicas than any pool runs.
const MaxPeers = 256

// Applier is the local core received events are applied to (the picker's selection service,
// adapted by the composition root). Its methods are called from one goroutine per partition.
type Applier interface {
	// HasPartition reports whether partition p exists here; events of other partitions are
	// dropped before they are queued.
	HasPartition(p Partition) bool
	// ApplySlot applies one peer's booking event of partition p (block size bs tokens). applied
	// false comes with the reason it was dropped (DropBlockSizeMismatch, DropUnknownWorker,
	// DropUnknownRank, DropUnknownReservation, DropConflict, DropInvalid, DropUnknownPartition).
	ApplySlot(p Partition, bs uint32, ev ledger.SlotEvent) (applied bool, reason DropReason)
	// ApplyAffinity applies one peer's session binding (§12.1 apply rules) and reports whether
	// the local table changed.
	ApplyAffinity(p Partition, u ledger.AffinityUpdate) bool
	// ForgetReplica releases every booking mirrored from the replica with router_id origin and
	// returns how many; the manager calls it when the peer that replica published on is
	// deregistered (it left: drained, scaled down or died).
	ForgetReplica(origin uint64) int
}

// Config configures a Manager.
type Config struct {
	// Bind is the PUB endpoint, e.g. "tcp://*:9092" (port 0 = ephemeral; see Manager.Addr).
	Bind string
	// RouterID is this replica's router_id and affinity writer_id: random, non-zero, chosen at
	// startup. Events carrying it are this replica's own and are dropped on receipt.
	RouterID uint64
	// Peers are the configured peer PUB endpoints (--replica-sync-peers), already validated.
	Peers []string
	// OutboundCapacity bounds queued slot events (0 = DefaultOutboundCapacity).
	OutboundCapacity int
	// AffinityOutboundCapacity bounds queued bindings (0 = DefaultAffinityOutboundCapacity).
	AffinityOutboundCapacity int
	// InboundCapacity bounds each partition's received, not yet applied events
	// (0 = DefaultInboundCapacity).
	InboundCapacity int
	// ReconnectMin and ReconnectMax bound the re-dial backoff of a peer (0 = 100 ms and 5 s).
	ReconnectMin, ReconnectMax time.Duration
	// DialTimeout bounds one TCP connect to a peer (0 = DefaultDialTimeout).
	DialTimeout time.Duration
	// FreedWindow is how long a free of a non-live id is remembered (0 = DefaultFreedWindow).
	FreedWindow time.Duration
	// Logger receives peer and drop diagnostics.
	Logger zerolog.Logger
	// Now is the clock of the lag histograms and remembered frees (nil = time.Now).
	Now func() time.Time
}

func (c *Config) defaults() {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.OutboundCapacity, DefaultOutboundCapacity)
	def(&c.AffinityOutboundCapacity, DefaultAffinityOutboundCapacity)
	def(&c.InboundCapacity, DefaultInboundCapacity)
	defDur := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	defDur(&c.ReconnectMin, DefaultReconnectMin)
	defDur(&c.ReconnectMax, DefaultReconnectMax)
	defDur(&c.DialTimeout, DefaultDialTimeout)
	defDur(&c.FreedWindow, DefaultFreedWindow)
	if c.Now == nil {
		c.Now = time.Now
	}
}

// quietZMQ silences zmq4's own logging; the manager logs through zerolog.
var quietZMQ = log.New(io.Discard, "", 0)

var (
	slotTopic     = []byte(TopicSlotTracker)
	affinityTopic = []byte(TopicSessionAffinity)
)

type outSlot struct {
	msg SlotMessage
	at  time.Time
}

type outAffinity struct {
	msg AffinityMessage
	at  time.Time
}

// Manager is one replica's sync mesh. Build it with New (which binds the PUB socket), start the
// receive side with Start, stop everything with Close. All methods are safe for concurrent use.
type Manager struct {
	cfg  Config
	log  zerolog.Logger
	pub  *publisher
	addr string

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	slotOut *fifo[outSlot]
	affOut  *fifo[outAffinity]

	mu      sync.Mutex
	peers   map[string]*peer
	applier Applier
	started bool
	closed  bool

	inMu    sync.Mutex
	inboxes map[Partition]*inbox

	departMu sync.Mutex
	departed map[uint64]time.Time // router_id → when its peer was deregistered

	c         counters
	connected atomic.Int64
	// sending counts the events the sender took from the queues and has not written yet.
	sending atomic.Int64
	warned  [NumDropReasons]atomic.Int64 // unix nanos of the last warning per reason
}

// New validates cfg, binds the PUB socket (selection-service.md §16 step 2) and starts the
// sender. Errors: a zero RouterID, an empty Bind, or the bind failing (naming the endpoint).
func New(cfg Config) (*Manager, error) {
	m, err := newUnstarted(cfg)
	if err != nil {
		return nil, err
	}
	m.wg.Add(1)
	go m.sendLoop()
	return m, nil
}

// newUnstarted is New without the sender goroutine (tests fill the outbound queues with it).
func newUnstarted(cfg Config) (*Manager, error) {
	cfg.defaults()
	if cfg.RouterID == 0 {
		return nil, errors.New("replica sync: router_id must not be 0")
	}
	if cfg.Bind == "" {
		return nil, errors.New("replica sync: no bind endpoint")
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &Manager{
		cfg: cfg, log: cfg.Logger, ctx: ctx, cancel: cancel,
		slotOut: newFIFO[outSlot](cfg.OutboundCapacity), affOut: newFIFO[outAffinity](cfg.AffinityOutboundCapacity),
		peers: map[string]*peer{}, inboxes: map[Partition]*inbox{},
	}
	pub, err := listenPub(cfg.Bind, func() { m.drop(DropSubscriberFull, "a replica peer is not keeping up; dropping its newest events") })
	if err != nil {
		cancel()
		return nil, fmt.Errorf("replica sync: bind %s: %w", cfg.Bind, err)
	}
	m.pub, m.addr = pub, pub.addr()
	for _, ep := range cfg.Peers {
		m.peers[ep] = &peer{endpoint: ep}
	}
	return m, nil
}

// Addr returns the PUB socket's bound address ("host:port").
//
// The PUB side is kvepp's own (pub.go, over zmq4's ZMTP connection layer): each subscriber has a
// bounded queue of its own, so a slow or stopped peer loses its newest events (counted as
// DropSubscriberFull) or, after a 15 s write timeout, its connection, and never delays the others.
func (m *Manager) Addr() string { return m.addr }

// RouterID returns this replica's router_id.
func (m *Manager) RouterID() uint64 { return m.cfg.RouterID }

// Start starts receiving: one SUB per peer registered so far (and per peer registered later),
// applying events to a (selection-service.md §16 step 5). Errors: ErrClosed, or a second call.
func (m *Manager) Start(a Applier) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case m.closed:
		return ErrClosed
	case m.started:
		return errors.New("replica sync: already started")
	}
	m.applier, m.started = a, true
	for _, p := range m.peers {
		m.startPeer(p)
	}
	m.log.Info().Str("bind", m.cfg.Bind).Str("addr", m.addr).Uint64("router_id", m.cfg.RouterID).
		Strs("peers", m.peersLocked()).Msg("replica sync started")
	return nil
}

// Close stops the sender, every SUB and applier, and closes the PUB socket. Events still queued
// are dropped (best effort). Later publishes are dropped as DropClosed. Idempotent.
func (m *Manager) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	peers := make([]*peer, 0, len(m.peers))
	for _, p := range m.peers {
		peers = append(peers, p)
	}
	m.mu.Unlock()
	m.slotOut.close()
	m.affOut.close()
	m.cancel()
	for _, p := range peers {
		p.stop()
	}
	m.wg.Wait()
	if err := m.pub.close(); err != nil && !errors.Is(err, net.ErrClosed) {
		return err
	}
	return nil
}

// PublishSlot queues a booking event of partition p (block size bs tokens) for the peers
// (§15.2); ev.Origin is set to this replica's router_id. It never blocks: a full queue drops the
// event (DropOutboundFull), as does a closed manager (DropClosed). ev.SequenceHashes is only read.
func (m *Manager) PublishSlot(p Partition, bs uint32, ev ledger.SlotEvent) {
	ev.Origin = m.cfg.RouterID
	m.pushed(m.slotOut.push(outSlot{msg: SlotMessage{Partition: p, BlockSize: bs, Event: ev}, at: m.cfg.Now()}))
}

// PublishAffinity queues a session binding of partition p for the peers (§15.3); its writer_id
// is u.Version.WriterID (the core's, equal to RouterID when the composition root wires them
// together). Never blocks; drops as PublishSlot.
func (m *Manager) PublishAffinity(p Partition, u ledger.AffinityUpdate) {
	m.pushed(m.affOut.push(outAffinity{msg: AffinityMessage{Partition: p, Update: u}, at: m.cfg.Now()}))
}

func (m *Manager) pushed(r pushResult) {
	switch r {
	case pushFull:
		m.drop(DropOutboundFull, "outbound replica queue full; dropping the newest event")
	case pushClosed:
		m.drop(DropClosed, "")
	}
}

// sendLoop writes queued events to the PUB socket until Close.
func (m *Manager) sendLoop() {
	defer m.wg.Done()
	var slots []outSlot
	var affs []outAffinity
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-m.slotOut.wake:
		case <-m.affOut.wake:
		}
		for m.ctx.Err() == nil {
			m.sending.Store(int64(m.slotOut.len() + m.affOut.len()))
			slots, affs = m.slotOut.swap(slots), m.affOut.swap(affs)
			m.sending.Store(int64(len(slots) + len(affs)))
			if len(slots) == 0 && len(affs) == 0 {
				break
			}
			for i := range slots {
				b, err := EncodeSlot(slots[i].msg)
				m.send(slotTopic, b, err, slots[i].at, &m.c.sentSlot)
			}
			for i := range affs {
				b, err := EncodeAffinity(affs[i].msg)
				m.send(affinityTopic, b, err, affs[i].at, &m.c.sentAffinity)
			}
		}
	}
}

func (m *Manager) send(topic, payload []byte, err error, at time.Time, sent *atomic.Uint64) {
	defer m.sending.Add(-1)
	if err != nil {
		m.log.Debug().Err(err).Str("topic", string(topic)).Msg("replica event not encoded")
		m.drop(DropMalformed, "")
		return
	}
	m.pub.publish(topic, payload)
	sent.Add(1)
	m.c.outboundLag.observe(m.cfg.Now().Sub(at))
}

// drop counts a dropped event; msg (when not empty) is logged as a warning at most every 10 s
// per reason, and at debug level otherwise.
func (m *Manager) drop(r DropReason, msg string) {
	m.c.dropped[r].Add(1)
	if msg == "" {
		return
	}
	now := m.cfg.Now().UnixNano()
	last := m.warned[r].Load()
	if now-last >= int64(10*time.Second) && m.warned[r].CompareAndSwap(last, now) {
		m.log.Warn().Str("reason", r.String()).Uint64("dropped_total", m.c.dropped[r].Load()).Msg(msg)
		return
	}
	m.log.Debug().Str("reason", r.String()).Msg(msg)
}

// RegisterPeer adds a peer PUB endpoint (selection-service.md §15.5; the caller validated it) and,
// once started, connects a SUB to it. added is false when it was already registered. Errors:
// ErrClosed.
func (m *Manager) RegisterPeer(endpoint string) (added bool, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return false, ErrClosed
	}
	if _, ok := m.peers[endpoint]; ok {
		return false, nil
	}
	if len(m.peers) >= MaxPeers {
		return false, ErrTooManyPeers
	}
	p := &peer{endpoint: endpoint}
	m.peers[endpoint] = p
	if m.started {
		m.startPeer(p)
	}
	m.log.Info().Str("peer", endpoint).Msg("replica peer registered")
	return true, nil
}

// DeregisterPeer removes a peer and closes its SUB. Errors: ErrPeerNotFound, ErrClosed.
func (m *Manager) DeregisterPeer(endpoint string) error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return ErrClosed
	}
	p, ok := m.peers[endpoint]
	if !ok {
		m.mu.Unlock()
		return ErrPeerNotFound
	}
	delete(m.peers, endpoint)
	m.mu.Unlock()
	p.stop()
	m.log.Info().Str("peer", endpoint).Msg("replica peer deregistered")
	m.forgetOriginsOf(p)
	return nil
}

// departedKeep is how long a departed replica's router_id stays remembered: longer than any
// event waits in an inbox.
const departedKeep = time.Minute

// forgetOriginsOf releases the mirrors of every replica that published through the deregistered
// peer p and that no other registered peer carries: that replica left (drained, scaled down or
// died), and its Free events may never arrive. Admissions from it received before now are
// dropped when they come up in an inbox (DropDepartedReplica).
func (m *Manager) forgetOriginsOf(p *peer) {
	origins := p.seenOrigins()
	if len(origins) == 0 {
		return
	}
	m.mu.Lock()
	a := m.applier
	for _, other := range m.peers {
		for _, o := range other.seenOrigins() {
			origins = slices.DeleteFunc(origins, func(x uint64) bool { return x == o })
		}
	}
	m.mu.Unlock()
	now := m.cfg.Now()
	m.departMu.Lock()
	if m.departed == nil {
		m.departed = map[uint64]time.Time{}
	}
	for o, at := range m.departed {
		if now.Sub(at) > departedKeep {
			delete(m.departed, o)
		}
	}
	for _, o := range origins {
		m.departed[o] = now
	}
	m.departMu.Unlock()
	if a == nil {
		return
	}
	for _, o := range origins {
		if n := a.ForgetReplica(o); n > 0 {
			m.log.Info().Str("peer", p.endpoint).Uint64("router_id", o).Int("bookings", n).
				Msg("released the bookings mirrored from a departed replica")
		}
	}
}

// departedBefore reports whether origin's peer was deregistered at or after at.
func (m *Manager) departedBefore(origin uint64, at time.Time) bool {
	m.departMu.Lock()
	defer m.departMu.Unlock()
	t, ok := m.departed[origin]
	return ok && !at.After(t)
}

// Peers returns the registered peer endpoints, sorted (never nil).
func (m *Manager) Peers() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.peersLocked()
}

func (m *Manager) peersLocked() []string {
	out := make([]string, 0, len(m.peers))
	for ep := range m.peers {
		out = append(out, ep)
	}
	slices.Sort(out)
	return out
}

// Stats returns the counters and gauges.
func (m *Manager) Stats() Stats {
	st := Stats{
		SentSlot: m.c.sentSlot.Load(), SentAffinity: m.c.sentAffinity.Load(),
		ReceivedSlot: m.c.receivedSlot.Load(), ReceivedAffinity: m.c.receivedAffinity.Load(),
		AppliedSlot: m.c.appliedSlot.Load(), AppliedAffinity: m.c.appliedAffinity.Load(),
		PeersConnected: int(m.connected.Load()), Subscribers: m.pub.subscribers(),
		OutboundQueued: m.slotOut.len() + m.affOut.len() + int(m.sending.Load()),
		OutboundLag:    m.c.outboundLag.snapshot(), InboundLag: m.c.inboundLag.snapshot(),
	}
	for i := range st.Dropped {
		st.Dropped[i] = m.c.dropped[i].Load()
	}
	m.mu.Lock()
	st.PeersConfigured = len(m.peers)
	m.mu.Unlock()
	m.inMu.Lock()
	for _, in := range m.inboxes {
		st.InboundQueued += in.q.len() + int(in.applying.Load())
	}
	m.inMu.Unlock()
	return st
}
