// Package extproc is kvepp's Envoy external processor: an ext_proc v3 gRPC server
// (envoy.service.ext_proc.v3.ExternalProcessor/Process) that picks a model-server endpoint for
// every inference request (epp.md §4–§8).
//
// One Process stream carries one HTTP request. The server captures the request headers, buffers the
// body until end of stream (FULL_DUPLEX_STREAMED, the conformance mode; BUFFERED and NONE are also
// accepted), parses and validates the OpenAI-style body (chat, completions, responses), tokenizes the
// prompt through a Tokenizers, and books a worker through a Picker. It then answers with one header
// mutation (x-gateway-destination-endpoint plus envoy.lb dynamic metadata), re-streams the body in
// chunks of at most 62,000 bytes, echoes the response, marks prefill complete on the first non-empty
// successful response chunk and frees the booking exactly once when the response ends or the stream
// closes. Every request-level failure becomes an ImmediateResponse (one status table, epp.md §8);
// gRPC errors are reserved for protocol violations (unsupported body modes, observability mode).
//
// Beyond the spec's flow: gzip and deflate request bodies are decoded (within the body limit) and
// routed like plain ones; a request's model comes from the body's model or the
// x-gateway-model-name header, for load-only picks too; a body that reaches its declared
// content-length is routed without waiting for an end of stream that an upgraded connection never
// sends, upgrade requests on inference paths are refused, and a body that has not ended within
// Config.RequestBodyTimeout is answered 408; on request (DecisionHeader) the routing reply
// describes the decision in the DecisionMetadataNamespace dynamic metadata.
//
// The request path parses a body once (epp.md §13.5): one validating pass (internal/jsonscan)
// finds the top-level members and the messages' element boundaries, which a PromptTokenizer gets
// in TokenizeCall.Members instead of parsing the body again. Bodies that arrive in several chunks
// are concatenated once, into a pooled buffer sized from content-length; the chunks sent back are
// slices of it. A tokenizer may attach a picker.BlockHashMemo to its prompt (a continuing
// conversation's cached prefix) so the picker hashes only the new blocks.
//
// When the Picker implements OutputTracker and tracks output blocks (DYN_ROUTER_TRACK_OUTPUT_BLOCKS),
// the response path counts a streamed response's generated tokens (exact from per-chunk usage,
// else estimated from its SSE events; outputtokens.go) and reports the running total after each
// chunk, so the booking grows by one output block per block_size tokens until it is freed.
//
// The package also provides Health, the gRPC health service of epp.md §9, and UsageParser, the
// response usage parser of epp.md §6.4. The Envoy emulator used by tests lives in
// extproc/extproctest.
package extproc
