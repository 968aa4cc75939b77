package httpapi

import (
	"fmt"
	"net/http"
)

// Header limits of the side port (README "Limits"). net/http answers headers over
// http.Server.MaxHeaderBytes itself, with a plain-text 431 before any handler runs; so the server
// reads up to HeaderReadLimit and LimitHeaders answers what exceeds MaxHeaderBytes with the API's
// JSON error. Only headers beyond HeaderReadLimit still get net/http's plain text.
const (
	// MaxHeaderBytes is the largest accepted request head (request line and headers) in bytes:
	// 1 MiB, net/http's own default.
	MaxHeaderBytes = 1 << 20
	// HeaderReadLimit is the http.Server.MaxHeaderBytes to serve LimitHeaders with: 8 MiB.
	HeaderReadLimit = 8 << 20
)

// LimitHeaders answers a request whose head (request line and headers, counted as on the wire)
// exceeds MaxHeaderBytes with 431 {"error": "request headers are N bytes; the limit is 1048576
// bytes"} and closes the connection; other requests go to next.
func LimitHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n := headBytes(r); n > MaxHeaderBytes {
			w.Header().Set("Connection", "close")
			writeError(w, http.StatusRequestHeaderFieldsTooLarge,
				fmt.Sprintf("request headers are %d bytes; the limit is %d bytes", n, MaxHeaderBytes))
			return
		}
		next.ServeHTTP(w, r)
	})
}

// headBytes is the size of r's head as sent: "METHOD URI PROTO\r\n", each "Name: value\r\n"
// (Host included), and the blank line.
func headBytes(r *http.Request) int {
	n := len(r.Method) + 1 + len(r.RequestURI) + 1 + len(r.Proto) + 2
	if r.Host != "" {
		n += len("Host: ") + len(r.Host) + 2
	}
	for k, vs := range r.Header {
		for _, v := range vs {
			n += len(k) + 2 + len(v) + 2
		}
	}
	return n + 2
}
