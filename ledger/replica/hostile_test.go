package replica

import (
	"io"
	"net"
	"testing"
	"time"

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
