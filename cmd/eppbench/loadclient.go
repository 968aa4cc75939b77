package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvepp/kvepp/extproc/extproctest"
)

// loadChunkBytes is the request body chunk size of an exchange: Envoy's default buffer
// (per_connection_buffer_limit_bytes 1 MiB is the cap; its reads arrive in 16 KiB slices).
const loadChunkBytes = 16 << 10

// loadResponseChunks is the upstream response of every exchange: a streamed chat completion in
// three SSE events, the last with usage, as a short vLLM answer looks.
var loadResponseChunks = [][]byte{
	[]byte("data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"}}]}\n\n"),
	[]byte("data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" world\"}}]}\n\n"),
	[]byte("data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":3000,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n"),
}

// exchangeTiming is what one exchange measured.
type exchangeTiming struct {
	// Decision is from sending the body's last chunk (end_of_stream) to receiving the routing reply.
	Decision time.Duration
	// Total is from opening the stream to its end after the response phase.
	Total time.Duration
}

// loadRequest is one exchange's request.
type loadRequest struct {
	Path      string
	Body      []byte
	RequestID string
}

// doExchange plays one full ext_proc exchange as Envoy's filter does in FULL_DUPLEX_STREAMED mode
// for both directions: request headers (deferred reply) and the body in 16 KiB chunks sent without
// waiting, the routing reply, the request body replies, then the upstream response (headers and
// three body chunks, each answered before the next is sent), and the end of the stream. It accepts
// the two ways servers answer the request body: re-streamed chunks up to end_of_stream (kvepp, the
// Gateway API Inference Extension's full EPP), or one CONTINUE per chunk (its lightweight EPP). An
// ImmediateResponse, a routing reply without a destination or a protocol violation is an error.
func doExchange(ctx context.Context, c extprocv3.ExternalProcessorClient, r loadRequest) (exchangeTiming, error) {
	start := time.Now()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ps, err := c.Process(ctx)
	if err != nil {
		return exchangeTiming{}, fmt.Errorf("open stream: %w", err)
	}
	hm := extproctest.RequestHeaders(false,
		extproctest.Header{Key: ":method", Value: "POST"},
		extproctest.Header{Key: ":path", Value: r.Path},
		extproctest.Header{Key: ":authority", Value: "gateway.bench"},
		extproctest.Header{Key: ":scheme", Value: "http"},
		extproctest.Header{Key: "content-type", Value: "application/json"},
		extproctest.Header{Key: "content-length", Value: strconv.Itoa(len(r.Body))},
		extproctest.Header{Key: "x-request-id", Value: r.RequestID},
	)
	hm.ProtocolConfig = &extprocv3.ProtocolConfiguration{
		RequestBodyMode:  filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
	}
	if err := ps.Send(hm); err != nil {
		return exchangeTiming{}, sendError(ps, err)
	}
	chunks := 0
	var lastSent time.Time
	for body := r.Body; ; {
		n := min(len(body), loadChunkBytes)
		last := n == len(body)
		if last {
			lastSent = time.Now()
		}
		if err := ps.Send(extproctest.RequestBody(body[:n], last)); err != nil {
			return exchangeTiming{}, sendError(ps, err)
		}
		chunks++
		body = body[n:]
		if last {
			break
		}
	}
	var t exchangeTiming
	routed, echoed, continues, bodyDone := false, 0, 0, false
	for !routed || !bodyDone {
		m, err := ps.Recv()
		if err != nil {
			return t, fmt.Errorf("request phase: %w", err)
		}
		switch x := m.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			return t, fmt.Errorf("immediate response %d: %s", x.ImmediateResponse.GetStatus().GetCode(), x.ImmediateResponse.GetBody())
		case *extprocv3.ProcessingResponse_RequestHeaders:
			if routed {
				return t, errors.New("a second request_headers reply")
			}
			t.Decision = time.Since(lastSent)
			routed = true
			if !hasDestination(x.RequestHeaders.GetResponse()) {
				return t, errors.New("the routing reply sets no x-gateway-destination-endpoint")
			}
		case *extprocv3.ProcessingResponse_RequestBody:
			if sr := x.RequestBody.GetResponse().GetBodyMutation().GetStreamedResponse(); sr != nil {
				echoed += len(sr.GetBody())
				bodyDone = sr.GetEndOfStream()
				if bodyDone && echoed != len(r.Body) {
					return t, fmt.Errorf("the re-streamed body has %d bytes, sent %d", echoed, len(r.Body))
				}
			} else {
				continues++
				bodyDone = continues == chunks
			}
		default:
			return t, fmt.Errorf("unexpected %T in the request phase", x)
		}
	}
	if err := ps.Send(extproctest.ResponseHeaders(false,
		extproctest.Header{Key: ":status", Value: "200"},
		extproctest.Header{Key: "content-type", Value: "text/event-stream"})); err != nil {
		return t, sendError(ps, err)
	}
	if err := expectReply(ps, "response_headers"); err != nil {
		return t, err
	}
	for i, ch := range loadResponseChunks {
		if err := ps.Send(extproctest.ResponseBody(ch, i == len(loadResponseChunks)-1)); err != nil {
			return t, sendError(ps, err)
		}
		if err := expectReply(ps, "response_body"); err != nil {
			return t, err
		}
	}
	if err := ps.CloseSend(); err != nil {
		return t, err
	}
	for {
		if _, err := ps.Recv(); err != nil {
			if !errors.Is(err, io.EOF) {
				return t, fmt.Errorf("end of stream: %w", err)
			}
			break
		}
	}
	t.Total = time.Since(start)
	return t, nil
}

// expectReply receives one message and checks it answers the phase named want.
func expectReply(ps extprocv3.ExternalProcessor_ProcessClient, want string) error {
	m, err := ps.Recv()
	if err != nil {
		return fmt.Errorf("%s reply: %w", want, err)
	}
	ok := false
	switch want {
	case "response_headers":
		ok = m.GetResponseHeaders() != nil
	case "response_body":
		ok = m.GetResponseBody() != nil
	}
	if !ok {
		return fmt.Errorf("expected a %s reply, got %T", want, m.GetResponse())
	}
	return nil
}

// sendError returns the stream's status when Send failed because the server ended the stream.
func sendError(ps extprocv3.ExternalProcessor_ProcessClient, err error) error {
	if errors.Is(err, io.EOF) {
		if _, rerr := ps.Recv(); rerr != nil && !errors.Is(rerr, io.EOF) {
			return rerr
		}
		return errors.New("the server ended the stream")
	}
	return err
}

// hasDestination reports whether a routing reply sets x-gateway-destination-endpoint.
func hasDestination(c *extprocv3.CommonResponse) bool {
	for _, h := range c.GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == extproctest.DestinationKey && (len(h.GetHeader().GetRawValue()) > 0 || h.GetHeader().GetValue() != "") {
			return true
		}
	}
	return false
}
