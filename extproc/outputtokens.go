package extproc

import (
	"context"

	"github.com/kvepp/kvepp/internal/jsonscan"
	"github.com/kvepp/kvepp/picker"
)

// OutputTracker is implemented by a Picker that grows bookings with the output KV of running
// responses (*picker.Service; DYN_ROUTER_TRACK_OUTPUT_BLOCKS, selection-service.md §10.3
// "output_block"). When the configured Picker implements it and TracksOutputBlocks is true, the
// server counts the generated tokens of every streamed response and reports the running total
// after each response chunk.
type OutputTracker interface {
	// TracksOutputBlocks reports whether OutputTokens does anything; the server parses nothing
	// for it otherwise.
	TracksOutputBlocks() bool
	// OutputTokens reports that the live reservation selectionID has generated generated output
	// tokens so far (a running total); it returns the output blocks it added. An error (the
	// reservation is gone) is logged at debug level and otherwise ignored.
	OutputTokens(ctx context.Context, selectionID string, generated uint64) (int, error)
}

// outputCharsPerToken is the generated text bytes counted as one token when a stream reports no
// usage until its end: OpenAI's rule of thumb for English text with a byte-level BPE vocabulary
// (≈ 4 characters per token). It only matters when an event carries several tokens (vLLM's
// --stream-interval > 1); an event with any text counts at least one token.
const outputCharsPerToken = 4

// outputCounter counts the output tokens of one streamed response from its SSE events (fed by
// UsageParser as each event completes). Exact when the stream reports usage with each chunk
// (vLLM's stream_options.continuous_usage_stats, or any event carrying usage.completion_tokens /
// usage.output_tokens): the latest reported count is used. Otherwise it is an estimate: every
// event that carries generated text — choices[].text, choices[].delta.content,
// choices[].delta.reasoning_content / reasoning, choices[].delta.tool_calls, or a Responses API
// "delta" — is at least one token (vLLM sends one event per token by default), and all the text
// is at least ⌈bytes / outputCharsPerToken⌉ tokens (its JSON-escaped length, which slightly
// overstates escaped text). Not safe for concurrent use.
type outputCounter struct {
	textEvents uint64 // events carrying generated text
	textBytes  uint64 // JSON-escaped bytes of generated text
	exact      uint64 // the latest usage completion/output tokens
	exactSeen  bool
	reported   uint64 // the last total passed to OutputTokens
}

// event counts one SSE event's data (a JSON object; anything else, such as [DONE], is skipped).
func (c *outputCounter) event(data []byte) {
	i := jsonscan.SkipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		return
	}
	var usage, choices []byte
	var delta int
	if !objectMembers(data, func(key, v []byte) {
		switch {
		case fieldIs(key, "usage"):
			usage = v
		case fieldIs(key, "choices"):
			choices = v
		case fieldIs(key, "delta"): // Responses API: response.output_text.delta and friends
			if len(v) > 0 && v[0] == '"' {
				delta = len(v) - 2
			}
		}
	}) {
		return
	}
	if n, ok := completionTokens(usage); ok {
		c.exact, c.exactSeen = n, true
	}
	text, carries := delta, delta > 0
	if len(choices) > 0 && choices[0] == '[' {
		jsonscan.Elements(choices, func(elem []byte, _, _ int) bool {
			if n, ok := choiceText(elem); ok {
				text, carries = text+n, true
			}
			return true
		})
	}
	if carries {
		c.textEvents++
		c.textBytes += uint64(text)
	}
}

// generated returns the output tokens counted so far (exact when usage was reported).
func (c *outputCounter) generated() uint64 {
	if c.exactSeen {
		return c.exact
	}
	return max(c.textEvents, (c.textBytes+outputCharsPerToken-1)/outputCharsPerToken)
}

// completionTokens reads usage.completion_tokens (else usage.output_tokens).
func completionTokens(usage []byte) (uint64, bool) {
	if len(usage) == 0 || usage[0] != '{' {
		return 0, false
	}
	var completion, output []byte
	if !objectMembers(usage, func(key, v []byte) {
		switch {
		case fieldIs(key, "completion_tokens"):
			completion = v
		case fieldIs(key, "output_tokens"):
			output = v
		}
	}) {
		return 0, false
	}
	if n, ok := tokenCount(completion); ok {
		return n, true
	}
	return tokenCount(output)
}

// choiceText returns the generated text bytes of one choice of a streamed chunk and whether it
// carries any generated output at all (a role-only or finish-only delta does not).
func choiceText(choice []byte) (int, bool) {
	if len(choice) == 0 || choice[0] != '{' {
		return 0, false
	}
	n, carries := 0, false
	add := func(v []byte) {
		switch {
		case len(v) > 2 && v[0] == '"':
			n, carries = n+len(v)-2, true
		case len(v) > 2 && v[0] == '[': // tool_calls: count their JSON
			n, carries = n+len(v), true
		}
	}
	objectMembers(choice, func(key, v []byte) {
		switch {
		case fieldIs(key, "text"):
			add(v)
		case fieldIs(key, "delta") && len(v) > 0 && v[0] == '{':
			objectMembers(v, func(k, dv []byte) {
				if fieldIs(k, "content") || fieldIs(k, "reasoning_content") || fieldIs(k, "reasoning") || fieldIs(k, "tool_calls") {
					add(dv)
				}
			})
		}
	})
	return n, carries
}

// outputTracker returns the server's Picker as an OutputTracker when it tracks output blocks.
func (s *Server) outputTracker() OutputTracker {
	if t, ok := s.cfg.Picker.(OutputTracker); ok && t.TracksOutputBlocks() {
		return t
	}
	return nil
}

// reportOutput passes the streamed response's generated-token total to the picker when it grew
// and the booking is still live (never after free).
func (st *stream) reportOutput() {
	c := st.outputs
	if c == nil {
		return
	}
	n := c.generated()
	if n <= c.reported {
		return
	}
	if s := st.bk.state.Load(); s != bookingLive && s != bookingPrefilled {
		return
	}
	c.reported = n
	if _, err := st.s.outputTracker().OutputTokens(st.ctx, st.bk.id, n); err != nil {
		st.s.log.Debug().Err(err).Str("selection_id", st.bk.id).Msg("output tokens not recorded")
	}
}

// trackOutput attaches an output counter to the response's usage parser when the picker tracks
// output blocks, the request holds a booking and the response succeeded. Only SSE events reach
// it: a response that is not streamed arrives whole, when the booking is about to be freed, so
// its output is never reported (see README "Output blocks").
func (st *stream) trackOutput() {
	if st.respStatus >= 400 || st.s.outputTracker() == nil {
		return
	}
	if s := st.bk.state.Load(); s != bookingLive && s != bookingPrefilled {
		return
	}
	st.outputs = &outputCounter{}
	st.usage.onEvent = st.outputs.event
}

var _ OutputTracker = (*picker.Service)(nil)
