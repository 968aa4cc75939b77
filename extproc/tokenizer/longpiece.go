package tokenizer

import (
	"slices"
	"sync"
	"sync/atomic"
	"unicode/utf8"
)

// Bounds of one encode (audit 7 R2). BPE keeps per-byte state for a whole pre-tokenized piece
// (about 32 bytes and, for a piece of megabytes, half a microsecond per byte), and a piece is as
// long as the request makes it: a 16 MB word without spaces, or a run of 16 million spaces, is one
// piece that costs seconds of CPU and hundreds of MB. Real text has pieces of a few bytes to a few
// hundred (the longest: runs of spaces or punctuation in code), so pieces above MaxExactPieceBytes
// are not merged at all: their ids are an estimate, and the prompt is exact only before them, as
// after an image ("exact prefix, the rest uncached", ChatPrompt.UncachedFrom).
const (
	// MaxExactPieceBytes is the longest pre-tokenized piece (bytes, after normalization) that is
	// encoded exactly: 16 KiB.
	MaxExactPieceBytes = 16 << 10
	// MaxPromptTokens bounds the ids of one encoded prompt (16,777,216 = 2^24, the picker's
	// MaxISLTokens): encoding stops as soon as the prompt has more, and the request is refused.
	MaxPromptTokens = 1 << 24
	// estimateSampleBytes is how much of a long piece is encoded exactly to estimate its ids: the
	// sample's ids per byte, applied to the whole piece.
	estimateSampleBytes = 1 << 10
	// maxPooledSegments is the largest segment scratch returned to the pool: a text of millions
	// of added tokens (56 MB of "<|im_end|>") needs one segment each, 134 MB the pool would keep.
	maxPooledSegments = 4096
	// MaxAddedTokenSegments bounds the segments the added-token split makes of one text (2^20,
	// about half a million added tokens with the text between them): each costs a 24-byte
	// segment and a 24-byte cache mark, so 56 MB of "<|im_end|>" cost a gigabyte. The text after
	// the last one is not encoded: its ids are an estimate (the ids per byte so far), booked as
	// uncached like an estimated piece. Real prompts have a few added tokens per message.
	MaxAddedTokenSegments = 1 << 20
)

// segmentLimit is MaxAddedTokenSegments, a variable only so that tests can use a small one.
var segmentLimit = MaxAddedTokenSegments

// cutSegmentID marks the segment addedMatcher.split ends with when it reached segmentLimit: the
// rest of the text, unsplit.
const cutSegmentID = -2

// appendCutRest appends the estimate for the unsplit rest of a text (rest bytes) after segments
// that covered done bytes with len(dst)-base ids: the same ids per byte, at least one, at most
// up to promptTokenLimit+1 ids in all.
func appendCutRest(dst []uint32, base, done, rest int) []uint32 {
	inexactPieces.Add(1)
	est := max(1, int((int64(len(dst)-base)*int64(rest)+int64(done)-1)/int64(max(done, 1))))
	for range min(est, promptTokenLimit+1-len(dst)) {
		dst = append(dst, inexactCutID)
	}
	return dst
}

// promptTokenLimit is MaxPromptTokens, a variable only so that tests can use a small one.
var promptTokenLimit = MaxPromptTokens

// inexactID stands in, during an encode, for the ids of a piece longer than MaxExactPieceBytes:
// no vocabulary has 2^32 ids, so the first one marks where the exact prefix ends. Prompts leave
// the package with these ids replaced by 0 (boundPrompt).
const inexactID = ^uint32(0)

// inexactCutID is inexactID for the estimate of the text after MaxAddedTokenSegments segments
// (appendCutRest), so that the refusal can name its own cause.
const inexactCutID = inexactID - 1

// isInexact reports whether id is one of the estimate markers (inexactID, inexactCutID).
func isInexact(id uint32) bool { return id >= inexactCutID }

// inexactPieces counts the pieces estimated rather than encoded, process-wide (InexactPieces).
var inexactPieces atomic.Uint64

// InexactPieces returns how many texts this process estimated instead of encoding: pre-tokenized
// pieces longer than MaxExactPieceBytes, and texts cut after MaxAddedTokenSegments segments (each
// one's ids booked as uncached, or its request refused where exact ids are required). Exported as
// the metric kvepp_tokenizer_inexact_pieces_total.
func InexactPieces() uint64 { return inexactPieces.Load() }

// longPieceState is a Tokenizer's lazily computed bound for estimates: the most input bytes one
// vocabulary token stands for.
type longPieceState struct {
	once     sync.Once
	maxBytes int
}

// maxTokenBytes returns the most input bytes one token covers (model vocabulary and added
// tokens; a byte-level spelling covers one byte per character), at least 1. ceil(n / it) is a
// lower bound on the ids of n bytes.
func (t *Tokenizer) maxTokenBytes() int {
	if t.long == nil { // a Tokenizer not built by Load (tests)
		return t.computeMaxTokenBytes()
	}
	t.long.once.Do(func() { t.long.maxBytes = t.computeMaxTokenBytes() })
	return t.long.maxBytes
}

func (t *Tokenizer) computeMaxTokenBytes() int {
	m := 1
	for _, tok := range t.idToToken {
		n := len(tok)
		if t.pre.byteLevel {
			n = utf8.RuneCountInString(tok)
		}
		m = max(m, n)
	}
	for _, a := range t.addedByID {
		m = max(m, len(a.content))
	}
	return m
}

// appendLongPiece appends the estimated ids of a piece longer than MaxExactPieceBytes as
// inexactID: the ids per byte of its first estimateSampleBytes (encoded by encode, the model's
// BPE), applied to its length, but at least the exact lower bound ceil(len / maxTokenBytes). It
// never appends more than MaxPromptTokens+1 ids in all, so a prompt over the limit stops here
// without running BPE on the piece.
func (t *Tokenizer) appendLongPiece(p string, dst []uint32, encode func(string, []uint32) []uint32) []uint32 {
	inexactPieces.Add(1)
	room := promptTokenLimit + 1 - len(dst)
	if room <= 0 {
		return dst
	}
	lower := (len(p) + t.maxTokenBytes() - 1) / t.maxTokenBytes()
	est := lower
	if lower < room {
		cut := estimateSampleBytes
		for cut > estimateSampleBytes-utf8.UTFMax && !utf8.RuneStart(p[cut]) {
			cut--
		}
		var buf [estimateSampleBytes]uint32
		sample := len(encode(p[:cut], buf[:0]))
		est = max(lower, int((int64(sample)*int64(len(p))+int64(cut)-1)/int64(cut)))
	}
	for range min(est, room) {
		dst = append(dst, inexactID)
	}
	return dst
}

// boundPrompt checks ids encoded by this package: more than MaxPromptTokens is a *RequestError;
// otherwise exact is the number of leading ids that are exact (len(ids) when no piece was
// estimated), and the estimated ids are replaced by 0. It costs nothing unless the process met a
// long piece since before was read (InexactPieces), which is how a caller takes it.
func boundPrompt(ids []uint32, before uint64) (exact int, err error) {
	if len(ids) > promptTokenLimit {
		return 0, badRequest("the prompt is longer than the limit of %d tokens (tokenizing stopped there)", promptTokenLimit)
	}
	if inexactPieces.Load() == before {
		return len(ids), nil
	}
	exact = slices.IndexFunc(ids, isInexact)
	if exact < 0 {
		return len(ids), nil // another request's long piece
	}
	zeroInexact(ids[exact:])
	return exact, nil
}

// zeroInexact replaces the estimate markers in ids (isInexact) by 0.
func zeroInexact(ids []uint32) {
	for i, id := range ids {
		if isInexact(id) {
			ids[i] = 0
		}
	}
}

// cacheable reports whether ids encoded since InexactPieces returned before may be kept in the
// conversation cache: within MaxPromptTokens and without an estimated piece.
func cacheable(ids []uint32, before uint64) bool {
	return len(ids) <= promptTokenLimit && (inexactPieces.Load() == before || !slices.ContainsFunc(ids, isInexact))
}

// exactPrompt is boundPrompt for the APIs that return exact ids only (/tokenize, TokenizeChat):
// a prompt with an estimated piece is a *RequestError.
func exactPrompt(ids []uint32, before uint64) ([]uint32, error) {
	if len(ids) <= promptTokenLimit && inexactPieces.Load() != before {
		if i := slices.IndexFunc(ids, isInexact); i >= 0 && ids[i] == inexactCutID {
			return nil, badRequest("the text has more than %d added (special) tokens and runs of text between them; kvepp tokenizes the text after them only approximately, for routing", segmentLimit)
		}
	}
	exact, err := boundPrompt(ids, before)
	if err != nil {
		return nil, err
	}
	if exact < len(ids) {
		return nil, badRequest("the text has a word, or a run of spaces or punctuation, of more than %d bytes; kvepp tokenizes such a piece only approximately, for routing", MaxExactPieceBytes)
	}
	return ids, nil
}
