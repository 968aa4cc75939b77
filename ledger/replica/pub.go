package replica

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/kvepp/kvepp/internal/zmqtcp"
)

// Bounds of the PUB socket.
const (
	// subscriberQueue is how many messages may wait for one subscriber (as many as the outbound
	// queue holds, so a burst the sender accepted reaches a live peer); beyond it that subscriber
	// misses the newest (DropSubscriberFull) and the others are unaffected. Memory grows with the
	// messages waiting, not with the bound.
	subscriberQueue = DefaultOutboundCapacity
	// subscriberFrameBytes bounds what a subscriber may send in one frame or message: it sends
	// only its greeting, handshake commands and subscriptions (a topic prefix each).
	subscriberFrameBytes = 4096
	// maxSubscriptions bounds one subscriber's topics (a replica subscribes to two); a further
	// subscription closes the connection, so no subscriber holds memory, or slows every publish,
	// with thousands of topics.
	maxSubscriptions = 16
	// maxSubscribersPerHost bounds the connections from one IP address (a replica opens one;
	// several replicas on one host, as in tests and on one machine, open one each).
	maxSubscribersPerHost = 32
	// maxSubscribers bounds the connected subscribers (each holds a queue and a goroutine);
	// further connections are closed at once.
	maxSubscribers = 1024
	// handshakeTimeout bounds a new connection's ZMTP greeting and handshake.
	handshakeTimeout = 5 * time.Second
)

// subscriberQueueLimit is the bound in force (tests shorten it before building a Manager).
var subscriberQueueLimit = subscriberQueue

const (
	// writeTimeout bounds one write to a subscriber (the 15 s heartbeat timeout of
	// selection-service.md §15.1); a subscriber that does not read is disconnected.
	writeTimeout = 15 * time.Second
)

// publisher is a ZeroMQ PUB socket (ZMTP 3.0 over TCP, NULL security, through zmq4's connection
// layer) that gives each subscriber its own bounded queue and writer, as libzmq does with its
// per-pipe high-water mark: a slow, stopped or vanished subscriber loses messages (counted) or is
// disconnected, and never delays the others. zmq4's own PUB socket writes to every subscriber in
// turn from one goroutine and drops silently at its high-water mark.
type publisher struct {
	ln     net.Listener
	onDrop func() // one message not queued for one subscriber

	mu     sync.Mutex
	subs   map[*subscriber]struct{}
	closed bool
	wg     sync.WaitGroup
	count  atomic.Int64
	served int            // connections being served, handshaking or subscribed (guarded by mu)
	perIP  map[string]int // of those, by remote address (guarded by mu)
}

// subscriber is one connected SUB socket.
type subscriber struct {
	raw  net.Conn
	conn *zmq4.Conn
	q    *fifo[zmq4.Msg]
	done chan struct{}
	once sync.Once

	mu     sync.RWMutex
	topics map[string]struct{} // subscribed prefixes
}

// listenPub binds a PUB socket on a tcp:// endpoint ("*" host = all interfaces, port 0 =
// ephemeral).
func listenPub(ep string, onDrop func()) (*publisher, error) {
	addr, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return nil, fmt.Errorf("replica sync binds tcp:// endpoints only, got %q", ep)
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	if host == "*" {
		host = ""
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(strings.Trim(host, "[]"), port))
	if err != nil {
		return nil, err
	}
	p := &publisher{ln: ln, onDrop: onDrop, subs: map[*subscriber]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// addr returns the bound address ("host:port").
func (p *publisher) addr() string { return p.ln.Addr().String() }

// subscribers returns the number of connected subscribers.
func (p *publisher) subscribers() int { return int(p.count.Load()) }

func (p *publisher) accept() {
	defer p.wg.Done()
	for {
		raw, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // e.g. out of file descriptors: try again shortly
			continue
		}
		p.wg.Add(1)
		go p.serve(raw)
	}
}

// serve performs the handshake and runs the subscriber until it or the socket closes.
func (p *publisher) serve(raw net.Conn) {
	defer p.wg.Done()
	host, ok := p.admit(raw)
	if !ok {
		_ = raw.Close()
		return
	}
	defer p.leave(host)
	_ = raw.SetDeadline(time.Now().Add(handshakeTimeout))
	conn, err := zmq4.Open(zmqtcp.LimitFramesTo(raw, subscriberFrameBytes), null.Security(), zmq4.Pub, zmq4.SocketIdentity(""), true, nil)
	if err != nil {
		_ = raw.Close()
		return
	}
	_ = raw.SetDeadline(time.Time{})
	s := &subscriber{raw: raw, conn: conn, q: newFIFO[zmq4.Msg](subscriberQueueLimit), done: make(chan struct{}),
		topics: map[string]struct{}{}}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		_ = raw.Close()
		return
	}
	p.subs[s] = struct{}{}
	p.count.Add(1)
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.subs, s)
		p.count.Add(-1)
		p.mu.Unlock()
	}()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		s.readSubscriptions()
	}()
	var batch []zmq4.Msg
	for {
		select {
		case <-s.done:
			return
		case <-s.q.wake:
		}
		for batch = s.q.swap(batch); len(batch) > 0; batch = s.q.swap(batch) {
			for _, msg := range batch {
				_ = raw.SetWriteDeadline(time.Now().Add(writeTimeout))
				if err := conn.SendMsg(msg); err != nil {
					s.close()
					return
				}
			}
		}
	}
}

// readSubscriptions applies the subscriber's (un)subscribe messages until its connection ends.
func (s *subscriber) readSubscriptions() {
	defer s.close()
	for {
		msg, err := s.conn.RecvMsg()
		if err != nil {
			return
		}
		if msg.Type == zmq4.CmdMsg || len(msg.Frames) != 1 || len(msg.Frames[0]) == 0 {
			continue
		}
		f := msg.Frames[0]
		s.mu.Lock()
		switch f[0] {
		case 1:
			if _, known := s.topics[string(f[1:])]; !known && len(s.topics) >= maxSubscriptions {
				s.mu.Unlock()
				return // a subscriber that wants more topics than there are is not a replica
			}
			s.topics[string(f[1:])] = struct{}{}
		case 0:
			delete(s.topics, string(f[1:]))
		}
		s.mu.Unlock()
	}
}

// subscribed reports whether the subscriber wants topic (ZMQ prefix matching).
func (s *subscriber) subscribed(topic []byte) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for prefix := range s.topics {
		if strings.HasPrefix(string(topic), prefix) {
			return true
		}
	}
	return false
}

func (s *subscriber) close() {
	s.once.Do(func() {
		close(s.done)
		_ = s.raw.Close()
	})
}

// publish queues [topic, payload] for every subscriber of topic without blocking; a subscriber
// whose queue is full misses it (onDrop).
func (p *publisher) publish(topic, payload []byte) {
	msg := zmq4.NewMsgFrom(topic, payload)
	p.mu.Lock()
	defer p.mu.Unlock()
	for s := range p.subs {
		if !s.subscribed(topic) {
			continue
		}
		if s.q.push(msg) != pushed {
			p.onDrop()
		}
	}
}

// close stops accepting, disconnects every subscriber and waits for their goroutines.
func (p *publisher) close() error {
	p.mu.Lock()
	p.closed = true
	for s := range p.subs {
		s.close()
	}
	p.mu.Unlock()
	err := p.ln.Close()
	p.wg.Wait()
	return err
}

// remoteHost is the IP address a connection comes from ("" when it has none).
func remoteHost(c net.Conn) string {
	host, _, err := net.SplitHostPort(c.RemoteAddr().String())
	if err != nil {
		return ""
	}
	return host
}

// admit counts c among the connections being served and returns its address, reporting false
// when maxSubscribers are served or its address has maxSubscribersPerHost of them: a replica
// opens one per peer, so idle connections from one place cannot fill every slot and lock the
// real replicas out.
func (p *publisher) admit(c net.Conn) (host string, ok bool) {
	host = remoteHost(c)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.served >= maxSubscribers || p.perIP[host] >= maxSubscribersPerHost {
		return host, false
	}
	if p.perIP == nil {
		p.perIP = map[string]int{}
	}
	p.served++
	p.perIP[host]++
	return host, true
}

// leave undoes admit for a connection from host.
func (p *publisher) leave(host string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.served--
	if p.perIP[host]--; p.perIP[host] <= 0 {
		delete(p.perIP, host)
	}
}
