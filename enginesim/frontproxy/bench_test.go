package frontproxy_test

import (
	"bytes"
	"io"
	"net/http"
	"testing"

	"github.com/kvepp/kvepp/enginesim/frontproxy"
)

// BenchmarkProxyExchange measures one complete exchange through the proxy — ext_proc request
// phase with a 30 KB body, upstream SSE of 20 events, response phase — against a scripted ext_proc
// server and an in-process upstream, all over loopback.
func BenchmarkProxyExchange(b *testing.B) {
	up := &sseUpstream{n: 20}
	upAddr := startUpstream(b, up)
	s := newScript()
	s.destination = func() string { return upAddr }
	f := newFixture(b, s, func(c *frontproxy.Config) { c.Observe = nil })
	f.exchanges = nil
	body := bytes.Repeat([]byte(`{"prompt":[1,2,3]}`), 1700)
	client := &http.Client{}
	b.SetBytes(int64(len(body)))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		resp, err := client.Post(f.srv.URL()+"/v1/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			b.Fatalf("status %d", resp.StatusCode)
		}
	}
}
