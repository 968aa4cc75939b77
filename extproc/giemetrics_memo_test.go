package extproc

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// value reads a counter or gauge child.
func value(t *testing.T, m prometheus.Metric) float64 {
	t.Helper()
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		t.Fatal(err)
	}
	if d.Counter != nil {
		return d.Counter.GetValue()
	}
	return d.Gauge.GetValue()
}

// TestGIEMetricsPerModelChildren: the memoized label children of each model update that model's
// series only, and the scheduler attempts count per status.
func TestGIEMetricsPerModelChildren(t *testing.T) {
	g := newGIEMetrics()
	g.routed("a", 10)
	g.routed("b", 20)
	g.routed("a", 5)
	g.finished(&stream{model: "a", startedAt: time.Now()}, true)
	g.scheduled(time.Millisecond, nil)
	g.scheduled(time.Millisecond, errUpgrade)
	g.scheduled(time.Millisecond, nil)
	for _, tc := range []struct {
		name      string
		got, want float64
	}{
		{"requests a", value(t, g.requests.WithLabelValues("a", "a")), 2},
		{"requests b", value(t, g.requests.WithLabelValues("b", "b")), 1},
		{"running a", value(t, g.running.WithLabelValues("a")), 1},
		{"running b", value(t, g.running.WithLabelValues("b")), 1},
		{"attempts success", value(t, g.schedulerTries.WithLabelValues("success")), 2},
		{"attempts failure", value(t, g.schedulerTries.WithLabelValues("failure")), 1},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %v, want %v", tc.name, tc.got, tc.want)
		}
	}
	ch := make(chan prometheus.Metric, 8)
	g.requestSizes.Collect(ch)
	if n := len(ch); n != 2 {
		t.Errorf("request size series %d, want one per model", n)
	}
}
