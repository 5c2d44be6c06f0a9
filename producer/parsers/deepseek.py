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

from producer.parsers.base import Call, ToolCallParser, Unparsed, json_object

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
        at = text.find(CALLS_BEGIN)
        if at < 0:
            raise Unparsed(self.name, f"{CALL_BEGIN} outside a {CALLS_BEGIN} section")
        content, section = text[:at].strip(), text[at + len(CALLS_BEGIN):]
        section = section.split(CALLS_END, 1)[0]
        calls = []
        for k, chunk in enumerate(section.split(CALL_BEGIN)[1:], 1):
            if CALL_END not in chunk:
                raise Unparsed(self.name, f"call {k} is not terminated ({CALL_END})")
            calls.append(self._call(chunk.split(CALL_END, 1)[0], k))
        if not calls:
            raise Unparsed(self.name, "a tool-call section without a call")
        return content, calls

    def _call(self, body: str, k: int) -> Call:
        raise NotImplementedError


class DeepSeekV3(_Sectioned):
    name = "deepseekv3"

    def _call(self, body: str, k: int) -> Call:
        if SEP not in body:
            raise Unparsed(self.name, f"call {k} has no {SEP}")
        _kind, rest = body.split(SEP, 1)
        m = _FENCED.match(rest)
        if m is None or not m["name"].strip():
            raise Unparsed(self.name, f"call {k} is not NAME\\n```json\\n...\\n```")
        raw = m["args"]
        return Call(m["name"].strip(), json_object(raw, self.name, f"call {k} arguments"), raw)


class DeepSeekV31(_Sectioned):
    name = "deepseekv31"

    def _call(self, body: str, k: int) -> Call:
        if SEP not in body:
            raise Unparsed(self.name, f"call {k} has no {SEP}")
        name, raw = body.split(SEP, 1)
        if not name.strip():
            raise Unparsed(self.name, f"call {k} has no function name")
        return Call(name.strip(), json_object(raw, self.name, f"call {k} arguments"), raw)


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
