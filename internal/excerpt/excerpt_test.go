package excerpt

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestOf(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"a short value is kept whole", "abc", "abc"},
		{"exactly the bound is kept whole", strings.Repeat("a", MaxBytes), strings.Repeat("a", MaxBytes)},
		{"a longer value is cut at the bound and marked", strings.Repeat("a", MaxBytes+1), strings.Repeat("a", MaxBytes) + "…"},
		{"a cut never splits a UTF-8 sequence", strings.Repeat("a", MaxBytes-1) + "é" + "b", strings.Repeat("a", MaxBytes-1) + "…"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Of(tc.in)
			if got != tc.want {
				t.Fatalf("Of = %q, want %q", got, tc.want)
			}
			if !utf8.ValidString(got) {
				t.Fatalf("Of = %q is not valid UTF-8", got)
			}
		})
	}
}

func TestClean(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		n        int
		want     string
	}{
		{"plain text is kept", "Not Found", 100, "Not Found"},
		{"control characters and invalid UTF-8 are dropped", "a\x00b\xffc\x1b[31md\u0085e\x7f", 100, "abc[31mde"},
		{"tabs and newlines become spaces, ends trimmed", "\n line one\n\tline two \r\n", 100, "line one  line two"},
		{"the result is bounded", strings.Repeat("é", 300), 100, strings.Repeat("é", 50) + "…"},
		{"a long dirty value is bounded too", strings.Repeat("\x00a", 1<<20), 10, strings.Repeat("a", 10) + "…"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Clean(tc.in, tc.n)
			if got != tc.want {
				t.Fatalf("Clean = %q, want %q", got, tc.want)
			}
		})
	}
}
