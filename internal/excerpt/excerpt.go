// Package excerpt shortens client-supplied text for error messages and logs, so an answer never
// echoes unbounded input: a 1 MB id in a request is quoted as its first 100 bytes and "…".
package excerpt

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// MaxBytes is how many bytes of a value Of keeps before marking the cut with "…".
const MaxBytes = 100

// Of returns s when it is at most MaxBytes long, else its longest prefix of at most MaxBytes bytes
// that does not split a UTF-8 sequence, followed by "…".
func Of(s string) string { return OfN(s, MaxBytes) }

// OfN is Of with a bound of n bytes (n > 0).
func OfN(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && cut > n-utf8.UTFMax && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}

// Clean returns text from another program (a server's error message, a peer's body) fit to
// quote in an answer or a log line: invalid UTF-8 and control characters (C0, DEL, C1) are
// dropped, except that tabs, newlines and carriage returns become one space each; surrounding
// spaces are trimmed; the result is cut to at most n bytes as OfN does (n > 0).
func Clean(s string, n int) string {
	clean := true
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f {
			clean = false
			break
		}
	}
	if !clean {
		var b strings.Builder
		b.Grow(min(len(s), n+utf8.UTFMax))
		for i := 0; i < len(s) && b.Len() <= n; {
			r, size := utf8.DecodeRuneInString(s[i:])
			i += size
			switch {
			case r == utf8.RuneError && size <= 1:
			case r == '\t' || r == '\n' || r == '\r':
				b.WriteByte(' ')
			case unicode.IsControl(r):
			default:
				b.WriteRune(r)
			}
		}
		s = b.String()
	}
	return OfN(strings.TrimSpace(s), n)
}
