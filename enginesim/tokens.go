package enginesim

import (
	"strings"
	"unicode"

	"github.com/zeebo/xxh3"
)

// TextVocabSize is the size of the simulator's text vocabulary: text token ids
// are in [0, TextVocabSize).
const TextVocabSize = 1 << 17

// TokenizeText turns text into token ids with the simulator's deterministic
// scheme: every maximal run of non-whitespace characters (unicode.IsSpace) is
// one token with id xxh3_64(utf8 run, seed 0) mod [TextVocabSize]. Whitespace
// only separates tokens, so "a  b" and "a b" tokenize alike. Empty or
// all-whitespace text yields no tokens. It never fails.
func TokenizeText(text string) []uint32 {
	var out []uint32
	for _, word := range strings.FieldsFunc(text, unicode.IsSpace) {
		out = append(out, uint32(xxh3.HashString(word)%TextVocabSize))
	}
	return out
}

// ChatMessage is one message of a chat request as the simulator reads it: the
// role and the text of its content (string content as is; for an array of
// parts, the "text" fields joined with "\n").
type ChatMessage struct {
	Role    string
	Content string
}

// RenderChat renders chat messages to the text the simulator tokenizes: for
// each message "<|im_start|>{role}\n{content}<|im_end|>\n", then the generation
// prompt "<|im_start|>assistant\n".
func RenderChat(msgs []ChatMessage) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("<|im_start|>")
		b.WriteString(m.Role)
		b.WriteString("\n")
		b.WriteString(m.Content)
		b.WriteString("<|im_end|>\n")
	}
	b.WriteString("<|im_start|>assistant\n")
	return b.String()
}

// outputWords is the text emitted for generated tokens, cycled.
var outputWords = [...]string{" lorem", " ipsum", " dolor", " sit", " amet"}

// outputText returns the text of generated tokens from..to−1 (0-based), concatenated.
func outputText(from, to int) string {
	var b strings.Builder
	for k := from; k < to; k++ {
		b.WriteString(outputWords[k%len(outputWords)])
	}
	return b.String()
}
