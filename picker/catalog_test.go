package picker_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
	"github.com/kvepp/kvepp/policies"
)

func TestUpsertWorkerComputesSchedulabilityReasons(t *testing.T) {
	badEndpoint := errors.New("invalid kv_events endpoint for worker 1 dp_rank 1: missing scheme")
	cases := []struct {
		name       string
		kvEvents   bool
		queueing   bool
		failAttach error
		rec        picker.WorkerRecord
		lifecycle  string
		reasons    []string
	}{
		{name: "a complete record is schedulable", rec: worker(1), lifecycle: picker.LifecycleSchedulable},
		{name: "a record without endpoint is incomplete", rec: worker(1, func(r *picker.WorkerRecord) { r.Endpoint = "" }),
			lifecycle: picker.LifecycleIncomplete, reasons: []string{"endpoint is required"}},
		{name: "a record without block_size is incomplete", rec: worker(1, func(r *picker.WorkerRecord) { r.BlockSize = nil }),
			lifecycle: picker.LifecycleIncomplete, reasons: []string{"block_size must be greater than 0"}},
		{name: "a record with block_size 0 is incomplete", rec: worker(1, func(r *picker.WorkerRecord) { r.BlockSize = u32(0) }),
			lifecycle: picker.LifecycleIncomplete, reasons: []string{"block_size must be greater than 0"}},
		{name: "reasons are listed in table order", rec: worker(1, func(r *picker.WorkerRecord) { r.Endpoint = ""; r.BlockSize = nil }),
			lifecycle: picker.LifecycleIncomplete, reasons: []string{"endpoint is required", "block_size must be greater than 0"}},
		{name: "data_parallel_size 0 is incomplete", rec: worker(1, func(r *picker.WorkerRecord) { r.DataParallelSize = u32(0) }),
			lifecycle: picker.LifecycleIncomplete, reasons: []string{"data_parallel_size must be greater than 0"}},
		{name: "data_parallel_size above the limit is incomplete", rec: worker(1, func(r *picker.WorkerRecord) { r.DataParallelSize = u32(5000) }),
			lifecycle: picker.LifecycleIncomplete, reasons: []string{"data_parallel_size 5000 exceeds the limit of 4096"}},
		{name: "a rank range past 2^32 is incomplete", rec: worker(1, func(r *picker.WorkerRecord) {
			r.DataParallelStartRank = u32(1<<32 - 1)
			r.DataParallelSize = u32(2)
		}), lifecycle: picker.LifecycleIncomplete, reasons: []string{"data_parallel_start_rank 4294967295 + data_parallel_size 2 exceeds the dp_rank range"}},
		{name: "queueing requires max_num_batched_tokens", queueing: true, rec: worker(1),
			lifecycle: picker.LifecycleIncomplete, reasons: []string{"max_num_batched_tokens is required while queueing is enabled"}},
		{name: "queueing with max_num_batched_tokens is schedulable", queueing: true,
			rec: worker(1, func(r *picker.WorkerRecord) { r.MaxNumBatchedTokens = u64(1024) }), lifecycle: picker.LifecycleSchedulable},
		{name: "KV events off need no event endpoints", rec: worker(1, func(r *picker.WorkerRecord) { r.DataParallelSize = u32(2) }),
			lifecycle: picker.LifecycleSchedulable},
		{name: "KV events on need an endpoint for every rank", kvEvents: true,
			rec: worker(1, func(r *picker.WorkerRecord) {
				r.DataParallelStartRank = u32(2)
				r.DataParallelSize = u32(2)
				r.KVEventsEndpoints = map[string]string{"2": "tcp://w:5557", "7": "tcp://w:9"}
			}),
			lifecycle: picker.LifecycleIncomplete, reasons: []string{"kv_events endpoint is required for dp_rank 3"}},
		{name: "KV events on accept the single-rank shorthand", kvEvents: true,
			rec:       worker(1, func(r *picker.WorkerRecord) { r.KVEventsEndpoint = "tcp://w:5557" }),
			lifecycle: picker.LifecycleSchedulable},
		{name: "the shorthand does not cover two ranks", kvEvents: true,
			rec: worker(1, func(r *picker.WorkerRecord) {
				r.KVEventsEndpoint = "tcp://w:5557"
				r.DataParallelSize = u32(2)
			}),
			lifecycle: picker.LifecycleIncomplete,
			reasons:   []string{"kv_events endpoint is required for dp_rank 0", "kv_events endpoint is required for dp_rank 1"}},
		{name: "a multi-rank worker with replay_endpoint stays incomplete", kvEvents: true,
			rec: worker(1, func(r *picker.WorkerRecord) {
				r.DataParallelSize = u32(2)
				r.KVEventsEndpoints = map[string]string{"0": "tcp://w:1", "1": "tcp://w:2"}
				r.ReplayEndpoint = "tcp://w:3"
			}),
			lifecycle: picker.LifecycleIncomplete, reasons: []string{"replay_endpoint is supported only for data_parallel_size 1"}},
		{name: "a listener start failure is a reconciliation failure", kvEvents: true, failAttach: badEndpoint,
			rec: worker(1, func(r *picker.WorkerRecord) {
				r.DataParallelSize = u32(2)
				r.KVEventsEndpoints = map[string]string{"0": "tcp://w:1", "1": "bad"}
			}),
			lifecycle: picker.LifecycleIncomplete, reasons: []string{"reconciliation failed: " + badEndpoint.Error()}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ev := pickertest.NewEventSource()
			ev.FailAttach(func(picker.WorkerEventSpec) error { return tc.failAttach })
			s := newService(t, func(c *picker.Config) {
				if tc.kvEvents {
					withEvents(ev)(c)
				}
				c.QueueingEnabled = tc.queueing
			})
			st, err := s.UpsertWorker(ctxb(), tc.rec, picker.SourceAPI)
			if err != nil {
				t.Fatalf("UpsertWorker: %v", err)
			}
			if st.Lifecycle != tc.lifecycle {
				t.Errorf("lifecycle = %q, want %q", st.Lifecycle, tc.lifecycle)
			}
			if diff := cmp.Diff(tc.reasons, st.NotSchedulableReasons); diff != "" {
				t.Errorf("reasons (-want +got):\n%s", diff)
			}
			_, attached := ev.Attached(1)
			if tc.kvEvents && attached != (tc.lifecycle == picker.LifecycleSchedulable) {
				t.Errorf("attached = %v with lifecycle %s", attached, st.Lifecycle)
			}
			if got := s.Ready().Ready; got != (tc.lifecycle == picker.LifecycleSchedulable) {
				t.Errorf("Ready = %v", got)
			}
		})
	}
}

func TestUpsertWorkerValidatesTheEndpoint(t *testing.T) {
	cases := []struct {
		name     string
		endpoint string
		reason   string // "" = schedulable
	}{
		{name: "an http URL with host and port is valid", endpoint: "http://10.0.0.10:8000"},
		{name: "an http URL without a port is valid (port 80 implied)", endpoint: "http://localhost"},
		{name: "an https URL with a base path is valid", endpoint: "https://worker.example:8443/v1"},
		{name: "a bracketed IPv6 host is valid", endpoint: "http://[fd00::3]:8000"},
		{name: "port 65535 is valid", endpoint: "http://w:65535"},
		{name: "a unix socket URL is invalid", endpoint: "unix:///tmp/sock",
			reason: `endpoint "unix:///tmp/sock" is invalid: scheme "unix" is not http or https`},
		{name: "surrounding whitespace is invalid", endpoint: " http://10.0.0.10:80 ",
			reason: `endpoint " http://10.0.0.10:80 " is invalid: it has leading or trailing whitespace`},
		{name: "a trailing newline is invalid", endpoint: "http://10.0.0.10:80\n",
			reason: `endpoint "http://10.0.0.10:80\n" is invalid: it has leading or trailing whitespace`},
		{name: "a port above 65535 is invalid", endpoint: "http://10.0.0.9:99999",
			reason: `endpoint "http://10.0.0.9:99999" is invalid: port 99999 is out of range 1..65535`},
		{name: "port 0 is invalid", endpoint: "http://10.0.0.9:0",
			reason: `endpoint "http://10.0.0.9:0" is invalid: port 0 is out of range 1..65535`},
		{name: "an empty port after the colon is invalid", endpoint: "http://w:",
			reason: `endpoint "http://w:" is invalid: empty port (omit the colon for the scheme's default port)`},
		{name: "a host:port without scheme is invalid", endpoint: "x:1",
			reason: `endpoint "x:1" is invalid: missing scheme (want http://host[:port] or https://host[:port])`},
		{name: "a bare IP and port is invalid", endpoint: "10.0.0.1:8000",
			reason: `endpoint "10.0.0.1:8000" is invalid: missing scheme (want http://host[:port] or https://host[:port])`},
		{name: "a URL without host is invalid", endpoint: "http:///v1",
			reason: `endpoint "http:///v1" is invalid: missing host (want http://host[:port])`},
		{name: "a URL with only a port is invalid", endpoint: "http://:8000",
			reason: `endpoint "http://:8000" is invalid: empty host`},
		{name: "a non-numeric port is invalid", endpoint: "http://w:http",
			reason: `endpoint "http://w:http" is invalid: not a URL: invalid port ":http" after host`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newService(t)
			st := mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.Endpoint = tc.endpoint }))
			var want []string
			wantLife := picker.LifecycleSchedulable
			if tc.reason != "" {
				want, wantLife = []string{tc.reason}, picker.LifecycleIncomplete
			}
			if st.Lifecycle != wantLife {
				t.Errorf("lifecycle = %q, want %q", st.Lifecycle, wantLife)
			}
			if diff := cmp.Diff(want, st.NotSchedulableReasons); diff != "" {
				t.Errorf("reasons (-want +got):\n%s", diff)
			}
			if st.Endpoint != tc.endpoint {
				t.Errorf("stored endpoint %q, want it echoed unchanged as %q", st.Endpoint, tc.endpoint)
			}
			if err := picker.ValidateEndpoint(tc.endpoint); (err == nil) != (tc.reason == "") || (err != nil && err.Error() != tc.reason) {
				t.Errorf("ValidateEndpoint = %v, want %q", err, tc.reason)
			}
		})
	}
	t.Run("a patch to an invalid endpoint makes a schedulable worker incomplete and a fix restores it", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		st, err := s.PatchWorker(ctxb(), 1, picker.WorkerPatch{Endpoint: strp("http://10.0.0.9:99999")})
		if err != nil {
			t.Fatal(err)
		}
		if st.Lifecycle != picker.LifecycleIncomplete || !cmp.Equal(st.NotSchedulableReasons,
			[]string{`endpoint "http://10.0.0.9:99999" is invalid: port 99999 is out of range 1..65535`}) {
			t.Fatalf("after a bad patch: lifecycle %s, reasons %q", st.Lifecycle, st.NotSchedulableReasons)
		}
		if s.Ready().Ready {
			t.Fatal("service is ready with only an unusable endpoint")
		}
		if _, err := s.Select(ctxb(), tokenReq(tokens(8))); picker.KindOf(err) != picker.KindNotReady {
			t.Fatalf("Select routed to an unusable endpoint: err %v", err)
		}
		st, err = s.PatchWorker(ctxb(), 1, picker.WorkerPatch{Endpoint: strp("http://10.0.0.9:9999")})
		if err != nil || st.Lifecycle != picker.LifecycleSchedulable {
			t.Fatalf("after the fix: lifecycle %s, reasons %q, err %v", st.Lifecycle, st.NotSchedulableReasons, err)
		}
	})
}

func TestUpsertWorkerRejectsKVEventsEndpointKeysThatAreNotRanks(t *testing.T) {
	cases := []struct {
		name     string
		kvEvents bool
		keys     map[string]string
		reasons  []string
	}{
		{name: "a non-numeric key keeps the worker incomplete naming the key", keys: map[string]string{"0": "tcp://w:1", "abc": "tcp://w:2"},
			reasons: []string{`kv_events_endpoints key "abc" is not a dp_rank (want a decimal integer in 0..4294967295)`}},
		{name: "a key past 2^32-1 keeps the worker incomplete naming the key", keys: map[string]string{"0": "tcp://w:1", "4294967296": "tcp://w:2"},
			reasons: []string{`kv_events_endpoints key "4294967296" is not a dp_rank (want a decimal integer in 0..4294967295)`}},
		{name: "every bad key is named once, in key order", keys: map[string]string{"0": "tcp://w:1", "-1": "tcp://w:2", " 1": "tcp://w:3"},
			reasons: []string{
				`kv_events_endpoints key " 1" is not a dp_rank (want a decimal integer in 0..4294967295)`,
				`kv_events_endpoints key "-1" is not a dp_rank (want a decimal integer in 0..4294967295)`,
			}},
		{name: "with KV events on a bad key is reported next to the missing rank", kvEvents: true, keys: map[string]string{"zero": "tcp://w:1"},
			reasons: []string{
				`kv_events_endpoints key "zero" is not a dp_rank (want a decimal integer in 0..4294967295)`,
				"kv_events endpoint is required for dp_rank 0",
			}},
		{name: "the largest rank is a valid key", keys: map[string]string{"0": "tcp://w:1", "4294967295": "tcp://w:2"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newService(t, func(c *picker.Config) {
				if tc.kvEvents {
					withEvents(pickertest.NewEventSource())(c)
				}
			})
			st := mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.KVEventsEndpoints = tc.keys }))
			if diff := cmp.Diff(tc.reasons, st.NotSchedulableReasons); diff != "" {
				t.Errorf("reasons (-want +got):\n%s", diff)
			}
			if wantSched := len(tc.reasons) == 0; (st.Lifecycle == picker.LifecycleSchedulable) != wantSched {
				t.Errorf("lifecycle = %s", st.Lifecycle)
			}
		})
	}
}

func TestTaintsAreStoredAsASortedSet(t *testing.T) {
	cases := []struct {
		name  string
		in    []string
		want  []string
		patch bool
	}{
		{name: "a duplicated taint is stored once", in: []string{"a", "a"}, want: []string{"a"}},
		{name: "taints are stored sorted", in: []string{"gpu", "fast", "gpu"}, want: []string{"fast", "gpu"}},
		{name: "a patch dedupes taints too", in: []string{"z", "a", "z"}, want: []string{"a", "z"}, patch: true},
		{name: "no taints stay absent", in: nil, want: nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newService(t)
			in := slicesClone(tc.in)
			var st picker.WorkerState
			if tc.patch {
				mustUpsert(t, s, worker(1))
				var err error
				if st, err = s.PatchWorker(ctxb(), 1, picker.WorkerPatch{Taints: in}); err != nil {
					t.Fatal(err)
				}
			} else {
				st = mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.Taints = in }))
			}
			if diff := cmp.Diff(tc.want, st.Taints); diff != "" {
				t.Errorf("stored taints (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tc.want, s.Workers("", "")[0].Taints); diff != "" {
				t.Errorf("listed taints (-want +got):\n%s", diff)
			}
			if !cmp.Equal(in, tc.in) {
				t.Errorf("caller's slice modified: %q", in)
			}
		})
	}
}

func slicesClone(s []string) []string {
	if s == nil {
		return nil
	}
	return append([]string(nil), s...)
}

func TestUpsertWorkerAttachesEveryRankWithItsEndpoint(t *testing.T) {
	ev := pickertest.NewEventSource()
	s := newService(t, withEvents(ev))
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) {
		r.DataParallelStartRank = u32(2)
		r.DataParallelSize = u32(2)
		r.KVEventsEndpoints = map[string]string{"2": "tcp://w:1", "3": "tcp://w:2"}
		r.IsEagle = true
	}))
	spec, ok := ev.Attached(1)
	if !ok {
		t.Fatal("worker 1 was not attached")
	}
	want := picker.WorkerEventSpec{
		WorkerID: 1, Partition: picker.PartitionKey{ModelName: "model", RoutingGroup: "default"}, BlockSize: 4, IsEagle: true,
		DPStartRank: 2, DPSize: 2, Endpoints: map[uint32]string{2: "tcp://w:1", 3: "tcp://w:2"},
	}
	if diff := cmp.Diff(want, spec); diff != "" {
		t.Errorf("spec (-want +got):\n%s", diff)
	}
}

func TestPartitionInvariantClashIsAReconciliationFailure(t *testing.T) {
	cases := []struct {
		name   string
		second picker.WorkerRecord
		reason string
	}{
		{"a different block_size clashes", worker(2, func(r *picker.WorkerRecord) { r.BlockSize = u32(8) }),
			"reconciliation failed: worker 2 block_size 8 does not match partition model:default block_size 4"},
		{"a different is_eagle clashes", worker(2, func(r *picker.WorkerRecord) { r.IsEagle = true }),
			"reconciliation failed: worker 2 is_eagle true does not match partition model:default is_eagle false"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newService(t)
			mustUpsert(t, s, worker(1))
			st := mustUpsert(t, s, tc.second)
			if st.Lifecycle != picker.LifecycleIncomplete || len(st.NotSchedulableReasons) != 1 || st.NotSchedulableReasons[0] != tc.reason {
				t.Fatalf("got %s %q, want incomplete %q", st.Lifecycle, st.NotSchedulableReasons, tc.reason)
			}
			// The clashing worker does not define the partition: once worker 1 leaves, a
			// block-size-4 worker is still accepted and a block-size-8 one redefines it.
			if _, err := s.DeleteWorker(ctxb(), 1); err != nil {
				t.Fatal(err)
			}
			if st := mustUpsert(t, s, worker(3)); st.Lifecycle != picker.LifecycleSchedulable {
				t.Fatalf("worker 3 after the clash: %s %q", st.Lifecycle, st.NotSchedulableReasons)
			}
		})
	}
	t.Run("the last worker replaced under another block size redefines the partition", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		st := mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.BlockSize = u32(16) }))
		if st.Lifecycle != picker.LifecycleSchedulable {
			t.Fatalf("re-upsert with block size 16: %s %q", st.Lifecycle, st.NotSchedulableReasons)
		}
		sel, err := s.Select(ctxb(), tokenReq(tokens(32)))
		if err != nil || sel.BlockSize != 16 {
			t.Fatalf("select after redefinition: %+v, %v", sel, err)
		}
	})
}

func TestUpsertMovesWorkerBetweenPartitions(t *testing.T) {
	s := newService(t)
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.RoutingGroup = "a" }))
	sel, err := s.SelectAndReserve(ctxb(), tokenReq([]uint32{1, 2, 3, 4}, func(r *picker.SelectRequest) {
		r.RoutingGroup = "a"
		r.SelectionID = "r1"
	}))
	if err != nil {
		t.Fatal(err)
	}
	if got := loadOf(t, s, "model", "a", 1, 0).ActiveRequests; got != 1 {
		t.Fatalf("active requests before the move = %d", got)
	}
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.RoutingGroup = "b" }))

	// The old partition is drained and not ready; its booking was released.
	_, err = s.Select(ctxb(), tokenReq([]uint32{1, 2, 3, 4}, func(r *picker.SelectRequest) { r.RoutingGroup = "a" }))
	wantKind(t, err, picker.KindNotReady, "no schedulable workers for model:a: there is no partition model:a (registered models: model)")
	wantKind(t, s.Free(ctxb(), sel.SelectionID), picker.KindNotFound, "reservation r1 not found")
	for _, pl := range s.Loads("model", "a") {
		if len(pl.Loads) != 0 {
			t.Errorf("old partition still lists loads %+v", pl.Loads)
		}
	}
	// The new one serves.
	sel, err = s.Select(ctxb(), tokenReq([]uint32{1, 2, 3, 4}, func(r *picker.SelectRequest) { r.RoutingGroup = "b" }))
	if err != nil || sel.WorkerID != 1 || sel.RoutingGroup != "b" {
		t.Fatalf("select in the new group: %+v, %v", sel, err)
	}
	if ws := s.Workers("", "a"); len(ws) != 0 {
		t.Errorf("group a still lists %d workers", len(ws))
	}
}

func TestDeleteWorker(t *testing.T) {
	t.Run("returns the final record as unschedulable and forgets the worker", func(t *testing.T) {
		ev := pickertest.NewEventSource()
		s := newService(t, withEvents(ev))
		mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.KVEventsEndpoint = "tcp://w:1" }))
		mustUpsert(t, s, worker(2, func(r *picker.WorkerRecord) { r.KVEventsEndpoint = "tcp://w:2" }))
		sel, err := s.SelectAndReserve(ctxb(), tokenReq([]uint32{1, 2, 3, 4}, func(r *picker.SelectRequest) {
			r.PinnedWorker = &picker.WorkerRank{WorkerID: 1}
		}))
		if err != nil {
			t.Fatal(err)
		}
		st, err := s.DeleteWorker(ctxb(), 1)
		if err != nil {
			t.Fatal(err)
		}
		if st.Lifecycle != picker.LifecycleUnschedulable || st.WorkerID != 1 || st.Endpoint != "http://worker-1:8000" {
			t.Errorf("final record = %+v", st)
		}
		if _, ok := ev.Attached(1); ok {
			t.Error("worker 1 listeners still attached")
		}
		if ws := s.Workers("", ""); len(ws) != 1 || ws[0].WorkerID != 2 {
			t.Errorf("Workers = %+v", ws)
		}
		wantKind(t, s.Free(ctxb(), sel.SelectionID), picker.KindNotFound, "")
	})
	t.Run("an unknown worker is not found", func(t *testing.T) {
		s := newService(t)
		_, err := s.DeleteWorker(ctxb(), 9)
		wantKind(t, err, picker.KindNotFound, "worker 9 not found")
	})
	t.Run("works during shutdown", func(t *testing.T) {
		s := newService(t)
		mustUpsert(t, s, worker(1))
		s.BeginShutdown()
		if _, err := s.DeleteWorker(ctxb(), 1); err != nil {
			t.Fatal(err)
		}
		_, err := s.UpsertWorker(ctxb(), worker(1), picker.SourceAPI)
		wantKind(t, err, picker.KindNotReady, "selection service is shutting down")
	})
}

// overlapOf selects toks pinned to (w, r) and returns rank r's device overlap in tokens.
func overlapOf(t *testing.T, s *picker.Service, toks []uint32, w uint64, r uint32) uint64 {
	t.Helper()
	sel, err := s.Select(ctxb(), tokenReq(toks, func(q *picker.SelectRequest) {
		q.PinnedWorker = &picker.WorkerRank{WorkerID: w, DPRank: r}
	}))
	if err != nil {
		t.Fatal(err)
	}
	return sel.Overlap.DP[itoa(uint64(r))]
}

func TestIndexRowsAcrossCatalogUpdates(t *testing.T) {
	toks := []uint32{1, 2, 3, 4}
	local := kvindex.BlockHashes(toks, 4, kvindex.BaseSeed)
	twoRanks := func(ep1 string) func(*picker.WorkerRecord) {
		return func(r *picker.WorkerRecord) {
			r.DataParallelSize = u32(2)
			r.KVEventsEndpoints = map[string]string{"0": "tcp://w:1", "1": ep1}
		}
	}
	setup := func(t *testing.T) (*picker.Service, *pickertest.EventSource) {
		ev := pickertest.NewEventSource()
		s := newService(t, withEvents(ev))
		mustUpsert(t, s, worker(1, twoRanks("tcp://w:2")))
		ev.Store(t, 1, 0, kvindex.TierDevice, nil, local...)
		ev.Store(t, 1, 1, kvindex.TierDevice, nil, local...)
		return s, ev
	}
	t.Run("a metadata-only update keeps the cached rows", func(t *testing.T) {
		s, _ := setup(t)
		mustUpsert(t, s, worker(1, twoRanks("tcp://w:2"), func(r *picker.WorkerRecord) { r.TotalKVBlocks = u64(100) }))
		if got := overlapOf(t, s, toks, 1, 0); got != 4 {
			t.Errorf("rank 0 overlap = %d, want 4", got)
		}
		if got := overlapOf(t, s, toks, 1, 1); got != 4 {
			t.Errorf("rank 1 overlap = %d, want 4", got)
		}
	})
	t.Run("a changed rank endpoint drops only that rank's rows", func(t *testing.T) {
		s, _ := setup(t)
		mustUpsert(t, s, worker(1, twoRanks("tcp://w:9")))
		sel, err := s.Select(ctxb(), tokenReq(toks, func(q *picker.SelectRequest) {
			q.PinnedWorker = &picker.WorkerRank{WorkerID: 1, DPRank: 1}
		}))
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(map[string]uint64{"0": 4, "1": 0}, sel.Overlap.DP); diff != "" {
			t.Errorf("dp overlap (-want +got):\n%s", diff)
		}
	})
	t.Run("a rank that left the range loses its rows", func(t *testing.T) {
		s, ev := setup(t)
		mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.KVEventsEndpoint = "tcp://w:1" }))
		mustUpsert(t, s, worker(1, twoRanks("tcp://w:2")))
		_ = ev
		if got := overlapOf(t, s, toks, 1, 0); got != 4 {
			t.Errorf("rank 0 overlap = %d, want 4 (kept)", got)
		}
		if got := overlapOf(t, s, toks, 1, 1); got != 0 {
			t.Errorf("rank 1 overlap = %d, want 0 (cleared)", got)
		}
	})
	t.Run("delete followed by add clears the rows", func(t *testing.T) {
		s, _ := setup(t)
		if _, err := s.DeleteWorker(ctxb(), 1); err != nil {
			t.Fatal(err)
		}
		mustUpsert(t, s, worker(1, twoRanks("tcp://w:2")))
		if got := overlapOf(t, s, toks, 1, 0); got != 0 {
			t.Errorf("overlap after delete+add = %d, want 0", got)
		}
	})
	t.Run("a worker that becomes incomplete loses its listeners and rows", func(t *testing.T) {
		s, ev := setup(t)
		st := mustUpsert(t, s, worker(1, twoRanks("")))
		if st.Lifecycle != picker.LifecycleIncomplete {
			t.Fatalf("lifecycle %s", st.Lifecycle)
		}
		if _, ok := ev.Attached(1); ok {
			t.Error("still attached")
		}
		mustUpsert(t, s, worker(1, twoRanks("tcp://w:2")))
		if got := overlapOf(t, s, toks, 1, 0); got != 0 {
			t.Errorf("overlap = %d, want 0", got)
		}
	})
	t.Run("the last worker replaced by a new registration is indexed in the same partition", func(t *testing.T) {
		s, ev := setup(t)
		if _, err := s.DeleteWorker(ctxb(), 1); err != nil {
			t.Fatal(err)
		}
		mustUpsert(t, s, worker(2, func(r *picker.WorkerRecord) { r.KVEventsEndpoint = "tcp://w:5" }))
		ev.Store(t, 2, 0, kvindex.TierDevice, nil, local...)
		if got := overlapOf(t, s, toks, 2, 0); got != 4 {
			t.Errorf("replacement overlap = %d, want 4", got)
		}
	})
}

func TestPatchWorker(t *testing.T) {
	t.Run("a patch fixing the endpoint makes the worker schedulable", func(t *testing.T) {
		s := newService(t)
		st := mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.Endpoint = "" }))
		if st.Lifecycle != picker.LifecycleIncomplete {
			t.Fatalf("lifecycle %s", st.Lifecycle)
		}
		st, err := s.PatchWorker(ctxb(), 1, picker.WorkerPatch{Endpoint: strp("http://w:1"), Taints: []string{"gpu"}})
		if err != nil {
			t.Fatal(err)
		}
		if st.Lifecycle != picker.LifecycleSchedulable || st.Endpoint != "http://w:1" || st.ModelName != "model" ||
			!cmp.Equal(st.Taints, []string{"gpu"}) || *st.BlockSize != 4 {
			t.Errorf("patched record = %+v", st)
		}
	})
	t.Run("an unknown worker is not found", func(t *testing.T) {
		s := newService(t)
		_, err := s.PatchWorker(ctxb(), 4, picker.WorkerPatch{})
		wantKind(t, err, picker.KindNotFound, "worker 4 not found")
	})
	t.Run("a patch keeps the worker's source", func(t *testing.T) {
		s := newService(t)
		if _, err := s.UpsertWorker(ctxb(), worker(1), picker.SourceDiscovery); err != nil {
			t.Fatal(err)
		}
		st, err := s.PatchWorker(ctxb(), 1, picker.WorkerPatch{TotalKVBlocks: u64(5)})
		if err != nil || st.Source != picker.SourceDiscovery {
			t.Fatalf("source = %q, err %v", st.Source, err)
		}
	})
}

func TestWorkerSourceStaysWithDiscovery(t *testing.T) {
	s := newService(t)
	if st := mustUpsert(t, s, worker(1)); st.Source != picker.SourceAPI {
		t.Fatalf("source = %q", st.Source)
	}
	st, _ := s.UpsertWorker(ctxb(), worker(1), picker.SourceDiscovery)
	if st.Source != picker.SourceDiscovery {
		t.Fatalf("after discovery upsert source = %q", st.Source)
	}
	if st := mustUpsert(t, s, worker(1)); st.Source != picker.SourceDiscovery {
		t.Fatalf("an API update took the worker from discovery: %q", st.Source)
	}
}

func TestWorkersAndReady(t *testing.T) {
	s := newService(t)
	if r := s.Ready(); r.Ready || r.SchedulableWorkers != 0 || len(r.Workers) != 0 {
		t.Fatalf("empty Ready = %+v", r)
	}
	mustUpsert(t, s, worker(3))
	mustUpsert(t, s, worker(1, func(r *picker.WorkerRecord) { r.RoutingGroup = "g" }))
	mustUpsert(t, s, worker(2, func(r *picker.WorkerRecord) { r.ModelName = "other"; r.Endpoint = "" }))
	ids := func(ws []picker.WorkerState) []uint64 {
		var out []uint64
		for _, w := range ws {
			out = append(out, w.WorkerID)
		}
		return out
	}
	for _, tc := range []struct {
		name, model, group string
		want               []uint64
	}{
		{"no filter lists every worker sorted by id", "", "", []uint64{1, 2, 3}},
		{"model_name filters", "model", "", []uint64{1, 3}},
		{"routing_group filters", "", "default", []uint64{2, 3}},
		{"both filter", "model", "g", []uint64{1}},
		{"an unknown partition lists nothing", "x", "", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if diff := cmp.Diff(tc.want, ids(s.Workers(tc.model, tc.group))); diff != "" {
				t.Error(diff)
			}
		})
	}
	t.Run("defaults fill model_name and routing_group", func(t *testing.T) {
		ws := s.Workers("other", "")
		if len(ws) != 1 || ws[0].RoutingGroup != "default" {
			t.Fatalf("%+v", ws)
		}
	})
	r := s.Ready()
	if !r.Ready || r.SchedulableWorkers != 2 || len(r.Workers) != 3 {
		t.Fatalf("Ready = %+v", r)
	}
	if got := s.Models(); !cmp.Equal(got, []string{"model", "other"}) {
		t.Errorf("Models = %v", got)
	}
	if !s.HasModel("other") || s.HasModel("x") {
		t.Error("HasModel")
	}
	s.BeginShutdown()
	if s.Ready().Ready {
		t.Error("ready while shutting down")
	}
}

func TestPolicyFactory(t *testing.T) {
	t.Run("receives worker type select and the partition, once per partition", func(t *testing.T) {
		var calls []string
		s := newService(t, func(c *picker.Config) {
			c.Policy = func(cfg policies.RouterConfig, wt string, p policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
				calls = append(calls, wt+" "+p.String())
				return policies.NewPolicy(cfg, wt, nil, lowestCost)
			}
		})
		mustUpsert(t, s, worker(1))
		mustUpsert(t, s, worker(2))
		mustUpsert(t, s, worker(3, func(r *picker.WorkerRecord) { r.RoutingGroup = "g" }))
		if diff := cmp.Diff([]string{"select model:default", "select model:g"}, calls); diff != "" {
			t.Error(diff)
		}
	})
	t.Run("a failing factory rejects the registration", func(t *testing.T) {
		s := newService(t, func(c *picker.Config) {
			c.Policy = func(policies.RouterConfig, string, policies.PartitionID) (*policies.WorkerSelectionPolicy, error) {
				return nil, errors.New("boom")
			}
		})
		_, err := s.UpsertWorker(ctxb(), worker(1), picker.SourceAPI)
		wantKind(t, err, picker.KindBadRequest, "")
		if !strings.Contains(err.Error(), "boom") {
			t.Errorf("error %q does not name the cause", err)
		}
		if len(s.Workers("", "")) != 0 {
			t.Error("worker registered despite the failure")
		}
	})
}

func TestNewValidatesConfiguration(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*picker.Config)
		want string
	}{
		{"a negative temperature", func(c *picker.Config) { c.Router.RouterTemperature = -1 }, "router_temperature"},
		{"a host weight above 1", func(c *picker.Config) { c.Router.HostCacheHitWeight = 1.5 }, "host_cache_hit_weight"},
		{"a zero expiry", func(c *picker.Config) { c.Router.ActiveRequestExpirySecs = 0 }, "active_request_expiry_secs"},
		{"KV events without a source", func(c *picker.Config) { c.Router.UseKVEvents = true; c.EventSource = nil }, "use_kv_events"},
	} {
		t.Run(tc.name+" stops startup", func(t *testing.T) {
			cfg := picker.DefaultConfig()
			cfg.Router.UseKVEvents = false
			tc.mod(&cfg)
			_, err := picker.New(cfg)
			if err == nil || !strings.HasPrefix(err.Error(), "invalid KV router configuration: ") || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want one naming %s", err, tc.want)
			}
		})
	}
}
