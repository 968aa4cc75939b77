package runner

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvepp/kvepp/ledger/replica"
)

var (
	descReplicaSent = prometheus.NewDesc("kvepp_replica_sync_events_sent_total",
		"Replica-sync events written to the PUB socket, by topic.", []string{"topic"}, nil)
	descReplicaReceived = prometheus.NewDesc("kvepp_replica_sync_events_received_total",
		"Replica-sync events received and decoded, by topic, before the drop rules.", []string{"topic"}, nil)
	descReplicaApplied = prometheus.NewDesc("kvepp_replica_sync_events_applied_total",
		"Replica-sync events applied to the local ledger or affinity table, by topic.", []string{"topic"}, nil)
	descReplicaDropped = prometheus.NewDesc("kvepp_replica_sync_events_dropped_total",
		"Replica-sync events dropped, by reason (own, unknown_partition, block_size_mismatch, unknown_worker, unknown_rank, outbound_queue_full, …).",
		[]string{"reason"}, nil)
	descReplicaPeers = prometheus.NewDesc("kvepp_replica_sync_peers",
		"Replica-sync peers: configured, and connected (SUB socket up).", []string{"state"}, nil)
	descReplicaQueued = prometheus.NewDesc("kvepp_replica_sync_queued_events",
		"Replica-sync events waiting, by direction.", []string{"direction"}, nil)
	descReplicaLag = prometheus.NewDesc("kvepp_replica_sync_lag_seconds",
		"Replica-sync lag inside this process: outbound = publish → written to the socket, inbound = received → applied.",
		[]string{"direction"}, nil)
)

// replicaCollector exports the replica-sync counters (read at scrape time).
type replicaCollector struct{ m *replica.Manager }

// Describe implements prometheus.Collector.
func (c replicaCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descReplicaSent, descReplicaReceived, descReplicaApplied, descReplicaDropped,
		descReplicaPeers, descReplicaQueued, descReplicaLag} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c replicaCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.m.Stats()
	counter := func(d *prometheus.Desc, v uint64, label string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), label)
	}
	gauge := func(d *prometheus.Desc, v int, label string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), label)
	}
	counter(descReplicaSent, st.SentSlot, replica.TopicSlotTracker)
	counter(descReplicaSent, st.SentAffinity, replica.TopicSessionAffinity)
	counter(descReplicaReceived, st.ReceivedSlot, replica.TopicSlotTracker)
	counter(descReplicaReceived, st.ReceivedAffinity, replica.TopicSessionAffinity)
	counter(descReplicaApplied, st.AppliedSlot, replica.TopicSlotTracker)
	counter(descReplicaApplied, st.AppliedAffinity, replica.TopicSessionAffinity)
	for r := replica.DropReason(0); r < replica.NumDropReasons; r++ {
		counter(descReplicaDropped, st.Dropped[r], r.String())
	}
	gauge(descReplicaPeers, st.PeersConfigured, "configured")
	gauge(descReplicaPeers, st.PeersConnected, "connected")
	gauge(descReplicaQueued, st.OutboundQueued, "outbound")
	gauge(descReplicaQueued, st.InboundQueued, "inbound")
	for dir, h := range map[string]replica.Histogram{"outbound": st.OutboundLag, "inbound": st.InboundLag} {
		ch <- prometheus.MustNewConstHistogram(descReplicaLag, h.Count, h.Sum, h.Buckets, dir)
	}
}
