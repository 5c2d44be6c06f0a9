"""Qwen tool calls, by SGLang's names (python/sglang/srt/function_call/qwen25_detector.py,
qwen3_coder_detector.py):

- `qwen25` (alias `qwen`; Qwen2.5, Qwen3, Hermes-style JSON): ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>``; the content is the text before the first call,
  stripped;
- `qwen3_coder` (Qwen3-Coder, XML): ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n
  </parameter>\\n</function>\\n</tool_call>``; a value loses one leading and one trailing
  newline and is typed from the tool's schema (integers, numbers, booleans, objects and
  arrays read; strings and unknown parameters kept as text); the content is the text before
  the first call, as generated.

Text after the last call is dropped. Where SGLang 0.5.23 differs: a call that is not valid
JSON is skipped (qwen25), an unterminated call is parsed from what there is (qwen3_coder);
here both raise `Unparsed`.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from producer.parsers.base import (
    Call,
    ToolCallParser,
    Unparsed,
    json_object,
    name_and_arguments,
    schema_types,
)

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                        re.DOTALL)


def _blocks(parser: str, text: str) -> tuple[str, list[str]]:
    """(text before the first call, the bodies of the calls)."""
    at = text.find(START)
    bodies: list[str] = []
    rest = text[at:]
    while START in rest:
        after = rest.split(START, 1)[1]
        if END not in after:
            raise Unparsed(parser, f"call {len(bodies) + 1} is not terminated ({END})")
        body, rest = after.split(END, 1)
        bodies.append(body)
    return text[:at], bodies


class Qwen25(ToolCallParser):
    name = "qwen25"
    markers = (START,)

    def split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call]]:
        if not self.has_call(text):
            return text, []
        content, bodies = _blocks(self.name, text)
        calls = []
        for k, body in enumerate(bodies, 1):
            if not (body.startswith("\n") and body.endswith("\n")):
                raise Unparsed(self.name, f"call {k} is not <tool_call>\\n...\\n</tool_call>")
            raw = body.strip()
            call = name_and_arguments(json_object(raw, self.name, f"call {k}"), self.name,
                                      f"call {k}")
            calls.append(call)
        return content.strip(), calls


def _typed(value: str, kind: str) -> Any:
    """A Qwen3-Coder parameter value as its schema type says (SGLang's conversion)."""
    kind = kind.lower()
    if value.lower() == "null":
        return None
    if not kind or kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            return int(number) if number.is_integer() and not re.search(r"[.eE]", value) \
                else number
    except ValueError:
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    for read in (json.loads, ast.literal_eval):
        try:
            return read(value)
        except (ValueError, SyntaxError):
            continue
    return value


class Qwen3Coder(ToolCallParser):
    name = "qwen3_coder"
    markers = (START, "<function=")

    def split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call]]:
        if not self.has_call(text):
            return text, []
        if START not in text:
            raise Unparsed(self.name, "<function=...> outside a <tool_call>")
        content, bodies = _blocks(self.name, text)
        types = schema_types(tools)
        calls = []
        for k, body in enumerate(bodies, 1):
            found = _FUNCTION.search(body)
            if found is None or not found.group(1).strip():
                raise Unparsed(self.name, f"call {k}: no complete <function=NAME>...</function>")
            name = found.group(1).strip()
            params = types.get(name, {})
            args = {}
            for key, value in _PARAMETER.findall(found.group(2)):
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                args[key.strip()] = _typed(value, params.get(key.strip(), ""))
            calls.append(Call(name, args, json.dumps(args, ensure_ascii=False)))
        return content, calls
