package tokenizer

import (
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ardanlabs/jinja"
)

// Why a renamed filter: transformers replaces jinja2's tojson with
//
//	json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
//
// ardanlabs/jinja's built-in tojson prints float 1.0 as "1" (and 1e6 as "1e+06", big integers
// as floats), and its built-in filters cannot be replaced. The engine does, however, fall back to
// a callable in the render scope for filter names it does not know. So at Load the template
// source is rewritten (only inside {{ }} / {% %} tags, outside string literals) from
// `|tojson` to `|kvepp_tojson`, and every render puts pyToJSON under that name. Pre-rendering
// argument objects was rejected: it cannot cover tojson applied to values the template builds
// itself, while the filter covers every use.
const tojsonFilterName = "kvepp_tojson"

// jsonOpts are json.dumps' keyword arguments as transformers' tojson passes them.
type jsonOpts struct {
	ensureASCII bool
	indent      string
	hasIndent   bool
	itemSep     string
	keySep      string
	sortKeys    bool
	bigInts     map[uint64]string
}

// newToJSONFilter returns the tojson replacement for one render; bigInts holds the literal text
// of integers beyond int64 decoded from the request.
func newToJSONFilter(bigInts map[uint64]string) jinja.Value {
	return jinja.NewCallable(tojsonFilterName, func(args []jinja.Value, kwargs map[string]jinja.Value) (jinja.Value, error) {
		if len(args) == 0 {
			return jinja.Undefined(), fmt.Errorf("tojson: missing value")
		}
		o := jsonOpts{itemSep: ", ", keySep: ": ", bigInts: bigInts}
		// Positional arguments follow transformers' signature:
		// tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
		named := map[string]jinja.Value{}
		for i, name := range []string{"ensure_ascii", "indent", "separators", "sort_keys"} {
			if 1+i < len(args) {
				named[name] = args[1+i]
			}
		}
		for k, v := range kwargs {
			named[k] = v
		}
		for k, v := range named {
			switch k {
			case "ensure_ascii":
				o.ensureASCII = v.IsTruthy()
			case "sort_keys":
				o.sortKeys = v.IsTruthy()
			case "indent":
				switch {
				case v.IsNone() || v.IsUndefined():
				case v.IsInt():
					o.hasIndent = true
					if n := v.AsInt(); n > 0 {
						o.indent = strings.Repeat(" ", int(min(n, 64)))
					}
				case v.IsString():
					o.hasIndent = true
					o.indent = v.AsString()
				default:
					return jinja.Undefined(), fmt.Errorf("tojson: indent must be an int or a string, got %s", v.String())
				}
			case "separators":
			default:
				return jinja.Undefined(), fmt.Errorf("tojson: unexpected keyword argument %q", k)
			}
		}
		if o.hasIndent {
			o.itemSep = ","
		}
		if v, ok := named["separators"]; ok && !v.IsNone() && !v.IsUndefined() {
			if !v.IsList() || v.AsList().Len() != 2 || !v.AsList().Items[0].IsString() || !v.AsList().Items[1].IsString() {
				return jinja.Undefined(), fmt.Errorf("tojson: separators must be a pair of strings")
			}
			o.itemSep = v.AsList().Items[0].AsString()
			o.keySep = v.AsList().Items[1].AsString()
		}
		var sb strings.Builder
		if err := o.encode(&sb, args[0], 0); err != nil {
			return jinja.Undefined(), err
		}
		return jinja.NewString(sb.String()), nil
	})
}

// pyToJSON encodes v as Python's json.dumps(v, ensure_ascii=False) does: ", " and ": "
// separators, insertion key order, repr-style floats (1.0, -0.0, 1e+21, 1.5e-07), exact big
// integers.
func pyToJSON(v jinja.Value, bigInts map[uint64]string) (string, error) {
	var sb strings.Builder
	o := jsonOpts{itemSep: ", ", keySep: ": ", bigInts: bigInts}
	err := o.encode(&sb, v, 0)
	return sb.String(), err
}

func (o *jsonOpts) newline(sb *strings.Builder, level int) {
	sb.WriteByte('\n')
	for i := 0; i < level; i++ {
		sb.WriteString(o.indent)
	}
}

func (o *jsonOpts) encode(sb *strings.Builder, v jinja.Value, level int) error {
	switch {
	case v.IsNone():
		sb.WriteString("null")
	case v.IsBool():
		if v.AsBool() {
			sb.WriteString("true")
		} else {
			sb.WriteString("false")
		}
	case v.IsInt():
		sb.WriteString(strconv.FormatInt(v.AsInt(), 10))
	case v.IsFloat():
		f := v.AsFloat()
		if lit, ok := o.bigInts[math.Float64bits(f)]; ok {
			sb.WriteString(lit)
		} else {
			sb.WriteString(pyFloatRepr(f))
		}
	case v.IsString():
		o.encodeString(sb, v.AsString())
	case v.IsList():
		items := v.AsList().Items
		if len(items) == 0 {
			sb.WriteString("[]")
			return nil
		}
		sb.WriteByte('[')
		for i, it := range items {
			if i > 0 {
				sb.WriteString(o.itemSep)
			}
			if o.hasIndent {
				o.newline(sb, level+1)
			}
			if err := o.encode(sb, it, level+1); err != nil {
				return err
			}
		}
		if o.hasIndent {
			o.newline(sb, level)
		}
		sb.WriteByte(']')
	case v.IsDict():
		d := v.AsDict()
		keys := d.Keys
		if len(keys) == 0 {
			sb.WriteString("{}")
			return nil
		}
		if o.sortKeys {
			keys = append([]string(nil), keys...)
			sort.Strings(keys) // UTF-8 byte order is code point order, as Python sorts str
		}
		sb.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				sb.WriteString(o.itemSep)
			}
			if o.hasIndent {
				o.newline(sb, level+1)
			}
			o.encodeString(sb, k)
			sb.WriteString(o.keySep)
			val, _ := d.Get(k)
			if err := o.encode(sb, val, level+1); err != nil {
				return err
			}
		}
		if o.hasIndent {
			o.newline(sb, level)
		}
		sb.WriteByte('}')
	case v.IsUndefined():
		return fmt.Errorf("tojson: Object of type Undefined is not JSON serializable")
	default:
		return fmt.Errorf("tojson: value %s is not JSON serializable", v.String())
	}
	return nil
}

const hexDigits = "0123456789abcdef"

// encodeString writes s as Python's json encoder does: \" \\ \n \r \t \b \f, other control
// characters as lowercase \u00XX, everything else verbatim (ensure_ascii=False) or non-ASCII as
// \uXXXX with surrogate pairs (ensure_ascii=True).
func (o *jsonOpts) encodeString(sb *strings.Builder, s string) {
	sb.WriteByte('"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && (c < utf8.RuneSelf || !o.ensureASCII) {
			i++
			continue
		}
		sb.WriteString(s[start:i])
		if c >= utf8.RuneSelf {
			r, n := utf8.DecodeRuneInString(s[i:])
			if r > 0xFFFF {
				r -= 0x10000
				writeU4(sb, 0xD800+(r>>10))
				writeU4(sb, 0xDC00+(r&0x3FF))
			} else {
				writeU4(sb, r)
			}
			i += n
			start = i
			continue
		}
		switch c {
		case '"':
			sb.WriteString(`\"`)
		case '\\':
			sb.WriteString(`\\`)
		case '\n':
			sb.WriteString(`\n`)
		case '\r':
			sb.WriteString(`\r`)
		case '\t':
			sb.WriteString(`\t`)
		case '\b':
			sb.WriteString(`\b`)
		case '\f':
			sb.WriteString(`\f`)
		default:
			writeU4(sb, rune(c))
		}
		i++
		start = i
	}
	sb.WriteString(s[start:])
	sb.WriteByte('"')
}

func writeU4(sb *strings.Builder, r rune) {
	sb.WriteString(`\u`)
	sb.WriteByte(hexDigits[(r>>12)&0xF])
	sb.WriteByte(hexDigits[(r>>8)&0xF])
	sb.WriteByte(hexDigits[(r>>4)&0xF])
	sb.WriteByte(hexDigits[r&0xF])
}

// pyFloatRepr formats f as Python's float.__repr__ (and json.dumps): the shortest round-trip
// digits, positional with a ".0" when the decimal exponent is in [-4, 16), scientific otherwise
// (1e+16, 1.5e-07); NaN and infinities as json.dumps writes them.
func pyFloatRepr(f float64) string {
	switch {
	case math.IsNaN(f):
		return "NaN"
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	case f == 0:
		if math.Signbit(f) {
			return "-0.0"
		}
		return "0.0"
	}
	e := strconv.FormatFloat(f, 'e', -1, 64) // d[.ddd]e±XX, shortest digits
	k := strings.LastIndexByte(e, 'e')
	exp, _ := strconv.Atoi(e[k+1:])
	if exp < -4 || exp >= 16 {
		return e // Go and Python agree: mantissa without trailing ".0", exponent sign and ≥2 digits
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.ContainsAny(s, ".") {
		s += ".0"
	}
	return s
}
