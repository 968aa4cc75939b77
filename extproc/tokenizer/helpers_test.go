package tokenizer

import (
	"encoding/binary"
	"sync"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/kvepp/kvepp/internal/sharedtest"
)

var (
	qwenOnce sync.Once
	qwenTok  *Tokenizer
	qwenErr  error
)

// qwen3 loads the shared Qwen3 tokenizer once per test binary.
func qwen3(t testing.TB) *Tokenizer {
	t.Helper()
	dir := sharedtest.Qwen3TokenizerDir(t)
	qwenOnce.Do(func() { qwenTok, qwenErr = Load(dir) })
	if qwenErr != nil {
		t.Fatalf("Load(%s): %v", dir, qwenErr)
	}
	return qwenTok
}

// blockHashes computes kv-events-index.md §1-§3 block hashes (XXH3-64, seed 1337, tokens as LE
// u32, full blocks only) without importing kvindex.
func blockHashes(tokens []uint32, bs int) []uint64 {
	var out []uint64
	buf := make([]byte, 4*bs)
	for i := 0; i+bs <= len(tokens); i += bs {
		for k := 0; k < bs; k++ {
			binary.LittleEndian.PutUint32(buf[4*k:], tokens[i+k])
		}
		out = append(out, xxh3.HashSeed(buf, 1337))
	}
	return out
}

// sequenceHashes chains block hashes: seq[0]=block[0], seq[i]=xxh3(LE u64 seq[i-1] ‖ LE u64
// block[i], 1337).
func sequenceHashes(blocks []uint64) []uint64 {
	out := make([]uint64, len(blocks))
	var buf [16]byte
	for i, b := range blocks {
		if i == 0 {
			out[0] = b
			continue
		}
		binary.LittleEndian.PutUint64(buf[:8], out[i-1])
		binary.LittleEndian.PutUint64(buf[8:], b)
		out[i] = xxh3.HashSeed(buf[:], 1337)
	}
	return out
}

// mustDecode is Decode(ids, false) failing the test on error.
func mustDecode(t testing.TB, tk *Tokenizer, ids []uint32) string {
	t.Helper()
	s, err := tk.Decode(ids, false)
	if err != nil {
		t.Fatalf("Decode: %v", err)
	}
	return s
}
