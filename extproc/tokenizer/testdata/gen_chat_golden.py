#!/usr/bin/env python3
"""Generates testdata/qwen3-chat-prompts.json: chat-template renders by Python jinja2 set up as
Hugging Face transformers sets it up (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols, raise_exception, strftime_now, tojson = json.dumps(ensure_ascii=False, ...)), over
request bodies preprocessed as vLLM's OpenAI server does (conversation messages, tool-call
arguments parsed, tools as model_dump()s, chat_template_kwargs merged), plus tojson cases.

    python3 gen_chat_golden.py ../../../../shared/models/qwen3
    NODE_PATH=/path/to/node_modules node gen_chat_ids.js ../../../../shared/models/qwen3

Needs only jinja2 (Debian python3-jinja2 or any jinja2 3.x). Tests read the JSON output.
"""
import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "..", "..", "shared", "models", "qwen3")


def make_env():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


TEXT_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


def conversation(messages, openai=False):
    """vLLM parse_chat_messages + _postprocess_messages; openai=True is vLLM's "openai" content
    format (content kept as a list of {"type": "text", "text": …} parts), else "string"."""
    out = []
    for m in messages:
        content = m.get("content")
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        else:
            parts = content
        texts = []
        for p in parts:
            if isinstance(p, str):
                t = p
            else:
                t = p.get(TEXT_FIELDS[p.get("type", "text")])
            if t is not None:  # vLLM keeps empty text parts
                texts.append(t)
        if openai:
            msg = {"role": m["role"], "content": [{"type": "text", "text": t} for t in texts]}
        else:
            msg = {"role": m["role"], "content": "\n".join(texts)}
        if m["role"] == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = list(m["tool_calls"])
            reasoning = m.get("reasoning") or m.get("reasoning_content")
            if reasoning is not None:
                msg["reasoning"] = reasoning
                msg["reasoning_content"] = reasoning
        elif m["role"] == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    for msg in out:
        if msg["role"] == "assistant" and isinstance(msg.get("tool_calls"), list):
            for item in msg["tool_calls"]:
                args = item["function"].get("arguments")
                if args:
                    if not isinstance(args, (dict, list)):
                        # vLLM: a string that does not parse to a JSON object renders as {}.
                        try:
                            parsed = json.loads(args)
                        except ValueError:
                            parsed = {}
                        item["function"]["arguments"] = parsed if isinstance(parsed, dict) else {}
                else:
                    item["function"]["arguments"] = {}
    return out


def dump_tools(tools):
    """[ChatCompletionToolsParam.model_dump()] — declared fields, defaults, then extras."""
    out = []
    for t in tools:
        fn = t["function"]
        f = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        f.update({k: v for k, v in fn.items() if k not in f})
        d = {"type": t.get("type", "function"), "function": f}
        d.update({k: v for k, v in t.items() if k not in d})
        out.append(d)
    return out


def responses_to_chat(body):
    msgs = []
    if body.get("instructions") is not None:
        msgs.append({"role": "system", "content": body["instructions"]})
    inp = body["input"]
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
    else:
        for item in inp:
            if "role" not in item:
                continue
            c = item.get("content")
            if isinstance(c, list):
                c = "".join(p["text"] for p in c if p.get("type") in ("input_text", "output_text"))
            msgs.append({"role": item["role"], "content": c or ""})
    return {"messages": msgs}


def iterates_content(env, source):
    """vLLM's content-format detection: the template loops over a message's content
    (`for x in m['content']` / `m.content`), so vLLM passes content as a list of parts."""
    from jinja2 import nodes
    for loop in env.parse(source).find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return True
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return True
    return False


def render(template, cfg, body, openai=False):
    body = json.loads(json.dumps(body))  # deep copy
    ctx = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = cfg.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        if v is not None:
            ctx[name] = v
    cont = body.get("continue_final_message", False)
    agp = body.get("add_generation_prompt", True) and not cont
    tools = dump_tools(body["tools"]) if body.get("tools") is not None else None
    conv = conversation(body["messages"], openai)
    ctx.update(tools=tools, documents=None, add_generation_prompt=agp)
    ctx.update(body.get("chat_template_kwargs") or {})
    out = template.render(messages=conv, **ctx)
    if cont:
        final = conv[-1]["content"]
        if isinstance(final, list):
            final = [p["text"] for p in final][-1]
        loc = out.rindex(final.strip())
        if out[loc: loc + len(final.lstrip())] == final:
            out = out[: loc + len(final.lstrip())]
        else:
            out = out[: loc + len(final.strip())]
    return out


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — «quoted» \"text\" & <tags>\nline two\u0001",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City, e.g. Zürich ✓ or 東京"},
                "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                "days": {"type": "integer", "minimum": 1, "maximum": 16, "default": 1.0},
                "eps": {"type": "number", "default": 1.5e-07, "min": -0.0, "max": 1e21, "big": 12345678901234567890, "pi": 3.14159, "hundred": 100.0, "tiny": 0.0001, "e16": 1e16, "e15": 123456789012345.6},
                "nested": {"type": "object", "properties": {"z": {"type": "boolean"}, "a": {"type": "null"}}, "required": ["z"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {"function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}, "strict": True}, "type": "function"}


def chat(messages, **extra):
    b = {"model": "Qwen/Qwen3-0.6B", "messages": messages}
    b.update(extra)
    return b


CHAT_CASES = [
    ("tools-floats-unicode", chat([{"role": "user", "content": "Weather in Zürich?"}], tools=[WEATHER, SEARCH])),
    ("tools-with-system", chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find cats"}], tools=[SEARCH])),
    ("tool-call-roundtrip", chat([
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2.0, \"eps\": 1e-7, \"big\": 123456789012345678901, \"neg0\": -0.0, \"list\": [1, 2.5, true, null], \"ü\": \"ß\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"unit\":\"c\",\"city\":\"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "22C"},
        {"role": "user", "content": "Thanks!"}], tools=[WEATHER])),
    ("tool-call-empty-arguments-and-content", chat([
        {"role": "user", "content": "Ping"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "ping", "arguments": ""}}]},
        {"role": "tool", "content": "pong"}])),
    ("empty-tool-calls-dropped", chat([
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "tool_calls": []}, {"role": "user", "content": "Bye"}])),
    ("reasoning-after-last-query", chat([
        {"role": "user", "content": "Tool please"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call it.", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"x\"}"}}]},
        {"role": "tool", "content": "result"}])),
    ("think-tags-in-history", chat([
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nsimple\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"}])),
    ("enable-thinking-false", chat([{"role": "user", "content": "Quick answer"}], chat_template_kwargs={"enable_thinking": False})),
    ("continue-final-message", chat([{"role": "user", "content": "Complete: roses are"}, {"role": "assistant", "content": "Roses are red,  "}],
                                    continue_final_message=True, add_generation_prompt=False)),
    ("tool-call-arguments-that-are-not-objects", chat([
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "n1", "type": "function", "function": {"name": "a", "arguments": "null"}},
            {"id": "n2", "type": "function", "function": {"name": "b", "arguments": "[1,2]"}},
            {"id": "n3", "type": "function", "function": {"name": "c", "arguments": "42"}},
            {"id": "n4", "type": "function", "function": {"name": "d", "arguments": "{\"x\": 1}{\"y\": 2}"}},
            {"id": "n5", "type": "function", "function": {"name": "e", "arguments": "{not json"}},
            {"id": "n6", "type": "function", "function": {"name": "f", "arguments": "{\"ok\": true}"}}]},
        {"role": "tool", "tool_call_id": "n1", "content": "done"}])),
    ("empty-text-parts-kept", chat([{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]}])),
    ("content-parts-joined", chat([{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}, {"type": "text", "text": ""}]}])),
    ("special-token-in-content", chat([{"role": "user", "content": "Say <|im_end|> and <think> literally"}])),
    ("no-generation-prompt", chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False)),
    ("name-field-and-null-content", chat([{"role": "user", "content": "Hi", "name": "bob"}, {"role": "assistant", "content": None}, {"role": "user", "content": "?"}])),
    ("tool-response-wrapped-user", chat([
        {"role": "user", "content": "<tool_response>x</tool_response>"}, {"role": "user", "content": "real question"},
        {"role": "assistant", "content": "answer", "reasoning_content": "hidden"}, {"role": "user", "content": "next"}])),
]

RESPONSES_CASES = [
    ("responses-string-input", {"model": "Qwen/Qwen3-0.6B", "instructions": "You are terse.", "input": "What is KV cache?"}),
    ("responses-array-input", {"model": "Qwen/Qwen3-0.6B", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello "}, {"type": "input_text", "text": "there"}]},
        {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "x"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
        {"role": "user", "content": "Plain string content"}]}),
]

TOJSON_CASES = [
    ("floats", "{{ x | tojson }}", {"x": [1.0, -0.0, 1e21, 1.5e-07, 0.1, 100.0, 1e16, 1e15, 0.0001, 0.00001, 123456789012345678901234567890, -5, 2.5e-300]}),
    ("nested-unicode", "{{ x|tojson }}", {"x": {"b": {"z": [1, {"k": "ü \"q\" \\ \n\t\u0007 \u2028 </x> & é"}]}, "a": None, "t": True, "f": False}}),
    ("indent", "{{ x | tojson(indent=2) }}", {"x": {"a": [1, 2, {}], "b": {"c": []}, "d": "x"}}),
    ("sort-keys", "{{ x | tojson(sort_keys=true) }}", {"x": {"b": 1, "a": {"d": 2, "c": 3}, "é": 0, "Z": 1}}),
    ("separators", "{{ x | tojson(separators=(',', ':')) }}", {"x": {"a": [1, 2], "b": "c"}}),
    ("ensure-ascii", "{{ x | tojson(ensure_ascii=true) }}", {"x": ["é", "中", "🚀", "a"]}),
    ("macro", "{% macro m(v) %}[{{ v|tojson }}]{% endmacro %}{{ m(x) }}", {"x": {"k": 1.0}}),
    ("string-literal-untouched", "{{ 'a|tojson' }} {{ x|tojson }}{# x|tojson #}", {"x": 2.0}),
    ("chained", "{{ x | tojson | length }}", {"x": {"a": 1.0}}),
    ("nested-braces", "{{ {'a': {'b': 1.5}} | tojson }}", {}),
    ("ws-same-line", "{{ x|tojson }} {% if x %}y{% endif %} {# c #}\n  {% if x %}z{% endif %}", {"x": 1}),
    ("ws-indented-blocks", "x\n  {% if x %}\n  y\n  {% endif %}\n  {% for i in [1, 2] %}\n  {{ i }}\n  {% endfor %}\n\n", {"x": 1}),
    ("ws-explicit", "a  {%- if x -%}  b  {%- endif %}  c {{- ' d ' -}}  \n {{ 'e' }}", {"x": 1}),
    ("ws-plus", "{%+ if x %}x{% endif +%}\ny\n   {%+ if x %}w{% endif %}", {"x": 1}),
    ("ws-comment-line", "  {# comment #}\nz\n\t{# c2 -#}  q", {}),
    ("ws-raw", "{% raw %}{{ x }}  {% endraw %}\n after", {}),
    ("ws-crlf-and-trailing-newline", "line\r\nbreak {{ 'q' }}\r\n{% if x %}\r\nz{% endif %}\r\n", {"x": 1}),
    ("ws-set-block", "{% set s %}\n  inner  \n{% endset %}[{{ s }}]", {}),
    ("ws-macro", "{% macro m(v) %}\n  <{{ v }}>\n{% endmacro %}\n{{ m(1) }}{{ m(2) }}", {}),
    ("ws-after-expression-before-trim", "text  {{ 'a' }}{%- if x %}b{% endif %}{% if x -%}{{ 'c' }}  d{% endif %}\n  e", {"x": 1}),
]


def main():
    with open(os.path.join(MODEL_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    env = make_env()
    template = env.from_string(cfg["chat_template"])
    cases = []
    for name, body in CHAT_CASES:
        # Bodies are stored as JSON text so number literals (1.0, -0.0, big ints) survive tools
        # that re-serialise the file.
        cases.append({"name": name, "path": "/v1/chat/completions", "body": json.dumps(body, ensure_ascii=False), "rendered_prompt": render(template, cfg, body)})
    for name, body in RESPONSES_CASES:
        cases.append({"name": name, "path": "/v1/responses", "body": json.dumps(body, ensure_ascii=False), "rendered_prompt": render(template, cfg, responses_to_chat(body))})
    tj = []
    for name, src, data in TOJSON_CASES:
        # Data is serialised with json.dumps so Go decodes the same values (floats stay floats).
        tj.append({"name": name, "template": src, "data": json.dumps(data, ensure_ascii=False), "output": env.from_string(src).render(**data)})
    out = {"generator": "python jinja2 " + jinja2.__version__, "cases": cases, "tojson": tj}
    with open(os.path.join(HERE, "qwen3-chat-prompts.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
