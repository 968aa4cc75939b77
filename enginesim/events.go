package enginesim

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"
)

// EventKind names a vLLM KV event class (kv-events-index.md §7.2).
type EventKind uint8

const (
	// BlockStored announces blocks newly cached on the engine.
	BlockStored EventKind = iota + 1
	// BlockRemoved announces blocks evicted from the engine's cache.
	BlockRemoved
	// AllBlocksCleared announces that the engine dropped its whole prefix cache.
	AllBlocksCleared
)

// String returns the vLLM class name used as the event tag ("BlockStored",
// "BlockRemoved", "AllBlocksCleared"), or "EventKind(n)" for an unknown kind.
func (k EventKind) String() string {
	switch k {
	case BlockStored:
		return "BlockStored"
	case BlockRemoved:
		return "BlockRemoved"
	case AllBlocksCleared:
		return "AllBlocksCleared"
	}
	return fmt.Sprintf("EventKind(%d)", uint8(k))
}

// MediumGPU is the medium string the simulator puts on every event (device tier,
// kv-events-index.md §8.1).
const MediumGPU = "GPU"

// EndSeq is the sequence number of the replay end marker (kv-events-index.md §6):
// all ones, sent with an empty payload.
const EndSeq uint64 = math.MaxUint64

// Event is one KV event as the simulator publishes it.
//
// BlockStored uses BlockHashes (engine ids, one per block), HasParent/ParentHash
// (the engine id of the block before the first one, absent for a store from the
// root), TokenIDs (exactly len(BlockHashes) × BlockSize tokens) and BlockSize (in
// tokens). BlockRemoved uses BlockHashes. AllBlocksCleared uses no field. Medium
// is the storage medium string; empty means [MediumGPU].
type Event struct {
	Kind        EventKind
	BlockHashes []uint64
	HasParent   bool
	ParentHash  uint64
	TokenIDs    []uint32
	BlockSize   int
	Medium      string
}

// EncodeBatch encodes one vLLM KV event batch in MessagePack (kv-events-index.md
// §7.1) and appends it to dst: the array [ts, events, dpRank], ts a float64 in
// seconds since the Unix epoch. Events use the array forms of §7.2, exactly as
// vLLM writes them:
//
//	["BlockStored", [hash...], parent|nil, [token...], block_size, nil (lora_id), medium, nil (lora_name)]
//	["BlockRemoved", [hash...], medium]
//	["AllBlocksCleared"]
//
// Integers use the smallest MessagePack width. It returns an error naming the
// event when an event has an unknown kind, a negative block size, or a token
// count other than len(BlockHashes) × BlockSize.
func EncodeBatch(dst []byte, ts float64, events []Event, dpRank uint32) ([]byte, error) {
	buf := bytes.NewBuffer(dst)
	enc := msgpack.NewEncoder(buf)
	if err := encodeBatch(enc, ts, events, dpRank); err != nil {
		return dst, err
	}
	return buf.Bytes(), nil
}

func encodeBatch(enc *msgpack.Encoder, ts float64, events []Event, dpRank uint32) error {
	if err := enc.EncodeArrayLen(3); err != nil {
		return err
	}
	if err := enc.EncodeFloat64(ts); err != nil {
		return err
	}
	if err := enc.EncodeArrayLen(len(events)); err != nil {
		return err
	}
	for i := range events {
		if err := encodeEvent(enc, &events[i]); err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
	}
	return enc.EncodeUint(uint64(dpRank))
}

func encodeEvent(enc *msgpack.Encoder, ev *Event) error {
	medium := ev.Medium
	if medium == "" {
		medium = MediumGPU
	}
	switch ev.Kind {
	case BlockStored:
		if ev.BlockSize < 0 {
			return fmt.Errorf("BlockStored block_size %d is negative", ev.BlockSize)
		}
		if want := len(ev.BlockHashes) * ev.BlockSize; len(ev.TokenIDs) != want {
			return fmt.Errorf("BlockStored has %d token ids, want %d (%d blocks × block_size %d)",
				len(ev.TokenIDs), want, len(ev.BlockHashes), ev.BlockSize)
		}
		if err := enc.EncodeArrayLen(8); err != nil {
			return err
		}
		if err := enc.EncodeString("BlockStored"); err != nil {
			return err
		}
		if err := encodeHashes(enc, ev.BlockHashes); err != nil {
			return err
		}
		var err error
		if ev.HasParent {
			err = enc.EncodeUint(ev.ParentHash)
		} else {
			err = enc.EncodeNil()
		}
		if err != nil {
			return err
		}
		if err := enc.EncodeArrayLen(len(ev.TokenIDs)); err != nil {
			return err
		}
		for _, t := range ev.TokenIDs {
			if err := enc.EncodeUint(uint64(t)); err != nil {
				return err
			}
		}
		if err := enc.EncodeUint(uint64(ev.BlockSize)); err != nil {
			return err
		}
		if err := enc.EncodeNil(); err != nil { // lora_id
			return err
		}
		if err := enc.EncodeString(medium); err != nil {
			return err
		}
		return enc.EncodeNil() // lora_name
	case BlockRemoved:
		if err := enc.EncodeArrayLen(3); err != nil {
			return err
		}
		if err := enc.EncodeString("BlockRemoved"); err != nil {
			return err
		}
		if err := encodeHashes(enc, ev.BlockHashes); err != nil {
			return err
		}
		return enc.EncodeString(medium)
	case AllBlocksCleared:
		if err := enc.EncodeArrayLen(1); err != nil {
			return err
		}
		return enc.EncodeString("AllBlocksCleared")
	}
	return fmt.Errorf("unknown event kind %v", ev.Kind)
}

func encodeHashes(enc *msgpack.Encoder, hashes []uint64) error {
	if err := enc.EncodeArrayLen(len(hashes)); err != nil {
		return err
	}
	for _, h := range hashes {
		if err := enc.EncodeUint(h); err != nil {
			return err
		}
	}
	return nil
}

// SeqFrame returns the 8-byte big-endian sequence frame of a live or replayed
// message (kv-events-index.md §5.2, §6).
func SeqFrame(seq uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], seq)
	return b[:]
}
