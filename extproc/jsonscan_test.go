package extproc

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

var jsonSeeds = []string{
	``, ` `, `{}`, `[]`, `{"a":1}`, `{"a":[1,2,{"b":null}],"c":"x\"y\\u00e9"}`, `[1,]`, `{"a":1,}`, `{"a"}`,
	`{"a":01}`, `-0.5e+10`, `tru`, `true false`, `{"a":1}}`, `{"a":-}`, `"unterminated`, "\xff\"\xfe\"",
	`{"a":1 "b":2}`, `{"model":5}`, `{"model":null,"model":"m"}`,
}

// FuzzParseBody checks parseBody's acceptance against encoding/json and its field extraction
// against a full decode.
func FuzzParseBody(f *testing.F) {
	for _, s := range jsonSeeds {
		f.Add([]byte(s))
	}
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"x"}],"cache_salt":"s","stream":true}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if bytes.Count(b, []byte("[")) > 1000 {
			return // encoding/json's depth limit differs only in the error, not in validity
		}
		valid := json.Valid(b)
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
