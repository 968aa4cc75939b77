package enginesim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// testClient is shared by the HTTP tests; TestMain closes its idle connections
// before checking for leaked goroutines.
var testTransport = &http.Transport{}
var testClient = &http.Client{Transport: testTransport, Timeout: 10 * time.Second}

func TestMain(m *testing.M) {
	code := m.Run()
	testTransport.CloseIdleConnections()
	if code == 0 {
		if leaked := leakedGoroutines(3 * time.Second); len(leaked) > 0 {
			fmt.Fprintf(os.Stderr, "leaked goroutines after all tests:\n\n%s\n", strings.Join(leaked, "\n\n"))
			code = 1
		}
	}
	os.Exit(code)
}

// knownLibraryLeaks are goroutines that go-zeromq/zmq4 v0.17.0 never stops: a
// PUB socket's writer loop (pubMWriter.run) waits on a condition variable that
// only pubMWriter.Close signals, and socket.Close never calls it.
var knownLibraryLeaks = []string{"zmq4.(*pubMWriter).run"}

// leakedGoroutines waits up to d for goroutines of this package, zmq4 or
// net/http to exit and returns the stacks of those that remain.
func leakedGoroutines(d time.Duration) []string {
	deadline := time.Now().Add(d)
	for {
		var leaked []string
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		for _, g := range strings.Split(string(buf), "\n\n") {
			if strings.Contains(g, "leakedGoroutines") || strings.Contains(g, "testing.(*M)") {
				continue
			}
			if !strings.Contains(g, "enginesim") && !strings.Contains(g, "zmq4") && !strings.Contains(g, "net/http") {
				continue
			}
			known := false
			for _, k := range knownLibraryLeaks {
				known = known || strings.Contains(g, k)
			}
			if !known {
				leaked = append(leaked, g)
			}
		}
		if len(leaked) == 0 || time.Now().After(deadline) {
			return leaked
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startWorker starts a worker and closes it when the test ends.
func startWorker(t testing.TB, cfg Config) *Worker {
	t.Helper()
	w, err := Start(cfg)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		if err := w.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return w
}

// seqTokens returns n token ids start, start+1, ….
func seqTokens(start, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(start + i)
	}
	return out
}

// postJSON posts body to url and returns the status and response body.
func postJSON(t testing.TB, url string, body any) (int, http.Header, []byte) {
	t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := testClient.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read %s: %v", url, err)
	}
	return resp.StatusCode, resp.Header, data
}

// decodedEvent is a test-side reading of one array-form event.
type decodedEvent struct {
	Tag       string
	Hashes    []uint64
	HasParent bool
	Parent    uint64
	Tokens    []uint32
	BlockSize int
	Medium    string
	Len       int // array length on the wire
}

type decodedBatch struct {
	TS     float64
	Events []decodedEvent
	DPRank uint64
}

func toU64(t testing.TB, v any) uint64 {
	t.Helper()
	switch n := v.(type) {
	case int8:
		return uint64(n)
	case int16:
		return uint64(n)
	case int32:
		return uint64(n)
	case int64:
		return uint64(n)
	case uint8:
		return uint64(n)
	case uint16:
		return uint64(n)
	case uint32:
		return uint64(n)
	case uint64:
		return n
	}
	t.Fatalf("%#v is not an integer", v)
	return 0
}

// decodeBatch decodes a payload written by EncodeBatch with a generic
// MessagePack decoder.
func decodeBatch(t testing.TB, payload []byte) decodedBatch {
	t.Helper()
	var top []any
	if err := msgpack.Unmarshal(payload, &top); err != nil {
		t.Fatalf("decode batch: %v", err)
	}
	if len(top) != 3 {
		t.Fatalf("batch has %d elements, want 3", len(top))
	}
	var b decodedBatch
	ts, ok := top[0].(float64)
	if !ok {
		t.Fatalf("ts %#v is not a float64", top[0])
	}
	b.TS = ts
	b.DPRank = toU64(t, top[2])
	for _, e := range top[1].([]any) {
		arr := e.([]any)
		ev := decodedEvent{Tag: arr[0].(string), Len: len(arr)}
		if len(arr) > 1 {
			for _, h := range arr[1].([]any) {
				ev.Hashes = append(ev.Hashes, toU64(t, h))
			}
		}
		switch ev.Tag {
		case "BlockStored":
			if arr[2] != nil {
				ev.HasParent, ev.Parent = true, toU64(t, arr[2])
			}
			for _, tok := range arr[3].([]any) {
				ev.Tokens = append(ev.Tokens, uint32(toU64(t, tok)))
			}
			ev.BlockSize = int(toU64(t, arr[4]))
			ev.Medium = arr[6].(string)
		case "BlockRemoved":
			ev.Medium = arr[2].(string)
		}
		b.Events = append(b.Events, ev)
	}
	return b
}

// subscriber is a real ZMQ SUB client of a worker's KV events.
type subscriber struct {
	sock zmq4.Socket
	msgs chan zmq4.Msg
	done chan struct{}
}

// subscribe connects a SUB socket to w and waits until the worker sees the
// subscription, so no batch published afterwards is lost.
func subscribe(t testing.TB, w *Worker) *subscriber {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s := &subscriber{sock: zmq4.NewSub(ctx), msgs: make(chan zmq4.Msg, 64), done: make(chan struct{})}
	t.Cleanup(func() {
		_ = s.sock.Close()
		cancel()
		<-s.done
	})
	if err := s.sock.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	if err := s.sock.Dial(w.KVEventsEndpoint()); err != nil {
		t.Fatalf("dial %s: %v", w.KVEventsEndpoint(), err)
	}
	go func() {
		defer close(s.done)
		for {
			msg, err := s.sock.Recv()
			if err != nil {
				return
			}
			select {
			case s.msgs <- msg:
			case <-ctx.Done():
				return
			}
		}
	}()
	waitFor(t, "the KV event subscription", w.HasSubscriber)
	return s
}

// next returns the next live message or fails after 5 s.
func (s *subscriber) next(t testing.TB) zmq4.Msg {
	t.Helper()
	select {
	case msg := <-s.msgs:
		return msg
	case <-time.After(5 * time.Second):
		t.Fatal("no KV event batch within 5 s")
		return zmq4.Msg{}
	}
}

// waitFor polls cond every millisecond for up to 5 s.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}
