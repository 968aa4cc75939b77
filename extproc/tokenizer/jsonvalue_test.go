package tokenizer

import (
	"encoding/json"
	"math/rand"
	"strings"
	"testing"
)

func stringsReader(s string) *strings.Reader { return strings.NewReader(s) }

// TestDecodeOrderedAgreesWithEncodingJSON checks the hand-written parser accepts exactly the
// documents encoding/json accepts and decodes the same strings and numbers.
func TestDecodeOrderedAgreesWithEncodingJSON(t *testing.T) {
	docs := []string{
		`{}`, `[]`, `""`, `0`, `-0.0`, `1e400`, `{"a":1,"a":2}`, `{"k":"\u00e9\ud83d\ude80\n\"\\\/"}`, `"\ud800"`, `"\udc00x"`,
		` {"a" : [ 1 , 2.5e-3 , true , false , null ] } `, `{"a":}`, `[1,]`, `{"a":1,}`, `01`, `1.`, `.5`, `-`, `1e`, `"\x"`,
		"\"\x01\"", `"abc`, `{"a" 1}`, `[1 2]`, `tru`, `nul`, `{"a":1}x`, `{"\u0041":1}`, "\"\xff\xfe\"", `[[[[[]]]]]`,
	}
	r := rand.New(rand.NewSource(3))
	alphabet := []string{`{`, `}`, `[`, `]`, `"a"`, `"\u00e9"`, `:`, `,`, `1`, `-2.5e+3`, `true`, `null`, ` `, `"x\"y"`}
	for i := 0; i < 5000; i++ {
		s := ""
		for k := 0; k < 1+r.Intn(12); k++ {
			s += alphabet[r.Intn(len(alphabet))]
		}
		docs = append(docs, s)
	}
	for _, d := range docs {
		v, err := decodeOrdered([]byte(d))
		if valid := json.Valid([]byte(d)); valid != (err == nil) {
			t.Fatalf("%q: json.Valid = %v, decodeOrdered error = %v", d, valid, err)
		}
		if err != nil {
			continue
		}
		var ref any
		dec := json.NewDecoder(stringsReader(d))
		dec.UseNumber()
		if dec.Decode(&ref) != nil {
			continue
		}
		if !sameJSON(v, ref) {
			t.Fatalf("%q: decoded values differ", d)
		}
	}
	t.Run("duplicate keys keep the first position and the last value", func(t *testing.T) {
		v, err := decodeOrdered([]byte(`{"b":1,"a":2,"b":3}`))
		if err != nil {
			t.Fatal(err)
		}
		if len(v.keys) != 2 || v.keys[0] != "b" || v.get("b").s != "3" {
			t.Fatalf("keys %v, b = %v", v.keys, v.get("b"))
		}
	})
	t.Run("deep nesting is rejected, not a stack overflow", func(t *testing.T) {
		deep := make([]byte, 0, 2*(maxJSONDepth+10))
		for i := 0; i < maxJSONDepth+5; i++ {
			deep = append(deep, '[')
		}
		if _, err := decodeOrdered(deep); err == nil {
			t.Fatal("want an error")
		}
	})
}

func sameJSON(v *jval, ref any) bool {
	switch x := ref.(type) {
	case nil:
		return v.kind == jNull
	case bool:
		return v.kind == jBool && v.b == x
	case json.Number:
		return v.kind == jNumber && v.s == string(x)
	case string:
		return v.kind == jString && v.s == x
	case []any:
		if v.kind != jArray || len(v.arr) != len(x) {
			return false
		}
		for i := range x {
			if !sameJSON(v.arr[i], x[i]) {
				return false
			}
		}
		return true
	case map[string]any:
		if v.kind != jObject || len(v.keys) != len(x) {
			return false
		}
		for k, e := range x {
			if !sameJSON(v.get(k), e) {
				return false
			}
		}
		return true
	}
	return false
}

// TestDecodeValidAgreesWithDecodeOrdered: on valid JSON, decodeValid (which looks through strings
// for quotes and escapes only) decodes what decodeOrdered decodes, for strings with escaped
// quotes, backslashes, \u escapes, line-break escapes and invalid UTF-8 at every position of long
// and short texts.
func TestDecodeValidAgreesWithDecodeOrdered(t *testing.T) {
	r := rand.New(rand.NewSource(5))
	parts := []string{"plain text ", `\"`, `\\`, `\n`, `\u00e9`, `\ud83d\ude80`, "\xff", "é", `\/`, `\t`, "'", "<|im_end|>"}
	docs := []string{`{"role":"user","content":"hi"}`, `["a","b\"c",{"k":"\\"}]`, `"\\\""`, `""`, `"\""`}
	for i := 0; i < 3000; i++ {
		var b strings.Builder
		for k := r.Intn(40); k >= 0; k-- {
			b.WriteString(parts[r.Intn(len(parts))])
		}
		docs = append(docs, `{"role":"user","content":"`+b.String()+`","x":["`+b.String()+`",1]}`)
	}
	for _, d := range docs {
		want, err := decodeOrdered([]byte(d))
		if err != nil {
			t.Fatalf("%q: %v", d, err)
		}
		got, err := decodeValid([]byte(d))
		if err != nil {
			t.Fatalf("decodeValid(%q): %v", d, err)
		}
		if !sameJVal(got, want) {
			t.Fatalf("%q: decodeValid and decodeOrdered differ", d)
		}
	}
}

func sameJVal(a, b *jval) bool {
	if a.kind != b.kind || a.b != b.b || a.s != b.s || len(a.arr) != len(b.arr) || len(a.keys) != len(b.keys) {
		return false
	}
	for i := range a.arr {
		if !sameJVal(a.arr[i], b.arr[i]) {
			return false
		}
	}
	for i := range a.keys {
		if a.keys[i] != b.keys[i] || !sameJVal(a.vals[i], b.vals[i]) {
			return false
		}
	}
	return true
}
