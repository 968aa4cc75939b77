package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"unicode/utf8"
)

// Tokenizer is a loaded Hugging Face BPE tokenizer (byte-level or SentencePiece-style) plus its
// chat template (tokenizer.md). It is immutable after Load except for its internal piece cache and
// is safe for concurrent use; load it once per model and share it.
type Tokenizer struct {
	model     *bpeModel
	addedRaw  *addedMatcher // added tokens with normalized=false, matched on the raw text
	addedNorm *addedMatcher // added tokens with normalized=true, matched on normalized text
	norm      normalizer    // nil when tokenizer.json has none
	pre       *preTokenizer
	post      postProcessor
	dec       decoder // nil when tokenizer.json has none (tokens are joined with spaces)
	decErr    error   // why dec is missing when tokenizer.json has a decoder this package lacks
	cache     *pieceCache

	idToToken map[uint32]string // vocabulary spelling by id (model vocab)
	addedByID map[uint32]*addedToken

	chat *chatConfig // nil when the model has no chat template

	cleanUpSpaces  bool // tokenizer_config.json clean_up_tokenization_spaces (Decode)
	modelMaxLength int  // tokenizer_config.json model_max_length, 0 = unknown
	maxPositions   int  // config.json max_position_embeddings, 0 = unknown

	segPool *sync.Pool // *[]segment scratch (a pointer: WithContext views share it); nil: none

	// cacheID tells this tokenizer's entries apart in a shared ConversationCache; prefixSafe
	// reports raw added tokens without lstrip/rstrip/single_word, which the cache needs.
	cacheID    uint64
	prefixSafe bool

	long *longPieceState // pieces over MaxExactPieceBytes (longpiece.go); nil: not cached

	stop *encodeStop // nil except in a WithContext view (cancel.go)
}

type addedTokenJSON struct {
	ID         uint32 `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	Lstrip     bool   `json:"lstrip"`
	Rstrip     bool   `json:"rstrip"`
	Normalized *bool  `json:"normalized"`
	Special    bool   `json:"special"`
}

type tokenizerJSON struct {
	AddedTokens   []addedTokenJSON `json:"added_tokens"`
	Normalizer    json.RawMessage  `json:"normalizer"`
	PreTokenizer  json.RawMessage  `json:"pre_tokenizer"`
	PostProcessor json.RawMessage  `json:"post_processor"`
	Decoder       json.RawMessage  `json:"decoder"`
	Model         struct {
		Type                    string          `json:"type"`
		Vocab                   json.RawMessage `json:"vocab"`
		Merges                  json.RawMessage `json:"merges"`
		Dropout                 *float64        `json:"dropout"`
		UnkToken                *string         `json:"unk_token"`
		ContinuingSubwordPrefix *string         `json:"continuing_subword_prefix"`
		EndOfWordSuffix         *string         `json:"end_of_word_suffix"`
		FuseUnk                 bool            `json:"fuse_unk"`
		ByteFallback            bool            `json:"byte_fallback"`
		IgnoreMerges            bool            `json:"ignore_merges"`
	} `json:"model"`
}

// Load reads dir/tokenizer.json and dir/tokenizer_config.json (plus dir/chat_template.jinja when
// present, which transformers prefers over the config's chat_template, and dir/config.json for
// MaxModelLen) and builds a Tokenizer (tokenizer.md, epp.md §5.4 `local`): byte-level or
// SentencePiece-style BPE, with the post-processor rewritten from add_bos_token/add_eos_token for
// the transformers classes that do so (postProcessorClasses). tokenizer_config.json is optional;
// without a chat template TokenizeChat and TokenizeResponses fail with ErrNoChatTemplate. Errors
// name the file and wrap ErrUnsupported for what is not implemented (Unigram, WordPiece and
// WordLevel models, the Precompiled normalizer, unknown components), naming the component and
// suggesting vllm-render.
func Load(dir string) (*Tokenizer, error) {
	path := filepath.Join(dir, "tokenizer.json")
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("load tokenizer: %w", err)
	}
	t, err := parseTokenizerJSON(data)
	if err != nil {
		return nil, fmt.Errorf("load tokenizer %s: %w", path, err)
	}
	cfgPath := filepath.Join(dir, "tokenizer_config.json")
	cfgData, err := os.ReadFile(cfgPath)
	switch {
	case errors.Is(err, os.ErrNotExist):
		cfgData = nil
	case err != nil:
		return nil, fmt.Errorf("load tokenizer config: %w", err)
	}
	if err := t.applyConfig(cfgData); err != nil {
		return nil, fmt.Errorf("load tokenizer config %s: %w", cfgPath, err)
	}
	t.maxPositions = readMaxPositions(dir)
	var jinjaFile []byte
	if b, err := os.ReadFile(filepath.Join(dir, "chat_template.jinja")); err == nil {
		jinjaFile = b
	}
	if cfgData != nil || jinjaFile != nil {
		chat, err := parseChatConfig(cfgData, jinjaFile)
		if err != nil {
			return nil, fmt.Errorf("load tokenizer config %s: %w", cfgPath, err)
		}
		t.chat = chat
	}
	return t, nil
}

func parseTokenizerJSON(data []byte) (*Tokenizer, error) {
	top, modelRaw, vocab, pairs, err := splitTokenizerJSON(data)
	if err != nil {
		return nil, fmt.Errorf("parse tokenizer.json: %w", err)
	}
	var tj tokenizerJSON
	if err := unmarshalSections(top, &tj); err != nil {
		return nil, fmt.Errorf("parse tokenizer.json: %w", err)
	}
	if err := unmarshalSections(modelRaw, &tj.Model); err != nil {
		return nil, fmt.Errorf("parse tokenizer.json model: %w", err)
	}
	if vocab == nil && tj.Model.Vocab != nil && !isNull(tj.Model.Vocab) && tj.Model.Type == "BPE" {
		return nil, fmt.Errorf("model.vocab: want an object")
	}
	m := &tj.Model
	switch m.Type {
	case "BPE":
	case "":
		if len(pairs) == 0 {
			return nil, unsupported("model without type or merges")
		}
	case "WordPiece", "WordLevel", "Unigram":
		return nil, unsupported("model %s (only BPE models are implemented)", m.Type)
	default:
		return nil, unsupported("model %q", m.Type)
	}
	if m.Dropout != nil && *m.Dropout > 0 {
		return nil, unsupported("BPE dropout %v", *m.Dropout)
	}
	if (m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "") ||
		(m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "") {
		return nil, unsupported("BPE continuing_subword_prefix/end_of_word_suffix")
	}
	norm, err := parseNormalizer(tj.Normalizer)
	if err != nil {
		return nil, err
	}
	pre, err := parsePreTokenizer(tj.PreTokenizer)
	if err != nil {
		return nil, err
	}
	if pre.byteLevel && m.ByteFallback {
		return nil, unsupported("BPE with byte_fallback behind a ByteLevel pre-tokenizer")
	}
	if pre.byteLevel && pre.metaspace {
		return nil, unsupported("pre_tokenizer with both ByteLevel and Metaspace")
	}
	// Decoding only serves /detokenize: a decoder this package lacks must not stop a tokenizer
	// that encodes exactly from loading, so its error is kept and returned by Decode.
	dec, decErr := parseDecoder(tj.Decoder)
	if decErr != nil && !errors.Is(decErr, ErrUnsupported) {
		return nil, decErr
	}
	t := &Tokenizer{norm: norm, pre: pre, dec: dec, decErr: decErr, cache: newPieceCache(), segPool: &sync.Pool{}, long: &longPieceState{}}
	if err := t.post.parse(tj.PostProcessor); err != nil {
		return nil, err
	}

	bm := &bpeModel{unkID: -1, fuseUnk: m.FuseUnk, ignoreMerges: m.IgnoreMerges, vocab: vocab}
	if bm.vocab == nil {
		bm.vocab = map[string]uint32{}
	}
	t.idToToken = make(map[uint32]string, len(bm.vocab))
	for tok, id := range bm.vocab {
		t.idToToken[id] = tok
	}
	for b := 0; b < 256; b++ {
		bm.byteIDs[b] = -1
		if id, ok := bm.vocab[string(byteToRune[b])]; ok && pre.byteLevel {
			bm.byteIDs[b] = int64(id)
		}
	}
	if !pre.byteLevel {
		bm.initCharSymbols(m.ByteFallback, pairs)
	}
	if m.UnkToken != nil {
		id, ok := bm.vocab[*m.UnkToken]
		if !ok {
			return nil, fmt.Errorf("model.unk_token %q is not in the vocabulary", *m.UnkToken)
		}
		bm.unkID = int64(id)
	}
	bm.merges = make(map[uint64]uint64, len(pairs))
	for rank, p := range pairs {
		l, ok1 := bm.vocab[p[0]]
		r, ok2 := bm.vocab[p[1]]
		n, ok3 := bm.vocab[p[0]+p[1]]
		if !ok1 || !ok2 || !ok3 {
			return nil, fmt.Errorf("model.merges[%d] %q %q: token not in the vocabulary", rank, p[0], p[1])
		}
		bm.merges[uint64(l)<<32|uint64(r)] = uint64(rank)<<32 | uint64(n)
	}
	t.model = bm

	// Added-token ids are assigned as tokenizers' AddedVocabulary::add_tokens does while
	// deserializing (the JSON "id" is not authoritative): a content already added or in the
	// model vocabulary keeps that id, anything else takes the next id after
	// max(vocabulary size, largest added id).
	t.addedByID = make(map[uint32]*addedToken, len(tj.AddedTokens))
	addedIDs := make(map[string]uint32, len(tj.AddedTokens))
	var rawToks, normToks []*addedToken
	maxAdded, haveAdded := uint32(0), false
	vocabLen := uint32(len(bm.vocab))
	for _, a := range tj.AddedTokens {
		if a.Content == "" {
			continue
		}
		normalized := !a.Special // tokenizers' default when the flag is absent
		if a.Normalized != nil {
			normalized = *a.Normalized
		}
		at := &addedToken{content: a.Content, special: a.Special, lstrip: a.Lstrip,
			rstrip: a.Rstrip, singleWord: a.SingleWord, normalized: normalized}
		if prev, ok := addedIDs[a.Content]; ok && *t.addedByID[prev] == (addedToken{id: prev, content: at.content,
			special: at.special, lstrip: at.lstrip, rstrip: at.rstrip, singleWord: at.singleWord, normalized: at.normalized}) {
			continue // an identical token is ignored
		}
		id, ok := addedIDs[a.Content]
		if !ok {
			id, ok = bm.vocab[a.Content]
		}
		if !ok {
			switch {
			case !haveAdded:
				id = vocabLen
			case maxAdded >= vocabLen || vocabLen == 0:
				id = maxAdded + 1
			default:
				id = vocabLen
			}
		}
		at.id = id
		addedIDs[a.Content] = id
		if !haveAdded || id > maxAdded {
			maxAdded, haveAdded = id, true
		}
		if old, ok := t.addedByID[id]; ok {
			// The same id re-added: the newer definition replaces the older one.
			rawToks = removeToken(rawToks, old)
			normToks = removeToken(normToks, old)
		}
		t.addedByID[id] = at
		if normalized {
			normToks = append(normToks, at)
		} else {
			rawToks = append(rawToks, at)
		}
	}
	t.addedRaw = newAddedMatcher(rawToks, func(a *addedToken) string { return a.content })
	t.addedNorm = newAddedMatcher(normToks, func(a *addedToken) string {
		if t.norm != nil {
			return t.norm.normalize(a.content)
		}
		return a.content
	})
	t.cacheID, t.prefixSafe = cacheIDs.Add(1), t.addedRaw.stripFree()
	return t, nil
}

func removeToken(list []*addedToken, tok *addedToken) []*addedToken {
	out := list[:0]
	for _, x := range list {
		if x != tok {
			out = append(out, x)
		}
	}
	return out
}

// unmarshalSections decodes raw top-level sections into the struct's JSON-tagged fields.
func unmarshalSections(sections map[string]json.RawMessage, v any) error {
	if len(sections) == 0 {
		return nil
	}
	buf, err := json.Marshal(sections)
	if err != nil {
		return err
	}
	return json.Unmarshal(buf, v)
}

// Encode returns the token ids of text as Hugging Face tokenizers' Tokenizer.encode does
// (tokenizer.md steps 2-8): added tokens (special and not) are found in the raw text first, the
// normalizer runs on each segment between them, then pre-tokenization, byte-level mapping and
// BPE. addSpecialTokens applies the post-processor (e.g. Llama 3's BOS; none for Qwen3).
// Invalid UTF-8 bytes are each replaced by U+FFFD first. Never panics. Bounds (longpiece.go): a
// pre-tokenized piece longer than MaxExactPieceBytes is not encoded but estimated, as ids 0; a
// text of more than MaxPromptTokens ids stops after MaxPromptTokens+1.
func (t *Tokenizer) Encode(text string, addSpecialTokens bool) []uint32 {
	before := InexactPieces()
	ids := t.encode(text, addSpecialTokens)
	if InexactPieces() != before {
		zeroInexact(ids)
	}
	return ids
}

// encode is Encode with the ids of long pieces left as inexactID (for boundPrompt).
func (t *Tokenizer) encode(text string, addSpecialTokens bool) []uint32 {
	if t.model == nil {
		return nil // a zero Tokenizer (not from Load) encodes nothing
	}
	if !utf8.ValidString(text) {
		text = sanitizeUTF8(text)
	}
	dst := make([]uint32, 0, len(text)/3+8)
	if addSpecialTokens {
		dst = append(dst, t.post.prefix...)
	}
	dst = t.appendEncoded(text, dst)
	if addSpecialTokens {
		dst = append(dst, t.post.suffix...)
	}
	return dst
}

func sanitizeUTF8(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 8)
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			b.WriteRune(utf8.RuneError)
		} else {
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

func (t *Tokenizer) getSegs() *[]segment {
	if t.segPool == nil { // a Tokenizer not built by Load (tests)
		return new([]segment)
	}
	if p, ok := t.segPool.Get().(*[]segment); ok {
		*p = (*p)[:0]
		return p
	}
	s := make([]segment, 0, 16)
	return &s
}

func (t *Tokenizer) appendEncoded(text string, dst []uint32) []uint32 {
	return t.appendEncodedAt(text, true, false, dst, nil)
}

// segMark is a boundary between two raw segments of an encoded text (the added tokens split it
// there, tokenizer.md step 2): the text offset, how many ids precede it in the output, and whether
// the segment before it is an added token.
type segMark struct {
	off, ids   int
	afterToken bool
}

// appendEncodedAt encodes text onto dst. atStart is false when text continues an earlier text at a
// raw segment boundary (conversation cache): then no segment is the start of the encoded input
// (Metaspace prepend_scheme "first"), and afterToken says whether that earlier text ended with an
// added token. When marks is non-nil every raw segment start, and the end of text, is appended to
// it with len(dst) at that point (ids counted from the start of dst).
func (t *Tokenizer) appendEncodedAt(text string, atStart, afterToken bool, dst []uint32, marks *[]segMark) []uint32 {
	segs := t.getSegs()
	*segs = t.addedRaw.split(text, *segs)
	base := len(dst)
	for _, sg := range *segs {
		if len(dst) > promptTokenLimit || t.stop.check(sg.end-sg.start) {
			break
		}
		if marks != nil {
			*marks = append(*marks, segMark{sg.start, len(dst), afterToken})
			afterToken = sg.id >= 0
		}
		if sg.id >= 0 {
			dst = append(dst, uint32(sg.id))
			continue
		}
		if sg.id == cutSegmentID {
			dst = appendCutRest(dst, base, sg.start, sg.end-sg.start)
			break
		}
		first := atStart && sg.start == 0
		seg := text[sg.start:sg.end]
		if t.norm != nil {
			seg = t.norm.normalize(seg)
		}
		if !t.addedNorm.any {
			dst = t.appendWords(seg, first, dst)
			continue
		}
		inner := t.addedNorm.split(seg, nil)
		for _, s2 := range inner {
			if s2.id >= 0 {
				dst = append(dst, uint32(s2.id))
			} else if s2.id == cutSegmentID {
				dst = appendCutRest(dst, base, sg.start+s2.start, s2.end-s2.start)
				break
			} else {
				dst = t.appendWords(seg[s2.start:s2.end], first && s2.start == 0, dst)
			}
		}
	}
	if marks != nil {
		*marks = append(*marks, segMark{len(text), len(dst), afterToken})
	}
	if cap(*segs) <= maxPooledSegments && t.segPool != nil {
		t.segPool.Put(segs) // not a huge one: the pool would keep it (audit 7 R3)
	}
	return dst
}

// appendWords pre-tokenizes normalized text and appends the BPE ids of every piece; first
// reports whether s starts at offset 0 of the encoded text (Metaspace prepend_scheme "first").
func (t *Tokenizer) appendWords(s string, first bool, dst []uint32) []uint32 {
	if scan := t.pre.fast; scan != nil {
		return t.appendScanned(s, scan, dst)
	}
	if cs := t.model.chars; cs != nil {
		if len(t.pre.steps) == 0 {
			return t.appendCharWord(cs, s, dst)
		}
		for _, p := range t.pre.run(s, first) {
			if dst = t.appendCharWord(cs, p, dst); len(dst) > promptTokenLimit || t.stop.check(len(p)) {
				break
			}
		}
		return dst
	}
	for _, p := range t.pre.run(s, first) {
		if dst = t.appendPiece(p, dst); len(dst) > promptTokenLimit || t.stop.check(len(p)) {
			break
		}
	}
	return dst
}

// appendScanned is appendWords for a pre-tokenizer that is one scanner (preTokenizer.fast): the
// loop every byte of a Qwen, Llama 3 or GPT-2 prompt goes through. For a llama-like scanner the
// common pieces are taken by appendRun, and the loop here encodes the piece it stops at.
func (t *Tokenizer) appendScanned(s string, scan scanFunc, dst []uint32) []uint32 {
	words, limit := t.pre.asciiWords, promptTokenLimit
	for i := 0; i < len(s); {
		if words {
			j := i
			if j, dst = t.cache.short.appendRun(s, i, dst, &t.model.byteIDs, t.pre.maxDigits, limit); j > i {
				if len(dst) > limit || t.stop.check(j-i) || j == len(s) {
					break
				}
				i = j
			}
		}
		j := -1
		if words {
			j = asciiWordEnd(s, i)
		}
		if j < 0 {
			j = scan(s, i)
		}
		if dst = t.appendPiece(s[i:j], dst); len(dst) > limit || t.stop.check(j-i) {
			break
		}
		i = j
	}
	return dst
}

// appendCharWord encodes one pre-tokenized word of a SentencePiece-style model, cut into
// independently encodable pieces (charSymbols.safeCut) that go through the piece cache.
func (t *Tokenizer) appendCharWord(cs *charSymbols, w string, dst []uint32) []uint32 {
	for i, j := 0, 0; i < len(w); i = j {
		j = cs.safeCut(t.model, w, i)
		p := w[i:j]
		if t.stop.check(len(p)) {
			break
		}
		if len(p) > MaxExactPieceBytes {
			if dst = t.appendLongPiece(p, dst, t.model.encodeChars); len(dst) > promptTokenLimit {
				break
			}
			continue
		}
		if len(p) == 1 && p[0] < utf8.RuneSelf {
			if id := cs.ascii[p[0]]; id >= 0 {
				dst = append(dst, uint32(id))
				continue
			}
		}
		var hit bool
		if dst, hit = t.cache.appendCached(w, i, j, dst); !hit {
			n := len(dst)
			dst = t.model.encodeChars(p, dst)
			t.cache.put(p, dst[n:])
		}
	}
	return dst
}

// appendPiece appends the ids of one pre-tokenized piece of a byte-level model.
func (t *Tokenizer) appendPiece(p string, dst []uint32) []uint32 {
	if len(p) == 1 {
		if id := t.model.byteIDs[p[0]]; id >= 0 {
			return append(dst, uint32(id))
		}
	}
	if len(p) == 0 {
		return dst
	}
	if len(p) > MaxExactPieceBytes {
		return t.appendLongPiece(p, dst, t.model.encodeWord)
	}
	if len(p) <= shortPiece {
		a, b := pieceKey(p, 0, len(p))
		if ids, k, hit := t.cache.short.get(a, b, len(p)); hit {
			return appendPacked(dst, ids, k)
		}
	}
	return t.appendUncached(p, dst)
}

// appendUncached appends the ids of piece p (at most MaxExactPieceBytes, not in the piece cache's
// short table) of a byte-level model: from the cache's long table, else encoded and cached.
func (t *Tokenizer) appendUncached(p string, dst []uint32) []uint32 {
	if out, hit := t.cache.appendLong(p, dst); hit {
		return out
	}
	n := len(dst)
	dst = t.model.encodeWord(p, dst)
	t.cache.put(p, dst[n:])
	return dst
}

// Decode returns the text of ids as tokenizers' Tokenizer.decode does with
// skip_special_tokens=false: every id's spelling (added tokens by their content, unknown ids
// skipped) through tokenizer.json's decoder chain (ByteLevel, Metaspace, Replace, ByteFallback,
// Fuse, Strip, Sequence; no decoder joins the spellings with spaces). Invalid UTF-8 in the
// result is replaced by U+FFFD. skipSpecial drops special added tokens first
// (skip_special_tokens=true). The error wraps ErrUnsupported when tokenizer.json names a decoder
// this package does not implement.
func (t *Tokenizer) Decode(ids []uint32, skipSpecial bool) (string, error) {
	if t.decErr != nil {
		return "", t.decErr
	}
	toks := make([]string, 0, len(ids))
	for _, id := range ids {
		if a, ok := t.addedByID[id]; ok {
			if !(skipSpecial && a.special) {
				toks = append(toks, a.content)
			}
			continue
		}
		if tok, ok := t.idToToken[id]; ok {
			toks = append(toks, tok)
		}
	}
	var out string
	if t.dec == nil {
		out = strings.Join(toks, " ")
	} else {
		out = strings.Join(t.dec.decodeChain(toks), "")
	}
	if !utf8.ValidString(out) {
		out = strings.ToValidUTF8(out, "\uFFFD")
	}
	if t.cleanUpSpaces {
		out = cleanUpTokenization(out)
	}
	return out, nil
}

// VocabSize returns the number of distinct token ids (model vocabulary plus added tokens not in
// it), for validating token-id prompts.
func (t *Tokenizer) VocabSize() int {
	n := len(t.idToToken)
	for id := range t.addedByID {
		if _, ok := t.idToToken[id]; !ok {
			n++
		}
	}
	return n
}
