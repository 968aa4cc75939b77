// Package tokenizer turns OpenAI-style request bodies into exactly the token ids a vLLM/SGLang
// engine computes for them, in process (epp.md §5.4 `local` mode, tokenizer.md).
//
// It has two halves:
//
//   - An exact Hugging Face byte-level BPE tokenizer loaded from tokenizer.json (Qwen2/2.5/3,
//     Llama 3 and GPT-2 layouts): added tokens matched leftmost-longest in the raw text, the
//     normalizer run per segment between added tokens, Split/ByteLevel/Digits pre-tokenizers
//     (hand-written scanners for the Qwen2, Llama 3 and GPT-2 patterns, verified equal to
//     regexp2 in its default mode, with regexp2 itself as the general fallback), GPT-2's
//     bytes-to-unicode mapping, BPE merges by rank with ties broken by leftmost position, the
//     post-processor for add_special_tokens, and a bounded concurrency-safe piece cache.
//   - A chat-template renderer (github.com/ardanlabs/jinja configured like transformers'
//     jinja2 environment) over an order-keeping decode of the request, with vLLM's request
//     preprocessing and a Python-exact tojson.
//
// Known engine gaps (outside tojson, which is exact): ardanlabs/jinja prints `{{ none }}` as ""
// (Python: "None") and floats in `{{ }}` with %g; integers beyond int64 are floats inside the
// template (tojson still prints their exact literal). Template whitespace control is resolved
// by this package with jinja2's lexer rules (see prepareTemplate), not by the engine.
//
// A *Tokenizer is immutable after Load and safe for concurrent use.
package tokenizer
