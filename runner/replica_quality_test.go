package runner

import (
	"container/heap"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/kvindex"
	"github.com/kvepp/kvepp/ledger/replica"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
)

// The routing-quality simulation: simulated workers in virtual time, routed by real kvepp cores
// (picker.Service) that share one view of the workers' caches (as KV events give every replica)
// and, when synced, exchange their bookings through real replica-sync managers on loopback. Each
// request goes to the next replica round-robin. Everything but the sockets runs in virtual time
// and the cores use seeded randomness, so a setup gives the same figures on every run.
const (
	simWorkers      = 4
	simBlockSize    = 16
	simConvs        = 48
	simTurns        = 4
	simSystem       = 128 // shared system-prompt tokens
	simPerTurn      = 256 // new tokens per turn
	simOutput       = 64  // output tokens per request
	simPrefillToken = 500 * time.Microsecond
	simDecodeToken  = 20 * time.Millisecond
	simConvGap      = 40 * time.Millisecond  // between conversation starts
	simThink        = 400 * time.Millisecond // between a response and the next turn
	simModel        = "sim"
)

type simEventKind uint8

const (
	simArrive simEventKind = iota
	simPrefillDone
	simDecodeDone
)

type simEvent struct {
	at   time.Duration
	seq  int
	kind simEventKind
	conv int
	turn int
}

type simQueue []simEvent

func (q simQueue) Len() int { return len(q) }
func (q simQueue) Less(i, j int) bool {
	return q[i].at < q[j].at || (q[i].at == q[j].at && q[i].seq < q[j].seq)
}
func (q simQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *simQueue) Push(x any)   { *q = append(*q, x.(simEvent)) }
func (q *simQueue) Pop() any {
	old := *q
	x := old[len(old)-1]
	*q = old[:len(old)-1]
	return x
}

// simWorker is one simulated engine: one serial prefill lane and an unbounded prefix cache of
// local block hashes.
type simWorker struct {
	laneFree time.Duration
	cache    map[uint64]bool
}

// simReplica is one kvepp core and, when synced, its replica-sync manager.
type simReplica struct {
	svc    *picker.Service
	events *pickertest.EventSource
	m      *replica.Manager
}

type simRequest struct {
	replica  int
	worker   uint64
	id       string
	arrival  time.Duration
	isl      int
	cached   int
	hashes   []uint64
	prefill  time.Duration
	complete time.Duration
}

// simulate runs the workload through n replicas and returns the cache hit rate and mean TTFT.
func simulate(t *testing.T, n int, withSync bool) qualityResult {
	t.Helper()
	clock := pickertest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	reps := make([]*simReplica, n)
	for i := range reps {
		r := &simReplica{events: pickertest.NewEventSource()}
		cfg := pickertest.Config(uint64(100+i), 7)
		cfg.Router.UseKVEvents, cfg.EventSource, cfg.Now = true, r.events, clock.Now
		if withSync {
			m, err := replica.New(replica.Config{Bind: "tcp://127.0.0.1:0", RouterID: uint64(i + 1), Logger: zerolog.Nop()})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = m.Close() })
			r.m = m
			pub := replicaPublisher{m: m}
			cfg.SlotPublisher, cfg.AffinityPublisher, cfg.ReplicaWriterID = pub, pub, uint64(i+1)
		}
		svc, err := picker.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		r.svc = svc
		for w := uint64(1); w <= simWorkers; w++ {
			bs := uint32(simBlockSize)
			rec := picker.WorkerRecord{WorkerID: w, ModelName: simModel, Endpoint: fmt.Sprintf("http://10.0.0.%d:8000", w),
				BlockSize: &bs, KVEventsEndpoint: fmt.Sprintf("tcp://10.0.0.%d:5557", w)}
			if _, err := svc.UpsertWorker(context.Background(), rec, picker.SourceAPI); err != nil {
				t.Fatal(err)
			}
		}
		reps[i] = r
	}
	if withSync {
		for i, r := range reps {
			for j, o := range reps {
				if i != j {
					if _, err := r.m.RegisterPeer("tcp://" + o.m.Addr()); err != nil {
						t.Fatal(err)
					}
				}
			}
			if err := r.m.Start(replicaApplier{svc: r.svc}); err != nil {
				t.Fatal(err)
			}
		}
		for i, r := range reps {
			simLink(t, r, reps, i)
		}
	}
	workers := make([]simWorker, simWorkers+1)
	for i := range workers {
		workers[i].cache = map[uint64]bool{}
	}
	q := &simQueue{}
	seq := 0
	push := func(at time.Duration, kind simEventKind, conv, turn int) {
		seq++
		heap.Push(q, simEvent{at: at, seq: seq, kind: kind, conv: conv, turn: turn})
	}
	for c := range simConvs {
		push(time.Duration(c)*simConvGap, simArrive, c, 0)
	}
	reqs := map[[2]int]*simRequest{}
	next := 0
	var res qualityResult
	var cachedTokens, promptTokens int
	var ttftSum time.Duration
	ctx := context.Background()
	now := time.Duration(0)
	for q.Len() > 0 {
		ev := heap.Pop(q).(simEvent)
		clock.Advance(ev.at - now)
		now = ev.at
		key := [2]int{ev.conv, ev.turn}
		switch ev.kind {
		case simArrive:
			tokens := make([]uint32, 0, simSystem+(ev.turn+1)*simPerTurn)
			for i := range simSystem {
				tokens = append(tokens, uint32(10+i))
			}
			for turn := 0; turn <= ev.turn; turn++ {
				for i := range simPerTurn {
					tokens = append(tokens, uint32(1000+ev.conv*10000+turn*simPerTurn+i))
				}
			}
			r := next % n
			next++
			id := fmt.Sprintf("c%d-t%d", ev.conv, ev.turn)
			sel, err := reps[r].svc.SelectAndReserve(ctx, picker.SelectRequest{ModelName: simModel, SelectionID: id,
				Prompt: picker.Prompt{TokenIDs: tokens}})
			if err != nil {
				t.Fatal(err)
			}
			seenBooked(t, withSync, reps, r, id)
			w := &workers[sel.WorkerID]
			local := kvindex.BlockHashes(tokens, simBlockSize, kvindex.Seed("", ""))
			hit := 0 // as vLLM, the last prompt token is always computed
			for hit < len(local) && hit < (len(tokens)-1)/simBlockSize && w.cache[local[hit]] {
				hit++
			}
			uncached := len(tokens) - hit*simBlockSize
			start := max(now, w.laneFree)
			done := start + time.Duration(uncached)*simPrefillToken
			w.laneFree = done
			reqs[key] = &simRequest{replica: r, worker: sel.WorkerID, id: id, arrival: now, isl: len(tokens), cached: hit * simBlockSize, hashes: local}
			push(done, simPrefillDone, ev.conv, ev.turn)
		case simPrefillDone:
			rq := reqs[key]
			w := &workers[rq.worker]
			var fresh []uint64
			var parent *uint64
			for i, h := range rq.hashes {
				if w.cache[h] {
					p := h + 1
					parent = &p
					continue
				}
				w.cache[h] = true
				fresh = rq.hashes[i:]
				break
			}
			for _, h := range fresh {
				w.cache[h] = true
			}
			if len(fresh) > 0 {
				for _, r := range reps { // the KV events reach every replica
					r.events.Store(t, rq.worker, 0, kvindex.TierDevice, parent, fresh...)
				}
			}
			if err := reps[rq.replica].svc.PrefillComplete(ctx, rq.id); err != nil {
				t.Fatal(err)
			}
			seenPrefilled(t, withSync, reps, rq.replica, rq.id)
			cachedTokens += rq.cached
			promptTokens += rq.isl
			ttftSum += now - rq.arrival
			res.Requests++
			push(now+simOutput*simDecodeToken, simDecodeDone, ev.conv, ev.turn)
		case simDecodeDone:
			rq := reqs[key]
			if err := reps[rq.replica].svc.Free(ctx, rq.id); err != nil {
				t.Fatal(err)
			}
			seenFreed(t, withSync, reps, rq.replica, rq.id)
			if ev.turn+1 < simTurns {
				push(now+simThink, simArrive, ev.conv, ev.turn+1)
			}
		}
	}
	res.HitRate = float64(cachedTokens) / float64(promptTokens)
	res.MeanTTFT = ttftSum / time.Duration(res.Requests)
	return res
}

// seenOn waits until cond holds on every replica but from (no-op without sync).
func seenOn(t *testing.T, withSync bool, reps []*simReplica, from int, what string, cond func(*picker.Service) bool) {
	t.Helper()
	if !withSync {
		return
	}
	end := time.Now().Add(10 * time.Second)
	for i, r := range reps {
		for i != from && !cond(r.svc) {
			if time.Now().After(end) {
				t.Fatalf("replica %d did not see %s", i, what)
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
}

func seenBooked(t *testing.T, withSync bool, reps []*simReplica, from int, id string) {
	seenOn(t, withSync, reps, from, "the admission of "+id, func(s *picker.Service) bool { _, ok := s.Booking(id); return ok })
}

func seenPrefilled(t *testing.T, withSync bool, reps []*simReplica, from int, id string) {
	seenOn(t, withSync, reps, from, "the prefill completion of "+id, func(s *picker.Service) bool {
		b, ok := s.Booking(id)
		return ok && b.PrefillCompleted
	})
}

func seenFreed(t *testing.T, withSync bool, reps []*simReplica, from int, id string) {
	seenOn(t, withSync, reps, from, "the free of "+id, func(s *picker.Service) bool { _, ok := s.Booking(id); return !ok })
}

// simLink waits until replica i's bookings reach every other replica (connected SUBs, known
// subscriptions).
func simLink(t *testing.T, r *simReplica, reps []*simReplica, i int) {
	t.Helper()
	ctx := context.Background()
	end := time.Now().Add(20 * time.Second)
	for k := 0; ; k++ {
		id := fmt.Sprintf("probe-%d-%d", i, k)
		if _, err := r.svc.Reserve(ctx, picker.ReservationRequest{ModelName: simModel, SelectionID: id, WorkerID: new(uint64(1)),
			Prompt: picker.Prompt{TokenIDs: []uint32{1, 2, 3}}}); err != nil {
			t.Fatal(err)
		}
		ok := false
		for wait := time.Now().Add(200 * time.Millisecond); !ok && time.Now().Before(wait); time.Sleep(time.Millisecond) {
			ok = true
			for j, o := range reps {
				if _, seen := o.svc.Booking(id); j != i && !seen {
					ok = false
				}
			}
		}
		if err := r.svc.Free(ctx, id); err != nil {
			t.Fatal(err)
		}
		seenFreed(t, true, reps, i, id)
		if ok {
			return
		}
		if time.Now().After(end) {
			t.Fatal("replicas not linked after 20 s")
		}
	}
}

// TestReplicaSyncRoutingQuality is the routing-quality acceptance: on the same workload,
// two kvepp replicas behind a round-robin front with replica sync route within 5 % of one
// replica (cache hit rate and mean time to first token); without sync the figures are shown.
func TestReplicaSyncRoutingQuality(t *testing.T) {
	one := simulate(t, 1, false)
	two := simulate(t, 2, true)
	off := simulate(t, 2, false)
	for _, r := range []struct {
		name string
		q    qualityResult
	}{{"1 replica", one}, {"2 replicas, sync on", two}, {"2 replicas, sync off", off}} {
		t.Logf("%-21s hit rate %.3f  mean TTFT %v  (%d requests)", r.name, r.q.HitRate, r.q.MeanTTFT.Round(time.Millisecond), r.q.Requests)
	}
	if two.HitRate < 0.95*one.HitRate {
		t.Errorf("hit rate with 2 synced replicas %.3f < 95 %% of one replica's %.3f", two.HitRate, one.HitRate)
	}
	if float64(two.MeanTTFT) > 1.05*float64(one.MeanTTFT) {
		t.Errorf("mean TTFT with 2 synced replicas %v > 105 %% of one replica's %v", two.MeanTTFT, one.MeanTTFT)
	}
}
