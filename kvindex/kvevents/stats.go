package kvevents

import (
	"errors"
	"fmt"
	"math"
	"sync/atomic"

	"github.com/kvepp/kvepp/kvindex"
)

// BatchDropReason classifies why a received message or batch was not applied at all
// (kv-events-index.md §5.2, §7.3 rule 6). Its String form is a stable metric label.
type BatchDropReason uint8

// Batch drop reasons.
const (
	// BatchDropFrames: a live message with a frame count other than 3 (§5.2).
	BatchDropFrames BatchDropReason = iota
	// BatchDropSeqFrame: a seq frame that is not exactly 8 bytes (§5.2).
	BatchDropSeqFrame
	// BatchDropPayload: a payload that is not a valid batch (§7.3 rule 6); the seq still advances
	// the watermark.
	BatchDropPayload
	// BatchDropQueueFull: the listener's receive queue (its high-water mark) was full; the
	// missing sequence numbers show up as a gap.
	BatchDropQueueFull

	// NumBatchDropReasons is the number of BatchDropReason values.
	NumBatchDropReasons
)

var batchDropNames = [NumBatchDropReasons]string{"frames", "seq_frame", "invalid_payload", "queue_full"}

// String returns the reason's metric label, e.g. "invalid_payload".
func (r BatchDropReason) String() string {
	if r < NumBatchDropReasons {
		return batchDropNames[r]
	}
	return fmt.Sprintf("batch_drop_reason(%d)", uint8(r))
}

// SinkErrorKind classifies errors returned by Sink.Apply (kv-events-index.md §11.2-§11.3).
type SinkErrorKind uint8

// Sink error kinds.
const (
	// SinkParentNotFound: the store's parent is unknown for the candidate; the store was skipped.
	SinkParentNotFound SinkErrorKind = iota
	// SinkInvalidSequence: the index rejected the store's block sequence.
	SinkInvalidSequence
	// SinkBlockNotFound: a removal named unknown blocks (non-fatal; the rest was removed).
	SinkBlockNotFound
	// SinkOther: any other error.
	SinkOther

	// NumSinkErrorKinds is the number of SinkErrorKind values.
	NumSinkErrorKinds
)

var sinkErrorNames = [NumSinkErrorKinds]string{"parent_not_found", "invalid_block_sequence", "block_not_found", "other"}

// String returns the kind's metric label, e.g. "parent_not_found".
func (k SinkErrorKind) String() string {
	if k < NumSinkErrorKinds {
		return sinkErrorNames[k]
	}
	return fmt.Sprintf("sink_error(%d)", uint8(k))
}

func sinkErrorKind(err error) SinkErrorKind {
	switch {
	case errors.Is(err, kvindex.ErrParentBlockNotFound):
		return SinkParentNotFound
	case errors.Is(err, kvindex.ErrInvalidBlockSequence):
		return SinkInvalidSequence
	case errors.Is(err, kvindex.ErrBlockNotFound):
		return SinkBlockNotFound
	}
	return SinkOther
}

// Stats is a snapshot of a Manager's counters since it was created, summed over all workers and
// ranks. All values are counts; arrays are indexed by their reason type (use its String method as
// the metric label). Counters only grow.
type Stats struct {
	// BatchesApplied counts batches whose sequence number was accepted and whose payload was
	// decoded and applied (live or replayed).
	BatchesApplied uint64
	// BatchesStale counts live batches with seq below the watermark (stale or duplicate; §13).
	BatchesStale uint64
	// BatchesDropped counts messages or batches dropped whole, by reason.
	BatchesDropped [NumBatchDropReasons]uint64
	// EventsApplied counts index events the sink applied (Stored, Removed, Cleared), a removal
	// naming some unknown blocks included (SinkBlockNotFound: the known ones were removed).
	EventsApplied uint64
	// EventsRejected counts index events the sink refused (every SinkErrors kind except
	// SinkBlockNotFound). Each event handed to the sink counts under exactly one of EventsApplied
	// and EventsRejected.
	EventsRejected uint64
	// EventsDropped counts engine events dropped by decoding or conversion, by reason.
	EventsDropped [NumDropReasons]uint64
	// SinkErrors counts errors returned by Sink.Apply, by kind.
	SinkErrors [NumSinkErrorKinds]uint64
	// Gaps counts sequence gaps detected (seq > expected), including a fresh listener's first
	// seq > 0.
	Gaps uint64
	// LostBatches counts sequence numbers that were neither received live nor replayed. It
	// saturates at 2^64−1: a publisher jumping its seq near 2^64 must not wrap the counter (a
	// Prometheus counter that goes down reads as a reset).
	LostBatches uint64
	// ReplaysOK, ReplaysFailed and ReplaysTimeout count replay requests (§6) that ended with the
	// END marker, failed (dial error, malformed reply), or hit the replay timeout.
	ReplaysOK      uint64
	ReplaysFailed  uint64
	ReplaysTimeout uint64
	// ReplayedBatches counts batches applied from replay replies.
	ReplayedBatches uint64
	// PublisherRestarts counts publishers detected as restarted at the same address (the first
	// seq after a reconnect was below the watermark); each cleared its (worker, rank) (§13).
	PublisherRestarts uint64
	// Reconnects counts SUB connections re-dialled after the publisher dropped them.
	Reconnects uint64
	// RanksCleared counts Cleared events the Manager applied itself: publisher restarts,
	// re-attaches with a changed endpoint, and ranks that left a worker's range.
	RanksCleared uint64
	// NamespaceOverflow counts blocks whose cache namespace could not be remembered because a
	// converter's namespace memory (2^20 entries) was full.
	NamespaceOverflow uint64
}

// counters is the live, atomically updated form of Stats.
type counters struct {
	batchesApplied    atomic.Uint64
	batchesStale      atomic.Uint64
	batchesDropped    [NumBatchDropReasons]atomic.Uint64
	eventsApplied     atomic.Uint64
	eventsRejected    atomic.Uint64
	eventsDropped     [NumDropReasons]atomic.Uint64
	sinkErrors        [NumSinkErrorKinds]atomic.Uint64
	gaps              atomic.Uint64
	lostBatches       atomic.Uint64
	replaysOK         atomic.Uint64
	replaysFailed     atomic.Uint64
	replaysTimeout    atomic.Uint64
	replayedBatches   atomic.Uint64
	publisherRestarts atomic.Uint64
	reconnects        atomic.Uint64
	ranksCleared      atomic.Uint64
	namespaceOverflow atomic.Uint64
}

// addLost adds n lost batches to lostBatches, saturating at math.MaxUint64 instead of wrapping.
func (c *counters) addLost(n uint64) {
	for {
		old := c.lostBatches.Load()
		sum := old + n
		if sum < old {
			sum = math.MaxUint64
		}
		if c.lostBatches.CompareAndSwap(old, sum) {
			return
		}
	}
}

func (c *counters) snapshot() Stats {
	s := Stats{
		BatchesApplied:    c.batchesApplied.Load(),
		BatchesStale:      c.batchesStale.Load(),
		EventsApplied:     c.eventsApplied.Load(),
		EventsRejected:    c.eventsRejected.Load(),
		Gaps:              c.gaps.Load(),
		LostBatches:       c.lostBatches.Load(),
		ReplaysOK:         c.replaysOK.Load(),
		ReplaysFailed:     c.replaysFailed.Load(),
		ReplaysTimeout:    c.replaysTimeout.Load(),
		ReplayedBatches:   c.replayedBatches.Load(),
		PublisherRestarts: c.publisherRestarts.Load(),
		Reconnects:        c.reconnects.Load(),
		RanksCleared:      c.ranksCleared.Load(),
		NamespaceOverflow: c.namespaceOverflow.Load(),
	}
	for i := range c.batchesDropped {
		s.BatchesDropped[i] = c.batchesDropped[i].Load()
	}
	for i := range c.eventsDropped {
		s.EventsDropped[i] = c.eventsDropped[i].Load()
	}
	for i := range c.sinkErrors {
		s.SinkErrors[i] = c.sinkErrors[i].Load()
	}
	return s
}

// EventsDroppedTotal returns the sum of EventsDropped over all reasons.
func (s Stats) EventsDroppedTotal() uint64 {
	var n uint64
	for _, v := range s.EventsDropped {
		n += v
	}
	return n
}

// BatchesDroppedTotal returns the sum of BatchesDropped over all reasons.
func (s Stats) BatchesDroppedTotal() uint64 {
	var n uint64
	for _, v := range s.BatchesDropped {
		n += v
	}
	return n
}
