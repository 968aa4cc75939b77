package tokenizer

import (
	"slices"
	"testing"

	"github.com/ardanlabs/jinja"
)

func TestConcatChainSplitsOnlyStringChains(t *testing.T) {
	for _, tc := range []struct {
		expr string
		want []string
	}{
		{`'<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n'`,
			[]string{`'<|im_start|>'`, `message.role`, `'\n'`, `message.content`, `'<|im_end|>'`, `'\n'`}},
		{`"a+b" + x | trim + y[1:2] + f(a + b, 'c') + n * 2`, []string{`"a+b"`, `x | trim`, `y[1:2]`, `f(a + b, 'c')`, `n * 2`}},
		{`'it\'s' + x`, []string{`'it\'s'`, `x`}},
		{`x + 'a'`, nil},               // does not start with a string literal
		{`'a'`, nil},                   // no chain
		{`'a' + x - 1`, nil},           // '-' shares the level
		{`'a' + x ~ y`, nil},           // '~' is lower
		{`'a' + x if c else 'b'`, nil}, // inline if
		{`'a' + x == y`, nil},          // comparison
		{`'a' + x and y`, nil},
		{`'a' + x in y`, nil},
		{`'a' + x is defined`, nil},
		{`'a' + 1e+5`, nil},
		{`'a' + `, nil},
		{`'a' 'b' + x`, nil},
	} {
		got, ok := concatChain(tc.expr)
		if ok != (tc.want != nil) || !slices.Equal(got, tc.want) {
			t.Errorf("concatChain(%q) = %q, %v; want %q", tc.expr, got, ok, tc.want)
		}
	}
}

// TestConcatChainPrintsTheSame renders chains over values of every kind both ways with the engine.
func TestConcatChainPrintsTheSame(t *testing.T) {
	data := map[string]jinja.Value{
		"s": jinja.NewString("str"), "i": jinja.NewInt(7), "f": jinja.NewFloat(2.5), "n": jinja.None(),
		"b": jinja.NewBool(true), "l": jinja.NewList([]jinja.Value{jinja.NewInt(1), jinja.NewString("x")}),
	}
	for _, expr := range []string{
		`'<' + s + '>'`, `'a' + i + f`, `'a' + n + u + b`, `'a' + l`, `'a' + i * 2 + s | upper`,
		`'a' + (i + 1) + s[1:]`,
	} {
		whole, err := jinja.Compile("{{ " + expr + " }}")
		if err != nil {
			t.Fatal(err)
		}
		ops, ok := concatChain(expr)
		if !ok {
			t.Fatalf("%q not split", expr)
		}
		src := ""
		for _, op := range ops {
			src += "{{ " + op + " }}"
		}
		split, err := jinja.Compile(src)
		if err != nil {
			t.Fatal(err)
		}
		want, err1 := whole.RenderValues(data)
		got, err2 := split.RenderValues(data)
		if (err1 == nil) != (err2 == nil) || got != want {
			t.Errorf("%q: split renders %q (%v), whole %q (%v)", expr, got, err2, want, err1)
		}
	}
}
