// Package vllmrender is the client of the model server's render endpoints, kvepp's tokenizer when
// DYN_EPP_TOKENIZER_PROTOCOL=vllm-render (epp.md §5.4): the request body is posted unchanged to
// <url>/v1/chat/completions/render, /v1/completions/render or /v1/responses/render and the
// engine's own token ids come back, so any model the engine serves is tokenized exactly.
//
// Failures carry the classification extproc.ClassifyTokenizerError reads (epp.md §5.4, §8):
// timeout → Timeout() (504), connection refused or DNS failure → Unavailable() (503), HTTP 4xx →
// BadRequest() with the tokenizer's message (400, "render server answered 404: Not Found"),
// anything else — 5xx, a body that is not JSON, missing token_ids, a response larger than
// MaxResponseBytes — is a plain error (502). Messages never name the render URL (Error.URL and
// Error.Detail are for logs) and quote at most MaxMessageBytes of the server's text.
package vllmrender

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"time"

	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/kvindex"
)

// Kind is the request kind, which decides the render path and the response shape.
type Kind uint8

// Request kinds (epp.md §5.3).
const (
	Chat Kind = iota
	Completion
	Responses
)

// paths are the render endpoints per kind.
var paths = [...]string{Chat: "/v1/chat/completions/render", Completion: "/v1/completions/render", Responses: "/v1/responses/render"}

// Config configures a Client.
type Config struct {
	// BaseURL is the render server, e.g. http://vllm:8000 (DYN_EPP_TOKENIZER_SERVICE_URL).
	BaseURL string
	// Timeout bounds one call (DYN_EPP_TOKENIZATION_TIMEOUT_MS); must be > 0.
	Timeout time.Duration
	// MaxResponseBytes bounds the response body (DYN_EPP_TOKENIZER_MAX_RESPONSE_BYTES); larger
	// responses fail (502). Must be > 0.
	MaxResponseBytes int64
	// Transport, when set, replaces the client's own pooled transport (tests).
	Transport http.RoundTripper
}

// Client calls one render server. It keeps connections alive between calls and is safe for
// concurrent use.
type Client struct {
	base    string
	timeout time.Duration
	max     int64
	http    *http.Client
}

// New returns a client for cfg. Errors: a base URL that is not absolute http(s), a
// non-positive timeout or response bound.
func New(cfg Config) (*Client, error) {
	u, err := url.Parse(cfg.BaseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("render URL %q is not an absolute http(s) URL", cfg.BaseURL)
	}
	if cfg.Timeout <= 0 {
		return nil, fmt.Errorf("render timeout %v must be > 0", cfg.Timeout)
	}
	if cfg.MaxResponseBytes <= 0 {
		return nil, fmt.Errorf("render response bound %d must be > 0", cfg.MaxResponseBytes)
	}
	tr := cfg.Transport
	if tr == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConns = 256
		t.MaxIdleConnsPerHost = 256 // one server takes every routing call: keep them warm
		tr = t
	}
	return &Client{base: strings.TrimRight(cfg.BaseURL, "/"), timeout: cfg.Timeout, max: cfg.MaxResponseBytes,
		http: &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}, nil
}

// MMItem is one multimodal placeholder of the rendered prompt: tokens [Offset, Offset+Length)
// and the u64 hash of its engine identifier (kvindex.HashMMIdentifier).
type MMItem struct {
	Offset, Length int
	Hash           uint64
}

// Result is a rendered prompt.
type Result struct {
	TokenIDs []uint32
	MM       []MMItem
}

// Error is a classified render failure (see the package doc).
type Error struct {
	// Msg is what the client is told (it never names the render URL or addresses): for a 4xx
	// "render server answered <status>: <its message>", the message at most MaxMessageBytes
	// bytes with control characters dropped.
	Msg string
	// Status is the HTTP status of the render response, 0 when there was none.
	Status int
	// URL is the render endpoint called, for logs.
	URL         string
	timeout     bool
	unavailable bool
	badRequest  bool
	err         error
}

// MaxMessageBytes bounds the part of a render server's error message kvepp passes on.
const MaxMessageBytes = 512

// Error returns the message.
func (e *Error) Error() string { return e.Msg }

// Detail is the message with the underlying cause, which may name the render URL and
// addresses: for logs, not for clients.
func (e *Error) Detail() string {
	if e.err != nil && !strings.Contains(e.Msg, excerpt.Clean(e.err.Error(), MaxMessageBytes)) {
		return e.Msg + ": " + e.err.Error()
	}
	return e.Msg
}

// Unwrap returns the cause.
func (e *Error) Unwrap() error { return e.err }

// Timeout reports a call that exceeded the configured timeout (504).
func (e *Error) Timeout() bool { return e.timeout }

// Unavailable reports an unreachable render server (503).
func (e *Error) Unavailable() bool { return e.unavailable }

// BadRequest reports a 4xx answer: the request is at fault (400).
func (e *Error) BadRequest() bool { return e.badRequest }

// Render posts body (the request as it will be forwarded) to the render endpoint of kind with
// header x-request-id and returns the engine's token ids and multimodal placeholders. The call is
// bounded by the configured timeout and by ctx. Errors are *Error, or ctx's error when ctx ended
// first.
func (c *Client) Render(ctx context.Context, kind Kind, body []byte, requestID string) (Result, error) {
	if int(kind) >= len(paths) {
		return Result{}, fmt.Errorf("unknown render kind %d", kind)
	}
	cctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	url := c.base + paths[kind]
	req, err := http.NewRequestWithContext(cctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return Result{}, &Error{Msg: "render request could not be built", URL: url, err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	if requestID != "" {
		req.Header.Set("x-request-id", requestID)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return Result{}, c.transportError(ctx, cctx, url, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, c.max+1))
	if err != nil {
		return Result{}, c.transportError(ctx, cctx, url, err)
	}
	if int64(len(data)) > c.max {
		return Result{}, &Error{Msg: fmt.Sprintf("render response is larger than %d bytes", c.max), Status: resp.StatusCode, URL: url}
	}
	if resp.StatusCode != http.StatusOK {
		// A 4xx is the request's fault as the render server sees it (400 to the client), but
		// it may just as well be a wrong render URL (404) or credentials (401): say who answered.
		return Result{}, &Error{Msg: fmt.Sprintf("render server answered %d: %s", resp.StatusCode, errorMessage(data, resp.StatusCode)),
			Status: resp.StatusCode, URL: url, badRequest: resp.StatusCode >= 400 && resp.StatusCode < 500}
	}
	res, err := parse(kind, data)
	if err != nil {
		return Result{}, &Error{Msg: "render response: " + excerpt.Clean(err.Error(), MaxMessageBytes), Status: resp.StatusCode, URL: url, err: err}
	}
	return res, nil
}

// transportError classifies a failed round trip. The client message names the kind of failure
// only; the cause (which names the URL and addresses) is kept for Detail.
func (c *Client) transportError(parent, call context.Context, url string, err error) error {
	if parent.Err() != nil {
		return parent.Err() // the stream ended; nobody waits for the answer
	}
	if errors.Is(call.Err(), context.DeadlineExceeded) {
		return &Error{Msg: fmt.Sprintf("render call exceeded %v", c.timeout), URL: url, timeout: true, err: err}
	}
	var op *net.OpError
	var dns *net.DNSError
	switch {
	case errors.As(err, &dns):
		return &Error{Msg: "render server unreachable: its host name does not resolve", URL: url, unavailable: true, err: err}
	case errors.As(err, &op) && op.Op == "dial":
		return &Error{Msg: "render server unreachable: " + causeOf(op), URL: url, unavailable: true, err: err}
	case errors.As(err, &op):
		return &Error{Msg: "render call failed: " + causeOf(op), URL: url, err: err}
	}
	return &Error{Msg: "render call failed", URL: url, err: err}
}

// causeOf is a network error's cause without its addresses ("connect: connection refused").
func causeOf(op *net.OpError) string {
	if op.Err == nil {
		return op.Op + " failed"
	}
	return excerpt.Clean(op.Err.Error(), MaxMessageBytes)
}

// errorMessage extracts the message of an error body (vLLM: {"error": {"message": …}}, FastAPI:
// {"detail": …}, or {"message": …}), else the body's text, else the status text; at most
// MaxMessageBytes bytes without control characters (excerpt.Clean).
func errorMessage(data []byte, status int) string {
	if msg := excerpt.Clean(rawErrorMessage(data), MaxMessageBytes); msg != "" {
		return msg
	}
	return http.StatusText(status)
}

// rawErrorMessage is errorMessage before cleaning ("" when the body has none).
func rawErrorMessage(data []byte) string {
	var b struct {
		Error   json.RawMessage `json:"error"`
		Message string          `json:"message"`
		Detail  json.RawMessage `json:"detail"`
	}
	if json.Unmarshal(data, &b) == nil {
		var inner struct {
			Message string `json:"message"`
		}
		var s string
		switch {
		case len(b.Error) > 0 && json.Unmarshal(b.Error, &inner) == nil && inner.Message != "":
			return inner.Message
		case len(b.Error) > 0 && json.Unmarshal(b.Error, &s) == nil && s != "":
			return s
		case b.Message != "":
			return b.Message
		case len(b.Detail) > 0:
			if json.Unmarshal(b.Detail, &s) == nil {
				return s
			}
			return string(b.Detail)
		}
	}
	return string(data)
}

// rendered is one render object: token_ids plus optional multimodal features.
type rendered struct {
	TokenIDs *[]uint32 `json:"token_ids"`
	Features *struct {
		MMHashes       json.RawMessage `json:"mm_hashes"`
		MMPlaceholders json.RawMessage `json:"mm_placeholders"`
	} `json:"features"`
}

// parse reads a render response: an object for chat and responses, an array whose element 0 is
// used for completions (epp.md §5.4).
func parse(kind Kind, data []byte) (Result, error) {
	var r rendered
	if kind == Completion {
		var list []rendered
		if err := json.Unmarshal(data, &list); err != nil {
			return Result{}, fmt.Errorf("want a JSON array of render objects: %w", err)
		}
		if len(list) == 0 {
			return Result{}, errors.New("empty render array")
		}
		r = list[0]
	} else if err := json.Unmarshal(data, &r); err != nil {
		return Result{}, fmt.Errorf("want a JSON render object: %w", err)
	}
	if r.TokenIDs == nil {
		return Result{}, errors.New("missing token_ids")
	}
	res := Result{TokenIDs: *r.TokenIDs}
	if r.Features != nil {
		mm, err := mmItems(r.Features.MMHashes, r.Features.MMPlaceholders)
		if err != nil {
			return Result{}, err
		}
		res.MM = mm
	}
	return res, nil
}

type placeholder struct {
	Offset int `json:"offset"`
	Length int `json:"length"`
}

// mmItems pairs mm_hashes with mm_placeholders, each either a list or a map modality → list
// (paired per modality, modalities in name order).
func mmItems(hashesRaw, placesRaw json.RawMessage) ([]MMItem, error) {
	if len(hashesRaw) == 0 || string(hashesRaw) == "null" {
		return nil, nil
	}
	hashes, err := byModality[string](hashesRaw)
	if err != nil {
		return nil, fmt.Errorf("features.mm_hashes: %w", err)
	}
	places, err := byModality[placeholder](placesRaw)
	if err != nil {
		return nil, fmt.Errorf("features.mm_placeholders: %w", err)
	}
	mods := make([]string, 0, len(hashes))
	for m := range hashes {
		mods = append(mods, m)
	}
	sort.Strings(mods)
	var out []MMItem
	for _, m := range mods {
		hs, ps := hashes[m], places[m]
		if len(hs) != len(ps) {
			return nil, fmt.Errorf("features: %d mm_hashes but %d mm_placeholders for %q", len(hs), len(ps), m)
		}
		for i, h := range hs {
			if ps[i].Offset < 0 || ps[i].Length < 0 {
				return nil, fmt.Errorf("features.mm_placeholders: negative range %+v", ps[i])
			}
			out = append(out, MMItem{Offset: ps[i].Offset, Length: ps[i].Length, Hash: kvindex.HashMMIdentifier(h)})
		}
	}
	return out, nil
}

func byModality[T any](raw json.RawMessage) (map[string][]T, error) {
	var list []T
	if json.Unmarshal(raw, &list) == nil {
		return map[string][]T{"": list}, nil
	}
	var m map[string][]T
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("want a list or an object of lists: %w", err)
	}
	return m, nil
}
