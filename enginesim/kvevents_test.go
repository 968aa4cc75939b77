package enginesim

import (
	"bytes"
	"context"
	"encoding/binary"
	"slices"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

// liveBatch checks the 3-frame shape of a live message and decodes it.
func liveBatch(t *testing.T, msg zmq4.Msg, wantSeq uint64) decodedBatch {
	t.Helper()
	if len(msg.Frames) != 3 {
		t.Fatalf("live message has %d frames, want 3", len(msg.Frames))
	}
	if len(msg.Frames[0]) != 0 {
		t.Errorf("topic frame %q, want empty", msg.Frames[0])
	}
	if len(msg.Frames[1]) != 8 {
		t.Fatalf("seq frame has %d bytes, want 8", len(msg.Frames[1]))
	}
	if seq := binary.BigEndian.Uint64(msg.Frames[1]); seq != wantSeq {
		t.Errorf("seq %d, want %d", seq, wantSeq)
	}
	b := decodeBatch(t, msg.Frames[2])
	if b.DPRank != 0 {
		t.Errorf("dp_rank %d, want 0", b.DPRank)
	}
	if now := float64(time.Now().Unix()); b.TS < now-60 || b.TS > now+60 {
		t.Errorf("ts %v is not the current Unix time", b.TS)
	}
	return b
}

// completion runs a non-streaming completion with token-id prompt tokens.
func completion(t *testing.T, w *Worker, tokens []uint32, maxTokens int) {
	t.Helper()
	status, _, body := postJSON(t, w.Endpoint()+"/v1/completions", map[string]any{"prompt": tokens, "max_tokens": maxTokens})
	if status != 200 {
		t.Fatalf("status %d: %s", status, body)
	}
}

func TestKVEventsOverZMQ(t *testing.T) {
	w := startWorker(t, Config{CapacityBlocks: 2, TimeScale: 0.001})
	sub := subscribe(t, w)

	a := seqTokens(1, 40)
	completion(t, w, a, 2)
	stored := liveBatch(t, sub.next(t), 0)
	if len(stored.Events) != 1 {
		t.Fatalf("first batch has %d events, want 1 BlockStored", len(stored.Events))
	}
	s := stored.Events[0]
	if s.Tag != "BlockStored" || s.Len != 8 || s.HasParent || s.BlockSize != 16 || s.Medium != "GPU" ||
		len(s.Hashes) != 2 || !slices.Equal(s.Tokens, a[:32]) {
		t.Fatalf("stored event = %+v, want 2 blocks from the root with the first 32 tokens", s)
	}
	if want := w.cache.blockHashes(a); !slices.Equal(s.Hashes, want) {
		t.Errorf("stored hashes %v, want the chained engine hashes %v", s.Hashes, want)
	}

	// A prompt extending a's first block stores only the new blocks, with the hit block as parent.
	// The cache holds 2 blocks, so a's second block (the LRU leaf) is evicted first.
	ext := append(append([]uint32(nil), a[:16]...), seqTokens(500, 24)...)
	completion(t, w, ext, 1)
	b := liveBatch(t, sub.next(t), 1)
	if len(b.Events) != 2 || b.Events[0].Tag != "BlockRemoved" || b.Events[1].Tag != "BlockStored" {
		t.Fatalf("second batch = %+v, want BlockRemoved then BlockStored", b.Events)
	}
	if r := b.Events[0]; r.Len != 3 || r.Medium != "GPU" || !slices.Equal(r.Hashes, s.Hashes[1:]) {
		t.Errorf("removed event = %+v, want a's second block %d", r, s.Hashes[1])
	}
	if st := b.Events[1]; !st.HasParent || st.Parent != s.Hashes[0] || len(st.Hashes) != 1 || !slices.Equal(st.Tokens, ext[16:32]) {
		t.Errorf("stored event = %+v, want 1 block under parent %d", st, s.Hashes[0])
	}

	// An unrelated prompt evicts both cached blocks, tail first.
	c := seqTokens(9000, 32)
	completion(t, w, c, 1)
	b = liveBatch(t, sub.next(t), 2)
	if r := b.Events[0]; r.Tag != "BlockRemoved" || len(r.Hashes) != 2 || r.Hashes[1] != s.Hashes[0] {
		t.Errorf("removed event = %+v, want the extension block then root %d", r, s.Hashes[0])
	}

	// A fully cached prompt changes nothing, so no batch is published for it.
	completion(t, w, c[:20], 1)
	if err := w.Reset(); err != nil {
		t.Fatal(err)
	}
	b = liveBatch(t, sub.next(t), 3)
	if len(b.Events) != 1 || b.Events[0].Tag != "AllBlocksCleared" || b.Events[0].Len != 1 {
		t.Errorf("reset batch = %+v, want one AllBlocksCleared", b.Events)
	}
	if st := w.Stats(); st.EventBatches != 4 || st.CachedBlocks != 0 || st.BlocksEvicted != 3 {
		t.Errorf("stats: %d batches, %d cached, %d evicted; want 4, 0, 3", st.EventBatches, st.CachedBlocks, st.BlocksEvicted)
	}
}

// replay sends ["", start] from a DEALER and collects replies until the end marker.
func replay(t *testing.T, endpoint string, start uint64) (seqs []uint64, payloads [][]byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	d := zmq4.NewDealer(ctx)
	defer d.Close()
	if err := d.Dial(endpoint); err != nil {
		t.Fatalf("dial replay %s: %v", endpoint, err)
	}
	if err := d.SendMulti(zmq4.NewMsgFrom([]byte{}, SeqFrame(start))); err != nil {
		t.Fatal(err)
	}
	for {
		msg, err := d.Recv()
		if err != nil {
			t.Fatalf("replay recv: %v", err)
		}
		if len(msg.Frames) != 3 || len(msg.Frames[0]) != 0 || len(msg.Frames[1]) != 8 {
			t.Fatalf("replay reply frames %q, want [\"\", seq, payload]", msg.Frames)
		}
		seq := binary.BigEndian.Uint64(msg.Frames[1])
		if seq == EndSeq {
			if len(msg.Frames[2]) != 0 {
				t.Errorf("end marker payload %x, want empty", msg.Frames[2])
			}
			return seqs, payloads
		}
		seqs = append(seqs, seq)
		payloads = append(payloads, msg.Frames[2])
	}
}

func TestReplay(t *testing.T) {
	w := startWorker(t, Config{ReplayBuffer: 3, TimeScale: 0.001})
	sub := subscribe(t, w)
	var live [][]byte
	for i := 0; i < 4; i++ {
		completion(t, w, seqTokens(1000*i, 16), 1)
		live = append(live, sub.next(t).Frames[2])
	}
	tests := []struct {
		name  string
		start uint64
		want  []uint64
	}{
		{"a start older than the ring replays only what is still buffered", 0, []uint64{1, 2, 3}},
		{"a start inside the ring replays from that seq", 2, []uint64{2, 3}},
		{"a start past the newest seq replays nothing but the end marker", 4, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			seqs, payloads := replay(t, w.ReplayEndpoint(), tc.start)
			if !slices.Equal(seqs, tc.want) {
				t.Fatalf("replayed seqs %v, want %v", seqs, tc.want)
			}
			for i, seq := range seqs {
				if !bytes.Equal(payloads[i], live[seq]) {
					t.Errorf("replayed payload of seq %d differs from the live one", seq)
				}
			}
		})
	}
	t.Run("a malformed request is ignored and the socket keeps serving", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		d := zmq4.NewDealer(ctx)
		defer d.Close()
		if err := d.Dial(w.ReplayEndpoint()); err != nil {
			t.Fatal(err)
		}
		if err := d.SendMulti(zmq4.NewMsgFrom([]byte{}, []byte{1, 2, 3})); err != nil {
			t.Fatal(err)
		}
		if seqs, _ := replay(t, w.ReplayEndpoint(), 3); !slices.Equal(seqs, []uint64{3}) {
			t.Errorf("replayed %v after a malformed request, want [3]", seqs)
		}
	})
}
