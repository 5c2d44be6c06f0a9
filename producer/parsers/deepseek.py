"""DeepSeek tool calls, by SGLang's names (python/sglang/srt/function_call/
deepseekv3_detector.py, deepseekv31_detector.py, deepseekv32_detector.py):

- `deepseekv3` (V3, R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \\n```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``;
- `deepseekv31` (V3.1): ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`` in the
  same section;
- `deepseekv32` (V3.2, "DSML"): ``<｜DSML｜function_calls>`` holding
  ``<｜DSML｜invoke name="NAME">`` with ``<｜DSML｜parameter name="K" string="true|false">V
  </｜DSML｜parameter>`` (a JSON object as the invoke's body is taken as the arguments).

The content is the text before the section, stripped (v3, v31), or with one trailing blank
line cut (v32); text after the section is dropped. Where SGLang 0.5.23 differs: invalid JSON
makes it hand the whole raw text back as content (v3, v31) or drop the invoke (v32); an
unterminated call is ignored. Here both raise `Unparsed`.
"""

from __future__ import annotations

import json
import re

from producer.parsers.base import Call, ToolCallParser, Unparsed, json_object, section_calls

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
DSML = "\uff5cDSML\uff5c"
BLOCK_BEGIN = f"<{DSML}function_calls>"
BLOCK_END = f"</{DSML}function_calls>"
_FENCED = re.compile(r"^(?P<name>.*?)\n```json\n(?P<args>.*)\n```$", re.DOTALL)
_INVOKE = re.compile(rf"<{DSML}invoke\s+name=\"(?P<name>[^\"]+)\"\s*(?:/>|>(?P<body>.*?)"
                     rf"</{DSML}invoke>)", re.DOTALL)
_PARAM = re.compile(rf"<{DSML}parameter\s+name=\"(?P<key>[^\"]+)\"(?:\s+string=\"(?P<str>"
                    rf"true|false)\")?\s*>(?P<value>.*?)</{DSML}parameter>", re.DOTALL)


class _Sectioned(ToolCallParser):
    """The V3 / V3.1 section: calls between CALL_BEGIN and CALL_END."""

    markers = (CALLS_BEGIN, CALL_BEGIN)

    def split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call]]:
        if not self.has_call(text):
            return text, []
        content, calls = section_calls(text, self.name, CALLS_BEGIN, CALLS_END, CALL_BEGIN,
                                       CALL_END, self._call)
        return content.strip(), calls

    def _call(self, body: str, k: int) -> Call:
        """Call k: what stands before SEP and after it (`_name_and_arguments`)."""
        if SEP not in body:
            raise Unparsed(self.name, f"call {k} has no {SEP}")
        before, after = body.split(SEP, 1)
        name, raw = self._name_and_arguments(before, after, k)
        return Call(name, json_object(raw, self.name, f"call {k} arguments"), raw)

    def _name_and_arguments(self, before: str, after: str, k: int) -> tuple[str, str]:
        """(the function's name, its arguments' JSON) of call k, split at SEP."""
        raise NotImplementedError


class DeepSeekV3(_Sectioned):
    name = "deepseekv3"

    def _name_and_arguments(self, before: str, after: str, k: int) -> tuple[str, str]:
        m = _FENCED.match(after)  # `before` is the call's kind ("function")
        if m is None or not m["name"].strip():
            raise Unparsed(self.name, f"call {k} is not NAME\\n```json\\n...\\n```")
        return m["name"].strip(), m["args"]


class DeepSeekV31(_Sectioned):
    name = "deepseekv31"

    def _name_and_arguments(self, before: str, after: str, k: int) -> tuple[str, str]:
        if not before.strip():
            raise Unparsed(self.name, f"call {k} has no function name")
        return before.strip(), after


class DeepSeekV32(ToolCallParser):
    name = "deepseekv32"
    markers = (BLOCK_BEGIN, f"<{DSML}invoke")

    def split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call]]:
        if not self.has_call(text):
            return text, []
        at = text.find(BLOCK_BEGIN)
        if at < 0 or BLOCK_END not in text[at:]:
            raise Unparsed(self.name, f"no complete {BLOCK_BEGIN} ... {BLOCK_END} block")
        content = text[:at]
        content = content[:-2] if content.endswith("\n\n") else content
        block = text[at + len(BLOCK_BEGIN):text.index(BLOCK_END, at)]
        calls = []
        invokes = list(_INVOKE.finditer(block))
        leftover = _INVOKE.sub("", block)
        if DSML in leftover or not invokes:
            raise Unparsed(self.name, "an invoke that does not parse (unterminated, or no name)")
        for k, m in enumerate(invokes, 1):
            calls.append(self._call(m["name"], m["body"] or "", k))
        return content, calls

    def _call(self, name: str, body: str, k: int) -> Call:
        if body.strip().startswith("{"):
            raw = body.strip()
            return Call(name, json_object(raw, self.name, f"call {k} arguments"), raw)
        args: dict = {}
        for p in _PARAM.finditer(body):
            value = p["value"]
            if p["str"] == "true":
                args[p["key"]] = value.strip()
                continue
            try:
                args[p["key"]] = json.loads(value)
            except json.JSONDecodeError:
                args[p["key"]] = value.strip()
        if _PARAM.sub("", body).strip():
            raise Unparsed(self.name, f"call {k}: text in the invoke besides its parameters")
        return Call(name, args, json.dumps(args, ensure_ascii=False))
