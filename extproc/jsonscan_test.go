package extproc

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/internal/jsonscan"
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
	f.Add([]byte(`{"messages":[1,{"a":"]"}],"messag\u0065s":[ "x" , [2] ],"messages":"s"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if bytes.Count(b, []byte("[")) > 1000 {
			return // encoding/json's depth limit differs only in the error, not in validity
		}
		valid := json.Valid(b)
		p, err := parseBody(b)
		var obj map[string]json.RawMessage
		isObj := valid && json.Unmarshal(b, &obj) == nil && obj != nil // "null" unmarshals into a nil map
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
		// The members are the body's, and the last messages array comes split into its elements.
		var last *BodyMember
		for i := range p.members {
			var v any
			if err := json.Unmarshal(p.members[i].Value, &v); err != nil {
				t.Fatalf("member %q value %q: %v", p.members[i].Key, p.members[i].Value, err)
			}
			if string(p.members[i].Key) == "messages" {
				last = &p.members[i]
			}
		}
		if last != nil && last.Value[0] == '[' {
			var want [][2]int
			jsonscan.Elements(last.Value, func(_ []byte, s, e int) bool { want = append(want, [2]int{s, e}); return true })
			if len(want) != len(last.Elements) || (len(want) > 0 && !slices.Equal(want, last.Elements)) {
				t.Fatalf("messages elements %v, want %v", last.Elements, want)
			}
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
