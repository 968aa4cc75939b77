package runner

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/internal/benchbody"
	"github.com/kvepp/kvepp/picker"
)

// decisionOf plays one chat request and returns its decision metadata (matched and prompt tokens).
func decisionOf(t *testing.T, client *extproctest.Client, body []byte) string {
	t.Helper()
	ex, err := client.Do(context.Background(), extproctest.Request{Body: body,
		Headers:  []extproctest.Header{{Key: extproc.DecisionHeader, Value: "1"}},
		Response: &extproctest.Response{Status: 200, ContentType: "text/event-stream", Chunks: sseChunks()}})
	if err != nil || ex.Immediate != nil {
		t.Fatalf("err %v immediate %+v", err, ex.Immediate)
	}
	f := ex.DynamicMetadata.GetFields()[extproc.DecisionMetadataNamespace].GetStructValue().GetFields()
	return fmt.Sprintf("%s matched=%v prompt=%v", ex.Destination, f["matched_tokens"].GetNumberValue(), f["prompt_tokens"].GetNumberValue())
}

// TestConversationCacheKeepsSelections plays the same continuing conversations — growing turn by
// turn, retried, branching at the last message — through two kvepp instances in approximate mode
// (whose index learns the exact block hashes of its own bookings), one with the conversation
// cache and one without: every decision (worker, matched prefix, prompt tokens) is the same, and
// the cache's metrics show it served the turns.
func TestConversationCacheKeepsSelections(t *testing.T) {
	start := func(cacheBytes int64) (*Instance, *extproctest.Client) {
		cfg := loopbackConfig(t)
		cfg.UseKVEvents = false
		cfg.ConversationCacheBytes = cacheBytes
		inst := startInstance(t, cfg)
		bs := uint32(16)
		rec := picker.WorkerRecord{WorkerID: 1, ModelName: e2eModel, Endpoint: "http://127.0.0.1:18001", BlockSize: &bs}
		if _, err := inst.Service.UpsertWorker(context.Background(), rec, picker.SourceAPI); err != nil {
			t.Fatal(err)
		}
		return inst, extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC))
	}
	cached, withCache := start(64 << 20)
	_, without := start(0)
	var bodies [][]byte
	for turns := 1; turns <= 6; turns++ {
		b, err := benchbody.New(benchbody.Conversation(e2eModel, turns, 1500), "")
		if err != nil {
			t.Fatal(err)
		}
		bodies = append(bodies, b.Raw, b.Raw, b.Unique("branch", uint64(turns)))
	}
	for i, body := range bodies {
		if got, want := decisionOf(t, withCache, body), decisionOf(t, without, body); got != want {
			t.Fatalf("request %d: with the cache %s, without %s", i, got, want)
		}
	}
	var hits float64
	mfs, err := cached.Metrics.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "kvepp_conversation_cache_lookups_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if strings.Contains(m.String(), `"hit"`) {
				hits = m.GetCounter().GetValue()
			}
		}
	}
	if hits < float64(len(bodies))/2 {
		t.Fatalf("kvepp_conversation_cache_lookups_total{result=\"hit\"} = %v of %d requests", hits, len(bodies))
	}
}

// TestConversationCacheCanBeTurnedOff: DYN_EPP_CONVERSATION_CACHE_BYTES=0 registers no cache
// metrics, a negative value is refused at startup with the setting's name.
func TestConversationCacheCanBeTurnedOff(t *testing.T) {
	cfg := loopbackConfig(t)
	cfg.ConversationCacheBytes = 0
	inst := startInstance(t, cfg)
	mfs, _ := inst.Metrics.Gather()
	for _, mf := range mfs {
		if strings.HasPrefix(mf.GetName(), "kvepp_conversation_cache") {
			t.Fatalf("metric %s registered with the cache off", mf.GetName())
		}
	}
	cfg.ConversationCacheBytes = -1
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "DYN_EPP_CONVERSATION_CACHE_BYTES") {
		t.Fatalf("negative bound: %v", err)
	}
}
