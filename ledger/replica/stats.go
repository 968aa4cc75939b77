package replica

import (
	"sync/atomic"
	"time"
)

// DropReason is why a replicated event was not sent or not applied (metric label).
type DropReason uint8

// Drop reasons. Receive path in the order checks run (selection-service.md §15.1, §15.4), then
// the apply outcomes, then the send path.
const (
	// DropMalformed: not two frames, or a payload that does not decode.
	DropMalformed DropReason = iota
	// DropUnknownTopic: a topic other than the two replica topics.
	DropUnknownTopic
	// DropLegacyEnvelope: a slot envelope carrying tenant_id (pre-v1 binaries).
	DropLegacyEnvelope
	// DropOwn: an event this replica published (its own router_id / writer_id).
	DropOwn
	// DropUnknownPartition: no such (model_name, routing_group) here.
	DropUnknownPartition
	// DropBlockSizeMismatch: the envelope's block_size differs from the partition's.
	DropBlockSizeMismatch
	// DropUnknownWorker: the worker is not schedulable in that partition here.
	DropUnknownWorker
	// DropUnknownRank: the dp_rank is outside the worker's range here.
	DropUnknownRank
	// DropUnknownReservation: a prefill completion or free for an id not live here.
	DropUnknownReservation
	// DropConflict: an admission whose id is live here as this replica's own booking.
	DropConflict
	// DropFreedBeforeAdmission: an admission arriving after a free of the same id from another
	// peer was seen (the free overtook it); applying it would leak the mirror until expiry.
	DropFreedBeforeAdmission
	// DropInvalid: an event that cannot be applied (empty id, zero router_id).
	DropInvalid
	// DropAffinityNotApplied: a binding the partition's table did not take (unknown partition or
	// worker, affinity off, or an older version, §12.1 apply rules).
	DropAffinityNotApplied
	// DropInboundFull: the partition's inbound queue held InboundCapacity events.
	DropInboundFull
	// DropOutboundFull: the outbound queue was full; the newest event is dropped.
	DropOutboundFull
	// DropSubscriberFull: one subscribed peer's socket queue was full; that peer misses the event.
	DropSubscriberFull
	// DropClosed: published after Close.
	DropClosed
	// DropDepartedReplica: an admission from a replica whose peer was deregistered, received
	// before it left (its mirrors were released then; applying it would leak one until expiry).
	DropDepartedReplica
	// NumDropReasons is the number of reasons.
	NumDropReasons
)

var dropNames = [NumDropReasons]string{
	"malformed", "unknown_topic", "legacy_envelope", "own", "unknown_partition", "block_size_mismatch",
	"unknown_worker", "unknown_rank", "unknown_reservation", "conflict", "freed_before_admission", "invalid",
	"affinity_not_applied", "inbound_queue_full", "outbound_queue_full", "subscriber_queue_full", "closed",
	"departed_replica",
}

// String returns the reason's metric label.
func (r DropReason) String() string {
	if r < NumDropReasons {
		return dropNames[r]
	}
	return "unknown"
}

// LagBuckets are the upper bounds (seconds) of the lag histograms.
var LagBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// histogram is a fixed-bucket, lock-free latency histogram.
type histogram struct {
	counts [17]atomic.Uint64 // len(LagBuckets)+1, the last is +Inf
	sumNs  atomic.Uint64
}

func (h *histogram) observe(d time.Duration) {
	d = max(d, 0)
	s := d.Seconds()
	i := 0
	for i < len(LagBuckets) && s > LagBuckets[i] {
		i++
	}
	h.counts[i].Add(1)
	h.sumNs.Add(uint64(d))
}

// Histogram is a snapshot of a lag histogram in Prometheus form.
type Histogram struct {
	// Count is the number of observations.
	Count uint64
	// Sum is the sum of the observations in seconds.
	Sum float64
	// Buckets maps each LagBuckets bound to the cumulative count of observations ≤ it.
	Buckets map[float64]uint64
}

func (h *histogram) snapshot() Histogram {
	out := Histogram{Buckets: make(map[float64]uint64, len(LagBuckets))}
	var cum uint64
	for i := range h.counts {
		cum += h.counts[i].Load()
		if i < len(LagBuckets) {
			out.Buckets[LagBuckets[i]] = cum
		}
	}
	out.Count = cum
	out.Sum = time.Duration(h.sumNs.Load()).Seconds()
	return out
}

// Stats are the replica-sync counters (cumulative since New) and gauges.
type Stats struct {
	// SentSlot and SentAffinity count messages written to the PUB socket per topic.
	SentSlot, SentAffinity uint64
	// ReceivedSlot and ReceivedAffinity count decoded messages per topic, before the drop rules.
	ReceivedSlot, ReceivedAffinity uint64
	// AppliedSlot and AppliedAffinity count events that changed the local state.
	AppliedSlot, AppliedAffinity uint64
	// Dropped counts dropped events by reason.
	Dropped [NumDropReasons]uint64
	// PeersConfigured is the number of peers; PeersConnected those whose SUB is connected now.
	PeersConfigured, PeersConnected int
	// Subscribers is the number of peers' SUB sockets connected to this replica's PUB socket.
	Subscribers int
	// OutboundQueued and InboundQueued are the events waiting now (inbound: all partitions).
	OutboundQueued, InboundQueued int
	// OutboundLag is publish → written to the socket; InboundLag is received → applied.
	OutboundLag, InboundLag Histogram
}

// DroppedTotal is the sum of Dropped.
func (s Stats) DroppedTotal() uint64 {
	var n uint64
	for _, v := range s.Dropped {
		n += v
	}
	return n
}

// counters are the live atomics behind Stats.
type counters struct {
	sentSlot, sentAffinity         atomic.Uint64
	receivedSlot, receivedAffinity atomic.Uint64
	appliedSlot, appliedAffinity   atomic.Uint64
	dropped                        [NumDropReasons]atomic.Uint64
	outboundLag, inboundLag        histogram
}
