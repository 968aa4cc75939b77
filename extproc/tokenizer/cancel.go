package tokenizer

import "context"

// stopCheckBytes is how much text an encode goes through between two looks at its context: 64
// KiB is well under a millisecond of BPE, and a look is one non-blocking channel receive.
const stopCheckBytes = 64 << 10

// encodeStop ends an encode soon after its request's context ends (audit 8 finding 3: a client
// that hung up kept its tokenizer budget and the CPU until a 64 MiB body was done). It belongs to
// one Tokenizer view (WithContext), used by one request at a time.
type encodeStop struct {
	ctx     context.Context
	bytes   int  // text since the last look
	stopped bool // ctx had ended at a look: the encode's ids are incomplete
}

// check counts n more bytes of text encoded and reports whether the encode must stop. A nil
// *encodeStop never stops. It is inlined (the encode loops call it once per piece): the nil test
// is all an encode without a context pays.
func (s *encodeStop) check(n int) bool {
	return s != nil && s.count(n)
}

// count is check for a non-nil s.
func (s *encodeStop) count(n int) bool {
	if s.bytes += n; s.bytes >= stopCheckBytes {
		s.bytes = 0
		s.stopped = s.ctx.Err() != nil
	}
	return s.stopped
}

// halted reports whether an encode stopped early (nil: never).
func (s *encodeStop) halted() bool { return s != nil && s.stopped }

// WithContext returns a view of t for one request (its calls one at a time) whose encodes stop
// soon (every 64 KiB of text) after ctx ends: the ids of that call are then incomplete, Err says
// so, and nothing incomplete goes into the conversation cache. The view shares t's vocabulary
// and caches; a ctx that never ends gives t itself.
func (t *Tokenizer) WithContext(ctx context.Context) *Tokenizer {
	if ctx.Done() == nil {
		return t
	}
	v := *t
	v.stop = &encodeStop{ctx: ctx}
	return &v
}

// Err returns the context's error once an encode of this WithContext view stopped early (the
// results of that call are incomplete and must be dropped), nil otherwise.
func (t *Tokenizer) Err() error {
	if !t.stop.halted() {
		return nil
	}
	return t.stop.ctx.Err()
}
