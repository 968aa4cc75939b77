package extproc

import (
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Outcome is the per-stream result recorded in kvepp_requests_total{outcome} (epp.md §7, §12).
type Outcome uint8

// Outcomes.
const (
	OutcomeSuccess   Outcome = iota // response completed with status < 400
	OutcomeError                    // response completed with status ≥ 400
	OutcomeCancelled                // stream closed before the response completed
	OutcomeRejected                 // ImmediateResponse
	OutcomeLoadOnly                 // routed by a load-only pick (no booking)
	numOutcomes
)

// String returns the metric label of o.
func (o Outcome) String() string {
	switch o {
	case OutcomeSuccess:
		return "success"
	case OutcomeError:
		return "error"
	case OutcomeCancelled:
		return "cancelled"
	case OutcomeRejected:
		return "rejected"
	case OutcomeLoadOnly:
		return "load_only"
	}
	return "unknown"
}

// Metrics holds the ext_proc server's metrics (epp.md §12, names prefixed kvepp_). It implements
// prometheus.Collector so the runner registers it on its own registry (no global registry). Counters
// are lock-free atomics; Snapshot reads them for tests and inspection. Safe for concurrent use.
type Metrics struct {
	requests               [numOutcomes]atomic.Uint64
	duplicateEOS           atomic.Uint64
	servedEndpointMismatch atomic.Uint64
	servedEndpointMoves    atomic.Uint64
	inflightPicks          atomic.Int64
	activeReservations     atomic.Int64
	usagePrompt            atomic.Uint64
	usageCompletion        atomic.Uint64
	usageCached            atomic.Uint64

	mu        sync.Mutex
	immediate map[int]uint64

	pickDuration     prometheus.Histogram
	tokenizeDuration prometheus.Histogram
	overlapTokens    prometheus.Histogram
	// gie are the same requests under the Gateway API Inference Extension's metric names.
	gie *gieMetrics

	descRequests, descImmediate, descDupEOS, descMismatch, descInflight, descActive, descUsage, descMoves *prometheus.Desc
}

// NewMetrics returns an empty, unregistered Metrics.
func NewMetrics() *Metrics {
	return &Metrics{
		immediate: make(map[int]uint64),
		gie:       newGIEMetrics(),
		pickDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvepp_pick_duration_seconds",
			Help:    "Time from request body end of stream to the routing header reply, seconds.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18),
		}),
		tokenizeDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvepp_tokenize_duration_seconds",
			Help:    "Time spent tokenizing a request prompt, seconds.",
			Buckets: prometheus.ExponentialBuckets(0.00005, 2, 21), // 50 µs … 52 s: a 64 MiB body takes tens of seconds
		}),
		overlapTokens: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvepp_overlap_tokens",
			Help:    "longest_matched overlap of the chosen worker, tokens.",
			Buckets: prometheus.ExponentialBuckets(16, 2, 14),
		}),
		descRequests:  prometheus.NewDesc("kvepp_requests_total", "ext_proc streams by outcome.", []string{"outcome"}, nil),
		descImmediate: prometheus.NewDesc("kvepp_immediate_responses_total", "ImmediateResponses sent, by HTTP status.", []string{"status"}, nil),
		descDupEOS:    prometheus.NewDesc("kvepp_duplicate_eos_total", "request_body messages ignored after end of stream.", nil, nil),
		descMismatch:  prometheus.NewDesc("kvepp_served_endpoint_mismatch_total", "Responses served by an endpoint other than the primary.", nil, nil),
		descInflight:  prometheus.NewDesc("kvepp_inflight_picks", "Requests in the routing phase (body end of stream to decision).", nil, nil),
		descActive:    prometheus.NewDesc("kvepp_active_reservations", "Bookings owned by open ext_proc streams.", nil, nil),
		descUsage:     prometheus.NewDesc("kvepp_usage_tokens_total", "Usage tokens reported by responses, by kind.", []string{"kind"}, nil),
		descMoves:     prometheus.NewDesc("kvepp_served_endpoint_moves_total", "Bookings moved to the endpoint the gateway reported as served (epp.md §6.3).", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.descRequests, m.descImmediate, m.descDupEOS, m.descMismatch, m.descInflight, m.descActive, m.descUsage, m.descMoves} {
		ch <- d
	}
	m.gie.Describe(ch)
	m.pickDuration.Describe(ch)
	m.tokenizeDuration.Describe(ch)
	m.overlapTokens.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	for o := Outcome(0); o < numOutcomes; o++ {
		ch <- prometheus.MustNewConstMetric(m.descRequests, prometheus.CounterValue, float64(m.requests[o].Load()), o.String())
	}
	s := m.Snapshot()
	for status, n := range s.ImmediateResponses {
		ch <- prometheus.MustNewConstMetric(m.descImmediate, prometheus.CounterValue, float64(n), strconv.Itoa(status))
	}
	ch <- prometheus.MustNewConstMetric(m.descDupEOS, prometheus.CounterValue, float64(s.DuplicateEOS))
	ch <- prometheus.MustNewConstMetric(m.descMismatch, prometheus.CounterValue, float64(s.ServedEndpointMismatch))
	ch <- prometheus.MustNewConstMetric(m.descMoves, prometheus.CounterValue, float64(s.ServedEndpointMoves))
	ch <- prometheus.MustNewConstMetric(m.descInflight, prometheus.GaugeValue, float64(s.InflightPicks))
	ch <- prometheus.MustNewConstMetric(m.descActive, prometheus.GaugeValue, float64(s.ActiveReservations))
	ch <- prometheus.MustNewConstMetric(m.descUsage, prometheus.CounterValue, float64(s.UsagePromptTokens), "prompt")
	ch <- prometheus.MustNewConstMetric(m.descUsage, prometheus.CounterValue, float64(s.UsageCompletionTokens), "completion")
	ch <- prometheus.MustNewConstMetric(m.descUsage, prometheus.CounterValue, float64(s.UsageCachedTokens), "cached")
	m.pickDuration.Collect(ch)
	m.tokenizeDuration.Collect(ch)
	m.overlapTokens.Collect(ch)
	m.gie.Collect(ch)
}

// MetricsSnapshot is a point-in-time copy of the counters of Metrics.
type MetricsSnapshot struct {
	// Requests counts finished streams by outcome label (success, error, cancelled, rejected, load_only).
	Requests map[string]uint64
	// ImmediateResponses counts ImmediateResponses by HTTP status.
	ImmediateResponses map[int]uint64
	// DuplicateEOS counts request_body messages ignored after end of stream (epp.md §4.4).
	DuplicateEOS uint64
	// ServedEndpointMismatch counts responses whose served endpoint differed from the primary.
	ServedEndpointMismatch uint64
	// ServedEndpointMoves counts bookings moved to the served endpoint (epp.md §6.3).
	ServedEndpointMoves uint64
	// InflightPicks is the number of requests in the routing phase now.
	InflightPicks int64
	// ActiveReservations is the number of bookings owned by open streams now.
	ActiveReservations int64
	// Usage token totals (epp.md §6.4), tokens.
	UsagePromptTokens, UsageCompletionTokens, UsageCachedTokens uint64
}

// Snapshot returns the current counter values.
func (m *Metrics) Snapshot() MetricsSnapshot {
	s := MetricsSnapshot{
		Requests:               make(map[string]uint64, numOutcomes),
		DuplicateEOS:           m.duplicateEOS.Load(),
		ServedEndpointMismatch: m.servedEndpointMismatch.Load(),
		ServedEndpointMoves:    m.servedEndpointMoves.Load(),
		InflightPicks:          m.inflightPicks.Load(),
		ActiveReservations:     m.activeReservations.Load(),
		UsagePromptTokens:      m.usagePrompt.Load(),
		UsageCompletionTokens:  m.usageCompletion.Load(),
		UsageCachedTokens:      m.usageCached.Load(),
	}
	for o := Outcome(0); o < numOutcomes; o++ {
		s.Requests[o.String()] = m.requests[o].Load()
	}
	m.mu.Lock()
	s.ImmediateResponses = make(map[int]uint64, len(m.immediate))
	for k, v := range m.immediate {
		s.ImmediateResponses[k] = v
	}
	m.mu.Unlock()
	return s
}

func (m *Metrics) countImmediate(status int) {
	m.mu.Lock()
	m.immediate[status]++
	m.mu.Unlock()
}

func (m *Metrics) addUsage(u Usage) {
	if n, ok := u.Prompt(); ok {
		m.usagePrompt.Add(n)
	}
	if n, ok := u.Completion(); ok {
		m.usageCompletion.Add(n)
	}
	if n, ok := u.Cached(); ok {
		m.usageCached.Add(n)
	}
}
