// Package zmqtcp registers a TCP transport for go-zeromq/zmq4 sockets that never hangs on a
// stuck peer. zmq4 performs the ZMTP handshake with blocking reads that ignore the socket's
// context and writes to a subscriber without a deadline, so a peer that accepts a connection but
// never speaks ZMTP would block a dial (and the socket's Close) forever, and one subscriber that
// stops reading would stall a PUB socket's sends to every other subscriber. Through this
// transport
//   - a dialled connection is closed as soon as its socket's context ends, and
//   - every write has a deadline of WriteTimeout; a write that misses it closes the connection
//     (zmq4 then drops that connection and keeps serving the others), and
//   - a peer's frame header declaring more than MaxFrameBytes closes the connection before zmq4
//     allocates the frame (LimitFrames).
//
// Use it by rewriting a validated tcp:// endpoint with Endpoint before Dial or Listen.
package zmqtcp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// Scheme is the zmq4 transport name registered by this package ("tcp" if the name was taken,
// which only happens when another package registered the same name first).
var Scheme = "tcp"

// WriteTimeout bounds one write to a peer (the 15 s heartbeat timeout of selection-service.md
// §15.1, which zmq4 does not implement itself).
const WriteTimeout = 15 * time.Second

// writeTimeout is the deadline in force (tests shorten it).
var writeTimeout = WriteTimeout

func init() {
	if zmq4.RegisterTransport("kvepp-tcp", tcpTransport{plain: transport.New("tcp")}) == nil {
		Scheme = "kvepp-tcp"
	}
}

// Endpoint rewrites a tcp:// endpoint to this package's transport; other schemes (ipc, inproc)
// are returned unchanged.
func Endpoint(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return Scheme + "://" + rest
	}
	return ep
}

// tcpTransport is plain TCP with the two guarantees of the package documentation.
type tcpTransport struct {
	plain transport.Transport
}

// Dial connects like tcp; the connection closes when ctx (the zmq4 socket's life-line) ends.
func (t tcpTransport) Dial(ctx context.Context, dialer transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.plain.Dial(ctx, dialer, addr)
	if err != nil {
		return nil, err
	}
	context.AfterFunc(ctx, func() { _ = c.Close() })
	return deadlineConn{Conn: LimitFrames(c)}, nil
}

// Listen listens like tcp; accepted connections get write deadlines.
func (t tcpTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	ln, err := t.plain.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return deadlineListener{Listener: ln}, nil
}

// Addr parses an address like tcp ("*" host = all interfaces, "*" or "0" port = ephemeral).
func (t tcpTransport) Addr(ep string) (string, error) { return t.plain.Addr(ep) }

type deadlineListener struct{ net.Listener }

// Accept wraps the accepted connection with write deadlines and the frame-size bound.
func (l deadlineListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return deadlineConn{Conn: LimitFrames(c)}, nil
}

// deadlineConn gives every Write a WriteTimeout deadline. A timed-out write closes the connection
// and reports io.EOF, which zmq4 treats as a closed connection (it ignores timeout errors and
// would keep writing into a half-sent frame).
type deadlineConn struct{ net.Conn }

// Write writes p within WriteTimeout.
func (c deadlineConn) Write(p []byte) (int, error) {
	_ = c.Conn.SetWriteDeadline(time.Now().Add(writeTimeout))
	n, err := c.Conn.Write(p)
	var ne net.Error
	if err != nil && errors.As(err, &ne) && ne.Timeout() {
		_ = c.Conn.Close()
		return n, fmt.Errorf("zmqtcp: write to %s timed out after %v: %w", c.RemoteAddr(), writeTimeout, io.EOF)
	}
	return n, err
}

// PlainError returns err with this transport's scheme written as the tcp:// the endpoint was
// configured with, so logs name an endpoint as the operator wrote it; nil stays nil. errors.Is and
// errors.As still reach the original error.
func PlainError(err error) error {
	if err == nil || Scheme == "tcp" {
		return err
	}
	return plainError{err}
}

// plainError is an error whose text names tcp:// instead of Scheme.
type plainError struct{ err error }

// Error returns the wrapped error's text with Scheme:// replaced by tcp://.
func (e plainError) Error() string {
	return strings.ReplaceAll(e.err.Error(), Scheme+"://", "tcp://")
}

// Unwrap returns the wrapped error.
func (e plainError) Unwrap() error { return e.err }
