package tokenizer

import (
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"
)

// addedToken is one entry of tokenizer.json's added_tokens.
type addedToken struct {
	id         uint32
	content    string
	special    bool
	lstrip     bool
	rstrip     bool
	singleWord bool
	normalized bool
}

// addedMatcher finds added tokens leftmost-longest (the reference uses Aho–Corasick with
// MatchKind::LeftmostLongest) and applies their lstrip/rstrip/single_word flags exactly as
// tokenizers' AddedVocabulary::find_matches does (tokenizer.md step 2).
type addedMatcher struct {
	byFirst [256][]*addedToken // candidates by first byte, longest first
	any     bool
	// first is the one byte every token starts with, when they share one (e.g. '<' for
	// "<|im_start|>", "<s>"): next then skips to it with a vectorised search. -1 otherwise.
	first int
	// bySecond[c], for a first byte c with many candidates (Gemma 3: 6,322 tokens start with
	// "<", 6,245 of them with "<unused"), holds them by second byte (one-byte tokens in every
	// list, last), longest first as in byFirst: a "<" in punctuation text used to be compared
	// with every one of them, 0.7 CPU-seconds per MB (audit 8 finding 4).
	bySecond [256]*[256][]*addedToken
	// longest is the length in bytes of the longest token content (0 when there is none).
	longest int
}

// manyCandidates is the number of candidates of one first byte above which next also looks at
// the second byte (bySecond).
const manyCandidates = 8

func newAddedMatcher(toks []*addedToken, content func(*addedToken) string) *addedMatcher {
	m := &addedMatcher{}
	type entry struct {
		t *addedToken
		c string
	}
	var es []entry
	for _, t := range toks {
		c := content(t)
		if c == "" {
			continue
		}
		es = append(es, entry{t, c})
	}
	sort.SliceStable(es, func(i, j int) bool { return len(es[i].c) > len(es[j].c) })
	m.first = -1
	for i, e := range es {
		switch {
		case i == 0:
			m.first = int(e.c[0])
		case m.first != int(e.c[0]):
			m.first = -2
		}
	}
	if m.first < 0 {
		m.first = -1
	}
	for _, e := range es {
		tok := *e.t
		tok.content = e.c
		m.byFirst[e.c[0]] = append(m.byFirst[e.c[0]], &tok)
		m.any = true
		m.longest = max(m.longest, len(e.c))
	}
	for c, cands := range m.byFirst {
		if len(cands) <= manyCandidates {
			continue
		}
		sec := new([256][]*addedToken)
		for _, t := range cands {
			if len(t.content) > 1 {
				sec[t.content[1]] = append(sec[t.content[1]], t)
				continue
			}
			for b := range sec {
				sec[b] = append(sec[b], t)
			}
		}
		m.bySecond[c] = sec
	}
	return m
}

// candidates returns the tokens that may start at s[i], longest first: byFirst, narrowed by the
// second byte where bySecond has it.
func (m *addedMatcher) candidates(s string, i int) []*addedToken {
	if sec := m.bySecond[s[i]]; sec != nil && i+1 < len(s) {
		return sec[s[i+1]]
	}
	return m.byFirst[s[i]]
}

// segment is a piece of the input: either an added token (id >= 0) or text to model-encode.
type segment struct {
	start, end int
	id         int64 // -1 for text
}

// next returns the leftmost-longest match at or after from as (start, end, token), or a nil
// token when there is none.
func (m *addedMatcher) next(s string, from int) (int, int, *addedToken) {
	if m.first >= 0 {
		for i := from; i < len(s); i++ {
			k := strings.IndexByte(s[i:], byte(m.first))
			if k < 0 {
				break
			}
			i += k
			for _, t := range m.candidates(s, i) {
				if len(s)-i >= len(t.content) && s[i:i+len(t.content)] == t.content {
					return i, i + len(t.content), t
				}
			}
		}
		return -1, -1, nil
	}
	for i := from; i < len(s); i++ {
		cands := m.candidates(s, i)
		if len(cands) == 0 {
			continue
		}
		for _, t := range cands {
			if len(s)-i >= len(t.content) && s[i:i+len(t.content)] == t.content {
				return i, i + len(t.content), t
			}
		}
	}
	return -1, -1, nil
}

// split appends the segments of s to dst (text segments are never empty). Overlapping spans,
// produced when rstrip swallows spaces in which the next match starts, are kept as the
// reference produces them.
func (m *addedMatcher) split(s string, dst []segment) []segment {
	if !m.any {
		if len(s) > 0 {
			dst = append(dst, segment{0, len(s), -1})
		}
		return dst
	}
	startOffset := 0
	for from := 0; from < len(s); {
		st, en, t := m.next(s, from)
		if t == nil {
			break
		}
		from = en
		start, stop := st, en
		if t.singleWord {
			startSpace := start == 0 || !endsWithWord(s[:start])
			stopSpace := stop == len(s) || !startsWithWord(s[stop:])
			if !startSpace || !stopSpace {
				continue
			}
		}
		if t.lstrip {
			ns := spaceLeftmostAtEnd(s[:start])
			if ns < startOffset {
				ns = startOffset
			}
			start = ns
		}
		if t.rstrip {
			stop += spaceRightmostAtStart(s[stop:])
		}
		if len(dst) >= segmentLimit {
			break // the rest is one unsplit segment (cutSegmentID), see segmentLimit
		}
		if startOffset < start {
			dst = append(dst, segment{startOffset, start, -1})
		}
		dst = append(dst, segment{start, stop, int64(t.id)})
		startOffset = stop
	}
	if len(dst) >= segmentLimit && startOffset < len(s) {
		return append(dst, segment{startOffset, len(s), cutSegmentID})
	}
	if startOffset < len(s) {
		dst = append(dst, segment{startOffset, len(s), -1})
	}
	return dst
}

// isWordRune matches the Rust regex crate's Unicode \w.
func isWordRune(r rune) bool {
	return unicode.IsLetter(r) || unicode.Is(unicode.M, r) || unicode.Is(unicode.Nd, r) ||
		unicode.Is(unicode.Pc, r) || r == 0x200C || r == 0x200D
}

func endsWithWord(s string) bool {
	r, _ := utf8.DecodeLastRuneInString(s)
	return len(s) > 0 && isWordRune(r)
}

func startsWithWord(s string) bool {
	r, _ := utf8.DecodeRuneInString(s)
	return len(s) > 0 && isWordRune(r)
}

// spaceLeftmostAtEnd returns where the trailing whitespace of s starts.
func spaceLeftmostAtEnd(s string) int {
	i := len(s)
	for i > 0 {
		r, n := utf8.DecodeLastRuneInString(s[:i])
		if !unicode.IsSpace(r) {
			break
		}
		i -= n
	}
	return i
}

// spaceRightmostAtStart returns the length of the leading whitespace of s.
func spaceRightmostAtStart(s string) int {
	i := 0
	for i < len(s) {
		r, n := utf8.DecodeRuneInString(s[i:])
		if !unicode.IsSpace(r) {
			break
		}
		i += n
	}
	return i
}

// maxLen returns the length in bytes of the longest token content (0 when there is none).
func (m *addedMatcher) maxLen() int { return m.longest }

// stripFree reports whether no token has lstrip, rstrip or single_word: every match is exactly its
// content, so whether a match covers an offset depends only on the bytes within the longest
// token's length of it (what straddles relies on).
func (m *addedMatcher) stripFree() bool {
	for _, cands := range m.byFirst {
		for _, t := range cands {
			if t.lstrip || t.rstrip || t.singleWord {
				return false
			}
		}
	}
	return true
}

// straddles reports whether some token's content occurs across the junction of left and right:
// left ends with a proper prefix of the content and right starts with the rest. Where it does
// not, and the offset is a segment boundary of the text left belongs to, splitting left+right
// gives the segments of left's text up to the junction followed by those of right alone (for a
// stripFree matcher): no match can start before the junction and end after it.
func (m *addedMatcher) straddles(left, right string) bool {
	for _, cands := range m.byFirst {
		for _, t := range cands {
			c := t.content
			for i := 1; i < len(c); i++ {
				if len(left) >= i && len(right) >= len(c)-i && left[len(left)-i:] == c[:i] && right[:len(c)-i] == c[i:] {
					return true
				}
			}
		}
	}
	return false
}
