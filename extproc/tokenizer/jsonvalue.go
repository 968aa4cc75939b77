package tokenizer

import (
	"bytes"
	"fmt"
	"math"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/ardanlabs/jinja"

	"github.com/kvepp/kvepp/internal/jsonscan"
)

// jkind is the JSON type of a jval.
type jkind uint8

const (
	jNull jkind = iota
	jBool
	jNumber
	jString
	jArray
	jObject
)

// jval is an order-keeping JSON value: objects keep their keys in document order (a repeated
// key keeps its first position and takes the last value, as Python's json.loads does).
type jval struct {
	kind jkind
	b    bool
	s    string // string value, or the number's literal text
	arr  []*jval
	keys []string
	vals []*jval
	idx  map[string]int // key → position, built once an object grows past a few keys
}

func (v *jval) get(key string) *jval {
	if v == nil || v.kind != jObject {
		return nil
	}
	if v.idx != nil {
		if i, ok := v.idx[key]; ok {
			return v.vals[i]
		}
		return nil
	}
	for i, k := range v.keys {
		if k == key {
			return v.vals[i]
		}
	}
	return nil
}

func (v *jval) set(key string, val *jval) {
	if v.idx != nil {
		if i, ok := v.idx[key]; ok {
			v.vals[i] = val
			return
		}
		v.idx[key] = len(v.keys)
	} else {
		for i, k := range v.keys {
			if k == key {
				v.vals[i] = val
				return
			}
		}
		if len(v.keys) >= 8 {
			v.idx = make(map[string]int, 16)
			for i, k := range v.keys {
				v.idx[k] = i
			}
			v.idx[key] = len(v.keys)
		}
	}
	if v.keys == nil { // room for a message's members at once, instead of growing 1, 2, 4
		v.keys, v.vals = make([]string, 0, 4), make([]*jval, 0, 4)
	}
	v.keys = append(v.keys, key)
	v.vals = append(v.vals, val)
}

// truthy is Python truthiness of the decoded value (None, False, 0, "", [], {} are false).
func (v *jval) truthy() bool {
	if v == nil {
		return false
	}
	switch v.kind {
	case jBool:
		return v.b
	case jNumber:
		f, err := strconv.ParseFloat(v.s, 64)
		return err != nil || f != 0
	case jString:
		return v.s != ""
	case jArray:
		return len(v.arr) > 0
	case jObject:
		return len(v.keys) > 0
	}
	return false
}

func (v *jval) typeName() string {
	if v == nil {
		return "missing"
	}
	return [...]string{"null", "boolean", "number", "string", "array", "object"}[v.kind]
}

func jstr(s string) *jval { return &jval{kind: jString, s: s} }

func newObject() *jval { return &jval{kind: jObject} }

// maxJSONDepth bounds nesting (encoding/json uses the same limit) so hostile bodies cannot
// exhaust the stack.
const maxJSONDepth = 10000

// decodeOrdered parses exactly one JSON value (RFC 8259) from data, keeping key order and
// number literals. It is a single-pass parser: json.Decoder.Token rescans every value several
// times, which dominated TokenizeChat on long prompts. Invalid UTF-8 and lone surrogate escapes
// become U+FFFD, as encoding/json does.
func decodeOrdered(data []byte) (*jval, error) {
	v, _, err := decodeOrderedLimit(data, MaxJSONValues)
	return v, err
}

// decodeValid is decodeOrdered for JSON known to be valid: a Request's members, which jsonscan
// validated (ParseRequest) or the caller did (RequestFromMembers). A string is then looked through
// only for its closing quote and for escapes, with the vectorised bytes.IndexByte: a prompt's text
// runs for kilobytes, and valid JSON has no control characters to look for. Input that is not
// valid after all is refused as decodeOrdered refuses it, except that a control character in a
// string is kept.
func decodeValid(data []byte) (*jval, error) {
	p := jsonParser{data: data, limit: MaxJSONValues, valid: true}
	v, err := p.document()
	return v, err
}

// MaxJSONValues bounds the values (objects, arrays, strings, numbers, literals) one decode of a
// request's JSON builds (250,000): every value is a tree node of about a hundred bytes, so a body
// of millions of zeros in a field no template reads would otherwise cost gigabytes.
const MaxJSONValues = 250_000

// decodeOrderedLimit is decodeOrdered building at most limit values; it also returns how many it
// built. More is an error.
func decodeOrderedLimit(data []byte, limit int) (*jval, int, error) {
	p := jsonParser{data: data, limit: limit}
	v, err := p.document()
	return v, p.values, err
}

// document parses exactly one JSON value, surrounded by optional whitespace.
func (p *jsonParser) document() (*jval, error) {
	p.skipWS()
	v, err := p.value(0)
	if err != nil {
		return nil, err
	}
	p.skipWS()
	if p.pos != len(p.data) {
		return nil, p.errorf("unexpected data after the top-level JSON value")
	}
	return v, nil
}

type jsonParser struct {
	data   []byte
	pos    int
	buf    []byte
	values int  // values built so far
	limit  int  // at most this many (0 = no bound: tokenizer files, not requests)
	valid  bool // the input is known to be valid JSON (decodeValid)
}

func (p *jsonParser) errorf(format string, args ...any) error {
	return fmt.Errorf("json offset %d: %s", p.pos, fmt.Sprintf(format, args...))
}

func (p *jsonParser) skipWS() {
	for p.pos < len(p.data) {
		switch p.data[p.pos] {
		case ' ', '\t', '\n', '\r':
			p.pos++
		default:
			return
		}
	}
}

func (p *jsonParser) value(depth int) (*jval, error) {
	if depth > maxJSONDepth {
		return nil, p.errorf("nesting deeper than %d", maxJSONDepth)
	}
	if p.values++; p.limit > 0 && p.values > p.limit {
		return nil, p.errorf("more than %d JSON values", p.limit)
	}
	if p.pos >= len(p.data) {
		return nil, p.errorf("unexpected end of input")
	}
	switch c := p.data[p.pos]; {
	case c == '{':
		p.pos++
		v := newObject()
		p.skipWS()
		if p.pos < len(p.data) && p.data[p.pos] == '}' {
			p.pos++
			return v, nil
		}
		for {
			p.skipWS()
			if p.pos >= len(p.data) || p.data[p.pos] != '"' {
				return nil, p.errorf("want an object key")
			}
			key, err := p.str()
			if err != nil {
				return nil, err
			}
			p.skipWS()
			if p.pos >= len(p.data) || p.data[p.pos] != ':' {
				return nil, p.errorf("want ':' after object key")
			}
			p.pos++
			p.skipWS()
			e, err := p.value(depth + 1)
			if err != nil {
				return nil, err
			}
			v.set(key, e)
			p.skipWS()
			if p.pos >= len(p.data) {
				return nil, p.errorf("unexpected end of input in object")
			}
			if p.data[p.pos] == ',' {
				p.pos++
				continue
			}
			if p.data[p.pos] == '}' {
				p.pos++
				return v, nil
			}
			return nil, p.errorf("want ',' or '}' in object")
		}
	case c == '[':
		p.pos++
		v := &jval{kind: jArray}
		p.skipWS()
		if p.pos < len(p.data) && p.data[p.pos] == ']' {
			p.pos++
			return v, nil
		}
		for {
			p.skipWS()
			e, err := p.value(depth + 1)
			if err != nil {
				return nil, err
			}
			v.arr = append(v.arr, e)
			p.skipWS()
			if p.pos >= len(p.data) {
				return nil, p.errorf("unexpected end of input in array")
			}
			if p.data[p.pos] == ',' {
				p.pos++
				continue
			}
			if p.data[p.pos] == ']' {
				p.pos++
				return v, nil
			}
			return nil, p.errorf("want ',' or ']' in array")
		}
	case c == '"':
		s, err := p.str()
		if err != nil {
			return nil, err
		}
		return jstr(s), nil
	case c == 't':
		return p.literal("true", &jval{kind: jBool, b: true})
	case c == 'f':
		return p.literal("false", &jval{kind: jBool})
	case c == 'n':
		return p.literal("null", &jval{kind: jNull})
	case c == '-' || (c >= '0' && c <= '9'):
		return p.number()
	}
	return nil, p.errorf("unexpected character %q", p.data[p.pos])
}

func (p *jsonParser) literal(word string, v *jval) (*jval, error) {
	if !bytes.HasPrefix(p.data[p.pos:], []byte(word)) {
		return nil, p.errorf("invalid literal")
	}
	p.pos += len(word)
	return v, nil
}

func (p *jsonParser) number() (*jval, error) {
	start := p.pos
	d := p.data
	i := p.pos
	if i < len(d) && d[i] == '-' {
		i++
	}
	digits := func() int {
		n := 0
		for i < len(d) && d[i] >= '0' && d[i] <= '9' {
			i++
			n++
		}
		return n
	}
	if i < len(d) && d[i] == '0' {
		i++
	} else if digits() == 0 {
		p.pos = i
		return nil, p.errorf("invalid number")
	}
	if i < len(d) && d[i] == '.' {
		i++
		if digits() == 0 {
			p.pos = i
			return nil, p.errorf("invalid number fraction")
		}
	}
	if i < len(d) && (d[i] == 'e' || d[i] == 'E') {
		i++
		if i < len(d) && (d[i] == '+' || d[i] == '-') {
			i++
		}
		if digits() == 0 {
			p.pos = i
			return nil, p.errorf("invalid number exponent")
		}
	}
	p.pos = i
	return &jval{kind: jNumber, s: string(d[start:i])}, nil
}

// str parses a string starting at the opening quote.
func (p *jsonParser) str() (string, error) {
	d := p.data
	i := p.pos + 1
	// Fast path: no escapes, no control characters, valid UTF-8.
	start, quote := i, -1
	if p.valid {
		i = plainEnd(d, i, &quote)
	} else {
		i = jsonscan.StringSpecial(d, i)
	}
	if i < len(d) && d[i] == '"' {
		if s := d[start:i]; utf8.Valid(s) {
			p.pos = i + 1
			if k, ok := chatWord(s); ok {
				return k, nil
			}
			return string(s), nil
		}
	}
	buf := append(p.buf[:0], d[start:i]...)
	for i < len(d) {
		j := 0
		if p.valid {
			j = plainEnd(d, i, &quote)
		} else {
			j = jsonscan.StringSpecial(d, i)
		}
		if j > i {
			buf = append(buf, d[i:j]...) // plain text up to the next quote, escape or control
			i = j
			continue
		}
		c := d[i]
		switch {
		case c == '"':
			p.pos = i + 1
			p.buf = buf
			if !utf8.Valid(buf) {
				return sanitizeUTF8(string(buf)), nil // each invalid byte → U+FFFD, as encoding/json
			}
			return string(buf), nil
		case c < 0x20:
			p.pos = i
			return "", p.errorf("control character in string")
		case c == '\\':
			if i+1 >= len(d) {
				p.pos = i
				return "", p.errorf("unterminated escape")
			}
			i++
			switch d[i] {
			case '"', '\\', '/':
				buf = append(buf, d[i])
			case 'b':
				buf = append(buf, '\b')
			case 'f':
				buf = append(buf, '\f')
			case 'n':
				buf = append(buf, '\n')
			case 'r':
				buf = append(buf, '\r')
			case 't':
				buf = append(buf, '\t')
			case 'u':
				r, ok := hex4(d, i+1)
				if !ok {
					p.pos = i
					return "", p.errorf("invalid \\u escape")
				}
				i += 4
				if utf16.IsSurrogate(r) {
					if r2, ok := hex4(d, i+3); ok && i+2 < len(d) && d[i+1] == '\\' && d[i+2] == 'u' {
						if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
							r = dec
							i += 6
						} else {
							r = utf8.RuneError
						}
					} else {
						r = utf8.RuneError
					}
				}
				buf = utf8.AppendRune(buf, r)
			default:
				p.pos = i
				return "", p.errorf("invalid escape \\%c", d[i])
			}
			i++
		default:
			buf = append(buf, c)
			i++
		}
	}
	p.pos = i
	return "", p.errorf("unterminated string")
}

// plainEnd returns the offset of the first '"' or '\\' at or after i in valid JSON (where a
// string's plain text ends), or len(d): two vectorised searches. *quote caches the offset of the
// next '"' (or len(d)) from one call to the next, so that a string with many escapes is searched
// for its quotes once, not once per escape.
func plainEnd(d []byte, i int, quote *int) int {
	if *quote < i {
		q := bytes.IndexByte(d[i:], '"')
		if q < 0 {
			q = len(d) - i
		}
		*quote = i + q
	}
	if b := bytes.IndexByte(d[i:*quote], '\\'); b >= 0 {
		return i + b
	}
	return *quote
}

func hex4(d []byte, i int) (rune, bool) {
	if i+4 > len(d) {
		return 0, false
	}
	var r rune
	for _, c := range d[i : i+4] {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}

// valueBuilder converts jvals into the template engine's values and remembers the literal text
// of integers too large for int64 (Python keeps them exact; the engine holds them as floats),
// keyed by the float's bits, so tojson can print them exactly.
type valueBuilder struct {
	bigInts map[uint64]string
}

func (vb *valueBuilder) value(v *jval) jinja.Value {
	if v == nil {
		return jinja.Undefined()
	}
	switch v.kind {
	case jNull:
		return jinja.None()
	case jBool:
		return jinja.NewBool(v.b)
	case jNumber:
		return vb.number(v.s)
	case jString:
		return jinja.NewString(v.s)
	case jArray:
		items := make([]jinja.Value, len(v.arr))
		for i, e := range v.arr {
			items[i] = vb.value(e)
		}
		return jinja.NewList(items)
	case jObject:
		d := jinja.NewDict()
		dd := d.AsDict()
		for i, k := range v.keys {
			dd.Set(k, vb.value(v.vals[i]))
		}
		return d
	}
	return jinja.Undefined()
}

func (vb *valueBuilder) number(lit string) jinja.Value {
	if !strings.ContainsAny(lit, ".eE") {
		if n, err := strconv.ParseInt(lit, 10, 64); err == nil {
			return jinja.NewInt(n)
		}
		f, _ := strconv.ParseFloat(lit, 64)
		if vb.bigInts == nil {
			vb.bigInts = make(map[uint64]string)
		}
		// Python prints int("-0") as 0, and big ints without leading zeros (JSON forbids them).
		vb.bigInts[math.Float64bits(f)] = lit
		return jinja.NewFloat(f)
	}
	f, _ := strconv.ParseFloat(lit, 64) // out of range → ±Inf, as Python's float()
	return jinja.NewFloat(f)
}

// chatWord returns the constant for the member names and roles every chat message repeats, so
// decoding them allocates nothing.
func chatWord(b []byte) (string, bool) {
	switch string(b) { // compared without converting
	case "role":
		return "role", true
	case "content":
		return "content", true
	case "user":
		return "user", true
	case "assistant":
		return "assistant", true
	case "system":
		return "system", true
	case "type":
		return "type", true
	case "text":
		return "text", true
	case "tool":
		return "tool", true
	case "name":
		return "name", true
	}
	return "", false
}
