package extproc_test

import (
	"strings"
	"testing"

	"github.com/kvepp/kvepp/extproc/extproctest"
)

// TestANonStreamedResponseIsBookedAsUnobserved checks that a request without "stream": true is
// booked with PrefillUnobserved (its first token is not seen until the whole answer arrives, so
// the picker releases its prefill on an estimate), and a streamed one is not.
func TestANonStreamedResponseIsBookedAsUnobserved(t *testing.T) {
	for _, tc := range []struct {
		body string
		want bool
	}{
		{`{"model":"m","messages":[{"role":"user","content":"hello"}],"stream":true}`, false},
		{`{"model":"m","messages":[{"role":"user","content":"hello"}]}`, true},
		{`{"model":"m","messages":[{"role":"user","content":"hello"}],"stream":false}`, true},
		{`{"model":"m","prompt":[1,2,3,4],"stream":true}`, false},
	} {
		h := newHarness(t, nil)
		path := "/v1/chat/completions"
		if strings.Contains(tc.body, `"prompt"`) {
			path = "/v1/completions"
		}
		ex := h.do(t, extproctest.Request{Path: path, Body: []byte(tc.body), Response: okResponse()})
		if ex.Immediate != nil {
			t.Fatalf("%s: ImmediateResponse %d %s", tc.body, ex.Immediate.Status, ex.Immediate.Body)
		}
		h.pk.mu.Lock()
		if len(h.pk.selects) != 1 {
			t.Fatalf("%s: %d selections", tc.body, len(h.pk.selects))
		}
		sel := h.pk.selects[0]
		h.pk.mu.Unlock()
		if sel.PrefillUnobserved != tc.want {
			t.Errorf("%s: PrefillUnobserved %v, want %v", tc.body, sel.PrefillUnobserved, tc.want)
		}
	}
}
