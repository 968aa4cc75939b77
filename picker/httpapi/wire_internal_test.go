package httpapi

import (
	"encoding/json"
	"slices"
	"testing"
)

// FuzzTokenList checks the reflection-free token_ids decoder against encoding/json's own []uint32
// decoding: the same inputs are accepted, with the same values — except null elements, which
// encoding/json turns into 0 and the API rejects (a token id is an integer).
func FuzzTokenList(f *testing.F) {
	for _, s := range []string{`[]`, `[1,2,3]`, ` [ 1 , 2 ] `, `[4294967295]`, `[4294967296]`, `[-1]`, `[1.5]`, `[1e3]`,
		`["1"]`, `null`, `[null]`, `{}`, `[[1]]`, `[0]`, `[01]`, `[1,]`, `[`} {
		f.Add([]byte(`{"t":` + s + `}`))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var mine struct {
			T tokenList `json:"t"`
		}
		var ref struct {
			T []uint32 `json:"t"`
		}
		errMine := json.Unmarshal(body, &mine)
		errRef := json.Unmarshal(body, &ref)
		var ptrs struct {
			T []*uint32 `json:"t"`
		}
		if errRef == nil && json.Unmarshal(body, &ptrs) == nil && slices.Contains(ptrs.T, nil) {
			if errMine == nil {
				t.Fatalf("%q: a null token id was accepted", body)
			}
			return
		}
		if (errMine == nil) != (errRef == nil) {
			t.Fatalf("%q: tokenList error %v, encoding/json error %v", body, errMine, errRef)
		}
		if errMine == nil && (!slices.Equal([]uint32(mine.T), ref.T) || (mine.T == nil) != (ref.T == nil)) {
			t.Fatalf("%q: tokenList %v, encoding/json %v", body, mine.T, ref.T)
		}
	})
}
