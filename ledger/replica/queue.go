package replica

import "sync"

// shrinkAbove is the buffer capacity above which a drained queue buffer is dropped instead of
// reused, so a burst's memory goes back to the runtime once the burst is drained.
const shrinkAbove = 4096

// fifo is a bounded multi-producer, single-consumer queue. push never blocks: beyond limit items
// it refuses the newest (selection-service.md §15.4 "full → drop newest"). Memory grows with the
// items queued, not with the limit.
type fifo[T any] struct {
	mu     sync.Mutex
	items  []T
	limit  int
	closed bool
	wake   chan struct{} // one token: "items may be waiting"
}

func newFIFO[T any](limit int) *fifo[T] {
	return &fifo[T]{limit: limit, wake: make(chan struct{}, 1)}
}

// pushResult says what push did.
type pushResult uint8

const (
	pushed pushResult = iota
	pushFull
	pushClosed
)

// push appends v unless the queue is full or closed.
func (q *fifo[T]) push(v T) pushResult {
	q.mu.Lock()
	switch {
	case q.closed:
		q.mu.Unlock()
		return pushClosed
	case len(q.items) >= q.limit:
		q.mu.Unlock()
		return pushFull
	}
	q.items = append(q.items, v)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
	return pushed
}

// swap takes every queued item, handing the queue buf (emptied) to reuse. The caller owns the
// returned slice until it hands it back through the next swap.
func (q *fifo[T]) swap(buf []T) []T {
	clear(buf)
	buf = buf[:0]
	if cap(buf) > shrinkAbove {
		buf = nil
	}
	q.mu.Lock()
	out := q.items
	q.items = buf
	q.mu.Unlock()
	return out
}

// len returns the number of queued items.
func (q *fifo[T]) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.items)
}

// close refuses every later push; queued items stay for the consumer.
func (q *fifo[T]) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
}
