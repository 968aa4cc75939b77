package main

import (
	"regexp"
	"strings"
	"testing"
)

// TestTheChartSaysWhichWayIsBetterAndMarksSparseBuckets: the chart names the better direction of
// each panel, explains the speedup, and draws buckets of few requests as open markers outside the
// lines instead of letting them swing the lines.
func TestTheChartSaysWhichWayIsBetterAndMarksSparseBuckets(t *testing.T) {
	res := sampleResult()
	tl := []TimelinePoint{{0, 40, 0.4, 0.5}, {10, 38, 0.5, 0.6}, {20, 41, 0.5, 0.7}, {30, 2, 0.95, 0.95}, {40, 1, 0, 0.9}}
	for i := range res.Baselines {
		res.Baselines[i].Timeline = tl
	}
	svg := renderSVG(res)
	for _, want := range []string{"(higher is better)", "(lower is better)", "speedup 10: the simulated clock runs 10× faster than the wall clock",
		"bucket of fewer than 9 requests (noisy; not joined)"} {
		if !strings.Contains(svg, want) {
			t.Errorf("the chart lacks %q", want)
		}
	}
	for _, pl := range regexp.MustCompile(`<polyline [^>]*points="([^"]*)"`).FindAllStringSubmatch(svg, -1) {
		if n := len(strings.Fields(pl[1])); n != 3 {
			t.Errorf("a line joins %d buckets, want the 3 dense ones: %s", n, pl[0])
		}
	}
	// 2 sparse buckets × (2 baselines + the ideal line) open markers, plus the legend's.
	if n := strings.Count(svg, `fill="white" stroke=`); n != 2*3+1 {
		t.Errorf("%d open markers, want 7", n)
	}
}
