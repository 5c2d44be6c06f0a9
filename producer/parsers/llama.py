"""Llama 3.x tool calls (SGLang's `llama3`, python/sglang/srt/function_call/
llama32_detector.py): JSON objects ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), separated by ``;``, after ``<|python_tag|>`` or as the whole reply when it
starts with ``{``. The content is the text before ``<|python_tag|>`` plus any text after the
calls. A turn ends on ``<|eot_id|>``, or ``<|eom_id|>`` after a call (SGLang adds it to the
stop ids when the vocabulary has it).

Where SGLang 0.5.23 differs: an object that does not parse after ``<|python_tag|>`` is
skipped (scanning resumes at the next ``{"name":``); here it raises `Unparsed`. A reply that
merely starts with ``{`` and is not a call object is content, as in SGLang.
"""

from __future__ import annotations

import json

from producer.parsers.base import Call, ToolCallParser, Unparsed, name_and_arguments

PYTHON_TAG = "<|python_tag|>"


class Llama3(ToolCallParser):
    name = "llama3"
    markers = (PYTHON_TAG,)
    end_tokens = ("<|eom_id|>",)

    def has_call(self, text: str) -> bool:
        return PYTHON_TAG in text or text.startswith("{")

    def split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call]]:
        if PYTHON_TAG in text:
            content, body = text.split(PYTHON_TAG, 1)
            calls, tail = self._objects(body.replace(PYTHON_TAG, ";"), strict=True)
            return content + tail.strip(), calls
        if text.startswith("{"):
            try:
                calls, tail = self._objects(text, strict=True)
            except Unparsed:
                return text, []
            return tail.strip(), calls
        return text, []

    def _objects(self, body: str, strict: bool) -> tuple[list[Call], str]:
        decoder = json.JSONDecoder()
        calls: list[Call] = []
        at = 0
        while True:
            while at < len(body) and body[at] in " \n\t;":
                at += 1
            if at >= len(body) or body[at] != "{":
                break
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError as exc:
                raise Unparsed(self.name, f"call {len(calls) + 1}: invalid JSON ({exc.msg})"
                               ) from None
            if not isinstance(obj, dict) or "name" not in obj:
                raise Unparsed(self.name, f"call {len(calls) + 1}: not a {{\"name\", "
                               "\"parameters\"}} object")
            calls.append(name_and_arguments(obj, self.name, f"call {len(calls) + 1}"))
            at = end
        if strict and not calls:
            raise Unparsed(self.name, f"{PYTHON_TAG} without a call")
        return calls, body[at:]
