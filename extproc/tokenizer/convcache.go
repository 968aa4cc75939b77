package tokenizer

import (
	"bytes"
	"container/list"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash/maphash"
	"strings"
	"sync"
	"sync/atomic"
	"unicode/utf8"

	"github.com/kvepp/kvepp/internal/jsonscan"
)

// Incremental tokenization of conversations (the conversation cache).
//
// Turn N+1 of a chat repeats turn N's messages and adds an assistant reply and a new user
// message. The cache keeps, for a conversation prefix ending at a user message, the token ids of
// the prompt text the chat template renders for it, keyed by the exact bytes of those messages
// (and of everything else the rendering depends on: the tokenizer, the template, tools,
// chat_template_kwargs). A request that extends a cached prefix renders only its tail — the
// boundary message and what follows, as a conversation of its own — and encodes only the text
// after the prefix.
//
// That is exact only where two things hold, and the cache is used only there:
//
//  1. The template renders a prefix ending at a boundary message the same whatever follows, and
//     renders what follows from the boundary message on alone (incrementalPlan: proven per
//     template, by the template's source digest; any other template falls back to a full render).
//     Concretely, for a conversation m[0..n] and a boundary k: let Q be the common prefix of the
//     renders of [m[k]] alone with and without the generation prompt. Then the full render equals
//     P_k + S, where S is the render of m[k..n] minus its first len(Q) bytes and P_k depends on
//     m[0..k], tools and kwargs only. P_k is what a cache entry stands for. Further, what the
//     render of [m] puts after Q (the ending, with or without the generation prompt) does not
//     depend on the boundary message m, so it is measured once per context with a stand-in
//     message, and S for a boundary that is the last message is the ending alone.
//  2. The token ids of the text split at a boundary are the ids of the two parts: the boundary is
//     a raw segment boundary of the added-token split (tokenizer.md step 2) — normalizer,
//     pre-tokenizer and BPE never look across it — that no added token can straddle, in a
//     tokenizer whose raw added tokens have no lstrip, rstrip or single_word (which would make a
//     match depend on bytes further away). An entry keeps the ids up to the last such boundary at
//     or before the end of P_k, the rest of P_k as text (pending), and the bytes before the
//     boundary (window) to check at each hit that the new text cannot join a token across it.
//
// Every check failing at a hit (the tail's render not starting with Q, a straddling token, a
// boundary that needs an added token where the new text has none) falls back to a from-scratch
// tokenization, so a cache hit returns exactly the from-scratch ids or is not taken. Requests
// with images, continue_final_message, or a template or tokenizer without a proof are tokenized
// from scratch.

// incrementalPlan is the proof obligation of condition 1 discharged for one chat template: which
// messages may end a cached prefix.
type incrementalPlan struct {
	name string
	// boundary reports whether a (preprocessed) message may end a cached prefix.
	boundary func(m *jval) bool
}

// userBoundary: any user message.
func userBoundary(m *jval) bool {
	r := m.get("role")
	return r != nil && r.kind == jString && r.s == "user"
}

// provenTemplates maps the digest of a template source (templateDigest) to its plan. The proofs,
// per template (R(ms, g) is the render of messages ms with add_generation_prompt g; T(m) what the
// loop prints for message m; E(g) what follows the loop):
//
// For every template below the loop prints a boundary (user) message from its own fields, without
// looking at loop.last, and the text after the loop depends on add_generation_prompt and
// chat_template_kwargs only; so the ending is the same for every boundary message.
//
// Qwen3 (Qwen/Qwen3-*): the head prints the tools block and messages[0] when it is a system
// message; ns.last_query_index is found by a reverse scan that stops at the last user message
// that is not a <tool_response> wrapper. With m[k] such a user message (the boundary), every
// message after k is rendered from fields of m[k..n] only: assistants compare loop.index0 with
// last_query_index, which lies at or after k in both the full and the tail render (the scan never
// passes m[k]), and use loop.last; tool messages look at their neighbours, m[k] being a user
// message in both. Messages before k render the same in every conversation extending m[0..k]
// (their index is below last_query_index, not last, and their neighbours are fixed). E(true) is
// "<|im_start|>assistant\n" (plus the empty think block for enable_thinking false), E(false) is
// empty, so Q = head(tail) + T(m[k]) exactly.
//
// Phi-3, Gemma 2, Mistral v0.1: the loop prints each message from its own fields (Gemma 2 and
// Mistral raise unless roles alternate user/assistant from index 0, Gemma 2 when messages[0] is a
// system message, Mistral for other roles); the head is bos_token (Gemma 2, Mistral) or empty.
// With m[k] a user message, alternation over m[k..n] in the tail render is alternation over
// m[k..n] in the full one (k is even because m[0..k] alternated when the entry was made), so the
// tail raises exactly when the full render raises beyond the cached prefix. Q is T(m[k]) (Mistral
// has no generation prompt; Gemma 2's E(false) is empty) or, for Phi-3 (E(true) =
// "<|assistant|>\n", E(false) = eos_token "<|endoftext|>"), T(m[k]) + "<|": every message and
// both endings after a user message start with "<|", so the tail after Q is still the text after
// P_k.
//
// Llama 2: a leading system message is folded into the first loop message (loop.index0 == 0),
// which is never after a boundary; every other message is T(m) from its own content, alternation
// as above, no generation prompt.
//
// Gemma 3: a leading system message becomes the first loop message's prefix (loop.first), never
// after a boundary; the rest is as Gemma 2 (alternation counted over the messages after the
// system message, so k−1 or k is even).
//
// Not proven (fall back): DeepSeek V3 (system messages anywhere are printed in the head, and
// tool-call state carries across messages), templates calling strftime_now (the prefix holds the
// date), and any template not listed.
var provenTemplates = map[string]*incrementalPlan{
	"87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5": {name: "qwen3", boundary: qwen3Boundary},
	"dcaee66df77bfbb789ec541fe713218da30225a526f1db97138fc39ee6dc56aa": {name: "phi3", boundary: userBoundary},
	"ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6": {name: "gemma2", boundary: userBoundary},
	"8d9e3a3c114fb2053ec500184677af4f7e5f8ec2582443cd535834e68b3ade29": {name: "gemma3", boundary: userBoundary},
	"26a59556925c987317ce5291811ba3b7f32ec4c647c400c6cc7e3a9993007ba7": {name: "mistral-v0.1", boundary: userBoundary},
	"e8d5b5a546d3f19df16a5320c614fab05bdc4edd50e850f1afd947b503ea41cf": {name: "llama2", boundary: userBoundary},
}

// qwen3Boundary: a user message that is not a tool response wrapped by the client (the template's
// last-query scan skips those).
func qwen3Boundary(m *jval) bool {
	if !userBoundary(m) {
		return false
	}
	c := m.get("content")
	if c == nil || c.kind != jString {
		return false
	}
	return !(strings.HasPrefix(c.s, "<tool_response>") && strings.HasSuffix(c.s, "</tool_response>"))
}

// templateDigest is the hex SHA-256 of a template source with its line endings normalised and one
// trailing newline dropped, as prepareTemplate reads it.
func templateDigest(src string) string {
	src = strings.ReplaceAll(src, "\r\n", "\n")
	src = strings.ReplaceAll(src, "\r", "\n")
	sum := sha256.Sum256([]byte(strings.TrimSuffix(src, "\n")))
	return hex.EncodeToString(sum[:])
}

// cacheIDs numbers tokenizers and templates for cache keys.
var cacheIDs atomic.Uint64

// ConversationCache is a bounded, concurrency-safe cache of tokenized conversation prefixes shared
// by any number of tokenizers (see the comment at the top of this file). Its memory (keys, ids
// and texts held) stays within the bound given to NewConversationCache; the least recently used
// entries are evicted first.
type ConversationCache struct {
	maxBytes int64
	seed     maphash.Seed

	mu      sync.Mutex
	entries map[uint64]*convEntry
	lru     list.List // of *convEntry, most recently used first
	bytes   int64

	hits, misses, bypassed, evictions, reused atomic.Uint64

	endMu   sync.Mutex
	endings map[uint64]memoEnding // by signature hash, at most maxEndings
}

// convEntry is one cached prefix P_k.
type convEntry struct {
	hash uint64
	// The key is the signature (keyHashes) followed by the raw messages array up to the end of the
	// boundary message, keyLen bytes: the key of keyParent (an entry for a shorter prefix of the
	// same conversation, nil for none) followed by keyDelta. Entries of one conversation share
	// their key bytes that way; each entry counts its whole key in its size, so the cache's
	// accounting never falls below the memory its entries keep reachable.
	keyParent *convEntry
	keyDelta  []byte
	keyLen    int
	// ids are the token ids of the prompt text up to the token boundary (no post-processor ids).
	ids []uint32
	// pending is the text of P_k after the token boundary; window the up to maxLen−1 bytes before
	// it; afterToken whether an added token ends right at the boundary (else the text after the
	// boundary must start with one).
	pending, window string
	afterToken      bool
	size            int64
	elem            *list.Element // in the cache's lru
	// hashes are block hashes of ids kept for the picker (PrefixMemo), guarded by the cache's mu.
	hashes []entryHashes
}

// entryHashes are the block hashes of an entry's ids for one hashing key.
type entryHashes struct {
	blockSize  uint32
	seed       uint64
	local, seq []uint64
}

// maxHashKeys bounds the hashing keys (block size, LoRA, cache namespace) an entry keeps hashes
// for.
const maxHashKeys = 4

// convEntryOverhead approximates an entry's memory besides its key, ids and texts, bytes.
const convEntryOverhead = 160

// NewConversationCache returns a cache holding at most maxBytes bytes of entries (> 0).
func NewConversationCache(maxBytes int64) *ConversationCache {
	return &ConversationCache{maxBytes: maxBytes, seed: maphash.MakeSeed(), entries: map[uint64]*convEntry{}, endings: map[uint64]memoEnding{}}
}

// ConversationCacheStats is a snapshot of a ConversationCache's state and counters.
type ConversationCacheStats struct {
	// Entries and Bytes are what the cache holds now; MaxBytes its bound (bytes).
	Entries         int
	Bytes, MaxBytes int64
	// Hits are chat tokenizations that reused a cached prefix; Misses those that could have but
	// found none (they are tokenized from scratch and fill the cache); Bypassed those the cache
	// cannot serve (template or tokenizer without a proof, images, continue_final_message).
	Hits, Misses, Bypassed uint64
	// Evictions counts entries dropped to stay within MaxBytes; ReusedTokens the prompt tokens taken
	// from the cache instead of being encoded.
	Evictions, ReusedTokens uint64
}

// Stats returns the cache's current state and counters.
func (c *ConversationCache) Stats() ConversationCacheStats {
	c.mu.Lock()
	n, b := len(c.entries), c.bytes
	c.mu.Unlock()
	return ConversationCacheStats{Entries: n, Bytes: b, MaxBytes: c.maxBytes,
		Hits: c.hits.Load(), Misses: c.misses.Load(), Bypassed: c.bypassed.Load(),
		Evictions: c.evictions.Load(), ReusedTokens: c.reused.Load()}
}

// get returns the entry whose key is sig followed by prefix, moving it to the front.
func (c *ConversationCache) get(h uint64, sig, prefix []byte) *convEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[h]
	if e == nil || e.keyLen != len(sig)+len(prefix) || !e.keyEquals(sig, prefix) {
		return nil
	}
	c.lru.MoveToFront(e.elem)
	return e
}

// put inserts e (replacing any entry with the same hash) and evicts the least recently used
// entries beyond the bound. An entry larger than half the bound is not kept.
func (c *ConversationCache) put(e *convEntry) {
	e.size = int64(e.keyLen+4*len(e.ids)+len(e.pending)+len(e.window)) + convEntryOverhead
	if e.size > c.maxBytes/2 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if old := c.entries[e.hash]; old != nil {
		if old.keyLen == e.keyLen && old.sameKey(e) {
			return // filled concurrently by another request of the same conversation
		}
		c.remove(old)
	}
	c.entries[e.hash] = e
	e.elem = c.lru.PushFront(e)
	c.bytes += e.size
	c.evict()
}

// evict drops least recently used entries until the cache is within its bound (c.mu held).
func (c *ConversationCache) evict() {
	for c.bytes > c.maxBytes && c.lru.Len() > 0 {
		c.remove(c.lru.Back().Value.(*convEntry))
		c.evictions.Add(1)
	}
}

// keyEquals reports whether e's key is sig followed by prefix (e.keyLen == len(sig)+len(prefix)).
func (e *convEntry) keyEquals(sig, prefix []byte) bool {
	for ; e != nil; e = e.keyParent {
		start := e.keyLen - len(e.keyDelta)
		if !keyRangeEquals(e.keyDelta, start, sig, prefix) {
			return false
		}
	}
	return true
}

// keyRangeEquals reports whether b equals bytes [start, start+len(b)) of sig followed by prefix.
func keyRangeEquals(b []byte, start int, sig, prefix []byte) bool {
	if start < len(sig) {
		n := min(len(sig)-start, len(b))
		if !bytes.Equal(b[:n], sig[start:start+n]) {
			return false
		}
		b, start = b[n:], len(sig)
	}
	return bytes.Equal(b, prefix[start-len(sig):start-len(sig)+len(b)])
}

// sameKey reports whether e and o (of equal keyLen) have the same key.
func (e *convEntry) sameKey(o *convEntry) bool {
	return bytes.Equal(e.flatKey(), o.flatKey())
}

// flatKey returns e's key as one slice (for the rare hash collision on insert).
func (e *convEntry) flatKey() []byte {
	out := make([]byte, e.keyLen)
	for x := e; x != nil; x = x.keyParent {
		copy(out[x.keyLen-len(x.keyDelta):], x.keyDelta)
	}
	return out
}

func (c *ConversationCache) remove(e *convEntry) {
	c.lru.Remove(e.elem)
	delete(c.entries, e.hash)
	c.bytes -= e.size
}

// convRequest is one chat request on the cached path.
type convRequest struct {
	t          *Tokenizer
	c          *ConversationCache
	tmpl       *chatTemplate
	in         *chatInput
	addSpecial bool
	// starts and ends are the offsets of each message element in in.messagesRaw; hashes the key
	// hash of the prefix ending with each message.
	starts, ends []int
	hashes       []uint64
	sig          []byte
	end          *ending // the context's ending, once known
	// longest and shorter are the entries for the longest and a shorter cached prefix of the
	// request's prompt (the one made for it, the one it extended), for its PrefixMemo.
	longest, shorter *convEntry
}

// cachedChat tokenizes a text-only chat request through the conversation cache: the ids of a
// cached prefix plus the encoded rest, or a from-scratch tokenization that fills the cache.
// handled false means the request is not for the cache (the caller tokenizes it as usual):
// no proof for its template or tokenizer, continue_final_message, or images in its prompt.
// Errors are the ones the from-scratch path returns.
func (t *Tokenizer) cachedChat(in *chatInput, addSpecial bool, c *ConversationCache) ([]uint32, *PrefixMemo, bool, error) {
	if t.chat == nil || t.model == nil || !t.prefixSafe || in.continueFinal || in.messagesRaw == nil {
		c.bypassed.Add(1)
		return nil, nil, false, nil
	}
	tmpl, err := t.chat.pick(in.tools != nil)
	if err != nil || tmpl.plan == nil {
		c.bypassed.Add(1)
		return nil, nil, false, nil
	}
	r := &convRequest{t: t, c: c, tmpl: tmpl, in: in, addSpecial: addSpecial}
	if in.messageElems != nil {
		r.starts, r.ends = make([]int, len(in.messageElems)), make([]int, len(in.messageElems))
		for i, sp := range in.messageElems {
			r.starts[i], r.ends[i] = sp[0], sp[1]
		}
	} else {
		jsonscan.Elements(in.messagesRaw, func(_ []byte, s, e int) bool {
			r.starts, r.ends = append(r.starts, s), append(r.ends, e)
			return true
		})
	}
	if len(r.ends) == 0 {
		c.bypassed.Add(1)
		return nil, nil, false, nil
	}
	r.keyHashes()
	for k := len(r.ends) - 1; k >= 0; k-- {
		e := c.get(r.hashes[k], r.sig, in.messagesRaw[:r.ends[k]])
		if e == nil {
			continue
		}
		ids, ok, err := r.extend(e, k)
		if err != nil {
			return nil, nil, true, err
		}
		if ok {
			c.hits.Add(1)
			c.reused.Add(uint64(len(e.ids)))
			return ids, r.memo(), true, nil
		}
		r.longest, r.shorter = nil, nil
		break // a check failed: tokenize from scratch
	}
	c.misses.Add(1)
	ids, handled, err := r.fromScratch()
	if !handled || err != nil {
		return nil, nil, handled, err
	}
	return ids, r.memo(), true, nil
}

// memo is the request's view of the entries whose ids its prompt starts with (nil: none, or a
// post-processor prefix before them).
func (r *convRequest) memo() *PrefixMemo {
	if r.longest == nil || (r.addSpecial && len(r.t.post.prefix) > 0) {
		return nil
	}
	return &PrefixMemo{c: r.c, e: r.longest, parent: r.shorter}
}

// keyHashes builds the key signature — tokenizer, template, tools and chat_template_kwargs — and
// the hash of the signature followed by the messages array up to the end of each message.
func (r *convRequest) keyHashes() {
	sig := make([]byte, 0, 32+len(r.in.toolsRaw)+len(r.in.kwargsRaw))
	sig = binary.LittleEndian.AppendUint64(sig, r.t.cacheID)
	sig = binary.LittleEndian.AppendUint64(sig, r.tmpl.cacheID)
	sig = binary.LittleEndian.AppendUint32(sig, uint32(len(r.in.toolsRaw)))
	sig = append(sig, r.in.toolsRaw...)
	sig = binary.LittleEndian.AppendUint32(sig, uint32(len(r.in.kwargsRaw)))
	r.sig = append(sig, r.in.kwargsRaw...)
	var h maphash.Hash
	h.SetSeed(r.c.seed)
	_, _ = h.Write(r.sig)
	r.hashes = make([]uint64, len(r.ends))
	prev := 0
	for i, end := range r.ends {
		_, _ = h.Write(r.in.messagesRaw[prev:end])
		r.hashes[i] = h.Sum64()
		prev = end
	}
}

// messages decodes and preprocesses the messages from index k on.
func (r *convRequest) messages(k int) (*jval, error) {
	msgs := make([]*jval, 0, len(r.ends)-k)
	for i := k; i < len(r.ends); i++ {
		v, err := decodeValid(r.in.messagesRaw[r.starts[i]:r.ends[i]])
		if err != nil {
			return nil, &RequestError{Msg: "messages is not valid JSON", Err: err}
		}
		msgs = append(msgs, v)
	}
	return conversation(msgs, k, r.tmpl.openAIContent, r.in.images)
}

// render renders a (tail of the) preprocessed conversation.
func (r *convRequest) render(conv []*jval, agp bool) (string, error) {
	return r.t.renderConversation(r.tmpl, r.in, &jval{kind: jArray, arr: conv}, agp)
}

// ending is what a conversation's render puts after its final boundary message's Q, with and
// without the generation prompt. The proven templates print it from add_generation_prompt and the
// context alone (the proofs above), so it is found once per context by rendering a stand-in
// boundary message, and it lets Q of any boundary message be found from one render of it:
// R([m], false) = Q(m) + ending.without.
type ending struct {
	with, without string
}

// standIn is the boundary message the ending is measured with.
var standIn = func() *jval {
	m := newObject()
	m.set("role", jstr("user"))
	m.set("content", jstr("x"))
	return m
}()

// maxEndings bounds ConversationCache.endings; the map is emptied when it is full.
const maxEndings = 256

// ending returns the ending of the request's context (memoized in the cache by signature).
func (r *convRequest) ending() (ending, bool) {
	if r.end != nil {
		return *r.end, true
	}
	h := maphash.Bytes(r.c.seed, r.sig)
	r.c.endMu.Lock()
	me, ok := r.c.endings[h]
	r.c.endMu.Unlock()
	if ok && bytes.Equal(me.sig, r.sig) {
		r.end = &me.ending
		return me.ending, true
	}
	with, err1 := r.render([]*jval{standIn}, true)
	without, err2 := r.render([]*jval{standIn}, false)
	if err1 != nil || err2 != nil {
		return ending{}, false
	}
	n := 0
	for n < len(with) && n < len(without) && with[n] == without[n] {
		n++
	}
	me = memoEnding{sig: bytes.Clone(r.sig), ending: ending{with: with[n:], without: without[n:]}}
	r.c.endMu.Lock()
	if len(r.c.endings) >= maxEndings {
		clear(r.c.endings)
	}
	r.c.endings[h] = me
	r.c.endMu.Unlock()
	r.end = &me.ending
	return me.ending, true
}

// memoEnding is a memoized ending and the signature it belongs to.
type memoEnding struct {
	sig []byte
	ending
}

// q returns Q of boundary message m: its render alone without the generation prompt, less the
// ending.
func (r *convRequest) q(m *jval) (string, bool) {
	end, ok := r.ending()
	if !ok {
		return "", false
	}
	alone, err := r.render([]*jval{m}, false)
	if err != nil || !strings.HasSuffix(alone, end.without) {
		return "", false
	}
	return alone[:len(alone)-len(end.without)], true
}

// suffixAfter returns S for boundary index j of conv (a tail of the request starting at request
// index base): the text the request's render has after P_j — the ending when j is the last
// message, else the render of conv[j-base:] less Q of message j.
func (r *convRequest) suffixAfter(conv []*jval, j, base int) (string, bool) {
	if j-base == len(conv)-1 {
		end, ok := r.ending()
		if r.in.addGenerationPrompt {
			return end.with, ok
		}
		return end.without, ok
	}
	q, ok := r.q(conv[j-base])
	if !ok {
		return "", false
	}
	tail, err := r.render(conv[j-base:], r.in.addGenerationPrompt)
	if err != nil || !strings.HasPrefix(tail, q) {
		return "", false
	}
	return tail[len(q):], true
}

// extend tokenizes the request from entry e, which holds the prefix ending with message k: the
// tail m[k..n] is rendered alone and the text after the prefix encoded. ok false means a check
// failed and the request must be tokenized from scratch; errors are the tail's (which the full
// render would raise too: the cached prefix rendered without error).
func (r *convRequest) extend(e *convEntry, k int) ([]uint32, bool, error) {
	conv, err := r.messages(k)
	if err != nil {
		return nil, false, err
	}
	if !r.tmpl.plan.boundary(conv.arr[0]) {
		return nil, false, nil
	}
	s, ok := r.suffixAfter(conv.arr, k, k)
	if !ok || strings.Contains(s, imageSentinel) {
		return nil, false, nil // the full render decides (and reports any error)
	}
	text := e.pending + s
	if !utf8.ValidString(text) || r.t.addedRaw.straddles(e.window, text) {
		return nil, false, nil
	}
	if !e.afterToken {
		if st, _, tok := r.t.addedRaw.next(text, 0); tok == nil || st != 0 {
			return nil, false, nil
		}
	}
	ids := make([]uint32, 0, len(r.t.post.prefix)+len(e.ids)+len(text)/3+len(r.t.post.suffix)+8)
	if r.addSpecial {
		ids = append(ids, r.t.post.prefix...)
	}
	pre := len(ids)
	ids = append(ids, e.ids...)
	var marks []segMark
	before := InexactPieces()
	ids = r.t.appendEncodedAt(text, false, e.afterToken, ids, &marks)
	if r.addSpecial {
		ids = append(ids, r.t.post.suffix...)
	}
	r.longest = e
	if j := r.lastBoundary(conv.arr, k); j > k && cacheable(ids, before) && !r.t.stop.halted() {
		// As from scratch, the boundary before the last one too: the next request may repeat
		// this one's history with another last message.
		parent := e
		if j2 := r.lastBoundary(conv.arr[:j-k], k); j2 > k {
			if p := r.fill(j2, conv.arr, k, text, marks, ids, pre, e, e.window); p != nil {
				parent = p
			}
		}
		if n := r.fill(j, conv.arr, k, text, marks, ids, pre, parent, e.window); n != nil {
			r.longest, r.shorter = n, e
		}
	}
	return ids, true, nil
}

// fromScratch renders and encodes the whole request and fills the cache at its last boundary and
// the one before (so a conversation seen first at turn N serves turn N+1, and a history shared by
// several requests serves each of them). handled is false for a prompt with images.
func (r *convRequest) fromScratch() ([]uint32, bool, error) {
	conv, err := r.messages(0)
	if err != nil {
		return nil, true, err
	}
	text, err := r.render(conv.arr, r.in.addGenerationPrompt)
	if err != nil {
		return nil, true, err
	}
	if strings.Contains(text, imageSentinel) {
		return nil, false, nil
	}
	valid := utf8.ValidString(text)
	if !valid {
		text = sanitizeUTF8(text)
	}
	ids := make([]uint32, 0, len(r.t.post.prefix)+len(text)/3+len(r.t.post.suffix)+8)
	if r.addSpecial {
		ids = append(ids, r.t.post.prefix...)
	}
	pre := len(ids)
	var marks []segMark
	before := InexactPieces()
	ids = r.t.appendEncodedAt(text, true, false, ids, &marks)
	if r.addSpecial {
		ids = append(ids, r.t.post.suffix...)
	}
	if valid && cacheable(ids, before) && !r.t.stop.halted() {
		if j := r.lastBoundary(conv.arr, 0); j >= 0 {
			var parent *convEntry
			if j2 := r.lastBoundary(conv.arr[:j], 0); j2 >= 0 {
				parent = r.fill(j2, conv.arr, 0, text, marks, ids, pre, nil, "")
			}
			r.longest, r.shorter = r.fill(j, conv.arr, 0, text, marks, ids, pre, parent, ""), parent
			if r.longest == nil {
				r.longest, r.shorter = parent, nil
			}
		}
	}
	return ids, true, nil
}

// lastBoundary returns the request index of the last boundary message of conv (a tail starting at
// request index base), or -1.
func (r *convRequest) lastBoundary(conv []*jval, base int) int {
	for i := len(conv) - 1; i >= 0; i-- {
		if r.tmpl.plan.boundary(conv[i]) {
			return base + i
		}
	}
	return -1
}

// fill caches the prefix ending with message j and returns the new entry (nil when none was
// made). text is the prompt text from the start of the prompt, or from the token boundary of the
// entry the request extended; conv the request's messages from index base; marks text's segment
// boundaries with ids counted in reqIDs (the request's ids, whose prompt ids start at pre); from
// an entry for a shorter prefix of this conversation (the one extended, or one made for the same
// request), whose key becomes this entry's key parent; window the bytes before text. The entry's
// ids are a sub-slice of reqIDs: the request's ids and the cache share them, read-only.
func (r *convRequest) fill(j int, conv []*jval, base int, text string, marks []segMark, reqIDs []uint32, pre int, from *convEntry, window string) *convEntry {
	s, ok := r.suffixAfter(conv, j, base)
	if !ok || !strings.HasSuffix(text, s) {
		return nil
	}
	end := len(text) - len(s) // where P_j ends in text
	// The last segment boundary at or before the end of P_j. The end of the text counts only
	// after an added token: before one it is a boundary only if the next text starts with an added
	// token, which nothing in this request shows.
	m := -1
	for i := len(marks) - 1; i >= 0; i-- {
		if mk := marks[i]; mk.off <= end && (mk.off < len(text) || mk.afterToken) {
			m = i
			break
		}
	}
	if m < 0 || marks[m].ids <= pre {
		return nil // no token boundary after the start of the prompt
	}
	mk := marks[m]
	left := window + text[:mk.off]
	keep := max(r.t.addedRaw.maxLen()-1, 0)
	e := &convEntry{
		hash:       r.hashes[j],
		ids:        reqIDs[pre:mk.ids:mk.ids],
		pending:    strings.Clone(text[mk.off:end]),
		window:     strings.Clone(left[max(len(left)-keep, 0):]),
		afterToken: mk.afterToken,
		keyLen:     len(r.sig) + r.ends[j],
	}
	start := 0
	if from != nil && from.keyLen <= e.keyLen {
		e.keyParent, start = from, from.keyLen
	}
	e.keyDelta = make([]byte, e.keyLen-start)
	n := 0
	if start < len(r.sig) {
		n = copy(e.keyDelta, r.sig[start:])
		start = len(r.sig)
	}
	copy(e.keyDelta[n:], r.in.messagesRaw[start-len(r.sig):r.ends[j]])
	r.c.put(e)
	return e
}

// PrefixMemo is a request's access to the block hashes of the cached prefix its prompt starts
// with (picker.BlockHashMemo, adapted by the caller): what one request of a conversation hashed,
// the next reuses. Tokens() is that prefix's length; hashes are kept per block size and seed, at
// most maxHashKeys each, counted in the cache's memory.
type PrefixMemo struct {
	c         *ConversationCache
	e, parent *convEntry // the longest cached prefix of the prompt, and a shorter one (or nil)
}

// Tokens returns the length of the prompt's cached prefix, tokens.
func (m *PrefixMemo) Tokens() int { return len(m.e.ids) }

// LoadBlockHashes returns the local and sequence hashes known for the prefix's first blocks at
// blockSize and seed (the longest prefix's, else the shorter one's), or nil.
func (m *PrefixMemo) LoadBlockHashes(blockSize uint32, seed uint64) (local, seq []uint64) {
	m.c.mu.Lock()
	defer m.c.mu.Unlock()
	for _, e := range []*convEntry{m.e, m.parent} {
		if e == nil {
			continue
		}
		for _, h := range e.hashes {
			if h.blockSize == blockSize && h.seed == seed {
				return h.local, h.seq
			}
		}
	}
	return nil, nil
}

// StoreBlockHashes keeps the hashes of the prefix's first len(local) blocks (local and seq of equal
// length, not modified afterwards) for the longest prefix and, cut to its length, the shorter one.
func (m *PrefixMemo) StoreBlockHashes(blockSize uint32, seed uint64, local, seq []uint64) {
	if blockSize == 0 || len(local) != len(seq) {
		return
	}
	m.c.mu.Lock()
	defer m.c.mu.Unlock()
	for _, e := range []*convEntry{m.e, m.parent} {
		if e == nil || m.c.entries[e.hash] != e || len(e.hashes) >= maxHashKeys {
			continue // evicted, or enough kept
		}
		n := min(len(local), len(e.ids)/int(blockSize))
		known := false
		for _, h := range e.hashes {
			known = known || (h.blockSize == blockSize && h.seed == seed && len(h.local) >= n)
		}
		if known || n == 0 {
			continue
		}
		e.hashes = append(e.hashes, entryHashes{blockSize: blockSize, seed: seed, local: local[:n:n], seq: seq[:n:n]})
		e.size += int64(16 * n)
		m.c.bytes += int64(16 * n)
	}
	m.c.evict()
}
