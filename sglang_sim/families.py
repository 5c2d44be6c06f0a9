"""What a model of each family writes: its reasoning block, its tool-call syntax, its end of
turn (``--family NAME``, SGLang's parser names). The simulator has no model: these write a
turn's text from words the caller draws, in the syntax a real model of the family emits, so
that a client decoding and parsing turns (a conversation regenerated turn by turn) meets
each family's grammar.

- qwen3: ``<think>\n..\n</think>\n\n``, calls ``<tool_call>\n{json}\n</tool_call>``, then
  ``<|im_end|>``; qwen25 the same without reasoning; qwen3_coder calls
  ``<tool_call>\n<function=F>\n<parameter=k>\nv\n</parameter>..``;
- kimi_k2: ``..</think>`` (the prompt opened the block), calls in a
  ``<|tool_calls_section_begin|>`` section with ids ``functions.F:IDX``, then ``<|im_end|>``;
- deepseek-r1: ``<think>\n..\n</think>\n\n``, calls ``<｜tool▁calls▁begin｜>..function
  <｜tool▁sep｜>F\n```json\n{json}\n```..``, then ``<｜end▁of▁sentence｜>``; deepseekv3 the
  same without reasoning; deepseekv31 ``..</think>`` (opened by the prompt) and calls
  ``<｜tool▁call▁begin｜>F<｜tool▁sep｜>{json}<｜tool▁call▁end｜>``; deepseekv32 the same
  reasoning and DSML calls ``<｜DSML｜function_calls>`` .. ``<｜DSML｜invoke name="F">``;
- glm45: ``<think>..</think>``, calls ``<tool_call>F\n<arg_key>k</arg_key>\n<arg_value>v
  </arg_value>..``, then ``<|user|>`` (after a call ``<|observation|>``); glm47 the same
  calls without newlines;
- gpt-oss: ``<|channel|>analysis<|message|>..<|end|>``, then a final message ended by
  ``<|return|>`` or a call ``<|channel|>commentary to=functions.F <|constrain|>json
  <|message|>{json}`` ended by ``<|call|>``;
- llama3: no reasoning, calls ``{"name": F, "parameters": {..}}``, then ``<|eot_id|>``.

The tools come from the prompt: JSON function schemas anywhere in it (most templates write
them as JSON), or gpt-oss's and Kimi's TypeScript-like declarations. A turn calls one tool
when tools are offered and the last message is the user's; after a tool result it answers
in words. Reasoning is written unless the prompt closed it (``enable_thinking = false``,
``thinking = false``: an empty think block at its end).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any, NamedTuple

ARG_VALUES: dict[str, Any] = {"integer": 3, "number": 2.5, "boolean": True, "array": [1, 2],
                              "object": {}}
_TS_TOOL = re.compile(r"type (\w+) = \((?:_: \{(.*?)\})?\) => any;", re.DOTALL)
_TS_FIELD = re.compile(r"^\s*(\w+)(\??): (\w+)", re.MULTILINE)
_XML_TOOL = re.compile(r"<function>\n<name>([^<]+)</name>(.*?)</function>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter>\n<name>([^<]+)</name>\n<type>([^<]+)</type>")
_XML_REQUIRED = re.compile(r"<required>(.*?)</required>")


class Tool(NamedTuple):
    name: str
    args: dict[str, Any]


class Turn(NamedTuple):
    """What one turn holds before it is written: its reasoning words, its answer words, the
    call it makes (or None), how many calls the prompt already holds, and whether the prompt
    opened the reasoning block (then the turn does not write ``<think>`` itself)."""

    reasoning: str | None
    words: str
    call: Tool | None
    calls_before: int
    opened: bool = False


def _think(t: Turn, open_tag: str, close_tag: str) -> str:
    if not t.reasoning:
        return ""
    return f"{t.reasoning}{close_tag}" if t.opened else f"{open_tag}{t.reasoning}{close_tag}"


def tools_in(prompt: str, rng: random.Random, words: list[str]) -> list[Tool]:
    """The tools a prompt offers, each with an argument for each required parameter."""
    found: dict[str, Tool] = {}
    decoder = json.JSONDecoder()
    at = prompt.find("{")
    while at >= 0:
        try:
            obj, end = decoder.raw_decode(prompt, at)
        except json.JSONDecodeError:
            at = prompt.find("{", at + 1)
            continue
        for schema in obj if isinstance(obj, list) else [obj]:
            fn = schema.get("function", schema) if isinstance(schema, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str) and (
                    "parameters" in fn or "description" in fn):
                found.setdefault(fn["name"], Tool(fn["name"], _args(fn, rng, words)))
        at = prompt.find("{", end)
    for name, body in _XML_TOOL.findall(prompt):  # Qwen3-Coder's declarations
        listed = _XML_REQUIRED.search(body)
        required = set(re.findall(r"`(\w+)`", listed.group(1))) if listed else set()
        args = {p: ARG_VALUES.get(t, rng.choice(words)) for p, t in _XML_PARAM.findall(body)
                if p in required}
        found.setdefault(name, Tool(name, args))
    for name, body in _TS_TOOL.findall(prompt):
        args = {k: ARG_VALUES.get({"number": "number", "boolean": "boolean"}.get(t, t),
                                  rng.choice(words)) for k, opt, t in _TS_FIELD.findall(body)
                if not opt}
        found.setdefault(name, Tool(name, args))
    return list(found.values())


def _args(fn: dict[str, Any], rng: random.Random, words: list[str]) -> dict[str, Any]:
    params = fn.get("parameters") or {}
    props = params.get("properties") or {} if isinstance(params, dict) else {}
    required = params.get("required") or list(props) if isinstance(params, dict) else []
    args = {}
    for name in required:
        spec = props.get(name) if isinstance(props, dict) else None
        kind = spec.get("type", "string") if isinstance(spec, dict) else "string"
        args[name] = ARG_VALUES.get(kind, rng.choice(words)) if isinstance(kind, str) \
            else rng.choice(words)
    return args


class Family(NamedTuple):
    """One family's grammar: how its prompts mark the last user turn and a tool result, how
    an open or closed reasoning block ends a prompt, and how a turn is written."""

    name: str
    user: str
    tool_result: str
    write: Callable[[Turn], tuple[str, str]]  # -> (text, name of its end-of-turn token)
    closed: tuple[str, ...] = ()  # the generation prompt ends with one: no reasoning
    reasons: bool = True
    only_opened: bool = False  # it reasons only when the prompt opens the block


def _qwen_json(call: Tool) -> str:
    body = json.dumps({"name": call.name, "arguments": call.args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _qwen3(t: Turn) -> tuple[str, str]:
    head = _think(t, "<think>\n", "\n</think>\n\n")
    return head + (_qwen_json(t.call) if t.call else t.words), "<|im_end|>"


def _qwen25(t: Turn) -> tuple[str, str]:
    return (_qwen_json(t.call) if t.call else t.words), "<|im_end|>"


def _qwen3_coder(t: Turn) -> tuple[str, str]:
    if t.call is None:
        return t.words, "<|im_end|>"
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n"
                     "</parameter>\n" for k, v in t.call.args.items())
    return (f"<tool_call>\n<function={t.call.name}>\n{params}</function>\n</tool_call>",
            "<|im_end|>")


def _kimi(t: Turn) -> tuple[str, str]:
    head = _think(t, "<think>", "</think>")
    if t.call is None:
        return head + t.words, "<|im_end|>"
    args = json.dumps(t.call.args, ensure_ascii=False)
    return (head + "<|tool_calls_section_begin|><|tool_call_begin|>functions."
            f"{t.call.name}:{t.calls_before}<|tool_call_argument_begin|>{args}"
            "<|tool_call_end|><|tool_calls_section_end|>"), "<|im_end|>"


def _deepseek_v3_call(call: Tool) -> str:
    args = json.dumps(call.args, ensure_ascii=False)
    return ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            f"{call.name}\n```json\n{args}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def _deepseek_r1(t: Turn) -> tuple[str, str]:
    head = _think(t, "<think>\n", "\n</think>\n\n")
    return head + (_deepseek_v3_call(t.call) if t.call else t.words), "<｜end▁of▁sentence｜>"


def _deepseek_v3(t: Turn) -> tuple[str, str]:
    return (_deepseek_v3_call(t.call) if t.call else t.words), "<｜end▁of▁sentence｜>"


def _deepseek_v31(t: Turn) -> tuple[str, str]:
    head = _think(t, "<think>", "</think>")
    if t.call is None:
        return head + t.words, "<｜end▁of▁sentence｜>"
    args = json.dumps(t.call.args, ensure_ascii=False)
    return (head + f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{t.call.name}<｜tool▁sep｜>"
            f"{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), "<｜end▁of▁sentence｜>"


def _deepseek_v32(t: Turn) -> tuple[str, str]:
    head = _think(t, "<think>", "</think>")
    if t.call is None:
        return head + t.words, "<｜end▁of▁sentence｜>"
    params = "".join(
        f'<｜DSML｜parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f'{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜parameter>\n'
        for k, v in t.call.args.items())
    return (f'{head}\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="{t.call.name}">\n'
            f"{params}</｜DSML｜invoke>\n</｜DSML｜function_calls>"), "<｜end▁of▁sentence｜>"


def _glm(sep: str) -> Callable[[Turn], tuple[str, str]]:
    def write(t: Turn) -> tuple[str, str]:
        head = _think(t, "<think>", "</think>")
        if t.call is None:
            return f"{head}\n{t.words}", "<|user|>"
        args = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>"
                       f"{v if isinstance(v, str) else json.dumps(v)}</arg_value>{sep}"
                       for k, v in t.call.args.items())
        return f"{head}\n<tool_call>{t.call.name}{sep}{args}</tool_call>", "<|observation|>"
    return write


def _gpt_oss(t: Turn) -> tuple[str, str]:
    head = f"<|channel|>analysis<|message|>{t.reasoning}<|end|><|start|>assistant" \
        if t.reasoning else ""
    if t.call is None:
        return f"{head}<|channel|>final<|message|>{t.words}", "<|return|>"
    args = json.dumps(t.call.args, ensure_ascii=False)
    return (f"{head}<|channel|>commentary to=functions.{t.call.name} <|constrain|>json"
            f"<|message|>{args}"), "<|call|>"


def _llama3(t: Turn) -> tuple[str, str]:
    if t.call is None:
        return t.words, "<|eot_id|>"
    return json.dumps({"name": t.call.name, "parameters": t.call.args}), "<|eot_id|>"


_QWEN = dict(user="<|im_start|>user", tool_result="<tool_response>",
             closed=("<think>\n\n</think>\n\n",))
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", write=_qwen3, **_QWEN),  # type: ignore[arg-type]
    Family("qwen25", write=_qwen25, reasons=False, **_QWEN),  # type: ignore[arg-type]
    Family("qwen3_coder", write=_qwen3_coder, reasons=False, **_QWEN),  # type: ignore[arg-type]
    Family("kimi_k2", "<|im_user|>", "## Return of", _kimi, closed=("<think></think>",),
           only_opened=True),
    Family("deepseek-r1", "<｜User｜>", "<｜tool▁output▁begin｜>", _deepseek_r1),
    Family("deepseekv3", "<｜User｜>", "<｜tool▁output▁begin｜>", _deepseek_v3, reasons=False),
    Family("deepseekv31", "<｜User｜>", "<｜tool▁output▁begin｜>", _deepseek_v31,
           closed=("</think>",), only_opened=True),
    Family("deepseekv32", "<｜User｜>", "<function_results>", _deepseek_v32,
           closed=("</think>",), only_opened=True),
    Family("glm45", "<|user|>", "<|observation|>", _glm("\n"), closed=("<think></think>",)),
    Family("glm47", "<|user|>", "<|observation|>", _glm(""), closed=("<think></think>",)),
    Family("gpt-oss", "<|start|>user", "<|start|>functions.", _gpt_oss),
    Family("llama3", "<|start_header_id|>user", "<|start_header_id|>ipython", _llama3,
           reasons=False),
)}


def turn(family: Family, prompt: str, rng: random.Random, words: list[str], n_words: int
         ) -> Turn:
    """The content of one turn of `family` answering `prompt` (module docstring)."""
    def say(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, n)))

    tail = prompt.rstrip()
    closed = any(prompt.endswith(c) or tail.endswith(c.rstrip()) for c in family.closed)
    opened = tail.endswith("<think>") and not closed
    reasoning = None
    if family.reasons and not closed and (opened or not family.only_opened):
        half = max(1, n_words // 2)
        reasoning, n_words = say(half), max(1, n_words - half)
    call = None
    tools = tools_in(prompt, rng, words)
    if tools and prompt.rfind(family.tool_result) < prompt.rfind(family.user):
        call = rng.choice(tools)
    return Turn(reasoning, say(n_words), call, prompt.count("<|tool_call_begin|>"), opened)
