// Package httpapi serves the standalone selection HTTP API (selection-service.md §2-§14) over a
// picker core: JSON in and out, one table from picker error kinds to status codes, and the §2
// conventions (415 without application/json, 400 malformed JSON, 422 wrong shape, 413 over
// 8 MiB, 404 "route not found", 405 "method not allowed", every error {"error": "..."}).
package httpapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/picker"
)

// DefaultMaxBodyBytes is the request body limit (selection-service.md §2: 8 MiB). Larger → 413.
const DefaultMaxBodyBytes = 8 << 20

// PolicyClassHeader names the queue policy family of a selection (§7.1); trimmed, empty ignored.
const PolicyClassHeader = "x-dynamo-meta-policy-class"

// Core is the part of *picker.Service the HTTP API calls (every route of selection-service.md
// §2.2 maps onto one method; errors are *picker.Error values mapped by StatusOf).
type Core interface {
	// UpsertWorker serves POST /workers (§4.1).
	UpsertWorker(ctx context.Context, rec picker.WorkerRecord, source picker.Source) (picker.WorkerState, error)
	// PatchWorker serves PATCH /workers/{worker_id} (§4.3).
	PatchWorker(ctx context.Context, workerID uint64, patch picker.WorkerPatch) (picker.WorkerState, error)
	// DeleteWorker serves DELETE /workers/{worker_id} (§4.4).
	DeleteWorker(ctx context.Context, workerID uint64) (picker.WorkerState, error)
	// Workers serves GET /workers (§4.5).
	Workers(model, group string) []picker.WorkerState
	// Ready serves GET /ready (§5).
	Ready() picker.ReadyState
	// Select serves POST /select (§7.2).
	Select(ctx context.Context, req picker.SelectRequest) (picker.Selection, error)
	// SelectAndReserve serves POST /select_and_reserve (§7.3).
	SelectAndReserve(ctx context.Context, req picker.SelectRequest) (picker.Selection, error)
	// PrefillComplete serves POST /reservations/{id}/prefill_complete (§10.2).
	PrefillComplete(ctx context.Context, selectionID string) error
	// OutputBlock serves POST /reservations/{id}/output_block (§10.2).
	OutputBlock(ctx context.Context, selectionID string, decayFraction *float64) error
	// Free serves DELETE /reservations/{id} (§10.2).
	Free(ctx context.Context, selectionID string) error
	// Loads serves GET /loads (§14.1).
	Loads(model, group string) []picker.PartitionLoads
	// ShuttingDown reports shutdown; the reservation lifecycle routes then answer 503 (§2).
	ShuttingDown() bool
	// Reserve serves POST /reservations (§10.1).
	Reserve(ctx context.Context, req picker.ReservationRequest) (picker.Reservation, error)
	// PotentialLoads serves POST /potential_loads (§14.2).
	PotentialLoads(req picker.InspectRequest) ([]picker.PotentialLoad, error)
	// OverlapScores serves POST /overlap_scores (§14.3).
	OverlapScores(req picker.InspectRequest) (picker.OverlapScores, error)
	// Dump serves GET /dump (§14.4).
	Dump() map[string]picker.PartitionDump
}

var _ Core = (*picker.Service)(nil)

// Options configures the handler.
type Options struct {
	// Logger receives 5xx diagnostics.
	Logger zerolog.Logger
	// MaxBodyBytes overrides DefaultMaxBodyBytes when > 0.
	MaxBodyBytes int64
	// Replica manages the replica-sync peers behind /replica_sync/* (selection-service.md §15.5).
	// Nil means replica sync is disabled: GET /replica_sync/peers answers [] and register /
	// deregister answer 409 "replica sync is disabled" (after body validation).
	Replica ReplicaPeers
	// Draining, when non-nil, is consulted on every request: while it returns true the side port
	// answers as after shutdown began (selection-service.md §2) without the core being shut down —
	// the EPP's SIGTERM drain window, in which the in-process ext_proc path keeps routing (epp.md
	// §9). Selecting and mutating calls (POST /workers, PATCH /workers/{id}, /select,
	// /select_and_reserve, /reservations and its lifecycle routes, /potential_loads,
	// /overlap_scores) answer 503 "selection service is shutting down" and GET /ready answers 503
	// with ready false; DELETE /workers/{id}, GET /workers, GET /loads, GET /health and GET /dump
	// keep working. Nil means never draining (only the core's own shutdown counts).
	Draining func() bool
	// Ready, when non-nil, is the embedding process's readiness (the EPP's gRPC readiness,
	// epp.md §9): while it returns false, GET /ready answers 503 with ready false whatever the
	// catalog holds, so the side port never reports ready before the process is (its index
	// recovered, its tokenizers loaded). Nil: the catalog alone decides (selection-service.md §5,
	// `epp select-service`).
	Ready func() bool
}

// ReplicaPeers is the dynamic replica-sync peer membership (selection-service.md §15.5), provided
// by the replica-sync transport. Endpoints reach it already validated by ValidateReplicaEndpoint.
// Errors should be *picker.Error values: KindNotFound "peer not found" (404) from DeregisterPeer,
// KindNotReady "replica peer manager is unavailable" (503).
type ReplicaPeers interface {
	// RegisterPeer adds a peer PUB endpoint; added is false when it was already registered.
	RegisterPeer(endpoint string) (added bool, err error)
	// DeregisterPeer removes a peer endpoint.
	DeregisterPeer(endpoint string) error
	// Peers returns the configured endpoints, sorted.
	Peers() []string
}

// Handler is the selection API's http.Handler.
type Handler struct {
	core     Core
	log      zerolog.Logger
	maxBody  int64
	replica  ReplicaPeers
	draining func() bool
	readyFn  func() bool
}

// New returns the HTTP handler of the selection API over core.
func New(core Core, opts Options) *Handler {
	h := &Handler{core: core, log: opts.Logger, maxBody: opts.MaxBodyBytes, replica: opts.Replica, draining: opts.Draining, readyFn: opts.Ready}
	if h.maxBody <= 0 {
		h.maxBody = DefaultMaxBodyBytes
	}
	return h
}

// statusByKind is the one table from picker error kinds to HTTP statuses (selection-service.md
// §2.1). Kinds not listed map to 500.
var statusByKind = map[picker.Kind]int{
	picker.KindBadRequest:    http.StatusBadRequest,
	picker.KindUnprocessable: http.StatusUnprocessableEntity,
	picker.KindNotReady:      http.StatusServiceUnavailable,
	picker.KindNotFound:      http.StatusNotFound,
	picker.KindConflict:      http.StatusConflict,
	picker.KindOverloaded:    http.StatusTooManyRequests,
	picker.KindInternal:      http.StatusInternalServerError,
	picker.KindPolicy:        http.StatusInternalServerError,
}

// StatusOf returns the HTTP status of a picker error (§2.1).
func StatusOf(err error) int {
	if st, ok := statusByKind[picker.KindOf(err)]; ok {
		return st
	}
	return http.StatusInternalServerError
}

type errorBody struct {
	Error   string `json:"error"`
	Details any    `json:"details,omitempty"`
}

type statusBody struct {
	Status string `json:"status"`
}

var okBody = statusBody{Status: "ok"}

// ServeHTTP routes the request (§2.2): unknown paths are 404 {"error":"route not found"}, a
// known path with another method is 405 {"error":"method not allowed"} with an Allow header.
// HEAD is served wherever GET is (headers only).
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	segs := splitPath(r.URL.EscapedPath())
	switch {
	case len(segs) == 1 && segs[0] == "health":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodGet: h.health})
	case len(segs) == 1 && segs[0] == "ready":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodGet: h.ready})
	case len(segs) == 1 && segs[0] == "workers":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodPost: h.upsertWorker, http.MethodGet: h.listWorkers})
	case len(segs) == 2 && segs[0] == "workers":
		id := segs[1]
		h.method(w, r, map[string]http.HandlerFunc{
			http.MethodPatch:  func(w http.ResponseWriter, r *http.Request) { h.patchWorker(w, r, id) },
			http.MethodDelete: func(w http.ResponseWriter, r *http.Request) { h.deleteWorker(w, r, id) },
		})
	case len(segs) == 1 && segs[0] == "select":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodPost: h.selectOnly})
	case len(segs) == 1 && segs[0] == "select_and_reserve":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodPost: h.selectAndReserve})
	case len(segs) == 1 && segs[0] == "loads":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodGet: h.loads})
	case len(segs) == 1 && segs[0] == "reservations":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodPost: h.reserve})
	case len(segs) == 1 && segs[0] == "potential_loads":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodPost: h.potentialLoads})
	case len(segs) == 1 && segs[0] == "overlap_scores":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodPost: h.overlapScores})
	case len(segs) == 1 && segs[0] == "dump":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodGet: h.dump})
	case len(segs) == 2 && segs[0] == "replica_sync" && segs[1] == "peers":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodGet: h.replicaPeers})
	case len(segs) == 2 && segs[0] == "replica_sync" && segs[1] == "register_peer":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodPost: h.registerPeer})
	case len(segs) == 2 && segs[0] == "replica_sync" && segs[1] == "deregister_peer":
		h.method(w, r, map[string]http.HandlerFunc{http.MethodPost: h.deregisterPeer})
	case len(segs) == 2 && segs[0] == "reservations":
		id := segs[1]
		h.method(w, r, map[string]http.HandlerFunc{
			http.MethodDelete: func(w http.ResponseWriter, r *http.Request) { h.free(w, r, id) },
		})
	case len(segs) == 3 && segs[0] == "reservations" && segs[2] == "prefill_complete":
		id := segs[1]
		h.method(w, r, map[string]http.HandlerFunc{
			http.MethodPost: func(w http.ResponseWriter, r *http.Request) { h.prefillComplete(w, r, id) },
		})
	case len(segs) == 3 && segs[0] == "reservations" && segs[2] == "output_block":
		id := segs[1]
		h.method(w, r, map[string]http.HandlerFunc{
			http.MethodPost: func(w http.ResponseWriter, r *http.Request) { h.outputBlock(w, r, id) },
		})
	default:
		writeError(w, http.StatusNotFound, "route not found")
	}
}

// splitPath splits an escaped path into unescaped segments; "/a/b" → ["a", "b"]. A segment that
// does not unescape stays as written.
func splitPath(p string) []string {
	p = strings.TrimPrefix(p, "/")
	if p == "" {
		return nil
	}
	segs := strings.Split(p, "/")
	for i, s := range segs {
		if u, err := url.PathUnescape(s); err == nil {
			segs[i] = u
		}
	}
	return segs
}

func (h *Handler) method(w http.ResponseWriter, r *http.Request, byMethod map[string]http.HandlerFunc) {
	if f, ok := byMethod[r.Method]; ok {
		f(w, r)
		return
	}
	if f, ok := byMethod[http.MethodGet]; ok && r.Method == http.MethodHead {
		f(w, r) // net/http discards the body of a HEAD response
		return
	}
	allowed := make([]string, 0, len(byMethod)+1)
	for m := range byMethod {
		allowed = append(allowed, m)
		if m == http.MethodGet {
			allowed = append(allowed, http.MethodHead)
		}
	}
	slices.Sort(allowed)
	w.Header().Set("Allow", strings.Join(allowed, ", "))
	writeError(w, http.StatusMethodNotAllowed, "method not allowed")
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status = http.StatusInternalServerError
		b, _ = json.Marshal(errorBody{Error: "encoding response: " + err.Error()})
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, errorBody{Error: msg})
}

// fail writes a picker error with its mapped status (and details, e.g. the 429 queue body).
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, err error) {
	st := StatusOf(err)
	body := errorBody{Error: err.Error()}
	var pe *picker.Error
	if errors.As(err, &pe) {
		body.Details = pe.Details
	}
	if st >= 500 && st != http.StatusServiceUnavailable {
		h.log.Error().Err(err).Str("method", r.Method).Str("path", r.URL.Path).Int("status", st).Msg("selection API error")
	}
	writeJSON(w, st, body)
}

// reply answers a core call: the error through fail when err is non-nil, else v as JSON with
// status.
func (h *Handler) reply(w http.ResponseWriter, r *http.Request, status int, v any, err error) {
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, status, v)
}

// decodeBody enforces the §2 body conventions and decodes the JSON body into v. It writes the
// error response itself and returns false on failure: 415 without Content-Type application/json,
// 413 over the limit, 400 malformed JSON (invalid UTF-8 included), 422 valid JSON of the wrong
// shape (a null body included). allowEmpty makes an
// empty body (with or without a Content-Type) decode as {}.
func (h *Handler) decodeBody(w http.ResponseWriter, r *http.Request, v any, allowEmpty bool) bool {
	if !allowEmpty && !isJSON(r.Header.Get("Content-Type")) {
		writeError(w, http.StatusUnsupportedMediaType, "Content-Type must be application/json")
		return false
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, h.maxBody))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds %d bytes", h.maxBody))
			return false
		}
		writeError(w, http.StatusBadRequest, "reading request body: "+err.Error())
		return false
	}
	if allowEmpty && len(strings.TrimSpace(string(body))) == 0 {
		return true
	}
	if !isJSON(r.Header.Get("Content-Type")) {
		writeError(w, http.StatusUnsupportedMediaType, "Content-Type must be application/json")
		return false
	}
	if !utf8.Valid(body) {
		// RFC 8259 §8.1: JSON text is UTF-8. encoding/json would silently replace invalid bytes
		// with U+FFFD, merging distinct names into one.
		writeError(w, http.StatusBadRequest, fmt.Sprintf("malformed JSON: the body is not valid UTF-8 (first invalid byte at offset %d)", invalidUTF8Offset(body)))
		return false
	}
	if bytes.Equal(bytes.Trim(body, " \t\r\n"), []byte("null")) {
		// encoding/json accepts null for a struct and leaves it zero; it is a non-object body.
		writeError(w, http.StatusUnprocessableEntity, "request body: expected an object, got JSON null")
		return false
	}
	if err := json.Unmarshal(body, v); err != nil {
		var se *json.SyntaxError
		if errors.As(err, &se) {
			writeError(w, http.StatusBadRequest, "malformed JSON: "+err.Error())
			return false
		}
		writeError(w, http.StatusUnprocessableEntity, schemaMessage(reflect.TypeOf(v), err))
		return false
	}
	return true
}

// invalidUTF8Offset returns the offset of the first byte of b that starts an invalid UTF-8
// sequence (len(b) when there is none).
func invalidUTF8Offset(b []byte) int {
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r == utf8.RuneError && n <= 1 {
			return i
		}
		i += n
	}
	return len(b)
}

// isJSON reports whether a Content-Type header names application/json (parameters allowed).
func isJSON(ct string) bool {
	if ct == "" {
		return false
	}
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && mt == "application/json"
}

// schemaMessage renders a decoding error of well-formed JSON into a body of type root (422) in
// JSON terms only — the field's JSON path and the expected JSON type, never Go type names:
// "token_ids[3]: expected an integer in [0, 4294967295], got JSON number -1",
// "request body: expected an object, got JSON array".
func schemaMessage(root reflect.Type, err error) string {
	var te *json.UnmarshalTypeError
	if !errors.As(err, &te) {
		return "invalid JSON body: " + err.Error()
	}
	path, declared := resolveField(root, te.Field)
	if declared == nil {
		declared = te.Type
	}
	if path == "" {
		path = "request body"
	}
	msg := path + ": expected " + describeJSON(declared, false)
	if te.Value != "" {
		msg += ", got JSON " + te.Value
	}
	return msg
}

// resolveField walks a decoder error's Go field path ("promptBody.token_ids",
// "WorkerRecord.block_size", "block_mm_infos.mm_objects.mm_hash", "token_ids.[3]" for an element
// a list decoder named, rendered "token_ids[3]") through root, dropping the
// names of embedded structs (which are not JSON fields) and stepping into arrays, pointers and
// map values. It returns the JSON path and the field's declared type; the type is nil when a
// segment cannot be resolved (the path is then the segments seen so far plus the rest as written,
// minus embedded names it could recognize).
func resolveField(root reflect.Type, field string) (string, reflect.Type) {
	if field == "" {
		return "", root
	}
	t := root
	var names []string
	for _, seg := range strings.Split(field, ".") {
		t = elemType(t)
		if strings.HasPrefix(seg, "[") && len(names) > 0 {
			// An element index added by a list decoder: t is already the element type.
			names[len(names)-1] += seg
			continue
		}
		switch {
		case t != nil && t.Kind() == reflect.Map:
			names = append(names, seg)
			t = t.Elem()
		case t != nil && t.Kind() == reflect.Struct:
			jsonType, embedded := structField(t, seg)
			switch {
			case jsonType != nil:
				names = append(names, seg)
				t = jsonType
			case embedded != nil:
				t = embedded
			default:
				names = append(names, seg)
				t = nil
			}
		default:
			names = append(names, seg)
			t = nil
		}
	}
	return strings.Join(names, "."), t
}

// elemType strips pointers and array/slice layers: the type a nested JSON field belongs to.
func elemType(t reflect.Type) reflect.Type {
	for t != nil && (t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
		t = t.Elem()
	}
	return t
}

// structField finds name in struct t: jsonType is the type of the field whose JSON name is name
// (looking through embedded structs), embedded the type of an embedded struct whose Go name is
// name (the decoder lists those in its paths).
func structField(t reflect.Type, name string) (jsonType, embedded reflect.Type) {
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		jname, _, _ := strings.Cut(tag, ",")
		if f.Anonymous && jname == "" {
			if f.Name == name {
				embedded = f.Type
			}
			if jt, _ := structField(elemType(f.Type), name); jt != nil {
				return jt, nil
			}
			continue
		}
		if !f.IsExported() {
			continue
		}
		if jname == "" {
			jname = f.Name
		}
		if jname == name || (jsonType == nil && strings.EqualFold(jname, name)) {
			jsonType = f.Type
		}
	}
	return jsonType, embedded
}

// describeJSON names the JSON shape that decodes into t ("an array of integers in [0, 255]"),
// plural for array and object elements ("integers in [0, 255]").
func describeJSON(t reflect.Type, plural bool) string {
	pick := func(one, many string) string {
		if plural {
			return many
		}
		return one
	}
	if t == reflect.TypeFor[Hash]() {
		return pick("an integer hash in [-2^63, 2^64-1]", "integer hashes in [-2^63, 2^64-1]")
	}
	switch t.Kind() {
	case reflect.Pointer:
		return describeJSON(t.Elem(), plural)
	case reflect.String:
		return pick("a string", "strings")
	case reflect.Bool:
		return pick("a boolean", "booleans")
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		return pick("an integer", "integers") + fmt.Sprintf(" in [0, %d]", uint64(math.MaxUint64)>>(64-t.Bits()))
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		hi := int64(math.MaxInt64) >> (64 - t.Bits())
		return pick("an integer", "integers") + fmt.Sprintf(" in [%d, %d]", -hi-1, hi)
	case reflect.Float32, reflect.Float64:
		return pick("a number", "numbers")
	case reflect.Slice, reflect.Array:
		return pick("an array of ", "arrays of ") + describeJSON(t.Elem(), true)
	case reflect.Map:
		return pick("an object of ", "objects of ") + describeJSON(t.Elem(), true)
	case reflect.Struct:
		return pick("an object", "objects")
	}
	return pick("a JSON value", "JSON values")
}

func (h *Handler) health(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, okBody)
}

func (h *Handler) ready(w http.ResponseWriter, _ *http.Request) {
	st := h.core.Ready()
	if st.Workers == nil {
		st.Workers = []picker.WorkerState{}
	}
	if h.isDraining() || (h.readyFn != nil && !h.readyFn()) {
		st.Ready = false
	}
	code := http.StatusOK
	if !st.Ready {
		code = http.StatusServiceUnavailable
	}
	writeJSON(w, code, st)
}

func (h *Handler) upsertWorker(w http.ResponseWriter, r *http.Request) {
	if h.shuttingDown(w) {
		return
	}
	var b workerBody
	if !h.decodeBody(w, r, &b, false) {
		return
	}
	if b.WorkerID == nil {
		writeError(w, http.StatusUnprocessableEntity, "missing field `worker_id`")
		return
	}
	rec := b.WorkerRecord
	rec.WorkerID = *b.WorkerID
	st, err := h.core.UpsertWorker(r.Context(), rec, picker.SourceAPI)
	h.reply(w, r, http.StatusCreated, st, err)
}

func (h *Handler) listWorkers(w http.ResponseWriter, r *http.Request) {
	listByPartition(w, r, h.core.Workers)
}

// listByPartition answers a GET that lists rows filtered by the optional model_name and
// routing_group query parameters (GET /workers §4.5, GET /loads §14.1): 200 with a JSON array,
// [] when nothing matches, 400 for a malformed query string.
func listByPartition[T any](w http.ResponseWriter, r *http.Request, list func(model, group string) []T) {
	q, ok := query(w, r)
	if !ok {
		return
	}
	rows := list(q.Get("model_name"), q.Get("routing_group"))
	if rows == nil {
		rows = []T{}
	}
	writeJSON(w, http.StatusOK, rows)
}

// query parses the query string strictly (a malformed escape such as %ZZ or a ';' separator is
// 400 "invalid query string" rather than a silently dropped filter). It writes the error itself.
func query(w http.ResponseWriter, r *http.Request) (url.Values, bool) {
	q, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid query string")
		return nil, false
	}
	return q, true
}

func parseWorkerID(w http.ResponseWriter, s string) (uint64, bool) {
	id, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid worker_id")
		return 0, false
	}
	return id, true
}

func (h *Handler) patchWorker(w http.ResponseWriter, r *http.Request, idStr string) {
	id, ok := parseWorkerID(w, idStr)
	if !ok {
		return
	}
	if h.shuttingDown(w) {
		return
	}
	var p patchBody
	if !h.decodeBody(w, r, &p, false) {
		return
	}
	if p.WorkerID != nil && *p.WorkerID != id {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("worker_id %d in the body does not match worker_id %d in the path", *p.WorkerID, id))
		return
	}
	st, err := h.core.PatchWorker(r.Context(), id, p.WorkerPatch)
	h.reply(w, r, http.StatusOK, st, err)
}

func (h *Handler) deleteWorker(w http.ResponseWriter, r *http.Request, idStr string) {
	id, ok := parseWorkerID(w, idStr)
	if !ok {
		return
	}
	st, err := h.core.DeleteWorker(r.Context(), id)
	h.reply(w, r, http.StatusOK, st, err)
}

// decodeRequest decodes the JSON body into a B (decodeBody, a body required) and converts it
// into a core request with convert; a conversion error is a 422 with its message. It writes the
// error response itself and returns false on failure.
func decodeRequest[B, R any](h *Handler, w http.ResponseWriter, r *http.Request, convert func(*B) (R, error)) (R, bool) {
	var b B
	if !h.decodeBody(w, r, &b, false) {
		var zero R
		return zero, false
	}
	req, err := convert(&b)
	if err != nil {
		writeError(w, http.StatusUnprocessableEntity, err.Error())
		return req, false
	}
	return req, true
}

// decodeSelect decodes a selection body into a core request (writing the error on failure).
func (h *Handler) decodeSelect(w http.ResponseWriter, r *http.Request) (picker.SelectRequest, bool) {
	return decodeRequest(h, w, r, func(b *selectBody) (picker.SelectRequest, error) {
		return b.request(strings.TrimSpace(r.Header.Get(PolicyClassHeader)))
	})
}

func (h *Handler) selectOnly(w http.ResponseWriter, r *http.Request) {
	if h.shuttingDown(w) {
		return
	}
	req, ok := h.decodeSelect(w, r)
	if !ok {
		return
	}
	sel, err := h.core.Select(r.Context(), req)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, toSelectResponse(sel, req.Advisory))
}

func (h *Handler) selectAndReserve(w http.ResponseWriter, r *http.Request) {
	if h.shuttingDown(w) {
		return
	}
	req, ok := h.decodeSelect(w, r)
	if !ok {
		return
	}
	req.Advisory = false // ignored by /select_and_reserve (§7.3)
	sel, err := h.core.SelectAndReserve(r.Context(), req)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, toReserveResponse(sel))
}

func (h *Handler) loads(w http.ResponseWriter, r *http.Request) {
	listByPartition(w, r, h.core.Loads)
}

// isDraining reports whether Options.Draining says the process is draining.
func (h *Handler) isDraining() bool { return h.draining != nil && h.draining() }

// shuttingDown rejects a selecting or mutating call after shutdown began or while draining (§2:
// every mutating or selecting call except DELETE /workers/{id} returns 503; the in-process core
// keeps the reservation lifecycle working for ext_proc). It writes the 503 itself.
func (h *Handler) shuttingDown(w http.ResponseWriter) bool {
	if h.core.ShuttingDown() || h.isDraining() {
		writeError(w, http.StatusServiceUnavailable, "selection service is shutting down")
		return true
	}
	return false
}

// emptyID answers 400 for a lifecycle path without a selection id ("/reservations/"); it writes
// the error itself.
func emptyID(w http.ResponseWriter, id string) bool {
	if id == "" {
		writeError(w, http.StatusBadRequest, "selection_id in the path is empty")
		return true
	}
	return false
}

func (h *Handler) prefillComplete(w http.ResponseWriter, r *http.Request, id string) {
	if emptyID(w, id) || h.shuttingDown(w) {
		return
	}
	h.reply(w, r, http.StatusOK, okBody, h.core.PrefillComplete(r.Context(), id))
}

func (h *Handler) outputBlock(w http.ResponseWriter, r *http.Request, id string) {
	if emptyID(w, id) || h.shuttingDown(w) {
		return
	}
	var b outputBlockBody
	if !h.decodeBody(w, r, &b, true) {
		return
	}
	h.reply(w, r, http.StatusOK, okBody, h.core.OutputBlock(r.Context(), id, b.DecayFraction))
}

func (h *Handler) free(w http.ResponseWriter, r *http.Request, id string) {
	if emptyID(w, id) || h.shuttingDown(w) {
		return
	}
	h.reply(w, r, http.StatusOK, okBody, h.core.Free(r.Context(), id))
}

func (h *Handler) reserve(w http.ResponseWriter, r *http.Request) {
	if h.shuttingDown(w) {
		return
	}
	req, ok := decodeRequest(h, w, r, (*reservationBody).request)
	if !ok {
		return
	}
	res, err := h.core.Reserve(r.Context(), req)
	h.reply(w, r, http.StatusCreated, res, err)
}

// decodeInspect decodes a /potential_loads or /overlap_scores body (writing the error on failure).
func (h *Handler) decodeInspect(w http.ResponseWriter, r *http.Request) (picker.InspectRequest, bool) {
	return decodeRequest(h, w, r, func(b *inspectBody) (picker.InspectRequest, error) {
		pr, err := b.prompt()
		if err != nil {
			return picker.InspectRequest{}, err
		}
		return picker.InspectRequest{ModelName: b.ModelName, RoutingGroup: b.RoutingGroup, Prompt: pr, Override: b.RouterConfigOverride}, nil
	})
}

func (h *Handler) potentialLoads(w http.ResponseWriter, r *http.Request) {
	if h.shuttingDown(w) {
		return
	}
	req, ok := h.decodeInspect(w, r)
	if !ok {
		return
	}
	rows, err := h.core.PotentialLoads(req)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	if rows == nil {
		rows = []picker.PotentialLoad{}
	}
	writeJSON(w, http.StatusOK, rows)
}

func (h *Handler) overlapScores(w http.ResponseWriter, r *http.Request) {
	if h.shuttingDown(w) {
		return
	}
	req, ok := h.decodeInspect(w, r)
	if !ok {
		return
	}
	res, err := h.core.OverlapScores(req)
	h.reply(w, r, http.StatusOK, res, err)
}

func (h *Handler) dump(w http.ResponseWriter, _ *http.Request) {
	d := h.core.Dump()
	if d == nil {
		d = map[string]picker.PartitionDump{}
	}
	writeJSON(w, http.StatusOK, d)
}

// errReplicaDisabled is the 409 of the replica routes without replica sync (§15.5).
const errReplicaDisabled = "replica sync is disabled"

func (h *Handler) replicaPeers(w http.ResponseWriter, _ *http.Request) {
	peers := []string{}
	if h.replica != nil {
		if ps := h.replica.Peers(); ps != nil {
			peers = ps
		}
	}
	writeJSON(w, http.StatusOK, peers)
}

// decodePeer decodes and validates a replica peer body: 415/413/400/422 as every body, then 400
// for an invalid endpoint (§15.5), before any check of whether replica sync is enabled.
func (h *Handler) decodePeer(w http.ResponseWriter, r *http.Request) (string, bool) {
	var b peerBody
	if !h.decodeBody(w, r, &b, false) {
		return "", false
	}
	if b.Endpoint == nil {
		writeError(w, http.StatusUnprocessableEntity, "missing field `endpoint`")
		return "", false
	}
	if err := ValidateReplicaEndpoint(*b.Endpoint); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return "", false
	}
	return *b.Endpoint, true
}

func (h *Handler) registerPeer(w http.ResponseWriter, r *http.Request) {
	ep, ok := h.decodePeer(w, r)
	if !ok {
		return
	}
	if h.replica == nil {
		writeError(w, http.StatusConflict, errReplicaDisabled)
		return
	}
	added, err := h.replica.RegisterPeer(ep)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	st := http.StatusOK
	if added {
		st = http.StatusCreated
	}
	writeJSON(w, st, okBody)
}

func (h *Handler) deregisterPeer(w http.ResponseWriter, r *http.Request) {
	ep, ok := h.decodePeer(w, r)
	if !ok {
		return
	}
	if h.replica == nil {
		writeError(w, http.StatusConflict, errReplicaDisabled)
		return
	}
	h.reply(w, r, http.StatusOK, okBody, h.replica.DeregisterPeer(ep))
}

// MaxPeerEndpointBytes bounds a replica-sync peer endpoint (a host name is at most 253 bytes).
const MaxPeerEndpointBytes = 512

// ValidateReplicaEndpoint checks a replica-sync peer endpoint (selection-service.md §15.5):
// scheme://address with scheme tcp, ipc or inproc and a non-empty address; tcp needs a non-empty
// host and a u16 port after the last ':' (as the spec has it, port 0 and host * pass, although
// they name no peer that can be dialled), and an IPv6 host must be bracketed
// ("tcp://[::1]:9092"); at most
// MaxPeerEndpointBytes, without whitespace, control characters or '@'. The error names the
// endpoint (at most 100 bytes of it).
func ValidateReplicaEndpoint(ep string) error {
	if len(ep) > MaxPeerEndpointBytes {
		return fmt.Errorf("invalid endpoint %q: %d bytes long; the limit is %d bytes", excerpt.Of(ep), len(ep), MaxPeerEndpointBytes)
	}
	if i := strings.IndexFunc(ep, func(r rune) bool { return r <= ' ' || r == 0x7f || r == '@' }); i >= 0 {
		return fmt.Errorf("invalid endpoint %q: contains whitespace, a control character or '@'", excerpt.Of(ep))
	}
	scheme, addr, ok := strings.Cut(ep, "://")
	if !ok {
		return fmt.Errorf("invalid endpoint %q: expected scheme://address", excerpt.Of(ep))
	}
	switch scheme {
	case "ipc", "inproc":
		if addr == "" {
			return fmt.Errorf("invalid endpoint %q: empty address", excerpt.Of(ep))
		}
		return nil
	case "tcp":
	default:
		return fmt.Errorf("invalid endpoint %q: scheme must be tcp, ipc or inproc", excerpt.Of(ep))
	}
	i := strings.LastIndexByte(addr, ':')
	if i < 0 {
		return fmt.Errorf("invalid endpoint %q: tcp endpoints need host:port", excerpt.Of(ep))
	}
	host, port := addr[:i], addr[i+1:]
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Errorf("invalid endpoint %q: port %q is not an integer in 0..65535", excerpt.Of(ep), excerpt.Of(port))
	}
	if host == "" {
		return fmt.Errorf("invalid endpoint %q: empty host", excerpt.Of(ep))
	}
	bracketed := strings.HasPrefix(host, "[") || strings.HasSuffix(host, "]")
	if bracketed {
		inner, ok := strings.CutPrefix(host, "[")
		if inner, ok2 := strings.CutSuffix(inner, "]"); !ok || !ok2 || inner == "" || strings.ContainsAny(inner, "[]") {
			return fmt.Errorf("invalid endpoint %q: malformed bracketed host", excerpt.Of(ep))
		}
		return nil
	}
	if strings.Contains(host, ":") {
		return fmt.Errorf("invalid endpoint %q: IPv6 hosts must be bracketed", excerpt.Of(ep))
	}
	return nil
}
