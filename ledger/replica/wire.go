package replica

import (
	"errors"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/kvepp/kvepp/ledger"
)

// The replica-sync topics (selection-service.md §15.1): the first frame of every message.
const (
	// TopicSlotTracker carries booking lifecycle events (§15.2).
	TopicSlotTracker = "dynamo.slot-tracker.v1"
	// TopicSessionAffinity carries session bindings (§15.3).
	TopicSessionAffinity = "dynamo.session-affinity.v1"
)

// Partition is the (model_name, routing_group) of a replicated event's envelope.
type Partition struct {
	// ModelName is the partition's model.
	ModelName string
	// RoutingGroup is the partition's routing group.
	RoutingGroup string
}

// String renders "model:group".
func (p Partition) String() string { return p.ModelName + ":" + p.RoutingGroup }

// SlotMessage is one decoded dynamo.slot-tracker.v1 payload (§15.2).
type SlotMessage struct {
	// Partition is the envelope's model_name and routing_group.
	Partition Partition
	// BlockSize is the envelope's block_size in tokens.
	BlockSize uint32
	// Event is the event; Event.Origin is the payload's router_id.
	Event ledger.SlotEvent
}

// AffinityMessage is one decoded dynamo.session-affinity.v1 payload (§15.3).
type AffinityMessage struct {
	// Partition is the binding's model_name and routing_group.
	Partition Partition
	// Update is the binding; Update.Version.WriterID is the payload's writer_id.
	Update ledger.AffinityUpdate
}

// errLegacyEnvelope marks a slot envelope that carries tenant_id (the pre-v1 envelope, §15.2).
var errLegacyEnvelope = errors.New("slot-tracker envelope carries tenant_id instead of routing_group")

// wireWorker is the event's worker map.
type wireWorker struct {
	WorkerID *uint64 `msgpack:"worker_id"`
	DPRank   *uint64 `msgpack:"dp_rank"`
}

// wireDuration is a Rust Duration {"secs","nanos"}.
type wireDuration struct {
	Secs  uint64 `msgpack:"secs"`
	Nanos uint64 `msgpack:"nanos"`
}

// wirePrefillHint is AddRequest's prefill_load_hint.
type wirePrefillHint struct {
	InitialEffectivePrefillTokens *uint64       `msgpack:"initial_effective_prefill_tokens"`
	ExpectedPrefillDuration       *wireDuration `msgpack:"expected_prefill_duration"`
}

// wireAddRequest is the AddRequest variant's body.
type wireAddRequest struct {
	TokenSequence        []uint64         `msgpack:"token_sequence"`
	TrackPrefillTokens   *bool            `msgpack:"track_prefill_tokens"`
	ExpectedOutputTokens *uint64          `msgpack:"expected_output_tokens"`
	PrefillLoadHint      *wirePrefillHint `msgpack:"prefill_load_hint"`
}

// wireData is the externally tagged `data` enum: "MarkPrefillCompleted" and "Free" as plain
// strings (or one-entry maps with a nil value), AddRequest as {"AddRequest": {…}}.
type wireData struct {
	kind ledger.SlotEventKind
	add  wireAddRequest
}

var (
	_ msgpack.CustomEncoder = (*wireData)(nil)
	_ msgpack.CustomDecoder = (*wireData)(nil)
)

// EncodeMsgpack implements msgpack.CustomEncoder.
func (d *wireData) EncodeMsgpack(enc *msgpack.Encoder) error {
	switch d.kind {
	case ledger.SlotPrefillComplete, ledger.SlotFree:
		return enc.EncodeString(d.kind.String())
	case ledger.SlotAdmission:
		if err := enc.EncodeMapLen(1); err != nil {
			return err
		}
		if err := enc.EncodeString(d.kind.String()); err != nil {
			return err
		}
		return enc.Encode(&d.add)
	}
	return fmt.Errorf("cannot encode slot event kind %v", d.kind)
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (d *wireData) DecodeMsgpack(dec *msgpack.Decoder) error {
	code, err := dec.PeekCode()
	if err != nil {
		return err
	}
	if msgpcode.IsString(code) || msgpcode.IsBin(code) {
		name, err := dec.DecodeString()
		if err != nil {
			return err
		}
		return d.unit(name)
	}
	n, err := dec.DecodeMapLen()
	if err != nil {
		return fmt.Errorf("data: want a string or a one-entry map: %w", err)
	}
	if n != 1 {
		return fmt.Errorf("data: want a one-entry map, got %d entries", n)
	}
	name, err := dec.DecodeString()
	if err != nil {
		return fmt.Errorf("data: variant name: %w", err)
	}
	if name == ledger.SlotAdmission.String() {
		d.kind = ledger.SlotAdmission
		if err := dec.Decode(&d.add); err != nil {
			return fmt.Errorf("data: AddRequest: %w", err)
		}
		return nil
	}
	if err := dec.DecodeNil(); err != nil {
		return fmt.Errorf("data: unit variant %q must carry nil: %w", name, err)
	}
	return d.unit(name)
}

// unit sets a unit variant by name.
func (d *wireData) unit(name string) error {
	switch name {
	case ledger.SlotPrefillComplete.String():
		d.kind = ledger.SlotPrefillComplete
	case ledger.SlotFree.String():
		d.kind = ledger.SlotFree
	default:
		return fmt.Errorf("data: unknown variant %q", name)
	}
	return nil
}

// wireSlotEvent is the envelope's event map.
type wireSlotEvent struct {
	RequestID *string    `msgpack:"request_id"`
	Worker    wireWorker `msgpack:"worker"`
	RouterID  *uint64    `msgpack:"router_id"`
	LoraName  *string    `msgpack:"lora_name"`
	Data      *wireData  `msgpack:"data"`
}

// wireSlotEnvelope is the dynamo.slot-tracker.v1 payload: exactly these four keys on encode.
type wireSlotEnvelope struct {
	ModelName    *string        `msgpack:"model_name"`
	RoutingGroup *string        `msgpack:"routing_group"`
	BlockSize    *uint64        `msgpack:"block_size"`
	Event        *wireSlotEvent `msgpack:"event"`
}

// wireSlotDecode adds the key whose presence rejects an envelope.
type wireSlotDecode struct {
	wireSlotEnvelope `msgpack:",inline"`
	TenantID         msgpack.RawMessage `msgpack:"tenant_id"`
}

// wireAffinity is the dynamo.session-affinity.v1 payload (§15.3).
type wireAffinity struct {
	ModelName    *string `msgpack:"model_name"`
	RoutingGroup *string `msgpack:"routing_group"`
	SessionID    *string `msgpack:"session_id"`
	WorkerID     *uint64 `msgpack:"worker_id"`
	DPRank       *uint64 `msgpack:"dp_rank"`
	Sequence     *uint64 `msgpack:"sequence"`
	WriterID     *uint64 `msgpack:"writer_id"`
}

// EncodeSlot encodes a slot-tracker payload (§15.2): a map with exactly model_name,
// routing_group, block_size and event; the event's router_id is ev.Origin. An admission carries
// token_sequence (nil when there are no hashes), track_prefill_tokens, expected_output_tokens and
// a prefill_load_hint when ev.PrefillTokens is set (expected_prefill_duration nil).
func EncodeSlot(m SlotMessage) ([]byte, error) {
	ev := &m.Event
	bs := uint64(m.BlockSize)
	wid, rank := ev.Candidate.WorkerID, uint64(ev.Candidate.DPRank)
	data := &wireData{kind: ev.Kind}
	if ev.Kind == ledger.SlotAdmission {
		track := ev.TrackPrefillTokens
		data.add = wireAddRequest{TokenSequence: ev.SequenceHashes, TrackPrefillTokens: &track}
		if ev.ExpectedOutputTokens != nil {
			v := uint64(*ev.ExpectedOutputTokens)
			data.add.ExpectedOutputTokens = &v
		}
		if ev.PrefillTokens != nil {
			data.add.PrefillLoadHint = &wirePrefillHint{InitialEffectivePrefillTokens: ev.PrefillTokens}
		}
	}
	return msgpack.Marshal(&wireSlotEnvelope{
		ModelName: &m.Partition.ModelName, RoutingGroup: &m.Partition.RoutingGroup, BlockSize: &bs,
		Event: &wireSlotEvent{RequestID: &ev.ID, Worker: wireWorker{WorkerID: &wid, DPRank: &rank},
			RouterID: &ev.Origin, LoraName: ev.LoraName, Data: data},
	})
}

// DecodeSlot decodes a slot-tracker payload (§15.2). Unknown keys are ignored and integers may
// use any MessagePack width; track_prefill_tokens defaults to true; a missing required key, a
// value out of range (block_size, dp_rank or expected_output_tokens above 2^32−1) or an unknown
// data variant is an error, and so is an envelope carrying tenant_id (errLegacyEnvelope).
func DecodeSlot(b []byte) (SlotMessage, error) {
	var w wireSlotDecode
	if err := msgpack.Unmarshal(b, &w); err != nil {
		return SlotMessage{}, err
	}
	if len(w.TenantID) > 0 {
		return SlotMessage{}, errLegacyEnvelope
	}
	e := w.Event
	switch {
	case w.ModelName == nil || w.RoutingGroup == nil || w.BlockSize == nil || e == nil:
		return SlotMessage{}, errors.New("envelope needs model_name, routing_group, block_size and event")
	case e.RequestID == nil || e.RouterID == nil || e.Data == nil || e.Worker.WorkerID == nil || e.Worker.DPRank == nil:
		return SlotMessage{}, errors.New("event needs request_id, worker {worker_id, dp_rank}, router_id and data")
	case *w.BlockSize > math.MaxUint32 || *e.Worker.DPRank > math.MaxUint32:
		return SlotMessage{}, errors.New("block_size or dp_rank exceeds 32 bits")
	}
	m := SlotMessage{
		Partition: Partition{ModelName: *w.ModelName, RoutingGroup: *w.RoutingGroup},
		BlockSize: uint32(*w.BlockSize),
		Event: ledger.SlotEvent{Kind: e.Data.kind, ID: *e.RequestID, Origin: *e.RouterID, LoraName: e.LoraName,
			Candidate: ledger.Candidate{WorkerID: *e.Worker.WorkerID, DPRank: uint32(*e.Worker.DPRank)}},
	}
	if m.Event.Kind == ledger.SlotAdmission {
		a := &e.Data.add
		m.Event.SequenceHashes = a.TokenSequence
		m.Event.TrackPrefillTokens = a.TrackPrefillTokens == nil || *a.TrackPrefillTokens
		if v := a.ExpectedOutputTokens; v != nil {
			if *v > math.MaxUint32 {
				return SlotMessage{}, errors.New("expected_output_tokens exceeds 32 bits")
			}
			eot := uint32(*v)
			m.Event.ExpectedOutputTokens = &eot
		}
		if h := a.PrefillLoadHint; h != nil {
			if h.InitialEffectivePrefillTokens == nil {
				return SlotMessage{}, errors.New("prefill_load_hint needs initial_effective_prefill_tokens")
			}
			m.Event.PrefillTokens = h.InitialEffectivePrefillTokens
		}
	}
	return m, nil
}

// EncodeAffinity encodes a session-affinity payload (§15.3); dp_rank is nil for a worker-only
// binding.
func EncodeAffinity(m AffinityMessage) ([]byte, error) {
	u := &m.Update
	w := wireAffinity{ModelName: &m.Partition.ModelName, RoutingGroup: &m.Partition.RoutingGroup, SessionID: &u.SessionID,
		WorkerID: &u.Target.WorkerID, Sequence: &u.Version.Sequence, WriterID: &u.Version.WriterID}
	if u.Target.HasRank {
		r := uint64(u.Target.DPRank)
		w.DPRank = &r
	}
	return msgpack.Marshal(&w)
}

// DecodeAffinity decodes a session-affinity payload (§15.3). Every key but dp_rank is required;
// unknown keys are ignored.
func DecodeAffinity(b []byte) (AffinityMessage, error) {
	var w wireAffinity
	if err := msgpack.Unmarshal(b, &w); err != nil {
		return AffinityMessage{}, err
	}
	if w.ModelName == nil || w.RoutingGroup == nil || w.SessionID == nil || w.WorkerID == nil || w.Sequence == nil || w.WriterID == nil {
		return AffinityMessage{}, errors.New("binding needs model_name, routing_group, session_id, worker_id, sequence and writer_id")
	}
	m := AffinityMessage{
		Partition: Partition{ModelName: *w.ModelName, RoutingGroup: *w.RoutingGroup},
		Update: ledger.AffinityUpdate{SessionID: *w.SessionID, Target: ledger.AffinityTarget{WorkerID: *w.WorkerID},
			Version: ledger.AffinityVersion{Sequence: *w.Sequence, WriterID: *w.WriterID}},
	}
	if w.DPRank != nil {
		if *w.DPRank > math.MaxUint32 {
			return AffinityMessage{}, errors.New("dp_rank exceeds 32 bits")
		}
		m.Update.Target.DPRank, m.Update.Target.HasRank = uint32(*w.DPRank), true
	}
	return m, nil
}
