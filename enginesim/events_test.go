package enginesim

import (
	"encoding/hex"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/internal/sharedtest"
)

func goldenKVEvents(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, v := range sharedtest.KVEventVectors(t) {
		out[v.Name] = v.Hex
	}
	return out
}

func TestEncodeBatchMatchesGoldenVectors(t *testing.T) {
	golden := goldenKVEvents(t)
	tests := []struct {
		name   string
		vector string
		event  Event
	}{
		{"a stored event from the root encodes like vLLM's array form", "stored-array-form",
			Event{Kind: BlockStored, BlockHashes: []uint64{11}, TokenIDs: []uint32{10, 11}, BlockSize: 2}},
		{"a removed event encodes like vLLM's array form", "removed-array-form",
			Event{Kind: BlockRemoved, BlockHashes: []uint64{11}}},
		{"an explicit GPU medium encodes like the default", "removed-array-form",
			Event{Kind: BlockRemoved, BlockHashes: []uint64{11}, Medium: MediumGPU}},
		{"all blocks cleared encodes as a one-element array", "cleared",
			Event{Kind: AllBlocksCleared}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			want, ok := golden[tc.vector]
			if !ok {
				t.Fatalf("golden vector %q missing", tc.vector)
			}
			got, err := EncodeBatch(nil, 1.5, []Event{tc.event}, 0)
			if err != nil {
				t.Fatal(err)
			}
			if hex.EncodeToString(got) != want {
				t.Errorf("EncodeBatch = %x\nwant          %s", got, want)
			}
		})
	}
}

func TestEncodeBatch(t *testing.T) {
	t.Run("appends to dst and round-trips parent, large hashes and tokens", func(t *testing.T) {
		ev := Event{Kind: BlockStored, BlockHashes: []uint64{1 << 63, 5}, HasParent: true, ParentHash: 1<<64 - 5,
			TokenIDs: []uint32{0, 1 << 31, 70000, 3}, BlockSize: 2}
		prefix := []byte("xy")
		got, err := EncodeBatch(prefix, 12.25, []Event{ev, {Kind: BlockRemoved, BlockHashes: []uint64{5}}}, 3)
		if err != nil {
			t.Fatal(err)
		}
		if string(got[:2]) != "xy" {
			t.Fatalf("prefix lost: %q", got[:2])
		}
		b := decodeBatch(t, got[2:])
		if b.TS != 12.25 || b.DPRank != 3 || len(b.Events) != 2 {
			t.Fatalf("batch = %+v", b)
		}
		s := b.Events[0]
		if s.Len != 8 || !s.HasParent || s.Parent != 1<<64-5 || s.BlockSize != 2 || s.Medium != "GPU" ||
			len(s.Hashes) != 2 || s.Hashes[0] != 1<<63 || s.Tokens[1] != 1<<31 || s.Tokens[2] != 70000 {
			t.Errorf("stored event = %+v", s)
		}
		if r := b.Events[1]; r.Tag != "BlockRemoved" || r.Len != 3 || r.Hashes[0] != 5 {
			t.Errorf("removed event = %+v", r)
		}
	})
	bad := []struct {
		name  string
		event Event
		want  string
	}{
		{"rejects a stored event whose token count is not blocks × block size",
			Event{Kind: BlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{1}, BlockSize: 2}, "1 token ids, want 2"},
		{"rejects a negative block size",
			Event{Kind: BlockStored, BlockSize: -1}, "negative"},
		{"rejects an unknown event kind",
			Event{Kind: 9}, "unknown event kind EventKind(9)"},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			dst := []byte("keep")
			got, err := EncodeBatch(dst, 0, []Event{tc.event}, 0)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to contain %q", err, tc.want)
			}
			if string(got) != "keep" {
				t.Errorf("dst changed on error: %q", got)
			}
		})
	}
}

func TestEventKindString(t *testing.T) {
	for k, want := range map[EventKind]string{BlockStored: "BlockStored", BlockRemoved: "BlockRemoved",
		AllBlocksCleared: "AllBlocksCleared", 0: "EventKind(0)"} {
		if k.String() != want {
			t.Errorf("%d.String() = %q, want %q", k, k.String(), want)
		}
	}
}

func BenchmarkEncodeBatch(b *testing.B) {
	// One 32-block store, the size of a 512-token trace block at bs 16.
	ev := Event{Kind: BlockStored, BlockSize: 16, BlockHashes: make([]uint64, 32), TokenIDs: seqTokens(100000, 512)}
	for i := range ev.BlockHashes {
		ev.BlockHashes[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		var err error
		buf, err = EncodeBatch(buf[:0], 1.5, []Event{ev}, 0)
		if err != nil {
			b.Fatal(err)
		}
	}
}
