"""How a generated turn enters the history: output ids -> the assistant message.

With ``turns = "all"`` the prompt of turn j+1 holds the model's own turns 1..j. A chat server
(SGLang's ``/v1/chat/completions``) would hand each generated turn back as an assistant
message, and the client would send it in the next request's history, where the chat template
renders it. `ReplyParser.message` builds that message from the output ids, as SGLang does:

1. the final stop token (end of turn) is cut, as SGLang's detokenizer trims a matched stop
   token, and the rest is decoded, special tokens skipped unless the conversation has tools
   (SGLang keeps them then, so that tool-call markup survives);
2. reasoning parser "qwen3" (SGLang's ``--reasoning-parser qwen3``): a text with ``<think>``
   loses every ``<think>`` and is stripped; what precedes ``</think>`` becomes
   ``reasoning_content``, the rest (stripped) ``content``; without ``</think>`` (cut by
   max_new_tokens) it is all reasoning;
3. tool-call parser "qwen25" (SGLang's ``--tool-call-parser qwen25``), only when the
   conversation has tools: each ``<tool_call>\\n{json}\\n</tool_call>`` block whose JSON names
   one of the tools becomes a call; the content is the text before the first block,
   stripped; a block that is not valid JSON is skipped, and with no valid call the text stays
   the content. Arguments are handed to the template as an object, as SGLang does.

"auto" picks "qwen3" when the chat template reads ``reasoning_content`` and the vocabulary
has ``</think>``, and "qwen25" when the template writes ``<tool_call>``; else nothing is
split and the decoded text is the content (a template that splits ``<think>`` itself, like
DeepSeek-R1's, still does). Whether the template keeps past reasoning is its business: Qwen3's
drops it before the last user turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>\n"
TOOL_CALL_END = "\n</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END),
                        re.DOTALL)


class ReplyParser:
    """Turns a generated turn's output ids into the assistant message of the next prompt."""

    def __init__(self, tokenizer: Any, template: str, reasoning: str = "auto",
                 tool_calls: str = "auto") -> None:
        self.tokenizer = tokenizer
        vocab_has_think = THINK_END in tokenizer.get_vocab()
        self.reasoning = reasoning == "qwen3" or (
            reasoning == "auto" and "reasoning_content" in template and vocab_has_think)
        self.tool_calls = tool_calls == "qwen25" or (
            tool_calls == "auto" and "<tool_call>" in template)
        eos = tokenizer.eos_token_id
        self.stop_ids = {eos} if isinstance(eos, int) else set()

    def text(self, output_ids: list[int], stop_ids: Iterable[int] = (),
             keep_special: bool = False) -> str:
        """The decoded turn, its final stop token cut."""
        ids = list(output_ids)
        if ids and (ids[-1] in self.stop_ids or ids[-1] in set(stop_ids)):
            ids.pop()
        return str(self.tokenizer.decode(ids, skip_special_tokens=not keep_special))

    def message(self, output_ids: list[int], tools: list[dict] | None = None,
                stop_ids: Iterable[int] = ()) -> dict[str, Any]:
        """The assistant message of one generated turn (module docstring)."""
        text = self.text(output_ids, stop_ids, keep_special=bool(tools))
        msg: dict[str, Any] = {"role": "assistant"}
        if self.reasoning:
            reasoning, text = split_reasoning(text)
            if reasoning:
                msg["reasoning_content"] = reasoning
        calls: list[dict] = []
        if self.tool_calls and tools:
            text, calls = split_tool_calls(text, tool_names(tools))
        msg["content"] = text
        if calls:
            msg["tool_calls"] = calls
        return msg


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) as SGLang's qwen3 reasoning parser splits a whole output."""
    if THINK_START not in text and THINK_END not in text:
        return None, text
    processed = text.replace(THINK_START, "").strip()
    if THINK_END not in processed:
        return processed, ""
    reasoning, content = processed.split(THINK_END, 1)
    return reasoning, content.strip()


def split_tool_calls(text: str, names: set[str] | None) -> tuple[str, list[dict]]:
    """(content, calls) as SGLang's qwen25 tool-call parser splits a whole output."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls: list[dict] = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block.strip())
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        if names is not None and call["name"] not in names:
            continue
        args = call.get("parameters") or call.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                continue
        if not isinstance(args, dict):
            continue
        calls.append({"id": f"call_{len(calls)}", "type": "function",
                      "function": {"name": call["name"], "arguments": args}})
    if not calls:
        return text, []
    return text[:start].strip(), calls


def tool_names(tools: list[dict]) -> set[str]:
    """The function names among tool schemas (OpenAI shape)."""
    names = set()
    for tool in tools:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names
