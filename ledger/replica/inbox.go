package replica

import (
	"errors"
	"sync/atomic"
	"time"

	"github.com/kvepp/kvepp/ledger"
)

// inItem is one received event waiting for its partition's applier.
type inItem struct {
	affinity bool
	slot     SlotMessage
	aff      AffinityMessage
	at       time.Time
}

// inbox is one partition's inbound queue and applier state (selection-service.md §15.4 "apply
// through a per-partition channel").
type inbox struct {
	part Partition
	q    *fifo[inItem]
	// applying counts the events the applier took from q and has not applied yet.
	applying atomic.Int64
	// freed remembers recent frees of ids that were not live (id → when), oldest first in
	// freedOrder, so an admission the free overtook is not mirrored.
	freed      map[string]time.Time
	freedOrder []freedAt
}

type freedAt struct {
	id string
	at time.Time
}

// receive handles one message from a peer: decode, drop malformed messages, unknown topics, the
// legacy envelope and this replica's own events, then queue it for its partition. It returns the
// router_id of a queued slot event, else 0.
func (m *Manager) receive(frames [][]byte) (origin uint64) {
	if len(frames) != 2 {
		m.drop(DropMalformed, "replica message without exactly 2 frames")
		return
	}
	now := m.cfg.Now()
	switch string(frames[0]) {
	case TopicSlotTracker:
		msg, err := DecodeSlot(frames[1])
		if errors.Is(err, errLegacyEnvelope) {
			m.drop(DropLegacyEnvelope, "replica event with a tenant_id envelope (an older binary); upgrade every selector together")
			return
		}
		if err != nil {
			m.log.Debug().Err(err).Msg("malformed slot-tracker payload")
			m.drop(DropMalformed, "")
			return
		}
		m.c.receivedSlot.Add(1)
		if msg.Event.Origin == m.cfg.RouterID {
			m.drop(DropOwn, "")
			return
		}
		m.enqueue(msg.Partition, inItem{slot: msg, at: now})
		return msg.Event.Origin
	case TopicSessionAffinity:
		msg, err := DecodeAffinity(frames[1])
		if err != nil {
			m.log.Debug().Err(err).Msg("malformed session-affinity payload")
			m.drop(DropMalformed, "")
			return
		}
		m.c.receivedAffinity.Add(1)
		if msg.Update.Version.WriterID == m.cfg.RouterID {
			m.drop(DropOwn, "")
			return
		}
		m.enqueue(msg.Partition, inItem{affinity: true, aff: msg, at: now})
	default:
		m.drop(DropUnknownTopic, "")
	}
	return 0
}

// enqueue drops events of partitions the applier does not know, and queues the rest on their
// partition's inbox (started on first use).
func (m *Manager) enqueue(p Partition, it inItem) {
	m.mu.Lock()
	a := m.applier
	m.mu.Unlock()
	if a == nil || !a.HasPartition(p) {
		m.drop(DropUnknownPartition, "")
		return
	}
	m.inMu.Lock()
	in := m.inboxes[p]
	if in == nil {
		in = &inbox{part: p, q: newFIFO[inItem](m.cfg.InboundCapacity), freed: map[string]time.Time{}}
		m.inboxes[p] = in
		m.wg.Add(1)
		go m.applyLoop(in, a)
	}
	m.inMu.Unlock()
	if in.q.push(it) != pushed {
		m.drop(DropInboundFull, "inbound replica queue full for partition "+p.String()+"; dropping events")
	}
}

// applyLoop applies one partition's queued events in arrival order until Close.
func (m *Manager) applyLoop(in *inbox, a Applier) {
	defer m.wg.Done()
	var items []inItem
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-in.q.wake:
		}
		for m.ctx.Err() == nil {
			in.applying.Store(int64(in.q.len()))
			items = in.q.swap(items)
			in.applying.Store(int64(len(items)))
			if len(items) == 0 {
				break
			}
			for i := range items {
				m.apply(in, a, &items[i])
				in.applying.Add(-1)
			}
		}
	}
}

// apply applies one event and counts the outcome.
func (m *Manager) apply(in *inbox, a Applier, it *inItem) {
	defer func() { m.c.inboundLag.observe(m.cfg.Now().Sub(it.at)) }()
	if it.affinity {
		if a.ApplyAffinity(in.part, it.aff.Update) {
			m.c.appliedAffinity.Add(1)
		} else {
			m.drop(DropAffinityNotApplied, "")
		}
		return
	}
	ev := it.slot.Event
	if ev.Kind == ledger.SlotAdmission && in.forget(ev.ID, it.at, m.cfg.FreedWindow) {
		m.drop(DropFreedBeforeAdmission, "")
		return
	}
	if ev.Kind == ledger.SlotAdmission && m.departedBefore(ev.Origin, it.at) {
		m.drop(DropDepartedReplica, "")
		return
	}
	applied, reason := a.ApplySlot(in.part, it.slot.BlockSize, ev)
	if applied {
		m.c.appliedSlot.Add(1)
		return
	}
	if ev.Kind == ledger.SlotFree && reason == DropUnknownReservation {
		in.remember(ev.ID, it.at, m.cfg.FreedWindow)
	}
	m.log.Debug().Str("reason", reason.String()).Str("kind", ev.Kind.String()).Str("request_id", ev.ID).
		Str("partition", in.part.String()).Msg("replica event dropped")
	m.drop(reason, "")
}

// remember records a free of id that found nothing to free, for window.
func (in *inbox) remember(id string, now time.Time, window time.Duration) {
	in.expire(now, window)
	if len(in.freedOrder) >= maxFreedPerPartition {
		old := in.freedOrder[0]
		in.freedOrder = in.freedOrder[1:]
		if in.freed[old.id] == old.at {
			delete(in.freed, old.id)
		}
	}
	in.freed[id] = now
	in.freedOrder = append(in.freedOrder, freedAt{id: id, at: now})
}

// forget reports whether a free of id was remembered within window, and forgets it.
func (in *inbox) forget(id string, now time.Time, window time.Duration) bool {
	in.expire(now, window)
	if _, ok := in.freed[id]; !ok {
		return false
	}
	delete(in.freed, id)
	return true
}

// expire drops remembered frees older than window.
func (in *inbox) expire(now time.Time, window time.Duration) {
	n := 0
	for n < len(in.freedOrder) && now.Sub(in.freedOrder[n].at) > window {
		if e := in.freedOrder[n]; in.freed[e.id] == e.at {
			delete(in.freed, e.id)
		}
		n++
	}
	if n > 0 {
		in.freedOrder = append(in.freedOrder[:0], in.freedOrder[n:]...)
	}
}
