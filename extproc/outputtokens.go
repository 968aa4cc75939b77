package extproc

import (
	"context"
	"math"

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
// usage.output_tokens, top level or under "response" as in the Responses API's response.completed):
// the latest reported count is used, plus the estimate of the text of the events after it (so a
// server that reports usage once early, even 0, and never again is still counted from its
// events). Without usage it is an estimate: every
// event that carries generated text — choices[].text, choices[].delta.content,
// choices[].delta.reasoning_content / reasoning, choices[].delta.tool_calls, or a Responses API
// "delta" — is at least one token (vLLM sends one event per token by default), and all the text
// is at least ⌈bytes / outputCharsPerToken⌉ tokens (its JSON-escaped length, which slightly
// overstates escaped text). Not safe for concurrent use.
type outputCounter struct {
	textEvents uint64 // events carrying generated text (since the latest usage)
	textBytes  uint64 // JSON-escaped bytes of generated text (since the latest usage)
	exact      uint64 // the latest usage completion/output tokens, 0 before any
	reported   uint64 // the last total passed to OutputTokens

	// Per-event scratch and the member callbacks over it, built once per response so that
	// counting an event allocates nothing.
	usage, choices      []byte
	response            []byte
	completion, output  []byte
	text                int
	carries             bool
	top, usageM, choice func(key, v []byte)
	responseM           func(key, v []byte)
	delta               func(key, v []byte)
	elem                func(elem []byte, start, end int) bool
}

// newOutputCounter returns a counter with its callbacks bound.
func newOutputCounter() *outputCounter {
	c := &outputCounter{}
	c.top = func(key, v []byte) {
		switch {
		case fieldIs(key, "usage"):
			c.usage = v
		case fieldIs(key, "choices"):
			c.choices = v
		case fieldIs(key, "response"): // Responses API: response.completed carries response.usage
			c.response = v
		case fieldIs(key, "delta"): // Responses API: response.output_text.delta and friends
			c.addText(v)
		}
	}
	c.responseM = func(key, v []byte) {
		if fieldIs(key, "usage") {
			c.usage = v
		}
	}
	c.usageM = func(key, v []byte) {
		switch {
		case fieldIs(key, "completion_tokens"):
			c.completion = v
		case fieldIs(key, "output_tokens"):
			c.output = v
		}
	}
	c.delta = func(key, v []byte) {
		if fieldIs(key, "content") || fieldIs(key, "reasoning_content") || fieldIs(key, "reasoning") || fieldIs(key, "tool_calls") {
			c.addText(v)
		}
	}
	c.choice = func(key, v []byte) {
		switch {
		case fieldIs(key, "text"):
			c.addText(v)
		case fieldIs(key, "delta") && len(v) > 0 && v[0] == '{':
			objectMembers(v, c.delta)
		}
	}
	c.elem = func(elem []byte, _, _ int) bool {
		if len(elem) > 0 && elem[0] == '{' {
			objectMembers(elem, c.choice)
		}
		return true
	}
	return c
}

// addText counts a generated-text value: a non-empty string by its JSON length without the
// quotes, a non-empty array (tool calls) by its JSON length; anything else carries nothing.
func (c *outputCounter) addText(v []byte) {
	switch {
	case len(v) > 2 && v[0] == '"':
		c.text, c.carries = c.text+len(v)-2, true
	case len(v) > 2 && v[0] == '[':
		c.text, c.carries = c.text+len(v), true
	}
}

// event counts one SSE event's data (a JSON object; anything else, such as [DONE], is skipped).
// A role-only or finish-only delta carries no generated text and counts nothing. It returns the
// event's top-level usage and response members and whether data is a JSON object
// (UsageParser.onEvent), from the one scan of its top level.
func (c *outputCounter) event(data []byte) (usage, response []byte, object bool) {
	i := jsonscan.SkipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		return nil, nil, false
	}
	c.usage, c.choices, c.response, c.text, c.carries = nil, nil, nil, 0, false
	if !objectMembers(data, c.top) {
		return nil, nil, false
	}
	usage, response = c.usage, c.response
	if len(c.usage) == 0 && len(c.response) > 0 && c.response[0] == '{' && !objectMembers(c.response, c.responseM) {
		c.usage = nil
	}
	if len(c.choices) > 0 && c.choices[0] == '[' {
		jsonscan.Elements(c.choices, c.elem)
	}
	if c.carries {
		c.textEvents++
		c.textBytes += uint64(c.text)
	}
	if len(c.usage) > 0 && c.usage[0] == '{' {
		c.completion, c.output = nil, nil
		if objectMembers(c.usage, c.usageM) {
			n, ok := tokenCount(c.completion)
			if !ok {
				n, ok = tokenCount(c.output)
			}
			if ok { // the count includes this event's text and all before it
				c.exact = n
				c.textEvents, c.textBytes = 0, 0
			}
		}
	}
	c.usage, c.choices, c.response = nil, nil, nil
	return usage, response, true
}

// generated returns the output tokens counted so far: the latest reported usage (0 when none)
// plus the estimate of the generated text of the events after it.
func (c *outputCounter) generated() uint64 {
	est := max(c.textEvents, (c.textBytes+outputCharsPerToken-1)/outputCharsPerToken)
	if est > math.MaxUint64-c.exact {
		return math.MaxUint64
	}
	return c.exact + est
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
	st.outputs = newOutputCounter()
	st.usage.onEvent = st.outputs.event
}

var _ OutputTracker = (*picker.Service)(nil)
