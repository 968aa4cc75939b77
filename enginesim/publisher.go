package enginesim

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"

	"github.com/go-zeromq/zmq4"
)

// pubHWM is the PUB queue limit, vLLM's default hwm (kv-events-index.md §5.1).
const pubHWM = 100000

// publisher owns a worker's ZMQ PUB socket (live events, §5) and ROUTER socket
// (replay, §6) and the ring of the last batches.
type publisher struct {
	pub    zmq4.Socket
	router zmq4.Socket
	cancel context.CancelFunc

	pubEndpoint    string
	replayEndpoint string

	mu      sync.Mutex
	closed  bool
	nextSeq uint64
	ring    []ringEntry // circular, len ≤ cap
	head    int         // index of the oldest entry when full
	cap     int

	done chan struct{} // closed when the replay loop exits
}

type ringEntry struct {
	seq     uint64
	payload []byte
}

// newPublisher binds the PUB socket at pubAddr and the ROUTER socket at
// replayAddr (both "tcp://host:port", port 0 picks a free port) and starts the
// replay loop. ringSize is the number of batches kept for replay.
func newPublisher(pubAddr, replayAddr string, ringSize int) (*publisher, error) {
	ctx, cancel := context.WithCancel(context.Background())
	p := &publisher{cancel: cancel, cap: ringSize, done: make(chan struct{})}
	p.pub = zmq4.NewPub(ctx)
	if err := p.pub.SetOption(zmq4.OptionHWM, pubHWM); err != nil {
		cancel()
		_ = p.pub.Close()
		return nil, fmt.Errorf("set PUB hwm: %w", err)
	}
	if err := p.pub.Listen(pubAddr); err != nil {
		cancel()
		_ = p.pub.Close()
		return nil, fmt.Errorf("listen for kv events on %q: %w", pubAddr, err)
	}
	p.router = zmq4.NewRouter(ctx)
	if err := p.router.Listen(replayAddr); err != nil {
		cancel()
		_ = p.pub.Close()
		_ = p.router.Close()
		return nil, fmt.Errorf("listen for replay on %q: %w", replayAddr, err)
	}
	p.pubEndpoint = tcpEndpoint(p.pub.Addr())
	p.replayEndpoint = tcpEndpoint(p.router.Addr())
	go p.replayLoop()
	return p, nil
}

func tcpEndpoint(a net.Addr) string {
	if a == nil {
		return ""
	}
	return "tcp://" + a.String()
}

// publish encodes one batch, assigns it the next sequence number, keeps it for
// replay and sends it as [topic "", seq, payload]. It returns the sequence
// number. Publishing after close is a no-op that returns an error.
func (p *publisher) publish(ts float64, events []Event) (uint64, error) {
	payload, err := EncodeBatch(nil, ts, events, 0)
	if err != nil {
		return 0, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, errPublisherClosed
	}
	seq := p.nextSeq
	p.nextSeq++
	if p.cap > 0 {
		e := ringEntry{seq: seq, payload: payload}
		if len(p.ring) < p.cap {
			p.ring = append(p.ring, e)
		} else {
			p.ring[p.head] = e
			p.head = (p.head + 1) % p.cap
		}
	}
	// The PUB queue never blocks (unbounded up to the hwm, then drops like libzmq).
	if err := p.pub.SendMulti(zmq4.NewMsgFrom([]byte{}, SeqFrame(seq), payload)); err != nil {
		return seq, fmt.Errorf("publish kv event batch seq %d: %w", seq, err)
	}
	return seq, nil
}

var errPublisherClosed = errors.New("kv event publisher is closed")

// buffered returns the kept batches with seq ≥ start, oldest first.
func (p *publisher) buffered(start uint64) []ringEntry {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []ringEntry
	n := len(p.ring)
	for i := 0; i < n; i++ {
		e := p.ring[(p.head+i)%n]
		if e.seq >= start {
			out = append(out, e)
		}
	}
	return out
}

// sequence returns the number of batches published so far (the next seq).
func (p *publisher) sequence() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.nextSeq
}

// hasSubscriber reports whether at least one SUB connection has subscribed.
func (p *publisher) hasSubscriber() bool {
	t, ok := p.pub.(zmq4.Topics)
	return ok && len(t.Topics()) > 0
}

// replayLoop answers DEALER requests [identity, "", start_seq] with
// [identity, "", seq, payload] per buffered batch with seq ≥ start_seq, then the
// end marker [identity, "", EndSeq, ""] (§6). Malformed requests are ignored.
func (p *publisher) replayLoop() {
	defer close(p.done)
	for {
		msg, err := p.router.Recv()
		if err != nil {
			return // socket closed
		}
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 0 || len(msg.Frames[2]) != 8 {
			continue
		}
		id := msg.Frames[0]
		start := binary.BigEndian.Uint64(msg.Frames[2])
		for _, e := range p.buffered(start) {
			if err := p.router.SendMulti(zmq4.NewMsgFrom(id, []byte{}, SeqFrame(e.seq), e.payload)); err != nil {
				break
			}
		}
		_ = p.router.SendMulti(zmq4.NewMsgFrom(id, []byte{}, SeqFrame(EndSeq), []byte{}))
	}
}

// close stops publishing, closes both sockets and waits for the replay loop.
func (p *publisher) close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	err := errors.Join(ignoreClosed(p.pub.Close()), ignoreClosed(p.router.Close()))
	p.cancel()
	<-p.done
	return err
}

// ignoreClosed drops the error of closing a connection that a peer's
// disconnect already closed (zmq4 keeps such connections listed until its
// reaper runs); it is not a shutdown failure.
func ignoreClosed(err error) error {
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}
