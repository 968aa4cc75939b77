package extproc_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
)

// trackingPicker is the fake picker with extproc.OutputTracker: it records every reported total
// per booking and whether the booking was live when it arrived.
type trackingPicker struct {
	*fakePicker
	on bool

	omu      sync.Mutex
	totals   map[string][]uint64
	lateCall int // reports for a booking already freed
}

func (p *trackingPicker) TracksOutputBlocks() bool { return p.on }

func (p *trackingPicker) OutputTokens(_ context.Context, id string, generated uint64) (int, error) {
	p.fakePicker.mu.Lock()
	live := p.fakePicker.live[id]
	p.fakePicker.mu.Unlock()
	p.omu.Lock()
	defer p.omu.Unlock()
	if !live {
		p.lateCall++
		return 0, fmt.Errorf("reservation %s not found", id)
	}
	if p.totals == nil {
		p.totals = map[string][]uint64{}
	}
	p.totals[id] = append(p.totals[id], generated)
	return 0, nil
}

func (p *trackingPicker) reported() (all []uint64, late int) {
	p.omu.Lock()
	defer p.omu.Unlock()
	for _, v := range p.totals {
		all = append(all, v...)
	}
	return all, p.lateCall
}

func newTrackingHarness(t *testing.T, on bool) (*harness, *trackingPicker) {
	var tp *trackingPicker
	h := newHarness(t, func(c *extproc.Config) {
		tp = &trackingPicker{fakePicker: c.Picker.(*fakePicker), on: on}
		c.Picker = tp
	})
	return h, tp
}

func sse(events ...string) []byte {
	var b strings.Builder
	for _, e := range events {
		b.WriteString("data: " + e + "\n\n")
	}
	return []byte(b.String())
}

// TestStreamedOutputTokensReachThePicker checks the response path of DYN_ROUTER_TRACK_OUTPUT_BLOCKS:
// after each chunk of a streamed response the running total of generated tokens goes to the
// picker — counted from the events (one token per event carrying text, or the text's bytes / 4
// when larger) and replaced by usage.completion_tokens when the stream reports it — only while
// the booking is live, and never when the picker does not track output blocks.
func TestStreamedOutputTokensReachThePicker(t *testing.T) {
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}`)
	cases := []struct {
		name   string
		chunks [][]byte
		want   []uint64
	}{
		{"one token per event, role-only delta and [DONE] not counted", [][]byte{
			sse(`{"choices":[{"delta":{"role":"assistant","content":""}}]}`, `{"choices":[{"delta":{"content":"Hi"}}]}`),
			sse(`{"choices":[{"delta":{"content":" the"}}]}`, `{"choices":[{"delta":{"content":"re"}}]}`),
			sse(`{"choices":[{"delta":{},"finish_reason":"stop"}]}`, `[DONE]`),
		}, []uint64{1, 3}},
		{"a long event counts its text at 4 bytes per token (completions, stream interval > 1)", [][]byte{
			sse(`{"choices":[{"text":"a"}]}`),
			sse(`{"choices":[{"text":"` + strings.Repeat("word ", 16) + `"}]}`), // 80 bytes
		}, []uint64{1, 21}},
		{"continuous usage stats are exact", [][]byte{
			sse(`{"choices":[{"text":"` + strings.Repeat("x", 400) + `"}],"usage":{"prompt_tokens":5,"completion_tokens":3}}`),
			sse(`{"choices":[{"text":"y"}],"usage":{"prompt_tokens":5,"completion_tokens":40}}`),
		}, []uint64{3, 40}},
		{"an event split across chunks counts once, when complete", [][]byte{
			[]byte(`data: {"choices":[{"delta":{"con`), []byte(`tent":"ok"}}]}` + "\n"), []byte("\n"),
		}, []uint64{1}},
		{"Responses API deltas and reasoning count", [][]byte{
			sse(`{"type":"response.output_text.delta","delta":"Hello"}`, `{"choices":[{"delta":{"reasoning_content":"hm"}}]}`),
		}, []uint64{2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h, tp := newTrackingHarness(t, true)
			ex := h.do(t, extproctest.Request{Body: chat, Response: &extproctest.Response{ContentType: "text/event-stream", Chunks: tc.chunks}})
			if ex.Immediate != nil {
				t.Fatalf("ImmediateResponse %d", ex.Immediate.Status)
			}
			h.pk.waitSettled(t)
			got, late := tp.reported()
			if fmt.Sprint(got) != fmt.Sprint(tc.want) || late != 0 {
				t.Fatalf("reported totals %v (late %d), want %v", got, late, tc.want)
			}
		})
	}
	t.Run("nothing is parsed or reported when the picker does not track output blocks", func(t *testing.T) {
		h, tp := newTrackingHarness(t, false)
		h.do(t, extproctest.Request{Body: chat, Response: okResponse()})
		h.pk.waitSettled(t)
		if got, late := tp.reported(); len(got) != 0 || late != 0 {
			t.Fatalf("reported %v (late %d) with tracking off", got, late)
		}
	})
	t.Run("an error response reports nothing", func(t *testing.T) {
		h, tp := newTrackingHarness(t, true)
		h.do(t, extproctest.Request{Body: chat, Response: &extproctest.Response{Status: 503, ContentType: "text/event-stream",
			Chunks: [][]byte{sse(`{"choices":[{"delta":{"content":"x"}}]}`)}}})
		h.pk.waitSettled(t)
		if got, _ := tp.reported(); len(got) != 0 {
			t.Fatalf("reported %v for an error response", got)
		}
	})
	t.Run("a response that is not streamed reports nothing", func(t *testing.T) {
		h, tp := newTrackingHarness(t, true)
		body := []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)
		h.do(t, extproctest.Request{Body: body, Response: &extproctest.Response{Chunks: [][]byte{
			[]byte(`{"choices":[{"message":{"content":"` + strings.Repeat("y", 400) + `"}}],"usage":{"completion_tokens":100}}`)}}})
		h.pk.waitSettled(t)
		if got, _ := tp.reported(); len(got) != 0 {
			t.Fatalf("reported %v for a response that is not streamed", got)
		}
	})
}
