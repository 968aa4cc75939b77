package tokenizer

import (
	"encoding/binary"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
)

// Spliced rendering of chat templates.
//
// Rendering a chat template with the jinja engine costs far more than the text it prints: for a
// 12 KB chat most of the time goes into building the template's variables and walking the
// template, and the messages' contents, which are most of the text, are only copied. For a
// template proven below, a conversation is rendered once with each message content replaced by a
// distinct stand-in (the skeleton), memoized by everything else the render depends on (the
// conversation's shape), and split at the stand-ins; the prompt text of any conversation of that
// shape is then the skeleton's literal pieces with the real contents put in between.
//
// That is exact where, for the template, a message's string content is printed verbatim at
// exactly one place and every other use of it is a predicate whose value on the real content
// equals its value on the stand-in (spliceProof.ok checks that on each message). Then the
// template's control flow, and so every literal piece it prints, is the same for the real
// conversation as for the stand-in one, and each content is printed where its stand-in is. The
// real contents never go through the splitter (only the skeleton is split), so a content that
// holds stand-in text, or template keywords, is spliced like any other. A skeleton in which a
// stand-in does not occur exactly once falls back, as does every message, template or value the
// proof does not cover: the full render decides (and reports any error).

// spliceProof is the splice obligation discharged for one chat template: which messages the
// skeleton render covers.
type spliceProof struct {
	name string
	// ok reports whether a preprocessed message's content may be replaced by a stand-in: its
	// role and fields are ones the proof covers and each predicate the template evaluates on the
	// content has the same value on it as on a stand-in.
	ok func(m *jval) bool
}

// splicedTemplates maps the digest of a template source (templateDigest) to its splice proof.
//
// Qwen3 (Qwen/Qwen3-*, digest as in provenTemplates), for conversations of system, user and tool
// messages only (contents strings: vLLM's string content format, conversation()):
//   - A system message's content is printed verbatim once: in the head when it is messages[0]
//     (messages[0].content + '\n\n' with tools, '<|im_start|>system\n' + content + '<|im_end|>\n'
//     without), else in the loop ('<|im_start|>' + role + '\n' + content + '<|im_end|>\n'; the
//     loop skips messages[0] when it is a system message, through loop.first).
//   - A user message's content is printed verbatim once, in the loop, as above.
//   - A tool message's content is printed verbatim once ({{- message.content }} between
//     '\n<tool_response>\n' and '\n</tool_response>'); around it the template reads only the
//     neighbours' roles, loop.first and loop.last.
//   - The only other read of a content is the reverse scan's
//     content.startswith('<tool_response>') and content.endswith('</tool_response>') on user
//     messages, whose only effect is ns.last_query_index, which only the assistant branch reads.
//     No covered conversation has an assistant message (ok is false for one, and the whole
//     conversation falls back), so that predicate's value never reaches the text: it need not
//     agree between content and stand-in.
//   - The other inputs of the render — roles, the message count, tools, chat_template_kwargs
//     (enable_thinking …), add_generation_prompt, the special tokens — are the skeleton's key
//     (names are keyed too; tool_call_id is not: the template never reads it), so they are the
//     same in the skeleton render. The template never calls strftime_now.
//
// Phi-3 (digest as in provenTemplates): the loop prints a system, user or assistant message as
// '<|' + tag + '|>\n' + message['content'] + '<|end|>\n' from its role and content alone (content
// verbatim, once); no other expression reads the content, and nothing reads any other field, so
// a message of those roles with a string content is covered whatever else it holds (tool_calls,
// reasoning …). A message of another role prints nothing: its stand-in would not occur, so such a
// conversation is not covered (ok false). The rest is add_generation_prompt and eos_token (keyed).
//
// Not proven (full render): every other template (Gemma's content | trim, Mistral's and Llama 2's
// raise_exception over roles and their loop.index0-dependent folding have not been worked
// through), and Qwen3 conversations with an assistant message (its content is split at
// '</think>', stripped and tested for truthiness).
var splicedTemplates = map[string]*spliceProof{
	"87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5": {name: "qwen3", ok: qwen3SpliceOK},
	"dcaee66df77bfbb789ec541fe713218da30225a526f1db97138fc39ee6dc56aa": {name: "phi3", ok: phi3SpliceOK},
}

// phi3SpliceOK: a system, user or assistant message with a string content (see
// splicedTemplates).
func phi3SpliceOK(m *jval) bool {
	role, content := m.get("role"), m.get("content")
	if role == nil || role.kind != jString || content == nil || content.kind != jString {
		return false
	}
	return role.s == "system" || role.s == "user" || role.s == "assistant"
}

// qwen3SpliceOK: a system, user or tool message as conversation() makes it, which a stand-in
// content can replace (see splicedTemplates).
func qwen3SpliceOK(m *jval) bool {
	if m == nil || m.kind != jObject || len(m.keys) < 2 {
		return false
	}
	role := m.get("role")
	if role == nil || role.kind != jString {
		return false
	}
	switch role.s {
	case "system", "user", "tool":
	default:
		return false
	}
	content := false
	for i, k := range m.keys {
		switch k {
		case "role", "name":
		case "content":
			content = m.vals[i].kind == jString
		case "tool_call_id":
			if role.s != "tool" {
				return false
			}
		default:
			return false
		}
	}
	return content
}

// standInMark starts every stand-in: U+FDD0 is a Unicode noncharacter, so the template's own text
// and the special tokens do not hold it (a skeleton in which it occurs other than once per
// stand-in falls back anyway).
const standInMark = "\uFDD0kvepp-content-"

// standInText is the stand-in content of message i.
func standInText(i int) string { return standInMark + strconv.Itoa(i) + "\uFDD1" }

// skeleton is a memoized stand-in render split at its stand-ins: the prompt text is pieces[0],
// the content of message slots[0], pieces[1], … pieces[len(slots)].
type skeleton struct {
	pieces []string
	slots  []int
	size   int // bytes of the pieces
	// unusable marks a shape whose stand-in render failed or did not hold each stand-in exactly
	// once: that depends on the shape alone (no real content is in it), so it is remembered and
	// the shape's requests render in full at once instead of rendering the stand-ins again.
	unusable bool
}

// skeletonCache memoizes a template's skeletons by shape (spliceKey). Bounded by maxSkeletonBytes
// of keys and pieces (emptied when full); concurrency-safe.
type skeletonCache struct {
	mu    sync.Mutex
	byKey map[string]*skeleton
	bytes int
	built atomic.Uint64 // stand-in renders made (for tests)
}

// maxSkeletonBytes bounds one template's skeleton cache (keys and pieces).
const maxSkeletonBytes = 1 << 20

func (c *skeletonCache) get(key []byte) *skeleton {
	c.mu.Lock()
	s := c.byKey[string(key)]
	c.mu.Unlock()
	return s
}

func (c *skeletonCache) put(key []byte, s *skeleton) {
	n := len(key) + s.size + 64
	if n > maxSkeletonBytes/4 {
		return // one huge shape (a long tools list) would evict everything else
	}
	c.mu.Lock()
	if c.byKey == nil || c.bytes+n > maxSkeletonBytes {
		c.byKey, c.bytes = map[string]*skeleton{}, 0
	}
	if _, ok := c.byKey[string(key)]; !ok {
		c.byKey[string(key)] = s
		c.bytes += n
	}
	c.mu.Unlock()
}

// spliceKey is the shape of a render: add_generation_prompt, the raw tools and
// chat_template_kwargs, and each message's role and name. ok is false when the render depends on
// values the raw bytes do not stand for (decoded tools or kwargs without them).
func spliceKey(in *chatInput, conv *jval, agp bool) ([]byte, bool) {
	if (in.tools != nil && in.toolsRaw == nil) || (in.kwargs != nil && in.kwargsRaw == nil) {
		return nil, false
	}
	key := make([]byte, 0, 16+len(in.toolsRaw)+len(in.kwargsRaw)+16*len(conv.arr))
	if agp {
		key = append(key, 1)
	} else {
		key = append(key, 0)
	}
	key = binary.AppendUvarint(key, uint64(len(in.toolsRaw)))
	key = append(key, in.toolsRaw...)
	key = binary.AppendUvarint(key, uint64(len(in.kwargsRaw)))
	key = append(key, in.kwargsRaw...)
	for _, m := range conv.arr {
		role := m.get("role").s
		key = binary.AppendUvarint(key, uint64(len(role)))
		key = append(key, role...)
		if n := m.get("name"); n != nil {
			key = append(key, 1)
			key = binary.AppendUvarint(key, uint64(len(n.s)))
			key = append(key, n.s...)
		} else {
			key = append(key, 0)
		}
	}
	return key, true
}

// spliced returns the render of conv by splicing (see the top of this file); ok false means the
// caller renders in full. tools are the dumped tools (nil for none). The split budget has been
// checked on the real values by the caller.
func (t *Tokenizer) spliced(tmpl *chatTemplate, in *chatInput, conv, tools *jval, agp bool) (string, bool) {
	proof := tmpl.splice
	if proof == nil || len(conv.arr) == 0 {
		return "", false
	}
	total := 0
	for _, m := range conv.arr {
		if !proof.ok(m) {
			return "", false
		}
		total += len(m.get("content").s)
	}
	key, ok := spliceKey(in, conv, agp)
	if !ok {
		return "", false
	}
	sk := tmpl.skeletons.get(key)
	if sk == nil {
		tmpl.skeletons.built.Add(1)
		if sk = t.renderSkeleton(tmpl, in, conv, tools, agp); sk == nil {
			sk = &skeleton{unusable: true}
		}
		tmpl.skeletons.put(key, sk)
	}
	if sk.unusable {
		return "", false
	}
	var b strings.Builder
	b.Grow(total + sk.size)
	for i, slot := range sk.slots {
		b.WriteString(sk.pieces[i])
		b.WriteString(conv.arr[slot].get("content").s)
	}
	b.WriteString(sk.pieces[len(sk.slots)])
	return b.String(), true
}

// renderSkeleton renders conv with each content replaced by standInText(i) and splits the text at
// the stand-ins; nil when the render fails or a stand-in does not occur exactly once.
func (t *Tokenizer) renderSkeleton(tmpl *chatTemplate, in *chatInput, conv, tools *jval, agp bool) *skeleton {
	stand := &jval{kind: jArray, arr: make([]*jval, len(conv.arr))}
	for i, m := range conv.arr {
		sm := &jval{kind: jObject, keys: m.keys, vals: make([]*jval, len(m.vals))}
		copy(sm.vals, m.vals)
		for k, key := range m.keys {
			if key == "content" {
				sm.vals[k] = jstr(standInText(i))
			}
		}
		stand.arr[i] = sm
	}
	out, err := t.renderTemplate(tmpl, in, stand, tools, agp)
	if err != nil || strings.Count(out, standInMark) != len(conv.arr) {
		return nil
	}
	sk := &skeleton{}
	seen := make([]bool, len(conv.arr))
	rest := out
	for {
		at := strings.Index(rest, standInMark)
		if at < 0 {
			break
		}
		after := rest[at+len(standInMark):]
		end := strings.IndexByte(after, '\xEF') // U+FDD1 is EF B7 91
		if end <= 0 || !strings.HasPrefix(after[end:], "\uFDD1") {
			return nil
		}
		i, err := strconv.Atoi(after[:end])
		if err != nil || i < 0 || i >= len(seen) || seen[i] || after[:end] != strconv.Itoa(i) {
			return nil
		}
		seen[i] = true
		sk.pieces = append(sk.pieces, rest[:at])
		sk.slots = append(sk.slots, i)
		sk.size += at
		rest = after[end+len("\uFDD1"):]
	}
	sk.pieces = append(sk.pieces, rest)
	sk.size += len(rest)
	return sk
}
