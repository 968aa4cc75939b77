package extproc

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/kvepp/kvepp/picker"
)

// Content codings of request bodies (RFC 9110 §8.4.1). gzip and deflate bodies are decoded so
// they are parsed, tokenized and routed like plain ones (the proxy still forwards the original
// bytes); any other coding cannot be read and gets a load-only pick (epp.md §5.7).
const (
	codingIdentity    = ""
	codingGzip        = "gzip"
	codingDeflate     = "deflate"
	codingUnsupported = "unsupported"
)

// contentCoding classifies a content-encoding header value: "" and "identity" are identity,
// "gzip" / "x-gzip" gzip, "deflate" deflate; anything else — other codings, or a list of several
// (which would need every one undone in order) — is unsupported.
func contentCoding(header string) string {
	switch strings.ToLower(strings.TrimSpace(header)) {
	case "", "identity":
		return codingIdentity
	case "gzip", "x-gzip":
		return codingGzip
	case "deflate":
		return codingDeflate
	}
	return codingUnsupported
}

// errUndecodable marks a body whose coding is supported but whose bytes do not decode.
var errUndecodable = errors.New("request body does not decode")

// decodeBody undoes coding (codingGzip or codingDeflate) on body. "deflate" is the zlib format
// (RFC 9110 §8.4.1.2); raw DEFLATE, which some clients send under that name, is accepted too. The
// decoded body may hold at most limit bytes: more is a 413 (KindRequestTooLarge), so a small
// compressed body cannot expand past the body limit. Undecodable bytes return errUndecodable.
func decodeBody(coding string, body []byte, limit int64) ([]byte, error) {
	var r io.Reader
	var err error
	switch coding {
	case codingGzip:
		r, err = gzip.NewReader(bytes.NewReader(body))
	case codingDeflate:
		if r, err = zlib.NewReader(bytes.NewReader(body)); errors.Is(err, zlib.ErrHeader) {
			r, err = flate.NewReader(bytes.NewReader(body)), nil
		}
	default:
		return nil, fmt.Errorf("%w: unsupported coding %q", errUndecodable, coding)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errUndecodable, err)
	}
	out, err := io.ReadAll(io.LimitReader(r, limit+1))
	if int64(len(out)) > limit {
		return nil, picker.Errorf(KindRequestTooLarge, "decoded request body exceeds %d bytes (DYN_EPP_MAX_REQUEST_BODY_BYTES)", limit)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errUndecodable, err)
	}
	return out, nil
}
