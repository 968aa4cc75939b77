package kveventstest_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	kt "github.com/kvepp/kvepp/kvindex/kvevents/kveventstest"
)

func seqOf(b []byte) uint64 { return binary.BigEndian.Uint64(b) }

// subscribe dials a raw zmq4 SUB to the publisher and waits until the subscription is live.
func subscribe(t *testing.T, pub *kt.Publisher) zmq4.Socket {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	sub := zmq4.NewSub(ctx)
	t.Cleanup(func() { _ = sub.Close() })
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	if err := sub.Dial(pub.Endpoint()); err != nil {
		t.Fatal(err)
	}
	pub.WaitForSubscriber()
	return sub
}

// replay sends a replay request from start and returns the replies up to and including END.
func replay(t *testing.T, pub *kt.Publisher, start uint64) [][][]byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	dealer := zmq4.NewDealer(ctx)
	defer dealer.Close()
	if err := dealer.Dial(pub.ReplayEndpoint()); err != nil {
		t.Fatal(err)
	}
	var req [8]byte
	binary.BigEndian.PutUint64(req[:], start)
	if err := dealer.SendMulti(zmq4.NewMsgFrom([]byte{}, req[:])); err != nil {
		t.Fatal(err)
	}
	var out [][][]byte
	for {
		msg, err := dealer.Recv()
		if err != nil {
			t.Fatalf("replay receive: %v", err)
		}
		out = append(out, msg.Frames)
		if seqOf(msg.Frames[len(msg.Frames)-2]) == kt.EndSeq {
			return out
		}
	}
}

func TestPublisherSendsVLLMFrames(t *testing.T) {
	pub := kt.New(t, kt.Options{Topic: "kv"})
	sub := subscribe(t, pub)
	if s := pub.Publish(kt.Cleared()); s != 0 {
		t.Fatalf("first seq = %d, want 0", s)
	}
	pub.Withhold(kt.Cleared())
	pub.PublishSeq(5, kt.Removed(1))
	for _, want := range []uint64{0, 5} {
		msg, err := sub.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(msg.Frames) != 3 || string(msg.Frames[0]) != "kv" || len(msg.Frames[1]) != 8 || seqOf(msg.Frames[1]) != want {
			t.Fatalf("message = %q, want [kv, seq %d, payload]", msg.Frames, want)
		}
	}
	if pub.NextSeq() != 6 {
		t.Errorf("NextSeq = %d, want 6", pub.NextSeq())
	}
}

func TestPublisherAnswersReplayRequests(t *testing.T) {
	for _, four := range []bool{false, true} {
		name := "3-frame replies end with the END marker"
		if four {
			name = "4-frame replies carry the topic and end with the END marker"
		}
		t.Run(name, func(t *testing.T) {
			pub := kt.New(t, kt.Options{Replay: true, ReplayBuffer: 3, FourFrameReplies: four, Topic: "kv"})
			var payloads [][]byte
			for i := 0; i < 5; i++ {
				payloads = append(payloads, pub.Encode(kt.Removed(uint64(i))))
				pub.Withhold(kt.Removed(uint64(i)))
			}
			got := replay(t, pub, 1)
			if len(got) != 4 {
				t.Fatalf("%d replies, want 3 buffered batches (seq 2..4, the ring keeps 3) and END", len(got))
			}
			for i, frames := range got {
				want := 3
				if four {
					want = 4
				}
				if len(frames) != want || len(frames[0]) != 0 {
					t.Fatalf("reply %d = %q, want %d frames starting with an empty delimiter", i, frames, want)
				}
				if four && string(frames[1]) != "kv" {
					t.Errorf("reply %d topic = %q", i, frames[1])
				}
				seq, payload := seqOf(frames[len(frames)-2]), frames[len(frames)-1]
				if i == 3 {
					if seq != kt.EndSeq || len(payload) != 0 {
						t.Errorf("last reply = seq %x payload %q, want END", seq, payload)
					}
					continue
				}
				if seq != uint64(i+2) {
					t.Errorf("reply %d seq = %d, want %d", i, seq, i+2)
				}
				// Payloads differ only in their timestamp; compare the events part.
				if !bytes.Equal(payload[10:], payloads[i+2][10:]) {
					t.Errorf("reply %d payload differs from what was published", i)
				}
			}
			if r := pub.ReplayRequests(); len(r) != 1 || r[0] != 1 {
				t.Errorf("ReplayRequests = %v, want [1]", r)
			}
		})
	}
}

func TestPublisherRestartsAtTheSameAddress(t *testing.T) {
	pub := kt.New(t, kt.Options{Replay: true})
	ep, rep := pub.Endpoint(), pub.ReplayEndpoint()
	pub.Publish(kt.Cleared())
	pub.Restart()
	if pub.Endpoint() != ep || pub.ReplayEndpoint() != rep {
		t.Fatalf("endpoints moved: %s %s -> %s %s", ep, rep, pub.Endpoint(), pub.ReplayEndpoint())
	}
	if pub.NextSeq() != 0 {
		t.Errorf("NextSeq after restart = %d, want 0", pub.NextSeq())
	}
	if got := replay(t, pub, 0); len(got) != 1 {
		t.Errorf("replay after restart returned %d replies, want only END (the buffer is new)", len(got))
	}
	sub := subscribe(t, pub)
	pub.Publish(kt.Cleared())
	msg, err := sub.Recv()
	if err != nil || seqOf(msg.Frames[1]) != 0 {
		t.Fatalf("after restart got %q, %v; want seq 0", msg.Frames, err)
	}
}

func TestPublisherServesRepeatedReplayRequests(t *testing.T) {
	// Clients close their DEALER right after the END marker, which can make zmq4's ROUTER report
	// a send error for it; the publisher must keep serving.
	pub := kt.New(t, kt.Options{Replay: true})
	for i := 0; i < 5; i++ {
		pub.Withhold(kt.Cleared())
	}
	for i := 0; i < 100; i++ {
		if got := replay(t, pub, 2); len(got) != 4 {
			t.Fatalf("round %d: %d replies, want 3 batches and END", i, len(got))
		}
	}
}

// replayRaw sends a replay request from start and returns the first n replies.
func replayRaw(t *testing.T, endpoint string, start uint64, n int) [][][]byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	dealer := zmq4.NewDealer(ctx)
	defer dealer.Close()
	if err := dealer.Dial(endpoint); err != nil {
		t.Fatal(err)
	}
	var req [8]byte
	binary.BigEndian.PutUint64(req[:], start)
	if err := dealer.SendMulti(zmq4.NewMsgFrom([]byte{}, req[:])); err != nil {
		t.Fatal(err)
	}
	var out [][][]byte
	for len(out) < n {
		msg, err := dealer.Recv()
		if err != nil {
			t.Fatalf("replay receive: %v", err)
		}
		out = append(out, msg.Frames)
	}
	return out
}

func TestPublisherReplayVariants(t *testing.T) {
	tests := []struct {
		name      string
		opts      kt.Options
		wantCount int // replies to read: the buffered batch and the END, or the malformed reply
	}{
		{"END with a payload keeps the all-ones seq", kt.Options{Replay: true, ReplayEnd: kt.EndSeqOnly}, 2},
		{"END as an empty payload uses the next seq", kt.Options{Replay: true, ReplayEnd: kt.EndEmptyPayloadOnly}, 2},
		{"a malformed answer is one 2-frame reply", kt.Options{Replay: true, ReplayMalformed: true}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pub := kt.New(t, tt.opts)
			pub.Withhold(kt.Cleared())
			got := replayRaw(t, pub.ReplayEndpoint(), 0, tt.wantCount)
			last := got[len(got)-1]
			switch {
			case tt.opts.ReplayMalformed:
				if len(last) != 2 {
					t.Errorf("reply = %q, want 2 frames", last)
				}
			case tt.opts.ReplayEnd == kt.EndSeqOnly:
				if len(last) != 3 || seqOf(last[1]) != kt.EndSeq || len(last[2]) == 0 {
					t.Errorf("END = %q, want all-ones seq and a payload", last)
				}
			default:
				if len(last) != 3 || seqOf(last[1]) != 1 || len(last[2]) != 0 {
					t.Errorf("END = %q, want seq 1 and an empty payload", last)
				}
			}
		})
	}
}

func TestPublisherBindsTheRequestedAddresses(t *testing.T) {
	probe := kt.New(t, kt.Options{Replay: true})
	ep, rep := probe.Endpoint(), probe.ReplayEndpoint()
	probe.Close()
	pub := kt.New(t, kt.Options{Replay: true, Endpoint: ep, ReplayEndpoint: rep})
	if pub.Endpoint() != ep || pub.ReplayEndpoint() != rep {
		t.Fatalf("bound %s and %s, want %s and %s", pub.Endpoint(), pub.ReplayEndpoint(), ep, rep)
	}
	sub := subscribe(t, pub)
	pub.Publish(kt.Cleared())
	if msg, err := sub.Recv(); err != nil || seqOf(msg.Frames[1]) != 0 {
		t.Fatalf("got %q, %v", msg.Frames, err)
	}
	_ = sub.Close()
	pub.WaitForNoSubscriber()
}
