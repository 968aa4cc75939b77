package frontproxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"
)

// Server is a running front proxy: an HTTP/1.1 server on a loopback (or given) address whose
// handler is a [Proxy]. Stop it with Close.
type Server struct {
	// Proxy is the handler (exposed for its configuration).
	Proxy *Proxy

	srv  *http.Server
	ln   net.Listener
	url  string
	done chan struct{}
}

// Start listens on addr ("host:port"; "" means "127.0.0.1:0") and serves p until Close. It fails
// when the address cannot be bound.
func Start(addr string, p *Proxy) (*Server, error) {
	if p == nil {
		return nil, errors.New("frontproxy: Start needs a Proxy")
	}
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("frontproxy: listen on %q: %w", addr, err)
	}
	s := &Server{
		Proxy: p,
		srv:   &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second},
		ln:    ln,
		url:   "http://" + ln.Addr().String(),
		done:  make(chan struct{}),
	}
	go func() {
		defer close(s.done)
		_ = s.srv.Serve(ln)
	}()
	return s, nil
}

// URL returns the proxy's base URL, "http://host:port".
func (s *Server) URL() string { return s.url }

// Close stops accepting requests, waits up to 5 s for running exchanges, then closes the rest. It
// is idempotent.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	if err != nil {
		err = errors.Join(err, s.srv.Close())
	}
	<-s.done
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}
