package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// SentencePiece-style BPE layouts (Llama 2, Mistral v0.x, Gemma 2/3, Phi-3): the vocabulary is
// made of characters, not byte-level symbols; spaces become U+2581 "▁" (through a Replace
// normalizer or the Metaspace pre-tokenizer); a character missing from the vocabulary is encoded
// as its UTF-8 bytes "<0xNN>" when byte_fallback is set, else as unk.

// metaspaceRune is SentencePiece's visible space, the usual Metaspace replacement.
const metaspaceRune = '\u2581'

// prependNormalizer is the Prepend normalizer: non-empty text gets the prefix.
type prependNormalizer string

func (p prependNormalizer) normalize(s string) string {
	if s == "" {
		return s
	}
	return string(p) + s
}

// replaceNormalizer is the Replace normalizer (and decoder) with a literal pattern, or a regex
// pattern through regexp2 (tokenizers uses Oniguruma; the patterns in real tokenizer.json files
// are literals).
type replaceNormalizer struct {
	literal string
	re      *regexMatcher
	content string
}

func (r *replaceNormalizer) normalize(s string) string {
	if r.re == nil {
		if r.literal == "" {
			return s
		}
		return strings.ReplaceAll(s, r.literal, r.content)
	}
	spans := r.re.spans(s, nil)
	if len(spans) == 0 {
		return s
	}
	var b strings.Builder
	prev := 0
	for _, sp := range spans {
		b.WriteString(s[prev:sp[0]])
		b.WriteString(r.content)
		prev = sp[1]
	}
	b.WriteString(s[prev:])
	return b.String()
}

// patternJSON is a Split or Replace pattern: a regex or a literal string.
type patternJSON struct {
	Regex  *string `json:"Regex"`
	String *string `json:"String"`
}

// parseReplace reads {"pattern": {"String"|"Regex": …}, "content": …}.
func parseReplace(raw json.RawMessage, where string) (*replaceNormalizer, error) {
	var q struct {
		Pattern patternJSON `json:"pattern"`
		Content string      `json:"content"`
	}
	if err := json.Unmarshal(raw, &q); err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	r := &replaceNormalizer{content: q.Content}
	switch {
	case q.Pattern.String != nil:
		r.literal = *q.Pattern.String
	case q.Pattern.Regex != nil:
		re, err := newRegexMatcher(*q.Pattern.Regex)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		r.re = re
	default:
		return nil, fmt.Errorf("%s: pattern has neither String nor Regex", where)
	}
	return r, nil
}

// stripNormalizer is the Strip normalizer: leading and/or trailing Unicode whitespace removed.
type stripNormalizer struct{ left, right bool }

func (n stripNormalizer) normalize(s string) string {
	if n.left {
		s = strings.TrimLeftFunc(s, unicode.IsSpace)
	}
	if n.right {
		s = strings.TrimRightFunc(s, unicode.IsSpace)
	}
	return s
}

// prependScheme is Metaspace's prepend_scheme.
type prependScheme uint8

const (
	prependAlways prependScheme = iota
	prependFirst
	prependNever
)

// metaspaceStep is the Metaspace pre-tokenizer: spaces become the replacement character, the
// replacement is prepended per prepend_scheme (always; first = only to the piece at offset 0 of
// the input; never), and with split the piece is cut before every replacement character
// (MergedWithNext).
type metaspaceStep struct {
	replacement string
	scheme      prependScheme
	split       bool
}

func parseMetaspace(raw json.RawMessage) (*metaspaceStep, error) {
	var q struct {
		Replacement    *string `json:"replacement"`
		StrRep         *string `json:"str_rep"`
		AddPrefixSpace *bool   `json:"add_prefix_space"`
		PrependScheme  *string `json:"prepend_scheme"`
		Split          *bool   `json:"split"`
	}
	if err := json.Unmarshal(raw, &q); err != nil {
		return nil, fmt.Errorf("pre_tokenizer Metaspace: %w", err)
	}
	ms := &metaspaceStep{replacement: string(metaspaceRune), scheme: prependAlways, split: true}
	switch {
	case q.Replacement != nil:
		ms.replacement = *q.Replacement
	case q.StrRep != nil:
		ms.replacement = *q.StrRep
	}
	if utf8.RuneCountInString(ms.replacement) != 1 {
		return nil, fmt.Errorf("pre_tokenizer Metaspace: replacement %q is not one character", ms.replacement)
	}
	// Older files carry add_prefix_space (true = always); prepend_scheme, when present, wins.
	if q.AddPrefixSpace != nil && !*q.AddPrefixSpace {
		ms.scheme = prependNever
	}
	if q.PrependScheme != nil {
		switch *q.PrependScheme {
		case "always":
			ms.scheme = prependAlways
		case "first":
			ms.scheme = prependFirst
		case "never":
			ms.scheme = prependNever
		default:
			return nil, fmt.Errorf("pre_tokenizer Metaspace: prepend_scheme %q is not always, first or never", *q.PrependScheme)
		}
	}
	if q.Split != nil {
		ms.split = *q.Split
	}
	return ms, nil
}

func (ms *metaspaceStep) apply(pieces []string, first bool, dst []string) ([]string, bool) {
	for k, p := range pieces {
		p = strings.ReplaceAll(p, " ", ms.replacement)
		if !strings.HasPrefix(p, ms.replacement) &&
			(ms.scheme == prependAlways || (ms.scheme == prependFirst && k == 0 && first)) {
			p = ms.replacement + p
		}
		if !ms.split {
			dst = append(dst, p)
			continue
		}
		start := 0
		for i := len(ms.replacement); i <= len(p); {
			j := strings.Index(p[i:], ms.replacement)
			if j < 0 {
				break
			}
			j += i
			if j > start {
				dst = append(dst, p[start:j])
				start = j
			}
			i = j + len(ms.replacement)
		}
		if start < len(p) {
			dst = append(dst, p[start:])
		}
	}
	return dst, first
}

// charSymbols are the per-character look-ups of a SentencePiece-style BPE model.
type charSymbols struct {
	ascii [utf8.RuneSelf]int64 // id of each ASCII character, -1 when absent
	// byteFallback[b] is the id of "<0xNN>" for byte b, -1 when absent (or byte_fallback off).
	byteFallback [256]int64
	// splitRune is the character pieces may be cut before (safe split, see safeSplit), 0 when
	// cutting is never exact for this vocabulary.
	splitRune rune
	// crossable[r] marks characters r after which a merge can join a token starting with
	// splitRune: cutting between them could change the result.
	crossable map[rune]bool
	// isolated[c] marks ASCII characters whose symbols take part in no merge: pieces are cut on
	// both sides of them (see markIsolated). anyIsolated reports whether one is marked.
	isolated    [utf8.RuneSelf]bool
	anyIsolated bool
}

// initCharSymbols builds the look-ups from the vocabulary and merges.
func (m *bpeModel) initCharSymbols(byteFallback bool, pairs [][2]string) {
	cs := &charSymbols{}
	for c := 0; c < utf8.RuneSelf; c++ {
		cs.ascii[c] = -1
		if id, ok := m.vocab[string(rune(c))]; ok {
			cs.ascii[c] = int64(id)
		}
	}
	for b := 0; b < 256; b++ {
		cs.byteFallback[b] = -1
		if !byteFallback {
			continue
		}
		if id, ok := m.vocab[fmt.Sprintf("<0x%02X>", b)]; ok {
			cs.byteFallback[b] = int64(id)
		}
	}
	// Safe split: BPE never joins two symbols across a boundary unless some merge (a, b) has a
	// ending in the left character and b starting with the right one. Pieces are cut only
	// before "▁" and only after characters no merge joins to a "▁…" token, so encoding each
	// piece alone gives exactly the ids of the whole word (merges inside one piece keep their
	// relative order), and the pieces — mostly words — repeat and hit the piece cache.
	sp := string(metaspaceRune)
	if _, ok := m.vocab[sp]; ok {
		cs.splitRune = metaspaceRune
		cs.crossable = map[rune]bool{}
		for _, p := range pairs {
			if strings.HasPrefix(p[1], sp) {
				r, _ := utf8.DecodeLastRuneInString(p[0])
				cs.crossable[r] = true
			}
		}
	}
	cs.markIsolated(m, pairs)
	m.chars = cs
}

// markIsolated sets cs.isolated: the ASCII characters c whose symbols — c's own vocabulary
// symbol, else its "<0xNN>" byte-fallback token — appear in no merge pair. Llama 2's "\n" is one
// (no vocabulary symbol, and its <0x0A> is never merged), so pretty-printed JSON, CSV and
// one-item-per-line lists, whose spaces all follow a newline, are cut at every newline instead
// of being one piece (audit 8 finding 1).
//
// Why a cut on either side of such a character c is exact: encodeChars maps each character to
// its symbols independently of its neighbours, except for unknown characters (a pending unk is
// flushed before the next vocabulary symbol but after byte-fallback tokens, and fuse_unk joins
// neighbouring unks). A vocabulary symbol flushes the pending unk in the whole word as at a
// piece's end, and it separates the unks on both sides in either case; a byte-fallback c is
// marked only when all 256 byte tokens exist, so no unk can occur at all. Then BPE repeatedly
// merges the adjacent pair of lowest rank; a pair with one of c's symbols has no rank, so no
// merge ever joins a symbol left of c with one right of c or with c, and each merge's rank
// competes only with the pairs on its own side: the merges on each side happen in the same
// order as when that side is encoded alone, and the ids are the concatenation of the sides'.
// ignore_merges looks the whole word up in the vocabulary first, which a cut would skip, so
// nothing is marked then.
func (cs *charSymbols) markIsolated(m *bpeModel, pairs [][2]string) {
	if m.ignoreMerges {
		return
	}
	inMerge := make(map[string]bool, 2*len(pairs))
	for _, p := range pairs {
		inMerge[p[0]], inMerge[p[1]] = true, true
	}
	fullFallback := true
	for b := 0; b < 256; b++ {
		fullFallback = fullFallback && cs.byteFallback[b] >= 0
	}
	for c := 0; c < utf8.RuneSelf; c++ {
		switch {
		case cs.ascii[c] >= 0:
			cs.isolated[c] = !inMerge[string(rune(c))]
		case fullFallback:
			cs.isolated[c] = !inMerge[fmt.Sprintf("<0x%02X>", c)]
		}
		cs.anyIsolated = cs.anyIsolated || cs.isolated[c]
	}
}

// safeCut returns the end of the piece starting at i: the next position before a "▁" that
// follows a vocabulary character no merge crosses, before an isolated character (markIsolated),
// just after one that starts the piece, or len(s).
func (cs *charSymbols) safeCut(m *bpeModel, s string, i int) int {
	if cs.splitRune == 0 && !cs.anyIsolated {
		return len(s)
	}
	if c := s[i]; c < utf8.RuneSelf && cs.isolated[c] {
		return i + 1
	}
	prev, n := utf8.DecodeRuneInString(s[i:])
	j := i + n
	for j < len(s) {
		if c := s[j]; c < utf8.RuneSelf {
			if cs.isolated[c] {
				return j
			}
			prev = rune(c)
			j++
			continue
		}
		r, n := utf8.DecodeRuneInString(s[j:])
		if r == cs.splitRune && !cs.crossable[prev] && m.hasChar(s[j-utf8.RuneLen(prev):j], prev) {
			return j
		}
		prev = r
		j += n
	}
	return j
}

// hasChar reports whether the one-character string c (rune r) is a vocabulary symbol.
func (m *bpeModel) hasChar(c string, r rune) bool {
	if r < utf8.RuneSelf {
		return m.chars.ascii[r] >= 0
	}
	_, ok := m.vocab[c]
	return ok
}

// encodeChars appends the BPE ids of one SentencePiece-style word as tokenizers' BPE::merge_word
// does: each character is its vocabulary symbol, else its "<0xNN>" byte tokens when byte
// fallback has them all, else unk (consecutive unknowns fused with fuse_unk); then merges.
func (m *bpeModel) encodeChars(word string, dst []uint32) []uint32 {
	if len(word) == 0 {
		return dst
	}
	if m.ignoreMerges {
		if id, ok := m.vocab[word]; ok {
			return append(dst, id)
		}
	}
	cs := m.chars
	syms := make([]uint32, 0, len(word))
	pendingUnk := false
	for i := 0; i < len(word); {
		c := word[i]
		var id int64 = -1
		n := 1
		if c < utf8.RuneSelf {
			id = cs.ascii[c]
		} else {
			_, n = utf8.DecodeRuneInString(word[i:])
			if v, ok := m.vocab[word[i:i+n]]; ok {
				id = int64(v)
			}
		}
		if id >= 0 {
			if pendingUnk {
				syms = append(syms, uint32(m.unkID))
				pendingUnk = false
			}
			syms = append(syms, uint32(id))
			i += n
			continue
		}
		if fb := cs.byteFallbackOf(word[i : i+n]); fb {
			// As the reference does, byte tokens go out without flushing a pending unk.
			for k := i; k < i+n; k++ {
				syms = append(syms, uint32(cs.byteFallback[word[k]]))
			}
			i += n
			continue
		}
		if m.unkID >= 0 {
			if pendingUnk && !m.fuseUnk {
				syms = append(syms, uint32(m.unkID))
			}
			pendingUnk = true
		}
		i += n
	}
	if pendingUnk {
		syms = append(syms, uint32(m.unkID))
	}
	if len(syms) > heapThreshold {
		return append(dst, m.mergeHeap(syms)...)
	}
	return append(dst, m.mergeScan(syms)...)
}

// byteFallbackOf reports whether every byte of c has a "<0xNN>" token.
func (cs *charSymbols) byteFallbackOf(c string) bool {
	for k := 0; k < len(c); k++ {
		if cs.byteFallback[c[k]] < 0 {
			return false
		}
	}
	return true
}
