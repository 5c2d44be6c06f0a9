"""Kimi-K2 / K2.5 tool calls (SGLang's `kimi_k2`, python/sglang/srt/function_call/
kimik2_detector.py):

``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
{json}<|tool_call_end|>...<|tool_calls_section_end|>``

The content is the text before the section, as generated (not stripped); text after it is
dropped. The name comes from the call id (``functions.NAME:IDX`` or ``NAME:IDX``); a bare
counter (``0``) names the one tool offered, or the tool whose parameters the arguments fit
best. The model's own IDX is not kept: the call gets the id SGLang's server gives it,
``functions.NAME:N`` with N counted over every call of the conversation so far
(`producer.reply_parser`).

Where SGLang 0.5.23 differs: its non-greedy match lets a call with broken JSON swallow the
next call, and it skips a call whose id names no function; here either raises `Unparsed`.
"""

from __future__ import annotations

import re

from producer.parsers.base import (
    Call,
    ToolCallParser,
    Unparsed,
    json_object,
    schema_types,
    section_calls,
)

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")


class KimiK2(ToolCallParser):
    name = "kimi_k2"
    markers = (SECTION_BEGIN, CALL_BEGIN)
    id_style = "kimi"

    def split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call]]:
        if not self.has_call(text):
            return text, []

        def call(body: str, k: int) -> Call:
            if ARGUMENT_BEGIN not in body:
                raise Unparsed(self.name, f"call {k} has no {ARGUMENT_BEGIN}")
            call_id, raw = (part.strip() for part in body.split(ARGUMENT_BEGIN, 1))
            args = json_object(raw, self.name, f"call {k} arguments")
            return Call(self._name(call_id, args, tools, k), args, raw)

        return section_calls(text, self.name, SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END,
                             call)

    def _name(self, call_id: str, args: dict, tools: list[dict] | None, k: int) -> str:
        m = _ID.match(call_id)
        if m:
            return m["name"]
        if call_id.isdigit():
            types = schema_types(tools)
            if len(types) == 1:
                return next(iter(types))
            overlap = {n: len(set(args) & set(p)) for n, p in types.items()}
            best = max(overlap.values(), default=0)
            fits = [n for n, v in overlap.items() if v == best and v > 0]
            if len(fits) == 1:
                return fits[0]
        raise Unparsed(self.name, f"call {k}: its id {call_id!r} names no function")
