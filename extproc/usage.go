package extproc

import (
	"bytes"
	"math"
	"strconv"
	"strings"

	"github.com/kvepp/kvepp/internal/jsonscan"
)

// MaxUsageBufferBytes bounds the usage parser's memory (epp.md §6.4): the SSE carry buffer (a partial
// line plus the current event) and the prefix of a non-streaming body kept for parsing. An oversize
// SSE event is discarded; a non-streaming body longer than this is not parsed.
const MaxUsageBufferBytes = 1 << 20

// Usage is the token usage reported by a response (epp.md §6.4). Each field is nil when no event
// carried a valid value for it: a JSON number with an integral value ≥ 0. Counts are tokens.
type Usage struct {
	PromptTokens       *uint64 // usage.prompt_tokens (chat / completions)
	CompletionTokens   *uint64 // usage.completion_tokens
	TotalTokens        *uint64 // usage.total_tokens
	InputTokens        *uint64 // usage.input_tokens (Responses API)
	OutputTokens       *uint64 // usage.output_tokens (Responses API)
	PromptCachedTokens *uint64 // usage.prompt_tokens_details.cached_tokens
	InputCachedTokens  *uint64 // usage.input_tokens_details.cached_tokens
}

// Prompt returns the prompt tokens (prompt_tokens, else input_tokens) and whether either was seen.
func (u Usage) Prompt() (uint64, bool) { return first(u.PromptTokens, u.InputTokens) }

// Completion returns the generated tokens (completion_tokens, else output_tokens) and whether either
// was seen.
func (u Usage) Completion() (uint64, bool) { return first(u.CompletionTokens, u.OutputTokens) }

// Cached returns the cached prompt tokens (prompt_tokens_details.cached_tokens, else
// input_tokens_details.cached_tokens) and whether either was seen.
func (u Usage) Cached() (uint64, bool) { return first(u.PromptCachedTokens, u.InputCachedTokens) }

func first(a, b *uint64) (uint64, bool) {
	if a != nil {
		return *a, true
	}
	if b != nil {
		return *b, true
	}
	return 0, false
}

// UsageParser extracts Usage from a response body fed chunk by chunk (epp.md §6.4). Streaming
// (Server-Sent Events) is assumed when the response content-type contains text/event-stream, the
// request had "stream": true, or the first non-whitespace body bytes are "data:". SSE events and
// lines split across chunks at any byte parse exactly as if unsplit. Parsing never fails: malformed
// events are skipped. A UsageParser is not safe for concurrent use; the zero value is not usable,
// use NewUsageParser.
type UsageParser struct {
	decided, streaming bool
	pending            []byte // a proper prefix of "data:" seen before the streaming decision
	skipped            int    // leading whitespace bytes dropped before the decision (capped)
	bom                int    // bytes of a leading UTF-8 BOM consumed; len(utf8BOM) once past it
	afterCR            bool   // the last line ended in '\r': a '\n' right after it ends nothing

	carry     []byte // partial SSE line
	carryOver bool   // the partial line exceeded the cap: drop it and its event
	event     []byte // data of the current SSE event
	hasData   bool
	discard   bool // the current event exceeded the cap

	body     []byte // non-streaming: the first MaxUsageBufferBytes of the body
	bodyOver bool

	usage Usage

	// onEvent, when set, receives the data of every complete SSE event (streaming only) before
	// its usage is merged; the slice is only valid during the call. It scans the event's top
	// level and returns its usage and response members and whether data is a JSON object, as
	// parseEvent's own scan would, so that the event is scanned once.
	onEvent func(data []byte) (usage, response []byte, object bool)
}

// NewUsageParser returns a parser for a response with the given content-type; requestStream is
// true when the request body had "stream": true.
func NewUsageParser(contentType string, requestStream bool) *UsageParser {
	p := &UsageParser{}
	if requestStream || strings.Contains(strings.ToLower(contentType), "text/event-stream") {
		p.decided, p.streaming = true, true
	}
	return p
}

// Write feeds the next response body chunk. It never fails and keeps no reference to chunk.
// Before the streaming decision it keeps at most the 4 bytes of a possible "data:" prefix: leading
// whitespace is counted, not kept (it still counts toward the non-streaming body's
// MaxUsageBufferBytes), so no body, however long its whitespace, grows the parser beyond its cap.
// A leading UTF-8 byte order mark is skipped, as an SSE stream's is (WHATWG HTML §9.2.6).
func (p *UsageParser) Write(chunk []byte) {
	chunk = p.skipBOM(chunk)
	if len(chunk) == 0 {
		return
	}
	if !p.decided {
		if len(p.pending) == 0 {
			rest := bytes.TrimLeft(chunk, " \t\r\n")
			p.skipped = min(p.skipped+len(chunk)-len(rest), MaxUsageBufferBytes+1)
			chunk = rest
			if len(chunk) == 0 {
				return
			}
		}
		if !p.decide(chunk) {
			return
		}
		chunk, p.pending = append(p.pending, chunk...), nil
		if !p.streaming && p.skipped > MaxUsageBufferBytes {
			p.bodyOver = true
		}
	}
	if p.streaming {
		p.feedSSE(chunk)
		return
	}
	if p.bodyOver {
		return
	}
	if p.skipped+len(p.body)+len(chunk) > MaxUsageBufferBytes {
		p.bodyOver, p.body = true, nil
		return
	}
	p.body = append(p.body, chunk...)
}

// decide makes the streaming decision from the first non-whitespace bytes, p.pending followed by
// next (which starts with a non-whitespace byte when p.pending is empty). While they are a proper
// prefix of "data:" it keeps them in p.pending (at most 4 bytes) and reports false.
func (p *UsageParser) decide(next []byte) bool {
	var buf [5]byte
	head := append(buf[:0], p.pending...)
	head = append(head, next[:min(len(next), 5-len(head))]...)
	if len(head) < 5 && bytes.HasPrefix([]byte("data:"), head) {
		p.pending = append(p.pending[:0], head...)
		return false
	}
	p.decided, p.streaming = true, bytes.HasPrefix(head, []byte("data:"))
	return true
}

// utf8BOM is the UTF-8 encoding of U+FEFF.
const utf8BOM = "\xef\xbb\xbf"

// skipBOM drops a UTF-8 byte order mark at the start of the body, even when it is split across
// chunks; bytes that only began like one are fed back as data.
func (p *UsageParser) skipBOM(chunk []byte) []byte {
	for p.bom < len(utf8BOM) && len(chunk) > 0 {
		if chunk[0] != utf8BOM[p.bom] {
			partial := p.bom
			p.bom = len(utf8BOM)
			if partial > 0 {
				p.Write([]byte(utf8BOM[:partial]))
			}
			return chunk
		}
		p.bom++
		chunk = chunk[1:]
	}
	return chunk
}

// Finish flushes a pending event (or parses the buffered non-streaming body) and returns the merged
// usage. Further Writes after Finish are not supported.
func (p *UsageParser) Finish() Usage {
	if !p.decided && len(p.pending) > 0 {
		p.decided, p.streaming = true, false
		p.body, p.pending = p.pending, nil
	}
	if p.streaming {
		if len(p.carry) > 0 && !p.carryOver {
			p.line(p.carry)
		}
		p.carry, p.carryOver = p.carry[:0], false
		p.dispatch()
	} else if !p.bodyOver && len(p.body) > 0 {
		p.parseEvent(p.body)
		p.body = nil
	}
	return p.usage
}

// feedSSE splits b into lines, joining with the carry of the previous chunk. A line ends at
// "\r\n", "\n" or a lone "\r" (the SSE grammar, WHATWG HTML §9.2.6), wherever chunks split them.
func (p *UsageParser) feedSSE(b []byte) {
	for len(b) > 0 {
		if p.afterCR {
			p.afterCR = false
			if b[0] == '\n' {
				b = b[1:]
				continue
			}
		}
		i := lineEnd(b)
		if i < 0 {
			if p.carryOver || len(p.carry)+len(b) > MaxUsageBufferBytes {
				p.carry, p.carryOver = p.carry[:0], true
				return
			}
			p.carry = append(p.carry, b...)
			return
		}
		line := b[:i]
		if b[i] == '\r' {
			if i+1 < len(b) {
				if b[i+1] == '\n' {
					i++
				}
			} else {
				p.afterCR = true
			}
		}
		b = b[i+1:]
		if p.carryOver {
			p.carryOver, p.discard = false, true
			p.carry = p.carry[:0]
			continue
		}
		if len(p.carry) > 0 {
			if len(p.carry)+len(line) > MaxUsageBufferBytes {
				p.carry, p.discard = p.carry[:0], true
				continue
			}
			p.carry = append(p.carry, line...)
			line = p.carry
		}
		p.line(line)
		p.carry = p.carry[:0]
	}
}

// lineEnd is the index of the first '\n' or '\r' in b, or -1.
func lineEnd(b []byte) int {
	i := bytes.IndexByte(b, '\n')
	seg := b
	if i >= 0 {
		seg = b[:i]
	}
	if j := bytes.IndexByte(seg, '\r'); j >= 0 {
		return j
	}
	return i
}

// line handles one SSE line (without its line ending).
func (p *UsageParser) line(l []byte) {
	if len(l) == 0 {
		p.dispatch()
		return
	}
	if !bytes.HasPrefix(l, []byte("data:")) || p.discard {
		return // event:, id:, retry:, comments
	}
	d := l[5:]
	if len(d) > 0 && d[0] == ' ' {
		d = d[1:]
	}
	if len(p.event)+len(d)+1 > MaxUsageBufferBytes {
		p.discard, p.event, p.hasData = true, p.event[:0], false
		return
	}
	if p.hasData {
		p.event = append(p.event, '\n')
	}
	p.event = append(p.event, d...)
	p.hasData = true
}

// dispatch ends the current event.
func (p *UsageParser) dispatch() {
	if p.hasData && !p.discard {
		if p.onEvent != nil {
			usage, response, ok := p.onEvent(p.event)
			if ok && bytes.Contains(p.event, usageKey) {
				p.mergeEvent(usage, response)
			}
		} else {
			p.parseEvent(p.event)
		}
	}
	p.event, p.hasData, p.discard = p.event[:0], false, false
}

var usageKey = []byte(`"usage"`)

// parseEvent merges the usage of one JSON event (or a whole non-streaming body).
func (p *UsageParser) parseEvent(data []byte) {
	if !bytes.Contains(data, usageKey) {
		return // also skips [DONE]
	}
	var usage, response []byte
	if !objectMembers(data, func(key, v []byte) {
		switch {
		case fieldIs(key, "usage"):
			usage = v
		case fieldIs(key, "response"):
			response = v
		}
	}) {
		return
	}
	p.mergeEvent(usage, response)
}

// mergeEvent merges the usage of an event's top-level usage and response members.
func (p *UsageParser) mergeEvent(usage, response []byte) {
	p.mergeUsage(usage)
	if len(response) > 0 && response[0] == '{' {
		var ru []byte
		if objectMembers(response, func(key, v []byte) {
			if fieldIs(key, "usage") {
				ru = v
			}
		}) {
			p.mergeUsage(ru)
		}
	}
}

// usageFields are the usage members mergeUsage reads, in the order of its values.
var usageFields = [...]string{"prompt_tokens", "completion_tokens", "total_tokens", "input_tokens", "output_tokens",
	"prompt_tokens_details", "input_tokens_details"}

func (p *UsageParser) mergeUsage(v []byte) {
	if len(v) == 0 || v[0] != '{' {
		return
	}
	// One array for the member values, so the callback captures one variable (one allocation,
	// not one per field).
	var vals [len(usageFields)][]byte
	if !objectMembers(v, func(key, val []byte) {
		for i, name := range usageFields {
			if fieldIs(key, name) {
				vals[i] = val
				return
			}
		}
	}) {
		return
	}
	prompt, completion, total, input, output, promptDetails, inputDetails := vals[0], vals[1], vals[2], vals[3], vals[4], vals[5], vals[6]
	set(&p.usage.PromptTokens, prompt)
	set(&p.usage.CompletionTokens, completion)
	set(&p.usage.TotalTokens, total)
	set(&p.usage.InputTokens, input)
	set(&p.usage.OutputTokens, output)
	set(&p.usage.PromptCachedTokens, cachedTokens(promptDetails))
	set(&p.usage.InputCachedTokens, cachedTokens(inputDetails))
}

func cachedTokens(details []byte) []byte {
	if len(details) == 0 || details[0] != '{' {
		return nil
	}
	var cached []byte
	if !objectMembers(details, func(key, v []byte) {
		if fieldIs(key, "cached_tokens") {
			cached = v
		}
	}) {
		return nil
	}
	return cached
}

// objectMembers calls fn with the members of the JSON object v in order (one pass, no
// reflection) and reports whether v is one; when it is not, what fn collected must be dropped,
// as encoding/json would have decoded nothing.
func objectMembers(v []byte, fn func(key, val []byte)) bool {
	return jsonscan.Object(v, func(key []byte, s, e int) { fn(key, v[s:e]) }) == nil
}

// fieldIs matches a JSON key to a field name as encoding/json does (case-insensitively).
func fieldIs(key []byte, name string) bool {
	return len(key) == len(name) && strings.EqualFold(string(key), name)
}

// set stores v into *dst when v is a JSON number with an integral value ≥ 0.
func set(dst **uint64, v []byte) {
	if n, ok := tokenCount(v); ok {
		*dst = &n
	}
}

// tokenCount parses a JSON number with an integral, non-negative value.
func tokenCount(v []byte) (uint64, bool) {
	if len(v) == 0 || !(v[0] == '-' || (v[0] >= '0' && v[0] <= '9')) {
		return 0, false
	}
	if n, err := strconv.ParseUint(string(v), 10, 64); err == nil {
		return n, true
	}
	f, err := strconv.ParseFloat(string(v), 64)
	if err != nil || f < 0 || f != math.Trunc(f) || f >= math.MaxUint64 {
		return 0, false
	}
	return uint64(f), true
}
