// Package pickertest provides the fakes that tests of picker.Service and of the hosts built on
// it (picker/httpapi …) share: a KV-event source without sockets whose indexes a test can write
// KV events into, a settable clock, and a reproducible random source for picker.Config.
package pickertest

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
)

// EventSource is a picker.KVEventSource without sockets. It remembers the partition index each
// worker is attached to, so a test can inject KV events with Store, and reconciles a re-attach
// rank by rank like kvevents.Manager (selection-service.md §4.2): a rank whose endpoint, replay
// endpoint, block size, eagle flag or index changed, or that left the worker's dp range, is
// cleared in the old index. Safe for concurrent use.
type EventSource struct {
	mu      sync.Mutex
	specs   map[uint64]picker.WorkerEventSpec
	indexes map[uint64]*kvindex.Index
	fail    func(spec picker.WorkerEventSpec) error
}

// NewEventSource returns a source with no worker attached.
func NewEventSource() *EventSource {
	return &EventSource{specs: map[uint64]picker.WorkerEventSpec{}, indexes: map[uint64]*kvindex.Index{}}
}

// FailAttach makes AttachWorker return fail(spec) when that is non-nil, without attaching (as a
// listener that cannot start). A nil fail restores normal attaches.
func (f *EventSource) FailAttach(fail func(spec picker.WorkerEventSpec) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail = fail
}

// AttachWorker attaches spec's worker to idx (see EventSource for re-attaches).
func (f *EventSource) AttachWorker(spec picker.WorkerEventSpec, idx *kvindex.Index) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		if err := f.fail(spec); err != nil {
			return err
		}
	}
	if old, ok := f.specs[spec.WorkerID]; ok {
		oldIdx := f.indexes[spec.WorkerID]
		for r := old.DPStartRank; r-old.DPStartRank < old.DPSize; r++ {
			inRange := r >= spec.DPStartRank && r-spec.DPStartRank < spec.DPSize
			same := inRange && old.Endpoints[r] == spec.Endpoints[r] && old.ReplayEndpoint == spec.ReplayEndpoint &&
				old.BlockSize == spec.BlockSize && old.IsEagle == spec.IsEagle && oldIdx == idx
			if !same {
				_ = oldIdx.Apply(kvindex.Event{WorkerID: spec.WorkerID, DPRank: r, Kind: kvindex.EventCleared})
			}
		}
	}
	f.specs[spec.WorkerID] = spec
	f.indexes[spec.WorkerID] = idx
	return nil
}

// DetachWorker forgets the worker; its index is left as it is (the caller removes the worker).
// Tests call it directly to lose a listener behind the catalog's back.
func (f *EventSource) DetachWorker(workerID uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.specs, workerID)
	delete(f.indexes, workerID)
}

// Attached returns the spec the worker is attached with, and whether it is attached.
func (f *EventSource) Attached(workerID uint64) (picker.WorkerEventSpec, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.specs[workerID]
	return s, ok
}

// Index returns the index the worker is attached to, nil when it is not attached (for events
// Store cannot express, such as chosen external block hashes).
func (f *EventSource) Index(workerID uint64) *kvindex.Index {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.indexes[workerID]
}

// Store applies a Stored event on tier for (workerID, rank) to the index the worker is attached
// to: one block per local hash (kvindex TokensHash), with external block hash local + 1; parent,
// when non-nil, is the parent block's external hash. It fails t when the worker is not attached
// or the index rejects the event.
func (f *EventSource) Store(t testing.TB, workerID uint64, rank uint32, tier kvindex.Tier, parent *uint64, local ...uint64) {
	t.Helper()
	idx := f.Index(workerID)
	if idx == nil {
		t.Fatalf("worker %d is not attached", workerID)
	}
	ev := kvindex.Event{WorkerID: workerID, DPRank: rank, Tier: tier, Kind: kvindex.EventStored}
	if parent != nil {
		ev.HasParent, ev.ParentHash = true, *parent
	}
	for _, h := range local {
		ev.Blocks = append(ev.Blocks, kvindex.StoredBlock{BlockHash: h + 1, TokensHash: h})
	}
	if err := idx.Apply(ev); err != nil {
		t.Fatalf("apply stored event: %v", err)
	}
}

// Clock is a settable clock for admission-time, expiry and TTL tests (picker.Config.Now).
// Safe for concurrent use.
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// NewClock returns a clock reading t0.
func NewClock(t0 time.Time) *Clock { return &Clock{now: t0} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock by d and returns the new time.
func (c *Clock) Advance(d time.Duration) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	return c.now
}

// RandSource returns a picker.Config.RandSource whose n-th call (n = 1, 2, …) returns
// rand.NewPCG(seed+n, stream): every partition gets its own reproducible stream. Safe for
// concurrent use.
func RandSource(seed, stream uint64) func() rand.Source {
	var mu sync.Mutex
	return func() rand.Source {
		mu.Lock()
		defer mu.Unlock()
		seed++
		return rand.NewPCG(seed, stream)
	}
}

// Config returns picker.DefaultConfig with KV events off (a test turns them on together with an
// EventSource) and RandSource(seed, stream) as its random source.
func Config(seed, stream uint64) picker.Config {
	cfg := picker.DefaultConfig()
	cfg.Router.UseKVEvents = false
	cfg.RandSource = RandSource(seed, stream)
	return cfg
}
