// Package picker is kvepp's selection service core (selection-service.md): the worker catalog and
// its partitions (model_name, routing_group), lifecycle and readiness, prompt normalisation,
// eligibility, the filter → scorer → picker policy pipeline, booking through the ledger, and the
// inspection queries. The HTTP API (picker/httpapi) and the Envoy ext_proc server (extproc) are thin
// shells over one *Service; in-process callers get *Error values whose Kind each shell maps to its
// own status codes.
package picker

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/policies"
)

// Service is one selection core: a process-wide worker catalog and reservation index (the ledger)
// plus one partition per (model_name, routing_group). All methods are safe for concurrent use.
// Selection and booking in one partition are serialized (selection-service.md §1); partitions run
// independently. Catalog mutations are serialized among themselves (§4.2).
type Service struct {
	cfg     Config
	log     zerolog.Logger
	now     func() time.Time
	ledger  *ledger.Ledger
	events  KVEventSource
	factory policies.PolicyFactory

	// catalogMu serializes catalog mutations (upsert, patch, delete) so lifecycle operations
	// commit in order and each sees the previous one's result (§4.2, acceptance 41).
	catalogMu sync.Mutex

	// mu guards workers and partitions (the maps, not the partitions' internals).
	mu         sync.RWMutex
	workers    map[uint64]*workerEntry
	partitions map[PartitionKey]*partition
	// byName indexes partitions by PartitionKey.String(), the ledger's Booking.Partition.
	byName map[string]*partition
	// queued counts the requests waiting in every partition's queue (§13).
	queued atomic.Int64

	schedulable      atomic.Int64 // number of schedulable workers catalog-wide
	shuttingDown     atomic.Bool
	deprecatedWarned atomic.Bool

	rngMu sync.Mutex
	rng   *rand.Rand // load-only picks

	// pending is the process-wide pending-selection cache (§11).
	pending *ledger.PendingCache
	// writerID is this replica's id in session-binding versions (§12.1).
	writerID uint64

	// withheld is the set of registered workers that are not candidates (SetCandidate, epp.md
	// §10.2); withheldMu serializes its copy-on-write updates.
	withheld   atomic.Pointer[withheldSet]
	withheldMu sync.Mutex
	// releases are the estimated prefill completions of PrefillUnobserved bookings.
	releases *prefillReleases
}

// New builds a Service from cfg. It validates the router settings and returns an error starting
// with "invalid KV router configuration: " naming the first bad setting (selection-service.md
// §16 step 1); KV events on without an EventSource is also an error.
func New(cfg Config) (*Service, error) {
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("invalid KV router configuration: %w", err)
	}
	if cfg.Router.UseKVEvents && cfg.EventSource == nil {
		return nil, fmt.Errorf("invalid KV router configuration: use_kv_events requires a KV event source")
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.RandSource == nil {
		cfg.RandSource = defaultRandSource
	}
	factory := cfg.Policy
	if factory == nil {
		factory = builtinFactory()
	}
	s := &Service{
		cfg:        cfg,
		log:        cfg.Logger,
		now:        cfg.Now,
		ledger:     ledger.New(ledger.Config{TrackActiveBlocks: cfg.Router.TrackActiveBlocks, MaxPrefillTokensPerSecond: PrefillRateCeilingFactor * cfg.AssumedPrefillTokensPerSecond}),
		factory:    factory,
		workers:    make(map[uint64]*workerEntry),
		partitions: make(map[PartitionKey]*partition),
		byName:     make(map[string]*partition),
		rng:        rand.New(cfg.RandSource()),
		pending:    ledger.NewPendingCache(cfg.SelectionCache),
		writerID:   cfg.ReplicaWriterID,
		releases:   newPrefillReleases(),
	}
	for s.writerID == 0 {
		s.writerID = s.rng.Uint64()
	}
	if cfg.Router.UseKVEvents {
		s.events = cfg.EventSource
	}
	return s, nil
}

// BeginShutdown makes every selecting or mutating call fail with 503 "selection service is
// shutting down" and Ready report not ready (selection-service.md §2, §16), and fails every
// request waiting in a partition queue with the same 503 (§13.3). DeleteWorker, Workers, Loads,
// lifecycle calls on existing reservations keep working. It is idempotent.
func (s *Service) BeginShutdown() {
	s.shuttingDown.Store(true)
	for _, p := range s.partitionsSnapshot() {
		if p.q == nil {
			continue
		}
		p.mu.Lock()
		s.failQueuedLocked(p, errShuttingDown())
		p.mu.Unlock()
	}
}

// ShuttingDown reports whether BeginShutdown was called.
func (s *Service) ShuttingDown() bool { return s.shuttingDown.Load() }

func errShuttingDown() error { return Errorf(KindNotReady, "selection service is shutting down") }

// Run performs the service's periodic maintenance until ctx is done and returns ctx.Err():
// the expiry guard every DefaultExpirySweepInterval (60 s, §10.5), the reservation-index sweep
// every expiry period (DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS, §10.5), the pending-selection cache
// sweep with the expiry guard, with session affinity on the affinity reaper every min(TTL, 30 s)
// (§12.1), with queueing on the queue recheck every QueueRecheckInterval (60 s, §13.3), and the
// estimated prefill completions of PrefillUnobserved bookings when each is due.
func (s *Service) Run(ctx context.Context) error {
	relDone := make(chan struct{})
	defer close(relDone)
	go s.runPrefillReleases(relDone)
	expiry := time.NewTicker(DefaultExpirySweepInterval)
	defer expiry.Stop()
	sweep := time.NewTicker(s.expiryLimit())
	defer sweep.Stop()
	var reap <-chan time.Time
	if s.cfg.SessionAffinityTTL > 0 {
		t := time.NewTicker(min(s.cfg.SessionAffinityTTL, ledger.MaxAffinityReapInterval))
		defer t.Stop()
		reap = t.C
	}
	var recheck <-chan time.Time
	if s.cfg.queueing() {
		iv := s.cfg.QueueRecheckInterval
		if iv <= 0 {
			iv = DefaultQueueRecheckInterval
		}
		t := time.NewTicker(iv)
		defer t.Stop()
		recheck = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-expiry.C:
			now := s.now()
			s.ExpireStale(now)
			s.pending.Sweep(now)
		case <-sweep.C:
			s.SweepReservations(s.now())
		case <-reap:
			s.ReapAffinity(s.now())
		case <-recheck:
			s.RecheckQueues()
		}
	}
}

// expiryLimit is DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS as a duration (at least 1 ms).
func (s *Service) expiryLimit() time.Duration {
	return max(time.Duration(s.cfg.Router.ActiveRequestExpirySecs*float64(time.Second)), time.Millisecond)
}

// partitionsSnapshot returns the partitions sorted by (model_name, routing_group).
func (s *Service) partitionsSnapshot() []*partition {
	s.mu.RLock()
	ps := make([]*partition, 0, len(s.partitions))
	for _, p := range s.partitions {
		ps = append(ps, p)
	}
	s.mu.RUnlock()
	slices.SortFunc(ps, func(a, b *partition) int {
		return cmp.Or(cmp.Compare(a.key.ModelName, b.key.ModelName), cmp.Compare(a.key.RoutingGroup, b.key.RoutingGroup))
	})
	return ps
}

func (s *Service) partition(key PartitionKey) *partition {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.partitions[key]
}

// Models returns the sorted distinct model_name values of partitions that have at least one
// registered worker (epp.md §5.5 partition resolution).
func (s *Service) Models() []string {
	var out []string
	for _, p := range s.partitionsSnapshot() {
		if p.memberCount.Load() > 0 && (len(out) == 0 || out[len(out)-1] != p.key.ModelName) {
			out = append(out, p.key.ModelName)
		}
	}
	return out
}

// HasModel reports whether a partition of model has at least one registered worker (epp.md §5.5).
func (s *Service) HasModel(model string) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for k, p := range s.partitions {
		if k.ModelName == model && p.memberCount.Load() > 0 {
			return true
		}
	}
	return false
}

// toLedger converts an index candidate to the ledger's identical shape.
func toLedger(c kvindex.Candidate) ledger.Candidate { return ledger.Candidate(c) }
