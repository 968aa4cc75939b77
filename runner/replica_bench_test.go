package runner

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/ledger"
	"github.com/kvepp/kvepp/ledger/replica"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/picker/pickertest"
)

// benchPair is a sending replica-sync manager and a receiving replica: a manager applying to a
// real selection core with 4 registered workers (block size 16).
type benchPair struct {
	from, to *replica.Manager
	svc      *picker.Service
	lag      *lagApplier
}

// lagApplier applies through the real core and, for events whose id is "<n>@<unix nanos>",
// records publish → applied.
type lagApplier struct {
	replicaApplier
	mu   sync.Mutex
	lags []time.Duration
}

func (a *lagApplier) ApplySlot(p replica.Partition, bs uint32, ev ledger.SlotEvent) (bool, replica.DropReason) {
	ok, r := a.replicaApplier.ApplySlot(p, bs, ev)
	if _, at, found := strings.Cut(ev.ID, "@"); found && ev.Kind == ledger.SlotFree {
		if ns, err := strconv.ParseInt(at, 10, 64); err == nil {
			a.mu.Lock()
			a.lags = append(a.lags, time.Since(time.Unix(0, ns)))
			a.mu.Unlock()
		}
	}
	return ok, r
}

func newBenchPair(b *testing.B) *benchPair {
	b.Helper()
	cfg := pickertest.Config(1, 1)
	svc, err := picker.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	for w := uint64(1); w <= 4; w++ {
		bs := uint32(16)
		if _, err := svc.UpsertWorker(context.Background(), picker.WorkerRecord{WorkerID: w, ModelName: "m",
			Endpoint: fmt.Sprintf("http://10.0.0.%d:8000", w), BlockSize: &bs}, picker.SourceAPI); err != nil {
			b.Fatal(err)
		}
	}
	mk := func(id uint64) *replica.Manager {
		m, err := replica.New(replica.Config{Bind: "tcp://127.0.0.1:0", RouterID: id, Logger: zerolog.Nop()})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = m.Close() })
		return m
	}
	p := &benchPair{from: mk(1), to: mk(2), svc: svc}
	p.lag = &lagApplier{replicaApplier: replicaApplier{svc: svc}}
	if _, err := p.to.RegisterPeer("tcp://" + p.from.Addr()); err != nil {
		b.Fatal(err)
	}
	if err := p.to.Start(p.lag); err != nil {
		b.Fatal(err)
	}
	// Wait for the link.
	for i := 0; ; i++ {
		id := "probe-" + strconv.Itoa(i)
		p.publishCycle(id, 1)
		time.Sleep(20 * time.Millisecond)
		if p.to.Stats().AppliedSlot > 0 {
			break
		}
		if i > 500 {
			b.Fatal("replicas not linked")
		}
	}
	return p
}

// publishCycle publishes one booking's admission, prefill completion and free.
func (p *benchPair) publishCycle(id string, w uint64) {
	part := replica.Partition{ModelName: "m", RoutingGroup: "default"}
	c := ledger.Candidate{WorkerID: w}
	prefill := uint64(512)
	p.from.PublishSlot(part, 16, ledger.SlotEvent{Kind: ledger.SlotAdmission, ID: id, Candidate: c,
		SequenceHashes: []uint64{uint64(len(id)), 2, 3, 4, 5, 6, 7, 8}, TrackPrefillTokens: true, PrefillTokens: &prefill})
	p.from.PublishSlot(part, 16, ledger.SlotEvent{Kind: ledger.SlotPrefillComplete, ID: id, Candidate: c})
	p.from.PublishSlot(part, 16, ledger.SlotEvent{Kind: ledger.SlotFree, ID: id, Candidate: c})
}

// settle waits until the receiver has handled every event it will get.
func (p *benchPair) settle(b *testing.B, want uint64) replica.Stats {
	end := time.Now().Add(60 * time.Second)
	for {
		st := p.to.Stats()
		if st.AppliedSlot+st.DroppedTotal() >= want && st.InboundQueued == 0 {
			return st
		}
		if time.Now().After(end) {
			b.Fatalf("receiver handled %d of %d events", st.AppliedSlot+st.DroppedTotal(), want)
		}
		time.Sleep(time.Millisecond)
	}
}

// BenchmarkReplicaSyncThroughput measures sustained lifecycle events per second from one replica
// to another over loopback, applied to a real core: b.N bookings, each an admission (8 sequence
// hashes), a prefill completion and a free, published as fast as the sender's queue drains.
func BenchmarkReplicaSyncThroughput(b *testing.B) {
	p := newBenchPair(b)
	base := p.to.Stats()
	sentBase := p.from.Stats().SentSlot
	b.ResetTimer()
	start := time.Now()
	for i := range b.N {
		// Keep at most 30,000 events in flight (below every queue's bound), so the figure is
		// the rate the pair sustains without dropping.
		for uint64(3*i)-(p.to.Stats().AppliedSlot-base.AppliedSlot) > 30_000 {
			time.Sleep(50 * time.Microsecond)
		}
		p.publishCycle("t"+strconv.Itoa(i), uint64(1+i%4))
	}
	for p.from.Stats().OutboundQueued > 0 {
		time.Sleep(50 * time.Microsecond)
	}
	fs := p.from.Stats()
	sent := fs.SentSlot - sentBase - fs.Dropped[replica.DropSubscriberFull]
	st := p.settle(b, base.AppliedSlot+base.DroppedTotal()+sent)
	el := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(3*b.N)/el.Seconds(), "events/s")
	b.ReportMetric(float64(st.AppliedSlot-base.AppliedSlot), "applied")
	b.ReportMetric(float64(st.DroppedTotal()-base.DroppedTotal()+fs.Dropped[replica.DropOutboundFull]+fs.Dropped[replica.DropSubscriberFull]), "dropped")
}

// BenchmarkReplicaSyncLag measures publish → applied lag on the peer at a steady 3,000 events/s
// (1,000 bookings/s), reporting the p50 and p99 of the free events.
func BenchmarkReplicaSyncLag(b *testing.B) {
	p := newBenchPair(b)
	b.ResetTimer()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for i := range b.N {
		<-tick.C
		p.publishCycle(fmt.Sprintf("%d@%d", i, time.Now().UnixNano()), uint64(1+i%4))
	}
	end := time.Now().Add(30 * time.Second)
	for {
		p.lag.mu.Lock()
		n := len(p.lag.lags)
		p.lag.mu.Unlock()
		if n >= b.N || time.Now().After(end) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	b.StopTimer()
	p.lag.mu.Lock()
	lags := slices.Clone(p.lag.lags)
	p.lag.mu.Unlock()
	if len(lags) == 0 {
		b.Fatal("no lag measured")
	}
	slices.Sort(lags)
	b.ReportMetric(float64(lags[len(lags)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lags[len(lags)*99/100].Microseconds()), "p99-µs")
	b.ReportMetric(float64(b.N-len(lags)), "lost")
}
