package kvindex

import (
	"encoding/json"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// byteReader hands out the fuzz input one byte at a time (zero once exhausted).
type byteReader struct {
	b []byte
	i int
}

func (r *byteReader) next() byte {
	if r.i >= len(r.b) {
		return 0
	}
	v := r.b[r.i]
	r.i++
	return v
}

func (r *byteReader) done() bool { return r.i >= len(r.b) }

// decodeOps turns fuzz bytes into a stream of events over 4 workers × 2 ranks with small hash
// universes (so that shared prefixes, overwrites, orphans and collisions are common). A step with
// Kind removeWorkerKind calls RemoveWorker. Tier and kind are occasionally out of range.
func decodeOps(data []byte) []Event {
	r := &byteReader{b: data}
	var evs []Event
	for !r.done() && len(evs) < 256 {
		op := r.next()
		ev := Event{WorkerID: uint64(op>>2&3) + 1, DPRank: uint32(op >> 4 & 1), EventID: uint64(len(evs))}
		ev.Tier = TierDevice
		if t := op >> 5; t >= 4 {
			ev.Tier = Tier(t - 4) // 0..3; half of the ops stay on the device tier
			if t == 7 && r.next() == 0xff {
				ev.Tier = Tier(9)
			}
		}
		base := ev.WorkerID * 100
		switch op & 3 {
		case 0, 1:
			ev.Kind = EventStored
			if pb := r.next(); pb&1 == 1 {
				ev.HasParent, ev.ParentHash = true, base+uint64(pb>>1&15)
			}
			n := int(r.next()%6) + 1
			for i := 0; i < n; i++ {
				b := r.next()
				ev.Blocks = append(ev.Blocks, StoredBlock{BlockHash: base + uint64(b&15), TokensHash: uint64(b >> 4 & 7)})
			}
		case 2:
			ev.Kind = EventRemoved
			n := int(r.next()%3) + 1
			for i := 0; i < n; i++ {
				ev.BlockHashes = append(ev.BlockHashes, base+uint64(r.next()&15))
			}
		default:
			ev.Kind = EventCleared
			if sel := r.next(); sel%4 == 0 {
				ev.Kind = removeWorkerKind
			} else if sel == 0xff {
				ev.Kind = EventKind(99)
			}
		}
		evs = append(evs, ev)
	}
	return evs
}

// FuzzApply applies a random event stream to a single-shard index and to one spreading every
// worker over its own shard (whose writes let lookups in at every yield point), and checks: no
// panic; the structural invariants and Stats entry counts against a recount; agreement with
// the reference model and between the two indexes
// (errors, counters, matches, dumps); no match longer than its query; and that the dump survives
// JSON and restores to the same device-tier answers.
func FuzzApply(f *testing.F) {
	f.Add([]byte{0x00, 0x00, 0x03, 0x10, 0x21, 0x32})
	f.Add([]byte{0x00, 0x00, 0x02, 0x10, 0x21, 0x04, 0x00, 0x02, 0x10, 0x21, 0x02, 0x00, 0x00})
	f.Add([]byte{0x80, 0x00, 0x01, 0x10, 0xa0, 0x03, 0x01, 0x33, 0x03, 0x00})
	f.Fuzz(func(t *testing.T, data []byte) {
		evs := decodeOps(data)
		ix, m := New(Config{BlockSize: 4}), newModel()
		sharded := New(Config{BlockSize: 4, Shards: 4, ShardWorkers: 1})
		// The sharded index also lets lookups in at every yield point of its writes: whatever
		// they see, they must not fail, and the end state must not change.
		forceYields(sharded, func() {
			for _, mt := range sharded.FindMatches([]uint64{0, 1, 2, 3}, nil) {
				if mt.Blocks() > 4 {
					t.Errorf("match %+v longer than its query, mid-write", mt)
				}
			}
			_ = sharded.Stats()
			_ = sharded.Dump()
		})
		for _, ev := range evs {
			if ev.Kind == removeWorkerKind {
				ix.RemoveWorker(ev.WorkerID)
				sharded.RemoveWorker(ev.WorkerID)
				m.removeWorker(ev.WorkerID)
				continue
			}
			err := ix.Apply(ev)
			if err2 := sharded.Apply(ev); (err == nil) != (err2 == nil) {
				t.Fatalf("event %+v: error %v, sharded %v", ev, err, err2)
			}
			if ev.Tier < numTiers {
				m.apply(ev)
			}
		}
		for _, x := range []*Index{ix, sharded} {
			if err := checkInvariants(x); err != nil {
				t.Fatal(err)
			}
		}
		if diff := cmp.Diff(ix.Stats(), sharded.Stats()); diff != "" {
			t.Fatalf("stats (-single +sharded):\n%s", diff)
		}
		if got, want := ix.Stats().Entries, m.entries(); got != want {
			t.Fatalf("entries %d, model %d", got, want)
		}
		var queries [][]uint64
		for i := 0; i < 8; i++ {
			q := []uint64{}
			for j := 0; j < i; j++ {
				q = append(q, uint64((i*7+j*3)%8))
			}
			queries = append(queries, q)
		}
		for len(queries[0]) < 12 {
			keys := childKeys(ix, queries[0])
			if len(keys) == 0 {
				break
			}
			queries[0] = append(queries[0], keys[0])
		}

		raw, err := json.Marshal(ix.Dump())
		if err != nil {
			t.Fatal(err)
		}
		if raw2, _ := json.Marshal(sharded.Dump()); string(raw2) != string(raw) {
			t.Fatal("the sharded index dumps differently")
		}
		var dumped []RouterEvent
		if err := json.Unmarshal(raw, &dumped); err != nil {
			t.Fatal(err)
		}
		restored := New(Config{BlockSize: 4})
		if err := restored.Restore(dumped); err != nil {
			t.Fatalf("restore: %v", err)
		}
		for _, q := range queries {
			got := matches(ix, q...)
			for _, mt := range got {
				if mt.Blocks() > uint32(len(q)) {
					t.Fatalf("match %+v longer than query %v", mt, q)
				}
			}
			if diff := cmp.Diff(m.findMatches(q), got); diff != "" {
				t.Fatalf("query %v (-model +index):\n%s", q, diff)
			}
			if diff := cmp.Diff(got, matches(sharded, q...)); diff != "" {
				t.Fatalf("query %v (-single +sharded):\n%s", q, diff)
			}
			if diff := cmp.Diff(deviceOnly(got), matches(restored, q...)); diff != "" {
				t.Fatalf("query %v (-original +restored):\n%s", q, diff)
			}
		}
	})
}
