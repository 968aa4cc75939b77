package discovery

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/kvepp/kvepp/internal/syncbuf"
	"github.com/kvepp/kvepp/picker"
	"github.com/rs/zerolog"
)

// fakeCatalog records operations and can be told to fail upserts.
type fakeCatalog struct {
	mu       sync.Mutex
	workers  map[uint64]picker.WorkerRecord
	sources  map[uint64]picker.Source
	failWith error // returned by UpsertWorker while non-nil
	// normalizeTaints stores taints as a sorted set, as picker.Service does.
	normalizeTaints bool
	upserts         int
	deletes         int
}

func newFakeCatalog() *fakeCatalog {
	return &fakeCatalog{workers: map[uint64]picker.WorkerRecord{}, sources: map[uint64]picker.Source{}}
}

func (f *fakeCatalog) UpsertWorker(_ context.Context, rec picker.WorkerRecord, src picker.Source) (picker.WorkerState, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failWith != nil {
		return picker.WorkerState{}, f.failWith
	}
	f.upserts++
	if rec.ModelName == "" {
		rec.ModelName = picker.DefaultPartitionName
	}
	if rec.RoutingGroup == "" {
		rec.RoutingGroup = picker.DefaultPartitionName
	}
	if f.normalizeTaints {
		rec.Taints = picker.NormalizeTaints(rec.Taints)
	}
	f.workers[rec.WorkerID] = rec
	f.sources[rec.WorkerID] = src
	return picker.WorkerState{WorkerRecord: rec, Lifecycle: picker.LifecycleSchedulable}, nil
}

func (f *fakeCatalog) DeleteWorker(_ context.Context, id uint64) (picker.WorkerState, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	rec, ok := f.workers[id]
	if !ok {
		return picker.WorkerState{}, picker.Errorf(picker.KindNotFound, "worker %d not found", id)
	}
	f.deletes++
	delete(f.workers, id)
	delete(f.sources, id)
	return picker.WorkerState{WorkerRecord: rec, Lifecycle: picker.LifecycleUnschedulable}, nil
}

func (f *fakeCatalog) Workers(model, group string) []picker.WorkerState {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []picker.WorkerState
	for _, r := range f.workers {
		if (model == "" || r.ModelName == model) && (group == "" || r.RoutingGroup == group) {
			out = append(out, picker.WorkerState{WorkerRecord: r, Lifecycle: picker.LifecycleSchedulable})
		}
	}
	return out
}

func (f *fakeCatalog) setFail(err error) {
	f.mu.Lock()
	f.failWith = err
	f.mu.Unlock()
}

// endpoints returns worker id → endpoint.
func (f *fakeCatalog) endpoints() map[uint64]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[uint64]string{}
	for id, r := range f.workers {
		out[id] = r.Endpoint
	}
	return out
}

func (f *fakeCatalog) counts() (int, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.upserts, f.deletes
}

func u32(v uint32) *uint32 { return &v }

func u64(v uint64) *uint64 { return &v }

func TestParseWorkers(t *testing.T) {
	defaults := Defaults{BlockSize: 16, ModelName: "Qwen/Qwen3-0.6B"}
	tests := []struct {
		name    string
		in      string
		want    []picker.WorkerRecord
		wantErr string
	}{
		{
			name: "a YAML list gets the default block size and model name where omitted",
			in: `
- worker_id: 1
  endpoint: http://127.0.0.1:8001
  kv_events_endpoint: tcp://127.0.0.1:5571
- worker_id: 2
  model_name: other
  endpoint: http://127.0.0.1:8002
  block_size: 32
`,
			want: []picker.WorkerRecord{
				{WorkerID: 1, ModelName: "Qwen/Qwen3-0.6B", Endpoint: "http://127.0.0.1:8001", KVEventsEndpoint: "tcp://127.0.0.1:5571", BlockSize: u32(16)},
				{WorkerID: 2, ModelName: "other", Endpoint: "http://127.0.0.1:8002", BlockSize: u32(32)},
			},
		},
		{
			name: "a JSON list parses the same way",
			in:   `[{"worker_id": 7, "endpoint": "http://a:1", "kv_events_endpoints": {"0": "tcp://a:5557"}}]`,
			want: []picker.WorkerRecord{{WorkerID: 7, ModelName: "Qwen/Qwen3-0.6B", Endpoint: "http://a:1", BlockSize: u32(16), KVEventsEndpoints: map[string]string{"0": "tcp://a:5557"}}},
		},
		{name: "an empty list means no workers", in: "[]", want: []picker.WorkerRecord{}},
		{
			name: "explicit values win over the defaults",
			in:   "- worker_id: 4\n  model_name: m\n  block_size: 8\n  max_num_batched_tokens: 100\n  total_kv_blocks: 9",
			want: []picker.WorkerRecord{{WorkerID: 4, ModelName: "m", BlockSize: u32(8), MaxNumBatchedTokens: u64(100), TotalKVBlocks: u64(9)}},
		},
		{name: "an empty file is rejected", in: "  \n", wantErr: "workers file is empty"},
		{name: "a routing group with a colon is rejected as the API rejects it", in: `[{"worker_id": 3, "routing_group": "b:c"}]`,
			wantErr: "worker record 0 (worker_id 3): routing_group \"b:c\" must not contain ':'"},
		{name: "a model name with a control character is rejected", in: `[{"worker_id": 3, "model_name": "m\u0000"}]`,
			wantErr: "control character U+0000"},
		{name: "a comment-only file is rejected like an empty one", in: "# all workers go here\n# none yet\n", wantErr: "workers file has no worker list"},
		{name: "a file of document separators only is rejected", in: "---\n# nothing\n---\n", wantErr: "workers file has no worker list"},
		{name: "an explicit null document is rejected", in: "null\n", wantErr: "workers file has no worker list"},
		{name: "a YAML tilde null is rejected", in: "~", wantErr: "write [] for no workers"},
		{name: "an explicit empty list after a separator and comments means no workers", in: "# drained\n---\n[]\n", want: []picker.WorkerRecord{}},
		{name: "an explicit empty JSON list with whitespace means no workers", in: " [ ] \n", want: []picker.WorkerRecord{}},
		{name: "a mapping at the top level is rejected", in: "worker_id: 1", wantErr: "must be a list of worker records"},
		{name: "a record that is not an object is rejected", in: "- 5", wantErr: "worker record 0: must be an object"},
		{name: "a record without worker_id is rejected", in: "- endpoint: http://a:1", wantErr: "worker record 0: worker_id is required"},
		{name: "a misspelt field is rejected", in: "- worker_id: 3\n  kv_event_endpoint: tcp://a:1", wantErr: `worker record 0 (worker_id 3): json: unknown field "kv_event_endpoint"`},
		{name: "a negative worker_id is rejected", in: "- worker_id: -1", wantErr: "worker record 0 (worker_id -1)"},
		{name: "a duplicate worker_id is rejected", in: "- worker_id: 1\n- worker_id: 1", wantErr: "worker record 1: worker_id 1 is already used by record 0"},
		{name: "broken YAML is rejected", in: "- worker_id: [1", wantErr: "not valid YAML or JSON"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseWorkers([]byte(tc.in), defaults)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error = %v, want it to contain %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Fatalf("records (-want +got):\n%s", diff)
			}
		})
	}
}

// harness writes the workers file and runs a FileSource over a fake catalog.
type harness struct {
	t    *testing.T
	path string
	cat  *fakeCatalog
	src  *FileSource
	logs *syncbuf.Buffer
}

func newHarness(t *testing.T, initial string) *harness {
	t.Helper()
	dir := t.TempDir()
	h := &harness{t: t, path: filepath.Join(dir, "workers.yaml"), cat: newFakeCatalog(), logs: &syncbuf.Buffer{}}
	h.write(initial)
	src, err := NewFileSource(FileConfig{
		Path:          h.path,
		Defaults:      Defaults{BlockSize: 16},
		Debounce:      20 * time.Millisecond,
		RetryInterval: 200 * time.Millisecond,
		Logger:        zerolog.New(h.logs),
	}, h.cat)
	if err != nil {
		t.Fatal(err)
	}
	h.src = src
	return h
}

func (h *harness) start() {
	h.t.Helper()
	if err := h.src.Start(context.Background()); err != nil {
		h.t.Fatalf("Start: %v", err)
	}
	h.t.Cleanup(func() { _ = h.src.Close() })
}

func (h *harness) write(content string) {
	h.t.Helper()
	if err := os.WriteFile(h.path, []byte(content), 0o644); err != nil {
		h.t.Fatal(err)
	}
}

// replace writes content to a temporary file and renames it over the workers file, as editors do.
func (h *harness) replace(content string) {
	h.t.Helper()
	tmp := h.path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		h.t.Fatal(err)
	}
	if err := os.Rename(tmp, h.path); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) waitFor(what string, cond func() bool) {
	h.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if cond() {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	h.t.Fatalf("timed out waiting for %s; catalog %v; logs:\n%s", what, h.cat.endpoints(), h.logs.String())
}

func (h *harness) waitEndpoints(want map[uint64]string) {
	h.t.Helper()
	h.waitFor("catalog to match", func() bool { return cmp.Equal(want, h.cat.endpoints()) })
}

const twoWorkers = `
- worker_id: 1
  endpoint: http://127.0.0.1:8001
- worker_id: 2
  endpoint: http://127.0.0.1:8002
`

func TestFileSource(t *testing.T) {
	t.Run("the initial snapshot registers every worker with source discovery and the default block size", func(t *testing.T) {
		h := newHarness(t, twoWorkers)
		h.start()
		if diff := cmp.Diff(map[uint64]string{1: "http://127.0.0.1:8001", 2: "http://127.0.0.1:8002"}, h.cat.endpoints()); diff != "" {
			t.Fatalf("catalog after Start (-want +got):\n%s", diff)
		}
		h.cat.mu.Lock()
		defer h.cat.mu.Unlock()
		for id, src := range h.cat.sources {
			if src != picker.SourceDiscovery {
				t.Errorf("worker %d source = %q, want discovery", id, src)
			}
			if bs := h.cat.workers[id].BlockSize; bs == nil || *bs != 16 {
				t.Errorf("worker %d block_size = %v, want 16", id, bs)
			}
		}
	})

	t.Run("a changed record is upserted, a new one added and a vanished one deleted", func(t *testing.T) {
		h := newHarness(t, twoWorkers)
		h.start()
		h.write(`
- worker_id: 2
  endpoint: http://127.0.0.1:9002
- worker_id: 3
  endpoint: http://127.0.0.1:8003
`)
		h.waitEndpoints(map[uint64]string{2: "http://127.0.0.1:9002", 3: "http://127.0.0.1:8003"})
		if st := h.src.Stats(); st.Workers != 2 || st.Applied != 2 {
			t.Fatalf("stats = %+v, want 2 workers and 2 applied snapshots", st)
		}
	})

	t.Run("a rename-replace of the file by an editor is seen", func(t *testing.T) {
		h := newHarness(t, twoWorkers)
		h.start()
		h.replace("- worker_id: 5\n  endpoint: http://127.0.0.1:8005\n")
		h.waitEndpoints(map[uint64]string{5: "http://127.0.0.1:8005"})
	})

	t.Run("unchanged records are not upserted again when the file is rewritten", func(t *testing.T) {
		h := newHarness(t, twoWorkers)
		h.start()
		h.write(twoWorkers + "- worker_id: 9\n  endpoint: http://127.0.0.1:8009\n")
		h.waitEndpoints(map[uint64]string{1: "http://127.0.0.1:8001", 2: "http://127.0.0.1:8002", 9: "http://127.0.0.1:8009"})
		if up, del := h.cat.counts(); up != 3 || del != 0 {
			t.Fatalf("upserts, deletes = %d, %d; want 3, 0 (only worker 9 is new)", up, del)
		}
	})

	t.Run("workers registered over the API are never deleted by the file", func(t *testing.T) {
		h := newHarness(t, twoWorkers)
		if _, err := h.cat.UpsertWorker(context.Background(), picker.WorkerRecord{WorkerID: 42, Endpoint: "http://api:1"}, picker.SourceAPI); err != nil {
			t.Fatal(err)
		}
		h.start()
		h.write("[]")
		h.waitEndpoints(map[uint64]string{42: "http://api:1"})
	})

	t.Run("an invalid file keeps the previous catalog and is logged", func(t *testing.T) {
		h := newHarness(t, twoWorkers)
		h.start()
		h.write("- worker_id: [broken")
		h.waitFor("the invalid file to be counted", func() bool { return h.src.Stats().InvalidFiles > 0 })
		if diff := cmp.Diff(map[uint64]string{1: "http://127.0.0.1:8001", 2: "http://127.0.0.1:8002"}, h.cat.endpoints()); diff != "" {
			t.Fatalf("catalog changed by an invalid file (-want +got):\n%s", diff)
		}
		if !strings.Contains(h.logs.String(), "keeping the current catalog") {
			t.Fatalf("no log about the invalid file:\n%s", h.logs.String())
		}
		h.write("- worker_id: 1\n  endpoint: http://127.0.0.1:8001\n")
		h.waitEndpoints(map[uint64]string{1: "http://127.0.0.1:8001"})
	})

	t.Run("one invalid content is logged and counted once however often it is read", func(t *testing.T) {
		h := newHarness(t, twoWorkers)
		h.start()
		h.write("- worker_id: [garbled")
		h.waitFor("the invalid file to be read", func() bool { return h.src.Stats().Reads >= 2 })
		for i := 0; i < 3; i++ {
			// Another file of the directory changes: the workers file is read again, unchanged.
			reads := h.src.Stats().Reads
			if err := os.WriteFile(filepath.Join(filepath.Dir(h.path), "sibling"), []byte(strconv.Itoa(i)), 0o644); err != nil {
				t.Fatal(err)
			}
			h.waitFor("the workers file to be read again", func() bool { return h.src.Stats().Reads > reads })
		}
		if n := strings.Count(h.logs.String(), "keeping the current catalog"); n != 1 {
			t.Fatalf("the invalid content was logged %d times:\n%s", n, h.logs.String())
		}
		if st := h.src.Stats(); st.InvalidFiles != 1 {
			t.Fatalf("InvalidFiles = %d, want 1", st.InvalidFiles)
		}
		h.write("- worker_id: [garbled again")
		h.waitFor("a different invalid content to be counted", func() bool { return h.src.Stats().InvalidFiles == 2 })
		if n := strings.Count(h.logs.String(), "keeping the current catalog"); n != 2 {
			t.Fatalf("a second invalid content was logged %d times in all, want 2", n)
		}
	})

	for _, doc := range []struct{ what, content string }{
		{"a comment-only file", "# workers are being rewritten\n"},
		{"a file of separators only", "---\n---\n"},
		{"a null document", "null\n"},
		{"an empty file", ""},
	} {
		t.Run(doc.what+" keeps every file-registered worker, is counted and is logged", func(t *testing.T) {
			h := newHarness(t, twoWorkers)
			h.start()
			h.write(doc.content)
			h.waitFor("the invalid file to be counted", func() bool { return h.src.Stats().InvalidFiles > 0 })
			if diff := cmp.Diff(map[uint64]string{1: "http://127.0.0.1:8001", 2: "http://127.0.0.1:8002"}, h.cat.endpoints()); diff != "" {
				t.Fatalf("catalog changed by %s (-want +got):\n%s", doc.what, diff)
			}
			if _, del := h.cat.counts(); del != 0 {
				t.Fatalf("%s deleted %d workers", doc.what, del)
			}
			if st := h.src.Stats(); st.Workers != 2 {
				t.Fatalf("source owns %d workers after %s, want 2", st.Workers, doc.what)
			}
			if !strings.Contains(h.logs.String(), "write [] for no workers") {
				t.Fatalf("no log explaining the refusal:\n%s", h.logs.String())
			}
			h.write(twoWorkers)
			h.waitFor("the fix to be logged", func() bool { return strings.Contains(h.logs.String(), "workers file valid again") })
			h.write("[]")
			h.waitEndpoints(map[uint64]string{})
		})
	}

	t.Run("reordered or duplicated taints in the file are not re-upserted on every rewrite", func(t *testing.T) {
		h := newHarness(t, "- worker_id: 1\n  endpoint: http://127.0.0.1:8001\n  taints: [b, a, b]\n")
		h.cat.normalizeTaints = true
		h.start()
		h.write("- worker_id: 1\n  endpoint: http://127.0.0.1:8001\n  taints: [b, a, b]\n- worker_id: 2\n  endpoint: http://127.0.0.1:8002\n")
		h.waitEndpoints(map[uint64]string{1: "http://127.0.0.1:8001", 2: "http://127.0.0.1:8002"})
		if up, _ := h.cat.counts(); up != 2 {
			t.Fatalf("upserts = %d, want 2 (worker 1 is unchanged up to taint order)", up)
		}
	})

	t.Run("a failed apply is retried after the retry interval", func(t *testing.T) {
		h := newHarness(t, twoWorkers)
		h.start()
		h.cat.setFail(errors.New("catalog busy"))
		h.write(twoWorkers + "- worker_id: 3\n  endpoint: http://127.0.0.1:8003\n")
		h.waitFor("the apply to fail", func() bool { return h.src.Stats().ApplyFailures > 0 })
		if !h.src.Stats().Pending {
			t.Fatal("a failed snapshot is not pending")
		}
		h.cat.setFail(nil)
		start := time.Now()
		h.waitEndpoints(map[uint64]string{1: "http://127.0.0.1:8001", 2: "http://127.0.0.1:8002", 3: "http://127.0.0.1:8003"})
		if h.src.Stats().Pending {
			t.Fatal("snapshot still pending after a successful retry")
		}
		if time.Since(start) > 3*time.Second {
			t.Fatalf("retry took %v", time.Since(start))
		}
	})

	t.Run("a newer snapshot supersedes a pending retry", func(t *testing.T) {
		h := newHarness(t, twoWorkers)
		h.src.cfg.RetryInterval = time.Hour // only the newer snapshot can succeed in time
		h.start()
		h.cat.setFail(errors.New("catalog busy"))
		h.write("- worker_id: 3\n  endpoint: http://127.0.0.1:8003\n")
		h.waitFor("the apply to fail", func() bool { return h.src.Stats().ApplyFailures > 0 })
		h.cat.setFail(nil)
		h.write("- worker_id: 4\n  endpoint: http://127.0.0.1:8004\n")
		h.waitEndpoints(map[uint64]string{4: "http://127.0.0.1:8004"})
	})

	t.Run("a worker deleted over the API is re-registered on the next snapshot", func(t *testing.T) {
		h := newHarness(t, twoWorkers)
		h.start()
		if _, err := h.cat.DeleteWorker(context.Background(), 1); err != nil {
			t.Fatal(err)
		}
		h.write(twoWorkers + "# touched\n")
		h.waitEndpoints(map[uint64]string{1: "http://127.0.0.1:8001", 2: "http://127.0.0.1:8002"})
	})
}

func TestFileSourceStartErrors(t *testing.T) {
	tests := []struct {
		name    string
		content *string
		fail    error
		wantErr string
	}{
		{name: "a missing file stops startup", wantErr: "read workers file"},
		{name: "an invalid file stops startup", content: ptr("- nope: 1"), wantErr: "worker_id is required"},
		{name: "a comment-only file stops startup", content: ptr("# to be filled in\n"), wantErr: "workers file has no worker list"},
		{name: "a failed initial apply stops startup naming the worker", content: ptr(twoWorkers), fail: errors.New("policy cannot be evaluated"), wantErr: "upsert worker 1: policy cannot be evaluated"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "workers.yaml")
			if tc.content != nil {
				if err := os.WriteFile(path, []byte(*tc.content), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			cat := newFakeCatalog()
			cat.setFail(tc.fail)
			src, err := NewFileSource(FileConfig{Path: path, Logger: zerolog.Nop()}, cat)
			if err != nil {
				t.Fatal(err)
			}
			err = src.Start(context.Background())
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("Start error = %v, want it to contain %q", err, tc.wantErr)
			}
			_ = src.Close()
		})
	}
}

func TestSameRecordIgnoresPartitionDefaults(t *testing.T) {
	a := picker.WorkerRecord{WorkerID: 1, Endpoint: "http://a:1"}
	b := picker.WorkerRecord{WorkerID: 1, Endpoint: "http://a:1", ModelName: "default", RoutingGroup: "default", KVEventsEndpoints: map[string]string{}}
	if !sameRecord(a, b) {
		t.Fatal("records differing only by defaults compare unequal")
	}
	b.Endpoint = "http://a:2"
	if sameRecord(a, b) {
		t.Fatal("records with different endpoints compare equal")
	}
}

func ptr(s string) *string { return &s }
