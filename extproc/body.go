package extproc

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strconv"

	"github.com/kvepp/kvepp/internal/jsonscan"
	"github.com/kvepp/kvepp/internal/tokenjson"
	"github.com/kvepp/kvepp/picker"
)

// requestKind is the classification of a request by method and path (epp.md §5.3).
type requestKind uint8

const (
	kindOther requestKind = iota
	kindChat
	kindCompletion
	kindResponses
)

// String names the kind for logs.
func (k requestKind) String() string {
	switch k {
	case kindChat:
		return "chat"
	case kindCompletion:
		return "completion"
	case kindResponses:
		return "responses"
	}
	return "other"
}

// classify returns the request kind of method and path: a POST whose path (query stripped) ends in
// /chat/completions, /completions or /responses; anything else is kindOther (load-only).
func classify(method, path string) requestKind {
	if method != "POST" {
		return kindOther
	}
	if i := indexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	switch {
	case hasSuffix(path, "/chat/completions"):
		return kindChat
	case hasSuffix(path, "/completions"):
		return kindCompletion
	case hasSuffix(path, "/responses"):
		return kindResponses
	}
	return kindOther
}

func indexByte(s string, c byte) int {
	for i := 0; i < len(s); i++ {
		if s[i] == c {
			return i
		}
	}
	return -1
}

func hasSuffix(s, suffix string) bool {
	return len(s) >= len(suffix) && s[len(s)-len(suffix):] == suffix
}

// span is a half-open byte range [start, end) of the body.
type span struct{ start, end int }

// parsedBody holds the top-level fields of an OpenAI-style body that routing reads (epp.md §5.3,
// §5.5). Raw values are sub-slices of the body; nothing else is decoded.
type parsedBody struct {
	model    string
	hasModel bool
	// modelBad is set when "model" is present but not a string (or null).
	modelBad bool
	// prompt is the raw value of messages / prompt / input (nil when absent).
	messages, prompt, input json.RawMessage
	previousResponseID      bool
	cacheSalt               string
	stream                  bool
	nvext                   json.RawMessage
	// saltValues are the value spans of every top-level "cache_salt" member.
	saltValues []span
	// members are all top-level members in document order, handed to the tokenizer so it need not
	// parse the body again (epp.md §13.5).
	members []BodyMember
	// memberBuf backs members for the usual bodies of a few top-level fields.
	memberBuf [8]BodyMember
	// msgElems are the element offsets of the messages array (BodyMember.Elements), backed by
	// msgElemBuf for conversations of up to 64 messages.
	msgElems   [][2]int
	msgElemBuf [64][2]int
	// lastValueEnd is the end of the last member's value (0 when the object is empty); open is the
	// offset just after '{'.
	lastValueEnd, open int
}

// errNotObject and friends are the 400 messages of epp.md §5.3.
var (
	errNotJSON   = picker.Errorf(picker.KindBadRequest, "request body is not valid JSON")
	errNotObject = picker.Errorf(picker.KindBadRequest, "request body must be a JSON object")
	errModelType = picker.Errorf(picker.KindBadRequest, "\"model\" must be a string")
)

// MaxBodyValues bounds the JSON values of one request body (250,000, counted by
// jsonscan.MoreValuesThan): the tokenizer builds a tree node of about a hundred bytes per value
// and renders the messages, so a 64 MiB body (or a 60 KB gzip body that decodes to one) of
// millions of tiny values would cost gigabytes before any other bound applied. Real requests
// have far fewer: a 2,000-turn agent conversation with 20 tool schemas is under 100,000.
const MaxBodyValues = 250_000

var errTooManyValues = picker.Errorf(picker.KindBadRequest, "request body has more than %d JSON values", MaxBodyValues)

// errTooDeep is the 400 of a body that is valid JSON except for its nesting depth.
var errTooDeep = picker.Errorf(picker.KindBadRequest, "request body nests JSON deeper than %d levels", jsonscan.MaxDepth)

// parseBody validates body as a JSON object (one pass, jsonscan.Object) and extracts the routing
// fields of its top level. It returns errNotJSON, errTooDeep or errNotObject (all 400) for bodies
// that are not JSON objects, and errModelType when model is present but not a string.
func parseBody(body []byte) (*parsedBody, error) {
	p := &parsedBody{}
	p.members, p.msgElems = p.memberBuf[:0], p.msgElemBuf[:0]
	msgMember, msgStart := -1, 0
	err := jsonscan.ObjectElements(body, "messages", &p.msgElems, func(key []byte, vs, ve int) {
		if string(key) == "messages" && body[vs] == '[' {
			msgMember, msgStart = len(p.members), vs
		}
		p.member(key, body[vs:ve], span{vs, ve})
		p.lastValueEnd = ve
	})
	if msgMember >= 0 && err == nil {
		// The element offsets are the body's; the member's value starts at its '['.
		for i := range p.msgElems {
			p.msgElems[i][0] -= msgStart
			p.msgElems[i][1] -= msgStart
		}
		p.members[msgMember].Elements = p.msgElems
	}
	switch err {
	case nil:
		if jsonscan.MoreValuesThan(body, MaxBodyValues) {
			return nil, errTooManyValues
		}
	case jsonscan.ErrTooDeep:
		return nil, errTooDeep
	case jsonscan.ErrNotObject:
		return nil, errNotObject
	default:
		return nil, errNotJSON
	}
	p.open = bytes.IndexByte(body, '{') + 1
	if p.modelBad {
		return p, errModelType
	}
	return p, nil
}

// member records one top-level member.
func (p *parsedBody) member(key, v []byte, sp span) {
	p.members = append(p.members, BodyMember{Key: key, Value: v})
	switch string(key) {
	case "model":
		switch {
		case v[0] == '"':
			s, err := unquote(v)
			if err != nil {
				p.modelBad = true
				return
			}
			p.model, p.hasModel, p.modelBad = s, s != "", false
		case bytes.Equal(v, []byte("null")):
			p.model, p.hasModel, p.modelBad = "", false, false
		default:
			p.modelBad = true
		}
	case "messages":
		p.messages = v
	case "prompt":
		p.prompt = v
	case "input":
		p.input = v
	case "previous_response_id":
		if v[0] == '"' {
			s, _ := unquote(v)
			p.previousResponseID = s != ""
		}
	case "cache_salt":
		p.saltValues = append(p.saltValues, sp)
		if v[0] == '"' {
			s, _ := unquote(v)
			p.cacheSalt = s
		} else {
			p.cacheSalt = ""
		}
	case "stream":
		p.stream = bytes.Equal(v, []byte("true"))
	case "nvext":
		p.nvext = v
	}
}

func unquote(v []byte) (string, error) {
	if bytes.IndexByte(v, '\\') < 0 {
		return string(v[1 : len(v)-1]), nil
	}
	var s string
	err := json.Unmarshal(v, &s)
	return s, err
}

// promptSource says where the prompt's token ids come from.
type promptSource struct {
	tokens []uint32 // completion token prompt ([int] or [[int]]): used directly, no tokenizer call
}

// validatePrompt checks the prompt field of kind (epp.md §5.3) and returns the direct token list of a
// completion token prompt. Errors are 400 (picker.KindBadRequest) naming the field.
func (p *parsedBody) validatePrompt(kind requestKind) (promptSource, error) {
	switch kind {
	case kindChat:
		if p.messages == nil {
			return promptSource{}, picker.Errorf(picker.KindBadRequest, "\"messages\" is required")
		}
		if p.messages[0] != '[' {
			return promptSource{}, picker.Errorf(picker.KindBadRequest, "\"messages\" must be an array")
		}
		empty := true
		jsonscan.Elements(p.messages, func([]byte, int, int) bool { empty = false; return false })
		if empty {
			return promptSource{}, picker.Errorf(picker.KindBadRequest, "\"messages\" must not be empty")
		}
	case kindCompletion:
		return validateCompletionPrompt(p.prompt)
	case kindResponses:
		if p.input == nil {
			return promptSource{}, picker.Errorf(picker.KindBadRequest, "\"input\" is required")
		}
		if p.input[0] != '"' && p.input[0] != '[' {
			return promptSource{}, picker.Errorf(picker.KindBadRequest, "\"input\" must be a string or an array")
		}
	}
	return promptSource{}, nil
}

// validateCompletionPrompt accepts string, [string], [int] and [[int]] (ids are u32); the first token
// list of a token prompt is returned.
func validateCompletionPrompt(v json.RawMessage) (promptSource, error) {
	bad := func() (promptSource, error) {
		return promptSource{}, picker.Errorf(picker.KindBadRequest,
			"\"prompt\" must be a string, an array of strings, an array of token ids or an array of token id arrays")
	}
	if v == nil {
		return promptSource{}, picker.Errorf(picker.KindBadRequest, "\"prompt\" is required")
	}
	switch v[0] {
	case '"':
		return promptSource{}, nil
	case '[':
	default:
		return bad()
	}
	// v is valid JSON (parseBody checked it), so its first element decides the form.
	i := jsonscan.SkipSpace(v, 1)
	if i >= len(v) || v[i] == ']' {
		return bad()
	}
	switch v[i] {
	case '"':
		ok := true
		jsonscan.Elements(v, func(e []byte, _, _ int) bool { ok = e[0] == '"'; return ok })
		if !ok {
			return bad()
		}
		return promptSource{}, nil
	case '[':
		// Every list is validated (a bad id in any of them is a 400), only the first is kept.
		// tokenjson rejects null and non-array lists, so mixed forms such as [[1],2] are a 400.
		ids, _, err := tokenjson.AppendFirstList(nil, v)
		if err != nil {
			return bad()
		}
		if ids == nil {
			// An empty first list ([[]]) must stay non-nil: nil tokens mean "tokenize the
			// prompt", empty ones are rejected as a prompt without tokens.
			ids = []uint32{}
		}
		return promptSource{tokens: ids}, nil
	default:
		// tokenjson, like encoding/json, accepts a null element as 0, but a null in a token prompt
		// is a 400. Once AppendIDs has accepted v it holds only brackets, commas, whitespace,
		// digits and null literals, so an 'n' anywhere is a null: one vectorised scan instead of a
		// second walk over the elements.
		ids, err := tokenjson.AppendIDs(nil, v)
		if err != nil || bytes.IndexByte(v, 'n') >= 0 {
			return bad()
		}
		return promptSource{tokens: ids}, nil
	}
}

// agentHints holds nvext fields read for routing (epp.md §5.5). Each is applied only when it parses.
type agentHints struct {
	priority, latencySensitivity *float64
	strictPriority, osl          *uint32
	doNotQueue                   bool
}

// parseNvext reads nvext.do_not_queue and nvext.agent_hints.{priority, latency_sensitivity,
// strict_priority, osl}. Malformed values are ignored.
func parseNvext(v json.RawMessage) agentHints {
	var h agentHints
	if len(v) == 0 || v[0] != '{' {
		return h
	}
	var nv struct {
		DoNotQueue json.RawMessage `json:"do_not_queue"`
		AgentHints json.RawMessage `json:"agent_hints"`
	}
	if json.Unmarshal(v, &nv) != nil {
		return h
	}
	h.doNotQueue = bytes.Equal(nv.DoNotQueue, []byte("true"))
	if len(nv.AgentHints) == 0 || nv.AgentHints[0] != '{' {
		return h
	}
	var ah struct {
		Priority           json.RawMessage `json:"priority"`
		LatencySensitivity json.RawMessage `json:"latency_sensitivity"`
		StrictPriority     json.RawMessage `json:"strict_priority"`
		OSL                json.RawMessage `json:"osl"`
	}
	if json.Unmarshal(nv.AgentHints, &ah) != nil {
		return h
	}
	h.priority = jsonFloat(ah.Priority)
	h.latencySensitivity = jsonFloat(ah.LatencySensitivity)
	h.strictPriority = jsonU32(ah.StrictPriority)
	h.osl = jsonU32(ah.OSL)
	return h
}

// jsonFloat parses a JSON number into a finite float64; nil for anything else.
func jsonFloat(v json.RawMessage) *float64 {
	if len(v) == 0 || !(v[0] == '-' || (v[0] >= '0' && v[0] <= '9')) {
		return nil
	}
	f, err := strconv.ParseFloat(string(v), 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return nil
	}
	return &f
}

// jsonU32 parses a JSON number with an integral value in [0, 2^32) ; nil for anything else.
func jsonU32(v json.RawMessage) *uint32 {
	f := jsonFloat(v)
	if f == nil || *f < 0 || *f != math.Trunc(*f) || *f > math.MaxUint32 {
		return nil
	}
	u := uint32(*f)
	return &u
}

// withCacheSalt returns body with every top-level cache_salt value replaced by salt, or with
// "cache_salt":salt appended as the last member when absent; other bytes and the key order are kept
// (epp.md §5.5 tenant isolation). The result is a new slice.
func (p *parsedBody) withCacheSalt(body []byte, salt string) ([]byte, error) {
	val, err := json.Marshal(salt)
	if err != nil {
		return nil, fmt.Errorf("encode cache_salt %q: %w", salt, err)
	}
	if len(p.saltValues) == 0 {
		out := make([]byte, 0, len(body)+len(val)+14)
		at := p.open
		out = append(out, body[:at]...)
		if p.lastValueEnd > 0 {
			at = p.lastValueEnd
			out = append(out[:0], body[:at]...)
			out = append(out, ',')
		}
		out = append(out, `"cache_salt":`...)
		out = append(out, val...)
		return append(out, body[at:]...), nil
	}
	out := make([]byte, 0, len(body)+len(val))
	prev := 0
	for _, sp := range p.saltValues {
		out = append(out, body[prev:sp.start]...)
		out = append(out, val...)
		prev = sp.end
	}
	return append(out, body[prev:]...), nil
}

// errEmptyTokens is the 400 for a prompt that tokenizes to nothing (epp.md §5.4).
var errEmptyTokens = picker.Errorf(picker.KindBadRequest, "the prompt tokenized to an empty token list")
