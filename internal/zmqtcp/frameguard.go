package zmqtcp

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync/atomic"
)

// MaxFrameBytes bounds one ZMTP frame, and one message, a peer may send (16 MiB), the equivalent of libzmq's
// ZMQ_MAXMSGSIZE. zmq4 allocates a frame's whole declared size before it reads the body, so
// without a bound a single 9-byte frame header from any peer (a hostile subscriber on the
// replica-sync port, a hostile KV-event publisher or replica-sync peer) makes the process allocate
// up to 2^63 bytes and abort. The largest legitimate message is far smaller: a vLLM KV-event
// batch for one engine step of 16,384 batched tokens is about 100 KB, a replica-sync booking of a
// 128k-token prompt about 80 KB.
const MaxFrameBytes = 16 << 20

// maxFrameBytes is the bound in force (tests lower it).
var maxFrameBytes uint64 = MaxFrameBytes

// oversizedFrames counts connections closed because a frame header declared more than
// MaxFrameBytes.
var oversizedFrames atomic.Uint64

// OversizedFrames returns how many connections this process closed because their peer declared
// a frame or a message larger than MaxFrameBytes, or a message of more than MaxMessageFrames
// parts (the metric kvepp_zmq_oversized_frames_total).
func OversizedFrames() uint64 { return oversizedFrames.Load() }

// greetingBytes is the length of the ZMTP 3.x greeting that precedes the first frame.
const greetingBytes = 64

// Frame flags (ZMTP 3.x, 23/ZMTP §"Framing"): bit 0 marks a message part with more to follow,
// bit 1 an 8-byte size, bit 2 a command.
const (
	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
)

// MaxMessageFrames bounds the frames of one message (KV events have 3, replica-sync messages 2):
// zmq4 keeps every part of a message until its last, so a stream of empty parts that never ends
// would grow memory without bound.
const MaxMessageFrames = 64

// LimitFrames wraps an accepted or dialled connection so that reading a ZMTP frame header that
// declares more than MaxFrameBytes closes the connection and reports an error wrapping io.EOF
// (which zmq4 treats as a closed connection) before zmq4 sees the size. Connections made through
// this package's transport are already wrapped; use it for connections handed to zmq4.Open
// directly.
func LimitFrames(c net.Conn) net.Conn { return LimitFramesTo(c, maxFrameBytes) }

// LimitFramesTo is LimitFrames with a bound of max bytes per frame and per message, for a
// connection whose peer has less to say: a PUB socket's subscribers send only subscriptions, so
// it accepts a few KiB, and a subscriber holding a large half-sent frame cannot pin 16 MiB per
// connection.
func LimitFramesTo(c net.Conn, max uint64) net.Conn {
	if g, ok := c.(*guardedConn); ok {
		return g
	}
	return &guardedConn{Conn: c, greeting: greetingBytes, max: max}
}

// guardedConn follows the ZMTP framing of the bytes read through it: the greeting, then frames of
// a flags byte, a 1- or 8-byte size and the body. Writes pass through unchanged.
type guardedConn struct {
	net.Conn
	greeting int     // greeting bytes still to pass
	sizeLen  int     // size bytes of the header being read: 0 = the next byte is a frame's flags
	sizeGot  int     // size bytes read so far
	size     [8]byte // the size being read, big-endian
	body     uint64  // body bytes of the current frame still to pass
	command  bool    // the frame being read is a command
	more     bool    // the frame being read is a message part with more to follow
	frames   int     // parts of the current message seen so far
	msgBytes uint64  // body bytes of the current message so far
	failed   error   // set once an oversized frame was seen; every later Read returns it
	max      uint64  // bytes per frame and per message
}

// Read reads from the connection and checks every frame header it passes.
func (c *guardedConn) Read(p []byte) (int, error) {
	if c.failed != nil {
		return 0, c.failed
	}
	n, err := c.Conn.Read(p)
	if serr := c.scan(p[:n]); serr != nil {
		oversizedFrames.Add(1)
		_ = c.Conn.Close()
		c.failed = serr
		return 0, serr
	}
	return n, err
}

// scan advances the framing state over p; it returns an error at the first header whose size
// exceeds maxFrameBytes.
func (c *guardedConn) scan(p []byte) error {
	for len(p) > 0 {
		switch {
		case c.greeting > 0:
			k := min(c.greeting, len(p))
			c.greeting -= k
			p = p[k:]
		case c.body > 0:
			k := min(c.body, uint64(len(p)))
			c.body -= k
			p = p[k:]
		case c.sizeLen == 0: // a frame's flags
			c.sizeLen, c.sizeGot = 1, 0
			if p[0]&flagLong != 0 {
				c.sizeLen = 8
			}
			c.command, c.more = p[0]&flagCommand != 0, p[0]&flagMore != 0
			p = p[1:]
		default: // the frame's size bytes
			k := copy(c.size[8-c.sizeLen+c.sizeGot:], p[:min(c.sizeLen-c.sizeGot, len(p))])
			c.sizeGot += k
			p = p[k:]
			if c.sizeGot < c.sizeLen {
				continue
			}
			if c.sizeLen == 1 {
				c.body = uint64(c.size[7])
			} else {
				c.body = binary.BigEndian.Uint64(c.size[:])
			}
			c.size, c.sizeLen = [8]byte{}, 0
			if c.body > c.max {
				return fmt.Errorf("zmqtcp: %s declared a %d-byte frame, more than the %d-byte limit; connection closed: %w",
					c.RemoteAddr(), c.body, c.max, io.EOF)
			}
			if c.command {
				continue
			}
			c.frames++
			c.msgBytes += c.body
			if c.frames > MaxMessageFrames || c.msgBytes > c.max {
				return fmt.Errorf("zmqtcp: %s sent a message of more than %d parts or %d bytes; connection closed: %w",
					c.RemoteAddr(), MaxMessageFrames, c.max, io.EOF)
			}
			if !c.more {
				c.frames, c.msgBytes = 0, 0
			}
		}
	}
	return nil
}
