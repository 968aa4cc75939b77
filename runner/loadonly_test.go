package runner

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvepp/kvepp/extproc/extproctest"
)

// TestLoadOnlyPicksHonourThePartitionWithTheRealCore plays gzip-encoded requests (load-only picks,
// epp.md §5.7) against the embedded selection core with two workers of the served model, one in
// the EPP's routing group and one in another: every pick lands on the partition's worker, as a
// tokenized request would (with random ties, 24 picks over both would miss it with odds 2^-24).
func TestLoadOnlyPicksHonourThePartitionWithTheRealCore(t *testing.T) {
	var yml string
	for i, group := range []string{"default", "prefill"} {
		yml += fmt.Sprintf("- worker_id: %d\n  model_name: %s\n  routing_group: %s\n  endpoint: http://127.0.0.1:%d\n  block_size: 16\n",
			i+1, e2eModel, group, 18101+i)
	}
	path := filepath.Join(t.TempDir(), "workers.yaml")
	if err := os.WriteFile(path, []byte(yml), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := loopbackConfig(t)
	cfg.WorkersFile = path
	cfg.UseKVEvents = false
	inst := startInstance(t, cfg)
	client := extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC))
	for i := 0; i < 24; i++ {
		ex, err := client.Do(context.Background(), extproctest.Request{
			Body:    []byte{0x1f, 0x8b, 0x08},
			Headers: []extproctest.Header{{Key: "content-encoding", Value: "gzip"}},
		})
		if err != nil {
			t.Fatal(err)
		}
		if ex.Immediate != nil || ex.Destination != "127.0.0.1:18101" {
			t.Fatalf("pick %d: destination %q, immediate %+v; want the default group's worker 127.0.0.1:18101", i, ex.Destination, ex.Immediate)
		}
	}
}
