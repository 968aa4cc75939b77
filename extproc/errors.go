package extproc

import (
	"encoding/json"
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"

	"github.com/kvepp/kvepp/picker"
)

// Kinds the ext_proc server adds to picker's vocabulary for its own failures (epp.md §5.5, §5.2,
// §8). They appear only in errors built by this package.
const (
	// KindModelNotFound: the body names a model no partition serves (404).
	KindModelNotFound picker.Kind = "model_not_found"
	// KindRequestTooLarge: the request body exceeds MaxRequestBodyBytes (413).
	KindRequestTooLarge picker.Kind = "request_too_large"
	// KindTokenizerTimeout: the tokenizer call timed out (504).
	KindTokenizerTimeout picker.Kind = "tokenizer_timeout"
	// KindTokenizerError: tokenizer 5xx, malformed or oversize tokenizer response (502).
	KindTokenizerError picker.Kind = "tokenizer_error"
	// KindRequestTimeout: the request body did not end within RequestBodyTimeout (408).
	KindRequestTimeout picker.Kind = "request_timeout"
)

// RejectReasonHeader is the response header naming the error.type of an ImmediateResponse
// (epp.md §8; the name is kvepp's choice).
const RejectReasonHeader = "x-dynamo-epp-reject-reason"

// rejection is one row of the status table: the HTTP status and the OpenAI-style error.type.
type rejection struct {
	status int
	typ    string
}

// statusTable is THE mapping from error kinds to ImmediateResponse statuses (epp.md §8). Kinds not in
// the table (and plain errors, whose kind is picker.KindInternal) get 500 internal_error.
var statusTable = map[picker.Kind]rejection{
	picker.KindBadRequest:    {400, "invalid_request_error"},
	picker.KindUnprocessable: {400, "invalid_request_error"},
	KindModelNotFound:        {404, "model_not_found"},
	picker.KindNotFound:      {404, "not_found_error"},
	KindRequestTooLarge:      {413, "request_too_large"},
	KindRequestTimeout:       {408, "request_timeout"},
	picker.KindOverloaded:    {429, "overloaded"},
	"queue_rejected":         {429, "overloaded"},
	picker.KindNotReady:      {503, "service_unavailable"},
	KindTokenizerTimeout:     {504, "tokenizer_timeout"},
	KindTokenizerError:       {502, "tokenizer_error"},
	picker.KindConflict:      {500, "internal_error"},
	picker.KindPolicy:        {500, "internal_error"},
	picker.KindInternal:      {500, "internal_error"},
}

// StatusFor returns the ImmediateResponse HTTP status and error.type for err (epp.md §8), using the
// kind of the first *picker.Error in its chain (picker.KindOf). Unknown kinds map to 500
// internal_error.
func StatusFor(err error) (status int, errorType string) {
	r, ok := statusTable[picker.KindOf(err)]
	if !ok {
		r = statusTable[picker.KindInternal]
	}
	return r.status, r.typ
}

// errorBody is the JSON body of an ImmediateResponse.
type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Code    int    `json:"code"`
}

// immediateResponse builds the ImmediateResponse for err: status from the table, body
// {"error":{"message","type","code"}}, content-type application/json, the reject-reason header and
// retry-after: 1 on 429.
func immediateResponse(err error) (*extprocv3.ProcessingResponse, int) {
	status, typ := StatusFor(err)
	msg := err.Error()
	body, mErr := json.Marshal(errorBody{Error: errorDetail{Message: msg, Type: typ, Code: status}})
	if mErr != nil { // cannot happen for strings and ints; keep a valid body regardless
		body = []byte(`{"error":{"message":"internal error","type":"internal_error","code":500}}`)
	}
	set := []*corev3.HeaderValueOption{
		setHeader("content-type", "application/json"),
		setHeader(RejectReasonHeader, typ),
	}
	if status == 429 {
		set = append(set, setHeader("retry-after", "1"))
	}
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: &extprocv3.ImmediateResponse{
				Status:  &typev3.HttpStatus{Code: typev3.StatusCode(status)},
				Headers: &extprocv3.HeaderMutation{SetHeaders: set},
				Body:    body,
				Details: "kvepp_" + typ + "_" + strconv.Itoa(status),
			},
		},
	}, status
}

// setHeader is one header mutation entry: raw_value with OVERWRITE_IF_EXISTS_OR_ADD (epp.md §4).
func setHeader(key, value string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{
		Header:       &corev3.HeaderValue{Key: key, RawValue: []byte(value)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}
}
