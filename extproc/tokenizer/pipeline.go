package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode"

	"golang.org/x/text/unicode/norm"
)

// ErrUnsupported is wrapped by Load for tokenizer layouts this package does not implement
// (Unigram, WordPiece and WordLevel models, the Precompiled normalizer, unknown pipeline
// components). The error text names the component and suggests vllm-render, which lets the
// model server tokenize instead.
var ErrUnsupported = errors.New("unsupported tokenizer layout")

// vllmRenderHint ends every ErrUnsupported message.
const vllmRenderHint = "; set DYN_EPP_TOKENIZER_PROTOCOL=vllm-render to let the model server tokenize"

func unsupported(format string, args ...any) error {
	return fmt.Errorf("%w: %s%s", ErrUnsupported, fmt.Sprintf(format, args...), vllmRenderHint)
}

// ---------------------------------------------------------------------------------------------
// Normalizers (tokenizer.md step 3).

type normalizer interface {
	normalize(s string) string
}

type formNormalizer struct{ f norm.Form }

// normalize applies the Unicode normalization form; ASCII text, which every form leaves as it is,
// is checked eight bytes at a time and returned without the normalizer's own scan.
func (n formNormalizer) normalize(s string) string {
	if isASCII(s) {
		return s
	}
	return n.f.String(s)
}

// isASCII reports whether s has no byte ≥ 0x80. It reads 32 bytes per step (a whole prompt
// is checked per segment), then 8, then single bytes.
func isASCII(s string) bool {
	i := 0
	for ; i+32 <= len(s); i += 32 {
		if (load64(s, i)|load64(s, i+8)|load64(s, i+16)|load64(s, i+24))&0x8080808080808080 != 0 {
			return false
		}
	}
	for ; i+8 <= len(s); i += 8 {
		if (uint64(s[i])|uint64(s[i+1])<<8|uint64(s[i+2])<<16|uint64(s[i+3])<<24|
			uint64(s[i+4])<<32|uint64(s[i+5])<<40|uint64(s[i+6])<<48|uint64(s[i+7])<<56)&0x8080808080808080 != 0 {
			return false
		}
	}
	for ; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}

type lowercaseNormalizer struct{}

// normalize lowercases per character as Rust's char::to_lowercase does (the tokenizers
// Lowercase normalizer): simple mappings plus the one unconditional multi-character mapping,
// U+0130 → "i\u0307"; no context-dependent final sigma.
func (lowercaseNormalizer) normalize(s string) string {
	return strings.Map(unicode.ToLower, strings.ReplaceAll(s, "\u0130", "i\u0307"))
}

type seqNormalizer []normalizer

func (q seqNormalizer) normalize(s string) string {
	for _, n := range q {
		s = n.normalize(s)
	}
	return s
}

type typed struct {
	Type string `json:"type"`
}

func parseNormalizer(raw json.RawMessage) (normalizer, error) {
	if isNull(raw) {
		return nil, nil
	}
	var t typed
	if err := json.Unmarshal(raw, &t); err != nil {
		return nil, fmt.Errorf("normalizer: %w", err)
	}
	switch t.Type {
	case "NFC":
		return formNormalizer{norm.NFC}, nil
	case "NFD":
		return formNormalizer{norm.NFD}, nil
	case "NFKC":
		return formNormalizer{norm.NFKC}, nil
	case "NFKD":
		return formNormalizer{norm.NFKD}, nil
	case "Lowercase":
		return lowercaseNormalizer{}, nil
	case "Sequence":
		var q struct {
			Normalizers []json.RawMessage `json:"normalizers"`
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return nil, fmt.Errorf("normalizer Sequence: %w", err)
		}
		var out seqNormalizer
		for _, r := range q.Normalizers {
			n, err := parseNormalizer(r)
			if err != nil {
				return nil, err
			}
			if n != nil {
				out = append(out, n)
			}
		}
		if len(out) == 0 {
			return nil, nil
		}
		return out, nil
	case "Prepend":
		var q struct {
			Prepend string `json:"prepend"`
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return nil, fmt.Errorf("normalizer Prepend: %w", err)
		}
		return prependNormalizer(q.Prepend), nil
	case "Replace":
		rp, err := parseReplace(raw, "normalizer Replace")
		if err != nil {
			return nil, err
		}
		return rp, nil
	case "Strip":
		var q struct {
			Left  bool `json:"strip_left"`
			Right bool `json:"strip_right"`
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return nil, fmt.Errorf("normalizer Strip: %w", err)
		}
		return stripNormalizer{left: q.Left, right: q.Right}, nil
	case "Precompiled":
		return nil, unsupported("normalizer Precompiled (a SentencePiece charsmap, used by Unigram models)")
	}
	return nil, unsupported("normalizer %q", t.Type)
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers (tokenizer.md steps 4-5).

type splitBehavior uint8

const (
	behRemoved splitBehavior = iota
	behIsolated
	behMergedWithPrevious
	behMergedWithNext
	behContiguous
)

// preStep transforms a list of pieces into a new list of pieces (appended to dst). first
// reports whether pieces[0] starts at offset 0 of the text being encoded (Metaspace's
// prepend_scheme "first" needs it); apply returns the same fact for its output.
type preStep interface {
	apply(pieces []string, first bool, dst []string) ([]string, bool)
}

type splitStep struct {
	scan scanFunc // hand-written scanner, or nil
	// maxDigits is set for the Qwen2 and Llama 3 patterns ("llama-like"), whose scanner takes an
	// ASCII word (with an optional leading space) first (asciiWordEnd): their digit run (1, 3); 0
	// for every other pattern.
	maxDigits int
	re        *regexMatcher // regexp2 fallback, or nil
	literal   string        // String pattern, when scan and re are nil
	behavior  splitBehavior
	invert    bool
}

func (st *splitStep) spans(s string, dst [][2]int) [][2]int {
	switch {
	case st.scan != nil:
		return scanSpans(st.scan, s, dst)
	case st.re != nil:
		return st.re.spans(s, dst)
	}
	if st.literal == "" {
		return dst
	}
	for i := 0; i <= len(s)-len(st.literal); {
		k := strings.Index(s[i:], st.literal)
		if k < 0 {
			break
		}
		dst = append(dst, [2]int{i + k, i + k + len(st.literal)})
		i += k + len(st.literal)
	}
	return dst
}

// part is one span of a split piece and whether it is a pattern match.
type part struct {
	s, e  int
	match bool
}

func (st *splitStep) apply(pieces []string, first bool, dst []string) ([]string, bool) {
	var spanBuf [64][2]int
	outFirst := first
	for k, p := range pieces {
		matches := st.spans(p, spanBuf[:0])
		// Build the alternating list of (span, isMatch) covering p.
		parts := make([]part, 0, 2*len(matches)+1)
		prev := 0
		for _, m := range matches {
			if m[0] > prev {
				parts = append(parts, part{prev, m[0], false})
			}
			parts = append(parts, part{m[0], m[1], true})
			prev = m[1]
		}
		if prev < len(p) {
			parts = append(parts, part{prev, len(p), false})
		}
		if st.invert {
			for k := range parts {
				parts[k].match = !parts[k].match
			}
		}
		if k == 0 && st.behavior == behRemoved && len(parts) > 0 && parts[0].match {
			outFirst = false // the leading match is dropped: the first output starts later
		}
		dst = st.behave(p, parts, dst)
	}
	return dst, outFirst
}

// behave applies the Split behaviour to the alternating (span, isMatch) parts of p, mirroring
// tokenizers' NormalizedString::split folds.
func (st *splitStep) behave(p string, parts []part, dst []string) []string {
	switch st.behavior {
	case behIsolated:
		for _, q := range parts {
			dst = append(dst, p[q.s:q.e])
		}
		return dst
	case behRemoved:
		for _, q := range parts {
			if !q.match {
				dst = append(dst, p[q.s:q.e])
			}
		}
		return dst
	}
	var acc []part
	prevMatch := false
	switch st.behavior {
	case behMergedWithPrevious:
		for _, q := range parts {
			if q.match && !prevMatch && len(acc) > 0 {
				acc[len(acc)-1].e = q.e
			} else {
				acc = append(acc, q)
			}
			prevMatch = q.match
		}
	case behMergedWithNext:
		for k := len(parts) - 1; k >= 0; k-- {
			q := parts[k]
			if q.match && !prevMatch && len(acc) > 0 {
				acc[len(acc)-1].s = q.s
			} else {
				acc = append(acc, q)
			}
			prevMatch = q.match
		}
		for i, j := 0, len(acc)-1; i < j; i, j = i+1, j-1 {
			acc[i], acc[j] = acc[j], acc[i]
		}
	case behContiguous:
		for _, q := range parts {
			if q.match == prevMatch && len(acc) > 0 {
				acc[len(acc)-1].e = q.e
			} else {
				acc = append(acc, q)
			}
			prevMatch = q.match
		}
	}
	for _, q := range acc {
		dst = append(dst, p[q.s:q.e])
	}
	return dst
}

type byteLevelStep struct {
	addPrefixSpace bool
	useRegex       bool
}

func (b byteLevelStep) apply(pieces []string, first bool, dst []string) ([]string, bool) {
	for _, p := range pieces {
		if b.addPrefixSpace && !strings.HasPrefix(p, " ") {
			p = " " + p
		}
		if !b.useRegex {
			dst = append(dst, p)
			continue
		}
		for i := 0; i < len(p); {
			j := scanGPT2(p, i)
			dst = append(dst, p[i:j])
			i = j
		}
	}
	return dst, first
}

type digitsStep struct{ individual bool }

func (d digitsStep) apply(pieces []string, first bool, dst []string) ([]string, bool) {
	for _, p := range pieces {
		start := 0
		inDigits := false
		for i, r := range p {
			isD := unicode.IsNumber(r) // Rust char::is_numeric: Nd, Nl, No
			if isD && d.individual {
				if i > start {
					dst = append(dst, p[start:i])
				}
				dst = append(dst, p[i:i+len(string(r))])
				start = i + len(string(r))
				inDigits = false
				continue
			}
			if i > start && isD != inDigits {
				dst = append(dst, p[start:i])
				start = i
			}
			inDigits = isD
		}
		if start < len(p) {
			dst = append(dst, p[start:])
		}
	}
	return dst, first
}

// preTokenizer is the flattened pre-tokenizer chain. fast is set when the whole chain is one
// scanner whose pieces need no further transformation (Qwen2, Llama 3, GPT-2 layouts).
type preTokenizer struct {
	steps []preStep
	fast  scanFunc
	// asciiWords is set when fast is a llama-like scanner (splitStep.maxDigits > 0): the encoder then
	// cuts ASCII words and one-byte pieces itself (asciiWordEnd, asciiSingle; maxDigits is the
	// pattern's, 1 for Qwen2 and 3 for Llama 3) and calls fast for everything else.
	asciiWords bool
	maxDigits  int
	byteLevel  bool // a ByteLevel step is present: the model's symbols are bytes, not characters
	metaspace  bool // a Metaspace step is present (SentencePiece layout)
}

func parsePreTokenizer(raw json.RawMessage) (*preTokenizer, error) {
	pt := &preTokenizer{}
	if isNull(raw) {
		return pt, nil
	}
	if err := pt.add(raw); err != nil {
		return nil, err
	}
	// Fast path: [Split(known, Isolated, !invert), ByteLevel(no prefix, no regex)] or
	// [ByteLevel(no prefix, GPT-2 regex)].
	switch len(pt.steps) {
	case 1:
		if b, ok := pt.steps[0].(byteLevelStep); ok && !b.addPrefixSpace && b.useRegex {
			pt.fast = scanGPT2
		}
	case 2:
		s, ok1 := pt.steps[0].(*splitStep)
		b, ok2 := pt.steps[1].(byteLevelStep)
		if ok1 && ok2 && s.scan != nil && s.behavior == behIsolated && !s.invert && !b.addPrefixSpace && !b.useRegex {
			pt.fast, pt.asciiWords, pt.maxDigits = s.scan, s.maxDigits > 0, s.maxDigits
		}
	}
	return pt, nil
}

func (pt *preTokenizer) add(raw json.RawMessage) error {
	var t typed
	if err := json.Unmarshal(raw, &t); err != nil {
		return fmt.Errorf("pre_tokenizer: %w", err)
	}
	switch t.Type {
	case "Sequence":
		var q struct {
			Pretokenizers []json.RawMessage `json:"pretokenizers"`
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return fmt.Errorf("pre_tokenizer Sequence: %w", err)
		}
		for _, r := range q.Pretokenizers {
			if err := pt.add(r); err != nil {
				return err
			}
		}
		return nil
	case "Split":
		var q struct {
			Pattern  patternJSON `json:"pattern"`
			Behavior string      `json:"behavior"`
			Invert   bool        `json:"invert"`
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return fmt.Errorf("pre_tokenizer Split: %w", err)
		}
		st := &splitStep{invert: q.Invert}
		switch q.Behavior {
		case "Isolated":
			st.behavior = behIsolated
		case "Removed":
			st.behavior = behRemoved
		case "MergedWithPrevious":
			st.behavior = behMergedWithPrevious
		case "MergedWithNext":
			st.behavior = behMergedWithNext
		case "Contiguous":
			st.behavior = behContiguous
		default:
			return unsupported("Split behavior %q", q.Behavior)
		}
		switch {
		case q.Pattern.Regex != nil:
			switch *q.Pattern.Regex {
			case patternQwen2:
				st.maxDigits = 1
			case patternLlama3:
				st.maxDigits = 3
			}
			if st.scan = knownScanner(*q.Pattern.Regex); st.scan == nil {
				re, err := newRegexMatcher(*q.Pattern.Regex)
				if err != nil {
					return err
				}
				st.re = re
			}
		case q.Pattern.String != nil:
			st.literal = *q.Pattern.String
		default:
			return fmt.Errorf("pre_tokenizer Split: pattern has neither Regex nor String")
		}
		pt.steps = append(pt.steps, st)
		return nil
	case "ByteLevel":
		q := struct {
			AddPrefixSpace bool  `json:"add_prefix_space"`
			UseRegex       *bool `json:"use_regex"`
		}{}
		if err := json.Unmarshal(raw, &q); err != nil {
			return fmt.Errorf("pre_tokenizer ByteLevel: %w", err)
		}
		useRegex := q.UseRegex == nil || *q.UseRegex // tokenizers' default is true
		pt.steps = append(pt.steps, byteLevelStep{addPrefixSpace: q.AddPrefixSpace, useRegex: useRegex})
		pt.byteLevel = true
		return nil
	case "Digits":
		var q struct {
			IndividualDigits bool `json:"individual_digits"`
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return fmt.Errorf("pre_tokenizer Digits: %w", err)
		}
		pt.steps = append(pt.steps, digitsStep{individual: q.IndividualDigits})
		return nil
	case "Metaspace":
		ms, err := parseMetaspace(raw)
		if err != nil {
			return err
		}
		pt.steps = append(pt.steps, ms)
		pt.metaspace = true
		return nil
	}
	return unsupported("pre_tokenizer %q", t.Type)
}

// run applies the general chain to s; first reports whether s starts at offset 0 of the text
// being encoded.
func (pt *preTokenizer) run(s string, first bool) []string {
	pieces := []string{s}
	for _, st := range pt.steps {
		pieces, first = st.apply(pieces, first, make([]string, 0, len(pieces)*4))
	}
	return pieces
}

// ---------------------------------------------------------------------------------------------
// Post-processors (tokenizer.md step 7), applied for add_special_tokens=true.

type postProcessor struct {
	prefix, suffix []uint32
}

func (p *postProcessor) parse(raw json.RawMessage) error {
	if isNull(raw) {
		return nil
	}
	var t typed
	if err := json.Unmarshal(raw, &t); err != nil {
		return fmt.Errorf("post_processor: %w", err)
	}
	switch t.Type {
	case "ByteLevel":
		return nil // only adjusts offsets
	case "Sequence":
		var q struct {
			Processors []json.RawMessage `json:"processors"`
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return fmt.Errorf("post_processor Sequence: %w", err)
		}
		for _, r := range q.Processors {
			if err := p.parse(r); err != nil {
				return err
			}
		}
		return nil
	case "TemplateProcessing":
		var q struct {
			Single []struct {
				SpecialToken *struct {
					ID string `json:"id"`
				} `json:"SpecialToken"`
				Sequence *struct {
					ID string `json:"id"`
				} `json:"Sequence"`
			} `json:"single"`
			SpecialTokens map[string]struct {
				IDs []uint32 `json:"ids"`
			} `json:"special_tokens"`
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return fmt.Errorf("post_processor TemplateProcessing: %w", err)
		}
		seenSeq := false
		var pre, suf []uint32
		for _, piece := range q.Single {
			switch {
			case piece.Sequence != nil:
				if seenSeq {
					return fmt.Errorf("post_processor TemplateProcessing: single template has two sequences")
				}
				seenSeq = true
			case piece.SpecialToken != nil:
				st, ok := q.SpecialTokens[piece.SpecialToken.ID]
				if !ok {
					return fmt.Errorf("post_processor TemplateProcessing: unknown special token %q", piece.SpecialToken.ID)
				}
				if seenSeq {
					suf = append(suf, st.IDs...)
				} else {
					pre = append(pre, st.IDs...)
				}
			}
		}
		p.prefix = append(p.prefix, pre...)
		p.suffix = append(suf, p.suffix...)
		return nil
	case "RobertaProcessing", "BertProcessing":
		var q struct {
			Sep [2]json.RawMessage `json:"sep"`
			Cls [2]json.RawMessage `json:"cls"`
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return fmt.Errorf("post_processor %s: %w", t.Type, err)
		}
		var sep, cls uint32
		if err := json.Unmarshal(q.Sep[1], &sep); err != nil {
			return fmt.Errorf("post_processor %s sep: %w", t.Type, err)
		}
		if err := json.Unmarshal(q.Cls[1], &cls); err != nil {
			return fmt.Errorf("post_processor %s cls: %w", t.Type, err)
		}
		p.prefix = append(p.prefix, cls)
		p.suffix = append([]uint32{sep}, p.suffix...)
		return nil
	}
	return unsupported("post_processor %q", t.Type)
}

func isNull(raw json.RawMessage) bool {
	s := strings.TrimSpace(string(raw))
	return s == "" || s == "null"
}
