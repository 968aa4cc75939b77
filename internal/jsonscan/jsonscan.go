// Package jsonscan validates JSON and walks valid JSON without decoding it: the one parse of a
// request body on kvepp's request path (epp.md §13.5). The ext_proc server validates a body and
// finds its top-level members with Object; the tokenizer then decodes only the members (and the
// message elements) it needs, from the same slices.
//
// Acceptance is encoding/json.Valid's (RFC 8259; strings are not checked for valid UTF-8), with
// nesting bounded at MaxDepth like encoding/json. Strings are scanned eight bytes at a time, which
// makes validation several times faster than json.Valid on prompt-sized bodies.
package jsonscan

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"math/bits"
)

// MaxDepth bounds nesting as encoding/json does; deeper input is invalid (never a stack blowup).
const MaxDepth = 10000

// Errors of Object.
var (
	// ErrNotJSON: the input is not valid JSON.
	ErrNotJSON = errors.New("not valid JSON")
	// ErrNotObject: valid JSON whose top level is not an object.
	ErrNotObject = errors.New("not a JSON object")
	// ErrTooDeep: the input would be valid JSON but nests deeper than MaxDepth.
	ErrTooDeep = errors.New("JSON nests too deep")
)

// SkipSpace returns the offset of the first byte at or after i that is not JSON whitespace.
func SkipSpace(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// Valid reports whether b is exactly one JSON value surrounded by optional whitespace.
func Valid(b []byte) bool {
	end, ok := ValidValue(b, SkipSpace(b, 0), 0)
	return ok && SkipSpace(b, end) == len(b)
}

// ValidValue reports whether b[i:] starts with one valid JSON value (leading whitespace already
// skipped) nested at depth, and returns the offset just past it.
func ValidValue(b []byte, i, depth int) (int, bool) {
	if i >= len(b) {
		return i, false
	}
	switch c := b[i]; {
	case c == '"':
		return ValidString(b, i)
	case c == '{':
		if depth >= MaxDepth {
			return i, false
		}
		return validObject(b, i, depth, memberHook{})
	case c == '[':
		if depth >= MaxDepth {
			return i, false
		}
		return validArray(b, i, depth, nil)
	case c == '-' || (c >= '0' && c <= '9'):
		return validNumber(b, i)
	case c == 't':
		return literal(b, i, "true")
	case c == 'f':
		return literal(b, i, "false")
	case c == 'n':
		return literal(b, i, "null")
	}
	return i, false
}

func literal(b []byte, i int, lit string) (int, bool) {
	if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
		return i, false
	}
	return i + len(lit), true
}

// SWAR constants: one byte value repeated in a 64-bit word.
const (
	ones  = 0x0101010101010101
	highs = 0x8080808080808080
)

// special returns a word whose high bit is set in every byte of w that needs a closer look inside
// a string: '"', '\\' or a control character (< 0x20). Bytes ≥ 0x80 never match.
func special(w uint64) uint64 {
	q := w ^ (ones * '"')
	s := w ^ (ones * '\\')
	return ((q-ones)&^q | (s-ones)&^s | (w - ones*0x20)) &^ w & highs
}

// StringSpecial returns the offset of the first byte at or after i that is '"', '\\' or a control
// character (< 0x20) — where a JSON string's plain text ends — or len(b) when there is none. It
// reads 32 bytes at a time (prompt text runs for kilobytes), then eight.
func StringSpecial(b []byte, i int) int {
	for i+32 <= len(b) {
		w := b[i : i+32]
		m0, m1 := special(binary.LittleEndian.Uint64(w)), special(binary.LittleEndian.Uint64(w[8:]))
		m2, m3 := special(binary.LittleEndian.Uint64(w[16:])), special(binary.LittleEndian.Uint64(w[24:]))
		if m0|m1|m2|m3 != 0 { // the lowest flagged byte of the first flagged word (special is exact there)
			switch {
			case m0 != 0:
				return i + bits.TrailingZeros64(m0)/8
			case m1 != 0:
				return i + 8 + bits.TrailingZeros64(m1)/8
			case m2 != 0:
				return i + 16 + bits.TrailingZeros64(m2)/8
			}
			return i + 24 + bits.TrailingZeros64(m3)/8
		}
		i += 32
	}
	for i+8 <= len(b) {
		if m := special(binary.LittleEndian.Uint64(b[i:])); m != 0 {
			return i + bits.TrailingZeros64(m)/8
		}
		i += 8
	}
	for i < len(b) && b[i] != '"' && b[i] != '\\' && b[i] >= 0x20 {
		i++
	}
	return i
}

// ValidString checks the string starting at b[i] == '"' and returns the offset past its closing
// quote.
func ValidString(b []byte, i int) (int, bool) {
	i++
	for {
		i = StringSpecial(b, i)
		if i >= len(b) {
			return i, false
		}
		switch c := b[i]; {
		case c == '"':
			return i + 1, true
		case c == '\\':
			if i+1 >= len(b) {
				return i, false
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if len(b)-i < 6 || !isHex(b[i+2]) || !isHex(b[i+3]) || !isHex(b[i+4]) || !isHex(b[i+5]) {
					return i, false
				}
				i += 6
			default:
				return i, false
			}
		default: // a control character
			return i, false
		}
	}
}

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

// validNumber checks -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? at b[i].
func validNumber(b []byte, i int) (int, bool) {
	if b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		i = digits(b, i)
	default:
		return i, false
	}
	if i < len(b) && b[i] == '.' {
		j := digits(b, i+1)
		if j == i+1 {
			return i, false
		}
		i = j
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		j := digits(b, i)
		if j == i {
			return i, false
		}
		i = j
	}
	return i, true
}

func digits(b []byte, i int) int {
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		i++
	}
	return i
}

// NestsTooDeep reports whether b opens more than MaxDepth arrays or objects at once (outside
// strings), which ValidValue refuses: it tells an over-deep body from malformed JSON for error
// messages.
func NestsTooDeep(b []byte) bool {
	depth := 0
	return outsideStrings(b, func(c byte) bool {
		switch c {
		case '[', '{':
			depth++
		case ']', '}':
			depth--
		}
		return depth > MaxDepth
	})
}

// MoreValuesThan reports whether b holds more than limit JSON values in all, counted outside
// strings as the arrays and objects opened plus the separating commas (each value after the
// first of an array or object follows one), which never undercounts by more than one. A body
// shorter than limit bytes cannot (each value but the first takes at least two bytes with its
// separator) and is not scanned.
func MoreValuesThan(b []byte, limit int) bool {
	if len(b) <= limit {
		return false
	}
	n := 0
	return outsideStrings(b, func(c byte) bool {
		if c == '[' || c == '{' || c == ',' {
			n++
		}
		return n > limit
	})
}

// outsideStrings calls visit with every byte of b that is not inside a string (string contents
// are skipped eight bytes at a time, StringSpecial) until visit returns true, and reports whether
// it did. b need not be valid JSON: an unterminated string runs to the end.
func outsideStrings(b []byte, visit func(c byte) bool) bool {
	for i := 0; i < len(b); i++ {
		if b[i] != '"' {
			if visit(b[i]) {
				return true
			}
			continue
		}
		for i = StringSpecial(b, i+1); i < len(b) && b[i] != '"'; i = StringSpecial(b, i) {
			if b[i] == '\\' {
				i++ // the escaped byte
			}
			i++
		}
	}
	return false
}

// Object validates body as one JSON object (surrounding whitespace allowed) and calls member for
// each top-level member in document order with its key (unescaped; a sub-slice of body unless the
// key has escapes) and the value's offsets [start, end) in body. It returns ErrNotJSON,
// ErrTooDeep or ErrNotObject for bodies that are not JSON objects; member is only called for
// bodies that are (validation runs member by member, so an invalid body may have reported some
// members before its error).
func Object(body []byte, member func(key []byte, start, end int)) error {
	return ObjectElements(body, "", nil, member)
}

// ObjectElements is Object that also lists, in *elements, the [start, end) offsets in body of the
// elements of every top-level member named arrayKey (its key unescaped) whose value is an array — the messages of a chat request, found in the same pass — replacing the list at each
// such member, so it holds the last one's (the member that counts).
func ObjectElements(body []byte, arrayKey string, elements *[][2]int, member func(key []byte, start, end int)) error {
	err := object(body, arrayKey, elements, member)
	if err == ErrNotJSON && NestsTooDeep(body) {
		return ErrTooDeep
	}
	return err
}

// validArray checks the array at b[i] == '[' nested at depth (below MaxDepth), appending the
// spans of its elements to *spans when spans is not nil.
func validArray(b []byte, i, depth int, spans *[][2]int) (int, bool) {
	i = SkipSpace(b, i+1)
	if i < len(b) && b[i] == ']' {
		return i + 1, true
	}
	for {
		start := i
		var ok bool
		if i, ok = ValidValue(b, i, depth+1); !ok {
			return i, false
		}
		if spans != nil {
			*spans = append(*spans, [2]int{start, i})
		}
		i = SkipSpace(b, i)
		if i >= len(b) {
			return i, false
		}
		if b[i] == ']' {
			return i + 1, true
		}
		if b[i] != ',' {
			return i, false
		}
		i = SkipSpace(b, i+1)
	}
}

func object(body []byte, arrayKey string, elements *[][2]int, member func(key []byte, start, end int)) error {
	i := SkipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		if Valid(body) {
			return ErrNotObject
		}
		return ErrNotJSON
	}
	end, ok := validObject(body, i, 0, memberHook{arrayKey: arrayKey, elements: elements, member: member})
	if !ok || SkipSpace(body, end) != len(body) {
		return ErrNotJSON
	}
	return nil
}

// memberHook is what the top-level object of ObjectElements reports: each member, and the
// elements of the array member named arrayKey. The zero hook reports nothing.
type memberHook struct {
	arrayKey string
	elements *[][2]int
	member   func(key []byte, start, end int)
}

// validObject checks the object at b[i] == '{' nested at depth (below MaxDepth) and returns the
// offset past it; with a hook, each member is reported (key unescaped) as it is validated.
func validObject(b []byte, i, depth int, hook memberHook) (int, bool) {
	i = SkipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return i + 1, true
	}
	for {
		if i >= len(b) || b[i] != '"' {
			return i, false
		}
		keyStart := i
		keyEnd, ok := ValidString(b, i)
		if !ok {
			return i, false
		}
		i = SkipSpace(b, keyEnd)
		if i >= len(b) || b[i] != ':' {
			return i, false
		}
		vs := SkipSpace(b, i+1)
		var key []byte
		if hook.member != nil {
			key = b[keyStart+1 : keyEnd-1]
			if bytes.IndexByte(key, '\\') >= 0 {
				var k string
				_ = json.Unmarshal(b[keyStart:keyEnd], &k) // valid (ValidString), so this cannot fail
				key = []byte(k)
			}
		}
		var ve int
		if hook.elements != nil && vs < len(b) && b[vs] == '[' && string(key) == hook.arrayKey {
			*hook.elements = (*hook.elements)[:0]
			ve, ok = validArray(b, vs, depth+1, hook.elements)
		} else {
			ve, ok = ValidValue(b, vs, depth+1)
		}
		if !ok {
			return ve, false
		}
		if hook.member != nil {
			hook.member(key, vs, ve)
		}
		i = SkipSpace(b, ve)
		if i >= len(b) {
			return i, false
		}
		if b[i] == '}' {
			return i + 1, true
		}
		if b[i] != ',' {
			return i, false
		}
		i = SkipSpace(b, i+1)
	}
}

// SkipString returns the offset just past the string starting at b[i] == '"'. b must be valid
// JSON there.
func SkipString(b []byte, i int) int {
	i++
	for {
		i = StringSpecial(b, i) // valid JSON: the special byte is '"' or '\\'
		switch {
		case i >= len(b):
			return len(b)
		case b[i] == '"':
			return i + 1
		default:
			i += 2
		}
	}
}

// SkipValue returns the offset just past the value starting at b[i]. b must be valid JSON there.
func SkipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		return SkipString(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				i = SkipString(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return len(b)
	default:
		for i < len(b) {
			switch b[i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return i
			}
			i++
		}
		return len(b)
	}
}

// Elements calls fn with every element of the JSON array v (valid JSON, v[0] == '['), and the
// element's offsets [start, end) in v, until fn returns false.
func Elements(v []byte, fn func(elem []byte, start, end int) bool) {
	i := SkipSpace(v, 1)
	for i < len(v) && v[i] != ']' {
		if v[i] == ',' {
			i = SkipSpace(v, i+1)
		}
		e := SkipValue(v, i)
		if !fn(v[i:e], i, e) {
			return
		}
		i = SkipSpace(v, e)
	}
}

// TypeName names the JSON type of a valid raw value ("object", "array", "string", "boolean",
// "null", "number"), or "missing" for an empty one.
func TypeName(v []byte) string {
	if len(v) == 0 {
		return "missing"
	}
	switch v[0] {
	case '{':
		return "object"
	case '[':
		return "array"
	case '"':
		return "string"
	case 't', 'f':
		return "boolean"
	case 'n':
		return "null"
	}
	return "number"
}
