package tokenizer

import (
	"strings"
	"unicode/utf8"
)

// imageMode says what the chat path does with image content parts.
type imageMode uint8

const (
	// imagesRefused answers 400 (exact tokenization only, e.g. /tokenize).
	imagesRefused imageMode = iota
	// imagesAsSentinels renders each image as imageSentinel, to find where the first one is.
	imagesAsSentinels
	// imagesAsParts renders images as vLLM hands them to an "openai"-format template
	// ({"type": "image"}), to see the text the template puts there.
	imagesAsParts
)

// imageSentinel marks an image in a rendered prompt: private-use characters no request text or
// template is expected to contain.
const imageSentinel = "\uE000kvepp-image\uE001"

// backOffTokens is how many tokens before the first image are treated as uncached when the text
// the engine puts at the image is not known to start with an added token: BPE may join the
// prefix's last piece with that text, so those last tokens may differ from the engine's.
const backOffTokens = 4

// ChatPrompt is a chat request tokenized for routing: TokenIDs are the engine's ids exactly up to
// UncachedFrom; from there on (the first image, epp.md §5.4 as kvepp extends it) the ids stand in
// for content kvepp cannot tokenize as the engine does, and their blocks must be booked as
// uncached. The same holds from the first pre-tokenized piece longer than MaxExactPieceBytes,
// whose ids are an estimate (longpiece.go). UncachedFrom is len(TokenIDs) for a text-only request
// without such a piece.
type ChatPrompt struct {
	TokenIDs     []uint32
	UncachedFrom int
	// Memo, when non-nil, keeps the block hashes of the cached conversation prefix TokenIDs starts
	// with (ChatOptions.Cache); TokenIDs may then share memory with the cache: do not modify it.
	Memo *PrefixMemo
}

// TokenizeChatPrompt tokenizes a chat completions body for routing. A text-only request gives
// exactly TokenizeChat's ids. A request with image parts (image_url, input_image, image_pil,
// image_embeds) is rendered with a sentinel at every image: the text before the first image is
// encoded exactly (the blocks before it hash as the engine's do); the rest — the remaining text
// plus imageTokens ids per image — is returned after UncachedFrom. When the rendered text at the
// image does not start with an added token (string content format, whose placeholder is
// model-specific, or a template that prints plain text for the image), UncachedFrom backs off by
// backOffTokens. Errors as TokenizeChat.
func (t *Tokenizer) TokenizeChatPrompt(body []byte, imageTokens int) (ChatPrompt, error) {
	r, err := ParseRequest(body)
	if err != nil {
		return ChatPrompt{}, err
	}
	return t.ChatPromptFor(r, ChatOptions{ImageTokens: imageTokens})
}

// ChatOptions are the options of ChatPromptFor.
type ChatOptions struct {
	// ImageTokens is the number of ids booked per image part (DYN_EPP_IMAGE_TOKENS).
	ImageTokens int
	// Cache, when non-nil, is the conversation cache a text-only chat reuses and fills (the ids
	// are the same either way; see ConversationCache).
	Cache *ConversationCache
}

// ChatPromptFor is TokenizeChatPrompt for a Request (a body already split into its members), with
// an optional conversation cache. Errors as TokenizeChat.
func (t *Tokenizer) ChatPromptFor(r *Request, o ChatOptions) (ChatPrompt, error) {
	in, addSpecial, err := chatInputFromRequest(r)
	if err != nil {
		return ChatPrompt{}, err
	}
	in.images = imagesAsSentinels
	if o.Cache != nil {
		before := InexactPieces()
		ids, memo, handled, err := t.cachedChat(in, addSpecial, o.Cache)
		if err != nil {
			return ChatPrompt{}, err
		}
		if handled {
			exact, err := boundPrompt(ids, before)
			if err != nil {
				return ChatPrompt{}, err
			}
			return ChatPrompt{TokenIDs: ids, UncachedFrom: exact, Memo: memo}, nil
		}
	}
	prompt, err := t.render(in)
	if err != nil {
		return ChatPrompt{}, err
	}
	return t.splitAtImages(prompt, countImageParts(in.messages), addSpecial, o.ImageTokens,
		func(prefix string) bool { return t.imageBoundaryClean(in, prefix) })
}

// MaxImagesPerRequest bounds the image parts of one routed request (128): each is booked as
// ImageTokens ids, so without a bound a 3 MB body of 65,000 image parts books 16 M tokens and a
// few dozen of them exhaust the EPP's memory. vLLM itself accepts a handful of images per prompt
// (--limit-mm-per-prompt).
const MaxImagesPerRequest = 128

// countImageParts counts the image content parts of decoded chat messages.
func countImageParts(messages *jval) int {
	n := 0
	if messages == nil {
		return 0
	}
	for _, m := range messages.arr {
		c := m.get("content")
		if c == nil || c.kind != jArray {
			continue
		}
		for _, p := range c.arr {
			if typ := p.get("type"); typ != nil && typ.kind == jString && imagePartTypes[typ.s] {
				n++
			}
		}
	}
	return n
}

// splitAtImages encodes a prompt rendered with imageSentinel at each of its image parts:
// exactly up to the first image (backing off backOffTokens unless clean, which may be nil, says
// the engine's text there starts with an added token), then the rest of the text and imageTokens
// ids per image as uncached (images counts the request's image parts; the template may render
// fewer). A prompt without a sentinel is encoded as it is. Errors (*RequestError): more than
// MaxImagesPerRequest image parts, or more sentinels than image parts (the request's text itself
// carries the sentinel and would be routed as images).
func (t *Tokenizer) splitAtImages(prompt string, images int, addSpecial bool, imageTokens int, clean func(prefix string) bool) (ChatPrompt, error) {
	if images > MaxImagesPerRequest {
		return ChatPrompt{}, badRequest("the request has %d image parts; kvepp routes at most %d per request", images, MaxImagesPerRequest)
	}
	before := InexactPieces()
	first := strings.Index(prompt, imageSentinel) // one scan of a text-only prompt
	if first < 0 {
		ids := t.encode(prompt, addSpecial)
		exact, err := boundPrompt(ids, before)
		return ChatPrompt{TokenIDs: ids, UncachedFrom: exact}, err
	}
	// Fewer sentinels than image parts is fine (the template did not render some messages, e.g.
	// a developer turn); more can only come from the request's own text.
	if 1+strings.Count(prompt[first+len(imageSentinel):], imageSentinel) > images {
		return ChatPrompt{}, badRequest("the request's text contains the character sequence U+E000 \"kvepp-image\" U+E001, which kvepp reserves to mark images")
	}
	prefix := prompt[:first]
	rest := strings.ReplaceAll(prompt[first+len(imageSentinel):], imageSentinel, "")

	ids := make([]uint32, 0, len(prompt)/3+images*imageTokens+8)
	if addSpecial {
		ids = append(ids, t.post.prefix...)
	}
	ids = t.appendEncodedText(prefix, ids)
	uncached := len(ids)
	if clean == nil || !clean(prefix) {
		uncached = max(uncached-backOffTokens, 0)
	}
	ids = t.appendEncodedText(rest, ids)
	for i := 0; i < images*imageTokens; i++ {
		ids = append(ids, 0)
	}
	if addSpecial {
		ids = append(ids, t.post.suffix...)
	}
	exact, err := boundPrompt(ids, before)
	return ChatPrompt{TokenIDs: ids, UncachedFrom: min(uncached, exact)}, err
}

// CompletionPromptFor tokenizes a completions body for routing, as CompletionIDs does, except
// that a prompt with a piece longer than MaxExactPieceBytes is routed: its ids are exact up to
// UncachedFrom, the ids from that piece on are estimated (booked as uncached). Errors as
// TokenizeCompletion, and a *RequestError for a prompt of more than MaxPromptTokens tokens.
func (t *Tokenizer) CompletionPromptFor(r *Request) (ChatPrompt, error) {
	before := InexactPieces()
	ids, encoded, err := t.completionIDs(r)
	if err != nil || !encoded {
		return ChatPrompt{TokenIDs: ids, UncachedFrom: len(ids)}, err
	}
	exact, err := boundPrompt(ids, before)
	return ChatPrompt{TokenIDs: ids, UncachedFrom: exact}, err
}

// appendEncodedText encodes s (without special tokens) onto dst.
func (t *Tokenizer) appendEncodedText(s string, dst []uint32) []uint32 {
	if t.model == nil {
		return dst
	}
	return t.appendEncoded(sanitizeIfNeeded(s), dst)
}

// imageBoundaryClean reports whether the engine's text at the first image starts with an added
// token right after prefix, so the prefix's ids are exactly the engine's: only knowable for an
// "openai"-format template, rendered again with the image parts vLLM passes.
func (t *Tokenizer) imageBoundaryClean(in *chatInput, prefix string) bool {
	tmpl, err := t.chat.pick(in.tools != nil)
	if err != nil || !tmpl.openAIContent {
		return false
	}
	in.images = imagesAsParts
	real, err := t.render(in)
	in.images = imagesAsSentinels
	if err != nil || !strings.HasPrefix(real, prefix) {
		return false
	}
	start, _, tok := t.addedRaw.next(real, len(prefix))
	return tok != nil && start == len(prefix)
}

// TokenizeChatText is TokenizeChat for callers that need exact ids only (/tokenize): image parts
// are a bad request rather than routed by their prefix.
func (t *Tokenizer) TokenizeChatText(body []byte) ([]uint32, error) {
	return t.TokenizeChat(body)
}

// TokenString returns the vocabulary spelling of id (an added token's content), as
// transformers' convert_ids_to_tokens; false for an unknown id.
func (t *Tokenizer) TokenString(id uint32) (string, bool) {
	if a, ok := t.addedByID[id]; ok {
		return a.content, true
	}
	s, ok := t.idToToken[id]
	return s, ok
}

func sanitizeIfNeeded(s string) string {
	if utf8.ValidString(s) {
		return s
	}
	return sanitizeUTF8(s)
}
