package tokenizer

import (
	"regexp"
	"strings"
	"unicode"
)

// MaxTemplateSplitValues bounds the list elements a chat template's str.split calls may build
// from one request's strings (250,000, as MaxJSONValues): the value scan of the body counts a
// string as one value, but a template such as Qwen3's, which does content.split('</think>'),
// turns a 56 MB string of 7 million separators into a 7-million-element list of about 90 bytes
// per element. The bound is checked before rendering, from the template's split call sites and
// the request's strings (splitBudget), so such a request is refused with a 400 instead.
const MaxTemplateSplitValues = MaxJSONValues

// splitCallRE finds a str.split call in a template source: group 1 or 2 is a quoted literal
// separator, group 3 is set for a call without arguments; a call with any other argument matches
// with all three empty.
var splitCallRE = regexp.MustCompile(`\.\s*split\s*\(\s*(?:'((?:[^'\\]|\\.)*)'\s*\)|"((?:[^"\\]|\\.)*)"\s*\)|(\))|)`)

// splitBudget is what a template's split call sites can build: per site, the pieces of every
// string of the template's input (an upper bound per evaluation of the site on each string,
// which is how chat templates use split: once per message and site).
type splitBudget struct {
	seps   []string // one per call site with a literal separator (repeats kept: each site counts)
	fields int      // call sites without arguments (whitespace split, strings.Fields)
	// dynamic counts call sites whose separator is an expression: not bounded here (no chat
	// template known to kvepp has one), see the package README's Limits.
	dynamic int
}

// parseSplitBudget finds the split call sites of a chat template source.
func parseSplitBudget(src string) splitBudget {
	var b splitBudget
	for _, m := range splitCallRE.FindAllStringSubmatchIndex(src, -1) {
		switch {
		case m[2] >= 0:
			b.addLiteral(src[m[2]:m[3]])
		case m[4] >= 0:
			b.addLiteral(src[m[4]:m[5]])
		case m[6] >= 0:
			b.fields++
		default:
			b.dynamic++
		}
	}
	return b
}

// addLiteral records a site with a quoted separator; one with a backslash escape is counted as
// dynamic rather than unescaped here (no known template has one).
func (b *splitBudget) addLiteral(sep string) {
	if sep == "" || strings.Contains(sep, `\`) {
		b.dynamic++
		return
	}
	b.seps = append(b.seps, sep)
}

// check walks the template's input values and returns a *RequestError when the split call sites
// could build more than MaxTemplateSplitValues elements beyond one per string. Templates without
// split sites return at once.
func (b *splitBudget) check(values ...*jval) error {
	if len(b.seps) == 0 && b.fields == 0 {
		return nil
	}
	left := MaxTemplateSplitValues
	var walk func(v *jval) string
	walk = func(v *jval) string {
		if v == nil {
			return ""
		}
		switch v.kind {
		case jString:
			for _, sep := range b.seps {
				if left -= strings.Count(v.s, sep); left < 0 {
					return "split('" + sep + "')"
				}
			}
			if b.fields > 0 {
				if left -= b.fields * countFields(v.s); left < 0 {
					return "split()"
				}
			}
		case jArray:
			for _, e := range v.arr {
				if site := walk(e); site != "" {
					return site
				}
			}
		case jObject:
			for _, e := range v.vals {
				if site := walk(e); site != "" {
					return site
				}
			}
		}
		return ""
	}
	for _, v := range values {
		if site := walk(v); site != "" {
			return badRequest("the chat template's %s would build more than %d values from the request's text", site, MaxTemplateSplitValues)
		}
	}
	return nil
}

// countFields is len(strings.Fields(s)) without building the fields.
func countFields(s string) int {
	n, in := 0, false
	for _, r := range s {
		sp := unicode.IsSpace(r)
		if !sp && !in {
			n++
		}
		in = !sp
	}
	return n
}
