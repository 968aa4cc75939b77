// Package tokenizer turns OpenAI-style request bodies into exactly the token ids a vLLM/SGLang
// engine computes for them, in process (epp.md §5.4 `local` mode, tokenizer.md).
//
// Its pipeline, stage by stage (each stage is its own type so later work can reuse or cache any
// of them):
//
//  1. request → chat input (request.go, chat.go): an order-keeping JSON decode (jsonvalue.go),
//     vLLM's preprocessing (content format, empty parts kept, tool-call arguments, tools as
//     model_dump()s, images marked for routing by their text prefix, images.go).
//  2. chat input → prompt text: the chat template through github.com/ardanlabs/jinja configured
//     like transformers' jinja2 (template.go resolves whitespace control with jinja2's lexer
//     rules; tojson.go is a Python-exact tojson; strftime.go a Python-exact strftime_now). For
//     templates proven to print message contents verbatim (splicedTemplates, by source digest:
//     Qwen3's system/user/tool conversations, Phi-3), splice.go renders a conversation's shape
//     once with stand-in contents and splices the real contents into it, byte-identical to the
//     full render; anything else renders in full.
//  3. prompt text → ids (tokenizer.go): added tokens matched leftmost-longest in the raw text with
//     their flags (added.go); the normalizer per segment between them (pipeline.go,
//     sentencepiece.go: NFC/NFD/NFKC/NFKD, Lowercase, Prepend, Replace, Strip); pre-tokenizers
//     (Split/ByteLevel/Digits with hand-written scanners for the Qwen2, Llama 3 and GPT-2
//     patterns and regexp2 as the general fallback; Metaspace); BPE (bpe.go) over GPT-2
//     byte-level symbols or, for SentencePiece-style models, characters with byte fallback,
//     cut at "▁" where no merge crosses so pieces hit the bounded piece cache; the
//     post-processor for add_special_tokens, rewritten from tokenizer_config.json's
//     add_bos_token/add_eos_token for the transformers classes that do so (config.go).
//  4. ids → text (decoder.go): the decoder chain, for /detokenize.
//  5. conversations, incrementally (convcache.go): a ConversationCache keeps the ids of a
//     conversation prefix ending at a user message, keyed by the exact bytes of those messages and
//     of the rest of the rendering's context; the next turn renders only its tail and encodes only
//     the new text, for templates proven prefix-stable (provenTemplates, by source digest) and at
//     token boundaries no added token can straddle, else from scratch — the ids are always the
//     from-scratch ids. PrefixMemo keeps the prefix's block hashes for the picker.
//
// A body is read through a Request: ParseRequest validates it and splits its top-level members
// (internal/jsonscan), RequestFromMembers takes the members a caller already scanned (the ext_proc
// server does, so a body is parsed once, epp.md §13.5); only the members a tokenization needs are
// decoded.
//
// Load also resolves nothing over the network: ResolveDir finds tokenizer files in a Hugging
// Face cache. The vllmrender subpackage is the other tokenizer: the model server's render
// endpoint.
//
// Known engine gaps (outside tojson and strftime_now, which kvepp supplies): ardanlabs/jinja
// prints `{{ none }}` as "" (Python: "None") and floats in `{{ }}` with %g; integers beyond
// int64 are floats inside the template (tojson still prints their exact literal). Its own
// strftime_now rewrites literal text that looks like a Go layout and lacks %j, %-d, %e; its
// filters cannot be replaced, so `|tojson` is renamed during template preparation.
//
// Bounds for hostile bodies (none changes the ids of real text): one decode builds at most
// MaxJSONValues values; a chat template's str.split call sites at most MaxTemplateSplitValues
// (templatebudget.go, checked before rendering); a prompt has at most MaxPromptTokens ids
// (encoding stops past it); and a pre-tokenized piece longer than MaxExactPieceBytes is not run
// through BPE (longpiece.go) — exact prefix, the rest uncached, as after an image: the ids before
// it are exact, its ids a counted estimate (an exact sample's ids per byte, at least bytes ÷ the
// longest token), and ChatPrompt.UncachedFrom marks where the estimate starts. The APIs that
// promise exact ids (TokenizeChat, TokenizeCompletion, TokenizeResponses) refuse such a prompt.
// The added-token split stops after MaxAddedTokenSegments segments, the rest estimated likewise;
// InexactPieces counts the pieces.
//
// A *Tokenizer is immutable after Load and safe for concurrent use.
package tokenizer
