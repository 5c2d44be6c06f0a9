"""GLM tool calls, by SGLang's names (python/sglang/srt/function_call/glm4_moe_detector.py,
glm47_moe_detector.py):

- `glm45` (alias `glm`; GLM-4.5, 4.6): ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n
  <arg_value>V</arg_value>\\n...</tool_call>``, a newline after the name;
- `glm47` (GLM-4.7): ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>
  </tool_call>``, no newline needed, a call without arguments allowed.

Values are typed from the tool's schema as SGLang does: a string parameter keeps the text
as written; others are read as JSON when they parse (a number given as ``"42"`` becomes 42),
else kept as text. The content is the text outside the calls, stripped: before the first
call (glm45) or around every call (glm47). Where SGLang 0.5.23 differs: an unterminated call,
or a glm45 call without the newline after its name, is skipped there (glm47 leaves it in the
content); here either raises `Unparsed`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from producer.parsers.base import Call, ToolCallParser, Unparsed, schema_types

START, END = "<tool_call>", "</tool_call>"
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?$")


def typed(raw: str, kind: str) -> Any:
    """An argument value read as the parameter's schema type says (module docstring)."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    if kind == "string":
        return value if isinstance(value, str) else raw
    if kind in ("integer", "number") and isinstance(value, str) and _NUMBER.match(value):
        if re.fullmatch(r"-?\d+", value):
            return int(value)
        if kind == "number":
            return float(value)
    return value


class Glm45(ToolCallParser):
    name = "glm45"
    markers = (START,)
    newline_after_name = True

    def split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call]]:
        if not self.has_call(text):
            return text, []
        types = schema_types(tools)
        calls: list[Call] = []
        outside: list[str] = []
        rest = text
        while START in rest:
            before, after = rest.split(START, 1)
            outside.append(before)
            if END not in after:
                raise Unparsed(self.name, f"call {len(calls) + 1} is not terminated ({END})")
            body, rest = after.split(END, 1)
            calls.append(self._call(body, types, len(calls) + 1))
        outside.append(rest)
        return self._content(outside), calls

    def _content(self, outside: list[str]) -> str:
        return outside[0].strip()

    def _call(self, body: str, types: dict[str, dict[str, str]], k: int) -> Call:
        at = body.find("<arg_key>")
        head = body if at < 0 else body[:at]
        if self.newline_after_name:
            m = re.match(r"^(.*?)(?:\\n|\n)", body, re.DOTALL)
            if m is None:
                raise Unparsed(self.name, f"call {k}: no newline after the function name")
            head = m.group(1)
        name = head.strip()
        if not name:
            raise Unparsed(self.name, f"call {k}: no function name")
        params = types.get(name, {})
        args = {key.strip(): typed(value, params.get(key.strip(), "")) for key, value in
                _ARG.findall(body)}
        return Call(name, args, json.dumps(args, ensure_ascii=False))


class Glm47(Glm45):
    name = "glm47"
    newline_after_name = False

    def _content(self, outside: list[str]) -> str:
        return "".join(outside).strip()
