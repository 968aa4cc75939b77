package runner

import (
	"context"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/extproc/extproctest"
)

// TestImageChatIsRoutedByItsTextPrefix plays a chat with an image through ext_proc in
// approximate mode: it is routed (not refused), the blocks before the image are indexed as a
// text-only request's are, and the blocks from the image on are indexed under a request-unique
// hash, so the same ids without it match only the prefix blocks.
func TestImageChatIsRoutedByItsTextPrefix(t *testing.T) {
	cfg := loopbackConfig(t)
	cfg.UseKVEvents = false
	cfg.ImageTokens = 64
	inst := startInstance(t, cfg)
	addWorkers(t, inst, 2, 18300)
	client := extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC))
	history := strings.Repeat("We talk about pictures and caches. ", 30)
	body := []byte(`{"model":"` + e2eModel + `","messages":[{"role":"system","content":"` + history + `"},{"role":"user","content":[{"type":"text","text":"Describe it."},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}`)
	ex, err := client.Do(context.Background(), extproctest.Request{Path: "/v1/chat/completions", Body: body,
		Response: &extproctest.Response{Status: 200, ContentType: "application/json", Chunks: [][]byte{[]byte(`{}`)}}})
	if err != nil {
		t.Fatal(err)
	}
	if ex.Immediate != nil || ex.Destination == "" {
		t.Fatalf("immediate %+v, destination %q: an image chat must be routed", ex.Immediate, ex.Destination)
	}
	lt := qwenLocal(t)
	p, err := lt.TokenizeChatPrompt(body, cfg.ImageTokens)
	if err != nil {
		t.Fatal(err)
	}
	if p.UncachedFrom < 16*5 || len(p.TokenIDs)-p.UncachedFrom < 64 {
		t.Fatalf("UncachedFrom %d of %d tokens: the test needs a long prefix and a booked image", p.UncachedFrom, len(p.TokenIDs))
	}
	overlap := deviceOverlap(t, inst.Addrs().Selection, e2eModel, p.TokenIDs)
	best := 0
	for _, n := range overlap {
		best = max(best, n)
	}
	if want := p.UncachedFrom / 16; best != want {
		t.Fatalf("the routed worker holds %d blocks of the ids, want exactly the %d blocks before the image", best, want)
	}
}
