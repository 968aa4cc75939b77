package extproc

import (
	"context"
	"errors"
	"testing"
	"time"
)

type releaseKey struct{}

// TestReleaseContextIsATimeoutContext: a release context behaves as
// context.WithTimeout(context.WithoutCancel(parent), timeout) — the parent's values, not its
// cancellation; a deadline that ends it with DeadlineExceeded whether it is waited on (Done) or
// polled (Err); cancel ends it with Canceled — and starts no timer unless Done is called.
func TestReleaseContextIsATimeoutContext(t *testing.T) {
	parent, cancelParent := context.WithCancel(context.WithValue(context.Background(), releaseKey{}, "stream"))
	cancelParent()

	t.Run("values, deadline, cancel", func(t *testing.T) {
		before := time.Now()
		ctx := newReleaseContext(parent, time.Hour)
		cancel := ctx.cancel
		if ctx.Value(releaseKey{}) != "stream" {
			t.Fatal("the stream's values are not visible")
		}
		if d, ok := ctx.Deadline(); !ok || d.Before(before.Add(time.Hour)) || d.After(time.Now().Add(time.Hour)) {
			t.Fatalf("deadline %v %v, want an hour from now", d, ok)
		}
		if err := ctx.Err(); err != nil {
			t.Fatalf("Err %v before the deadline, although the parent is cancelled", err)
		}
		if ctx.timer != nil {
			t.Fatal("a timer was started although Done was never called")
		}
		done := ctx.Done()
		select {
		case <-done:
			t.Fatal("Done closed before the deadline")
		default:
		}
		if ctx.timer == nil {
			t.Fatal("Done started no deadline timer")
		}
		cancel()
		<-done
		if !errors.Is(ctx.Err(), context.Canceled) {
			t.Fatalf("Err %v after cancel, want Canceled", ctx.Err())
		}
		cancel() // idempotent
		if ctx.Done() != done {
			t.Fatal("Done changed")
		}
	})
	t.Run("the deadline closes Done", func(t *testing.T) {
		ctx := newReleaseContext(parent, 20*time.Millisecond)
		cancel := ctx.cancel
		defer cancel()
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("Done not closed at the deadline")
		}
		if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			t.Fatalf("Err %v, want DeadlineExceeded", ctx.Err())
		}
		cancel()
		if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			t.Fatalf("Err %v after a late cancel, want DeadlineExceeded still", ctx.Err())
		}
	})
	t.Run("a polled deadline", func(t *testing.T) {
		ctx := newReleaseContext(parent, time.Millisecond)
		cancel := ctx.cancel
		defer cancel()
		time.Sleep(5 * time.Millisecond)
		if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			t.Fatalf("Err %v past the deadline, want DeadlineExceeded", ctx.Err())
		}
		select {
		case <-ctx.Done():
		default:
			t.Fatal("Done open after Err reported the deadline")
		}
		if ctx.timer != nil {
			t.Fatal("a timer was started for a deadline already past")
		}
	})
	t.Run("a cancelled context's Done is closed", func(t *testing.T) {
		ctx := newReleaseContext(parent, time.Hour)
		cancel := ctx.cancel
		cancel()
		select {
		case <-ctx.Done():
		default:
			t.Fatal("Done open after cancel")
		}
	})
	t.Run("children see its end", func(t *testing.T) {
		ctx := newReleaseContext(parent, time.Hour)
		cancel := ctx.cancel
		child, cancelChild := context.WithCancel(ctx)
		defer cancelChild()
		cancel()
		select {
		case <-child.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("a child context outlived its release context")
		}
	})
	if n := testing.AllocsPerRun(100, func() {
		ctx := newReleaseContext(parent, time.Hour)
		_ = ctx.Err()
		ctx.cancel()
	}); n > 2 {
		t.Errorf("%v allocations per release context, want at most 2", n)
	}
}
