package extproc_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
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

// countingService is the real selection core, counting the output blocks OutputTokens added.
type countingService struct {
	*picker.Service
	mu    sync.Mutex
	added int
}

func (c *countingService) OutputTokens(ctx context.Context, id string, generated uint64) (int, error) {
	n, err := c.Service.OutputTokens(ctx, id, generated)
	c.mu.Lock()
	c.added += n
	c.mu.Unlock()
	return n, err
}

// TestOutputBlocksOverTheRealCoreAreFreedWithTheResponse runs streamed responses through the
// ext_proc server over the real selection core with DYN_ROUTER_TRACK_OUTPUT_BLOCKS: the bookings
// grow by one block per 4 generated tokens (block size 4), and once the response ends — or the
// client cancels mid-response — the worker's active blocks and requests are back to zero.
func TestOutputBlocksOverTheRealCoreAreFreedWithTheResponse(t *testing.T) {
	for _, cancelAfter := range []int{0, 2} {
		pc := pickertest.Config(3, 9)
		pc.Router.TrackActiveBlocks, pc.Router.TrackOutputBlocks = true, true
		svc, err := picker.New(pc)
		if err != nil {
			t.Fatal(err)
		}
		bs := uint32(4)
		if _, err := svc.UpsertWorker(context.Background(), picker.WorkerRecord{WorkerID: 1, ModelName: "m", Endpoint: "http://10.0.0.1:8000", BlockSize: &bs}, picker.SourceAPI); err != nil {
			t.Fatal(err)
		}
		cs := &countingService{Service: svc}
		srv, err := extproc.NewServer(extproc.Config{Picker: cs, Tokenizers: &fakeTokenizers{}})
		if err != nil {
			t.Fatal(err)
		}
		client := extproctest.NewClient(extproctest.Serve(t, srv.Register, srv.GRPCServerOptions()...))
		chunks := [][]byte{
			sse(`{"choices":[{"text":"a"}],"usage":{"prompt_tokens":4,"completion_tokens":1}}`),
			sse(`{"choices":[{"text":"b"}],"usage":{"prompt_tokens":4,"completion_tokens":17}}`), // 4 blocks
			sse(`{"choices":[{"text":"c"}],"usage":{"prompt_tokens":4,"completion_tokens":33}}`), // 8 blocks
			sse(`[DONE]`),
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		_, err = client.Do(ctx, extproctest.Request{Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":[1,2,3,4,5,6,7,8],"stream":true}`),
			Response: &extproctest.Response{ContentType: "text/event-stream", Chunks: chunks, CancelAfterChunks: cancelAfter}})
		cancel()
		if err != nil && cancelAfter == 0 {
			t.Fatal(err)
		}
		want := 8
		if cancelAfter > 0 {
			want = 4
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			l := svc.Loads("", "")[0].Loads[0]
			cs.mu.Lock()
			added := cs.added
			cs.mu.Unlock()
			if l.ActiveRequests == 0 && l.PotentialDecodeBlocks == 0 && added == want {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("cancel after %d: %d output blocks added (want %d); %d requests and %d blocks still active", cancelAfter, added, want, l.ActiveRequests, l.PotentialDecodeBlocks)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}
