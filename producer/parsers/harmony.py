"""gpt-oss's harmony format (SGLang's `gpt-oss` reasoning and tool-call parsers,
python/sglang/srt/parser/harmony_parser.py and function_call/gpt_oss_detector.py; the
format as openai-harmony renders and parses it).

A turn is a run of messages after the prompt's ``<|start|>assistant``, each
``[<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]
<|message|>BODY`` ended by ``<|end|>``, ``<|call|>`` (a tool call) or ``<|return|>`` (the
final answer; the model's end-of-turn token, cut before parsing like ``<|call|>``):

- ``analysis``: reasoning (bodies joined, as SGLang joins them);
- ``commentary`` with a recipient ``functions.NAME``: a call, its body the JSON arguments;
- ``final``, and ``commentary`` without a recipient (a preamble): the content.

The reasoning parser returns the reasoning and the rest re-written as harmony messages
without the analysis ones; the tool-call parser reads calls and content from that. Where
SGLang 0.5.23 differs: a turn whose first message is a call (no ``<|start|>assistant`` before
it, as the prompt ends with it) is missed there; invalid JSON drops the call there, and
raises `Unparsed` here.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from producer.parsers.base import Call, ReasoningParser, ToolCallParser, Unparsed, json_object

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
_ENDS = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_RECIPIENT = re.compile(r"\bto=([A-Za-z_][\w.\-]*)")


class Message(NamedTuple):
    channel: str
    recipient: str | None
    body: str
    ended_by: str  # END, CALL, RETURN, or "" (cut)


def messages(text: str) -> list[Message]:
    """The harmony messages of a turn; text outside any message is a plain one (content,
    as SGLang's harmony parser takes it)."""
    out: list[Message] = []
    rest = text
    while rest.strip():
        starts = [i for i in (rest.find(START), rest.find(CHANNEL)) if i >= 0]
        first = min(starts) if starts else len(rest)
        if first > 0 or MESSAGE not in rest:
            plain = rest[:first] if starts and MESSAGE in rest else rest
            out.append(Message("final", None, plain, ""))
            rest = rest[len(plain):]
            continue
        head, rest = rest.split(MESSAGE, 1)
        head = head.strip()
        if head.startswith(START):
            head = head[len(START):]
        role, _, channel_part = head.partition(CHANNEL)
        if not channel_part and not role.startswith("assistant"):
            channel_part = role  # no <|channel|>: not a message of the model
        found = _ENDS.search(rest)
        body, ended_by = (rest[:found.start()], found.group()) if found else (rest, "")
        rest = rest[found.end():] if found else ""
        header = f"{role} {channel_part}"
        recipient = _RECIPIENT.search(header)
        channel = channel_part.split()[0] if channel_part.split() else ""
        out.append(Message(channel.lower(), recipient.group(1) if recipient else None, body,
                           ended_by))
    return out


def _write(m: Message) -> str:
    to = f" to={m.recipient}" if m.recipient else ""
    constrain = f" {CONSTRAIN}json" if m.recipient else ""
    return f"{START}assistant{CHANNEL}{m.channel}{to}{constrain}{MESSAGE}{m.body}{m.ended_by}"


class GptOssReasoning(ReasoningParser):
    name = "gpt-oss"
    start = f"{CHANNEL}analysis"
    end = END
    forced = True

    def split(self, text: str, opened: bool = False) -> tuple[str | None, str]:
        if MESSAGE not in text:
            return None, text
        msgs = messages(text)
        reasoning = "".join(m.body for m in msgs if m.channel == "analysis")
        rest = [m for m in msgs if m.channel != "analysis"]
        if all(m.recipient is None for m in rest):
            return reasoning or None, "".join(m.body for m in rest)
        return reasoning or None, "".join(_write(m) for m in rest)


class GptOssTools(ToolCallParser):
    name = "gpt-oss"
    markers = (" to=functions.", "to=functions.")
    end_tokens = (CALL,)

    def split(self, text: str, tools: list[dict] | None) -> tuple[str, list[Call]]:
        if not self.has_call(text):
            return text, []
        content: list[str] = []
        calls: list[Call] = []
        for m in messages(text):
            if m.recipient is None:
                if m.channel != "analysis":
                    content.append(m.body)
                continue
            if not m.recipient.startswith("functions."):
                raise Unparsed(self.name, f"a call to {m.recipient!r}, not a function")
            raw = m.body.strip() or "{}"
            calls.append(Call(m.recipient.split(".", 1)[1],
                              json_object(raw, self.name, f"call {len(calls) + 1} arguments"),
                              raw))
        return " ".join(content).strip(), calls
