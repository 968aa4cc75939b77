package extproc

import (
	"context"
	"sync"
	"time"
)

// releaseContext is the context of a Free or PrefillComplete call (Server.releaseCtx): the
// stream's values without its cancellation, with a deadline ReleaseTimeout away. It is
// context.WithTimeout(context.WithoutCancel(stream), ReleaseTimeout) except that its timer is
// started only when Done is first called: every exchange makes two such calls, and the picker of
// one process (picker.Service) never waits on its context, so most releases need no timer at all
// (one allocation instead of four, and no timer-heap insertion and removal). Err reads the clock
// until then, so a call that only polls Err still sees the deadline pass.
type releaseContext struct {
	context.Context // the stream's context without its cancellation (values only)
	deadline        time.Time

	mu    sync.Mutex
	done  chan struct{} // made by the first Done call (or by the end of the context)
	timer *time.Timer   // closes done at the deadline; started by the first Done call
	err   error         // context.DeadlineExceeded or context.Canceled once ended
}

// newReleaseContext returns the release context of parent bounded by timeout. Like a
// context.CancelFunc, its cancel must be called once the call it was made for returns.
func newReleaseContext(parent context.Context, timeout time.Duration) *releaseContext {
	return &releaseContext{Context: context.WithoutCancel(parent), deadline: time.Now().Add(timeout)}
}

// Deadline reports the release deadline.
func (c *releaseContext) Deadline() (time.Time, bool) { return c.deadline, true }

// Done returns a channel closed at the deadline or when the context is cancelled, starting the
// deadline timer on its first call.
func (c *releaseContext) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		c.done = make(chan struct{})
		switch d := time.Until(c.deadline); {
		case c.err != nil:
			close(c.done)
		case d <= 0:
			c.endLocked(context.DeadlineExceeded)
		default:
			c.timer = time.AfterFunc(d, func() { c.end(context.DeadlineExceeded) })
		}
	}
	return c.done
}

// Err returns nil until the deadline passes or the context is cancelled, then
// context.DeadlineExceeded or context.Canceled (whichever came first) from then on.
func (c *releaseContext) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil && !time.Now().Before(c.deadline) {
		c.endLocked(context.DeadlineExceeded)
	}
	return c.err
}

// cancel ends the context with context.Canceled (unless it has already ended) and stops its timer.
func (c *releaseContext) cancel() { c.end(context.Canceled) }

func (c *releaseContext) end(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.endLocked(err)
}

// endLocked records err as the end of the context, closes done if it was handed out and stops the
// timer. Later ends change nothing. Caller holds c.mu.
func (c *releaseContext) endLocked(err error) {
	if c.err != nil {
		return
	}
	c.err = err
	if c.done != nil {
		close(c.done)
	}
	if c.timer != nil {
		c.timer.Stop()
	}
}
