package extproc

import (
	"context"
	"errors"
	"net"

	"github.com/kvepp/kvepp/picker"
)

// Picker is the part of the selection core (*picker.Service) that the ext_proc server calls
// (epp.md §5.6, §5.7, §7). Errors carry a picker.Kind (picker.KindOf) which the server maps to an
// ImmediateResponse status in one table (epp.md §8).
type Picker interface {
	// SelectAndReserve selects a worker rank for req and books it under req.SelectionID (a fresh
	// UUIDv4 chosen by the server). On success the reservation is live until Free.
	SelectAndReserve(ctx context.Context, req picker.SelectRequest) (picker.Selection, error)
	// PrefillComplete marks the reservation's prefill as done (first response chunk, epp.md §7).
	PrefillComplete(ctx context.Context, selectionID string) error
	// Free releases the reservation; the server calls it exactly once per booking.
	Free(ctx context.Context, selectionID string) error
	// LoadOnlyPick chooses the schedulable rank of model with the fewest active requests, ties at
	// random, without booking (epp.md §5.7). When allowedSet is true only workers in allowed are
	// candidates (an empty list allows none). model "" means: any served model's workers (used when
	// a header-only request cannot name a partition and several are served).
	LoadOnlyPick(ctx context.Context, model string, allowed []uint64, allowedSet bool) (picker.Selection, error)
	// HasModel reports whether a partition of model exists (epp.md §5.5).
	HasModel(model string) bool
	// Models lists the served partition models.
	Models() []string
	// Workers lists the catalog records of partition (model, group), model "" meaning every model;
	// the server reads WorkerID and Endpoint to resolve subset hints from IP addresses to worker ids
	// (epp.md §5.8).
	Workers(model, group string) []picker.WorkerState
	// Reserve books an explicit reservation on a named worker rank; the server uses it to move a
	// booking to the endpoint the gateway reports as served (epp.md §6.3).
	Reserve(ctx context.Context, req picker.ReservationRequest) (picker.Reservation, error)
}

// Tokenizers returns the request tokenizer of a model (epp.md §5.4). The server asks for the
// partition model (the base model when the request names a LoRA adapter).
type Tokenizers interface {
	// ForModel returns model's tokenizer; an error becomes a 500 unless it carries a picker.Kind.
	ForModel(model string) (RequestTokenizer, error)
}

// RequestTokenizer turns a request body, as it will be forwarded, into the engine's prompt token ids
// (epp.md §5.4). Errors are classified by ClassifyTokenizerError: wrap ErrTokenizerBadRequest (or
// implement BadRequest() bool) for 400, ErrTokenizerTimeout (or Timeout() bool, or
// context.DeadlineExceeded) for 504, ErrTokenizerUnavailable (or Unavailable() bool, or a dial error)
// for 503; anything else is a 502 tokenizer_error.
type RequestTokenizer interface {
	// TokenizeChat renders a /chat/completions body's messages with the chat template and returns
	// the prompt token ids.
	TokenizeChat(body []byte) ([]uint32, error)
	// TokenizeCompletion returns the token ids of a /completions body's text prompt (token prompts
	// never reach the tokenizer).
	TokenizeCompletion(body []byte) ([]uint32, error)
	// TokenizeResponses converts a stateless /responses body to chat messages and returns the prompt
	// token ids.
	TokenizeResponses(body []byte) ([]uint32, error)
}

// PromptTokenizer is optionally implemented by a RequestTokenizer that needs the stream's context
// and request id (vllm-render calls the model server) or reports multimodal items (images): the
// server then calls TokenizePrompt instead of the per-kind methods. Errors as RequestTokenizer's.
type PromptTokenizer interface {
	TokenizePrompt(ctx context.Context, call TokenizeCall) (TokenizedPrompt, error)
}

// PromptKind is the kind of request being tokenized (epp.md §5.3).
type PromptKind uint8

// Prompt kinds.
const (
	PromptChat PromptKind = iota
	PromptCompletion
	PromptResponses
)

// TokenizeCall is one tokenization: the request body as it will be forwarded and its x-request-id.
type TokenizeCall struct {
	Kind      PromptKind
	Body      []byte
	RequestID string
	// Members are the body's top-level members in document order, as the server already validated
	// and scanned them (a repeated key appears each time; the last one counts), so an in-process
	// tokenizer need not parse Body again (one parse per request, epp.md §13.5). Nil when the
	// server did not scan the body. They alias Body's bytes as received: when the server rewrote
	// cache_salt for x-tenant-id, Body holds the new value and Members the old one (no tokenizer
	// reads cache_salt). Valid only during the call.
	Members []BodyMember
}

// BodyMember is one top-level member of a JSON request body: its key (unescaped) and its raw JSON
// value, both slices of (or, for an escaped key, decoded from) the body.
type BodyMember struct {
	Key, Value []byte
	// Elements are, for the member the server also split into its array elements (the last
	// "messages" array), the [start, end) offsets in Value of each element; nil otherwise.
	Elements [][2]int
}

// TokenizedPrompt is the engine's view of a prompt: its token ids and the token ranges of
// multimodal items, which salt the blocks they overlap (picker.MMItem).
type TokenizedPrompt struct {
	TokenIDs []uint32
	MMItems  []picker.MMItem
	// HashMemo, when non-nil, keeps the block hashes of a token prefix TokenIDs shares with earlier
	// prompts (a continuing conversation), so the picker hashes only the rest (picker.Prompt.HashMemo).
	HashMemo picker.BlockHashMemo
}

// Tokenizer error sentinels (epp.md §5.4, §8). Tokenizer implementations wrap them with %w.
var (
	// ErrTokenizerBadRequest marks a request the tokenizer rejected (vllm-render 4xx, an
	// unrenderable conversation): 400 invalid_request_error carrying the error text.
	ErrTokenizerBadRequest = errors.New("tokenizer rejected the request")
	// ErrTokenizerTimeout marks a tokenizer call that exceeded DYN_EPP_TOKENIZATION_TIMEOUT_MS: 504.
	ErrTokenizerTimeout = errors.New("tokenizer timed out")
	// ErrTokenizerUnavailable marks an unreachable tokenizer (connection refused, DNS failure): 503.
	ErrTokenizerUnavailable = errors.New("tokenizer unavailable")
	// ErrTokenizerUpstream marks a tokenizer 5xx, malformed or oversize response: 502 (also the
	// default for unclassified errors).
	ErrTokenizerUpstream = errors.New("tokenizer error")
)

// ClassifyTokenizerError maps a tokenizer error to the picker.Kind the server's status table uses
// (epp.md §8): bad request → picker.KindBadRequest (400), timeout → KindTokenizerTimeout (504),
// unavailable → picker.KindNotReady (503), anything else → KindTokenizerError (502). A *picker.Error in
// the chain keeps its own kind. ClassifyTokenizerError(nil) is "".
func ClassifyTokenizerError(err error) picker.Kind {
	if err == nil {
		return ""
	}
	var pe *picker.Error
	if errors.As(err, &pe) {
		return pe.Kind
	}
	var br interface{ BadRequest() bool }
	if errors.Is(err, ErrTokenizerBadRequest) || (errors.As(err, &br) && br.BadRequest()) {
		return picker.KindBadRequest
	}
	var to interface{ Timeout() bool }
	if errors.Is(err, ErrTokenizerTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		(errors.As(err, &to) && to.Timeout()) {
		return KindTokenizerTimeout
	}
	var un interface{ Unavailable() bool }
	var op *net.OpError
	var dns *net.DNSError
	if errors.Is(err, ErrTokenizerUnavailable) || (errors.As(err, &un) && un.Unavailable()) ||
		(errors.As(err, &op) && op.Op == "dial") || errors.As(err, &dns) {
		return picker.KindNotReady
	}
	return KindTokenizerError
}
