package picker_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"runtime"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvepp/kvepp/picker"
)

// endlessDump is a reader of `{"m:default":{"block_size":4,"events":[` followed by valid events
// forever (or, with filler, one event whose unknown string field never ends): what a broken or
// hostile peer may send.
type endlessDump struct {
	head   []byte
	filler bool
	i      int
	read   int64
	buf    []byte
}

func newEndlessDump(filler bool) *endlessDump {
	head := `{"m:default":{"block_size":4,"events":[`
	if filler {
		head += `{"worker_id":1,"padding":"`
	}
	return &endlessDump{head: []byte(head), filler: filler}
}

func (d *endlessDump) Read(p []byte) (int, error) {
	for len(d.buf) < len(p) {
		switch {
		case d.head != nil:
			d.buf, d.head = append(d.buf, d.head...), nil
		case d.filler:
			d.buf = append(d.buf, strings.Repeat("a", 4096)...)
		default:
			d.i++
			d.buf = fmt.Appendf(d.buf, `{"worker_id":1,"storage_tier":"device","event":{"event_id":%d,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":%d,"tokens_hash":%d}]}},"dp_rank":0}},`, d.i, d.i, d.i)
		}
	}
	n := copy(p, d.buf)
	d.buf = d.buf[n:]
	d.read += int64(n)
	return n, nil
}

// allocatedDuring returns the bytes allocated by f.
func allocatedDuring(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

func TestDecodeDumpStopsAnEndlessDumpAtItsBoundInBoundedMemory(t *testing.T) {
	t.Run("more events than MaxEvents", func(t *testing.T) {
		src := newEndlessDump(false)
		var err error
		alloc := allocatedDuring(func() {
			_, err = picker.DecodeDump(src, picker.DumpLimits{MaxEvents: 10000})
		})
		if !errors.Is(err, picker.ErrDumpTooLarge) || !strings.Contains(err.Error(), "10000 events") {
			t.Fatalf("err = %v, want ErrDumpTooLarge naming 10000 events", err)
		}
		// 10,000 events are about 1.9 MB of JSON; decoding stops right after them.
		if src.read > 4<<20 {
			t.Fatalf("read %d bytes of the dump for a 10,000-event bound", src.read)
		}
		if alloc > 64<<20 {
			t.Fatalf("allocated %d bytes for a 10,000-event bound", alloc)
		}
	})
	t.Run("more bytes than MaxBytes inside one event", func(t *testing.T) {
		src := newEndlessDump(true)
		var err error
		alloc := allocatedDuring(func() {
			_, err = picker.DecodeDump(src, picker.DumpLimits{MaxBytes: 1 << 20})
		})
		if !errors.Is(err, picker.ErrDumpTooLarge) || !strings.Contains(err.Error(), "1048576 bytes") {
			t.Fatalf("err = %v, want ErrDumpTooLarge naming 1048576 bytes", err)
		}
		if src.read > 2<<20 {
			t.Fatalf("read %d bytes of the dump for a 1 MiB bound", src.read)
		}
		if alloc > 32<<20 {
			t.Fatalf("allocated %d bytes for a 1 MiB bound", alloc)
		}
	})
}

func TestDecodeDumpSkipsEachBadPartitionAndReportsIt(t *testing.T) {
	ev := func(h int) string {
		return fmt.Sprintf(`{"worker_id":1,"storage_tier":"device","event":{"event_id":0,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":%d,"tokens_hash":%d}]}},"dp_rank":0}}`, h, h)
	}
	longModel := strings.Repeat("x", 1000)
	body := `{` +
		`"good:default":{"block_size":4,"extra":{"ignored":[1,2]},"events":[` + ev(1) + `,` + ev(2) + `]},` +
		`"nocolon":{"block_size":4,"events":[` + ev(3) + `]},` +
		`"` + longModel + `:default":{"block_size":4,"events":[` + ev(4) + `]},` +
		`"ctl\u0001:default":{"block_size":4,"events":[]},` +
		`"bs0:default":{"block_size":0,"events":[` + ev(5) + `]},` +
		`"nobs:default":{"events":[` + ev(6) + `]},` +
		`"strid:default":{"block_size":4,"events":[` + ev(7) + `,{"worker_id":"str"}]},` +
		`"notobject:default":[1,{"a":[2]}],` +
		`"good:default":{"block_size":4,"events":[]},` +
		`"other:g":{"block_size":16,"events":null}` +
		`}`
	d, err := picker.DecodeDump(strings.NewReader(body), picker.DumpLimits{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, p := range d.Partitions {
		got = append(got, fmt.Sprintf("%s bs=%d events=%d", p.Key, p.BlockSize, p.Events))
	}
	if diff := cmp.Diff([]string{"good:default bs=4 events=2", "other:g bs=16 events=0"}, got); diff != "" {
		t.Fatalf("partitions (-want +got):\n%s", diff)
	}
	reasons := map[string]string{}
	for _, s := range d.Skipped {
		if len(s.Key) > 110 {
			t.Errorf("skipped key quoted with %d bytes", len(s.Key))
		}
		reasons[s.Key] = s.Reason
	}
	for key, want := range map[string]string{
		"nocolon":                    "not <model_name>:<routing_group>",
		longModel[:100] + "…":        "model_name",
		"ctl\x01:default":            "control character",
		"bs0:default":                "block_size must be greater than 0",
		"nobs:default":               "block_size is missing",
		"strid:default":              "events[1]",
		"notobject:default":          "not an object",
		"good:default (second time)": "appears twice",
	} {
		if !strings.Contains(reasons[key], want) {
			t.Errorf("skipped %q: reason %q, want it to contain %q (all: %v)", key, reasons[key], want, reasons)
		}
	}
	if d.Events != 8 {
		t.Errorf("Events = %d, want every event counted (8)", d.Events)
	}
}

func TestDecodeDumpRefusesMalformedJSONWhole(t *testing.T) {
	for _, body := range []string{``, `null`, `[]`, `{"m:default":{"block_size":4,"events":[`, `<html>`, `{"m:default":{"block_size":4}} trailing`} {
		if _, err := picker.DecodeDump(strings.NewReader(body), picker.DumpLimits{}); err == nil || errors.Is(err, picker.ErrDumpTooLarge) {
			t.Errorf("DecodeDump(%q) = %v, want a decoding error", body, err)
		}
	}
}

// TestRestoreDumpReproducesTheDump: a service's own /dump, decoded in chunks and restored into a
// fresh service, gives the same dump back.
func TestRestoreDumpReproducesTheDump(t *testing.T) {
	src := newService(t, func(c *picker.Config) { c.Router.UseKVEvents = false })
	for id := uint64(1); id <= 3; id++ {
		if _, err := src.UpsertWorker(ctxb(), worker(id), picker.SourceAPI); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 40; i++ {
		prompt := append(tokens(8), uint32(1000+i), uint32(2000+i), 3, 4)
		if _, err := src.SelectAndReserve(ctxb(), picker.SelectRequest{ModelName: "model", Prompt: picker.Prompt{TokenIDs: prompt}}); err != nil {
			t.Fatal(err)
		}
	}
	want, err := json.Marshal(src.Dump())
	if err != nil {
		t.Fatal(err)
	}
	defer picker.SetDumpChunkEvents(7)()
	d, err := picker.DecodeDump(io.MultiReader(bytes.NewReader(want)), picker.DumpLimits{})
	if err != nil {
		t.Fatal(err)
	}
	dst := newService(t, func(c *picker.Config) { c.Router.UseKVEvents = false })
	if fails := dst.RestoreDump(d, 2); len(fails) != 0 {
		t.Fatalf("restore failures: %v", fails)
	}
	got, _ := json.Marshal(dst.Dump())
	if len(d.Partitions) != 1 || d.Partitions[0].Events < 40 {
		t.Fatalf("the dump holds %+v, want one partition of many events", d.Partitions)
	}
	if string(got) != string(want) {
		t.Fatalf("restored dump differs:\n got %s\nwant %s", got, want)
	}
}

// BenchmarkDecodeDump decodes a 100,000-event /dump (one partition, chained single-block events
// as Dump emits them); bytes/op is the JSON text, B/op what decoding and staging allocate.
func BenchmarkDecodeDump(b *testing.B) {
	var buf bytes.Buffer
	buf.WriteString(`{"m:default":{"block_size":16,"events":[`)
	for i := 1; i <= 100000; i++ {
		if i > 1 {
			buf.WriteByte(',')
		}
		parent := "null"
		if i > 1 {
			parent = fmt.Sprint(i - 1)
		}
		fmt.Fprintf(&buf, `{"worker_id":1,"storage_tier":"device","event":{"event_id":%d,"data":{"stored":{"parent_hash":%s,"blocks":[{"block_hash":%d,"tokens_hash":%d}]}},"dp_rank":0}}`, i, parent, i, i)
	}
	buf.WriteString(`]}}`)
	b.SetBytes(int64(buf.Len()))
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		d, err := picker.DecodeDump(bytes.NewReader(buf.Bytes()), picker.DumpLimits{})
		if err != nil || d.Events != 100000 {
			b.Fatal(err)
		}
	}
}
