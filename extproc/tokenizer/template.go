package tokenizer

import (
	"strings"
	"unicode"

	"github.com/ardanlabs/jinja"
)

// textVarName is the render variable holding template text that must bypass the engine's
// whitespace handling (see prepareTemplate).
const textVarName = "kvepp_text"

// preparedTemplate is a chat template source rewritten for ardanlabs/jinja.
type preparedTemplate struct {
	src   string
	texts jinja.Value // list of text pieces referenced as kvepp_text[i]
}

// prepareTemplate rewrites a Jinja template so that ardanlabs/jinja renders it as Python
// jinja2 does under transformers' settings (trim_blocks, lstrip_blocks, keep_trailing_newline
// false):
//
//   - Whitespace control is resolved here, with jinja2's lexer rules: newlines normalized to
//     "\n" and one trailing newline dropped; "-" markers strip all adjacent whitespace;
//     trim_blocks drops one newline after a block or comment tag unless "+%}"; lstrip_blocks
//     drops spaces and tabs before a block or comment tag when only they separate it from the
//     start of its line (or the end of a tag that ended a line), unless "{%+". The markers
//     are then removed. ardanlabs/jinja's own trimming is not equivalent: it strips the nearest
//     text segment even across intervening tags and treats the first text segment as the
//     template start, so "{{ a }} {% if b %}" lost its space.
//   - Text the engine could still alter (leading "\n", trailing spaces or tabs, raw-block
//     content) is emitted as {{ kvepp_text[i] }} with the exact text passed in at render.
//   - `|tojson` is renamed `|kvepp_tojson` (see tojsonFilterName).
func prepareTemplate(src string) preparedTemplate {
	src = strings.ReplaceAll(src, "\r\n", "\n")
	src = strings.ReplaceAll(src, "\r", "\n")
	src = strings.TrimSuffix(src, "\n")
	pieces := lexTemplate(src)

	// Resolve whitespace control on the text pieces.
	lineStarting := true
	for i := range pieces {
		p := &pieces[i]
		if !p.text {
			continue
		}
		var prev, next *tmplPiece
		if i > 0 {
			prev = &pieces[i-1]
		}
		if i+1 < len(pieces) {
			next = &pieces[i+1]
		}
		t := p.s
		if !p.raw {
			lineStarting = prev == nil
		}
		if prev != nil && !prev.text {
			switch {
			case prev.rmod == '-':
				trimmed := strings.TrimLeftFunc(t, unicode.IsSpace)
				consumed := t[:len(t)-len(trimmed)]
				lineStarting = strings.HasSuffix(consumed, "\n")
				t = trimmed
			case prev.kind != '{' && prev.rmod != '+' && strings.HasPrefix(t, "\n"):
				t = t[1:]
				lineStarting = true
			}
		}
		if next != nil && !next.text {
			switch {
			case next.lmod == '-':
				t = strings.TrimRightFunc(t, unicode.IsSpace)
			case next.kind != '{' && next.lmod != '+':
				lpos := strings.LastIndexByte(t, '\n') + 1
				if lpos > 0 || lineStarting {
					if strings.Trim(t[lpos:], " \t") == "" {
						t = t[:lpos]
					}
				}
			}
		}
		p.s = t
	}

	var b strings.Builder
	b.Grow(len(src) + 64)
	var texts []jinja.Value
	for _, p := range pieces {
		switch {
		case p.text:
			if p.s == "" {
				continue
			}
			safe := !p.raw && !strings.HasPrefix(p.s, "\n") && !strings.HasSuffix(p.s, " ") && !strings.HasSuffix(p.s, "\t")
			if safe {
				b.WriteString(p.s)
				continue
			}
			b.WriteString("{{ " + textVarName + "[")
			b.WriteString(itoa(len(texts)))
			b.WriteString("] }}")
			texts = append(texts, jinja.NewString(p.s))
		case p.kind == '#' || p.isRaw:
			// Comments and raw/endraw tags produce no output.
		case p.kind == '{':
			if ops, ok := concatChain(p.inner()); ok {
				for _, op := range ops {
					b.WriteString("{{ " + op + " }}")
				}
				continue
			}
			b.WriteString(p.s)
		default:
			b.WriteString(p.s)
		}
	}
	return preparedTemplate{src: b.String(), texts: jinja.NewList(texts)}
}

// concatChain splits an output expression `'lit' + e2 + … + en` into its operands, so that
// `{{ 'lit' + e2 + … }}` is emitted as `{{ 'lit' }}{{ e2 }}…`: the chat templates print each turn
// that way, and the engine would otherwise copy the growing string (a whole message content) once
// per '+'. The output is the same: in ardanlabs/jinja a '+' with a string operand concatenates
// the printed forms of both operands, so a chain that starts with a string literal prints the
// concatenation of every operand's printed form, evaluated left to right either way. ok is false
// unless the expression is exactly such a chain at its top level: nothing of lower precedence
// there ('-', '~', comparisons, and/or/not/in/is/if/else), no number with a signed exponent.
func concatChain(expr string) ([]string, bool) {
	expr = strings.TrimSpace(expr)
	if expr == "" || (expr[0] != '\'' && expr[0] != '"') {
		return nil, false
	}
	var ops []string
	depth, start := 0, 0
	for i := 0; i < len(expr); i++ {
		c := expr[i]
		switch {
		case c == '\'' || c == '"':
			j := i + 1
			for j < len(expr) && expr[j] != c {
				if expr[j] == '\\' {
					j++
				}
				j++
			}
			if j >= len(expr) {
				return nil, false
			}
			i = j
		case c == '(' || c == '[' || c == '{':
			depth++
		case c == ')' || c == ']' || c == '}':
			depth--
		case depth > 0:
		case c == '+':
			if i > 0 && (expr[i-1] == 'e' || expr[i-1] == 'E') && i > 1 && expr[i-2] >= '0' && expr[i-2] <= '9' {
				return nil, false // 1e+5
			}
			ops = append(ops, strings.TrimSpace(expr[start:i]))
			start = i + 1
		case c == '-' || c == '~' || c == '=' || c == '!' || c == '<' || c == '>':
			return nil, false
		case isIdentByte(c):
			j := i
			for j < len(expr) && (isIdentByte(expr[j]) || expr[j] == '.') {
				j++
			}
			switch expr[i:j] {
			case "if", "else", "or", "and", "not", "in", "is":
				return nil, false
			}
			i = j - 1
		}
	}
	ops = append(ops, strings.TrimSpace(expr[start:]))
	if len(ops) < 2 || depth != 0 {
		return nil, false
	}
	if !stringLiteral(ops[0]) {
		return nil, false
	}
	for _, op := range ops {
		if op == "" {
			return nil, false
		}
	}
	return ops, true
}

// stringLiteral reports whether s is exactly one quoted string literal.
func stringLiteral(s string) bool {
	if len(s) < 2 || (s[0] != '\'' && s[0] != '"') || s[len(s)-1] != s[0] {
		return false
	}
	q := s[0]
	for i := 1; i < len(s)-1; i++ {
		if s[i] == '\\' {
			i++
			continue
		}
		if s[i] == q {
			return false
		}
	}
	return true
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	var buf [20]byte
	i := len(buf)
	for n > 0 {
		i--
		buf[i] = byte('0' + n%10)
		n /= 10
	}
	return string(buf[i:])
}

// tmplPiece is text or one tag of a template source.
type tmplPiece struct {
	text  bool
	raw   bool   // text inside {% raw %}
	isRaw bool   // a raw / endraw tag
	kind  byte   // tag kind: '{' expression, '%' statement, '#' comment
	lmod  byte   // '-' or '+' after the opener, else 0
	rmod  byte   // '-' or '+' before the closer, else 0
	s     string // text, or the tag rewritten without markers (and with |tojson renamed)
}

// lexTemplate splits src into text and tags as jinja2's lexer does: string literals and
// bracket nesting inside tags are skipped when looking for the closer.
func lexTemplate(src string) []tmplPiece {
	var out []tmplPiece
	i := 0
	for i < len(src) {
		k := nextOpener(src, i)
		if k < 0 {
			out = append(out, tmplPiece{text: true, s: src[i:]})
			break
		}
		if k > i {
			out = append(out, tmplPiece{text: true, s: src[i:k]})
		}
		tag, end := lexTag(src, k)
		out = append(out, tag)
		i = end
		if tag.isRaw {
			// Raw content runs to the next {% endraw %}.
			j := i
			for {
				m := strings.Index(src[j:], "{%")
				if m < 0 {
					out = append(out, tmplPiece{text: true, raw: true, s: src[i:]})
					return out
				}
				m += j
				endTag, e := lexTag(src, m)
				if strings.TrimSpace(strings.Trim(endTag.inner(), "-+")) == "endraw" {
					if m > i {
						out = append(out, tmplPiece{text: true, raw: true, s: src[i:m]})
					}
					endTag.isRaw = true
					out = append(out, endTag)
					i = e
					break
				}
				j = m + 2
			}
		}
	}
	return out
}

func nextOpener(src string, from int) int {
	for i := from; i+1 < len(src); i++ {
		if src[i] == '{' && (src[i+1] == '{' || src[i+1] == '%' || src[i+1] == '#') {
			return i
		}
	}
	return -1
}

// inner returns the tag body without delimiters (markers already removed).
func (p tmplPiece) inner() string {
	if len(p.s) < 4 {
		return ""
	}
	return p.s[2 : len(p.s)-2]
}

// lexTag lexes the tag opening at k and returns it with the offset just past it. An
// unterminated tag runs to the end of the source (the engine then reports the error).
func lexTag(src string, k int) (tmplPiece, int) {
	p := tmplPiece{kind: src[k+1]}
	closer := "}}"
	switch p.kind {
	case '%':
		closer = "%}"
	case '#':
		closer = "#}"
	}
	j := k + 2
	if j < len(src) && (src[j] == '-' || (src[j] == '+' && p.kind != '{')) {
		p.lmod = src[j]
		j++
	}
	bodyStart := j
	var b strings.Builder
	b.WriteString(src[k : k+2])
	depth := 0
	var quote byte
	lastPipe := false
	seg := bodyStart // start of the body not yet copied
	for j < len(src) {
		c := src[j]
		if p.kind == '#' {
			if strings.HasPrefix(src[j:], closer) {
				if j > bodyStart && (src[j-1] == '-' || src[j-1] == '+') {
					p.rmod = src[j-1]
				}
				break
			}
			j++
			continue
		}
		if quote != 0 {
			if c == '\\' && j+1 < len(src) {
				j += 2
				continue
			}
			if c == quote {
				quote = 0
			}
			j++
			continue
		}
		if depth == 0 {
			if strings.HasPrefix(src[j:], closer) {
				break
			}
			if (c == '-' || (c == '+' && p.kind != '{')) && strings.HasPrefix(src[j+1:], closer) {
				p.rmod = c
				b.WriteString(src[seg:j])
				seg = j + 1
				j++
				break
			}
		}
		switch {
		case c == '\'' || c == '"':
			quote = c
			lastPipe = false
		case c == '(' || c == '[' || c == '{':
			depth++
			lastPipe = false
		case c == ')' || c == ']' || c == '}':
			lastPipe = false
			if depth > 0 {
				depth--
				if c == '}' && j+1 < len(src) && src[j+1] == '}' {
					// ardanlabs/jinja would take "}}" for the closer: separate the braces.
					b.WriteString(src[seg : j+1])
					b.WriteByte(' ')
					seg = j + 1
				}
			}
		case c == '|':
			lastPipe = true
		case c == ' ' || c == '\t' || c == '\n':
		case lastPipe && strings.HasPrefix(src[j:], "tojson") && (j+6 == len(src) || !isIdentByte(src[j+6])):
			b.WriteString(src[seg:j])
			b.WriteString(tojsonFilterName)
			j += len("tojson")
			seg = j
			lastPipe = false
			continue
		default:
			lastPipe = false
		}
		j++
	}
	if j > len(src) {
		j = len(src)
	}
	b.WriteString(src[seg:j])
	end := j + len(closer)
	if end > len(src) {
		end = len(src)
	} else {
		b.WriteString(closer)
	}
	p.s = b.String()
	if p.kind == '%' {
		p.isRaw = strings.TrimSpace(p.inner()) == "raw"
	}
	return p, end
}

func isIdentByte(c byte) bool {
	return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')
}
