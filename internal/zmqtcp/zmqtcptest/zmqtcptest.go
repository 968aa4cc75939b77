// Package zmqtcptest makes hostile ZMTP peers for tests: a valid ZMTP 3.0 NULL greeting followed
// by a frame header that declares an enormous frame, the input that made zmq4 abort the process
// before internal/zmqtcp bounded frame sizes.
package zmqtcptest

import (
	"encoding/binary"
	"net"
	"testing"
)

// Oversized returns a ZMTP 3.0 greeting (NULL mechanism, as client) and the header of a command
// frame declaring size bytes (64 + 9 bytes; no body follows).
func Oversized(size uint64) []byte {
	g := make([]byte, 64, 64+9)
	g[0], g[9] = 0xFF, 0x7F // signature
	g[10], g[11] = 3, 0     // version 3.0
	copy(g[12:32], "NULL")  // mechanism, zero padded; as-server and filler stay 0
	g = append(g, 0x06)     // command frame with an 8-byte size
	return binary.BigEndian.AppendUint64(g, size)
}

// ServeOversized listens on 127.0.0.1 and writes Oversized(size) to every connection, then holds
// it open until the peer closes it; it returns the listener's "host:port". The listener closes at
// the end of the test.
func ServeOversized(t testing.TB, size uint64) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				if _, err := c.Write(Oversized(size)); err != nil {
					return
				}
				var buf [512]byte
				for {
					if _, err := c.Read(buf[:]); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}
