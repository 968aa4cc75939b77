// Package tokenjson parses JSON arrays of token ids ([1,2,3] and [[1,2],[3]]) into uint32s.
//
// Token prompts carry tens of thousands of ids (tens of kilobytes of JSON) per request, and decoding
// them with encoding/json (reflection, a separate validation pass, a per-element state machine) was
// a quarter to a third of the CPU of the services that read them. This package does the same job in
// one pass, allocating nothing on success beyond the result slice.
//
// Acceptance is that of encoding/json decoding into []uint32 (or [][]uint32): the input must be valid
// JSON (RFC 8259 whitespace, no leading zeros, no trailing commas or trailing data), and every
// element must be a JSON integer in 0..4294967295 written without fraction or exponent ("1.0" and
// "1e3" are rejected, as encoding/json rejects them for unsigned integers) or null, which
// encoding/json leaves as the zero value and this package therefore decodes as 0. The intended
// differences: the whole input being the literal null is an error here (it is not an array), while
// encoding/json accepts it and leaves the slice nil; and AppendFirstList rejects an inner list that
// is null, which encoding/json decodes as a nil list.
package tokenjson

import (
	"bytes"
	"fmt"
	"math"
	"slices"

	"github.com/kvepp/kvepp/internal/jsonscan"
)

// Error says why an input is not a JSON array of token ids. Every error this package returns is an
// *Error.
type Error struct {
	// Offset is the byte offset in the input at which the problem was found.
	Offset int
	// List is the index of the inner array holding the bad element for the [[int]] form
	// (AppendFirstList), and -1 otherwise.
	List int
	// Index is the index of the bad element within its array, or -1 when the problem is not an
	// element (a missing '[', a misplaced comma, trailing data, ...).
	Index int
	// Reason describes the problem, e.g. "is not an integer in 0..4294967295".
	Reason string
}

// Error formats the problem with its position, e.g.
// "tokenjson: token id at index 3 is not an integer in 0..4294967295 (offset 9)".
func (e *Error) Error() string {
	switch {
	case e.Index < 0:
		return fmt.Sprintf("tokenjson: %s (offset %d)", e.Reason, e.Offset)
	case e.List >= 0:
		return fmt.Sprintf("tokenjson: token id at index %d of list %d %s (offset %d)", e.Index, e.List, e.Reason, e.Offset)
	default:
		return fmt.Sprintf("tokenjson: token id at index %d %s (offset %d)", e.Index, e.Reason, e.Offset)
	}
}

// Reasons shared by several error sites.
const (
	reasonNotID = "is not an integer in 0..4294967295"
	reasonEOF   = "unexpected end of input"
)

// AppendIDs parses v, a JSON array of token ids such as [1, 2, 3], and appends the ids to dst in
// order. Whitespace may surround v and its tokens as JSON allows; [] appends nothing (and so
// returns dst unchanged, which is nil when dst is nil).
//
// Every element must be an integer in 0..4294967295 without sign, fraction or exponent, or null
// (appended as 0, matching encoding/json). Anything else — other JSON values, invalid JSON, a value
// other than an array, trailing data — is an *Error naming the offset and, for a bad element, its
// index. On error the returned slice is dst with its original length (appended ids are dropped, its
// spare capacity may have been written). AppendIDs never panics.
func AppendIDs(dst []uint32, v []byte) ([]uint32, error) {
	n0 := len(dst)
	i := SkipSpace(v, 0)
	if i >= len(v) || v[i] != '[' {
		return dst, notArray(v, i, -1)
	}
	out, end, err := parseList(dst, v, i, -1, true)
	if err != nil {
		return dst[:n0], err
	}
	if end = SkipSpace(v, end); end != len(v) {
		return dst[:n0], &Error{Offset: end, List: -1, Index: -1, Reason: "unexpected data after the array"}
	}
	return out, nil
}

// AppendFirstList parses v, a JSON array of token id arrays such as [[1, 2], [3]] (the batched
// token prompt form), appends the ids of the first inner array to dst and returns the number of
// inner arrays as lists. Later inner arrays are checked exactly as strictly as the first (a bad id
// anywhere is an error) but their ids are not kept, because callers route on the first prompt only.
//
// Each inner array follows AppendIDs' rules (so a null id is 0); an empty outer array [] gives
// lists 0. Unlike encoding/json decoding into [][]uint32, which turns an inner null into a nil list,
// an inner null is an error: no caller has a meaning for a null prompt in a batch, and rejecting it
// here spares them a second pass over the input to look for one. The whole input being null, or
// any other non-array, is also an error. On error the returned slice is dst with its original
// length and lists is 0. AppendFirstList never panics.
func AppendFirstList(dst []uint32, v []byte) (ids []uint32, lists int, err error) {
	n0 := len(dst)
	i := SkipSpace(v, 0)
	if i >= len(v) || v[i] != '[' {
		return dst, 0, notArray(v, i, -1)
	}
	i = SkipSpace(v, i+1)
	if i < len(v) && v[i] == ']' {
		if i = SkipSpace(v, i+1); i != len(v) {
			return dst, 0, &Error{Offset: i, List: -1, Index: -1, Reason: "unexpected data after the array"}
		}
		return dst, 0, nil
	}
	for {
		if i >= len(v) {
			return dst[:n0], 0, &Error{Offset: i, List: -1, Index: -1, Reason: reasonEOF}
		}
		if v[i] != '[' {
			return dst[:n0], 0, notArray(v, i, lists)
		}
		keep := lists == 0
		out, e, err := parseList(dst, v, i, lists, keep)
		if err != nil {
			return dst[:n0], 0, err
		}
		if keep {
			dst = out
		}
		i = e
		lists++
		i = SkipSpace(v, i)
		if i >= len(v) {
			return dst[:n0], 0, &Error{Offset: i, List: -1, Index: -1, Reason: reasonEOF}
		}
		if v[i] == ']' {
			break
		}
		if v[i] != ',' {
			return dst[:n0], 0, &Error{Offset: i, List: -1, Index: -1,
				Reason: fmt.Sprintf("invalid character %q after list %d, want ',' or ']'", v[i], lists-1)}
		}
		i = SkipSpace(v, i+1)
	}
	if i = SkipSpace(v, i+1); i != len(v) {
		return dst[:n0], 0, &Error{Offset: i, List: -1, Index: -1, Reason: "unexpected data after the array"}
	}
	return dst, lists, nil
}

// parseList parses the array of ids starting at v[i] == '[' and returns the offset just past its
// ']'. When keep is false the ids are validated but not appended. list is the list index for
// errors (-1 for a lone array). On error the returned slice is meaningless.
func parseList(dst []uint32, v []byte, i, list int, keep bool) ([]uint32, int, error) {
	i = SkipSpace(v, i+1)
	if i < len(v) && v[i] == ']' {
		return dst, i + 1, nil
	}
	if keep {
		// A valid list holds one id more than it has commas, and its commas end at the first ']'
		// (it holds no strings or nested arrays). bytes.IndexByte and bytes.Count are vectorised,
		// so sizing dst once is cheaper than letting append regrow and copy it several times.
		end := bytes.IndexByte(v[i:], ']')
		if end < 0 {
			end = len(v) - i
		}
		dst = slices.Grow(dst, bytes.Count(v[i:i+end], []byte{','})+1)
	}
	for idx := 0; ; idx++ {
		if i >= len(v) {
			return dst, 0, &Error{Offset: i, List: -1, Index: -1, Reason: reasonEOF}
		}
		start := i
		var id uint64
		switch c := v[i]; {
		case c >= '1' && c <= '9':
			id = uint64(c - '0')
			for i++; i < len(v); i++ {
				d := v[i] - '0'
				if d > 9 {
					break
				}
				id = id*10 + uint64(d)
			}
			// 4294967295 has ten digits. Past ten id may have wrapped, so the digit count is
			// checked before the value; checking once per id rather than per digit keeps the
			// digit loop short.
			if i-start > 10 || id > math.MaxUint32 {
				return dst, 0, elemErr(start, list, idx, reasonNotID)
			}
		case c == '0':
			i++
			if i < len(v) && v[i] >= '0' && v[i] <= '9' {
				return dst, 0, elemErr(start, list, idx, "has a leading zero, which JSON does not allow")
			}
		case c == 'n' && hasLiteral(v, i, "null"):
			// encoding/json leaves a null element as the zero value.
			i += len("null")
		case c == ']':
			// Only reachable after a comma: the empty array was handled above.
			return dst, 0, &Error{Offset: i, List: -1, Index: -1, Reason: "trailing comma before ']'"}
		default:
			return dst, 0, elemErr(i, list, idx, describe(c))
		}
		if keep {
			dst = append(dst, uint32(id))
		}
		// The common separator is a bare ',' (json.Marshal's) or ", "; test for it before anything
		// else. Whitespace before the next element is skipped here; a ']' or ',' there is caught
		// by the element switch.
		if i < len(v) && v[i] == ',' {
			i++
			if i < len(v) && v[i] <= ' ' {
				i = SkipSpace(v, i)
			}
			continue
		}
		if i < len(v) && (v[i] == '.' || v[i] == 'e' || v[i] == 'E') {
			// A fraction or exponent: valid JSON perhaps, but encoding/json refuses it for an
			// unsigned integer even when its value is integral (1.0, 1e3).
			return dst, 0, elemErr(start, list, idx, reasonNotID)
		}
		i = SkipSpace(v, i)
		if i >= len(v) {
			return dst, 0, &Error{Offset: i, List: -1, Index: -1, Reason: reasonEOF}
		}
		switch v[i] {
		case ']':
			return dst, i + 1, nil
		case ',':
			i = SkipSpace(v, i+1)
		default:
			return dst, 0, elemErr(i, list, idx, fmt.Sprintf("is followed by invalid character %q, want ',' or ']'", v[i]))
		}
	}
}

// describe is the reason for an element starting with c, which is not a digit or null.
func describe(c byte) string {
	switch c {
	case '-':
		return "is negative, not an integer in 0..4294967295"
	case '"':
		return "is a string, not an integer in 0..4294967295"
	case 't', 'f':
		return "is a boolean or invalid, not an integer in 0..4294967295"
	case '[', '{':
		return "is an array or object, not an integer in 0..4294967295"
	case ',':
		return "is missing (two commas, or a comma after '[')"
	}
	return fmt.Sprintf("starts with invalid character %q", c)
}

func elemErr(off, list, idx int, reason string) *Error {
	return &Error{Offset: off, List: list, Index: idx, Reason: reason}
}

// notArray is the error for a value at v[i] that should be an array; list is the outer index when
// it is an inner array of the [[int]] form.
func notArray(v []byte, i, list int) *Error {
	if i >= len(v) {
		return &Error{Offset: i, List: -1, Index: -1, Reason: reasonEOF}
	}
	if list >= 0 {
		return &Error{Offset: i, List: -1, Index: -1,
			Reason: fmt.Sprintf("list %d is not an array: found %q, want '['", list, v[i])}
	}
	return &Error{Offset: i, List: -1, Index: -1, Reason: fmt.Sprintf("not a JSON array: found %q, want '['", v[i])}
}

// hasLiteral reports whether v[i:] starts with lit.
func hasLiteral(v []byte, i int, lit string) bool {
	return len(v)-i >= len(lit) && string(v[i:i+len(lit)]) == lit
}

// SkipSpace returns the offset of the first byte at or after i that is not JSON whitespace (RFC
// 8259: space, tab, LF, CR — not the wider set bytes.TrimSpace removes); len(v) when there is none.
func SkipSpace(v []byte, i int) int { return jsonscan.SkipSpace(v, i) }
