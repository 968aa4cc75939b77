package tokenizer

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// decoder is one step of tokenizer.json's decoder chain: it maps token spellings to new
// spellings (tokenizers' Decoder::decode_chain); the final text is their concatenation.
type decoder interface {
	decodeChain(toks []string) []string
}

type seqDecoder []decoder

func (q seqDecoder) decodeChain(toks []string) []string {
	for _, d := range q {
		toks = d.decodeChain(toks)
	}
	return toks
}

// byteLevelDecoder maps GPT-2 byte-level spellings back to bytes (a token with a rune outside
// the table is kept verbatim) and returns one lossy UTF-8 string.
type byteLevelDecoder struct{}

func (byteLevelDecoder) decodeChain(toks []string) []string {
	var buf []byte
	for _, t := range toks {
		buf = unByteLevel(buf, t)
	}
	return []string{strings.ToValidUTF8(string(buf), "\uFFFD")}
}

// replaceDecoder is the Replace decoder (a Replace normalizer applied to every token).
type replaceDecoder struct{ r *replaceNormalizer }

func (d replaceDecoder) decodeChain(toks []string) []string {
	out := make([]string, len(toks))
	for i, t := range toks {
		out[i] = d.r.normalize(t)
	}
	return out
}

// byteFallbackDecoder turns runs of "<0xNN>" tokens into the string of their bytes, or into
// one U+FFFD per byte when the run is not valid UTF-8.
type byteFallbackDecoder struct{}

func byteToken(t string) (byte, bool) {
	if len(t) != 6 || !strings.HasPrefix(t, "<0x") || t[5] != '>' {
		return 0, false
	}
	v, err := strconv.ParseUint(t[3:5], 16, 8)
	if err != nil {
		return 0, false
	}
	return byte(v), true
}

func (byteFallbackDecoder) decodeChain(toks []string) []string {
	out := make([]string, 0, len(toks))
	var run []byte
	flush := func() {
		if len(run) == 0 {
			return
		}
		if utf8.Valid(run) {
			out = append(out, string(run))
		} else {
			for range run {
				out = append(out, "\uFFFD")
			}
		}
		run = run[:0]
	}
	for _, t := range toks {
		if b, ok := byteToken(t); ok {
			run = append(run, b)
			continue
		}
		flush()
		out = append(out, t)
	}
	flush()
	return out
}

// fuseDecoder joins every token into one.
type fuseDecoder struct{}

func (fuseDecoder) decodeChain(toks []string) []string {
	return []string{strings.Join(toks, "")}
}

// stripDecoder removes up to start leading and stop trailing copies of content from each token.
type stripDecoder struct {
	content     rune
	start, stop int
}

func (d stripDecoder) decodeChain(toks []string) []string {
	out := make([]string, len(toks))
	for i, t := range toks {
		for k := 0; k < d.start; k++ {
			r, n := utf8.DecodeRuneInString(t)
			if n == 0 || r != d.content {
				break
			}
			t = t[n:]
		}
		for k := 0; k < d.stop; k++ {
			r, n := utf8.DecodeLastRuneInString(t)
			if n == 0 || r != d.content {
				break
			}
			t = t[:len(t)-n]
		}
		out[i] = t
	}
	return out
}

// metaspaceDecoder turns the replacement back into spaces; unless prepend_scheme is never, the
// first token's replacements are dropped instead (as the reference does: all of them, not only
// the one the pre-tokenizer prepended).
type metaspaceDecoder struct {
	replacement string
	scheme      prependScheme
}

func (d metaspaceDecoder) decodeChain(toks []string) []string {
	out := make([]string, len(toks))
	for i, t := range toks {
		if i == 0 && d.scheme != prependNever {
			out[i] = strings.ReplaceAll(t, d.replacement, "")
		} else {
			out[i] = strings.ReplaceAll(t, d.replacement, " ")
		}
	}
	return out
}

// parseDecoder reads tokenizer.json's decoder (nil when absent).
func parseDecoder(raw json.RawMessage) (decoder, error) {
	if isNull(raw) {
		return nil, nil
	}
	var t typed
	if err := json.Unmarshal(raw, &t); err != nil {
		return nil, fmt.Errorf("decoder: %w", err)
	}
	switch t.Type {
	case "ByteLevel":
		return byteLevelDecoder{}, nil
	case "Sequence":
		var q struct {
			Decoders []json.RawMessage `json:"decoders"`
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return nil, fmt.Errorf("decoder Sequence: %w", err)
		}
		var out seqDecoder
		for _, r := range q.Decoders {
			d, err := parseDecoder(r)
			if err != nil {
				return nil, err
			}
			if d != nil {
				out = append(out, d)
			}
		}
		return out, nil
	case "Replace":
		r, err := parseReplace(raw, "decoder Replace")
		if err != nil {
			return nil, err
		}
		return replaceDecoder{r}, nil
	case "ByteFallback":
		return byteFallbackDecoder{}, nil
	case "Fuse":
		return fuseDecoder{}, nil
	case "Strip":
		var q struct {
			Content string `json:"content"`
			Start   int    `json:"start"`
			Stop    int    `json:"stop"`
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return nil, fmt.Errorf("decoder Strip: %w", err)
		}
		r, n := utf8.DecodeRuneInString(q.Content)
		if n == 0 || n != len(q.Content) {
			return nil, fmt.Errorf("decoder Strip: content %q is not one character", q.Content)
		}
		return stripDecoder{content: r, start: q.Start, stop: q.Stop}, nil
	case "Metaspace":
		ms, err := parseMetaspace(raw)
		if err != nil {
			return nil, fmt.Errorf("decoder %w", err)
		}
		return metaspaceDecoder{replacement: ms.replacement, scheme: ms.scheme}, nil
	}
	return nil, unsupported("decoder %q", t.Type)
}
