package main

import (
	"fmt"
	"html"
	"math"
	"path/filepath"
	"slices"
	"strings"
)

// palette colours the baselines in run order (colour-blind-safe Okabe–Ito order).
var palette = []string{"#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"}

func color(i int) string { return palette[i%len(palette)] }

// renderSVG draws the result as one standalone SVG: hit rate per baseline (bars, the ideal reuse
// as a dashed line), simulated TTFT p50 per baseline (bars), and the hit rate over time per
// baseline (lines, the ideal dashed), written by hand with the standard library.
func renderSVG(res *Result) string {
	const w, h = 1000, 740
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="Helvetica, Arial, sans-serif" font-size="12">`+"\n", w, h, w, h)
	b.WriteString(`<rect width="100%" height="100%" fill="white"/>` + "\n")
	title := fmt.Sprintf("eppbench — %s: %d requests, %d workers × %d blocks",
		filepath.Base(res.Workload.Name), res.Workload.Requests, res.Setup.Workers, res.Setup.CapacityBlocks)
	text(&b, w/2, 24, "middle", 15, "bold", title)
	text(&b, w/2, 42, "middle", 11, "normal", fmt.Sprintf(
		"speedup %g: the simulated clock runs %g× faster than the wall clock and arrivals are compressed to match; times are simulated",
		res.Setup.Speedup, res.Setup.Speedup))

	names := make([]string, len(res.Baselines))
	hits := make([]float64, len(res.Baselines))
	ttfts := make([]float64, len(res.Baselines))
	ttft90 := make([]float64, len(res.Baselines))
	for i, bl := range res.Baselines {
		names[i], hits[i], ttfts[i], ttft90[i] = bl.Name, 100*bl.HitRate, bl.TTFTms.P50, bl.TTFTms.P90
		if bl.Completed == 0 {
			hits[i], ttfts[i], ttft90[i] = math.NaN(), math.NaN(), math.NaN() // no figures: "no data", not a zero bar
		}
	}
	ideal := 100 * res.Workload.IdealHitRate
	barPanel(&b, 60, 80, 420, 240, "Prefix-cache hit rate, % of prompt tokens (higher is better)", names, hits, "%.1f%%", ideal, "ideal %.1f%%")
	pairPanel(&b, 560, 80, 420, 240, "TTFT p50 (solid) and p90 (light), ms (lower is better)", names, ttfts, ttft90)
	timelinePanel(&b, 60, 440, 900, 230, res)
	b.WriteString("</svg>\n")
	return b.String()
}

func text(b *strings.Builder, x, y float64, anchor string, size int, weight, s string) {
	fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="%s" font-size="%d" font-weight="%s">%s</text>`+"\n",
		x, y, anchor, size, weight, html.EscapeString(s))
}

// niceMax rounds v up to 1, 2 or 5 × a power of ten (at least 1e-9).
func niceMax(v float64) float64 {
	if v <= 0 || math.IsNaN(v) || math.IsInf(v, 0) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

// barPanel draws vertical bars with value labels; ref ≥ 0 adds a dashed reference line. A NaN
// value (a router with no completed request) gets a "no data" label instead of a bar.
func barPanel(b *strings.Builder, x, y, w, h float64, title string, names []string, vals []float64, valFmt string, ref float64, refFmt string) {
	text(b, x+w/2, y-12, "middle", 13, "bold", title)
	top := ref
	for _, v := range vals {
		if !math.IsNaN(v) {
			top = math.Max(top, v)
		}
	}
	top = niceMax(top * 1.1)
	axes(b, x, y, w, h, top, "")
	eachBar(x, w, len(vals), func(i int, bx, bw float64) {
		v := vals[i]
		if math.IsNaN(v) {
			text(b, bx+bw/2, y+h-4, "middle", 11, "normal", "no data")
		} else {
			bh := h * v / top
			fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/>`+"\n", bx, y+h-bh, bw, bh, color(i))
			text(b, bx+bw/2, y+h-bh-4, "middle", 11, "normal", fmt.Sprintf(valFmt, v))
		}
		barLabel(b, bx+bw/2, y+h+14, names[i])
	})
	if ref >= 0 {
		ry := y + h - h*ref/top
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#555" stroke-dasharray="6 4"/>`+"\n", x, ry, x+w, ry)
		text(b, x+w-4, ry-4, "end", 11, "normal", fmt.Sprintf(refFmt, ref))
	}
}

// axes draws a panel's x and y axes with four horizontal grid lines labelled 0..top, each label
// followed by unit ("%", or "" for none).
func axes(b *strings.Builder, x, y, w, h, top float64, unit string) {
	fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#333"/>`+"\n", x, y+h, x+w, y+h)
	fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#333"/>`+"\n", x, y, x, y+h)
	for i := 0; i <= 4; i++ {
		v := top * float64(i) / 4
		yy := y + h - h*float64(i)/4
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", x, yy, x+w, yy)
		text(b, x-6, yy+4, "end", 11, "normal", trimFloat(v)+unit)
	}
}

// barLabel writes a router name under a bar, rotated.
func barLabel(b *strings.Builder, x, y float64, name string) {
	fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="end" font-size="11" transform="rotate(-25 %.1f %.1f)">%s</text>`+"\n",
		x, y, x, y, html.EscapeString(name))
}

// pairPanel draws two bars per router on a log-free linear scale: a (solid, labelled) and b
// (lighter, behind it, labelled above), e.g. TTFT p50 and p90. NaN pairs get "no data".
func pairPanel(b *strings.Builder, x, y, w, h float64, title string, names []string, a, bv []float64) {
	text(b, x+w/2, y-12, "middle", 13, "bold", title)
	top := 0.0
	for i := range a {
		if !math.IsNaN(bv[i]) {
			top = math.Max(top, math.Max(a[i], bv[i]))
		}
	}
	top = niceMax(top * 1.15)
	axes(b, x, y, w, h, top, "")
	eachBar(x, w, len(a), func(i int, bx, bw float64) {
		if math.IsNaN(a[i]) {
			text(b, bx+bw/2, y+h-4, "middle", 11, "normal", "no data")
		} else {
			hb, ha := h*bv[i]/top, h*a[i]/top
			fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s" fill-opacity="0.35"/>`+"\n", bx, y+h-hb, bw, hb, color(i))
			fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/>`+"\n", bx+bw*0.2, y+h-ha, bw*0.6, ha, color(i))
			text(b, bx+bw/2, y+h-hb-4, "middle", 10, "normal", fmt.Sprintf("%.0f", bv[i]))
			if ha < hb-14 {
				text(b, bx+bw/2, y+h-ha-4, "middle", 10, "normal", fmt.Sprintf("%.0f", a[i]))
			}
		}
		barLabel(b, bx+bw/2, y+h+14, names[i])
	})
}

// eachBar lays n bars out over the width w starting at x (each 60 % of its slot, centred) and
// calls draw with each bar's index, left edge and width.
func eachBar(x, w float64, n int, draw func(i int, bx, bw float64)) {
	if n == 0 {
		return
	}
	slot := w / float64(n)
	bw := slot * 0.6
	for i := 0; i < n; i++ {
		draw(i, x+slot*float64(i)+(slot-bw)/2, bw)
	}
}

// sparseBucketRequests is the fewest requests a timeline bucket needs to be joined into its line;
// a bucket holding fewer than this (or than a quarter of the median bucket) swings with single
// requests — typically the last buckets, where few conversations are still running — and is drawn
// as an open marker instead.
const sparseBucketRequests = 5

// sparseBelow returns the request count under which a bucket of tl is sparse.
func sparseBelow(tl []TimelinePoint) int {
	var counts []int
	for _, p := range tl {
		if p.Requests > 0 {
			counts = append(counts, p.Requests)
		}
	}
	if len(counts) == 0 {
		return sparseBucketRequests
	}
	slices.Sort(counts)
	return max(sparseBucketRequests, counts[len(counts)/2]/4)
}

// timelinePanel draws the hit rate over simulated time, one line per baseline through its dense
// buckets, sparse buckets (sparseBelow) as open markers.
func timelinePanel(b *strings.Builder, x, y, w, h float64, res *Result) {
	text(b, x+w/2, y-12, "middle", 13, "bold", "Hit rate over time, requests bucketed by arrival in simulated seconds (higher is better)")
	top, span := 0.0, 0.0
	for _, bl := range res.Baselines {
		for _, p := range bl.Timeline {
			top = math.Max(top, math.Max(p.HitRate, p.IdealHitRate))
			span = math.Max(span, p.StartSeconds)
		}
	}
	top = niceMax(100 * top * 1.05)
	if len(res.Baselines) > 0 && len(res.Baselines[0].Timeline) > 1 {
		tl := res.Baselines[0].Timeline
		span += tl[1].StartSeconds - tl[0].StartSeconds
	}
	if span <= 0 {
		span = 1
	}
	axes(b, x, y, w, h, top, "%")
	for i := 0; i <= 5; i++ {
		t := span * float64(i) / 5
		xx := x + w*float64(i)/5
		text(b, xx, y+h+16, "middle", 11, "normal", fmt.Sprintf("%.0f s", t))
	}
	px := func(t float64) float64 { return x + w*t/span }
	py := func(v float64) float64 { return y + h - h*(100*v)/top }
	minRequests := sparseBucketRequests
	if len(res.Baselines) > 0 {
		minRequests = sparseBelow(res.Baselines[0].Timeline)
	}
	line := func(pts []TimelinePoint, val func(TimelinePoint) float64, stroke, dash string) {
		var sb strings.Builder
		for _, p := range pts {
			if p.Requests == 0 {
				continue
			}
			mid := p.StartSeconds
			if len(pts) > 1 {
				mid += (pts[1].StartSeconds - pts[0].StartSeconds) / 2
			}
			if p.Requests < minRequests {
				fmt.Fprintf(b, `<circle cx="%.1f" cy="%.1f" r="3" fill="white" stroke="%s" stroke-width="1.5"/>`+"\n", px(mid), py(val(p)), stroke)
				continue
			}
			fmt.Fprintf(&sb, "%.1f,%.1f ", px(mid), py(val(p)))
		}
		fmt.Fprintf(b, `<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>`+"\n", stroke, dash, strings.TrimSpace(sb.String()))
	}
	if len(res.Baselines) > 0 {
		line(res.Baselines[0].Timeline, func(p TimelinePoint) float64 { return p.IdealHitRate }, "#777", ` stroke-dasharray="6 4"`)
	}
	for i, bl := range res.Baselines {
		line(bl.Timeline, func(p TimelinePoint) float64 { return p.HitRate }, color(i), "")
	}
	// Legend.
	lx, ly := x+10, y+h+34
	for i, bl := range res.Baselines {
		xx := lx + float64(i%5)*180
		yy := ly + float64(i/5)*16
		fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="14" height="4" fill="%s"/>`+"\n", xx, yy-5, color(i))
		text(b, xx+20, yy, "start", 11, "normal", bl.Name)
	}
	xx := lx + float64(len(res.Baselines)%5)*180
	yy := ly + float64(len(res.Baselines)/5)*16
	fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#777" stroke-width="2" stroke-dasharray="6 4"/>`+"\n", xx, yy-3, xx+14, yy-3)
	text(b, xx+20, yy, "start", 11, "normal", "ideal (unbounded cache)")
	n := len(res.Baselines) + 1
	xx, yy = lx+float64(n%5)*180, ly+float64(n/5)*16
	fmt.Fprintf(b, `<circle cx="%.1f" cy="%.1f" r="3" fill="white" stroke="#333" stroke-width="1.5"/>`+"\n", xx+7, yy-3)
	text(b, xx+20, yy, "start", 11, "normal", fmt.Sprintf("bucket of fewer than %d requests (noisy; not joined)", minRequests))
}

// trimFloat formats an axis value without trailing zeros.
func trimFloat(v float64) string {
	s := fmt.Sprintf("%.2f", v)
	s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	if s == "" || s == "-" {
		return "0"
	}
	return s
}
