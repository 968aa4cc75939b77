// Package kveventstest provides a vLLM-format KV-event publisher for tests, in the spirit of
// net/http/httptest: New binds a ZeroMQ PUB socket (and optionally a ROUTER replay socket) on a
// free loopback port, tests publish batches built from Stored, Removed and Cleared events, and the
// code under test subscribes to Endpoint() exactly as it would to a vLLM engine
// (kv-events-index.md §5-§7).
//
// A typical test:
//
//	pub := kveventstest.New(t, kveventstest.Options{Replay: true})
//	// … attach a subscriber to pub.Endpoint() with replay endpoint pub.ReplayEndpoint() …
//	pub.Publish(kveventstest.Stored(nil, []uint64{11}, []uint32{1, 2, 3, 4}, 4))
//
// Sequence control: Publish numbers batches 0, 1, 2, …; PublishSeq sends an explicit sequence
// number; Withhold consumes a sequence number and keeps the batch for replay without sending it
// live, which is how a lost message looks to a subscriber. Restart closes and rebinds both
// sockets at the same addresses with the sequence back at 0 and an empty replay buffer, like a
// restarted engine.
//
// ZeroMQ's slow-joiner effect applies: a batch published before the subscriber's subscription has
// reached the publisher is lost for that subscriber. WaitForSubscriber blocks until a
// subscription has arrived.
package kveventstest

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

// EndSeq is the sequence number of the replay END marker (−1 as a signed 64-bit integer, §6).
const EndSeq = ^uint64(0)

// Options configures a Publisher. The zero value publishes 3-element batches with a nil
// data_parallel_rank, topic "", and no replay socket.
type Options struct {
	// Topic is the topic frame of every live message and of 4-frame replay replies.
	Topic string
	// DPRank is the data_parallel_rank sent in every batch; nil sends msgpack nil.
	DPRank *uint32
	// TwoElementBatches sends [ts, events] batches without the rank element.
	TwoElementBatches bool
	// Replay binds a ROUTER replay socket (§6) next to the PUB socket.
	Replay bool
	// ReplayBuffer is the number of most recent batches kept for replay (vLLM's buffer_steps);
	// 0 means 10000.
	ReplayBuffer int
	// FourFrameReplies answers replay requests with ["", topic, seq, payload] instead of
	// ["", seq, payload].
	FourFrameReplies bool
	// ReplayNoEnd never sends the END marker, so a client waits for its replay timeout.
	ReplayNoEnd bool
	// ReplayEnd selects how the END marker is encoded (default EndSeqAndEmptyPayload).
	ReplayEnd EndMarker
	// ReplayDelay delays every replay answer by this long (a slow publisher), so live batches
	// arrive while the subscriber's replay is in flight.
	ReplayDelay time.Duration
	// ReplayMalformed answers every replay request with a single 2-frame reply ["", seq] (after
	// the routing identity), which a client must treat as a failed replay (§6).
	ReplayMalformed bool
	// Endpoint and ReplayEndpoint are the addresses to bind, e.g. "tcp://127.0.0.1:6000" for a
	// data-parallel test that needs ports offset by rank; "" binds a free loopback port.
	Endpoint, ReplayEndpoint string
}

// EndMarker is the encoding of the replay END marker (kv-events-index.md §6: a client ends the
// replay on either the all-ones seq or an empty payload).
type EndMarker uint8

const (
	// EndSeqAndEmptyPayload sends seq ff…ff with an empty payload, as vLLM does.
	EndSeqAndEmptyPayload EndMarker = iota
	// EndSeqOnly sends seq ff…ff with a non-empty payload.
	EndSeqOnly
	// EndEmptyPayloadOnly sends an empty payload under the last replayed seq + 1 (0 if none).
	EndEmptyPayloadOnly
)

type ringEntry struct {
	seq     uint64
	payload []byte
}

// Publisher is a vLLM-format KV-event publisher bound on 127.0.0.1. All methods are safe for
// concurrent use. Failures to bind or send fail the test that created it.
type Publisher struct {
	t    testing.TB
	opts Options

	mu             sync.Mutex
	pub            zmq4.Socket
	router         zmq4.Socket
	cancel         context.CancelFunc
	routerDone     chan struct{}
	endpoint       string
	replayEndpoint string
	next           uint64
	ring           []ringEntry
	requests       []uint64
	closed         bool
}

var quietLogger = log.New(io.Discard, "", 0)

// New starts a publisher on free loopback ports and registers Close with t.Cleanup.
func New(t testing.TB, opts Options) *Publisher {
	t.Helper()
	if opts.ReplayBuffer <= 0 {
		opts.ReplayBuffer = 10000
	}
	p := &Publisher{t: t, opts: opts, endpoint: "tcp://127.0.0.1:0"}
	if opts.Endpoint != "" {
		p.endpoint = opts.Endpoint
	}
	if opts.Replay {
		p.replayEndpoint = "tcp://127.0.0.1:0"
		if opts.ReplayEndpoint != "" {
			p.replayEndpoint = opts.ReplayEndpoint
		}
	}
	if err := p.bind(); err != nil {
		t.Fatalf("kveventstest: %v", err)
	}
	t.Cleanup(p.Close)
	return p
}

// bind (re)creates the sockets at p.endpoint / p.replayEndpoint and records the bound addresses.
func (p *Publisher) bind() error {
	ctx, cancel := context.WithCancel(context.Background())
	pub := zmq4.NewPub(ctx, zmq4.WithLogger(quietLogger))
	if err := pub.Listen(p.endpoint); err != nil {
		cancel()
		return fmt.Errorf("bind PUB %s: %w", p.endpoint, err)
	}
	p.endpoint = "tcp://" + pub.Addr().(*net.TCPAddr).String()
	p.pub, p.cancel = pub, cancel
	if !p.opts.Replay {
		return nil
	}
	router := zmq4.NewRouter(ctx, zmq4.WithLogger(quietLogger))
	if err := router.Listen(p.replayEndpoint); err != nil {
		_ = pub.Close()
		cancel()
		return fmt.Errorf("bind ROUTER %s: %w", p.replayEndpoint, err)
	}
	p.replayEndpoint = "tcp://" + router.Addr().(*net.TCPAddr).String()
	p.router = router
	p.routerDone = make(chan struct{})
	go p.serveReplay(router, p.routerDone)
	return nil
}

// Endpoint returns the PUB address, "tcp://127.0.0.1:PORT".
func (p *Publisher) Endpoint() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.endpoint
}

// ReplayEndpoint returns the ROUTER replay address, or "" without Options.Replay.
func (p *Publisher) ReplayEndpoint() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.replayEndpoint
}

// NextSeq returns the sequence number the next Publish will use.
func (p *Publisher) NextSeq() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.next
}

// ReplayRequests returns the start sequence numbers of the replay requests served so far since
// New or the last Restart, in arrival order.
func (p *Publisher) ReplayRequests() []uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]uint64(nil), p.requests...)
}

// Encode returns the MessagePack payload Publish would send for events under p's options.
func (p *Publisher) Encode(events ...Event) []byte {
	return Batch{
		TS:          float64(time.Now().UnixNano()) / 1e9,
		DPRank:      p.opts.DPRank,
		TwoElements: p.opts.TwoElementBatches,
		Events:      events,
	}.Encode()
}

// Publish sends one batch of events with the next sequence number and returns that number.
func (p *Publisher) Publish(events ...Event) uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.next
	p.sendLocked(seq, p.Encode(events...), true)
	return seq
}

// PublishSeq sends one batch with sequence number seq (for gap and stale tests); the next
// Publish uses seq+1.
func (p *Publisher) PublishSeq(seq uint64, events ...Event) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sendLocked(seq, p.Encode(events...), true)
}

// PublishPayload sends an arbitrary payload (e.g. invalid MessagePack) with the next sequence
// number and returns that number.
func (p *Publisher) PublishPayload(payload []byte) uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.next
	p.sendLocked(seq, payload, true)
	return seq
}

// Withhold consumes the next sequence number for a batch of events and keeps it in the replay
// buffer without sending it live (a message lost on the way), returning that number.
func (p *Publisher) Withhold(events ...Event) uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.next
	p.sendLocked(seq, p.Encode(events...), false)
	return seq
}

// PublishFrames sends an arbitrary multipart message (for malformed-frame tests); it consumes
// no sequence number and is not kept for replay.
func (p *Publisher) PublishFrames(frames ...[]byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.t.Errorf("kveventstest: PublishFrames after Close")
		return
	}
	if err := p.pub.SendMulti(zmq4.NewMsgFrom(frames...)); err != nil {
		p.t.Errorf("kveventstest: send: %v", err)
	}
}

func (p *Publisher) sendLocked(seq uint64, payload []byte, live bool) {
	if p.closed {
		p.t.Errorf("kveventstest: publish after Close")
		return
	}
	p.next = seq + 1
	if p.opts.Replay {
		p.ring = append(p.ring, ringEntry{seq: seq, payload: payload})
		if over := len(p.ring) - p.opts.ReplayBuffer; over > 0 {
			p.ring = append(p.ring[:0], p.ring[over:]...)
		}
	}
	if !live {
		return
	}
	var seqFrame [8]byte
	binary.BigEndian.PutUint64(seqFrame[:], seq)
	if err := p.pub.SendMulti(zmq4.NewMsgFrom([]byte(p.opts.Topic), seqFrame[:], payload)); err != nil {
		p.t.Errorf("kveventstest: send seq %d: %v", seq, err)
	}
}

// WaitForSubscriber blocks until at least one subscriber's subscription has reached the PUB
// socket (so the next Publish is delivered to it) and fails the test after 10 s.
func (p *Publisher) WaitForSubscriber() {
	p.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		p.mu.Lock()
		var n int
		if tp, ok := p.pub.(zmq4.Topics); ok && !p.closed {
			n = len(tp.Topics())
		}
		p.mu.Unlock()
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("kveventstest: no subscriber on %s after 10s", p.Endpoint())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// WaitForNoSubscriber blocks until no subscription is registered on the PUB socket any more
// (every subscriber has disconnected) and fails the test after 10 s. Tests that detach and
// re-attach a subscriber use it so that WaitForSubscriber then sees the new subscription.
func (p *Publisher) WaitForNoSubscriber() {
	p.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		p.mu.Lock()
		n := 0
		if tp, ok := p.pub.(zmq4.Topics); ok && !p.closed {
			n = len(tp.Topics())
		}
		p.mu.Unlock()
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("kveventstest: %s still has a subscriber after 10s", p.Endpoint())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Restart closes both sockets and binds them again at the same addresses, with the sequence
// number back at 0 and an empty replay buffer, like an engine process that restarted. Connected
// subscribers see their connection drop and must re-dial.
func (p *Publisher) Restart() {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.t.Fatalf("kveventstest: Restart after Close")
	}
	p.closeSocketsLocked()
	p.next, p.ring, p.requests = 0, nil, nil
	var err error
	for attempt := 0; attempt < 50; attempt++ {
		if err = p.bind(); err == nil {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	p.t.Fatalf("kveventstest: restart: %v", err)
}

// Close closes the sockets. It is idempotent and registered with t.Cleanup by New.
func (p *Publisher) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	p.closed = true
	p.closeSocketsLocked()
}

func (p *Publisher) closeSocketsLocked() {
	_ = p.pub.Close()
	if p.router != nil {
		_ = p.router.Close()
	}
	p.cancel()
	if p.routerDone != nil {
		// The serve goroutine takes p.mu to read the ring; release it while waiting.
		done := p.routerDone
		p.routerDone, p.router = nil, nil
		p.mu.Unlock()
		<-done
		p.mu.Lock()
	}
}

// serveReplay answers replay requests [identity, "", start_seq] on router until it is closed.
func (p *Publisher) serveReplay(router zmq4.Socket, done chan struct{}) {
	defer close(done)
	for {
		msg, err := router.Recv()
		if err != nil {
			return
		}
		frames := msg.Frames
		var start []byte
		switch {
		case len(frames) == 3 && len(frames[1]) == 0:
			start = frames[2]
		case len(frames) == 2:
			start = frames[1]
		}
		if len(start) != 8 {
			continue
		}
		id := frames[0]
		from := binary.BigEndian.Uint64(start)
		p.mu.Lock()
		p.requests = append(p.requests, from)
		var entries []ringEntry
		for _, e := range p.ring {
			if e.seq >= from {
				entries = append(entries, e)
			}
		}
		p.mu.Unlock()
		p.answer(router, id, entries)
	}
}

// answer sends the replies of one replay request. A send error ends this answer only: zmq4's
// ROUTER may report one for the END marker when the client closes its DEALER right after
// receiving it, and the next request must still be served.
func (p *Publisher) answer(router zmq4.Socket, id []byte, entries []ringEntry) {
	if p.opts.ReplayDelay > 0 {
		time.Sleep(p.opts.ReplayDelay)
	}
	if p.opts.ReplayMalformed {
		var seqFrame [8]byte
		_ = router.SendMulti(zmq4.NewMsgFrom(id, []byte{}, seqFrame[:]))
		return
	}
	next := uint64(0)
	for _, e := range entries {
		if router.SendMulti(p.reply(id, e.seq, e.payload)) != nil {
			return
		}
		next = e.seq + 1
	}
	if p.opts.ReplayNoEnd {
		return
	}
	switch p.opts.ReplayEnd {
	case EndSeqOnly:
		_ = router.SendMulti(p.reply(id, EndSeq, []byte("end")))
	case EndEmptyPayloadOnly:
		_ = router.SendMulti(p.reply(id, next, []byte{}))
	default:
		_ = router.SendMulti(p.reply(id, EndSeq, []byte{}))
	}
}

func (p *Publisher) reply(id []byte, seq uint64, payload []byte) zmq4.Msg {
	var seqFrame [8]byte
	binary.BigEndian.PutUint64(seqFrame[:], seq)
	if p.opts.FourFrameReplies {
		return zmq4.NewMsgFrom(id, []byte{}, []byte(p.opts.Topic), seqFrame[:], payload)
	}
	return zmq4.NewMsgFrom(id, []byte{}, seqFrame[:], payload)
}
