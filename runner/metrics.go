package runner

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvepp/kvepp/kvindex/kvevents"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/discovery"
)

var (
	descKVEvents = prometheus.NewDesc("kvepp_kv_events_total",
		"KV events by result, each event under one: applied to the index, rejected by the index (kvepp_kv_event_index_errors_total has the kind), dropped by decoding or conversion; stale counts batches below the sequence watermark.",
		[]string{"result"}, nil)
	descKVEventDrops = prometheus.NewDesc("kvepp_kv_events_dropped_total",
		"KV events dropped by decoding or conversion, by reason.", []string{"reason"}, nil)
	descKVBatchDrops = prometheus.NewDesc("kvepp_kv_event_batches_dropped_total",
		"KV event messages or batches dropped whole, by reason.", []string{"reason"}, nil)
	descKVSinkErrors = prometheus.NewDesc("kvepp_kv_event_index_errors_total",
		"Errors returned by the prefix index while applying KV events, by kind.", []string{"kind"}, nil)
	descKVGaps = prometheus.NewDesc("kvepp_kv_event_gaps_total",
		"KV event sequence gaps detected.", nil, nil)
	descKVLost = prometheus.NewDesc("kvepp_kv_event_lost_batches_total",
		"KV event batches neither received live nor replayed.", nil, nil)
	descKVReplays = prometheus.NewDesc("kvepp_kv_replays_total",
		"KV event replay requests by result.", []string{"result"}, nil)
	descKVRestarts = prometheus.NewDesc("kvepp_kv_event_publisher_restarts_total",
		"KV event publishers detected as restarted at the same address.", nil, nil)
	descReadyWorkers = prometheus.NewDesc("kvepp_ready_workers",
		"Schedulable workers in the catalog that may be picked (discovered pods whose Ready condition is True).", nil, nil)
	descWorkers = prometheus.NewDesc("kvepp_workers",
		"Workers in the catalog by lifecycle.", []string{"lifecycle"}, nil)
	descActiveRequests = prometheus.NewDesc("kvepp_selection_active_requests",
		"Live bookings in the selection core's ledger (ext_proc streams and HTTP API reservations).", nil, nil)
	descActivePrefill = prometheus.NewDesc("kvepp_selection_active_prefill_tokens",
		"Booked prefill tokens not yet completed, summed over every worker rank.", nil, nil)
	descActiveBlocks = prometheus.NewDesc("kvepp_selection_active_blocks",
		"Active (decode) blocks, summed over every worker rank.", nil, nil)
	descFileApplied = prometheus.NewDesc("kvepp_workers_file_snapshots_applied_total",
		"Workers-file snapshots applied completely.", nil, nil)
	descFileFailures = prometheus.NewDesc("kvepp_workers_file_apply_failures_total",
		"Workers-file snapshot applies that failed (each is retried after 5 s).", nil, nil)
	descFileInvalid = prometheus.NewDesc("kvepp_workers_file_invalid_total",
		"Distinct invalid workers-file contents seen (each logged once; the catalog was kept).", nil, nil)
)

// statsCollector exports the other components' counters, read at scrape time (epp.md §12; names
// prefixed kvepp_): KV-event ingestion, the worker catalog and the workers file. The ext_proc
// server's own metrics (requests, immediate responses, active reservations, …) are registered
// beside it. Nothing is registered on the global registry.
type statsCollector struct {
	svc    *picker.Service
	events *kvevents.Manager
	disc   *discovery.FileSource
}

// Describe implements prometheus.Collector.
func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descKVEvents, descKVEventDrops, descKVBatchDrops, descKVSinkErrors, descKVGaps,
		descKVLost, descKVReplays, descKVRestarts, descReadyWorkers, descWorkers, descActiveRequests, descActivePrefill, descActiveBlocks, descFileApplied, descFileFailures, descFileInvalid} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *statsCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	if c.events != nil {
		st := c.events.Stats()
		counter(descKVEvents, st.EventsApplied, "applied")
		counter(descKVEvents, st.EventsRejected, "rejected")
		counter(descKVEvents, st.BatchesStale, "stale")
		counter(descKVEvents, st.EventsDroppedTotal(), "dropped")
		for r := kvevents.DropReason(0); r < kvevents.NumDropReasons; r++ {
			counter(descKVEventDrops, st.EventsDropped[r], r.String())
		}
		for r := kvevents.BatchDropReason(0); r < kvevents.NumBatchDropReasons; r++ {
			counter(descKVBatchDrops, st.BatchesDropped[r], r.String())
		}
		for k := kvevents.SinkErrorKind(0); k < kvevents.NumSinkErrorKinds; k++ {
			counter(descKVSinkErrors, st.SinkErrors[k], k.String())
		}
		counter(descKVGaps, st.Gaps)
		counter(descKVLost, st.LostBatches)
		counter(descKVReplays, st.ReplaysOK, "ok")
		counter(descKVReplays, st.ReplaysFailed, "failed")
		counter(descKVReplays, st.ReplaysTimeout, "timeout")
		counter(descKVRestarts, st.PublisherRestarts)
	}
	byLifecycle := map[string]int{
		picker.LifecycleIncomplete: 0, picker.LifecycleSchedulable: 0,
		picker.LifecycleDraining: 0, picker.LifecycleUnschedulable: 0,
	}
	ready := 0
	for _, w := range c.svc.Workers("", "") {
		byLifecycle[w.Lifecycle]++
		if w.Lifecycle == picker.LifecycleSchedulable && w.Candidate {
			ready++
		}
	}
	ch <- prometheus.MustNewConstMetric(descReadyWorkers, prometheus.GaugeValue, float64(ready))
	for lc, n := range byLifecycle {
		ch <- prometheus.MustNewConstMetric(descWorkers, prometheus.GaugeValue, float64(n), lc)
	}
	var requests, prefill, blocks uint64
	for _, p := range c.svc.Loads("", "") {
		for _, l := range p.Loads {
			requests += l.ActiveRequests
			prefill += l.PotentialPrefillTokens
			blocks += l.PotentialDecodeBlocks
		}
	}
	ch <- prometheus.MustNewConstMetric(descActiveRequests, prometheus.GaugeValue, float64(requests))
	ch <- prometheus.MustNewConstMetric(descActivePrefill, prometheus.GaugeValue, float64(prefill))
	ch <- prometheus.MustNewConstMetric(descActiveBlocks, prometheus.GaugeValue, float64(blocks))
	if c.disc != nil {
		st := c.disc.Stats()
		counter(descFileApplied, st.Applied)
		counter(descFileFailures, st.ApplyFailures)
		counter(descFileInvalid, st.InvalidFiles)
	}
}
