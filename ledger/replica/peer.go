package replica

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvepp/kvepp/internal/zmqtcp"
)

// peer is one registered peer PUB endpoint and, once the manager started, the goroutine that
// keeps a SUB connected to it.
type peer struct {
	endpoint  string
	cancel    context.CancelFunc
	done      chan struct{}
	connected atomic.Bool

	mu      sync.Mutex
	origins map[uint64]struct{} // router_ids whose slot events arrived through this peer
}

// noteOrigin remembers that origin's slot events arrive through p.
func (p *peer) noteOrigin(origin uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.origins == nil {
		p.origins = map[uint64]struct{}{}
	}
	p.origins[origin] = struct{}{}
}

// seenOrigins returns the router_ids noted by noteOrigin.
func (p *peer) seenOrigins() []uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]uint64, 0, len(p.origins))
	for o := range p.origins {
		out = append(out, o)
	}
	return out
}

// stop ends the peer's goroutine (if it runs) and waits for it; its socket is closed on return.
func (p *peer) stop() {
	if p.cancel != nil {
		p.cancel()
		<-p.done
	}
}

// startPeer starts p's SUB goroutine. Caller holds m.mu.
func (m *Manager) startPeer(p *peer) {
	ctx, cancel := context.WithCancel(m.ctx)
	p.cancel, p.done = cancel, make(chan struct{})
	go m.runPeer(ctx, p)
}

// runPeer dials the peer, receives until the connection drops, and re-dials with backoff
// (100 ms doubling to 5 s, §15.1) until the peer is deregistered or the manager closes. zmq4
// reports a lost connection as an error rather than reconnecting.
func (m *Manager) runPeer(ctx context.Context, p *peer) {
	defer close(p.done)
	lg := m.log.With().Str("peer", p.endpoint).Logger()
	backoff := m.cfg.ReconnectMin
	for attempt := 0; ; attempt++ {
		sock, err := m.dialPeer(ctx, p.endpoint)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			ev := lg.Debug()
			if attempt == 0 {
				ev = lg.Info()
			}
			ev.Err(err).Dur("retry_in", backoff).Msg("replica peer not reachable yet")
			if !sleep(ctx, backoff) {
				return
			}
			backoff = min(backoff*2, m.cfg.ReconnectMax)
			continue
		}
		p.connected.Store(true)
		m.connected.Add(1)
		lg.Info().Msg("replica peer connected")
		attempt, backoff = 0, m.cfg.ReconnectMin
		var last uint64 // the origin noted last: a peer normally carries one
		for {
			msg, rerr := sock.Recv()
			if rerr != nil {
				err = rerr
				break
			}
			if msg.Type == zmq4.CmdMsg {
				continue
			}
			if o := m.receive(msg.Frames); o != 0 && o != last {
				p.noteOrigin(o)
				last = o
			}
		}
		p.connected.Store(false)
		m.connected.Add(-1)
		_ = sock.Close()
		if ctx.Err() != nil {
			return
		}
		lg.Warn().Err(err).Dur("retry_in", backoff).Msg("replica peer connection lost; re-dialling")
		if !sleep(ctx, backoff) {
			return
		}
	}
}

// dialPeer connects a SUB subscribed to both replica topics.
func (m *Manager) dialPeer(ctx context.Context, ep string) (zmq4.Socket, error) {
	sock := zmq4.NewSub(ctx, zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(m.cfg.DialTimeout), zmq4.WithLogger(quietZMQ))
	err := errors.Join(sock.SetOption(zmq4.OptionSubscribe, TopicSlotTracker), sock.SetOption(zmq4.OptionSubscribe, TopicSessionAffinity))
	if err == nil {
		err = sock.Dial(zmqtcp.Endpoint(ep))
	}
	if err != nil {
		_ = sock.Close()
		return nil, zmqtcp.PlainError(err)
	}
	return sock, nil
}

// sleep waits d or until ctx ends; it reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
