package kvindex

import (
	"encoding/binary"
	"slices"
	"unsafe"

	"github.com/zeebo/xxh3"
)

// BaseSeed is the XXH3 seed of an unsalted request (kv-events-index.md §1.2): the starting value
// of Seed and the seed of the sequence-hash chain (§2).
const BaseSeed uint64 = 1337

// padBase is the SGLang pad-value offset of §1.3.
const padBase = 1_000_000

// littleEndian reports whether the host stores integers little-endian, which lets block hashing
// read a token slice's memory directly instead of re-encoding it.
var littleEndian = func() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}()

// Seed returns the per-request block-hash seed (kv-events-index.md §1.2):
// 1337 +wrap XXH3-64(loraName, seed 0) +wrap XXH3-64(cacheNamespace, seed 1). An empty string is
// the same as absent. The same seed must be used for query hashing and for event re-hashing.
func Seed(loraName, cacheNamespace string) uint64 {
	seed := BaseSeed
	if loraName != "" {
		seed += xxh3.HashStringSeed(loraName, 0)
	}
	if cacheNamespace != "" {
		seed += xxh3.HashStringSeed(cacheNamespace, 1)
	}
	return seed
}

// HashMMIdentifier turns a multimodal item identifier into its u64 mm hash (kv-events-index.md
// §1.3): an identifier of exactly 64 hex characters (a sha256 digest, either case) yields the
// integer of its first 16 hex characters; any other string yields XXH3-64(utf8(id), seed 0).
func HashMMIdentifier(id string) uint64 {
	if len(id) == 64 {
		var v uint64
		hex := true
		for i := 0; i < 64; i++ {
			d, ok := hexDigit(id[i])
			if !ok {
				hex = false
				break
			}
			if i < 16 {
				v = v<<4 | uint64(d)
			}
		}
		if hex {
			return v
		}
	}
	return xxh3.HashStringSeed(id, 0)
}

func hexDigit(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10, true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// PadValue returns the SGLang placeholder token id of a multimodal item with hash mmHash
// (kv-events-index.md §1.3): 1,000,000 + (mmHash & (2^30 − 1)). Pad substitution is off by
// default; callers that enable it replace the item's placeholder run with this value on both the
// query side and the event side before hashing.
func PadValue(mmHash uint64) uint32 {
	return padBase + uint32(mmHash&(1<<30-1))
}

// BlockHash returns the local block hash (tokens_hash) of one block (kv-events-index.md §1.1,
// §1.3): XXH3-64 with the given seed over the block's token ids as u32 little-endian, followed by
// mmHashes as u64 little-endian sorted ascending (duplicates kept). The caller's mmHashes slice is
// not modified. blockTokens is hashed as given, whatever its length.
func BlockHash(blockTokens []uint32, seed uint64, mmHashes []uint64) uint64 {
	var buf [256]byte
	return blockHash(buf[:0], blockTokens, seed, mmHashes)
}

// blockHash hashes one block using scratch (length 0) as encoding space when it is large enough.
func blockHash(scratch []byte, tokens []uint32, seed uint64, mm []uint64) uint64 {
	if len(mm) == 0 && littleEndian {
		if len(tokens) == 0 {
			return xxh3.HashSeed(nil, seed)
		}
		return xxh3.HashSeed(unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), 4*len(tokens)), seed)
	}
	b := scratch[:0]
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	if len(mm) > 0 {
		start := len(b)
		for _, h := range mm {
			b = binary.LittleEndian.AppendUint64(b, h)
		}
		sortLEU64(b[start:])
	}
	return xxh3.HashSeed(b, seed)
}

// sortLEU64 sorts a run of little-endian u64 values in place (small insertion sort: blocks carry
// a handful of multimodal hashes at most).
func sortLEU64(b []byte) {
	n := len(b) / 8
	for i := 1; i < n; i++ {
		v := binary.LittleEndian.Uint64(b[8*i:])
		j := i
		for j > 0 && binary.LittleEndian.Uint64(b[8*(j-1):]) > v {
			copy(b[8*j:8*j+8], b[8*(j-1):8*j])
			j--
		}
		binary.LittleEndian.PutUint64(b[8*j:], v)
	}
}

// BlockHashes returns the local block hashes of tokens split into blocks of blockSize tokens
// (kv-events-index.md §1.1): one hash per complete block, the partial tail dropped. blockSize <= 0
// yields nil. Equivalent to AppendBlockHashes(nil, tokens, blockSize, seed, nil).
func BlockHashes(tokens []uint32, blockSize int, seed uint64) []uint64 {
	return AppendBlockHashes(nil, tokens, blockSize, seed, nil)
}

// AppendBlockHashes appends to dst the local block hashes of tokens (kv-events-index.md §1.1,
// §1.3) and returns the extended slice: floor(len(tokens)/blockSize) hashes, blockSize <= 0 appends
// nothing. blockMM may be nil; otherwise blockMM[i] lists the mm hashes of the items overlapping
// block i (entries beyond the number of blocks are ignored), appended to that block's bytes
// sorted ascending. It allocates only when dst lacks capacity.
func AppendBlockHashes(dst []uint64, tokens []uint32, blockSize int, seed uint64, blockMM [][]uint64) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	n := len(tokens) / blockSize
	dst = slices.Grow(dst, n)
	var stack [512]byte
	scratch := stack[:0]
	for i := 0; i < n; i++ {
		var mm []uint64
		if i < len(blockMM) {
			mm = blockMM[i]
		}
		if need := 4*blockSize + 8*len(mm); need > cap(scratch) && (len(mm) > 0 || !littleEndian) {
			scratch = make([]byte, 0, need)
		}
		dst = append(dst, blockHash(scratch, tokens[i*blockSize:(i+1)*blockSize], seed, mm))
	}
	return dst
}

// EagleBlockHashes returns the local block hashes of an Eagle (speculative bigram) request
// (kv-events-index.md §1.4): block i hashes the blockSize+1 tokens [i·bs, i·bs+bs] (windows
// overlap by one token), n_blocks = floor((len(tokens)−1)/blockSize). blockMM is as in
// AppendBlockHashes. blockSize <= 0 or an empty token list yields nil.
func EagleBlockHashes(tokens []uint32, blockSize int, seed uint64, blockMM [][]uint64) []uint64 {
	if blockSize <= 0 || len(tokens) < 2 {
		return nil
	}
	n := (len(tokens) - 1) / blockSize
	out := make([]uint64, 0, n)
	var stack [512]byte
	scratch := stack[:0]
	for i := 0; i < n; i++ {
		var mm []uint64
		if i < len(blockMM) {
			mm = blockMM[i]
		}
		if need := 4*(blockSize+1) + 8*len(mm); need > cap(scratch) && (len(mm) > 0 || !littleEndian) {
			scratch = make([]byte, 0, need)
		}
		out = append(out, blockHash(scratch, tokens[i*blockSize:i*blockSize+blockSize+1], seed, mm))
	}
	return out
}

// SequenceHashes returns the sequence-hash chain of blockHashes (kv-events-index.md §2):
// seq[0] = local[0], seq[i] = XXH3-64(LE_u64(seq[i−1]) ‖ LE_u64(local[i]), seed 1337). The result
// has one entry per block hash; an empty input yields nil.
func SequenceHashes(blockHashes []uint64) []uint64 {
	if len(blockHashes) == 0 {
		return nil
	}
	return AppendSequenceHashes(make([]uint64, 0, len(blockHashes)), blockHashes)
}

// AppendSequenceHashes appends the sequence-hash chain of blockHashes (kv-events-index.md §2) to
// dst and returns the extended slice. The chain always starts at blockHashes[0] (it never
// continues a chain already in dst). It allocates only when dst lacks capacity.
func AppendSequenceHashes(dst, blockHashes []uint64) []uint64 {
	if len(blockHashes) == 0 {
		return dst
	}
	dst = slices.Grow(dst, len(blockHashes))
	prev := blockHashes[0]
	dst = append(dst, prev)
	for _, h := range blockHashes[1:] {
		prev = chainHash(prev, h)
		dst = append(dst, prev)
	}
	return dst
}

// chainHash is one step of the §2 chain.
func chainHash(prev, local uint64) uint64 {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], prev)
	binary.LittleEndian.PutUint64(b[8:], local)
	return xxh3.HashSeed(b[:], BaseSeed)
}

// AppendSequenceHashesAfter appends to dst the sequence-hash chain of blockHashes continued after
// prev, the chain's entry for the block before blockHashes[0] (kv-events-index.md §2): a chain
// whose first part is already known is extended without recomputing it. It allocates only when
// dst lacks capacity.
func AppendSequenceHashesAfter(dst []uint64, prev uint64, blockHashes []uint64) []uint64 {
	dst = slices.Grow(dst, len(blockHashes))
	for _, h := range blockHashes {
		prev = chainHash(prev, h)
		dst = append(dst, prev)
	}
	return dst
}
