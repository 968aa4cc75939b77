package policies

import (
	"fmt"
	"math/rand/v2"
)

// InputTrigger is what triggered the request in an agentic session (selection-service.md §12.2).
type InputTrigger uint8

const (
	// InputTriggerNone: the request carried no input_trigger.
	InputTriggerNone InputTrigger = iota
	// InputTriggerUserMessage: "user_message".
	InputTriggerUserMessage
	// InputTriggerToolResult: "tool_result".
	InputTriggerToolResult
	// InputTriggerOther: "other".
	InputTriggerOther
)

// String returns the wire name ("user_message", "tool_result", "other") or "" for none.
func (t InputTrigger) String() string {
	switch t {
	case InputTriggerUserMessage:
		return "user_message"
	case InputTriggerToolResult:
		return "tool_result"
	case InputTriggerOther:
		return "other"
	}
	return ""
}

// ParseInputTrigger parses the session_context.input_trigger wire value; "" is InputTriggerNone.
// Any other value is an error naming it (the HTTP layer maps it to 422, §12.2).
func ParseInputTrigger(s string) (InputTrigger, error) {
	switch s {
	case "":
		return InputTriggerNone, nil
	case "user_message":
		return InputTriggerUserMessage, nil
	case "tool_result":
		return InputTriggerToolResult, nil
	case "other":
		return InputTriggerOther, nil
	}
	return InputTriggerNone, fmt.Errorf("input_trigger %q must be one of user_message, tool_result, other", s)
}

// KVHints are the request's KV lifecycle hints (session_context.kv_hints, §12.2).
type KVHints struct {
	evictSession bool
}

// NewKVHints builds the hints (host side).
func NewKVHints(evictSession bool) *KVHints { return &KVHints{evictSession: evictSession} }

// EvictSession reports whether the request asks consumers to evict session state. False on a nil
// receiver.
func (h *KVHints) EvictSession() bool { return h != nil && h.evictSession }

// SessionParams are the host-side inputs of NewSessionContext (the §12.2 session_context fields).
type SessionParams struct {
	SessionID       string       // session_id (required in session_context)
	ParentSessionID string       // parent_session_id, "" when absent
	SessionFinal    bool         // session_final, false when absent
	KVHints         *KVHints     // kv_hints, nil when absent
	InputTrigger    InputTrigger // input_trigger, InputTriggerNone when absent
	// AgentHeaders maps upstream-captured header names to their ordered values; preserved
	// uninterpreted. The context keeps the map without copying it.
	AgentHeaders map[string][]string
}

// SessionContext is the policy-facing view of the request's session metadata (§12.2, §17.3).
type SessionContext struct {
	p SessionParams
}

// NewSessionContext builds a session context (host side). A legacy flat session_id maps to
// SessionParams{SessionID: id}.
func NewSessionContext(p SessionParams) *SessionContext { return &SessionContext{p: p} }

// SessionID is the stable reasoning or tool-session identifier.
func (s *SessionContext) SessionID() string { return s.p.SessionID }

// ParentSessionID is the parent session of a subagent, "" when absent.
func (s *SessionContext) ParentSessionID() string { return s.p.ParentSessionID }

// SessionFinal is the terminal marker (false when absent).
func (s *SessionContext) SessionFinal() bool { return s.p.SessionFinal }

// KVHints returns the KV lifecycle hints, nil when absent (EvictSession on nil is false).
func (s *SessionContext) KVHints() *KVHints { return s.p.KVHints }

// InputTrigger returns the request trigger, InputTriggerNone when absent.
func (s *SessionContext) InputTrigger() InputTrigger { return s.p.InputTrigger }

// AgentHeaders returns the upstream-captured headers (name → ordered values), nil when absent.
// Read-only.
func (s *SessionContext) AgentHeaders() map[string][]string { return s.p.AgentHeaders }

// ContextParams are the host-side inputs of a WorkerSelectionContext.
type ContextParams struct {
	// ISLTokens is the request's input length in tokens (after routing_token_ids substitution).
	ISLTokens int
	// BlockSize is the partition's KV block size in tokens.
	BlockSize int
	// TracksPrefillTokens is the request's track_prefill_tokens decision.
	TracksPrefillTokens bool
	// Session is the request's session context, nil when absent.
	Session *SessionContext
	// ExpectedOutputTokens is optional (tokens).
	ExpectedOutputTokens *uint32
	// PriorityJump is the raw priority_jump.
	PriorityJump float64
	// StrictPriority is the strict queue tier.
	StrictPriority uint32
	// RouterTemperatureOverride is router_config_override.router_temperature, nil when absent.
	RouterTemperatureOverride *float64
	// OverlapScoreCreditOverride is router_config_override.overlap_score_credit (after the §9.6
	// deprecated-weight mapping), nil when absent. kvepp extension read by the built-in policy.
	OverlapScoreCreditOverride *float64
	// PrefillLoadScaleOverride is router_config_override.prefill_load_scale (after §9.6), nil when
	// absent. kvepp extension read by the built-in policy.
	PrefillLoadScaleOverride *float64
	// Rand is the random source policies use (normally the partition's, since a policy runs in the
	// partition's serialized context). nil: the context creates one on first use.
	Rand *rand.Rand
}

// WorkerSelectionContext is the per-request context every component receives
// (selection-service.md §17.3). Build it with NewWorkerSelectionContext, or reuse one with Reset.
// Not safe for concurrent use.
type WorkerSelectionContext struct {
	p      ContextParams
	blocks int
	active *WorkerSelectionPolicy // set while Select runs
}

// NewWorkerSelectionContext builds a context (host side).
func NewWorkerSelectionContext(p ContextParams) *WorkerSelectionContext {
	c := &WorkerSelectionContext{}
	c.Reset(p)
	return c
}

// Reset reinitialises c for another request, so hosts can reuse one context without allocating.
func (c *WorkerSelectionContext) Reset(p ContextParams) {
	c.p = p
	c.active = nil
	c.blocks = 0
	if p.BlockSize > 0 && p.ISLTokens > 0 {
		c.blocks = (p.ISLTokens + p.BlockSize - 1) / p.BlockSize
	}
}

// RequestBlocks is the incoming prompt size in KV blocks, ceil(isl/bs) (0 if either is ≤ 0).
func (c *WorkerSelectionContext) RequestBlocks() int { return c.blocks }

// BlockSize is the number of tokens in one KV block.
func (c *WorkerSelectionContext) BlockSize() int { return c.p.BlockSize }

// ISLTokens is the request's input length in tokens (kvepp extension; the built-in cost needs it).
func (c *WorkerSelectionContext) ISLTokens() int { return c.p.ISLTokens }

// TracksPrefillTokens reports whether the request contributes to prefill-load tracking.
func (c *WorkerSelectionContext) TracksPrefillTokens() bool { return c.p.TracksPrefillTokens }

// SessionContext returns the session metadata, nil when the request has none.
func (c *WorkerSelectionContext) SessionContext() *SessionContext { return c.p.Session }

// ExpectedOutputTokens returns the expected output length in tokens and true, or (0, false).
func (c *WorkerSelectionContext) ExpectedOutputTokens() (uint32, bool) {
	if c.p.ExpectedOutputTokens == nil {
		return 0, false
	}
	return *c.p.ExpectedOutputTokens, true
}

// PriorityJump is the raw scheduler priority boost (queue policies treat negatives as 0).
func (c *WorkerSelectionContext) PriorityJump() float64 { return c.p.PriorityJump }

// StrictPriority is the strict integer priority (larger first).
func (c *WorkerSelectionContext) StrictPriority() uint32 { return c.p.StrictPriority }

// RouterTemperatureOverride returns the per-request router temperature and true, or (0, false).
func (c *WorkerSelectionContext) RouterTemperatureOverride() (float64, bool) {
	return optional(c.p.RouterTemperatureOverride)
}

// OverlapScoreCreditOverride returns the per-request overlap_score_credit and true, or (0, false).
// kvepp extension.
func (c *WorkerSelectionContext) OverlapScoreCreditOverride() (float64, bool) {
	return optional(c.p.OverlapScoreCreditOverride)
}

// PrefillLoadScaleOverride returns the per-request prefill_load_scale and true, or (0, false).
// kvepp extension.
func (c *WorkerSelectionContext) PrefillLoadScaleOverride() (float64, bool) {
	return optional(c.p.PrefillLoadScaleOverride)
}

func optional(p *float64) (float64, bool) {
	if p == nil {
		return 0, false
	}
	return *p, true
}

// Rand returns the request's random source (never nil).
func (c *WorkerSelectionContext) Rand() *rand.Rand {
	if c.p.Rand == nil {
		c.p.Rand = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	}
	return c.p.Rand
}

// MinActivePrefillTokens is the minimum ActivePrefillTokens over the candidates that survived
// eligibility and every policy filter (selection-service.md §9.2, §17.2 rule 7), computed by the
// host only when a component calls it (at most once per Select from scorers and the picker). Called
// from a filter it is the minimum over the candidates still alive before that filter. Outside
// Select it is 0.
func (c *WorkerSelectionContext) MinActivePrefillTokens() int {
	if c.active == nil {
		return 0
	}
	return c.active.minActivePrefill()
}
