#!/usr/bin/env python3
"""Generates family-chat-prompts.json: chat templates of the model families kvepp tokenizes
(templates/*.jinja: Llama 2 chat, Mistral v0.1 instruct, Phi-3, Gemma 2, Gemma 3 and DeepSeek V3
as their tokenizer_config.json files ship them, plus kvepp's features.jinja) rendered by Python
jinja2 configured as transformers configures it, over request bodies preprocessed as vLLM does
(gen_chat_golden.py's conversation/dump_tools/render). strftime_now is pinned to
2026-03-07 09:05:03 so the output is reproducible (the Go test pins its clock the same way).
Then gen_family_chat_ids.js adds token ids with the real tokenizers (fetch_models.sh).

    python3 gen_family_chat_golden.py
    NODE_PATH=/path/to/node_modules node gen_family_chat_ids.js /tmp/kvepp-tokenizer-models
"""
import json
import os
from datetime import datetime

import jinja2

import gen_chat_golden as g

HERE = os.path.dirname(os.path.abspath(__file__))
PINNED = datetime(2026, 3, 7, 9, 5, 3)

# family → (template file, tokenizer the ids come from, special tokens as tokenizer_config.json has them)
FAMILIES = {
    "llama2-chat": ("llama2-chat.jinja", "llama2", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "mistral-v0.1": ("mistral-v0.1.jinja", "llama2", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "phi3": ("phi3.jinja", "llama2", {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>", "pad_token": "<|endoftext|>"}),
    "gemma2": ("gemma2.jinja", "gemma3", {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"}),
    "gemma3": ("gemma3.jinja", "gemma3", {"bos_token": "<bos>", "eos_token": "<end_of_turn>", "unk_token": "<unk>", "pad_token": "<pad>"}),
    "deepseek-v3": ("deepseek-v3.jinja", "deepseek_v3", {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>", "pad_token": "<｜end▁of▁sentence｜>"}),
    "features": ("features.jinja", "llama2", {"bos_token": "<s>", "eos_token": "</s>"}),
}


def chat(messages, **extra):
    b = {"model": "m", "messages": messages}
    b.update(extra)
    return b


U = lambda c: {"role": "user", "content": c}
A = lambda c, **kw: dict({"role": "assistant", "content": c}, **kw)
S = lambda c: {"role": "system", "content": c}
CALLS = [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"days\": 2.0}"}},
    {"id": "c2", "type": "function", "function": {"name": "noop", "arguments": "null"}},
    {"id": "c3", "type": "function", "function": {"name": "bad", "arguments": "{broken"}},
]

COMMON = [
    ("single-user", chat([U("Hello there")])),
    ("multi-turn", chat([U("Hi! What is a KV cache?"), A("A cache of attention keys and values."), U("And why route by it?")])),
    ("whitespace-runs", chat([U("  leading and trailing   \n\n\twith\ttabs  and    runs   ")])),
    ("unicode-and-byte-fallback", chat([U("Zürich 東京 жизнь — «quotes» 🧪🚀👍🏽 𝔘 \u200b\u3000 ﬁ")])),
    ("special-tokens-typed-in-content", chat([U("<s>[INST] fake </s> <start_of_turn> <｜User｜> <|user|>")])),
    ("no-generation-prompt", chat([U("Hi"), A("Hello!")], add_generation_prompt=False)),
    ("empty-text-parts-kept", chat([U([{"type": "text", "text": "part one"}, {"type": "text", "text": ""}, {"type": "text", "text": "part two"}])])),
    ("roles-do-not-alternate", chat([U("one"), U("two")])),
]
WITH_SYSTEM = [
    ("system-prompt", chat([S("You are terse."), U("Explain BPE."), A("Merges."), U("More?")])),
]
TOOLS = [
    ("tool-call-roundtrip", chat([U("Weather?"), A(None, tool_calls=CALLS), {"role": "tool", "tool_call_id": "c1", "content": "18C"}, U("Thanks")],
                                 tools=[g.WEATHER, g.SEARCH])),
    ("tool-outputs", chat([U("Weather?"), A("", tool_calls=CALLS[:1]), {"role": "tool", "tool_call_id": "c1", "content": "18C"},
                           {"role": "tool", "tool_call_id": "c1", "content": "19C"}, A("It is mild.")])),
    ("reasoning-and-thinking-off", chat([U("2+2?"), A("<think>add</think>\n\n4", reasoning_content="\nadding\n"), U("3+3?")],
                                        chat_template_kwargs={"enable_thinking": False})),
]

CASES = {
    "llama2-chat": COMMON + WITH_SYSTEM,
    "mistral-v0.1": COMMON + [("system-role-refused", chat([S("sys"), U("hi")]))],
    "phi3": COMMON + WITH_SYSTEM,
    "gemma2": COMMON + [("system-role-refused", chat([S("sys"), U("hi")]))],
    "gemma3": COMMON + WITH_SYSTEM + [("system-content-parts", chat([S([{"type": "text", "text": "Sys in parts"}]), U("hi")]))],
    "deepseek-v3": COMMON + WITH_SYSTEM + TOOLS,
    "features": COMMON + WITH_SYSTEM + TOOLS,
}


def main():
    env = g.make_env()
    env.globals["strftime_now"] = lambda fmt: PINNED.strftime(fmt)
    out = {"generator": "python jinja2 " + jinja2.__version__, "pinned_now": PINNED.isoformat(), "families": {}}
    for fam, (tfile, tok, special) in FAMILIES.items():
        with open(os.path.join(HERE, "templates", tfile), encoding="utf-8") as f:
            src = f.read()
        template = env.from_string(src)
        openai = g.iterates_content(env, src)
        cases = []
        for name, body in CASES[fam]:
            c = {"name": name, "body": json.dumps(body, ensure_ascii=False)}
            try:
                c["rendered_prompt"] = g.render(template, special, body, openai)
            except Exception as e:  # raise_exception, or a TypeError over the request (vLLM: 400)
                c["error"] = type(e).__name__ + ": " + str(e)
            cases.append(c)
        out["families"][fam] = {"template": tfile, "tokenizer": tok, "special_tokens": special, "content_format": "openai" if openai else "string", "cases": cases}
    with open(os.path.join(HERE, "family-chat-prompts.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
