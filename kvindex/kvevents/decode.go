package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"sync"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Event type tags of kv-events-index.md §7.2 (the engine's class names).
const (
	TypeBlockStored      = "BlockStored"
	TypeBlockRemoved     = "BlockRemoved"
	TypeAllBlocksCleared = "AllBlocksCleared"
)

// Decoding errors. DecodeBatch returns an error wrapping ErrInvalidBatch; the others are set
// (wrapped, naming the offending field and value) in RawEvent.Err of an event that must be dropped
// while the rest of its batch is kept (kv-events-index.md §7.3). Test with errors.Is.
var (
	// ErrInvalidBatch: the payload is not a valid event batch (§7.3 rule 6); the whole batch is
	// dropped, but its sequence number still advances the listener's watermark.
	ErrInvalidBatch = errors.New("invalid kv event batch")
	// ErrUnknownEventType: the event's tag (array element 0 or map key "type") is not one of
	// BlockStored, BlockRemoved, AllBlocksCleared (§7.3 rule 5); the event is skipped.
	ErrUnknownEventType = errors.New("unknown kv event type")
	// ErrInvalidEvent: the event is neither an array nor a map, is shorter than its minimum length
	// (BlockStored 5, BlockRemoved 2), or a required field (block_hashes; for BlockStored also
	// token_ids and block_size) is missing or of the wrong type (§7.3 rule 4).
	ErrInvalidEvent = errors.New("invalid kv event")
	// ErrTokenIDOutOfRange: a token id is negative or above 2^32−1 (§7.3 rule 4).
	ErrTokenIDOutOfRange = errors.New("token id out of range")
)

// maxNesting bounds the nesting depth of MessagePack containers the decoder descends into, so a
// hostile payload cannot drive it into deep recursion. Real batches nest at most 5 levels.
const maxNesting = 32

// Batch is one decoded event batch (kv-events-index.md §7.1).
type Batch struct {
	// TS is the publisher's time.time() in seconds since the Unix epoch (0 when absent or not a
	// number).
	TS float64
	// Events are the batch's events in wire order, including events that must be dropped (their
	// Err is set) so callers can count them.
	Events []RawEvent
	// DPRank is the batch's data_parallel_rank; nil when absent, nil or out of the u32 range. A
	// non-nil value overrides the listener's registered rank (§7.1, §9 step 1).
	DPRank *uint32
}

// RawEvent is one engine event as decoded from the wire, before interpretation (§7.2). Absent
// optional fields hold their zero value (nil pointers for fields where nil differs from 0).
type RawEvent struct {
	// Type is the event tag: TypeBlockStored, TypeBlockRemoved, TypeAllBlocksCleared, or the
	// unknown tag of a skipped event ("" when the tag was not a string).
	Type string
	// BlockHashes are the engine's block hashes decoded to u64 per §4 (u64 as is, negative i64 as
	// its two's complement bits, bytes as their last 8 bytes big-endian).
	BlockHashes []uint64
	// HasParent and ParentHash give parent_block_hash (BlockStored); HasParent is false for nil.
	HasParent  bool
	ParentHash uint64
	// TokenIDs are the stored blocks' token ids (BlockStored). Bigram pairs [(a0,b0),…,(ak,bk)]
	// are normalized to [a0,…,ak,bk] (§1.4) and Bigram is set.
	TokenIDs []uint32
	Bigram   bool
	// BlockSize is the event's block_size in tokens (BlockStored).
	BlockSize int
	// LoraID is lora_id, nil when absent.
	LoraID *int64
	// Medium is the storage medium name as sent ("" when nil or absent: the device tier).
	Medium string
	// LoraName is lora_name when it is a string ("" when nil or absent).
	LoraName string
	// LoraMetaCacheSalt is the "cache_salt" string of an SGLang metadata map sent in the lora_name
	// slot (§8.4 rule 4); LoraName is then "".
	LoraMetaCacheSalt string
	// CacheSalt is the map-form event's top-level "cache_salt" string (§8.4 rule 1).
	CacheSalt string
	// ExtraKeys holds extra_keys per block: ExtraKeys[i] is nil or the keys of block i, each key
	// decoded loosely (string, []byte for msgpack bin, int64, uint64 above 2^63−1, float64, bool,
	// []any, map[string]any or nil).
	ExtraKeys [][]any
	// GroupIdx is the KV-cache group index (0 when absent); KVCacheSpecKind its attention kind
	// ("" when absent: full attention); SlidingWindow the window in tokens or nil (§8.3).
	GroupIdx        int
	KVCacheSpecKind string
	SlidingWindow   *int64
	// Locality is "" when nil or absent, otherwise the value sent (§8.2).
	Locality string
	// Err is non-nil when the event must be dropped: it wraps ErrUnknownEventType,
	// ErrInvalidEvent or ErrTokenIDOutOfRange.
	Err error
}

// Wire field names of §7.2 in array order (index 0 is the tag).
var (
	storedFields = [...]string{"", "block_hashes", "parent_block_hash", "token_ids", "block_size",
		"lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
		"kv_cache_spec_sliding_window", "locality", "source_kind"}
	removedFields = [...]string{"", "block_hashes", "medium", "group_idx", "kv_cache_spec_kind",
		"kv_cache_spec_sliding_window", "locality"}
)

const (
	minStoredLen  = 5
	minRemovedLen = 2
)

// decoder is a reusable MessagePack reader over one payload.
type decoder struct {
	buf []byte // the payload r reads
	r   bytes.Reader
	d   *msgpack.Decoder
}

var decoderPool = sync.Pool{New: func() any { return &decoder{d: msgpack.NewDecoder(nil)} }}

// DecodeBatch decodes one MessagePack event batch (kv-events-index.md §7): an array
// [ts, events, data_parallel_rank] of 2 or more elements (elements after the third are ignored) or
// a map with keys "ts", "events", "data_parallel_rank" (other keys ignored). Events may be in array
// or map form, mixed in one batch. Events that must be dropped are returned with Err set (unknown
// tag, missing or invalid required field, out-of-range token id). A payload that is not a valid
// batch (truncated, wrong outer type, fewer than 2 elements, events not an array, nesting deeper
// than 32 levels) returns an error wrapping ErrInvalidBatch. Bytes after the batch are ignored.
// DecodeBatch never panics.
func DecodeBatch(payload []byte) (Batch, error) {
	x := decoderPool.Get().(*decoder)
	x.buf = payload
	x.r.Reset(payload)
	x.d.Reset(&x.r)
	b, err := x.batch()
	x.buf = nil
	x.r.Reset(nil)
	x.d.Reset(nil)
	decoderPool.Put(x)
	if err != nil {
		return Batch{}, fmt.Errorf("%w: %w", ErrInvalidBatch, err)
	}
	return b, nil
}

func (x *decoder) batch() (Batch, error) {
	var b Batch
	c, err := x.d.PeekCode()
	if err != nil {
		return b, err
	}
	switch {
	case isArray(c):
		n, err := x.arrayLen()
		if err != nil {
			return b, err
		}
		if n < 2 {
			return b, fmt.Errorf("batch array has %d elements, need at least 2", n)
		}
		if b.TS, err = x.ts(); err != nil {
			return b, err
		}
		if b.Events, err = x.events(); err != nil {
			return b, err
		}
		if n >= 3 {
			if b.DPRank, err = x.rank(); err != nil {
				return b, err
			}
		}
		return b, nil
	case isMap(c):
		n, err := x.mapLen()
		if err != nil {
			return b, err
		}
		for i := 0; i < n; i++ {
			key, ok, err := x.key()
			if err != nil {
				return b, err
			}
			switch {
			case !ok:
				err = x.skip(1)
			case key == "ts":
				b.TS, err = x.ts()
			case key == "events":
				b.Events, err = x.events()
			case key == "data_parallel_rank":
				b.DPRank, err = x.rank()
			default:
				err = x.skip(1)
			}
			if err != nil {
				return b, err
			}
		}
		return b, nil
	}
	return b, fmt.Errorf("batch is msgpack type 0x%02x, want array or map", c)
}

func (x *decoder) ts() (float64, error) {
	c, err := x.d.PeekCode()
	if err != nil {
		return 0, err
	}
	if c == msgpcode.Float || c == msgpcode.Double {
		return x.d.DecodeFloat64()
	}
	u, neg, ok, err := x.integer()
	if err != nil || !ok {
		return 0, err
	}
	if neg {
		return float64(int64(u)), nil
	}
	return float64(u), nil
}

func (x *decoder) rank() (*uint32, error) {
	v, ok, err := x.optInt()
	if err != nil || !ok || v < 0 || v > math.MaxUint32 {
		return nil, err
	}
	r := uint32(v)
	return &r, nil
}

func (x *decoder) events() ([]RawEvent, error) {
	c, err := x.d.PeekCode()
	if err != nil {
		return nil, err
	}
	if !isArray(c) {
		return nil, fmt.Errorf("events is msgpack type 0x%02x, want array", c)
	}
	n, err := x.arrayLen()
	if err != nil {
		return nil, err
	}
	evs := make([]RawEvent, n)
	for i := range evs {
		if err := x.event(&evs[i]); err != nil {
			return nil, err
		}
	}
	return evs, nil
}

// fieldState records which required fields were seen and valid.
type fieldState struct {
	hashes, tokens, blockSize bool
	lenErr                    error // the event array is shorter than its minimum length
	tokenErr                  error // first invalid token id
}

func (f *fieldState) fail(err error) {
	if f.tokenErr == nil {
		f.tokenErr = err
	}
}

func (x *decoder) event(ev *RawEvent) error {
	c, err := x.d.PeekCode()
	if err != nil {
		return err
	}
	var fs fieldState
	switch {
	case isArray(c):
		n, err := x.arrayLen()
		if err != nil {
			return err
		}
		if n == 0 {
			ev.Err = fmt.Errorf("%w: empty event array", ErrInvalidEvent)
			return nil
		}
		tag, ok, err := x.optString()
		if err != nil {
			return err
		}
		if ok {
			ev.Type = tag
		}
		var names []string
		switch ev.Type {
		case TypeBlockStored:
			names = storedFields[:]
			if n < minStoredLen {
				fs.lenErr = (fmt.Errorf("%w: BlockStored has %d elements, need at least %d", ErrInvalidEvent, n, minStoredLen))
			}
		case TypeBlockRemoved:
			names = removedFields[:]
			if n < minRemovedLen {
				fs.lenErr = (fmt.Errorf("%w: BlockRemoved has %d elements, need at least %d", ErrInvalidEvent, n, minRemovedLen))
			}
		}
		for i := 1; i < n; i++ {
			if i < len(names) {
				err = x.field(ev, names[i], &fs)
			} else {
				err = x.skip(1)
			}
			if err != nil {
				return err
			}
		}
	case isMap(c):
		n, err := x.mapLen()
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			key, ok, err := x.key()
			if err != nil {
				return err
			}
			switch {
			case !ok:
				err = x.skip(1)
			case key == "type":
				var tag string
				if tag, ok, err = x.optString(); ok {
					ev.Type = tag
				}
			case key == "cache_salt":
				var s string
				if s, ok, err = x.optString(); ok {
					ev.CacheSalt = s
				}
			default:
				err = x.field(ev, key, &fs)
			}
			if err != nil {
				return err
			}
		}
	default:
		if err := x.skip(0); err != nil {
			return err
		}
		ev.Err = fmt.Errorf("%w: event is msgpack type 0x%02x, want array or map", ErrInvalidEvent, c)
		return nil
	}
	ev.Err = fs.validate(ev.Type)
	return nil
}

// validate returns the drop reason of an event of the given type, or nil.
func (f *fieldState) validate(typ string) error {
	switch typ {
	case TypeBlockStored:
		switch {
		case f.lenErr != nil:
			return f.lenErr
		case f.tokenErr != nil:
			return f.tokenErr
		case !f.hashes:
			return fmt.Errorf("%w: BlockStored without valid block_hashes", ErrInvalidEvent)
		case !f.tokens:
			return fmt.Errorf("%w: BlockStored without valid token_ids", ErrInvalidEvent)
		case !f.blockSize:
			return fmt.Errorf("%w: BlockStored without valid block_size", ErrInvalidEvent)
		}
	case TypeBlockRemoved:
		switch {
		case f.lenErr != nil:
			return f.lenErr
		case !f.hashes:
			return fmt.Errorf("%w: BlockRemoved without valid block_hashes", ErrInvalidEvent)
		}
	case TypeAllBlocksCleared:
	default:
		return fmt.Errorf("%w: %q", ErrUnknownEventType, typ)
	}
	return nil
}

// field decodes the value of one named event field into ev. Unknown names are skipped. Required
// fields record their validity in fs; optional fields of the wrong type are treated as absent.
func (x *decoder) field(ev *RawEvent, name string, fs *fieldState) error {
	switch name {
	case "block_hashes":
		hs, err := x.hashList(fs)
		if err != nil {
			return err
		}
		ev.BlockHashes = hs
	case "parent_block_hash":
		h, ok, err := x.hash()
		if err != nil {
			return err
		}
		ev.HasParent, ev.ParentHash = ok, h
	case "token_ids":
		return x.tokenIDs(ev, fs)
	case "block_size":
		v, ok, err := x.optInt()
		if err != nil {
			return err
		}
		if !ok || v < 0 || v > math.MaxInt32 {
			fs.blockSize = false
			return nil
		}
		ev.BlockSize, fs.blockSize = int(v), true
	case "lora_id":
		return x.optIntField(&ev.LoraID)
	case "medium":
		return x.optStringField(&ev.Medium)
	case "lora_name":
		return x.loraSlot(ev)
	case "extra_keys":
		return x.extraKeys(ev)
	case "group_idx":
		v, ok, err := x.optInt()
		if err != nil {
			return err
		}
		ev.GroupIdx = 0
		if ok && v >= math.MinInt32 && v <= math.MaxInt32 {
			ev.GroupIdx = int(v)
		}
	case "kv_cache_spec_kind":
		return x.optStringField(&ev.KVCacheSpecKind)
	case "kv_cache_spec_sliding_window":
		return x.optIntField(&ev.SlidingWindow)
	case "locality":
		return x.optStringField(&ev.Locality)
	default:
		return x.skip(1)
	}
	return nil
}

func (x *decoder) hashList(fs *fieldState) ([]uint64, error) {
	n, ok, err := x.optArrayLen(1)
	if err != nil {
		return nil, err
	}
	if !ok {
		fs.hashes = false
		return nil, nil
	}
	hs := make([]uint64, 0, n)
	valid := true
	for i := 0; i < n; i++ {
		h, ok, err := x.hash()
		if err != nil {
			return nil, err
		}
		if !ok {
			valid = false
			continue
		}
		hs = append(hs, h)
	}
	fs.hashes = valid
	if !valid {
		return nil, nil
	}
	return hs, nil
}

// hash decodes one block hash per §4; ok is false (value consumed) for nil or a non-hash type.
func (x *decoder) hash() (uint64, bool, error) {
	c, err := x.d.PeekCode()
	if err != nil {
		return 0, false, err
	}
	if msgpcode.IsString(c) || msgpcode.IsBin(c) {
		n, err := x.bytesLen()
		if err != nil {
			return 0, false, err
		}
		var buf [8]byte
		if n > 8 {
			if _, err := x.r.Seek(int64(n-8), io.SeekCurrent); err != nil {
				return 0, false, err
			}
			n = 8
		}
		if _, err := x.r.Read(buf[8-n:]); err != nil && n > 0 {
			return 0, false, err
		}
		return binary.BigEndian.Uint64(buf[:]), true, nil
	}
	u, _, ok, err := x.integer()
	return u, ok, err
}

func (x *decoder) tokenIDs(ev *RawEvent, fs *fieldState) error {
	fs.tokens = false
	ev.TokenIDs, ev.Bigram = nil, false
	n, ok, err := x.optArrayLen(1)
	if err != nil || !ok {
		return err
	}
	toks := make([]uint32, 0, n)
	valid := true
	bigram := false
	var last uint32
	for i := 0; i < n; i++ {
		if !valid {
			if err := x.skip(1); err != nil {
				return err
			}
			continue
		}
		if i == 0 {
			c, err := x.d.PeekCode()
			if err != nil {
				return err
			}
			bigram = isArray(c)
		}
		if !bigram {
			// Fast path over the raw bytes for unsigned ids below 2^32 (nearly every token).
			var k int
			toks, k = x.fastTokens(toks, n-i)
			if i += k; i == n {
				break
			}
			t, ok, err := x.token(i, -1, fs)
			if err != nil {
				return err
			}
			if !ok {
				valid = false
				continue
			}
			toks = append(toks, t)
			continue
		}
		m, isPair, err := x.optArrayLen(1)
		if err != nil {
			return err
		}
		if !isPair {
			fs.fail(fmt.Errorf("%w: token_ids[%d] is not a bigram pair", ErrInvalidEvent, i))
			valid = false
			continue
		}
		for j := 0; j < m; j++ {
			if j >= 2 || !valid {
				if err := x.skip(1); err != nil {
					return err
				}
				continue
			}
			t, ok, err := x.token(i, j, fs)
			if err != nil {
				return err
			}
			if !ok {
				valid = false
				continue
			}
			if j == 0 {
				toks = append(toks, t)
			} else {
				last = t
			}
		}
		if m != 2 && valid {
			fs.fail(fmt.Errorf("%w: token_ids[%d] has %d elements, want a bigram pair", ErrInvalidEvent, i, m))
			valid = false
		}
	}
	if !valid {
		return nil
	}
	if bigram && n > 0 {
		toks = append(toks, last)
	}
	ev.TokenIDs, ev.Bigram, fs.tokens = toks, bigram, true
	return nil
}

// fastTokens appends up to max token ids encoded as positive fixints or uint8/16/32, reading the
// payload bytes directly, and returns how many it consumed; it stops before any other encoding.
func (x *decoder) fastTokens(toks []uint32, max int) ([]uint32, int) {
	buf := x.buf
	start := len(buf) - x.r.Len()
	pos := start
	k := 0
	for ; k < max && pos < len(buf); k++ {
		c := buf[pos]
		switch {
		case c <= msgpcode.PosFixedNumHigh:
			toks = append(toks, uint32(c))
			pos++
		case c == msgpcode.Uint8 && pos+1 < len(buf):
			toks = append(toks, uint32(buf[pos+1]))
			pos += 2
		case c == msgpcode.Uint16 && pos+2 < len(buf):
			toks = append(toks, uint32(binary.BigEndian.Uint16(buf[pos+1:])))
			pos += 3
		case c == msgpcode.Uint32 && pos+4 < len(buf):
			toks = append(toks, binary.BigEndian.Uint32(buf[pos+1:]))
			pos += 5
		default:
			_, _ = x.r.Seek(int64(pos-start), io.SeekCurrent)
			return toks, k
		}
	}
	_, _ = x.r.Seek(int64(pos-start), io.SeekCurrent)
	return toks, k
}

// token decodes one token id; an invalid id is recorded in fs and ok is false (j < 0 for a flat
// list).
func (x *decoder) token(i, j int, fs *fieldState) (uint32, bool, error) {
	u, neg, ok, err := x.integer()
	if err != nil {
		return 0, false, err
	}
	if ok && !neg && u <= math.MaxUint32 {
		return uint32(u), true, nil
	}
	where := fmt.Sprintf("token_ids[%d]", i)
	if j >= 0 {
		where = fmt.Sprintf("token_ids[%d][%d]", i, j)
	}
	switch {
	case !ok:
		fs.fail(fmt.Errorf("%w: %s is not an integer", ErrInvalidEvent, where))
	case neg:
		fs.fail(fmt.Errorf("%w: %s = %d", ErrTokenIDOutOfRange, where, int64(u)))
	default:
		fs.fail(fmt.Errorf("%w: %s = %d", ErrTokenIDOutOfRange, where, u))
	}
	return 0, false, nil
}

func (x *decoder) loraSlot(ev *RawEvent) error {
	ev.LoraName, ev.LoraMetaCacheSalt = "", ""
	c, err := x.d.PeekCode()
	if err != nil {
		return err
	}
	if isMap(c) {
		v, err := x.loose(1)
		if err != nil {
			return err
		}
		if m, ok := v.(map[string]any); ok {
			if s, ok := m["cache_salt"].(string); ok {
				ev.LoraMetaCacheSalt = s
			}
		}
		return nil
	}
	s, _, err := x.optString()
	ev.LoraName = s
	return err
}

func (x *decoder) extraKeys(ev *RawEvent) error {
	ev.ExtraKeys = nil
	n, ok, err := x.optArrayLen(1)
	if err != nil || !ok {
		return err
	}
	keys := make([][]any, n)
	for i := range keys {
		c, err := x.d.PeekCode()
		if err != nil {
			return err
		}
		if !isArray(c) {
			if err := x.skip(2); err != nil {
				return err
			}
			continue
		}
		v, err := x.loose(2)
		if err != nil {
			return err
		}
		keys[i], _ = v.([]any)
	}
	ev.ExtraKeys = keys
	return nil
}

// integer decodes an integer of any MessagePack width. u holds the value's 64 bits (two's
// complement when neg). ok is false (value consumed) when the value is not an integer. It reads
// the bytes directly: token lists are the bulk of every payload.
func (x *decoder) integer() (u uint64, neg, ok bool, err error) {
	c, err := x.r.ReadByte()
	if err != nil {
		return 0, false, false, err
	}
	switch {
	case c <= msgpcode.PosFixedNumHigh:
		return uint64(c), false, true, nil
	case c >= msgpcode.NegFixedNumLow:
		return uint64(int64(int8(c))), true, true, nil
	}
	var w int
	switch c {
	case msgpcode.Uint8, msgpcode.Int8:
		w = 1
	case msgpcode.Uint16, msgpcode.Int16:
		w = 2
	case msgpcode.Uint32, msgpcode.Int32:
		w = 4
	case msgpcode.Uint64, msgpcode.Int64:
		w = 8
	default:
		if err := x.r.UnreadByte(); err != nil {
			return 0, false, false, err
		}
		return 0, false, false, x.skip(1)
	}
	for k := 0; k < w; k++ {
		b, err := x.r.ReadByte()
		if err != nil {
			return 0, false, false, io.ErrUnexpectedEOF
		}
		u = u<<8 | uint64(b)
	}
	if c >= msgpcode.Int8 { // signed: sign-extend from w bytes
		shift := uint(64 - 8*w)
		v := int64(u<<shift) >> shift
		return uint64(v), v < 0, true, nil
	}
	return u, false, true, nil
}

// optInt decodes an optional signed integer; ok is false for nil, a non-integer (consumed) or an
// unsigned value above 2^63−1.
func (x *decoder) optInt() (int64, bool, error) {
	u, neg, ok, err := x.integer()
	if err != nil || !ok {
		return 0, false, err
	}
	if !neg && u > math.MaxInt64 {
		return 0, false, nil
	}
	return int64(u), true, nil
}

// optIntField decodes an optional integer field into *dst: a pointer to the value, or nil when
// the value is nil or not an integer that fits int64 (consumed either way). On a decoding error
// *dst is left unchanged.
func (x *decoder) optIntField(dst **int64) error {
	v, ok, err := x.optInt()
	if err != nil {
		return err
	}
	*dst = nil
	if ok {
		*dst = &v
	}
	return nil
}

// optStringField decodes an optional string field into *dst: the str or bin value, or "" for
// nil or another type (consumed either way). On a decoding error *dst is left unchanged.
func (x *decoder) optStringField(dst *string) error {
	s, _, err := x.optString()
	if err != nil {
		return err
	}
	*dst = s
	return nil
}

// optString decodes an optional str or bin value; ok is false for nil or another type (consumed).
func (x *decoder) optString() (string, bool, error) {
	c, err := x.d.PeekCode()
	if err != nil {
		return "", false, err
	}
	if msgpcode.IsString(c) || msgpcode.IsBin(c) {
		n, err := x.bytesLen()
		if err != nil {
			return "", false, err
		}
		// n ≤ x.r.Len(), so one Read fills the buffer.
		if n <= 64 {
			var buf [64]byte
			_, _ = x.r.Read(buf[:n])
			if s, ok := internString(buf[:n]); ok {
				return s, true, nil
			}
			return string(buf[:n]), true, nil
		}
		b := make([]byte, n)
		_, _ = x.r.Read(b)
		return string(b), true, nil
	}
	return "", false, x.skip(1)
}

// key decodes a map key; ok is false (value consumed) when the key is not a string.
func (x *decoder) key() (string, bool, error) {
	return x.optString()
}

// arrayLen decodes an array header and checks the count against the bytes left (every element
// takes at least one byte), so a forged length cannot force a huge allocation. nil counts as 0.
func (x *decoder) arrayLen() (int, error) {
	n, err := x.d.DecodeArrayLen()
	return x.boundedLen(n, err, 1, "array", "elements")
}

// optArrayLen decodes an optional array header: (n, true) for an array of n elements (checked as
// by arrayLen), or (0, false) after skipping a value of another type (see skip for depth).
func (x *decoder) optArrayLen(depth int) (int, bool, error) {
	c, err := x.d.PeekCode()
	if err != nil {
		return 0, false, err
	}
	if !isArray(c) {
		return 0, false, x.skip(depth)
	}
	n, err := x.arrayLen()
	return n, err == nil, err
}

// mapLen is arrayLen for map headers (every entry takes at least two bytes).
func (x *decoder) mapLen() (int, error) {
	n, err := x.d.DecodeMapLen()
	return x.boundedLen(n, err, 2, "map", "entries")
}

// boundedLen checks a decoded header length n (negative for nil, which counts as 0) of n items
// taking at least itemBytes bytes each against the bytes left in the payload; decodeErr, the
// header's decoding error, is returned as is. The error names the length: "<kind> of <n> <unit>
// exceeds the <left> bytes left".
func (x *decoder) boundedLen(n int, decodeErr error, itemBytes int, kind, unit string) (int, error) {
	if decodeErr != nil {
		return 0, decodeErr
	}
	if n < 0 {
		return 0, nil
	}
	if n > x.r.Len()/itemBytes {
		return 0, fmt.Errorf("%s of %d %s exceeds the %d bytes left", kind, n, unit, x.r.Len())
	}
	return n, nil
}

// skip consumes one value of any type, descending at most maxNesting container levels.
func (x *decoder) skip(depth int) error {
	if depth > maxNesting {
		return fmt.Errorf("msgpack nesting deeper than %d levels", maxNesting)
	}
	c, err := x.d.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case isArray(c):
		n, err := x.arrayLen()
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			if err := x.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case isMap(c):
		n, err := x.mapLen()
		if err != nil {
			return err
		}
		for i := 0; i < 2*n; i++ {
			if err := x.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		n, err := x.bytesLen()
		if err != nil {
			return err
		}
		_, err = x.r.Seek(int64(n), io.SeekCurrent)
		return err
	case msgpcode.IsExt(c):
		return x.skipExt(c)
	}
	// Only fixed-size scalars remain (nil, bool, integers, floats; 0xc1 is an error), which
	// msgpack skips without allocating.
	return x.d.Skip()
}

// bytesLen decodes a str or bin header and checks the length against the bytes left, so the
// payload is then read from x.r directly. (msgpack's own readers grow a buffer kept in the pooled
// decoder by up to 1 MiB per call for a forged length.)
func (x *decoder) bytesLen() (int, error) {
	n, err := x.d.DecodeBytesLen()
	return x.boundedLen(n, err, 1, "string", "bytes")
}

// skipExt skips a MessagePack extension value (header, type byte and data).
func (x *decoder) skipExt(c byte) error {
	var n int
	switch c {
	case msgpcode.FixExt1:
		n = 1
	case msgpcode.FixExt2:
		n = 2
	case msgpcode.FixExt4:
		n = 4
	case msgpcode.FixExt8:
		n = 8
	case msgpcode.FixExt16:
		n = 16
	default:
		var hdr [5]byte
		w := 4
		switch c {
		case msgpcode.Ext8:
			w = 1
		case msgpcode.Ext16:
			w = 2
		}
		if _, err := io.ReadFull(&x.r, hdr[:1+w]); err != nil {
			return err
		}
		for _, b := range hdr[1 : 1+w] {
			n = n<<8 | int(b)
		}
		if n+1 > x.r.Len() {
			return fmt.Errorf("extension of %d bytes exceeds the %d bytes left", n, x.r.Len())
		}
		_, err := x.r.Seek(int64(n+1), io.SeekCurrent)
		return err
	}
	if _, err := x.r.ReadByte(); err != nil { // the code byte
		return err
	}
	if n+1 > x.r.Len() {
		return fmt.Errorf("extension of %d bytes exceeds the %d bytes left", n, x.r.Len())
	}
	_, err := x.r.Seek(int64(n+1), io.SeekCurrent)
	return err
}

// loose decodes one value of any type into Go values (see RawEvent.ExtraKeys), descending at
// most maxNesting container levels. Integers are normalized to int64 (uint64 only above
// 2^63−1), floats to float64, maps to map[string]any (entries with non-string keys dropped),
// extension values to nil.
func (x *decoder) loose(depth int) (any, error) {
	if depth > maxNesting {
		return nil, fmt.Errorf("msgpack nesting deeper than %d levels", maxNesting)
	}
	c, err := x.d.PeekCode()
	if err != nil {
		return nil, err
	}
	switch {
	case c == msgpcode.Nil:
		return nil, x.d.DecodeNil()
	case c == msgpcode.True || c == msgpcode.False:
		return x.d.DecodeBool()
	case c == msgpcode.Float || c == msgpcode.Double:
		return x.d.DecodeFloat64()
	case isUint(c) || isInt(c):
		u, neg, _, err := x.integer()
		if err != nil {
			return nil, err
		}
		if !neg && u > math.MaxInt64 {
			return u, nil
		}
		return int64(u), nil
	case msgpcode.IsString(c):
		s, _, err := x.optString()
		return s, err
	case msgpcode.IsBin(c):
		n, err := x.bytesLen()
		if err != nil {
			return nil, err
		}
		b := make([]byte, n)
		if _, err := x.r.Read(b); err != nil && n > 0 {
			return nil, err
		}
		return b, nil
	case isArray(c):
		n, err := x.arrayLen()
		if err != nil {
			return nil, err
		}
		s := make([]any, n)
		for i := range s {
			if s[i], err = x.loose(depth + 1); err != nil {
				return nil, err
			}
		}
		return s, nil
	case isMap(c):
		n, err := x.mapLen()
		if err != nil {
			return nil, err
		}
		m := make(map[string]any, n)
		for i := 0; i < n; i++ {
			k, ok, err := x.key()
			if err != nil {
				return nil, err
			}
			if !ok {
				if err := x.skip(depth + 1); err != nil {
					return nil, err
				}
				continue
			}
			if m[k], err = x.loose(depth + 1); err != nil {
				return nil, err
			}
		}
		return m, nil
	}
	return nil, x.skip(depth)
}

// interned are the strings every batch repeats (tags, field names, media, attention kinds);
// returning them avoids an allocation per field.
var interned = [...]string{
	TypeBlockStored, TypeBlockRemoved, TypeAllBlocksCleared,
	"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
	"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "type",
	"cache_salt", "ts", "events", "data_parallel_rank",
	"GPU", "CPU", "DISK", "LOCAL", "full_attention", "sliding_window", "mla_attention",
}

// internString returns the interned copy of b, if any, without allocating.
func internString(b []byte) (string, bool) {
	for _, s := range interned {
		if string(b) == s {
			return s, true
		}
	}
	return "", false
}

func isUint(c byte) bool {
	return c <= msgpcode.PosFixedNumHigh || (c >= msgpcode.Uint8 && c <= msgpcode.Uint64)
}

func isInt(c byte) bool {
	return c >= msgpcode.NegFixedNumLow || (c >= msgpcode.Int8 && c <= msgpcode.Int64)
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}
