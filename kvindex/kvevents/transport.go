package kvevents

import "github.com/kvepp/kvepp/internal/zmqtcp"

// dialAddress rewrites a validated tcp:// endpoint to internal/zmqtcp's transport: zmq4 performs
// the ZMTP handshake with blocking reads that ignore the context, so dialling a port that accepts
// but never speaks ZMTP (a hung process, a non-ZMQ server) would otherwise block the dial, and a
// listener's shutdown, forever; through zmqtcp the connection closes when its socket's context
// ends. Other schemes are returned unchanged.
func dialAddress(ep string) string { return zmqtcp.Endpoint(ep) }

// plainDialError names the endpoint of a dial error as it was configured (tcp://), not by the
// internal transport's scheme; nil stays nil.
func plainDialError(err error) error { return zmqtcp.PlainError(err) }
