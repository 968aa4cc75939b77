// Package helpertest tests test helpers (sharedtest, binarytest, policytest, catalogtest …): it
// runs a helper against a testing.TB that records the helper's failures instead of failing the
// calling test, so a test can assert that a helper fails, and with which message.
package helpertest

import (
	"fmt"
	"runtime"
	"sync"
	"testing"
)

// Failures runs fn in a new goroutine with a testing.TB that records every Error, Errorf, Fatal
// and Fatalf message (formatted as fmt.Sprint / fmt.Sprintf would) and returns them in order.
// Fatal and Fatalf stop fn's goroutine, as they do in a test. Every other method — Helper,
// Cleanup, TempDir, Log … — is t's own.
func Failures(t testing.TB, fn func(tb testing.TB)) []string {
	r := &recorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(r)
	}()
	<-done
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.msgs
}

// recorder records failures; the embedded testing.TB answers everything else.
type recorder struct {
	testing.TB
	mu   sync.Mutex
	msgs []string
}

func (r *recorder) Helper() {}

func (r *recorder) add(msg string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, msg)
}

func (r *recorder) Error(args ...any) { r.add(fmt.Sprint(args...)) }

func (r *recorder) Errorf(format string, args ...any) { r.add(fmt.Sprintf(format, args...)) }

func (r *recorder) Fatal(args ...any) {
	r.add(fmt.Sprint(args...))
	runtime.Goexit()
}

func (r *recorder) Fatalf(format string, args ...any) {
	r.add(fmt.Sprintf(format, args...))
	runtime.Goexit()
}
