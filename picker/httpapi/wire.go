package httpapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strconv"

	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/internal/tokenjson"
	"github.com/kvepp/kvepp/picker"
)

// Hash is a block or sequence hash on the wire (selection-service.md §2): emitted as the
// two's-complement int64 of the u64 value, accepted as any JSON integer in [-2^63, 2^64-1] (values
// ≥ 2^63 are the same 64 bits).
type Hash uint64

// MarshalJSON emits the hash as a signed 64-bit integer.
func (h Hash) MarshalJSON() ([]byte, error) {
	return strconv.AppendInt(nil, int64(h), 10), nil
}

// UnmarshalJSON accepts an integer in [-2^63, 2^64-1]; anything else (fractions, exponents,
// strings, null, out of range) is a *json.UnmarshalTypeError naming the value (the decoder adds
// the field, e.g. "block_hashes"), which the API reports as 422.
func (h *Hash) UnmarshalJSON(b []byte) error {
	s := string(b)
	if len(s) > 0 && s[0] == '-' {
		if v, err := strconv.ParseInt(s, 10, 64); err == nil {
			*h = Hash(uint64(v))
			return nil
		}
	} else if v, err := strconv.ParseUint(s, 10, 64); err == nil {
		*h = Hash(v)
		return nil
	}
	return &json.UnmarshalTypeError{Value: jsonValue(s), Type: reflect.TypeFor[Hash]()}
}

// jsonValue describes a raw JSON value for an error message by its JSON kind, with scalars
// quoted as written up to 100 bytes, a cut marked with "…": `string "x"`, "number 1.5", "array",
// "null".
func jsonValue(raw string) string {
	if raw == "" {
		return "value"
	}
	switch raw[0] {
	case '"':
		return "string " + excerpt.Of(raw)
	case '[':
		return "array"
	case '{':
		return "object"
	case 't', 'f':
		return "bool"
	case 'n':
		return "null"
	}
	return "number " + excerpt.Of(raw)
}

func hashesIn(hs []Hash) []uint64 {
	if hs == nil {
		return nil
	}
	out := make([]uint64, len(hs))
	for i, h := range hs {
		out[i] = uint64(h)
	}
	return out
}

func hashesOut(hs []uint64) []Hash {
	out := make([]Hash, len(hs))
	for i, h := range hs {
		out[i] = Hash(h)
	}
	return out
}

// elementError is the 422 of one bad array element: the decoder adds the field path in front of
// Field "[i]", which schemaMessage renders as "token_ids[3]: expected an integer in …, got JSON
// number 18446744073709551616".
func elementError(raw []byte, index int, elem reflect.Type) error {
	return &json.UnmarshalTypeError{Value: jsonValue(string(raw)), Type: elem, Field: "[" + strconv.Itoa(index) + "]"}
}

// tokenList is a JSON array of u32 token ids, decoded without reflection (prompts are the bulk of
// every selection body). null leaves it nil; [] is empty and non-nil; an element that is not an
// integer in [0, 2^32-1] (null included) is a 422 naming its index.
type tokenList []uint32

// UnmarshalJSON implements json.Unmarshaler for an already syntax-checked JSON value.
func (t *tokenList) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil
	}
	ids, err := tokenjson.AppendIDs([]uint32{}, b)
	if err != nil {
		var te *tokenjson.Error
		if errors.As(err, &te) && te.Index >= 0 {
			return elementError(b[te.Offset:valueEnd(b, te.Offset)], te.Index, reflect.TypeFor[uint32]())
		}
		return &json.UnmarshalTypeError{Value: jsonValue(string(b)), Type: reflect.TypeFor[tokenList]()}
	}
	if n := bytes.IndexByte(b, 'n'); n >= 0 {
		// The array holds only numbers and nulls: a 'n' starts a null element, which tokenjson
		// (like encoding/json) reads as 0; a token id is an integer.
		return elementError(b[n:n+len("null")], bytes.Count(b[:n], []byte{','}), reflect.TypeFor[uint32]())
	}
	*t = ids
	return nil
}

// hashList is a JSON array of hashes (Hash); a bad element is a 422 naming its index.
type hashList []Hash

// UnmarshalJSON implements json.Unmarshaler.
func (l *hashList) UnmarshalJSON(b []byte) error {
	out, err := decodeList(b, reflect.TypeFor[hashList](), reflect.TypeFor[Hash](), func(raw []byte) (Hash, bool) {
		var h Hash
		return h, h.UnmarshalJSON(raw) == nil
	})
	*l = out
	return err
}

// idList is a JSON array of u64 worker ids; a bad element is a 422 naming its index.
type idList []uint64

// UnmarshalJSON implements json.Unmarshaler.
func (l *idList) UnmarshalJSON(b []byte) error {
	out, err := decodeList(b, reflect.TypeFor[idList](), reflect.TypeFor[uint64](), func(raw []byte) (uint64, bool) {
		v, err := strconv.ParseUint(string(raw), 10, 64)
		return v, err == nil
	})
	*l = out
	return err
}

// decodeList decodes b, a syntax-checked JSON value, as an array whose elements parse converts:
// null is a nil list, [] an empty non-nil one; a non-array is a 422 for listType, the first
// element parse refuses a 422 for elem naming its index.
func decodeList[T any](b []byte, listType, elem reflect.Type, parse func([]byte) (T, bool)) ([]T, error) {
	if string(b) == "null" {
		return nil, nil
	}
	if len(b) == 0 || b[0] != '[' {
		return nil, &json.UnmarshalTypeError{Value: jsonValue(string(b)), Type: listType}
	}
	out := make([]T, 0, bytes.Count(b, []byte{','})+1)
	i := tokenjson.SkipSpace(b, 1)
	for idx := 0; i < len(b) && b[i] != ']'; idx++ {
		end := valueEnd(b, i)
		v, ok := parse(b[i:end])
		if !ok {
			return nil, elementError(b[i:end], idx, elem)
		}
		out = append(out, v)
		i = tokenjson.SkipSpace(b, end)
		if i < len(b) && b[i] == ',' {
			i = tokenjson.SkipSpace(b, i+1)
		}
	}
	return out, nil
}

// valueEnd returns the offset just past the JSON value starting at b[i] in syntax-checked JSON:
// strings end at their closing quote, arrays and objects at their matching bracket, other values
// at the next ',', ']', '}' or whitespace.
func valueEnd(b []byte, i int) int {
	if i >= len(b) {
		return len(b)
	}
	depth, inString := 0, false
	for j := i; j < len(b); j++ {
		c := b[j]
		switch {
		case inString:
			if c == '\\' {
				j++
			} else if c == '"' {
				inString = false
				if depth == 0 {
					return j + 1
				}
			}
		case c == '"':
			inString = true
		case c == '[' || c == '{':
			depth++
		case c == ']' || c == '}':
			if depth == 0 {
				return j
			}
			depth--
			if depth == 0 {
				return j + 1
			}
		case depth == 0 && (c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r'):
			return j
		}
	}
	return len(b)
}

// mmObject is one multimodal item of a block (§6.1).
type mmObject struct {
	MMHash *Hash `json:"mm_hash"`
}

// blockMMInfo is one entry of block_mm_infos: null or {"mm_objects":[{"mm_hash":u64}, …]}.
type blockMMInfo struct {
	MMObjects []mmObject `json:"mm_objects"`
}

// mmRoutingInfo is mm_routing_info (§6.1).
type mmRoutingInfo struct {
	RoutingTokenIDs tokenList      `json:"routing_token_ids"`
	BlockMMInfos    []*blockMMInfo `json:"block_mm_infos"`
}

// promptBody is the prompt part shared by the selection routes (§6).
type promptBody struct {
	TokenIDs       tokenList      `json:"token_ids"`
	MMRoutingInfo  *mmRoutingInfo `json:"mm_routing_info"`
	BlockMMInfos   []*blockMMInfo `json:"block_mm_infos"`
	LoraName       string         `json:"lora_name"`
	CacheSalt      string         `json:"cache_salt"`
	IsEagle        *bool          `json:"is_eagle"`
	BlockHashes    hashList       `json:"block_hashes"`
	SequenceHashes hashList       `json:"sequence_hashes"`
	ISLTokens      *uint64        `json:"isl_tokens"`
}

// prompt converts the body to the core's Prompt: token form when token_ids is present (or
// mm_routing_info.routing_token_ids is non-empty, which then replaces token_ids), else hash form.
func (b *promptBody) prompt() (picker.Prompt, error) {
	p := picker.Prompt{LoraName: b.LoraName, CacheSalt: b.CacheSalt, IsEagle: b.IsEagle}
	var routing []uint32
	infos := b.BlockMMInfos
	if b.MMRoutingInfo != nil {
		routing = b.MMRoutingInfo.RoutingTokenIDs
		if b.MMRoutingInfo.BlockMMInfos != nil {
			infos = b.MMRoutingInfo.BlockMMInfos
		}
	}
	if b.TokenIDs == nil && len(routing) == 0 {
		p.HashForm = true
		p.BlockHashes = hashesIn(b.BlockHashes)
		p.SequenceHashes = hashesIn(b.SequenceHashes)
		if b.ISLTokens != nil {
			p.ISLTokens = *b.ISLTokens
			p.ISLTokensSet = true
		}
		return p, nil
	}
	p.TokenIDs = b.TokenIDs
	if len(routing) > 0 {
		p.TokenIDs = routing
	}
	if infos != nil {
		p.BlockMMHashes = make([][]uint64, len(infos))
		for i, info := range infos {
			if info == nil {
				continue
			}
			for j, o := range info.MMObjects {
				if o.MMHash == nil {
					return p, fmt.Errorf("missing field `mm_hash` in block_mm_infos[%d].mm_objects[%d]", i, j)
				}
				p.BlockMMHashes[i] = append(p.BlockMMHashes[i], uint64(*o.MMHash))
			}
		}
	}
	return p, nil
}

// workerRankBody is {worker_id, dp_rank?} (affinity_target, pinned_worker).
type workerRankBody struct {
	WorkerID *uint64 `json:"worker_id"`
	DPRank   *uint32 `json:"dp_rank"`
}

// sessionContextBody is session_context (§12.2).
type sessionContextBody struct {
	SessionID       *string                `json:"session_id"`
	ParentSessionID string                 `json:"parent_session_id"`
	SessionFinal    bool                   `json:"session_final"`
	InputTrigger    string                 `json:"input_trigger"`
	AgentHeaders    map[string][]string    `json:"agent_headers"`
	KVHints         *picker.SessionKVHints `json:"kv_hints"`
}

// selectBody is the body of POST /select and POST /select_and_reserve (§7.1).
type selectBody struct {
	promptBody
	ModelName            string                       `json:"model_name"`
	RoutingGroup         string                       `json:"routing_group"`
	SelectionID          *string                      `json:"selection_id"`
	RouterConfigOverride *picker.RouterConfigOverride `json:"router_config_override"`
	ExpectedOutputTokens *uint32                      `json:"expected_output_tokens"`
	PriorityJump         float64                      `json:"priority_jump"`
	StrictPriority       uint32                       `json:"strict_priority"`
	SessionID            *string                      `json:"session_id"`
	SessionContext       *sessionContextBody          `json:"session_context"`
	AffinityTarget       *workerRankBody              `json:"affinity_target"`
	PinnedWorker         *workerRankBody              `json:"pinned_worker"`
	AllowedWorkerIDs     idList                       `json:"allowed_worker_ids"`
	RoutingConstraints   *picker.RoutingConstraints   `json:"routing_constraints"`
	Advisory             bool                         `json:"advisory"`
}

// request converts the body to a SelectRequest; errors are schema errors (422).
func (b *selectBody) request(policyClass string) (picker.SelectRequest, error) {
	if b.SelectionID != nil && *b.SelectionID == "" {
		return picker.SelectRequest{}, errors.New("selection_id must not be empty")
	}
	pr, err := b.prompt()
	if err != nil {
		return picker.SelectRequest{}, err
	}
	req := picker.SelectRequest{
		ModelName:            b.ModelName,
		RoutingGroup:         b.RoutingGroup,
		SelectionID:          deref(b.SelectionID),
		Prompt:               pr,
		Override:             b.RouterConfigOverride,
		ExpectedOutputTokens: b.ExpectedOutputTokens,
		PriorityJump:         b.PriorityJump,
		StrictPriority:       b.StrictPriority,
		AllowedWorkerIDs:     b.AllowedWorkerIDs,
		AllowedSet:           b.AllowedWorkerIDs != nil,
		Advisory:             b.Advisory,
		PolicyClass:          policyClass,
	}
	if b.RoutingConstraints != nil {
		req.RoutingConstraints = *b.RoutingConstraints
	}
	switch {
	case b.SessionContext != nil:
		sc := b.SessionContext
		if sc.SessionID == nil {
			return req, fmt.Errorf("missing field `session_id` in session_context")
		}
		req.Session = &picker.SessionContext{
			SessionID: *sc.SessionID, ParentSessionID: sc.ParentSessionID, SessionFinal: sc.SessionFinal,
			InputTrigger: sc.InputTrigger, AgentHeaders: sc.AgentHeaders, KVHints: sc.KVHints,
		}
	case b.SessionID != nil:
		req.Session = &picker.SessionContext{SessionID: *b.SessionID}
	}
	if t := b.AffinityTarget; t != nil {
		if t.WorkerID == nil {
			return req, fmt.Errorf("missing field `worker_id` in affinity_target")
		}
		req.AffinityTarget = &picker.AffinityTarget{WorkerID: *t.WorkerID, DPRank: t.DPRank}
	}
	if p := b.PinnedWorker; p != nil {
		if p.WorkerID == nil {
			return req, fmt.Errorf("missing field `worker_id` in pinned_worker")
		}
		if p.DPRank == nil {
			return req, fmt.Errorf("missing field `dp_rank` in pinned_worker")
		}
		req.PinnedWorker = &picker.WorkerRank{WorkerID: *p.WorkerID, DPRank: *p.DPRank}
	}
	return req, nil
}

// deref returns *p, or "" for nil.
func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

// selectResponse is the /select response (§7.4): no booking fields; selection_id only when
// supplied; worker_load only for advisory selects.
type selectResponse struct {
	SelectionID            string             `json:"selection_id,omitempty"`
	ModelName              string             `json:"model_name"`
	RoutingGroup           string             `json:"routing_group"`
	WorkerID               uint64             `json:"worker_id"`
	DPRank                 uint32             `json:"dp_rank"`
	Endpoint               string             `json:"endpoint"`
	BlockSize              uint32             `json:"block_size"`
	Overlap                picker.Overlap     `json:"overlap"`
	EffectivePrefillTokens uint64             `json:"effective_prefill_tokens"`
	PotentialDecodeBlocks  uint64             `json:"potential_decode_blocks"`
	DecodeBusy             *bool              `json:"decode_busy,omitempty"`
	WorkerLoad             *picker.WorkerLoad `json:"worker_load,omitempty"`
}

// reserveResponse is the /select_and_reserve response (§7.4): booking fields first, as in the
// reference example, then the selection fields and an optional kv_hint.
type reserveResponse struct {
	SelectionID            string         `json:"selection_id"`
	SequenceHashes         []Hash         `json:"sequence_hashes"`
	ISLTokens              uint64         `json:"isl_tokens"`
	TrackPrefillTokens     bool           `json:"track_prefill_tokens"`
	ModelName              string         `json:"model_name"`
	RoutingGroup           string         `json:"routing_group"`
	WorkerID               uint64         `json:"worker_id"`
	DPRank                 uint32         `json:"dp_rank"`
	Endpoint               string         `json:"endpoint"`
	BlockSize              uint32         `json:"block_size"`
	Overlap                picker.Overlap `json:"overlap"`
	EffectivePrefillTokens uint64         `json:"effective_prefill_tokens"`
	PotentialDecodeBlocks  uint64         `json:"potential_decode_blocks"`
	DecodeBusy             *bool          `json:"decode_busy,omitempty"`
	KVHint                 *picker.KVHint `json:"kv_hint,omitempty"`
}

func overlapOut(o picker.Overlap) picker.Overlap {
	if o.DP == nil {
		o.DP = map[string]uint64{}
	}
	return o
}

func toSelectResponse(sel picker.Selection, advisory bool) selectResponse {
	r := selectResponse{
		SelectionID: sel.SelectionID, ModelName: sel.ModelName, RoutingGroup: sel.RoutingGroup,
		WorkerID: sel.WorkerID, DPRank: sel.DPRank, Endpoint: sel.Endpoint, BlockSize: sel.BlockSize,
		Overlap: overlapOut(sel.Overlap), EffectivePrefillTokens: sel.EffectivePrefillTokens,
		PotentialDecodeBlocks: sel.PotentialDecodeBlocks, DecodeBusy: sel.DecodeBusy,
	}
	if advisory {
		r.WorkerLoad = sel.WorkerLoad
	}
	return r
}

func toReserveResponse(sel picker.Selection) reserveResponse {
	return reserveResponse{
		SelectionID: sel.SelectionID, SequenceHashes: hashesOut(sel.SequenceHashes), ISLTokens: sel.ISLTokens,
		TrackPrefillTokens: sel.TrackPrefillTokens, ModelName: sel.ModelName, RoutingGroup: sel.RoutingGroup,
		WorkerID: sel.WorkerID, DPRank: sel.DPRank, Endpoint: sel.Endpoint, BlockSize: sel.BlockSize,
		Overlap: overlapOut(sel.Overlap), EffectivePrefillTokens: sel.EffectivePrefillTokens,
		PotentialDecodeBlocks: sel.PotentialDecodeBlocks, DecodeBusy: sel.DecodeBusy, KVHint: sel.KVHint,
	}
}

// workerBody is POST /workers: the record with worker_id required.
type workerBody struct {
	picker.WorkerRecord
	WorkerID *uint64 `json:"worker_id"`
}

// patchBody is PATCH /workers/{worker_id} (§4.3): the patch (whose model_name and routing_group
// may only repeat the worker's own) plus worker_id, which may only repeat the path's.
type patchBody struct {
	picker.WorkerPatch
	WorkerID *uint64 `json:"worker_id"`
}

// outputBlockBody is POST /reservations/{id}/output_block (§10.2).
type outputBlockBody struct {
	DecayFraction *float64 `json:"decay_fraction"`
}

// reservationBody is POST /reservations (§10.1): selection_id is required; worker_id selects the
// explicit form, whose prompt and booking fields are read.
type reservationBody struct {
	promptBody
	ModelName              string                       `json:"model_name"`
	RoutingGroup           string                       `json:"routing_group"`
	SelectionID            *string                      `json:"selection_id"`
	WorkerID               *uint64                      `json:"worker_id"`
	DPRank                 *uint32                      `json:"dp_rank"`
	RouterConfigOverride   *picker.RouterConfigOverride `json:"router_config_override"`
	ExpectedOutputTokens   *uint32                      `json:"expected_output_tokens"`
	EffectivePrefillTokens *uint64                      `json:"effective_prefill_tokens"`
	TrackPrefillTokens     *bool                        `json:"track_prefill_tokens"`
}

// request converts the body to a ReservationRequest; errors are schema errors (422).
func (b *reservationBody) request() (picker.ReservationRequest, error) {
	if b.SelectionID == nil {
		return picker.ReservationRequest{}, fmt.Errorf("missing field `selection_id`")
	}
	req := picker.ReservationRequest{ModelName: b.ModelName, RoutingGroup: b.RoutingGroup, SelectionID: *b.SelectionID}
	if b.WorkerID == nil {
		return req, nil // cached replay: every other field is ignored (§10.1)
	}
	pr, err := b.prompt()
	if err != nil {
		return req, err
	}
	req.WorkerID, req.DPRank, req.Prompt = b.WorkerID, b.DPRank, pr
	req.Override = b.RouterConfigOverride
	req.ExpectedOutputTokens = b.ExpectedOutputTokens
	req.EffectivePrefillTokens = b.EffectivePrefillTokens
	req.TrackPrefillTokens = b.TrackPrefillTokens
	return req, nil
}

// inspectBody is POST /potential_loads and POST /overlap_scores (§14.2, §14.3).
type inspectBody struct {
	promptBody
	ModelName            string                       `json:"model_name"`
	RoutingGroup         string                       `json:"routing_group"`
	RouterConfigOverride *picker.RouterConfigOverride `json:"router_config_override"`
}

// peerBody is POST /replica_sync/register_peer and /deregister_peer (§15.5).
type peerBody struct {
	Endpoint *string `json:"endpoint"`
}
