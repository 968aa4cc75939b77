package zmqtcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvepp/kvepp/internal/zmqtcp/zmqtcptest"
)

// zmtpStream is a greeting and frames of the given body sizes (short and long headers).
func zmtpStream(sizes ...int) []byte {
	out := append([]byte(nil), zmqtcptest.Oversized(0)[:64]...)
	for i, n := range sizes {
		body := bytes.Repeat([]byte{byte(i + 1)}, n)
		if n <= 255 && i%2 == 0 {
			out = append(out, 0x00, byte(n))
		} else {
			out = append(out, flagLong)
			out = binary.BigEndian.AppendUint64(out, uint64(n))
		}
		out = append(out, body...)
	}
	return out
}

// readThrough reads stream through a guardedConn in random-sized pieces and returns what came out.
func readThrough(t *testing.T, stream []byte, seed uint64) ([]byte, error) {
	t.Helper()
	client, server := net.Pipe()
	defer client.Close()
	go func() {
		r := rand.New(rand.NewPCG(seed, 1))
		for rest := stream; len(rest) > 0; {
			k := min(1+r.IntN(40), len(rest))
			if _, err := server.Write(rest[:k]); err != nil {
				return
			}
			rest = rest[k:]
		}
		server.Close()
	}()
	g := LimitFrames(client)
	var out []byte
	buf := make([]byte, 7)
	for {
		n, err := g.Read(buf)
		out = append(out, buf[:n]...)
		if err != nil {
			if err == io.EOF {
				return out, nil
			}
			return out, err
		}
	}
}

func TestFramesWithinTheLimitPassUnchanged(t *testing.T) {
	old := maxFrameBytes
	maxFrameBytes = 300
	defer func() { maxFrameBytes = old }()
	stream := zmtpStream(0, 5, 255, 300, 1, 0, 299)
	for seed := range uint64(20) {
		got, err := readThrough(t, stream, seed)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if !bytes.Equal(got, stream) {
			t.Fatalf("seed %d: the stream changed on the way through", seed)
		}
	}
}

func TestAnOversizedFrameClosesTheConnection(t *testing.T) {
	old := maxFrameBytes
	maxFrameBytes = 300
	defer func() { maxFrameBytes = old }()
	before := OversizedFrames()
	// Two good frames, then one of 301 bytes declared with a long header (split across reads).
	stream := append(zmtpStream(10, 300), 0x01|flagLong)
	stream = binary.BigEndian.AppendUint64(stream, 301)
	for seed := range uint64(10) {
		got, err := readThrough(t, stream, seed)
		if err == nil || !errors.Is(err, io.EOF) || !strings.Contains(err.Error(), "301-byte frame") {
			t.Fatalf("seed %d: error %v, want the oversized frame reported as io.EOF", seed, err)
		}
		if len(got) >= len(stream) {
			t.Fatalf("seed %d: the oversized header reached the reader", seed)
		}
	}
	if OversizedFrames()-before != 10 {
		t.Fatalf("OversizedFrames grew by %d, want 10", OversizedFrames()-before)
	}
}

// TestADialToAHostilePublisherFails is the crash the bound prevents: without it zmq4 allocates the
// declared 1 TiB and the Go runtime aborts the process.
func TestADialToAHostilePublisherFails(t *testing.T) {
	before := OversizedFrames()
	addr := zmqtcptest.ServeOversized(t, 1<<40)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sub := zmq4.NewSub(ctx, zmq4.WithDialerMaxRetries(0))
	defer sub.Close()
	if err := sub.Dial(Endpoint("tcp://" + addr)); err == nil {
		t.Fatal("dial to a peer declaring a 1 TiB frame succeeded")
	}
	if OversizedFrames() == before {
		t.Fatal("the oversized frame was not counted")
	}
}

func TestAMessageOfEndlessPartsClosesTheConnection(t *testing.T) {
	stream := zmtpStream()
	for i := 0; i <= MaxMessageFrames; i++ {
		stream = append(stream, flagMore, 0) // an empty part with more to follow
	}
	got, err := readThrough(t, stream, 1)
	if err == nil || !errors.Is(err, io.EOF) || !strings.Contains(err.Error(), "parts") {
		t.Fatalf("error %v after %d bytes, want the endless message refused", err, len(got))
	}
	// The same number of parts spread over messages passes, and so do commands.
	stream = zmtpStream()
	for i := 0; i < 3*MaxMessageFrames; i++ {
		stream = append(stream, flagMore, 0, 0, 0, flagCommand, 0)
	}
	if got, err := readThrough(t, stream, 2); err != nil || !bytes.Equal(got, stream) {
		t.Fatalf("short messages and commands: %v", err)
	}
}
