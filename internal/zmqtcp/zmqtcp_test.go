package zmqtcp

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4/transport"
)

func TestEndpoint(t *testing.T) {
	if got := Endpoint("tcp://127.0.0.1:9092"); got != Scheme+"://127.0.0.1:9092" || Scheme != "kvepp-tcp" {
		t.Fatalf("Endpoint = %q (scheme %q)", got, Scheme)
	}
	for _, ep := range []string{"ipc:///tmp/x", "inproc://y"} {
		if got := Endpoint(ep); got != ep {
			t.Fatalf("Endpoint(%q) = %q", ep, got)
		}
	}
}

func TestAStuckReaderFailsTheWriteAndClosesTheConnection(t *testing.T) {
	old := writeTimeout
	writeTimeout = 50 * time.Millisecond
	defer func() { writeTimeout = old }()
	tr := tcpTransport{plain: transport.New("tcp")}
	ln, err := tr.Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String()) // never reads
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	start := time.Now()
	for {
		if _, err = server.Write(buf); err != nil {
			break
		}
		if time.Since(start) > 10*time.Second {
			t.Fatal("writes to a reader that never reads did not time out")
		}
	}
	if !errors.Is(err, io.EOF) || !strings.Contains(err.Error(), "timed out") {
		t.Fatalf("write error %v, want a timeout reported as io.EOF", err)
	}
	if _, err := server.Write([]byte{1}); err == nil {
		t.Fatal("the connection is still open after the timeout")
	}
}

func TestADialClosesWhenItsContextEnds(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	tr := tcpTransport{plain: transport.New("tcp")}
	c, err := tr.Dial(ctx, &net.Dialer{}, ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	peer, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	done := make(chan error, 1)
	go func() { _, err := c.Read(make([]byte, 1)); done <- err }() // blocks: the peer never writes
	cancel()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("read succeeded")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a read on a dialled connection did not end with its context")
	}
}
