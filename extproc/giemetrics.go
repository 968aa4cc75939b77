package extproc

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// GIE error codes of inference_objective_request_error_total{error_code}, as the Gateway API
// Inference Extension's EPP labels them.
const (
	gieBadRequest        = "BadRequest"
	gieResourceExhausted = "InferencePoolResourceExhausted"
	gieUnavailable       = "ServiceUnavailable"
	gieInternal          = "Internal"
	gieModelServerError  = "ModelServerError"
)

// gieMetrics exports the request metrics under the names, labels and buckets of the Gateway API
// Inference Extension's EPP (inference_objective_*, inference_extension_scheduler_*), so its
// published Grafana dashboard works unchanged beside kvepp's own kvepp_* metrics. Labels are the
// served partition model for both model_name and target_model_name (a LoRA request counts under
// its base model: labels never carry client-controlled values, epp.md §12).
type gieMetrics struct {
	requests        *prometheus.CounterVec
	errors          *prometheus.CounterVec
	duration        *prometheus.HistogramVec
	requestSizes    *prometheus.HistogramVec
	responseSizes   *prometheus.HistogramVec
	inputTokens     *prometheus.HistogramVec
	outputTokens    *prometheus.HistogramVec
	running         *prometheus.GaugeVec
	ntpot           *prometheus.HistogramVec
	schedulerE2E    prometheus.Histogram
	schedulerTries  *prometheus.CounterVec
	collectorsInOrd []prometheus.Collector
	// byModel and tries memoize the label children every exchange updates (gieModel).
	byModel keyCache[*gieModel]
	tries   keyCache[prometheus.Counter]
}

func newGIEMetrics() *gieMetrics {
	models := []string{"model_name", "target_model_name"}
	g := &gieMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inference_objective_request_total",
			Help: "Counter of inference objective requests broken out for each model and target model (routed requests).",
		}, models),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inference_objective_request_error_total",
			Help: "Counter of inference objective requests errors broken out for each model and target model.",
		}, []string{"model_name", "target_model_name", "error_code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "inference_objective_request_duration_seconds",
			Help: "Inference objective response latency distribution in seconds for each model and target model.",
			Buckets: []float64{0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 45, 60,
				120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600},
		}, models),
		requestSizes: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "inference_objective_request_sizes",
			Help:    "Inference objective requests size distribution in bytes for each model and target model.",
			Buckets: append(prometheus.ExponentialBuckets(64, 2, 11), prometheus.ExponentialBuckets(131072, 2, 14)...), // 64 B … 1 GiB
		}, models),
		responseSizes: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "inference_objective_response_sizes",
			Help:    "Inference objective responses size distribution in bytes for each model and target model.",
			Buckets: []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536},
		}, models),
		inputTokens: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "inference_objective_input_tokens",
			Help:    "Inference objective input token count distribution for requests in each model (from the response usage).",
			Buckets: []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072, 262144, 524288, 1048576},
		}, models),
		outputTokens: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "inference_objective_output_tokens",
			Help:    "Inference objective output token count distribution for requests in each model (from the response usage).",
			Buckets: []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192},
		}, models),
		running: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "inference_objective_running_requests",
			Help: "Inference objective number of running requests in each model (routed, response not finished).",
		}, []string{"model_name"}),
		ntpot: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "inference_objective_normalized_time_per_output_token_seconds",
			Help:    "Inference objective latency divided by number of output tokens in seconds for each model and target model.",
			Buckets: []float64{0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0},
		}, models),
		schedulerE2E: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "inference_extension_scheduler_e2e_duration_seconds",
			Help:    "End-to-end scheduling latency distribution in seconds (the selection core's pick and booking).",
			Buckets: []float64{0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1},
		}),
		schedulerTries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inference_extension_scheduler_attempts_total",
			Help: "Total number of scheduling attempts by status (success, failure).",
		}, []string{"status"}),
	}
	g.collectorsInOrd = []prometheus.Collector{g.requests, g.errors, g.duration, g.requestSizes, g.responseSizes,
		g.inputTokens, g.outputTokens, g.running, g.ntpot, g.schedulerE2E, g.schedulerTries}
	return g
}

// Describe implements prometheus.Collector.
func (g *gieMetrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range g.collectorsInOrd {
		c.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (g *gieMetrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range g.collectorsInOrd {
		c.Collect(ch)
	}
}

// scheduled records one scheduling attempt (a SelectAndReserve or a load-only pick) of d.
func (g *gieMetrics) scheduled(d time.Duration, err error) {
	g.schedulerE2E.Observe(d.Seconds())
	status := "success"
	if err != nil {
		status = "failure"
	}
	tries, _ := g.tries.get(status, func(s string) (prometheus.Counter, error) { return g.schedulerTries.WithLabelValues(s), nil })
	tries.Inc()
}

// routed counts a request the EPP routed to model's partition, with its body size (bytes).
func (g *gieMetrics) routed(model string, bodyBytes int) {
	mm := g.model(model)
	mm.requests.Inc()
	mm.requestSizes.Observe(float64(bodyBytes))
	mm.running.Inc()
}

// rejected counts an ImmediateResponse of HTTP status code.
func (g *gieMetrics) rejected(model string, code int) {
	g.errors.WithLabelValues(model, model, gieErrorCode(code)).Inc()
}

// finished records a routed request at stream end: the running gauge, and for a completed
// response its duration since the request headers, its size, usage tokens and the model server's
// error status.
func (g *gieMetrics) finished(st *stream, completed bool) {
	m := st.model
	mm := g.model(m)
	mm.running.Dec()
	if !completed {
		return
	}
	d := time.Since(st.startedAt)
	mm.duration.Observe(d.Seconds())
	mm.responseSizes.Observe(float64(st.respBytes))
	if st.respStatus >= 400 {
		g.errors.WithLabelValues(m, m, gieModelServerError).Inc()
	}
	if n, ok := st.usageSeen.Prompt(); ok && n > 0 {
		mm.inputTokens.Observe(float64(n))
	}
	if n, ok := st.usageSeen.Completion(); ok && n > 0 {
		mm.outputTokens.Observe(float64(n))
		mm.ntpot.Observe(d.Seconds() / float64(n))
	}
}

// gieModel is the label children of one served model (model_name = target_model_name = the
// model), resolved once instead of hashing the labels at every update: nine look-ups per
// exchange otherwise. All of a model's series exist from its first routed request on (zero until
// observed, as Prometheus recommends for known label values); before, the token and duration
// series appeared with their first observation.
type gieModel struct {
	requests                              prometheus.Counter
	running                               prometheus.Gauge
	requestSizes, responseSizes, duration prometheus.Observer
	inputTokens, outputTokens, ntpot      prometheus.Observer
}

// model returns model's label children (memoized for up to maxCachedKeys models; labels are
// served models only, epp.md §12).
func (g *gieMetrics) model(m string) *gieModel {
	mm, _ := g.byModel.get(m, func(m string) (*gieModel, error) {
		return &gieModel{
			requests: g.requests.WithLabelValues(m, m), running: g.running.WithLabelValues(m),
			requestSizes: g.requestSizes.WithLabelValues(m, m), responseSizes: g.responseSizes.WithLabelValues(m, m),
			duration: g.duration.WithLabelValues(m, m), inputTokens: g.inputTokens.WithLabelValues(m, m),
			outputTokens: g.outputTokens.WithLabelValues(m, m), ntpot: g.ntpot.WithLabelValues(m, m),
		}, nil
	})
	return mm
}

// gieErrorCode maps an ImmediateResponse status to the GIE error code.
func gieErrorCode(code int) string {
	switch {
	case code == 429:
		return gieResourceExhausted
	case code == 503:
		return gieUnavailable
	case code >= 400 && code < 500:
		return gieBadRequest
	case code >= 500:
		return gieInternal
	}
	return "Unknown:" + strconv.Itoa(code)
}
