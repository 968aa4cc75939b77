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
