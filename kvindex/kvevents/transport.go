package kvevents

import (
	"context"
	"net"
	"strings"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// watchedTCPScheme names a zmq4 transport that is plain TCP except that a connection is closed
// as soon as its socket's context ends. zmq4 performs the ZMTP handshake with blocking reads that
// ignore the context, so dialling a port that accepts but never speaks ZMTP (a hung process, a
// non-ZMQ server) would otherwise block the dial, and a listener's shutdown, forever.
const watchedTCPScheme = "kvepp-watched-tcp"

// dialScheme is the scheme listeners dial tcp:// endpoints with: watchedTCPScheme once
// registered, "tcp" if another package took the name.
var dialScheme = "tcp"

func init() {
	if zmq4.RegisterTransport(watchedTCPScheme, watchedTCP{plain: transport.New("tcp")}) == nil {
		dialScheme = watchedTCPScheme
	}
}

// dialAddress rewrites a validated tcp:// endpoint to the watched transport; other schemes are
// returned unchanged.
func dialAddress(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return dialScheme + "://" + rest
	}
	return ep
}

// plainDialError returns err with the watched transport's scheme written as the tcp:// the
// endpoint was configured with, so logs name the endpoint as the operator wrote it; nil stays nil.
func plainDialError(err error) error {
	if err == nil || dialScheme == "tcp" {
		return err
	}
	return dialError{err}
}

// dialError is a dial error whose text names tcp:// instead of the watched transport.
type dialError struct{ err error }

// Error returns the wrapped error's text with watchedTCPScheme replaced by tcp.
func (e dialError) Error() string {
	return strings.ReplaceAll(e.err.Error(), watchedTCPScheme+"://", "tcp://")
}

// Unwrap returns the dial error.
func (e dialError) Unwrap() error { return e.err }

// watchedTCP is the transport behind watchedTCPScheme.
type watchedTCP struct {
	plain transport.Transport
}

// Dial connects like tcp and closes the connection when ctx (the zmq4 socket's life-line) ends.
func (w watchedTCP) Dial(ctx context.Context, dialer transport.Dialer, addr string) (net.Conn, error) {
	c, err := w.plain.Dial(ctx, dialer, addr)
	if err != nil {
		return nil, err
	}
	context.AfterFunc(ctx, func() { _ = c.Close() })
	return c, nil
}

// Listen listens like tcp.
func (w watchedTCP) Listen(ctx context.Context, addr string) (net.Listener, error) {
	return w.plain.Listen(ctx, addr)
}

// Addr parses an address like tcp.
func (w watchedTCP) Addr(ep string) (string, error) {
	return w.plain.Addr(ep)
}
