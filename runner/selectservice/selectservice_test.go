package selectservice_test

import (
	"context"
	"errors"
	"flag"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/httpapi"
	"github.com/kvepp/kvepp/picker/queue"
	"github.com/kvepp/kvepp/runner/selectservice"
)

func TestParseFlags(t *testing.T) {
	tr, fa := true, false
	for _, tc := range []struct {
		name string
		args []string
		want func(*selectservice.Config)
		err  string
	}{
		{name: "no flags give the documented defaults", want: func(*selectservice.Config) {}},
		{name: "every documented flag is read", args: []string{
			"--port", "9000", "--threads=2", "--indexer-peers", "http://a:8092, http://b:8092",
			"--selection-cache-ttl-secs", "2.5", "--selection-cache-max-entries", "10", "--selection-cache-max-bytes", "1024",
			"--session-affinity-ttl-secs", "600", "--router-assume-kv-reuse",
		}, want: func(c *selectservice.Config) {
			c.Port, c.Threads = 9000, 2
			c.IndexerPeers = []string{"http://a:8092", "http://b:8092"}
			c.SelectionCacheTTL, c.SelectionCacheMaxEntries, c.SelectionCacheMaxBytes = 2500*time.Millisecond, 10, 1024
			c.SessionAffinityTTL = 10 * time.Minute
			c.AssumeKVReuse = &tr
		}},
		{name: "--no-router-assume-kv-reuse turns reuse off", args: []string{"--no-router-assume-kv-reuse"},
			want: func(c *selectservice.Config) { c.AssumeKVReuse = &fa }},
		{name: "a port of 0 asks for an ephemeral port", args: []string{"--port=0"}, want: func(c *selectservice.Config) { c.Port = 0 }},
		{name: "session affinity ttl 0 fails", args: []string{"--session-affinity-ttl-secs=0"}, err: "--session-affinity-ttl-secs"},
		{name: "session affinity ttl above a year fails", args: []string{"--session-affinity-ttl-secs=31536001"}, err: "31536000"},
		{name: "a fractional session affinity ttl fails", args: []string{"--session-affinity-ttl-secs=1.5"}, err: "integer"},
		{name: "selection cache ttl must be positive", args: []string{"--selection-cache-ttl-secs=0"}, err: "--selection-cache-ttl-secs"},
		{name: "selection cache entries must be at least 1", args: []string{"--selection-cache-max-entries=0"}, err: "--selection-cache-max-entries"},
		{name: "selection cache bytes must be at least 1", args: []string{"--selection-cache-max-bytes=-1"}, err: "--selection-cache-max-bytes"},
		{name: "threads must be at least 1", args: []string{"--threads=0"}, err: "--threads"},
		{name: "ports stop at 65535", args: []string{"--port=70000"}, err: "--port"},
		{name: "keyed tracking hashes are rejected", args: []string{"--router-tracking-hash=keyed-xxh3-v1"}, err: "tracking hash keyed-xxh3-v1 is not supported"},
		{name: "tracking key files are rejected", args: []string{"--router-tracking-key-file=/k"}, err: "not supported"},
		{name: "indexer peers must be http URLs", args: []string{"--indexer-peers=tcp://a:1"}, err: "http(s)"},
		{name: "unknown flags fail", args: []string{"--grpc-port=1"}, err: "flag provided but not defined"},
		{name: "the replica sync port must not be 0", args: []string{"--replica-sync-port=0"}, err: "--replica-sync-port must be in 1..65535"},
		{name: "the replica sync port stops at 65535", args: []string{"--replica-sync-port=65536"}, err: "--replica-sync-port must be in 1..65535"},
		{name: "the replica sync port is an integer", args: []string{"--replica-sync-port=x"}, err: "--replica-sync-port must be an integer"},
		{name: "replica peers need the port", args: []string{"--replica-sync-peers=tcp://a:9092"}, err: "--replica-sync-peers requires --replica-sync-port"},
		{name: "replica peers must be endpoints", args: []string{"--replica-sync-port=9092", "--replica-sync-peers=tcp://a"}, err: "--replica-sync-peers: invalid endpoint"},
		{name: "positional arguments fail", args: []string{"extra"}, err: "unexpected argument"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := selectservice.ParseFlags(tc.args, io.Discard)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) || !strings.HasPrefix(err.Error(), "invalid KV router configuration: ") {
					t.Fatalf("ParseFlags(%v) = %v, want an error containing %q", tc.args, err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := selectservice.DefaultConfig()
			tc.want(&want)
			if got.Port != want.Port || got.Threads != want.Threads || strings.Join(got.IndexerPeers, ",") != strings.Join(want.IndexerPeers, ",") ||
				got.SelectionCacheTTL != want.SelectionCacheTTL || got.SelectionCacheMaxEntries != want.SelectionCacheMaxEntries ||
				got.SelectionCacheMaxBytes != want.SelectionCacheMaxBytes || got.SessionAffinityTTL != want.SessionAffinityTTL ||
				(got.AssumeKVReuse == nil) != (want.AssumeKVReuse == nil) || (got.AssumeKVReuse != nil && *got.AssumeKVReuse != *want.AssumeKVReuse) {
				t.Fatalf("ParseFlags(%v) = %+v, want %+v", tc.args, got, want)
			}
		})
	}
	if _, err := selectservice.ParseFlags([]string{"-h"}, io.Discard); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h = %v", err)
	}
}

func TestDefaultsAndApplyTo(t *testing.T) {
	c := selectservice.DefaultConfig()
	if c.Port != 8092 || c.Threads != 4 || c.SelectionCacheTTL != 120*time.Second || c.SelectionCacheMaxEntries != 4096 ||
		c.SelectionCacheMaxBytes != 268435456 || c.SessionAffinityTTL != 0 || c.AssumeKVReuse != nil {
		t.Fatalf("defaults %+v", c)
	}
	off := false
	c.AssumeKVReuse, c.SessionAffinityTTL = &off, time.Hour
	pc := picker.DefaultConfig()
	c.ApplyTo(&pc)
	if pc.Router.AssumeKVReuse || pc.SessionAffinityTTL != time.Hour ||
		pc.SelectionCache != (ledger.PendingConfig{TTL: 120 * time.Second, MaxEntries: 4096, MaxBytes: 268435456}) {
		t.Fatalf("applied %+v", pc)
	}
	pc = picker.DefaultConfig()
	selectservice.DefaultConfig().ApplyTo(&pc)
	if !pc.Router.AssumeKVReuse {
		t.Fatal("an unset flag overrode the environment's assume_kv_reuse")
	}
}

// gate records the EventGate calls.
type gate struct {
	mu    sync.Mutex
	calls []string
}

func (g *gate) record(s string) { g.mu.Lock(); g.calls = append(g.calls, s); g.mu.Unlock() }
func (g *gate) HoldEvents()     { g.record("hold") }
func (g *gate) ReleaseEvents(b bool) {
	if b {
		g.record("release(bootstrapped)")
	} else {
		g.record("release")
	}
}
func (g *gate) Close() error { g.record("close"); return nil }
func (g *gate) String() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return strings.Join(g.calls, ",")
}

func approxPicker() picker.Config {
	pc := picker.DefaultConfig()
	pc.Router.UseKVEvents = false
	return pc
}

// runService starts Run on a loopback listener and returns its address, core and a stop func
// that cancels it and returns Run's result.
func runService(t *testing.T, cfg selectservice.Config, opts selectservice.Options) (string, *picker.Service, func() error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	opts.Listener = ln
	started := make(chan *picker.Service, 1)
	opts.Started = func(_ string, s *picker.Service) { started <- s }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- selectservice.Run(ctx, cfg, opts) }()
	select {
	case s := <-started:
		var once sync.Once
		var res error
		return ln.Addr().String(), s, func() error { once.Do(func() { cancel(); res = <-done }); return res }
	case err := <-done:
		cancel()
		t.Fatalf("Run returned before serving: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not start")
	}
	return "", nil, nil
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func post(t *testing.T, url, body string) (int, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestRunServesTheAPIAndShutsDown(t *testing.T) {
	g := &gate{}
	cfg := selectservice.DefaultConfig()
	cfg.SessionAffinityTTL = time.Minute
	addr, svc, stop := runService(t, cfg, selectservice.Options{Picker: approxPicker(), Events: g})
	if st, body := get(t, "http://"+addr+"/health"); st != 200 || body != `{"status":"ok"}` {
		t.Fatalf("/health = %d %s", st, body)
	}
	if st, _ := post(t, "http://"+addr+"/workers", `{"worker_id":1,"model_name":"model","endpoint":"http://w","block_size":4}`); st != 201 {
		t.Fatalf("POST /workers = %d", st)
	}
	if st, body := post(t, "http://"+addr+"/select_and_reserve", `{"model_name":"model","token_ids":[1,2,3,4],"session_id":"s"}`); st != 200 {
		t.Fatalf("select_and_reserve = %d %s", st, body)
	}
	if _, _, _, ok := svc.SessionBinding(picker.PartitionKey{ModelName: "model", RoutingGroup: "default"}, "s"); !ok {
		t.Fatal("--session-affinity-ttl-secs did not enable affinity")
	}
	if err := stop(); err != nil {
		t.Fatalf("Run after cancel = %v", err)
	}
	if !svc.ShuttingDown() {
		t.Fatal("core not shut down")
	}
	if g.String() != "close" {
		t.Fatalf("event gate calls %q, want the listeners closed", g.String())
	}
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Fatal("port still open after shutdown")
	}
}

func TestRunShutdownClosesTheEventListeners(t *testing.T) {
	// Acceptance 34's listener half: shutdown stops the KV listeners (and 59: sockets released).
	g := &gate{}
	_, _, stop := runService(t, selectservice.DefaultConfig(), selectservice.Options{Picker: approxPicker(), Events: g})
	if g.String() != "" {
		t.Fatalf("calls before shutdown %q", g.String())
	}
	if err := stop(); err != nil || g.String() != "close" {
		t.Fatalf("stop = %v, calls %q", err, g.String())
	}
}

func TestRunRecoversTheIndexFromAPeer(t *testing.T) {
	// A peer selector with a recorded prefix (approximate mode records bookings).
	pc := approxPicker()
	peer, err := picker.New(pc)
	if err != nil {
		t.Fatal(err)
	}
	peerSrv := httptest.NewServer(httpapi.New(peer, httpapi.Options{}))
	defer peerSrv.Close()
	post(t, peerSrv.URL+"/workers", `{"worker_id":1,"model_name":"llama3:8b","routing_group":"g","endpoint":"http://w","block_size":4}`)
	post(t, peerSrv.URL+"/select_and_reserve", `{"model_name":"llama3:8b","routing_group":"g","token_ids":[1,2,3,4,5,6,7,8]}`)
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close()

	g := &gate{}
	cfg := selectservice.DefaultConfig()
	cfg.IndexerPeers = []string{dead.URL, peerSrv.URL + "/"}
	addr, svc, stop := runService(t, cfg, selectservice.Options{Picker: approxPicker(), Events: g})
	defer stop()
	if g.String() != "hold,release(bootstrapped)" {
		t.Fatalf("event gate %q, want events held during recovery", g.String())
	}
	d := svc.Dump()
	if pd, ok := d["llama3:8b:g"]; !ok || pd.BlockSize != 4 || len(pd.Events) != 2 {
		t.Fatalf("recovered dump %+v", d)
	}
	post(t, "http://"+addr+"/workers", `{"worker_id":1,"model_name":"llama3:8b","routing_group":"g","endpoint":"http://w","block_size":4}`)
	st, body := post(t, "http://"+addr+"/select", `{"model_name":"llama3:8b","routing_group":"g","token_ids":[1,2,3,4,5,6,7,8]}`)
	if st != 200 || !strings.Contains(body, `"longest_matched":8`) {
		t.Fatalf("select after recovery = %d %s", st, body)
	}
	t.Run("a worker of another block size discards the recovered index", func(t *testing.T) {
		post(t, "http://"+addr+"/workers", `{"worker_id":1,"model_name":"llama3:8b","routing_group":"g","endpoint":"http://w","block_size":8}`)
		if d := svc.Dump()["llama3:8b:g"]; d.BlockSize != 8 || len(d.Events) != 0 {
			t.Fatalf("dump after the block size change %+v", d)
		}
	})
}

func TestRunStartsEmptyWhenNoPeerAnswers(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	g := &gate{}
	cfg := selectservice.DefaultConfig()
	cfg.IndexerPeers = []string{dead.URL}
	_, svc, stop := runService(t, cfg, selectservice.Options{Picker: approxPicker(), Events: g})
	defer stop()
	dead.Close()
	if g.String() != "hold,release" || len(svc.Dump()) != 0 {
		t.Fatalf("gate %q dump %v", g.String(), svc.Dump())
	}
}

func TestRunRejectsBadConfiguration(t *testing.T) {
	cfg := selectservice.DefaultConfig()
	cfg.SessionAffinityTTL = 2 * ledger.MaxAffinityTTL
	if err := selectservice.Run(context.Background(), cfg, selectservice.Options{Picker: approxPicker()}); err == nil {
		t.Fatal("Run accepted an affinity TTL above a year")
	}
	pc := approxPicker()
	pc.Router.RouterTemperature = -1
	err := selectservice.Run(context.Background(), selectservice.DefaultConfig(), selectservice.Options{Picker: pc})
	if err == nil || !strings.HasPrefix(err.Error(), "invalid KV router configuration: ") {
		t.Fatalf("temperature -1 = %v", err)
	}
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	cfg = selectservice.DefaultConfig()
	cfg.BindAddress, cfg.Port = "127.0.0.1", busy.Addr().(*net.TCPAddr).Port
	if err := selectservice.Run(context.Background(), cfg, selectservice.Options{Picker: approxPicker()}); err == nil || !strings.Contains(err.Error(), "--port") {
		t.Fatalf("busy port = %v", err)
	}
}

func TestRunKeepsTheEnvironmentsQueueAndCacheSettings(t *testing.T) {
	profiles := &queue.Profiles{}
	pc := approxPicker()
	pc.Router.QueuePolicy, pc.Router.OverlapRefreshAfterSecs = "wspt", 3
	pc.Router.ApproximateCachePolicy = picker.ApproxCachePolicyLRU
	pc.PolicyProfiles = profiles
	t.Run("ApplyTo leaves the queue policy, refresh, cache policy and policy profiles alone", func(t *testing.T) {
		got := pc
		selectservice.DefaultConfig().ApplyTo(&got)
		if got.Router.QueuePolicy != "wspt" || got.Router.OverlapRefreshAfterSecs != 3 ||
			got.Router.ApproximateCachePolicy != picker.ApproxCachePolicyLRU || got.PolicyProfiles != profiles {
			t.Fatalf("applied router %+v profiles %p", got.Router, got.PolicyProfiles)
		}
	})
	t.Run("the served core bounds each rank by total_kv_blocks under lru", func(t *testing.T) {
		addr, _, stop := runService(t, selectservice.DefaultConfig(), selectservice.Options{Picker: pc})
		defer stop()
		base := "http://" + addr
		if st, body := post(t, base+"/workers", `{"worker_id":1,"model_name":"m","endpoint":"http://w","block_size":4,"total_kv_blocks":2}`); st != 201 {
			t.Fatalf("POST /workers = %d %s", st, body)
		}
		prompt := `{"model_name":"m","token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]}`
		if st, body := post(t, base+"/select_and_reserve", prompt); st != 200 {
			t.Fatalf("select_and_reserve = %d %s", st, body)
		}
		if st, body := post(t, base+"/select", prompt); st != 200 || !strings.Contains(body, `"longest_matched":8`) {
			t.Fatalf("select = %d %s, want 8 tokens (2 blocks) left by lru", st, body)
		}
	})
}

// TestRunAnswersOversizedHeadersWithJSON: headers over 1 MiB get the API's JSON 431.
func TestRunAnswersOversizedHeadersWithJSON(t *testing.T) {
	addr, _, stop := runService(t, selectservice.DefaultConfig(), selectservice.Options{Picker: approxPicker()})
	defer stop()
	req, err := http.NewRequest(http.MethodGet, "http://"+addr+"/health", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-Big", strings.Repeat("a", 2<<20))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge || !strings.HasPrefix(string(b), `{"error":"request headers are `) {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
}
