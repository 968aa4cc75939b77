package enginesim

import (
	"container/list"
	"context"
	"sync"
)

// fifoSem is a counting semaphore that admits waiters strictly in arrival
// order and lets a waiter leave the queue when its context ends.
type fifoSem struct {
	mu      sync.Mutex
	free    int
	waiters list.List // of chan struct{}
}

func newFIFOSem(n int) *fifoSem { return &fifoSem{free: n} }

// acquire takes one slot, waiting FIFO. It returns ctx.Err() if ctx ends first
// (the slot is then not held).
func (s *fifoSem) acquire(ctx context.Context) error {
	s.mu.Lock()
	if s.free > 0 && s.waiters.Len() == 0 {
		s.free--
		s.mu.Unlock()
		return nil
	}
	ch := make(chan struct{})
	elem := s.waiters.PushBack(ch)
	s.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		s.mu.Lock()
		select {
		case <-ch:
			// Granted concurrently with the cancellation: hand the slot on.
			s.mu.Unlock()
			s.release()
		default:
			s.waiters.Remove(elem)
			s.mu.Unlock()
		}
		return ctx.Err()
	}
}

// release returns one slot, granting it to the oldest waiter if any.
func (s *fifoSem) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if front := s.waiters.Front(); front != nil {
		s.waiters.Remove(front)
		close(front.Value.(chan struct{}))
		return
	}
	s.free++
}

// waiting returns the number of queued waiters.
func (s *fifoSem) waiting() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.waiters.Len()
}
