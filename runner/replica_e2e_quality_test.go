package runner

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvepp/kvepp/enginesim"
	"github.com/kvepp/kvepp/enginesim/frontproxy"
	"github.com/kvepp/kvepp/picker"
)

// qualityResult is the routing quality of one setup on the conversation workload.
type qualityResult struct {
	HitRate  float64       // cached prompt tokens / prompt tokens over the pool
	MeanTTFT time.Duration // simulated time to first token (queue + uncached prefill)
	P90TTFT  time.Duration
	Requests int64
}

// runQuality replays a multi-turn conversation workload against 4 simulated vLLM workers through
// `replicas` kvepp EPPs (KV events on, the Qwen3 tokenizer) behind a round-robin front: each
// request goes to the next replica's Envoy stand-in (frontproxy), so consecutive turns of one
// conversation are routed by different replicas. withSync turns replica sync on between them.
func runQuality(t *testing.T, replicas int, withSync bool) qualityResult {
	t.Helper()
	pool, err := enginesim.NewPool(4, enginesim.Config{TimeScale: 0.02, PrefillPerToken: 400 * time.Microsecond,
		DecodePerToken: 10 * time.Millisecond, SerialPrefill: true, CapacityBlocks: 4096, StreamInterval: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	insts := make([]*Instance, replicas)
	for i := range insts {
		cfg := loopbackConfig(t)
		cfg.DrainTimeout, cfg.LogLevel = 0, "error"
		if withSync {
			cfg.ReplicaSyncPort = OptPort{Set: true}
		}
		inst, err := Start(context.Background(), Options{Config: cfg})
		if err != nil {
			t.Fatal(err)
		}
		defer inst.Stop(context.Background())
		insts[i] = inst
		for j, w := range pool.Workers() {
			bs := uint32(enginesim.DefaultBlockSize)
			rec := picker.WorkerRecord{WorkerID: uint64(j + 1), ModelName: enginesim.DefaultModel, Endpoint: w.Endpoint(),
				BlockSize: &bs, KVEventsEndpoint: w.KVEventsEndpoint()}
			if _, err := inst.Service.UpsertWorker(context.Background(), rec, picker.SourceAPI); err != nil {
				t.Fatal(err)
			}
		}
	}
	if withSync {
		for _, on := range insts {
			for _, peer := range insts {
				if on != peer {
					if _, err := on.replica.m.RegisterPeer("tcp://" + peer.Addrs().ReplicaSync); err != nil {
						t.Fatal(err)
					}
				}
			}
		}
		for _, from := range insts {
			var to []*Instance
			for _, o := range insts {
				if o != from {
					to = append(to, o)
				}
			}
			linkAllService(t, from, to)
		}
	}
	for _, w := range pool.Workers() {
		for end := time.Now().Add(10 * time.Second); !w.HasSubscriber(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(end) {
				t.Fatal("a worker's KV events have no subscriber")
			}
		}
	}
	fronts := make([]string, replicas)
	for i, inst := range insts {
		conn, err := frontproxy.Dial(inst.Addrs().GRPC, false)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		p, err := frontproxy.New(frontproxy.Config{ExtProc: conn})
		if err != nil {
			t.Fatal(err)
		}
		srv, err := frontproxy.Start("", p)
		if err != nil {
			t.Fatal(err)
		}
		defer srv.Close()
		fronts[i] = srv.URL()
	}
	before := pool.Stats()

	// 32 conversations of 3 turns, 16 at a time: every turn resends the whole history (a shared
	// 64-token system prompt, then 480 new tokens per turn), so each turn has a long uncached
	// prefill whose placement decides how long requests queue behind each other.
	const convs, turns, parallel, system, perTurn = 32, 3, 16, 64, 480
	var next int
	var mu sync.Mutex
	front := func() string {
		mu.Lock()
		defer mu.Unlock()
		next++
		return fronts[next%len(fronts)]
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, parallel)
	errs := make(chan error, convs)
	for c := range convs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			prompt := make([]string, 0, system+turns*perTurn)
			for i := range system {
				prompt = append(prompt, strconv.Itoa(10+i))
			}
			for turn := range turns {
				for i := range perTurn {
					prompt = append(prompt, strconv.Itoa(1000+c*10000+turn*perTurn+i))
				}
				body := fmt.Sprintf(`{"model":%q,"prompt":[%s],"max_tokens":16,"stream":true}`, enginesim.DefaultModel, strings.Join(prompt, ","))
				resp, err := http.Post(front()+"/v1/completions", "application/json", bytes.NewReader([]byte(body)))
				if err != nil {
					errs <- err
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					errs <- fmt.Errorf("conversation %d turn %d: status %d", c, turn, resp.StatusCode)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	after := pool.Stats()
	res := qualityResult{Requests: after.Requests - before.Requests}
	res.HitRate = float64(after.CachedPromptTokens-before.CachedPromptTokens) / float64(after.PromptTokens-before.PromptTokens)
	var ttfts []time.Duration
	for _, ws := range after.Workers {
		for _, r := range ws.Records {
			if !r.Canceled && !strings.HasPrefix(r.ID, "probe") {
				ttfts = append(ttfts, r.TTFT)
			}
		}
	}
	slices.Sort(ttfts)
	var sum time.Duration
	for _, d := range ttfts {
		sum += d
	}
	if len(ttfts) > 0 {
		res.MeanTTFT = sum / time.Duration(len(ttfts))
		res.P90TTFT = ttfts[len(ttfts)*9/10]
	}
	return res
}

// linkAllService waits until a booking made on from's core reaches every instance of to.
func linkAllService(t *testing.T, from *Instance, to []*Instance) {
	t.Helper()
	ctx := context.Background()
	end := time.Now().Add(20 * time.Second)
	for i := 0; ; i++ {
		id := fmt.Sprintf("probe-%p-%d", from, i)
		if _, err := from.Service.Reserve(ctx, picker.ReservationRequest{ModelName: enginesim.DefaultModel, SelectionID: id,
			WorkerID: new(uint64(1)), Prompt: picker.Prompt{TokenIDs: []uint32{1, 2, 3}}}); err != nil {
			t.Fatal(err)
		}
		ok := false
		for wait := time.Now().Add(200 * time.Millisecond); !ok && time.Now().Before(wait); time.Sleep(5 * time.Millisecond) {
			ok = true
			for _, inst := range to {
				if _, seen := inst.Service.Booking(id); !seen {
					ok = false
				}
			}
		}
		_ = from.Service.Free(ctx, id)
		if ok {
			return
		}
		if time.Now().After(end) {
			t.Fatal("replicas not linked after 20 s")
		}
	}
}

// TestReplicaSyncEndToEndQuality runs the conversation workload through the whole stack (simulated
// vLLM workers, the Envoy stand-in, ext_proc, KV events, replica sync over loopback) for one
// replica, two synced replicas and two unsynced ones, and logs hit rate and time to first token.
// Wall-clock timing on a shared machine makes the figures noisy, so it asserts nothing and runs
// only with KVEPP_REPLICA_E2E=1; TestReplicaSyncRoutingQuality is the deterministic check.
func TestReplicaSyncEndToEndQuality(t *testing.T) {
	if os.Getenv("KVEPP_REPLICA_E2E") != "1" {
		t.Skip("set KVEPP_REPLICA_E2E=1 to run the end-to-end replica comparison")
	}
	one := runQuality(t, 1, false)
	two := runQuality(t, 2, true)
	off := runQuality(t, 2, false)
	for name, r := range map[string]qualityResult{"1 replica": one, "2 replicas, sync on": two, "2 replicas, sync off": off} {
		t.Logf("%-21s hit rate %.3f  mean TTFT %v  p90 TTFT %v  (%d requests)", name, r.HitRate, r.MeanTTFT.Round(time.Millisecond), r.P90TTFT.Round(time.Millisecond), r.Requests)
	}
}
