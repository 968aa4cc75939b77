package replica

import (
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/kvepp/kvepp/internal/zmqtcp"
	"github.com/kvepp/kvepp/internal/zmqtcp/zmqtcptest"
)

// TestAHostileSubscriberIsDisconnectedAndThePeersKeepReceiving sends the sync port a frame header
// declaring 1 TiB (without the frame bound zmq4 allocates it and the process aborts): the
// connection is closed, and a real peer linked afterwards still receives.
func TestAHostileSubscriberIsDisconnectedAndThePeersKeepReceiving(t *testing.T) {
	a := newManager(t, 1)
	// 1 TiB would abort the process; 8 KiB is more than a subscriber ever sends (it would let
	// each connection pin memory with a half-sent frame).
	for _, size := range []uint64{1 << 40, 8 << 10} {
		before := zmqtcp.OversizedFrames()
		raw, err := net.Dial("tcp", a.Addr())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := raw.Write(zmqtcptest.Oversized(size)); err != nil {
			t.Fatal(err)
		}
		_ = raw.SetReadDeadline(time.Now().Add(deadline))
		if _, err := io.Copy(io.Discard, raw); err != nil {
			t.Fatalf("the connection declaring %d bytes was not closed: %v", size, err)
		}
		raw.Close()
		if zmqtcp.OversizedFrames() == before {
			t.Fatalf("the %d-byte frame was not counted", size)
		}
	}
	fb := &fakeApplier{}
	b := newManager(t, 2, func(c *Config) { c.Peers = []string{endpoint(a)} })
	if err := b.Start(fb); err != nil {
		t.Fatal(err)
	}
	link(t, a, fb)
}

// TestAHostilePeerIsNotFollowed points a replica at a "peer" that declares a 1 TiB frame: the
// replica stays up, counts the frame and keeps retrying, as for any peer that is not reachable.
func TestAHostilePeerIsNotFollowed(t *testing.T) {
	before := zmqtcp.OversizedFrames()
	b := newManager(t, 2, func(c *Config) { c.Peers = []string{"tcp://" + zmqtcptest.ServeOversized(t, 1<<40)} })
	if err := b.Start(&fakeApplier{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the oversized frame to be refused", func() bool { return zmqtcp.OversizedFrames() > before })
	if st := b.Stats(); st.PeersConnected != 0 {
		t.Fatalf("connected to the hostile peer: %+v", st)
	}
}

// TestASubscriberWithTooManyTopicsIsDisconnected: a subscriber asking for more topics than a
// replica ever does is closed, so it cannot pin memory (or slow every publish) with thousands.
func TestASubscriberWithTooManyTopicsIsDisconnected(t *testing.T) {
	a := newManager(t, 1)
	raw, err := net.Dial("tcp", a.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	sub, err := zmq4.Open(raw, null.Security(), zmq4.Sub, zmq4.SocketIdentity(""), false, nil)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the subscriber", func() bool { return a.Stats().Subscribers == 1 })
	for i := 0; i <= maxSubscriptions; i++ {
		if err := sub.SendMsg(zmq4.NewMsg(append([]byte{1}, fmt.Sprintf("topic-%d", i)...))); err != nil {
			break // the publisher may already have closed it
		}
	}
	eventually(t, "the subscriber to be dropped", func() bool { return a.Stats().Subscribers == 0 })
}

// TestOneAddressCannotTakeEveryConnectionSlot: connections from one address beyond
// maxSubscribersPerHost are closed at once, so idle connections from one place cannot lock the
// replicas out of the PUB socket.
func TestOneAddressCannotTakeEveryConnectionSlot(t *testing.T) {
	a := newManager(t, 1)
	var conns []net.Conn
	for i := 0; i <= maxSubscribersPerHost; i++ {
		c, err := net.Dial("tcp", a.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		conns = append(conns, c)
	}
	// The admitted ones get a greeting (and then wait out the 5 s handshake timeout); the one over
	// the share is closed at once, without one.
	closed := 0
	for _, c := range conns {
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		if _, err := c.Read(make([]byte, 64)); errors.Is(err, io.EOF) {
			closed++
		}
	}
	if closed != 1 {
		t.Fatalf("%d of %d connections from one address were closed, want 1", closed, len(conns))
	}
}
