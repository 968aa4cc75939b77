package runner

import (
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvepp/kvepp/extproc/extproctest"
)

// startApproximate starts an approximate-mode EPP (DYN_ROUTER_USE_KV_EVENTS=false) whose workers
// file holds yml, and returns it with an ext_proc client.
func startApproximate(t *testing.T, yml string) (*Instance, *extproctest.Client) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "workers.yaml")
	if err := os.WriteFile(path, []byte(yml), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := loopbackConfig(t)
	cfg.WorkersFile = path
	cfg.UseKVEvents = false
	inst := startInstance(t, cfg)
	return inst, extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC))
}

// TestLoadOnlyPicksHonourThePartitionWithTheRealCore plays requests in an encoding kvepp cannot
// read (load-only picks, epp.md §5.7) against the embedded selection core with two workers of the
// served model, one in the EPP's routing group and one in another: every pick lands on the
// partition's worker, as a tokenized request would (with random ties, 24 picks over both would
// miss it with odds 2^-24).
func TestLoadOnlyPicksHonourThePartitionWithTheRealCore(t *testing.T) {
	var yml string
	for i, group := range []string{"default", "prefill"} {
		yml += fmt.Sprintf("- worker_id: %d\n  model_name: %s\n  routing_group: %s\n  endpoint: http://127.0.0.1:%d\n  block_size: 16\n",
			i+1, e2eModel, group, 18101+i)
	}
	_, client := startApproximate(t, yml)
	for i := 0; i < 24; i++ {
		ex, err := client.Do(context.Background(), extproctest.Request{
			Body:    []byte{0x28, 0xb5, 0x2f, 0xfd},
			Headers: []extproctest.Header{{Key: "content-encoding", Value: "zstd"}},
		})
		if err != nil {
			t.Fatal(err)
		}
		if ex.Immediate != nil || ex.Destination != "127.0.0.1:18101" {
			t.Fatalf("pick %d: destination %q, immediate %+v; want the default group's worker 127.0.0.1:18101", i, ex.Destination, ex.Immediate)
		}
	}
}

// TestRequestsOfOneModelStayOnItsWorkersWithTheRealCore replays the audit's case with the real
// core: model "m" on one worker, another model on two. Header-only GET /v1/models naming m in
// x-gateway-model-name and gzip-encoded chat requests for m must all land on m's worker; the chat
// requests are decoded, tokenized and booked (and freed when their responses end).
func TestRequestsOfOneModelStayOnItsWorkersWithTheRealCore(t *testing.T) {
	yml := "- {worker_id: 1, model_name: m, endpoint: 'http://127.0.0.1:18301', block_size: 16}\n" +
		"- {worker_id: 2, model_name: other, endpoint: 'http://127.0.0.1:18302', block_size: 16}\n" +
		"- {worker_id: 3, model_name: other, endpoint: 'http://127.0.0.1:18303', block_size: 16}\n"
	inst, client := startApproximate(t, yml)
	for i := 0; i < 100; i++ {
		ex, err := client.Do(context.Background(), extproctest.Request{Method: "GET", Path: "/v1/models", HeaderOnly: true,
			Headers: []extproctest.Header{{Key: "x-gateway-model-name", Value: "m"}}})
		if err != nil {
			t.Fatal(err)
		}
		if ex.Immediate != nil || ex.Destination != "127.0.0.1:18301" {
			t.Fatalf("GET /v1/models %d went to %q (immediate %+v), want m's worker", i, ex.Destination, ex.Immediate)
		}
	}
	var gz bytes.Buffer
	w := gzip.NewWriter(&gz)
	if _, err := w.Write([]byte(`{"model":"m","messages":[{"role":"user","content":"hello there"}]}`)); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 30; i++ {
		ex, err := client.Do(context.Background(), extproctest.Request{Body: gz.Bytes(),
			Headers:  []extproctest.Header{{Key: "content-encoding", Value: "gzip"}, {Key: "x-kvepp-decision", Value: "1"}},
			Response: &extproctest.Response{Chunks: [][]byte{[]byte(`{"choices":[]}`)}}})
		if err != nil {
			t.Fatal(err)
		}
		if ex.Immediate != nil || ex.Destination != "127.0.0.1:18301" || !bytes.Equal(ex.Body, gz.Bytes()) {
			t.Fatalf("gzip chat %d went to %q (immediate %+v), want m's worker with the body unchanged", i, ex.Destination, ex.Immediate)
		}
		if d := ex.DynamicMetadata.GetFields()["kvepp.decision"].GetStructValue().GetFields(); !d["booked"].GetBoolValue() {
			t.Fatalf("gzip chat %d was not booked: %v", i, d)
		}
	}
	waitNoLoad(t, inst.Addrs().Selection)
}
