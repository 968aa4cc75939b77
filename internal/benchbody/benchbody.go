// Package benchbody builds the request bodies of kvepp's ext_proc load benchmarks (`eppbench load`
// and the runner's exchange benchmarks): synthetic multi-turn conversations, and bodies made unique
// per request the way real traffic differs — a marker at the start of the last message's text, so
// no cache keyed by a prefix of that message can answer a benchmark request that a real user would
// never send twice.
package benchbody

import (
	"bytes"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
)

// Body is one request body and the place where a per-request marker makes it unique.
type Body struct {
	// Raw is the body as sent when it is not made unique.
	Raw []byte
	// Path is the request's :path (from the body's shape unless given).
	Path string
	// Turns is the number of user messages of a chat body (0 for other kinds).
	Turns int
	// markAt is the offset in Raw just after the opening quote of the last message's text (chat),
	// of the prompt (completions) or of the input (responses); -1 when there is no text to mark.
	markAt int
}

// New inspects raw, a JSON request body, and finds where its unique marker goes: the text of the
// last message (chat completions: a string content, or the last text part), the prompt
// (completions: a string or the last string of a list) or the input (responses). path "" takes
// /v1/chat/completions, /v1/completions or /v1/responses from the body's shape. The error says why
// raw is not a request body.
func New(raw []byte, path string) (*Body, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(raw, &top); err != nil {
		return nil, errors.New("not a JSON object: " + err.Error())
	}
	b := &Body{Raw: raw, Path: path, markAt: -1}
	var target json.RawMessage
	def := ""
	switch {
	case top["messages"] != nil:
		var msgs []map[string]json.RawMessage
		if err := json.Unmarshal(top["messages"], &msgs); err != nil || len(msgs) == 0 {
			return nil, errors.New("messages must be a non-empty array of objects")
		}
		for _, m := range msgs {
			if string(m["role"]) == `"user"` {
				b.Turns++
			}
		}
		target, def = lastText(msgs[len(msgs)-1]["content"]), "/v1/chat/completions"
	case top["prompt"] != nil:
		target, def = lastText(top["prompt"]), "/v1/completions"
	case top["input"] != nil:
		target, def = lastText(top["input"]), "/v1/responses"
	default:
		return nil, errors.New("the body has none of messages, prompt, input")
	}
	if b.Path == "" {
		b.Path = def
	}
	if len(target) >= 2 && target[0] == '"' {
		if i := bytes.LastIndex(raw, target); i >= 0 {
			b.markAt = i + 1
		}
	}
	return b, nil
}

// Unique returns the body of request n of a run: Raw with "[<run> <n>] " inserted at the start of
// the last message's text (run should differ between runs against the same server, so no request
// repeats an earlier run's either). It returns Raw itself when there is no text to mark. The
// result is a new slice, safe to hand to gRPC (which may read a message after Send returns).
func (b *Body) Unique(run string, n uint64) []byte {
	if b.markAt < 0 {
		return b.Raw
	}
	return b.AppendUnique(make([]byte, 0, len(b.Raw)+len(run)+24), run, n)
}

// AppendUnique appends the body Unique returns to dst (Raw when there is no text to mark), for a
// benchmark that reuses one buffer.
func (b *Body) AppendUnique(dst []byte, run string, n uint64) []byte {
	if b.markAt < 0 {
		return append(dst, b.Raw...)
	}
	dst = append(dst, b.Raw[:b.markAt]...)
	dst = append(dst, '[')
	dst = append(dst, run...)
	dst = append(dst, ' ')
	dst = strconv.AppendUint(dst, n, 10)
	dst = append(dst, "] "...)
	return append(dst, b.Raw[b.markAt:]...)
}

// Markable reports whether Unique changes the body.
func (b *Body) Markable() bool { return b.markAt >= 0 }

// lastText returns the raw JSON string of v when it is a string, else of the last string (or the
// last "text" member) inside an array; nil when there is none.
func lastText(v json.RawMessage) json.RawMessage {
	v = bytes.TrimSpace(v)
	if len(v) == 0 {
		return nil
	}
	if v[0] == '"' {
		return v
	}
	var arr []json.RawMessage
	if json.Unmarshal(v, &arr) != nil {
		return nil
	}
	for i := len(arr) - 1; i >= 0; i-- {
		e := bytes.TrimSpace(arr[i])
		if len(e) > 0 && e[0] == '"' {
			return e
		}
		var part map[string]json.RawMessage
		if json.Unmarshal(e, &part) == nil && len(part["text"]) > 0 && part["text"][0] == '"' {
			return part["text"]
		}
	}
	return nil
}

// words is the vocabulary of the synthetic conversations: common English words plus the
// code-ish tokens (identifiers, numbers, punctuation) of a technical chat.
var words = strings.Fields(`the of and to in is that it for on with as was this be by are
at or from have an not but which they you one all their there can more has been if when will would
about what so out up into than them some could other its time only new like then also two these may
first any our over such after most use well even where through because each those how while many both
cache router block token prefix worker request latency memory model server queue batch index hash
function return value error config update result number string buffer stream context engine shard
replica kernel tensor layer decode prefill attention vector matrix gradient weight sample epoch,
however, therefore. because: (see above) [note] {key: value} x = y + 1; i++ 42 7 2024 3.14 0x1f
"quoted" 'single' foo_bar FooBar fooBar ./path/to/file.go http://example.com/a?b=c #tag`)

// DefaultTurnBytes is the text per conversation turn of Conversation when none is given: 30 turns
// make a body of about 225 KB.
const DefaultTurnBytes = 7680

// Conversation builds a streamed chat completions body for model with a system message and turns
// user messages, each but the last followed by an assistant reply: about turnBytes bytes of text
// per turn, three quarters in the user message and one quarter in the reply. The text is
// deterministic pseudo-English (fixed seed), so every run and every server sees the same
// conversation, and for k < n the messages of Conversation(m, k, b) are the first 2k messages of
// Conversation(m, n, b): a conversation continuing.
func Conversation(model string, turns, turnBytes int) []byte {
	rng := rand.New(rand.NewPCG(15, 15))
	text := func(n int) string {
		var sb strings.Builder
		for sb.Len() < n {
			if sb.Len() > 0 {
				if rng.IntN(12) == 0 {
					sb.WriteString("\n\n")
				} else {
					sb.WriteByte(' ')
				}
			}
			sb.WriteString(words[rng.IntN(len(words))])
		}
		return sb.String()
	}
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	msgs := []msg{{"system", "You are a helpful assistant for a team that runs LLM inference clusters."}}
	for t := 0; t < turns; t++ {
		msgs = append(msgs, msg{"user", text(turnBytes * 3 / 4)})
		if t < turns-1 {
			msgs = append(msgs, msg{"assistant", text(turnBytes / 4)})
		}
	}
	out, _ := json.Marshal(struct {
		Model    string `json:"model"`
		Messages []msg  `json:"messages"`
		Stream   bool   `json:"stream"`
	}{model, msgs, true})
	return out
}
