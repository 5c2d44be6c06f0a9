"""What every reply parser shares: the parsed call, the error of a reply that does not parse,
the two interfaces, and the `<think>`-tag reasoning split most families use.

A reasoning parser splits a decoded turn into (reasoning, the rest); a tool-call parser
splits the rest into (content, calls). Both work on the text decoded with special tokens
kept and the final end-of-turn token cut (`producer.reply_parser`), and follow SGLang 0.5.23's
parser of the same name (python/sglang/srt/parser/reasoning_parser.py,
python/sglang/srt/function_call/*_detector.py) except where a module docstring says why not.
The one rule common to all of them where SGLang differs: markup that starts a tool call but
does not parse (bad JSON, an unterminated call, a call with no name) raises `Unparsed`
instead of being dropped or handed back as content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

from foundation.errors import TokencapError


class Call(NamedTuple):
    """One tool call of a reply: the function's name, its arguments as an object (as SGLang
    and vLLM hand them to a chat template), and the arguments' text as the model wrote it
    (for templates that write arguments as a string), when it wrote JSON."""

    name: str
    arguments: dict[str, Any]
    raw_arguments: str | None = None


class Unparsed(TokencapError, ValueError):
    """A reply whose tool-call markup does not parse. Its turn stays as generated; the
    conversation cannot go on from it (there is no call to answer and no content to show)."""

    def __init__(self, parser: str, reason: str) -> None:
        super().__init__(f"{parser}: {reason}")
        self.parser = parser
        self.reason = reason


class ReasoningParser:
    """Splits off the reasoning of a turn (`split`)."""

    name = ""
    start = "<think>"
    end = "</think>"
    # a tool call that starts before `end` ends the reasoning there (SGLang's
    # tool_start_token); the marker stays in the rest, for the tool-call parser
    interrupt: str | None = None
    # reasoning is assumed to have started even without `start` (DeepSeek-R1's parser)
    forced = False

    def split(self, text: str, opened: bool = False) -> tuple[str | None, str]:
        """(reasoning or None, the rest). `opened`: the prompt ended inside a reasoning
        block (its generation prompt opened one), so a turn without `start` is reasoning
        from its first token, and one cut before `end` is all reasoning. No whitespace is
        trimmed (SGLang 0.5.23: test_parse_non_stream_preserves_payload_whitespace)."""
        if not (self.forced or opened or self.start in text):
            return None, text
        rest = text
        while rest.startswith(self.start):
            rest = rest[len(self.start):]
        if self.end in rest:
            reasoning, content = rest.split(self.end, 1)
            return reasoning, content
        if self.interrupt and self.interrupt in rest:
            at = rest.find(self.interrupt)
            return rest[:at], rest[at:]
        return rest, ""


class ToolCallParser:
    """Splits the calls out of a turn (`split`)."""

    name = ""
    # any of these in a turn means the model began a call
    markers: tuple[str, ...] = ()
    # tokens that end a turn of this family besides the model's eos ids (gpt-oss stops on
    # <|call|>, Llama 3 on <|eom_id|> after a call): also sent as stop ids
    end_tokens: tuple[str, ...] = ()
    # ids of the calls: "kimi" (functions.NAME:IDX over the whole history, SGLang's
    # serving_chat for kimi_k2) or "call" (call_<24 hex>, SGLang's default)
    id_style = "call"

    def has_call(self, text: str) -> bool:
        return any(m in text for m in self.markers)

    def split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call]]:
        """(content, calls); raises `Unparsed` when a call was begun and does not parse."""
        raise NotImplementedError


def json_object(text: str, parser: str, what: str) -> dict[str, Any]:
    """`text` parsed as a JSON object, or `Unparsed`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Unparsed(parser, f"{what}: invalid JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(value, dict):
        raise Unparsed(parser, f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def section_calls(text: str, parser: str, begin: str, end: str, call_begin: str,
                  call_end: str, call: Callable[[str, int], Call]) -> tuple[str, list[Call]]:
    """A turn whose calls stand in one section (DeepSeek V3 / V3.1, Kimi-K2): (the text
    before the section, `call(body, k)` for the body of each call k = 1, 2, ... between
    `call_begin` and `call_end`). The section runs from `begin` to `end` or the text's end;
    what follows it is dropped. `Unparsed`: a call begun outside a section, one not
    terminated, or a section without a call."""
    at = text.find(begin)
    if at < 0:
        raise Unparsed(parser, f"{call_begin} outside a {begin} section")
    section = text[at + len(begin):].split(end, 1)[0]
    calls = []
    for k, chunk in enumerate(section.split(call_begin)[1:], 1):
        if call_end not in chunk:
            raise Unparsed(parser, f"call {k} is not terminated ({call_end})")
        calls.append(call(chunk.split(call_end, 1)[0], k))
    if not calls:
        raise Unparsed(parser, "a tool-call section without a call")
    return text[:at], calls


def name_and_arguments(obj: dict[str, Any], parser: str, what: str) -> Call:
    """A `{"name", "arguments"}` (or `"parameters"`) object as a `Call` (SGLang's
    parse_base_json accepts both keys); arguments given as a JSON string are parsed."""
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise Unparsed(parser, f"{what}: no function name")
    args = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(args, str):
        args = json_object(args, parser, f"{what} arguments") if args.strip() else {}
    if not isinstance(args, dict):
        raise Unparsed(parser, f"{what}: arguments are not an object")
    return Call(name, args, json.dumps(args, ensure_ascii=False))


def schema_types(tools: list[dict] | None) -> dict[str, dict[str, str]]:
    """function name -> {parameter: JSON schema type} of the tools offered."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        types: dict[str, str] = {}
        for key, spec in (props or {}).items():
            kind = spec.get("type", "") if isinstance(spec, dict) else ""
            types[key] = kind if isinstance(kind, str) else str(kind)
        out[fn["name"]] = types
    return out
