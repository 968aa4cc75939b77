// Package excerpt shortens client-supplied text for error messages and logs, so an answer never
// echoes unbounded input: a 1 MB id in a request is quoted as its first 100 bytes and "…".
package excerpt

import "unicode/utf8"

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
