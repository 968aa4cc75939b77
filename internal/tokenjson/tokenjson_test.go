package tokenjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// stdIDs is the oracle for AppendIDs: encoding/json decoding into []uint32, except that a whole
// input of null, which encoding/json accepts as "leave the slice nil", is rejected by this package
// because it is not an array.
func stdIDs(v []byte) ([]uint32, bool) {
	if isNull(v) {
		return nil, false
	}
	var ids []uint32
	if err := json.Unmarshal(v, &ids); err != nil {
		return nil, false
	}
	return ids, true
}

// stdFirstList is the oracle for AppendFirstList: encoding/json decoding into [][]uint32, with the
// same null exception as stdIDs and one more: an inner null list, which encoding/json decodes as a
// nil []uint32 (an empty inner array decodes as a non-nil one), is rejected.
func stdFirstList(v []byte) (first []uint32, lists int, ok bool) {
	if isNull(v) {
		return nil, 0, false
	}
	var ll [][]uint32
	if err := json.Unmarshal(v, &ll); err != nil {
		return nil, 0, false
	}
	for _, l := range ll {
		if l == nil {
			return nil, 0, false // an inner null, rejected on purpose
		}
	}
	if len(ll) > 0 {
		first = ll[0]
	}
	return first, len(ll), true
}

func isNull(v []byte) bool {
	return string(bytes.Trim(v, " \t\r\n")) == "null"
}

// TestAppendIDsMatchesEncodingJSON pins the accept/reject decision of every case (so a change in
// either implementation shows up as a named failure) and checks the values against encoding/json.
func TestAppendIDsMatchesEncodingJSON(t *testing.T) {
	tests := []struct {
		name string
		in   string
		ok   bool
	}{
		{"empty array", `[]`, true},
		{"empty array with inner whitespace", "[ \t\r\n]", true},
		{"one id", `[7]`, true},
		{"zero", `[0]`, true},
		{"several ids", `[1,2,3]`, true},
		{"the largest u32", `[4294967295]`, true},
		{"whitespace everywhere JSON allows it", " \n[ 1 ,\t2\r\n, 3 ]\t", true},
		{"a comma and a space", `[1, 2, 3]`, true},
		{"a null element is 0 as in encoding/json", `[1,null,3]`, true},
		{"only null", `[null]`, true},

		{"one above the largest u32", `[4294967296]`, false},
		{"a very long number", `[` + strings.Repeat("9", 40) + `]`, false},
		{"negative", `[-1]`, false},
		{"negative zero", `[-0]`, false},
		{"a fraction", `[1.0]`, false},
		{"a zero fraction", `[0.0]`, false},
		{"an exponent", `[1e3]`, false},
		{"a capital exponent", `[1E3]`, false},
		{"zero with exponent", `[0e0]`, false},
		{"a leading zero", `[01]`, false},
		{"a double zero", `[00]`, false},
		{"a plus sign", `[+1]`, false},
		{"a string", `["1"]`, false},
		{"true", `[true]`, false},
		{"false", `[false]`, false},
		{"a nested array", `[[1]]`, false},
		{"an object", `[{}]`, false},
		{"a trailing comma", `[1,]`, false},
		{"a trailing comma and space", `[1, ]`, false},
		{"a leading comma", `[,1]`, false},
		{"a double comma", `[1,,2]`, false},
		{"a missing comma", `[1 2]`, false},
		{"trailing garbage", `[1]x`, false},
		{"a second array", `[1][2]`, false},
		{"unterminated", `[1,2`, false},
		{"unterminated after comma", `[1,`, false},
		{"only an open bracket", `[`, false},
		{"empty input", ``, false},
		{"only whitespace", `  `, false},
		{"the literal null", `null`, false}, // the one intended difference: encoding/json accepts it
		{"a number", `1`, false},
		{"a string value", `"[1]"`, false},
		{"an object value", `{"a":1}`, false},
		{"a truncated null", `[nul]`, false},
		{"null followed by letters", `[nullx]`, false},
		{"a number followed by letters", `[1x]`, false},
		{"hex", `[0x10]`, false},
		{"a dot alone", `[1.]`, false},
		{"a form feed is not JSON whitespace", "[\f1]", false},
		{"a vertical tab is not JSON whitespace", "[1\v]", false},
		{"a non-breaking space is not JSON whitespace", "[1\u00a0]", false},
		{"a byte order mark", "\ufeff[1]", false},
		{"a closing brace", `[1}`, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			want, wantOK := stdIDs([]byte(tc.in))
			if wantOK != tc.ok && tc.in != "null" {
				t.Fatalf("the table says ok=%v but encoding/json says %v", tc.ok, wantOK)
			}
			got, err := AppendIDs(nil, []byte(tc.in))
			if (err == nil) != tc.ok {
				t.Fatalf("AppendIDs(%q) error %v, want ok=%v", tc.in, err, tc.ok)
			}
			if err != nil {
				var e *Error
				if !errors.As(err, &e) {
					t.Fatalf("error %T is not *Error", err)
				}
				return
			}
			if !slices.Equal(got, want) {
				t.Errorf("AppendIDs(%q) = %v, encoding/json gives %v", tc.in, got, want)
			}
		})
	}
}

func TestAppendFirstListMatchesEncodingJSON(t *testing.T) {
	tests := []struct {
		name      string
		in        string
		ok        bool
		wantLists int
	}{
		{"one list", `[[1,2,3]]`, true, 1},
		{"two lists, the first kept", `[[1,2],[3]]`, true, 2},
		{"an empty outer array", `[]`, true, 0},
		{"an empty inner array", `[[]]`, true, 1},
		{"whitespace everywhere", " [ [ 1 , 2 ] ,\n[ 3 ] ] ", true, 2},
		{"an inner null list is rejected, unlike encoding/json", `[[1],null]`, false, 0},
		{"a first null list is rejected, unlike encoding/json", `[null,[1]]`, false, 0},
		{"a lone null list", `[null]`, false, 0},
		{"null ids inside a list", `[[null,1]]`, true, 1},

		{"a bad id in a later list", `[[1],[1.5]]`, false, 0},
		{"an out-of-range id in a later list", `[[1],[4294967296]]`, false, 0},
		{"a negative id in the first list", `[[-1]]`, false, 0},
		{"a flat list", `[1,2]`, false, 0},
		{"a string list", `[["a"]]`, false, 0},
		{"a trailing comma in the outer array", `[[1],]`, false, 0},
		{"a trailing comma in an inner array", `[[1,]]`, false, 0},
		{"a missing comma between lists", `[[1][2]]`, false, 0},
		{"unterminated", `[[1]`, false, 0},
		{"trailing garbage", `[[1]] x`, false, 0},
		{"the literal null", `null`, false, 0},
		{"deeper nesting", `[[[1]]]`, false, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			want, wantLists, wantOK := stdFirstList([]byte(tc.in))
			if wantOK != tc.ok {
				t.Fatalf("the table says ok=%v but the oracle says %v", tc.ok, wantOK)
			}
			got, lists, err := AppendFirstList(nil, []byte(tc.in))
			if (err == nil) != tc.ok {
				t.Fatalf("AppendFirstList(%q) error %v, want ok=%v", tc.in, err, tc.ok)
			}
			if err != nil {
				return
			}
			if lists != wantLists || lists != tc.wantLists || !slices.Equal(got, want) {
				t.Errorf("AppendFirstList(%q) = %v, %d lists; encoding/json gives %v, %d lists", tc.in, got, lists, want, wantLists)
			}
		})
	}
}

func TestErrorMessages(t *testing.T) {
	tests := []struct {
		in, want string
	}{
		{`[1,2,3,-4]`, "tokenjson: token id at index 3 is negative, not an integer in 0..4294967295 (offset 7)"},
		{`[1,2,3,4.5]`, "tokenjson: token id at index 3 is not an integer in 0..4294967295 (offset 7)"},
		{`[4294967296]`, "tokenjson: token id at index 0 is not an integer in 0..4294967295 (offset 1)"},
		{`[1,"2"]`, "tokenjson: token id at index 1 is a string, not an integer in 0..4294967295 (offset 3)"},
		{`[01]`, "tokenjson: token id at index 0 has a leading zero, which JSON does not allow (offset 1)"},
		{`[1 2]`, "tokenjson: token id at index 0 is followed by invalid character '2', want ',' or ']' (offset 3)"},
		{`[1,]`, "tokenjson: trailing comma before ']' (offset 3)"},
		{`[1]x`, "tokenjson: unexpected data after the array (offset 3)"},
		{`[1,2`, "tokenjson: unexpected end of input (offset 4)"},
		{`{}`, `tokenjson: not a JSON array: found '{', want '[' (offset 0)`},
	}
	for _, tc := range tests {
		_, err := AppendIDs(nil, []byte(tc.in))
		if err == nil || err.Error() != tc.want {
			t.Errorf("AppendIDs(%q) error\n %v\nwant\n %s", tc.in, err, tc.want)
		}
	}
	_, _, err := AppendFirstList(nil, []byte(`[[1],[2,true]]`))
	if want := "tokenjson: token id at index 1 of list 1 is a boolean or invalid, not an integer in 0..4294967295 (offset 8)"; err == nil || err.Error() != want {
		t.Errorf("AppendFirstList error\n %v\nwant\n %s", err, want)
	}
	var e *Error
	if !errors.As(err, &e) || e.List != 1 || e.Index != 1 || e.Offset != 8 {
		t.Errorf("error fields %+v", e)
	}
}

// TestAppendKeepsDst checks the append contract: ids go after dst's elements, and an error leaves
// dst's length as it was.
func TestAppendKeepsDst(t *testing.T) {
	dst := []uint32{9, 8}
	got, err := AppendIDs(dst, []byte(`[1,2]`))
	if err != nil || !slices.Equal(got, []uint32{9, 8, 1, 2}) {
		t.Fatalf("AppendIDs = %v, %v", got, err)
	}
	got, err = AppendIDs(dst, []byte(`[1,x]`))
	if err == nil || !slices.Equal(got, []uint32{9, 8}) {
		t.Fatalf("AppendIDs on error = %v, %v; want dst unchanged and an error", got, err)
	}
	got, lists, err := AppendFirstList(dst, []byte(`[[1,2],[3]]`))
	if err != nil || lists != 2 || !slices.Equal(got, []uint32{9, 8, 1, 2}) {
		t.Fatalf("AppendFirstList = %v, %d, %v", got, lists, err)
	}
	got, lists, err = AppendFirstList(dst, []byte(`[[1,2],[x]]`))
	if err == nil || lists != 0 || !slices.Equal(got, []uint32{9, 8}) {
		t.Fatalf("AppendFirstList on error = %v, %d, %v", got, lists, err)
	}
	if got, _ := AppendIDs(nil, []byte(`[]`)); got != nil {
		t.Errorf("AppendIDs(nil, []) = %#v, want nil", got)
	}
}

func TestLargeArray(t *testing.T) {
	v := benchInput(16384)
	got, err := AppendIDs(nil, v)
	want, ok := stdIDs(v)
	if err != nil || !ok || !slices.Equal(got, want) {
		t.Fatalf("16k ids: err %v, std ok %v, equal %v", err, ok, slices.Equal(got, want))
	}
	if cap(got) != len(got) {
		t.Errorf("cap %d for %d ids: the comma count should size the slice exactly", cap(got), len(got))
	}
}

func FuzzAppendIDs(f *testing.F) {
	for _, s := range []string{
		`[]`, `[1,2,3]`, `[4294967295]`, `[4294967296]`, `[null]`, `[0]`, `[01]`, `[1.0]`, `[1e3]`,
		`[-1]`, `["1"]`, `[1,]`, ` [ 1 , 2 ] `, `null`, `[[1,2],[3]]`, `[[1],null]`, `[[]]`, `[1]x`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, v []byte) {
		prefix := []uint32{42}
		got, err := AppendIDs(prefix, v)
		want, ok := stdIDs(v)
		if (err == nil) != ok {
			t.Fatalf("AppendIDs(%q): error %v, encoding/json ok=%v", v, err, ok)
		}
		if len(got) == 0 || got[0] != 42 {
			t.Fatalf("AppendIDs(%q) lost dst: %v", v, got)
		}
		if ok && !slices.Equal(got[1:], want) {
			t.Fatalf("AppendIDs(%q) = %v, encoding/json gives %v", v, got[1:], want)
		}
		if !ok && len(got) != 1 {
			t.Fatalf("AppendIDs(%q) returned %v on error, want dst", v, got)
		}

		first, lists, err := AppendFirstList(prefix, v)
		wantFirst, wantLists, ok := stdFirstList(v)
		if (err == nil) != ok {
			t.Fatalf("AppendFirstList(%q): error %v, encoding/json ok=%v", v, err, ok)
		}
		if len(first) == 0 || first[0] != 42 {
			t.Fatalf("AppendFirstList(%q) lost dst: %v", v, first)
		}
		if ok && (lists != wantLists || !slices.Equal(first[1:], wantFirst)) {
			t.Fatalf("AppendFirstList(%q) = %v, %d lists; encoding/json gives %v, %d lists", v, first[1:], lists, wantFirst, wantLists)
		}
	})
}

// benchInput is a JSON array of n ids drawn from a 152k vocabulary (Qwen-sized), formatted as
// json.Marshal formats []uint32.
func benchInput(n int) []byte {
	r := rand.New(rand.NewPCG(1, 2))
	b := []byte{'['}
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(r.IntN(151936)), 10)
	}
	return append(b, ']')
}

func BenchmarkAppendIDs(b *testing.B) {
	v := benchInput(16384)
	b.SetBytes(int64(len(v)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := AppendIDs(nil, v); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkAppendIDsReuse(b *testing.B) {
	v := benchInput(16384)
	var dst []uint32
	b.SetBytes(int64(len(v)))
	b.ReportAllocs()
	for b.Loop() {
		var err error
		if dst, err = AppendIDs(dst[:0], v); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkAppendFirstList(b *testing.B) {
	v := append(append([]byte{'['}, benchInput(16384)...), ']')
	b.SetBytes(int64(len(v)))
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := AppendFirstList(nil, v); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkUnmarshalStdlib(b *testing.B) {
	v := benchInput(16384)
	b.SetBytes(int64(len(v)))
	b.ReportAllocs()
	for b.Loop() {
		var ids []uint32
		if err := json.Unmarshal(v, &ids); err != nil {
			b.Fatal(err)
		}
	}
}
