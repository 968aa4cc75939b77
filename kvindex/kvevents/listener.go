package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/kvindex"
)

// endSeq is the sequence number of the replay END marker (−1 as i64, §6).
const endSeq = ^uint64(0)

// quietZMQ silences zmq4's own logging; the listener logs through zerolog.
var quietZMQ = log.New(io.Discard, "", 0)

// item is one received message, queued between a listener's reader and processor goroutines.
type item struct {
	frames [][]byte
	// afterReconnect marks the first message received on a re-dialled connection.
	afterReconnect bool
}

// listenerConfig is everything that identifies one rank's listener; a re-attach with an equal
// config keeps the running listener.
type listenerConfig struct {
	workerID  uint64
	rank      uint32
	endpoints rankEndpoints
	blockSize int
	eagle     bool
	sink      Sink
}

// listener is one SUB subscription for one (worker, dp_rank) (kv-events-index.md §13). A reader
// goroutine receives messages and (re)dials; a processor goroutine tracks sequence numbers,
// replays gaps and applies events to the sink in arrival order.
type listener struct {
	m    *Manager
	cfg  listenerConfig
	conv *Converter
	log  zerolog.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// rankRange packs the worker's current rank range (start<<32 | size); a re-attach that keeps
	// this listener may change it while the processor runs.
	rankRange    atomic.Uint64
	bootstrapped atomic.Bool

	qmu   sync.Mutex
	queue []item
	head  int
	wake  chan struct{}

	// Processor state, owned by the processor goroutine.
	started     bool
	reconnected bool
	expected    uint64
	evBuf       []kvindex.Event
	// rejections counts the events the sink refused; lastRejectLog rate-limits their log.
	rejections    uint64
	lastRejectLog time.Time

	// Published for inspection.
	next       atomic.Uint64
	hasStarted atomic.Bool
}

func newListener(m *Manager, cfg listenerConfig, notes *workerNotes, rankStart, rankSize uint32) *listener {
	ctx, cancel := context.WithCancel(context.Background())
	l := &listener{
		m:      m,
		cfg:    cfg,
		ctx:    ctx,
		cancel: cancel,
		wake:   make(chan struct{}, 1),
		log: m.log.With().Uint64("worker_id", cfg.workerID).Uint32("dp_rank", cfg.rank).
			Str("endpoint", cfg.endpoints.events).Logger(),
	}
	l.conv = NewConverter(cfg.workerID, cfg.rank, cfg.blockSize, cfg.eagle)
	l.conv.SetLogger(l.log)
	l.conv.notes = notes
	l.conv.stats = &m.stats
	l.setRankRange(rankStart, rankSize)
	return l
}

func (l *listener) setRankRange(start, size uint32) {
	l.rankRange.Store(uint64(start)<<32 | uint64(size))
}

func (l *listener) start() {
	l.wg.Add(2)
	go l.readLoop()
	go l.processLoop()
}

// stop cancels both goroutines and waits for them; the sockets are closed on return.
func (l *listener) stop() {
	l.cancel()
	l.wg.Wait()
}

// sleep waits d or until the listener stops; it reports whether the listener is still running.
func (l *listener) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-l.ctx.Done():
		return false
	}
}

func (l *listener) nextBackoff(d time.Duration) time.Duration {
	d *= 2
	if d > l.m.cfg.ReconnectMaxBackoff {
		d = l.m.cfg.ReconnectMaxBackoff
	}
	return d
}

// readLoop dials the publisher, receives messages into the queue, and re-dials with backoff when
// the connection drops (zmq4 reports EOF instead of reconnecting; §13 library note).
func (l *listener) readLoop() {
	defer l.wg.Done()
	backoff := l.m.cfg.ReconnectMinBackoff
	everConnected := false
	for {
		sock := l.dial()
		if sock == nil {
			return
		}
		reconnect := everConnected
		if reconnect {
			l.m.stats.reconnects.Add(1)
			l.log.Info().Msg("KV event publisher reconnected")
		}
		everConnected = true
		// A connection that succeeds resets the backoff even if no batch follows, so a publisher
		// that restarts, or flaps, is redialled promptly rather than at the cap.
		backoff = l.m.cfg.ReconnectMinBackoff
		first := true
		var err error
		for {
			var msg zmq4.Msg
			msg, err = sock.Recv()
			if err != nil {
				break
			}
			if msg.Type == zmq4.CmdMsg {
				continue
			}
			l.enqueue(item{frames: msg.Frames, afterReconnect: reconnect && first})
			first = false
		}
		_ = sock.Close()
		if l.ctx.Err() != nil {
			return
		}
		l.log.Warn().Err(err).Int64("retry_in_ms", backoff.Milliseconds()).Msg("KV event publisher connection lost; re-dialling")
		if !l.sleep(backoff) {
			return
		}
		backoff = l.nextBackoff(backoff)
	}
}

// dial connects a fresh SUB socket subscribed to every topic, retrying with backoff until it
// succeeds (nil only when the listener stops).
func (l *listener) dial() zmq4.Socket {
	backoff := l.m.cfg.ReconnectMinBackoff
	for attempt := 0; ; attempt++ {
		sock := zmq4.NewSub(l.ctx, zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(l.m.cfg.DialTimeout),
			zmq4.WithLogger(quietZMQ))
		err := sock.SetOption(zmq4.OptionSubscribe, "")
		if err == nil {
			err = plainDialError(sock.Dial(dialAddress(l.cfg.endpoints.events)))
		}
		if err == nil {
			return sock
		}
		_ = sock.Close()
		if l.ctx.Err() != nil {
			return nil
		}
		ev := l.log.Debug()
		if attempt == 0 {
			ev = l.log.Info()
		}
		ev.Err(err).Int64("retry_in_ms", backoff.Milliseconds()).Msg("KV event publisher not reachable yet")
		if !l.sleep(backoff) {
			return nil
		}
		backoff = l.nextBackoff(backoff)
	}
}

// enqueue appends a message for the processor; beyond QueueLimit queued messages it drops the
// message and counts it (the missing seq later shows as a gap).
func (l *listener) enqueue(it item) {
	l.qmu.Lock()
	if len(l.queue)-l.head >= l.m.cfg.QueueLimit {
		l.qmu.Unlock()
		l.m.stats.batchesDropped[BatchDropQueueFull].Add(1)
		return
	}
	l.queue = append(l.queue, it)
	l.qmu.Unlock()
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

func (l *listener) dequeue() (item, bool) {
	l.qmu.Lock()
	defer l.qmu.Unlock()
	if l.head == len(l.queue) {
		if l.head > 0 {
			clear(l.queue)
			l.queue, l.head = l.queue[:0], 0
		}
		return item{}, false
	}
	it := l.queue[l.head]
	l.queue[l.head] = item{}
	l.head++
	if l.head > 1024 && l.head*2 > len(l.queue) {
		n := copy(l.queue, l.queue[l.head:])
		clear(l.queue[n:])
		l.queue, l.head = l.queue[:n], 0
	}
	return it, true
}

// processLoop applies queued messages in arrival order, waiting while the Manager holds events.
func (l *listener) processLoop() {
	defer l.wg.Done()
	for {
		if gate := l.m.holdGate(); gate != nil {
			select {
			case <-gate:
			case <-l.ctx.Done():
				return
			}
		}
		it, ok := l.dequeue()
		if !ok {
			select {
			case <-l.wake:
				continue
			case <-l.ctx.Done():
				return
			}
		}
		if l.ctx.Err() != nil {
			return
		}
		l.handle(it)
	}
}

// handle runs the sequence logic of §13 for one live message.
func (l *listener) handle(it item) {
	if it.afterReconnect {
		l.reconnected = true
	}
	if len(it.frames) != 3 {
		l.m.stats.batchesDropped[BatchDropFrames].Add(1)
		l.log.Debug().Int("frames", len(it.frames)).Msg("dropping KV event message: want 3 frames")
		return
	}
	if len(it.frames[1]) != 8 {
		l.m.stats.batchesDropped[BatchDropSeqFrame].Add(1)
		l.log.Debug().Int("seq_bytes", len(it.frames[1])).Msg("dropping KV event message: seq frame is not 8 bytes")
		return
	}
	seq := binary.BigEndian.Uint64(it.frames[1])
	payload := it.frames[2]
	switch {
	case !l.started:
		l.started, l.reconnected = true, false
		if seq > 0 && !l.bootstrapped.Load() {
			l.expected = 0
			l.recoverGap(seq, true)
		}
	case l.reconnected && seq < l.expected:
		l.reconnected = false
		l.m.stats.publisherRestarts.Add(1)
		l.log.Warn().Uint64("watermark", l.expected).Uint64("seq", seq).
			Msg("KV event publisher restarted at the same address; clearing this rank's blocks")
		l.clearRank(seq)
		l.expected = 0
		if seq > 0 {
			l.recoverGap(seq, false)
		}
	default:
		l.reconnected = false
		if seq < l.expected {
			l.m.stats.batchesStale.Add(1)
			l.log.Debug().Uint64("seq", seq).Uint64("expected", l.expected).Msg("ignoring stale KV event batch")
			return
		}
		if seq > l.expected {
			l.recoverGap(seq, false)
		}
	}
	l.apply(seq, payload, false)
}

// recoverGap handles the missing range [l.expected, to): replay it when a replay endpoint is
// configured, and count whatever was not recovered as lost (§13). start marks the first batch of a
// fresh subscription: without a replay endpoint the batches before it were published before kvepp
// subscribed, which is expected on every start and logged at info as the subscription's start
// point; a loss that replay could have recovered, and any later gap, is a warning.
func (l *listener) recoverGap(to uint64, start bool) {
	l.m.stats.gaps.Add(1)
	from := l.expected
	if l.cfg.endpoints.replay != "" {
		l.replay(to)
	}
	if l.expected < to {
		lost := to - l.expected
		l.m.stats.addLost(lost)
		if start && l.cfg.endpoints.replay == "" {
			l.log.Info().Uint64("seq", to).Uint64("earlier_batches", lost).
				Msg("KV event subscription starts at this seq; earlier batches were published before kvepp subscribed (a replay endpoint would fetch them)")
			return
		}
		l.log.Warn().Uint64("from", l.expected).Uint64("to", to).Uint64("lost", lost).Uint64("gap_start", from).
			Bool("replay", l.cfg.endpoints.replay != "").Msg("KV event batches lost; the index may miss blocks of this rank")
	}
}

// replay requests batches from l.expected over DEALER→ROUTER (§6) and applies those with
// l.expected ≤ seq < to in order, until the END marker, an error, or the replay timeout.
func (l *listener) replay(to uint64) {
	ctx, cancel := context.WithTimeout(l.ctx, l.m.cfg.ReplayTimeout)
	defer cancel()
	sock := zmq4.NewDealer(ctx, zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(l.m.cfg.ReplayTimeout),
		zmq4.WithLogger(quietZMQ))
	defer sock.Close()
	rlog := l.log.With().Str("replay_endpoint", l.cfg.endpoints.replay).Uint64("from", l.expected).Uint64("to", to).Logger()
	fail := func(err error, msg string) {
		if l.ctx.Err() != nil {
			return // stopping
		}
		if errors.Is(err, context.DeadlineExceeded) {
			l.m.stats.replaysTimeout.Add(1)
			rlog.Warn().Int64("timeout_ms", l.m.cfg.ReplayTimeout.Milliseconds()).Uint64("recovered_to", l.expected).Msg("KV event replay timed out")
			return
		}
		l.m.stats.replaysFailed.Add(1)
		rlog.Warn().Err(err).Msg(msg)
	}
	if err := sock.Dial(dialAddress(l.cfg.endpoints.replay)); err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		fail(err, "KV event replay: cannot connect")
		return
	}
	var start [8]byte
	binary.BigEndian.PutUint64(start[:], l.expected)
	if err := sock.SendMulti(zmq4.NewMsgFrom([]byte{}, start[:])); err != nil {
		fail(err, "KV event replay: cannot send request")
		return
	}
	for {
		msg, err := sock.Recv()
		if err != nil {
			if ctx.Err() != nil {
				err = ctx.Err()
			}
			fail(err, "KV event replay: receive failed")
			return
		}
		var seqFrame, payload []byte
		switch len(msg.Frames) {
		case 3:
			seqFrame, payload = msg.Frames[1], msg.Frames[2]
		case 4:
			seqFrame, payload = msg.Frames[2], msg.Frames[3]
		default:
			fail(errors.New("malformed reply"), "KV event replay: reply has neither 3 nor 4 frames; aborting")
			return
		}
		if len(seqFrame) != 8 {
			fail(errors.New("malformed reply"), "KV event replay: reply seq frame is not 8 bytes; aborting")
			return
		}
		seq := binary.BigEndian.Uint64(seqFrame)
		if seq == endSeq || len(payload) == 0 {
			l.m.stats.replaysOK.Add(1)
			return
		}
		if seq < l.expected || seq >= to {
			continue
		}
		if seq > l.expected {
			lost := seq - l.expected
			l.m.stats.addLost(lost)
			rlog.Warn().Uint64("missing_from", l.expected).Uint64("missing_to", seq).
				Msg("KV event replay buffer no longer holds part of the gap")
		}
		l.apply(seq, payload, true)
	}
}

// apply decodes, converts and applies one batch and advances the watermark past seq.
func (l *listener) apply(seq uint64, payload []byte, replayed bool) {
	l.expected = seq + 1
	// Publish the watermark only once the batch is fully applied, so an observer that sees
	// NextSeq == seq+1 also sees the batch's effects and counters.
	defer func() {
		l.next.Store(seq + 1)
		l.hasStarted.Store(true)
	}()
	b, err := DecodeBatch(payload)
	if err != nil {
		l.m.stats.batchesDropped[BatchDropPayload].Add(1)
		l.log.Warn().Err(err).Uint64("seq", seq).Msg("dropping undecodable KV event batch")
		return
	}
	rr := l.rankRange.Load()
	l.conv.SetRankRange(uint32(rr>>32), uint32(rr))
	evs, errs := l.conv.Convert(b, seq, l.evBuf[:0])
	for _, e := range errs {
		var de *DropError
		if errors.As(e, &de) {
			l.m.stats.eventsDropped[de.Reason].Add(1)
		}
		l.log.Debug().Err(e).Uint64("seq", seq).Msg("dropping KV event")
	}
	for i := range evs {
		err := l.cfg.sink.Apply(evs[i])
		if err == nil {
			l.m.stats.eventsApplied.Add(1)
			continue
		}
		kind := sinkErrorKind(err)
		l.m.stats.sinkErrors[kind].Add(1)
		if kind == SinkBlockNotFound {
			// A removal naming blocks the index does not hold: the known ones were removed.
			l.m.stats.eventsApplied.Add(1)
			continue
		}
		l.m.stats.eventsRejected.Add(1)
		l.logRejection(err, seq)
	}
	clear(evs)
	l.evBuf = evs[:0]
	l.m.stats.batchesApplied.Add(1)
	if replayed {
		l.m.stats.replayedBatches.Add(1)
	}
}

// logRejection logs an event the index refused at info, at most once per RejectLogInterval for
// this rank; the line counts the rank's rejections so far.
func (l *listener) logRejection(err error, seq uint64) {
	l.rejections++
	now := time.Now()
	if !l.lastRejectLog.IsZero() && now.Sub(l.lastRejectLog) < l.m.cfg.RejectLogInterval {
		return
	}
	l.lastRejectLog = now
	l.log.Info().Err(err).Uint64("seq", seq).Uint64("rank_rejections", l.rejections).
		Int64("next_log_after_ms", l.m.cfg.RejectLogInterval.Milliseconds()).
		Msg("index rejected KV event; the index may miss blocks of this rank")
}

// clearRank removes this rank's blocks from the sink (all tiers) and forgets its namespaces.
func (l *listener) clearRank(eventID uint64) {
	l.conv.forgetRank(l.cfg.rank)
	l.m.applyClear(l.cfg.sink, l.cfg.workerID, l.cfg.rank, eventID)
}
