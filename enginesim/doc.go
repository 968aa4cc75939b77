// Package enginesim simulates vLLM model servers for benchmarks and tests: an
// OpenAI-compatible HTTP server, a real prefix cache with LRU eviction, and KV
// events published in vLLM's ZeroMQ wire format (kv-events-index.md §4-§7), with
// the replay socket of §6. It is a stand-in for an external engine and imports no
// other kvepp package.
//
// # Workers and pools
//
// [Start] runs one [Worker] (one simulated vLLM server, data-parallel rank 0) on
// loopback; [NewPool] starts several. Every worker listens on three sockets: HTTP
// ([Worker.Endpoint]), a ZMQ PUB socket for live KV events
// ([Worker.KVEventsEndpoint]) and a ZMQ ROUTER socket for replay
// ([Worker.ReplayEndpoint]).
//
// # HTTP API
//
//   - POST /v1/completions and POST /v1/chat/completions: OpenAI-compatible.
//     Without "stream" the answer is one JSON object (object "text_completion"
//     or "chat.completion") with choices and usage. With "stream": true it is
//     an SSE stream of `data: {json}` events: one chunk per output token (chat
//     starts with a delta carrying role "assistant"), the last with
//     finish_reason "length", then a chunk with empty choices and usage, then
//     `data: [DONE]`. The usage chunk is always sent (as if
//     stream_options.include_usage were set). Usage is {prompt_tokens,
//     completion_tokens, total_tokens, prompt_tokens_details:{cached_tokens}}.
//     With stream_options.continuous_usage_stats (vLLM) every token chunk also
//     carries usage {prompt_tokens, completion_tokens so far, total_tokens}.
//   - GET /health answers 200 with an empty body; GET /v1/models lists the model.
//   - Every response carries X-Enginesim-Worker: <Config.Name>. An X-Request-Id
//     request header becomes the request's id (response id "cmpl-<id>" or
//     "chatcmpl-<id>", [RequestRecord.ID]).
//   - Errors are vLLM-shaped JSON {"object":"error","message",…,"code"}: 400 for
//     a malformed body or prompt (message names the offending field and value),
//     404 for a model other than [Config.Model], 413 for a body over 64 MiB.
//     A stream cut short by [Worker.Close] or a client disconnect ends without
//     [DONE].
//
// # Token scheme
//
// Completions accept `prompt` as token ids ([int], or [[int]] with one element),
// which are used as given. Text is turned into token ids deterministically:
// every maximal run of non-whitespace characters is one token whose id is
// xxh3_64(utf8 run, seed 0) mod 131072 ([TextVocabSize]); whitespace only
// separates tokens. A chat request is first rendered to text, one line group per
// message, "<|im_start|>{role}\n{content}<|im_end|>\n", followed by
// "<|im_start|>assistant\n" (content may be a string or an array of parts whose
// "text" fields are joined with "\n"; other parts are ignored), and that text is
// tokenized as above. Both endpoints also accept a body field
// `prompt_token_ids` ([int]) that overrides the prompt or messages, so a client
// that tokenized the request itself (or a benchmark that synthesizes token ids)
// controls the exact ids. See [TokenizeText] and [RenderChat].
//
// The number of output tokens is `max_tokens` (chat: `max_completion_tokens`,
// else `max_tokens`), or [Config.DefaultMaxTokens] when absent; generation never
// stops early and finish_reason is always "length".
//
// # Prefix cache
//
// The cache holds full prompt blocks of [Config.BlockSize] tokens, at most
// [Config.CapacityBlocks] of them. A block's engine hash is chained like vLLM's:
// hash_i = xxh3_64(LE_u64(hash_{i-1}) ‖ LE_u32 tokens of block i, seed
// [Config.HashSeed]), where hash_{-1} = xxh3_64("enginesim:none", seed HashSeed)
// stands for vLLM's NONE_HASH. These hashes are opaque engine ids sent in events;
// a router re-hashes the token ids itself.
//
// This section describes [EngineSimple]; [EngineVLLM] uses the same hashes, hit rule,
// LRU order and events, with the differences given under "Timing model".
//
// A request's prefix hit is the number of consecutive cached blocks from the
// start, looked up when the request's prefill is scheduled (after any wait for a
// running slot and, with [Config.SerialPrefill], for the prefill lane), as vLLM's
// scheduler looks it up when it schedules a waiting request. Like vLLM, at least the
// last prompt token is always computed, so at most floor((len-1)/bs) blocks hit:
// a 32-token prompt cached in full hits 1 block, a 40-token prompt hits 2. Hit
// blocks are pinned (reference-counted) while the request runs. After prefill,
// every full prompt block after the hit prefix is stored: missing blocks are
// inserted, evicting least recently used unpinned blocks at capacity, and blocks
// already present (stored meanwhile by a concurrent request with the same
// prefix) are reused. The partial tail block and generated tokens are never
// cached. If the cache is full of pinned blocks, the store stops at the first
// block that does not fit and the rest of the prompt is not cached.
//
// When a request finishes its blocks are unpinned and appended to the LRU list in
// reverse order (the last block first), as vLLM's free-block queue does, so the
// tail of a prompt is evicted before its head. Eviction removes exactly the
// evicted block and never implicitly removes its descendants. Because a request
// pins its whole prefix and releases it tail first, a block is never less
// recently used than its cached descendants, so eviction always takes a leaf and
// a parent is not evicted while a child stays cached; events therefore never
// leave a router with orphaned blocks.
//
// # KV events
//
// Each prefill that changes the cache publishes one batch [ts, events, 0]
// (§7.1): a BlockRemoved event listing the blocks evicted to make room (if any),
// then one BlockStored event listing every block the request computed after its
// hit prefix, in order, with the hash of the last hit block as parent (nil when
// the hit is empty); reused blocks are announced again, which a router's index
// applies idempotently. [Worker.Reset] publishes AllBlocksCleared; a request
// running across a reset stores its whole prompt again from the first block.
// Events use the array forms of [EncodeBatch]; the medium is always "GPU".
// Sequence numbers start at 0 and increase by one per batch; the last
// [Config.ReplayBuffer] batches are kept for replay.
//
// # Timing model
//
// All durations in [Config] are simulated time; [Config.TimeScale] converts them
// to wall-clock time (wall = simulated × TimeScale), so 0.01 runs a hundred times
// faster than real time. [Config.Engine] chooses one of two models.
//
// [EngineSimple] (the default, for fast tests): a request first waits FIFO for one of
// [Config.MaxRunning] running slots (and, with [Config.SerialPrefill], for the
// worker's single prefill lane). Its simulated time to first token is
// TTFT = queue + [Config.PrefillOverhead] + [Config.PrefillPerToken] × uncached
// prompt tokens, where queue is the measured wait converted to simulated time.
// Every further output token takes [Config.DecodePerToken], so the simulated
// end-to-end latency is TTFT + (output tokens − 1) × DecodePerToken. Running
// requests do not slow each other down; only the running-slot limit (and the
// optional serial prefill lane) creates contention. The prefix cache's capacity is
// CapacityBlocks cached blocks.
//
// [EngineVLLM] models vLLM V1's scheduler, step by step, as Dynamo's mocker and Vidur
// do. One engine loop per worker runs steps back to back:
//
//   - A step has a token budget, max_num_batched_tokens ([Config.MaxNumBatchedTokens],
//     default [StepProfile.MaxNumBatchedTokens]). Running requests go first in admission
//     order, each decoding request taking one token and a request still in prefill its
//     next chunk; since a request is admitted behind every running one and a prefill that
//     leaves budget over ends in that step, decoding requests always come before prefill
//     chunks (decode first). Waiting requests that have arrived are then admitted in order
//     while budget and running slots ([Config.MaxRunning], vLLM max_num_seqs) remain.
//   - The KV cache is a pool of CapacityBlocks blocks (vLLM num_gpu_blocks). A running
//     request holds the blocks of every token it has computed (prompt and generated);
//     they are not evictable. Free blocks are unused or hold cached prompt blocks in LRU
//     order; allocating takes unused blocks first, then evicts the least recently used
//     cached block. A request that needs a block when none is free preempts the last
//     running request (recompute: its blocks are freed, its progress lost, and it goes
//     back to the front of the waiting queue, keeping the tokens it already emitted); a
//     waiting request whose blocks do not fit stops admission for that step. A request
//     whose prompt and max_tokens exceed the whole pool is refused with 400.
//   - The prefix is looked up when a request is admitted; prompt blocks are cached as
//     their chunk is computed (announced in the step's KV event batch: evicted blocks,
//     then stored ones), so a request admitted in a later step hits them.
//   - The step takes [StepProfile.StepTime] of what it computes: a fixed time, time per
//     token, prefill attention per (new token, attended token) pair and decode attention
//     per context token read. The step that completes a request's prompt samples its
//     first token (TTFT = that step's end − arrival); each later step samples one more.
//     [DefaultProfile] is calibrated to Llama-3.1-8B on an A100-80GB ([ProfileLlama31_8B_A100]).
//
// The engine clock advances by exactly each step's simulated duration; a goroutine that
// wakes late (a busy machine) makes the next step start at once rather than late, up to
// 250 ms of simulated time behind the wall clock, and only time beyond that is lost and
// counted in [Stats.EngineLag]. [Sim] runs either model in virtual time without
// sockets or goroutines, for offline replays.
package enginesim
