package jsonscan

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"
)

var seeds = []string{
	``, ` `, `{}`, `[]`, `{"a":1}`, `{"a":[1,2,{"b":null}],"c":"x\"y\\u00e9"}`, `[1,]`, `{"a":1,}`, `{"a"}`,
	`{"a":01}`, `-0.5e+10`, `1.`, `.5`, `"\x01"`, "\"\t\"", `"\q"`, `"\u12G4"`, `tru`, `true false`, `nul`,
	`{"a":1}}`, `[[[[]]]]`, `{"a":-}`, `"unterminated`, `{"k":"v" , "k2" : [ true , false , null ] }`,
	"\xff\"\xfe\"", `"\ud800"`, `1e5`, `1E-5`, `-`, `{"a":1 "b":2}`,
	// Strings long enough for the eight-byte scan, with the special byte at every position.
	`"0123456789abcdef0123456789"`, `"0123456789ab"cdef0123456789"`, `"0123456789abc\"def0123456789"`,
	"\"0123456789abcd\x1fef0123456789\"", "\"héllo wörld — ünïcode ✓ 0123456789\"", `"01234567\\`,
	"\"0123456\x7f89\"", "\"01234567\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8\"",
}

func TestValidAgreesWithEncodingJSON(t *testing.T) {
	for _, s := range seeds {
		if got, want := Valid([]byte(s)), json.Valid([]byte(s)); got != want {
			t.Errorf("Valid(%q) = %v, json.Valid = %v", s, got, want)
		}
	}
	deep := strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1)
	if Valid([]byte(deep)) {
		t.Errorf("nesting beyond %d accepted", MaxDepth)
	}
}

// TestValidStringFindsEverySpecialByte puts a quote, a backslash or a control character at every
// offset of a long string: the eight-byte scan must stop exactly there.
func TestValidStringFindsEverySpecialByte(t *testing.T) {
	for _, special := range []string{`"`, `\n`, "\x00", "\x1f", `\`} {
		for at := 0; at < 40; at++ {
			s := `"` + strings.Repeat("a", at) + special + strings.Repeat("b", 40-at)
			end, ok := ValidString([]byte(s), 0)
			if special == `"` {
				if !ok || end != at+2 {
					t.Fatalf("%q: end %d ok %v", s, end, ok)
				}
				continue
			}
			if got, want := Valid([]byte(s+`"`)), json.Valid([]byte(s+`"`)); got != want {
				t.Fatalf("Valid(%q) = %v, json.Valid = %v", s+`"`, got, want)
			}
		}
	}
}

func TestObjectReportsMembersAndErrors(t *testing.T) {
	type m struct {
		key, val string
	}
	var got []m
	body := []byte(` {"a" : 1, "b\u0063":[1, {"x":"y"}],"a":"z"} `)
	err := Object(body, func(key []byte, s, e int) { got = append(got, m{string(key), string(body[s:e])}) })
	want := []m{{"a", "1"}, {"bc", `[1, {"x":"y"}]`}, {"a", `"z"`}}
	if err != nil || len(got) != len(want) {
		t.Fatalf("Object: %v %v", got, err)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("member %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	for in, want := range map[string]error{
		`[1]`: ErrNotObject, `"s"`: ErrNotObject, `{"a":}`: ErrNotJSON, `{"a":1} x`: ErrNotJSON, ``: ErrNotJSON,
		`{"a":` + strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1) + `}`: ErrTooDeep,
	} {
		if err := Object([]byte(in), func([]byte, int, int) {}); err != want {
			t.Errorf("Object(%.40q) = %v, want %v", in, err, want)
		}
	}
}

func TestObjectElementsListsTheLastArrayMember(t *testing.T) {
	body := []byte(`{"messages":[1,2],"x":[3],"messag\u0065s":[ {"a":[4]} , "s,]" ,5 ],"m":1}`)
	var spans [][2]int
	var keys []string
	err := ObjectElements(body, "messages", &spans, func(k []byte, _, _ int) { keys = append(keys, string(k)) })
	if err != nil || strings.Join(keys, ",") != "messages,x,messages,m" {
		t.Fatalf("members %v, %v", keys, err)
	}
	var got []string
	for _, sp := range spans {
		got = append(got, string(body[sp[0]:sp[1]]))
	}
	if strings.Join(got, "|") != `{"a":[4]}|"s,]"|5` {
		t.Fatalf("elements %q", got)
	}
	if err := ObjectElements([]byte(`{"messages":[1,}`), "messages", &spans, func([]byte, int, int) {}); err != ErrNotJSON {
		t.Fatalf("invalid array: %v", err)
	}
}

func TestElementsAndTypeName(t *testing.T) {
	v := []byte(`[ 1 , "a,b" , {"k":[2,3]}, [] ,null]`)
	var els []string
	Elements(v, func(e []byte, s, end int) bool {
		if string(v[s:end]) != string(e) {
			t.Fatalf("offsets %d..%d do not give %q", s, end, e)
		}
		els = append(els, string(e))
		return true
	})
	want := []string{"1", `"a,b"`, `{"k":[2,3]}`, "[]", "null"}
	if strings.Join(els, "|") != strings.Join(want, "|") {
		t.Fatalf("elements %q, want %q", els, want)
	}
	names := []string{TypeName(nil), TypeName([]byte("{}")), TypeName([]byte("[]")), TypeName([]byte(`""`)),
		TypeName([]byte("true")), TypeName([]byte("null")), TypeName([]byte("-1"))}
	if strings.Join(names, ",") != "missing,object,array,string,boolean,null,number" {
		t.Fatalf("type names %v", names)
	}
}

// FuzzValid checks the validator against encoding/json, and Object's members against a decode.
func FuzzValid(f *testing.F) {
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"x"}],"cache_salt":"s","stream":true}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if bytes.Count(b, []byte("[")) > 1000 {
			return // encoding/json's depth limit differs only in the error, not in validity
		}
		valid := json.Valid(b)
		if got := Valid(b); got != valid {
			t.Fatalf("Valid(%q) = %v, json.Valid = %v", b, got, valid)
		}
		if valid {
			start := SkipSpace(b, 0)
			end, _ := ValidValue(b, start, 0)
			if got := SkipValue(b, start); got != end {
				t.Fatalf("SkipValue(%q) = %d, ValidValue ends at %d", b, got, end)
			}
		}
		var obj map[string]json.RawMessage
		isObj := valid && json.Unmarshal(b, &obj) == nil && obj != nil // "null" unmarshals into a nil map
		seen := map[string]string{}
		err := Object(b, func(key []byte, s, e int) { seen[string(key)] = string(b[s:e]) })
		if isObj != (err == nil) {
			t.Fatalf("Object(%q) = %v, object %v", b, err, isObj)
		}
		if err == nil {
			for k, v := range obj {
				// encoding/json replaces invalid UTF-8 in keys; the scanner keeps the bytes.
				if !strings.ContainsRune(k, utf8.RuneError) && string(bytes.TrimSpace(v)) != seen[k] {
					t.Fatalf("member %q: %q, decode %q", k, seen[k], v)
				}
			}
		}
	})
}

func BenchmarkValid10KB(b *testing.B) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("lorem ipsum ", 850) + `"}],"stream":true}`)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if !Valid(body) {
			b.Fatal("invalid")
		}
	}
}

func TestMoreValuesThan(t *testing.T) {
	parts := func(n int) []byte {
		return []byte(`{"messages":[{"role":"user","content":[` + strings.Repeat(`{"type":"text"},`, n) + `{"type":"text"}]}]}`)
	}
	// parts(10): 4 containers before the parts, 11 part objects, 1 + 10 commas: 26.
	for _, tc := range []struct {
		body  []byte
		limit int
		want  bool
	}{
		{parts(10), 26, false},
		{parts(10), 25, true},
		{[]byte(`{"a":[` + strings.Repeat("0,", 99) + `0]}`), 101, false}, // 2 containers + 99 commas
		{[]byte(`{"a":[` + strings.Repeat("0,", 99) + `0]}`), 100, true},
		{[]byte(`{"a":"` + strings.Repeat("{[,", 1000) + `"}`), 10, false}, // inside a string: not counted
		{[]byte(`{"a":"\"` + strings.Repeat(",", 100) + `"}`), 10, false},  // nor after an escaped quote
	} {
		if got := MoreValuesThan(tc.body, tc.limit); got != tc.want {
			t.Errorf("MoreValuesThan(%.60s…, %d) = %v, want %v", tc.body, tc.limit, got, tc.want)
		}
	}
}
