// Package kvevents ingests KV-cache events published by inference engines (vLLM, SGLang) over
// ZeroMQ and applies them to a prefix index (kv-events-index.md §4-§9, §13, §16, §17).
//
// The package has three layers, each usable on its own:
//
//   - DecodeBatch turns one MessagePack payload into a Batch of RawEvents, tolerating every wire
//     variant of §7 (array or map events, omitted trailing fields, u64 / negative i64 / bytes
//     hashes, 2- or 3-element batches, map batches).
//   - A Converter turns the RawEvents of one (worker, dp_rank) listener into kvindex.Events:
//     medium → tier, locality and attention-group filtering, block-size and token-count
//     validation, and re-hashing of token ids with the request salt (LoRA name and cache
//     namespace) and multimodal extras (§8, §9). Engine block hashes are kept only as external ids.
//   - A Manager runs one SUB listener per registered (worker, dp_rank) endpoint, tracks sequence
//     numbers, recovers gaps over the DEALER→ROUTER replay protocol (§6), detects publishers that
//     restarted at the same address, and applies the converted events to a Sink (a
//     *kvindex.Index) in arrival order per worker (§13, §16).
//
// Counters for every applied, stale or dropped batch and event, gaps, replays and publisher
// restarts are available from Manager.Stats, ready to be exported as metrics.
//
// The subpackage kveventstest provides a vLLM-format publisher (PUB plus ROUTER replay socket)
// on loopback for tests of any package.
package kvevents
