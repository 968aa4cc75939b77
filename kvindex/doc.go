// Package kvindex is kvepp's pure KV-cache core (kv-events-index.md §1-§3, §10-§12, §14-§16):
//
//   - block hashing: Seed, BlockHash, AppendBlockHashes (with sorted multimodal suffixes),
//     EagleBlockHashes, the sequence-hash chain, HashMMIdentifier and PadValue;
//   - Index, one partition's prefix index: a radix tree of device blocks keyed by local block
//     hash, with per-candidate external-hash lookups, plus one lower-tier store per tier
//     (host_pinned, disk, external), fed by Events (Apply) and queried by FindMatches; stored as
//     arena-allocated runs of blocks (about 22 bytes per (block, worker) pair) in worker shards
//     with one lock each (README.md);
//   - Dump and Restore in the /dump RouterEvent JSON format;
//   - Approx, the approximate-mode index fed by the router's own bookings (TTL, size cap, LRU).
//
// Everything here is a data structure: no goroutines, sockets or clocks (time is passed in).
// Index and Approx are safe for concurrent use.
package kvindex
