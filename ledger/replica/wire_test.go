package replica

import (
	"errors"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvepp/kvepp/ledger"
)

func u32p(v uint32) *uint32 { return &v }
func u64p(v uint64) *uint64 { return &v }
func strp(v string) *string { return &v }

var part = Partition{ModelName: "Qwen/Qwen3-0.6B", RoutingGroup: "default"}

func TestSlotRoundTrip(t *testing.T) {
	for _, ev := range []ledger.SlotEvent{
		{Kind: ledger.SlotAdmission, ID: "req-1", Candidate: ledger.Candidate{WorkerID: 1 << 52, DPRank: 3}, Origin: 99,
			LoraName: strp("lora-a"), SequenceHashes: []uint64{1, 1<<64 - 1}, TrackPrefillTokens: true,
			PrefillTokens: u64p(384), ExpectedOutputTokens: u32p(128)},
		{Kind: ledger.SlotAdmission, ID: "req-2", Candidate: ledger.Candidate{WorkerID: 7}, Origin: 1},
		{Kind: ledger.SlotPrefillComplete, ID: "req-1", Candidate: ledger.Candidate{WorkerID: 7, DPRank: 1}, Origin: 5},
		{Kind: ledger.SlotFree, ID: "req-1", Candidate: ledger.Candidate{WorkerID: 7}, Origin: 5},
	} {
		t.Run(ev.Kind.String()+" "+ev.ID, func(t *testing.T) {
			in := SlotMessage{Partition: part, BlockSize: 16, Event: ev}
			b, err := EncodeSlot(in)
			if err != nil {
				t.Fatal(err)
			}
			out, err := DecodeSlot(b)
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(in, out); d != "" {
				t.Fatalf("round trip (-in +out):\n%s", d)
			}
		})
	}
}

func TestSlotEnvelopeShape(t *testing.T) {
	b, err := EncodeSlot(SlotMessage{Partition: part, BlockSize: 16, Event: ledger.SlotEvent{
		Kind: ledger.SlotAdmission, ID: "r", Candidate: ledger.Candidate{WorkerID: 2, DPRank: 1}, Origin: 9,
		SequenceHashes: []uint64{5}, TrackPrefillTokens: true, PrefillTokens: u64p(12)}})
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := msgpack.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	keys := func(m map[string]any) []string {
		var ks []string
		for k := range m {
			ks = append(ks, k)
		}
		slices.Sort(ks)
		return ks
	}
	if got, want := keys(m), []string{"block_size", "event", "model_name", "routing_group"}; !slices.Equal(got, want) {
		t.Fatalf("envelope keys %v, want exactly %v (acceptance 60)", got, want)
	}
	ev := m["event"].(map[string]any)
	if got, want := keys(ev), []string{"data", "lora_name", "request_id", "router_id", "worker"}; !slices.Equal(got, want) {
		t.Fatalf("event keys %v, want %v", got, want)
	}
	add := ev["data"].(map[string]any)["AddRequest"].(map[string]any)
	if got, want := keys(add), []string{"expected_output_tokens", "prefill_load_hint", "token_sequence", "track_prefill_tokens"}; !slices.Equal(got, want) {
		t.Fatalf("AddRequest keys %v, want %v", got, want)
	}
	hint := add["prefill_load_hint"].(map[string]any)
	if hint["expected_prefill_duration"] != nil || hint["initial_effective_prefill_tokens"] == nil {
		t.Fatalf("prefill_load_hint = %v", hint)
	}
	for _, kind := range []ledger.SlotEventKind{ledger.SlotPrefillComplete, ledger.SlotFree} {
		b, _ := EncodeSlot(SlotMessage{Partition: part, BlockSize: 16, Event: ledger.SlotEvent{Kind: kind, ID: "r", Origin: 9}})
		var m map[string]any
		if err := msgpack.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		if got := m["event"].(map[string]any)["data"]; got != kind.String() {
			t.Fatalf("%v data = %#v, want the plain string", kind, got)
		}
	}
}

// foreign builds a payload the way another implementation might: any integer widths, unit
// variants as one-entry maps, extra keys.
func foreign(t *testing.T, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDecodeSlotAcceptsOtherEncoders(t *testing.T) {
	b := foreign(t, map[string]any{
		"model_name": "m", "routing_group": "g", "block_size": int8(16), "extra": []int{1},
		"event": map[string]any{
			"request_id": "r", "worker": map[string]any{"worker_id": int64(4), "dp_rank": uint16(2)},
			"router_id": uint8(3), "lora_name": nil, "unknown": true,
			"data": map[string]any{"AddRequest": map[string]any{
				"token_sequence": []any{int8(1), uint64(1<<64 - 1), int32(7)},
				"prefill_load_hint": map[string]any{
					"initial_effective_prefill_tokens": uint32(40),
					"expected_prefill_duration":        map[string]any{"secs": 1, "nanos": 5},
				},
			}},
		},
	})
	got, err := DecodeSlot(b)
	if err != nil {
		t.Fatal(err)
	}
	want := SlotMessage{Partition: Partition{"m", "g"}, BlockSize: 16, Event: ledger.SlotEvent{
		Kind: ledger.SlotAdmission, ID: "r", Candidate: ledger.Candidate{WorkerID: 4, DPRank: 2}, Origin: 3,
		SequenceHashes: []uint64{1, 1<<64 - 1, 7}, TrackPrefillTokens: true, PrefillTokens: u64p(40)}}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("(-want +got):\n%s", d)
	}
	for _, unit := range []string{"MarkPrefillCompleted", "Free"} {
		b := foreign(t, map[string]any{"model_name": "m", "routing_group": "g", "block_size": 4, "event": map[string]any{
			"request_id": "r", "worker": map[string]any{"worker_id": 1, "dp_rank": 0}, "router_id": 3, "data": map[string]any{unit: nil}}})
		got, err := DecodeSlot(b)
		if err != nil || got.Event.Kind.String() != unit {
			t.Fatalf("%s as a one-entry map: %+v, %v", unit, got.Event, err)
		}
	}
}

func TestDecodeSlotRejects(t *testing.T) {
	event := func(mod func(map[string]any)) map[string]any {
		e := map[string]any{"request_id": "r", "worker": map[string]any{"worker_id": 1, "dp_rank": 0}, "router_id": 3, "data": "Free"}
		if mod != nil {
			mod(e)
		}
		return e
	}
	env := func(mod func(map[string]any)) map[string]any {
		m := map[string]any{"model_name": "m", "routing_group": "g", "block_size": 4, "event": event(nil)}
		if mod != nil {
			mod(m)
		}
		return m
	}
	cases := map[string]any{
		"not a map":              []int{1, 2},
		"missing routing_group":  env(func(m map[string]any) { delete(m, "routing_group") }),
		"missing block_size":     env(func(m map[string]any) { delete(m, "block_size") }),
		"block_size over 32 bit": env(func(m map[string]any) { m["block_size"] = uint64(1 << 40) }),
		"missing request_id":     env(func(m map[string]any) { m["event"] = event(func(e map[string]any) { delete(e, "request_id") }) }),
		"missing router_id":      env(func(m map[string]any) { m["event"] = event(func(e map[string]any) { delete(e, "router_id") }) }),
		"missing dp_rank": env(func(m map[string]any) {
			m["event"] = event(func(e map[string]any) { e["worker"] = map[string]any{"worker_id": 1} })
		}),
		"unknown variant": env(func(m map[string]any) { m["event"] = event(func(e map[string]any) { e["data"] = "Evict" }) }),
		"two-entry data map": env(func(m map[string]any) {
			m["event"] = event(func(e map[string]any) { e["data"] = map[string]any{"Free": nil, "X": nil} })
		}),
		"unit variant with a value": env(func(m map[string]any) {
			m["event"] = event(func(e map[string]any) { e["data"] = map[string]any{"Free": 1} })
		}),
		"hint without tokens": env(func(m map[string]any) {
			m["event"] = event(func(e map[string]any) {
				e["data"] = map[string]any{"AddRequest": map[string]any{"prefill_load_hint": map[string]any{}}}
			})
		}),
	}
	for name, v := range cases {
		t.Run(name, func(t *testing.T) {
			if m, err := DecodeSlot(foreign(t, v)); err == nil {
				t.Fatalf("decoded %+v, want an error", m)
			}
		})
	}
	t.Run("a tenant_id envelope is the legacy envelope", func(t *testing.T) {
		v := env(func(m map[string]any) { delete(m, "routing_group"); m["tenant_id"] = "g" })
		if _, err := DecodeSlot(foreign(t, v)); !errors.Is(err, errLegacyEnvelope) {
			t.Fatalf("err = %v, want errLegacyEnvelope", err)
		}
	})
	t.Run("garbage bytes", func(t *testing.T) {
		if _, err := DecodeSlot([]byte{0xc1, 0x00}); err == nil {
			t.Fatal("decoded garbage")
		}
	})
}

func TestAffinityRoundTrip(t *testing.T) {
	for _, u := range []ledger.AffinityUpdate{
		{SessionID: "s", Target: ledger.AffinityTarget{WorkerID: 3, DPRank: 2, HasRank: true}, Version: ledger.AffinityVersion{Sequence: 1 << 62, WriterID: 8}},
		{SessionID: "worker-only", Target: ledger.AffinityTarget{WorkerID: 3}, Version: ledger.AffinityVersion{Sequence: 1, WriterID: 8}},
	} {
		in := AffinityMessage{Partition: part, Update: u}
		b, err := EncodeAffinity(in)
		if err != nil {
			t.Fatal(err)
		}
		out, err := DecodeAffinity(b)
		if err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff(in, out); d != "" {
			t.Fatalf("(-in +out):\n%s", d)
		}
	}
	var m map[string]any
	b, _ := EncodeAffinity(AffinityMessage{Partition: part, Update: ledger.AffinityUpdate{SessionID: "s", Target: ledger.AffinityTarget{WorkerID: 3}}})
	_ = msgpack.Unmarshal(b, &m)
	if v, ok := m["dp_rank"]; !ok || v != nil {
		t.Fatalf("worker-only binding dp_rank = %v (present %v), want nil", v, ok)
	}
	if _, err := DecodeAffinity(foreign(t, map[string]any{"model_name": "m", "routing_group": "g", "session_id": "s", "worker_id": 1, "sequence": 1})); err == nil {
		t.Fatal("a binding without writer_id decoded")
	}
}
