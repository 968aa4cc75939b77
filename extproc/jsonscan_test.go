package extproc

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

var jsonSeeds = []string{
	``, ` `, `{}`, `[]`, `{"a":1}`, `{"a":[1,2,{"b":null}],"c":"x\"y\\u00e9"}`, `[1,]`, `{"a":1,}`, `{"a"}`,
	`{"a":01}`, `-0.5e+10`, `1.`, `.5`, `"\x01"`, "\"\t\"", `"\q"`, `"\u12G4"`, `tru`, `true false`, `nul`,
	`{"a":1}}`, `[[[[]]]]`, `{"a":-}`, `"unterminated`, `{"k":"v" , "k2" : [ true , false , null ] }`,
	"\xff\"\xfe\"", `"\ud800"`, `1e5`, `1E-5`, `-`, `{"a":1 "b":2}`,
}

func TestValidJSONAgreesWithEncodingJSON(t *testing.T) {
	for _, s := range jsonSeeds {
		if got, want := validJSON([]byte(s)), json.Valid([]byte(s)); got != want {
			t.Errorf("validJSON(%q) = %v, json.Valid = %v", s, got, want)
		}
	}
	deep := strings.Repeat("[", maxJSONDepth+1) + strings.Repeat("]", maxJSONDepth+1)
	if validJSON([]byte(deep)) {
		t.Errorf("nesting beyond %d accepted", maxJSONDepth)
	}
}

// FuzzValidJSON checks the validator against encoding/json and parseBody's field extraction
// against a full decode.
func FuzzValidJSON(f *testing.F) {
	for _, s := range jsonSeeds {
		f.Add([]byte(s))
	}
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"x"}],"cache_salt":"s","stream":true}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if bytes.Count(b, []byte("[")) > 1000 {
			return // encoding/json's depth limit differs only in the error, not in validity
		}
		valid := json.Valid(b)
		if got := validJSON(b); got != valid {
			t.Fatalf("validJSON(%q) = %v, json.Valid = %v", b, got, valid)
		}
		p, err := parseBody(b)
		var obj map[string]json.RawMessage
		isObj := valid && json.Unmarshal(b, &obj) == nil
		if isObj != (err == nil || err == errModelType) {
			t.Fatalf("parseBody(%q) err = %v, object = %v", b, err, isObj)
		}
		if err != nil {
			return
		}
		var m struct {
			Model *string `json:"model"`
		}
		if json.Unmarshal(b, &m) == nil && m.Model != nil && *m.Model != p.model {
			t.Fatalf("model %q, decode %q", p.model, *m.Model)
		}
		out, err := p.withCacheSalt(b, "t1")
		if err != nil {
			t.Fatal(err)
		}
		var salted struct {
			CacheSalt string `json:"cache_salt"`
		}
		if err := json.Unmarshal(out, &salted); err != nil || salted.CacheSalt != "t1" {
			t.Fatalf("withCacheSalt(%q) = %q (%v)", b, out, err)
		}
	})
}

func BenchmarkParseBody10KB(b *testing.B) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("lorem ipsum ", 850) + `"}],"stream":true}`)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := parseBody(body); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkEncodingJSONValid10KB(b *testing.B) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("lorem ipsum ", 850) + `"}],"stream":true}`)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if !json.Valid(body) {
			b.Fatal("invalid")
		}
	}
}
