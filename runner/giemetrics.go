package runner

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/discovery"
)

var (
	descPoolReadyPods = prometheus.NewDesc("inference_pool_ready_pods",
		"The number of ready pods in the inference server pool (registered workers that are candidates).", []string{"name"}, nil)
	descPoolAvgKV = prometheus.NewDesc("inference_pool_average_kv_cache_utilization",
		"The average kv cache utilization for an inference server pool: per worker rank, the active blocks kvepp has booked divided by total_kv_blocks, averaged over the ranks whose total_kv_blocks is known.",
		[]string{"name"}, nil)
	descPoolAvgQueue = prometheus.NewDesc("inference_pool_average_queue_size",
		"The average number of requests routed to a worker rank of the pool and not yet finished (kvepp's ledger).", []string{"name"}, nil)
	descPoolPerPodQueue = prometheus.NewDesc("inference_pool_per_pod_queue_size",
		"The number of requests routed to each worker rank and not yet finished (kvepp's ledger); model_server_pod is <pod>-rank-<dp_rank>.",
		[]string{"name", "model_server_pod"}, nil)
	descPoolRegistered = prometheus.NewDesc("kvepp_inference_pool_registered_pods",
		"Pods of the InferencePool registered as workers (Running with an IP, not terminating), Ready or not.", nil, nil)
	descPoolReady = prometheus.NewDesc("kvepp_inference_pool_synced",
		"1 when the InferencePool was read and its pods registered, else 0 (readiness follows it).", nil, nil)
	descPoolApplied = prometheus.NewDesc("kvepp_inference_pool_snapshots_applied_total",
		"InferencePool snapshots applied completely.", nil, nil)
	descPoolApplyFailures = prometheus.NewDesc("kvepp_inference_pool_apply_failures_total",
		"InferencePool snapshot applies that failed (each is retried after 5 s unless a newer one arrives).", nil, nil)
	descPoolReadFailures = prometheus.NewDesc("kvepp_inference_pool_read_failures_total",
		"Failed reads of the InferencePool or its pods (missing CRD or RBAC, API errors).", nil, nil)
)

// poolCollector exports the pool-level metrics of the Gateway API Inference Extension's EPP
// (inference_pool_*; its Grafana dashboard reads them) from kvepp's own state, plus kvepp's
// InferencePool discovery counters. Without a pool the same figures describe the whole catalog
// (name = "").
type poolCollector struct {
	svc  *picker.Service
	pool *discovery.PoolSource // nil without InferencePool discovery
	name string
}

// Describe implements prometheus.Collector.
func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descPoolReadyPods, descPoolAvgKV, descPoolAvgQueue, descPoolPerPodQueue,
		descPoolRegistered, descPoolReady, descPoolApplied, descPoolApplyFailures, descPoolReadFailures} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	// Rank names: the pod's for discovered workers, worker-<id> otherwise.
	podOf := map[uint64]string{}
	if c.pool != nil {
		for _, r := range c.pool.Ranks() {
			podOf[r.WorkerID] = r.Pod
		}
	}
	totalKV := map[uint64]uint64{}
	ready := 0
	for _, w := range c.svc.Workers("", "") {
		if w.Lifecycle != picker.LifecycleSchedulable || !c.svc.IsCandidate(w.WorkerID) {
			continue
		}
		if _, discovered := podOf[w.WorkerID]; c.pool != nil && !discovered {
			continue // an API-registered worker is not a pod of the pool
		}
		ready++
		if w.TotalKVBlocks != nil && *w.TotalKVBlocks > 0 {
			totalKV[w.WorkerID] = *w.TotalKVBlocks
		}
	}
	gauge(descPoolReadyPods, float64(ready), c.name)

	var ranks, queued int
	var kvSum float64
	kvRanks := 0
	for _, pl := range c.svc.Loads("", "") {
		for _, l := range pl.Loads {
			pod, discovered := podOf[l.WorkerID]
			if c.pool != nil && !discovered {
				continue
			}
			if !discovered {
				pod = "worker-" + strconv.FormatUint(l.WorkerID, 10)
			}
			ranks++
			queued += int(l.ActiveRequests)
			gauge(descPoolPerPodQueue, float64(l.ActiveRequests), c.name, pod+"-rank-"+strconv.FormatUint(uint64(l.DPRank), 10))
			if t, ok := totalKV[l.WorkerID]; ok {
				kvSum += min(1, float64(l.PotentialDecodeBlocks)/float64(t))
				kvRanks++
			}
		}
	}
	if ranks > 0 {
		gauge(descPoolAvgQueue, float64(queued)/float64(ranks), c.name)
	}
	if kvRanks > 0 {
		gauge(descPoolAvgKV, kvSum/float64(kvRanks), c.name)
	}
	if c.pool == nil {
		return
	}
	st := c.pool.Stats()
	gauge(descPoolRegistered, float64(st.Registered))
	synced := 0.0
	if st.Ready {
		synced = 1
	}
	gauge(descPoolReady, synced)
	counter := func(d *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	counter(descPoolApplied, st.Applied)
	counter(descPoolApplyFailures, st.ApplyFailures)
	counter(descPoolReadFailures, st.ReadFailures)
}
