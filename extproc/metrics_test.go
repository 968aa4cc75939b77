package extproc_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvepp/kvepp/extproc/extproctest"
)

func TestMetricsAreCollectedWithKveppNames(t *testing.T) {
	h := newHarness(t, nil)
	h.do(t, extproctest.Request{Body: []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`), Response: okResponse()})
	h.do(t, extproctest.Request{Body: []byte(`{}`)})
	reg := prometheus.NewRegistry()
	if err := reg.Register(h.srv.Metrics()); err != nil {
		t.Fatalf("register: %v", err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			key := mf.GetName()
			for _, l := range m.GetLabel() {
				key += "{" + l.GetName() + "=" + l.GetValue() + "}"
			}
			switch {
			case m.GetCounter() != nil:
				got[key] = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				got[key] = m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				got[key] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	want := map[string]float64{
		"kvepp_requests_total{outcome=success}":       1,
		"kvepp_requests_total{outcome=rejected}":      1,
		"kvepp_immediate_responses_total{status=400}": 1,
		"kvepp_usage_tokens_total{kind=prompt}":       10,
		"kvepp_usage_tokens_total{kind=completion}":   2,
		"kvepp_pick_duration_seconds":                 1,
		"kvepp_tokenize_duration_seconds":             1,
		"kvepp_overlap_tokens":                        1,
		"kvepp_active_reservations":                   0,
		"kvepp_inflight_picks":                        0,
		"kvepp_duplicate_eos_total":                   0,
		"kvepp_served_endpoint_mismatch_total":        0,
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %v (present %v), want %v", k, g, ok, v)
		}
	}
}
