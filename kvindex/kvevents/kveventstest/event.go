package kveventstest

import (
	"bytes"
	"encoding/binary"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// Event tags of kv-events-index.md §7.2.
const (
	TypeBlockStored      = "BlockStored"
	TypeBlockRemoved     = "BlockRemoved"
	TypeAllBlocksCleared = "AllBlocksCleared"
)

// HashEncoding selects how block hashes are put on the wire (kv-events-index.md §4).
type HashEncoding uint8

const (
	// HashUint64 sends hashes as unsigned integers (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
	HashUint64 HashEncoding = iota
	// HashInt64 sends hashes as signed 64-bit integers with the same bits (SGLang).
	HashInt64
	// HashBytes sends hashes as 32-byte msgpack bin digests whose last 8 bytes are the hash
	// big-endian (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
	HashBytes
)

// Event is one KV event in vLLM wire form (kv-events-index.md §7.2). Build it with Stored,
// Removed, Cleared or Raw and refine it with the With… methods, which return modified copies.
// Pointer fields are sent as msgpack nil when nil.
type Event struct {
	// Type is the tag: TypeBlockStored, TypeBlockRemoved, TypeAllBlocksCleared or any other
	// string (an unknown tag, to test skipping).
	Type string
	// BlockHashes are the engine block hashes, encoded per Hashes.
	BlockHashes []uint64
	// Parent is parent_block_hash (BlockStored); nil = the root.
	Parent *uint64
	// TokenIDs are the stored blocks' tokens (BlockStored).
	TokenIDs []uint32
	// Bigram sends TokenIDs as Eagle bigram pairs [(t0,t1),(t1,t2),…] (§1.4), which decode back
	// to TokenIDs; TokenIDs needs at least 2 entries.
	Bigram bool
	// BlockSize is block_size in tokens (BlockStored).
	BlockSize int
	// LoraID is lora_id.
	LoraID *int64
	// Medium is the storage medium ("GPU", "CPU", …); nil means the device tier.
	Medium *string
	// LoraName is sent in the lora_name slot: nil, a string, or any msgpack-encodable value such
	// as SGLang's metadata map.
	LoraName any
	// ExtraKeys are extra_keys per block (nil = msgpack nil).
	ExtraKeys [][]any
	// GroupIdx, KVCacheSpecKind and SlidingWindow describe the KV-cache group (§8.3).
	GroupIdx        *int
	KVCacheSpecKind *string
	SlidingWindow   *int64
	// Locality is the locality string (§8.2).
	Locality *string
	// CacheSalt is the map-form top-level cache_salt key; it is sent only in map form.
	CacheSalt string
	// MapForm sends the event as a map with a "type" key instead of an array.
	MapForm bool
	// Hashes selects the wire encoding of BlockHashes and Parent.
	Hashes HashEncoding
	// Elements, when positive, cuts or pads (with nil) the array form to exactly this many
	// elements, tag included; 0 sends the vLLM layout (BlockStored at least 8 elements,
	// BlockRemoved at least 3, AllBlocksCleared 1) extended to the last field that is set.
	Elements int
	// raw, when set, is encoded instead of the fields above.
	raw any
}

// Parent returns a pointer to h, for Stored's parent argument.
func Parent(h uint64) *uint64 { return &h }

// Stored builds a BlockStored event in array form: blocks with engine hashes hashes (one per
// block), chained after parent (nil = the root), carrying tokens (len(hashes)×blockSize tokens for
// a valid event) and block_size blockSize, medium nil (device tier).
func Stored(parent *uint64, hashes []uint64, tokens []uint32, blockSize int) Event {
	return Event{Type: TypeBlockStored, Parent: parent, BlockHashes: hashes, TokenIDs: tokens, BlockSize: blockSize}
}

// Removed builds a BlockRemoved event in array form for the given engine hashes, medium nil.
func Removed(hashes ...uint64) Event {
	return Event{Type: TypeBlockRemoved, BlockHashes: hashes}
}

// Cleared builds an AllBlocksCleared event.
func Cleared() Event {
	return Event{Type: TypeAllBlocksCleared}
}

// Raw builds an event that is encoded as the msgpack encoding of v, for malformed-input tests.
func Raw(v any) Event {
	return Event{raw: v}
}

// WithMedium returns e with the medium set (e.g. "GPU", "CPU", "DISK").
func (e Event) WithMedium(m string) Event { e.Medium = &m; return e }

// WithLoraName returns e with lora_name set to name.
func (e Event) WithLoraName(name string) Event { e.LoraName = name; return e }

// WithLoraID returns e with lora_id set.
func (e Event) WithLoraID(id int64) Event { e.LoraID = &id; return e }

// WithExtraKeys returns e with extra_keys set, one list per block (nil for a block without keys).
func (e Event) WithExtraKeys(perBlock ...[]any) Event { e.ExtraKeys = perBlock; return e }

// WithGroup returns e with group_idx and kv_cache_spec_kind set.
func (e Event) WithGroup(idx int, kind string) Event {
	e.GroupIdx, e.KVCacheSpecKind = &idx, &kind
	return e
}

// WithSlidingWindow returns e with kv_cache_spec_sliding_window set (tokens).
func (e Event) WithSlidingWindow(w int64) Event { e.SlidingWindow = &w; return e }

// WithLocality returns e with locality set.
func (e Event) WithLocality(l string) Event { e.Locality = &l; return e }

// WithCacheSalt returns e in map form with the top-level cache_salt key set.
func (e Event) WithCacheSalt(s string) Event { e.CacheSalt, e.MapForm = s, true; return e }

// AsMap returns e in map form.
func (e Event) AsMap() Event { e.MapForm = true; return e }

// AsBigrams returns e with its token ids sent as Eagle bigram pairs.
func (e Event) AsBigrams() Event { e.Bigram = true; return e }

// WithHashEncoding returns e with hashes sent in encoding h.
func (e Event) WithHashEncoding(h HashEncoding) Event { e.Hashes = h; return e }

// WithElements returns e whose array form has exactly n elements (see Event.Elements).
func (e Event) WithElements(n int) Event { e.Elements = n; return e }

// Batch is one event batch (kv-events-index.md §7.1).
type Batch struct {
	// TS is the timestamp in seconds (sent as float64).
	TS float64
	// DPRank is data_parallel_rank; nil is sent as msgpack nil.
	DPRank *uint32
	// TwoElements sends [ts, events] without the rank element (older vLLM, SGLang).
	TwoElements bool
	// MapForm sends the batch as a map {"ts", "events", "data_parallel_rank"}.
	MapForm bool
	// Events are the batch's events.
	Events []Event
}

// Encode returns the batch's MessagePack payload. It panics only if an event built with Raw
// holds a value msgpack cannot encode (a bug in the test).
func (b Batch) Encode() []byte {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true) // like Python's msgpack: the smallest integer width
	must := func(err error) {
		if err != nil {
			panic(fmt.Sprintf("kveventstest: encode batch: %v", err))
		}
	}
	var rank any
	if b.DPRank != nil {
		rank = *b.DPRank
	}
	switch {
	case b.MapForm:
		must(enc.EncodeMapLen(3))
		must(enc.EncodeString("ts"))
		must(enc.EncodeFloat64(b.TS))
		must(enc.EncodeString("events"))
		must(encodeEvents(enc, b.Events))
		must(enc.EncodeString("data_parallel_rank"))
		must(enc.Encode(rank))
	case b.TwoElements:
		must(enc.EncodeArrayLen(2))
		must(enc.EncodeFloat64(b.TS))
		must(encodeEvents(enc, b.Events))
	default:
		must(enc.EncodeArrayLen(3))
		must(enc.EncodeFloat64(b.TS))
		must(encodeEvents(enc, b.Events))
		must(enc.Encode(rank))
	}
	return buf.Bytes()
}

func encodeEvents(enc *msgpack.Encoder, evs []Event) error {
	if err := enc.EncodeArrayLen(len(evs)); err != nil {
		return err
	}
	for _, ev := range evs {
		if err := ev.encode(enc); err != nil {
			return err
		}
	}
	return nil
}

// field is one named wire field of an event.
type field struct {
	name  string
	value any
	set   bool // explicitly set (not a default)
}

func (e Event) hash(h uint64) any {
	switch e.Hashes {
	case HashInt64:
		return int64(h)
	case HashBytes:
		b := bytes.Repeat([]byte{0xab}, 32)
		binary.BigEndian.PutUint64(b[24:], h)
		return b
	}
	return h
}

func (e Event) fields() []field {
	hashes := make([]any, len(e.BlockHashes))
	for i, h := range e.BlockHashes {
		hashes[i] = e.hash(h)
	}
	opt := func(name string, set bool, v any) field {
		if !set {
			return field{name: name}
		}
		return field{name: name, value: v, set: true}
	}
	var medium, kind, locality any
	if e.Medium != nil {
		medium = *e.Medium
	}
	if e.KVCacheSpecKind != nil {
		kind = *e.KVCacheSpecKind
	}
	if e.Locality != nil {
		locality = *e.Locality
	}
	var group, window any
	if e.GroupIdx != nil {
		group = *e.GroupIdx
	}
	if e.SlidingWindow != nil {
		window = *e.SlidingWindow
	}
	switch e.Type {
	case TypeBlockStored:
		var parent, loraID any
		if e.Parent != nil {
			parent = e.hash(*e.Parent)
		}
		if e.LoraID != nil {
			loraID = *e.LoraID
		}
		var extra any
		if e.ExtraKeys != nil {
			extra = e.ExtraKeys
		}
		return []field{
			{name: "block_hashes", value: hashes, set: true},
			{name: "parent_block_hash", value: parent, set: true},
			{name: "token_ids", value: e.tokens(), set: true},
			{name: "block_size", value: e.BlockSize, set: true},
			{name: "lora_id", value: loraID, set: true},
			{name: "medium", value: medium, set: true},
			{name: "lora_name", value: e.LoraName, set: true},
			opt("extra_keys", e.ExtraKeys != nil, extra),
			opt("group_idx", e.GroupIdx != nil, group),
			opt("kv_cache_spec_kind", e.KVCacheSpecKind != nil, kind),
			opt("kv_cache_spec_sliding_window", e.SlidingWindow != nil, window),
			opt("locality", e.Locality != nil, locality),
		}
	case TypeBlockRemoved:
		return []field{
			{name: "block_hashes", value: hashes, set: true},
			{name: "medium", value: medium, set: true},
			opt("group_idx", e.GroupIdx != nil, group),
			opt("kv_cache_spec_kind", e.KVCacheSpecKind != nil, kind),
			opt("kv_cache_spec_sliding_window", e.SlidingWindow != nil, window),
			opt("locality", e.Locality != nil, locality),
		}
	}
	return nil
}

func (e Event) tokens() any {
	if !e.Bigram || len(e.TokenIDs) < 2 {
		return e.TokenIDs
	}
	pairs := make([][2]uint32, len(e.TokenIDs)-1)
	for i := range pairs {
		pairs[i] = [2]uint32{e.TokenIDs[i], e.TokenIDs[i+1]}
	}
	return pairs
}

func (e Event) encode(enc *msgpack.Encoder) error {
	if e.raw != nil {
		return enc.Encode(e.raw)
	}
	fs := e.fields()
	if e.MapForm {
		n := 1
		for _, f := range fs {
			if f.set {
				n++
			}
		}
		if e.CacheSalt != "" {
			n++
		}
		if err := enc.EncodeMapLen(n); err != nil {
			return err
		}
		if err := enc.EncodeString("type"); err != nil {
			return err
		}
		if err := enc.EncodeString(e.Type); err != nil {
			return err
		}
		for _, f := range fs {
			if !f.set {
				continue
			}
			if err := enc.EncodeString(f.name); err != nil {
				return err
			}
			if err := enc.Encode(f.value); err != nil {
				return err
			}
		}
		if e.CacheSalt != "" {
			if err := enc.EncodeString("cache_salt"); err != nil {
				return err
			}
			return enc.EncodeString(e.CacheSalt)
		}
		return nil
	}
	n := 1 + len(fs)
	if e.Elements > 0 {
		n = e.Elements
	} else {
		// The vLLM layout: every field up to the last one that is set.
		for n > 1 && !fs[n-2].set {
			n--
		}
	}
	if err := enc.EncodeArrayLen(n); err != nil {
		return err
	}
	if err := enc.EncodeString(e.Type); err != nil {
		return err
	}
	for i := 1; i < n; i++ {
		var v any
		if i-1 < len(fs) {
			v = fs[i-1].value
		}
		if err := enc.Encode(v); err != nil {
			return err
		}
	}
	return nil
}
