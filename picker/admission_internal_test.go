package picker

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// TestRecheckQueuesAdmitsAfterAnOutOfBandRelease checks the periodic recheck of §13.3: capacity
// that comes back without a lifecycle call of this service (a booking released straight in the
// ledger, as a replica mirror's removal would) is found by RecheckQueues.
func TestRecheckQueuesAdmitsAfterAnOutOfBandRelease(t *testing.T) {
	th := 0.0
	cfg := DefaultConfig()
	cfg.Router.UseKVEvents = false
	cfg.Router.QueueThreshold = &th
	cfg.Logger = zerolog.Nop()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	bs, mb := uint32(4), uint64(1024)
	ctx := context.Background()
	if _, err := s.UpsertWorker(ctx, WorkerRecord{WorkerID: 1, ModelName: "m", Endpoint: "http://w1", BlockSize: &bs, MaxNumBatchedTokens: &mb}, SourceAPI); err != nil {
		t.Fatal(err)
	}
	w1 := uint64(1)
	isl := uint64(4)
	if _, err := s.Reserve(ctx, ReservationRequest{ModelName: "m", SelectionID: "busy", WorkerID: &w1,
		Prompt: Prompt{HashForm: true, SequenceHashes: []uint64{}, ISLTokens: isl, ISLTokensSet: true}, EffectivePrefillTokens: &isl}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := s.SelectAndReserve(ctx, SelectRequest{ModelName: "m", SelectionID: "q", Prompt: Prompt{TokenIDs: []uint32{1, 2, 3, 4}}})
		done <- err
	}()
	p := s.partition(PartitionKey{ModelName: "m", RoutingGroup: DefaultPartitionName})
	deadline := time.Now().Add(5 * time.Second)
	for p.pendingCount.Load() != 1 {
		if time.Now().After(deadline) {
			t.Fatal("request never queued")
		}
		time.Sleep(time.Millisecond)
	}
	s.RecheckQueues()
	select {
	case err := <-done:
		t.Fatalf("admitted while busy: %v", err)
	default:
	}
	if _, err := s.ledger.Free("busy"); err != nil { // no dispatch runs
		t.Fatal(err)
	}
	select {
	case err := <-done:
		t.Fatalf("admitted without a recheck: %v", err)
	case <-time.After(20 * time.Millisecond):
	}
	s.RecheckQueues()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the recheck did not admit the request")
	}
}

// TestRunRechecksTheQueuesPeriodically checks that Run drives RecheckQueues every
// QueueRecheckInterval.
func TestRunRechecksTheQueuesPeriodically(t *testing.T) {
	th := 0.0
	cfg := DefaultConfig()
	cfg.Router.UseKVEvents = false
	cfg.Router.QueueThreshold = &th
	cfg.QueueRecheckInterval = 5 * time.Millisecond
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	bs, mb := uint32(4), uint64(1024)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := s.UpsertWorker(ctx, WorkerRecord{WorkerID: 1, ModelName: "m", Endpoint: "http://w1", BlockSize: &bs, MaxNumBatchedTokens: &mb}, SourceAPI); err != nil {
		t.Fatal(err)
	}
	w1, isl := uint64(1), uint64(4)
	if _, err := s.Reserve(ctx, ReservationRequest{ModelName: "m", SelectionID: "busy", WorkerID: &w1,
		Prompt: Prompt{HashForm: true, SequenceHashes: []uint64{}, ISLTokens: isl, ISLTokensSet: true}, EffectivePrefillTokens: &isl}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := s.SelectAndReserve(ctx, SelectRequest{ModelName: "m", Prompt: Prompt{TokenIDs: []uint32{1, 2, 3, 4}}})
		done <- err
	}()
	p := s.partition(PartitionKey{ModelName: "m", RoutingGroup: DefaultPartitionName})
	for p.pendingCount.Load() != 1 {
		time.Sleep(time.Millisecond)
	}
	if _, err := s.ledger.Free("busy"); err != nil {
		t.Fatal(err)
	}
	go func() { _ = s.Run(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run never rechecked the queue")
	}
}

// benchPartition is BenchmarkSelectAndReserveFree's partition with queueing on (router queue
// threshold 0): 32 single-rank workers of block size 16 (max_num_batched_tokens 8192), a
// 512-token prompt, and, when busy, an occupying booking of 16 prefill tokens on every worker.
func benchPartition(b *testing.B, busy, queueing bool) (*Service, *partition, SelectRequest) {
	b.Helper()
	th := 0.0
	cfg := DefaultConfig()
	cfg.Router.UseKVEvents = false
	if queueing {
		cfg.Router.QueueThreshold = &th
	}
	s, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	bs, mb := uint32(16), uint64(8192)
	ctx := context.Background()
	for id := uint64(1); id <= 32; id++ {
		rec := WorkerRecord{WorkerID: id, ModelName: "m", Endpoint: "http://w", BlockSize: &bs, MaxNumBatchedTokens: &mb}
		if _, err := s.UpsertWorker(ctx, rec, SourceAPI); err != nil {
			b.Fatal(err)
		}
		if busy {
			occupyWorker(b, s, id)
		}
	}
	toks := make([]uint32, 512)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	p := s.partition(PartitionKey{ModelName: "m", RoutingGroup: DefaultPartitionName})
	return s, p, SelectRequest{ModelName: "m", SelectionID: "q", Prompt: Prompt{TokenIDs: toks}}
}

// occupyWorker books 16 prefill tokens on (id, 0) under "o<id>".
func occupyWorker(b *testing.B, s *Service, id uint64) {
	isl := uint64(16)
	if _, err := s.Reserve(context.Background(), ReservationRequest{ModelName: "m", SelectionID: "o" + strconv.FormatUint(id, 10), WorkerID: &id,
		Prompt: Prompt{HashForm: true, SequenceHashes: []uint64{}, ISLTokens: isl, ISLTokensSet: true}, EffectivePrefillTokens: &isl}); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkQueueAdmission measures queue admission in-process, without goroutine hand-offs.
// "off": one SelectAndReserve plus its Free with queueing off (the fast path); "idle": the same
// with queueing on and the pool not busy (the admission check on top of the fast path). "queued": one SelectAndReserve enqueued behind a
// busy pool (prompt lookup, class snapshot, busy check, Enqueue), then dispatched by the Free of
// one occupying booking (PopNext with the busy check, selection, booking, re-validation), then
// the admitted booking freed and the occupant re-booked.
func BenchmarkQueueAdmission(b *testing.B) {
	ctx := context.Background()
	for _, mode := range []struct {
		name     string
		queueing bool
	}{{"off", false}, {"idle", true}} {
		b.Run(mode.name, func(b *testing.B) {
			s, _, req := benchPartition(b, false, mode.queueing)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := s.SelectAndReserve(ctx, req); err != nil {
					b.Fatal(err)
				}
				if err := s.Free(ctx, "q"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("queued", func(b *testing.B) {
		s, p, req := benchPartition(b, true, true)
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			r := req
			pr, err := s.prepare(&r)
			if err != nil {
				b.Fatal(err)
			}
			if err := s.ledger.Claim(r.SelectionID); err != nil {
				b.Fatal(err)
			}
			p.mu.Lock()
			w, _, _, err := s.admitLocked(ctx, p, &r, &pr, true)
			p.mu.Unlock()
			if err != nil || w == nil {
				b.Fatalf("not queued: %v", err)
			}
			victim := uint64(i%32 + 1)
			if err := s.Free(ctx, "o"+strconv.FormatUint(victim, 10)); err != nil {
				b.Fatal(err)
			}
			<-w.done
			if w.err != nil || !w.sel.Booked {
				b.Fatalf("dispatch: %+v %v", w.sel, w.err)
			}
			if err := s.Free(ctx, "q"); err != nil {
				b.Fatal(err)
			}
			occupyWorker(b, s, victim)
		}
	})
}
