package kvevents

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/kvindex"
)

// Sink receives the index events of listeners (a *kvindex.Index satisfies it). Apply is called
// from one goroutine per (worker, dp_rank) listener, in arrival order for that listener, and
// concurrently for different listeners; an error is counted in Stats.SinkErrors and logged, never
// fatal.
type Sink interface {
	Apply(ev kvindex.Event) error
}

var _ Sink = (*kvindex.Index)(nil)

// WorkerSpec describes one worker's KV event sources (kv-events-index.md §5, selection-service.md
// §4.1).
type WorkerSpec struct {
	// WorkerID is the service-wide worker id.
	WorkerID uint64
	// BlockSize is the registered KV block size in tokens (> 0); stores with another block_size
	// are dropped (§9).
	BlockSize int
	// IsEagle selects Eagle (bigram) hashing (§1.4).
	IsEagle bool
	// DPStartRank and DPSize give the worker's global ranks [DPStartRank, DPStartRank+DPSize);
	// DPSize must be > 0.
	DPStartRank, DPSize uint32
	// Endpoints maps each global rank to its ZMQ PUB endpoint (tcp://host:port, ipc://path or
	// inproc://name).
	Endpoints map[uint32]string
	// Endpoint is a base endpoint for ranks missing from Endpoints: used as is when DPSize is 1,
	// otherwise offset per rank r like engines do (tcp port + r, ipc/inproc "_dp{r}"; §5.1).
	Endpoint string
	// ReplayEndpoint is the ROUTER replay endpoint (§6), "" for none; with DPSize > 1 it is
	// offset per rank like Endpoint.
	ReplayEndpoint string
}

// ManagerConfig configures a Manager. Zero durations and limits take the defaults.
type ManagerConfig struct {
	// Logger receives the listeners' logs (gaps, restarts, drops); the zero value discards.
	Logger zerolog.Logger
	// ReplayTimeout bounds one replay request until its END marker (§6); default 5 s.
	ReplayTimeout time.Duration
	// QueueLimit is the number of received batches a listener buffers before dropping new ones
	// (its receive high-water mark, §5.2); default 100,000.
	QueueLimit int
	// ReconnectMinBackoff and ReconnectMaxBackoff bound the exponential backoff between dial
	// attempts to an unreachable or vanished publisher; defaults 100 ms and 5 s.
	ReconnectMinBackoff, ReconnectMaxBackoff time.Duration
	// DialTimeout bounds one TCP connect attempt; default 5 s.
	DialTimeout time.Duration
	// RejectLogInterval is the least time between two info-level logs of events the index
	// rejected (an unknown parent block, say), per rank; the log line counts every rejection of the
	// rank so far. Default DefaultRejectLogInterval.
	RejectLogInterval time.Duration
}

// DefaultRejectLogInterval is ManagerConfig.RejectLogInterval's default: 10 s.
const DefaultRejectLogInterval = 10 * time.Second

// Manager errors.
var (
	// ErrClosed is returned by Attach after Close.
	ErrClosed = errors.New("kv event manager is closed")
	// ErrInvalidSpec is wrapped by Attach for a spec with block size 0, DP size 0 or a nil sink.
	ErrInvalidSpec = errors.New("invalid kv event worker spec")
)

// worker is the Manager's record of one attached worker.
type worker struct {
	spec      WorkerSpec
	sink      Sink
	notes     *workerNotes
	listeners map[uint32]*listener
}

// Manager runs the KV event listeners of all attached workers: one SUB listener per
// (worker, dp_rank), each applying its events to the worker's Sink in arrival order
// (kv-events-index.md §13, §16). All methods are safe for concurrent use; Attach, Detach and
// Close are serialized.
type Manager struct {
	cfg   ManagerConfig
	log   zerolog.Logger
	stats counters

	mu      sync.Mutex
	workers map[uint64]*worker
	closed  bool

	holdMu sync.Mutex
	hold   chan struct{} // non-nil while events are held; closed on release
}

// NewManager returns a Manager with no workers.
func NewManager(cfg ManagerConfig) *Manager {
	if cfg.ReplayTimeout <= 0 {
		cfg.ReplayTimeout = 5 * time.Second
	}
	if cfg.QueueLimit <= 0 {
		cfg.QueueLimit = 100_000
	}
	if cfg.ReconnectMinBackoff <= 0 {
		cfg.ReconnectMinBackoff = 100 * time.Millisecond
	}
	if cfg.ReconnectMaxBackoff < cfg.ReconnectMinBackoff {
		cfg.ReconnectMaxBackoff = max(5*time.Second, cfg.ReconnectMinBackoff)
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 5 * time.Second
	}
	if cfg.RejectLogInterval <= 0 {
		cfg.RejectLogInterval = DefaultRejectLogInterval
	}
	return &Manager{
		cfg:     cfg,
		log:     cfg.Logger.With().Str("component", "kvevents").Logger(),
		workers: make(map[uint64]*worker),
	}
}

// Attach starts listening to spec's endpoints and applying their events to sink, or reconciles
// an attached worker rank by rank (selection-service.md §4.2): a rank whose endpoint, replay
// endpoint, block size, Eagle flag and sink are unchanged keeps its listener, watermark and blocks;
// a changed rank's old listener is stopped, its blocks are cleared from the old sink with a
// Cleared event, and a new listener starts with a fresh watermark; ranks that left the range are
// stopped and cleared. Listeners connect in the background, so an unreachable publisher is not an
// error.
//
// Errors (nothing is changed and no listener is left running): ErrClosed; ErrInvalidSpec for
// block size 0, DP size 0 or a nil sink; ErrMissingEndpoint for a rank without endpoint; and
// "invalid kv_events endpoint for worker W dp_rank R: …" / "invalid replay endpoint for worker W
// dp_rank R: …" for endpoints ValidateEndpoint rejects.
func (m *Manager) Attach(spec WorkerSpec, sink Sink) error {
	if spec.BlockSize <= 0 {
		return fmt.Errorf("%w: worker %d: block_size %d must be greater than 0", ErrInvalidSpec, spec.WorkerID, spec.BlockSize)
	}
	if spec.DPSize == 0 {
		return fmt.Errorf("%w: worker %d: data_parallel_size must be greater than 0", ErrInvalidSpec, spec.WorkerID)
	}
	if uint64(spec.DPStartRank)+uint64(spec.DPSize) > 1<<32 {
		return fmt.Errorf("%w: worker %d: ranks [%d, %d+%d) overflow u32", ErrInvalidSpec, spec.WorkerID,
			spec.DPStartRank, spec.DPStartRank, spec.DPSize)
	}
	if sink == nil {
		return fmt.Errorf("%w: worker %d: nil sink", ErrInvalidSpec, spec.WorkerID)
	}
	eps, err := spec.resolveEndpoints()
	if err != nil {
		return err
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ErrClosed
	}
	old := m.workers[spec.WorkerID]
	w := &worker{spec: spec, sink: sink, listeners: make(map[uint32]*listener, len(eps))}
	if old != nil {
		w.notes = old.notes
	} else {
		w.notes = &workerNotes{}
	}

	// Plan: keep identical ranks, build new listeners for the rest. Nothing can fail after this.
	var fresh []*listener
	kept := make(map[*listener]bool)
	for _, r := range sortedRanks(eps) {
		cfg := listenerConfig{workerID: spec.WorkerID, rank: r, endpoints: eps[r], blockSize: spec.BlockSize,
			eagle: spec.IsEagle, sink: sink}
		if old != nil {
			if l := old.listeners[r]; l != nil && l.cfg.sameAs(cfg) {
				l.setRankRange(spec.DPStartRank, spec.DPSize)
				w.listeners[r] = l
				kept[l] = true
				continue
			}
		}
		l := newListener(m, cfg, w.notes, spec.DPStartRank, spec.DPSize)
		w.listeners[r] = l
		fresh = append(fresh, l)
	}

	// Stop and clear replaced ranks and ranks that left, before their successors start, so a
	// Cleared event never lands after a new listener's first store.
	if old != nil {
		for _, r := range sortedRanks(old.listeners) {
			l := old.listeners[r]
			if kept[l] {
				continue
			}
			l.stop()
			m.applyClear(l.cfg.sink, spec.WorkerID, r, 0)
			m.log.Info().Uint64("worker_id", spec.WorkerID).Uint32("dp_rank", r).
				Msg("KV event endpoint changed or rank left; cleared the rank's blocks")
		}
	}
	for _, l := range fresh {
		l.start()
	}
	m.workers[spec.WorkerID] = w
	return nil
}

// sameAs reports whether a running listener with config c can serve d unchanged.
func (c listenerConfig) sameAs(d listenerConfig) bool {
	return c.workerID == d.workerID && c.rank == d.rank && c.endpoints == d.endpoints &&
		c.blockSize == d.blockSize && c.eagle == d.eagle && sameSink(c.sink, d.sink)
}

// sameSink compares two sinks by identity; sinks of non-comparable dynamic types are different.
func sameSink(a, b Sink) (same bool) {
	defer func() {
		if recover() != nil {
			same = false
		}
	}()
	return a == b
}

func sortedRanks[V any](m map[uint32]V) []uint32 {
	rs := make([]uint32, 0, len(m))
	for r := range m {
		rs = append(rs, r)
	}
	sort.Slice(rs, func(i, j int) bool { return rs[i] < rs[j] })
	return rs
}

// applyClear applies a Cleared event for (worker, rank) to sink and counts it.
func (m *Manager) applyClear(sink Sink, workerID uint64, rank uint32, eventID uint64) {
	m.stats.ranksCleared.Add(1)
	ev := kvindex.Event{WorkerID: workerID, DPRank: rank, Tier: kvindex.TierDevice, EventID: eventID, Kind: kvindex.EventCleared}
	if err := sink.Apply(ev); err != nil {
		m.stats.sinkErrors[sinkErrorKind(err)].Add(1)
		m.log.Warn().Err(err).Uint64("worker_id", workerID).Uint32("dp_rank", rank).Msg("index rejected Cleared event")
	}
}

// Detach stops the worker's listeners and waits for them to exit. It does not touch the index
// (the caller removes the worker's rows, e.g. with kvindex.Index.RemoveWorker). Unknown ids are
// ignored.
func (m *Manager) Detach(workerID uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	w := m.workers[workerID]
	if w == nil {
		return
	}
	delete(m.workers, workerID)
	stopAll(w)
}

func stopAll(w *worker) {
	var wg sync.WaitGroup
	for _, l := range w.listeners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l.stop()
		}()
	}
	wg.Wait()
}

// Close stops every listener and makes further Attach calls fail with ErrClosed. It is
// idempotent and always returns nil.
func (m *Manager) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	for id, w := range m.workers {
		stopAll(w)
		delete(m.workers, id)
	}
	return nil
}

// HoldEvents makes every listener, current and future, buffer received batches instead of
// applying them, for startup recovery (kv-events-index.md §16, epp.md §11.1): the index is being
// filled from a peer snapshot and live events must land after it. Buffers are bounded by
// ManagerConfig.QueueLimit per listener. Calling it while already holding has no effect.
func (m *Manager) HoldEvents() {
	m.holdMu.Lock()
	defer m.holdMu.Unlock()
	if m.hold == nil {
		m.hold = make(chan struct{})
	}
}

// ReleaseEvents ends HoldEvents: listeners apply their buffered batches in order, then continue
// live. bootstrapped reports that the index was restored from a peer snapshot; listeners that
// exist now then accept their first sequence number as the watermark instead of replaying from 0
// (§13). Without a hold it has no effect.
func (m *Manager) ReleaseEvents(bootstrapped bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.holdMu.Lock()
	defer m.holdMu.Unlock()
	if m.hold == nil {
		return
	}
	if bootstrapped {
		for _, w := range m.workers {
			for _, l := range w.listeners {
				l.bootstrapped.Store(true)
			}
		}
	}
	close(m.hold)
	m.hold = nil
}

// holdGate returns the channel a listener waits on while events are held, or nil.
func (m *Manager) holdGate() chan struct{} {
	m.holdMu.Lock()
	defer m.holdMu.Unlock()
	return m.hold
}

// Stats returns a snapshot of the counters, summed over all listeners since NewManager.
func (m *Manager) Stats() Stats {
	return m.stats.snapshot()
}

// ListenerState describes one (worker, dp_rank) listener for inspection.
type ListenerState struct {
	// Endpoint and ReplayEndpoint are the resolved endpoints ("" without replay).
	Endpoint, ReplayEndpoint string
	// Started reports whether a batch has been applied; NextSeq is then the sequence number
	// expected next (the watermark). Both are published after the batch's events reached the
	// sink, so NextSeq == s+1 means batch s is fully applied.
	Started bool
	NextSeq uint64
}

// Listener returns the state of the listener of (workerID, rank), or false when there is none.
func (m *Manager) Listener(workerID uint64, rank uint32) (ListenerState, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	w := m.workers[workerID]
	if w == nil || w.listeners[rank] == nil {
		return ListenerState{}, false
	}
	l := w.listeners[rank]
	return ListenerState{
		Endpoint:       l.cfg.endpoints.events,
		ReplayEndpoint: l.cfg.endpoints.replay,
		Started:        l.hasStarted.Load(),
		NextSeq:        l.next.Load(),
	}, true
}
