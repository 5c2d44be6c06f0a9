"""How a generated turn enters the history: output ids -> the assistant message.

With ``turns = "all"`` the prompt of turn j+1 holds the model's own turns 1..j. A chat server
(SGLang's ``/v1/chat/completions``) hands each generated turn back as an assistant message,
which the client sends in the next request's history and the chat template renders. This
module builds that message from the output ids, as SGLang does:

1. the turn's final end-of-turn token is cut (the tokenizer's eos, the ids of the model's
   `generation_config.json` ``eos_token_id``, the family's own ends such as gpt-oss's
   ``<|call|>``: `ReplyParser.end_of_turn_ids`, also the stop ids sent), and the rest is
   decoded with special tokens kept (the markers of reasoning and tool calls are tokens);
2. the reasoning parser (SGLang's `--reasoning-parser` name, `producer.parsers`) splits off
   ``reasoning_content``; a turn cut before its end of reasoning is all reasoning when the
   prompt opened the reasoning block (Kimi-K2.5, DeepSeek-V3.1: `opened`);
3. when the conversation has tools, the tool-call parser splits ``tool_calls`` off the
   content, each call with the id the server gives it (Kimi: ``functions.NAME:IDX`` with IDX
   counted over the whole conversation; else ``call_<24 hex>``, here derived from the
   conversation and turn so that a render is the same every time) and its arguments as an
   object (or, for a template that writes them as text, the model's own JSON text).

"auto" picks both parsers from the chat template and the vocabulary (`parsers.choose`). A
turn whose tool-call markup does not parse raises `Unparsed`: its conversation stops there,
the turn kept as generated. Whether the template keeps past reasoning is its business.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from foundation.config import RunConfig, generation_eos_ids
from foundation.errors import ConfigError
from foundation.gate import ReplyMarkers
from producer.parsers.registry import (
    Ambiguous,
    Call,
    Choice,
    Unparsed,
    choose,
    reasoning_parser,
    tool_call_parser,
)

if TYPE_CHECKING:
    from producer.render import Renderer

__all__ = ["ReplyParser", "Unparsed", "reply_parser"]


class ReplyParser:
    """Turns a generated turn's output ids into the assistant message of the next prompt."""

    def __init__(self, tokenizer: Any, template: str, reasoning: str = "auto",
                 tool_calls: str = "auto", end_of_turn: Iterable[int] = (),
                 arguments_as_string: bool = False) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.reasoning_choice: Choice = choose("reasoning", reasoning, template, vocab)
        self.tool_choice: Choice = choose("tool", tool_calls, template, vocab)
        self.reasoning = reasoning_parser(self.reasoning_choice.name)
        self.tools = tool_call_parser(self.tool_choice.name)
        self.arguments_as_string = arguments_as_string
        ends = set(end_of_turn)
        eos = tokenizer.eos_token_id
        ends.update([eos] if isinstance(eos, int) else eos or [])
        for token in self.tools.end_tokens if self.tools else ():
            tid = vocab.get(token)
            if isinstance(tid, int):
                ends.add(tid)
        self.end_of_turn_ids: frozenset[int] = frozenset(ends)

    def markers(self) -> ReplyMarkers:
        """The family's markers as ids, for the reply gate (`foundation.gate`)."""
        tok = self.tokenizer

        def ids(text: str) -> list[int]:
            return [int(t) for t in tok.encode(text, add_special_tokens=False)]

        r, tools = self.reasoning, self.tools
        return ReplyMarkers(
            reasoning_start=ids(r.start) if r else [],
            reasoning_end=ids(r.end) if r else [],
            reasoning_interrupts=[ids(r.interrupt)] if r and r.interrupt else [],
            reasoning_forced=bool(r and r.forced),
            call_starts=[ids(m) for m in tools.markers] if tools else [],
            end_ids=sorted(self.end_of_turn_ids), blank_ids=blank_ids(tok))

    def describe(self) -> str:
        """The parsers in use and why, for preview and the run log."""
        return (f"reasoning parser {self.reasoning_choice.name} ({self.reasoning_choice.why}); "
                f"tool-call parser {self.tool_choice.name} ({self.tool_choice.why})")

    def text(self, output_ids: Sequence[int], stop_ids: Iterable[int] = ()) -> str:
        """The decoded turn (special tokens kept), its final end-of-turn token cut."""
        ids = list(output_ids)
        if ids and (ids[-1] in self.end_of_turn_ids or ids[-1] in set(stop_ids)):
            ids.pop()
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def message(self, output_ids: Sequence[int], tools: list[dict] | None = None,
                stop_ids: Iterable[int] = (), opened: bool = False, calls_before: int = 0,
                call_key: str = "") -> dict[str, Any]:
        """The assistant message of one generated turn (module docstring). `calls_before`:
        the tool calls of the conversation's earlier turns (Kimi's ids count them);
        `call_key` makes the other families' ids (the conversation and turn)."""
        text = self.text(output_ids, stop_ids)
        msg: dict[str, Any] = {"role": "assistant"}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text, opened)
            if reasoning:
                msg["reasoning_content"] = reasoning
        calls: list[Call] = []
        if self.tools is not None and tools:
            text, calls = self.tools.split(text, tools)
        msg["content"] = text
        if calls:
            msg["tool_calls"] = [self._call(c, calls_before + k, call_key)
                                 for k, c in enumerate(calls)]
        return msg

    def call_id(self, name: str, index: int, key: str) -> str:
        """The id the server gives the `index`-th call of a conversation (`key`: the
        conversation and turn of the call)."""
        if self.tools is not None and self.tools.id_style == "kimi":
            return f"functions.{name}:{index}"
        return "call_" + hashlib.sha256(f"{key}#{index}".encode()).hexdigest()[:24]

    def result_ids(self, conversation_id: str) -> Any:
        """`Conversation.prompt`'s `call_id`: ids for the results no regenerated call asked
        for, in the model's format."""
        return lambda name, index, turn: self.call_id(name, index,
                                                      f"{conversation_id}#t{turn}")

    def _call(self, call: Call, index: int, key: str) -> dict[str, Any]:
        call_id = self.call_id(call.name, index, key)
        args: Any = call.arguments
        if self.arguments_as_string:
            args = call.raw_arguments if call.raw_arguments is not None else "{}"
        return {"id": call_id, "type": "function",
                "function": {"name": call.name, "arguments": args}}

    def messages(self, outputs: Sequence[Sequence[int]], tools: list[dict] | None,
                 conversation_id: str, stop_ids: Iterable[int] = (), opened: bool = False
                 ) -> list[dict[str, Any]]:
        """The assistant messages of a conversation's generated turns, in order; `Unparsed`
        (its message naming the turn) at the first that does not parse."""
        out: list[dict[str, Any]] = []
        calls = 0
        for turn, ids in enumerate(outputs, 1):
            try:
                msg = self.message(ids, tools, stop_ids, opened, calls,
                                   f"{conversation_id}#t{turn}")
            except Unparsed as exc:
                raise Unparsed(exc.parser, f"turn {turn}: {exc.reason}") from None
            calls += len(msg.get("tool_calls") or ())
            out.append(msg)
        return out


def reply_parser(cfg: RunConfig, renderer: Renderer | None) -> ReplyParser:
    """How the run's generated turns enter the next prompt; a config whose "auto" parsers fit
    twice stops here (ConfigError naming the key)."""
    if renderer is None:
        raise ConfigError("$.tokenizer", "generated turns are read with the model's tokenizer "
                          "and chat template: name the tokenizer")
    try:
        return ReplyParser(renderer.tokenizer, renderer.template, cfg.reasoning_parser,
                           cfg.tool_call_parser, generation_eos_ids(cfg),
                           renderer.arguments_as_string)
    except Ambiguous as exc:
        key = "$.tool_call_parser" if "tool parsers" in str(exc) else "$.reasoning_parser"
        raise ConfigError(key, str(exc)) from None


_BLANK: dict[int, list[int]] = {}  # id(tokenizer) -> its blank ids, worked out once


def blank_ids(tokenizer: Any) -> list[int]:
    """The ids that decode to whitespace only (the reply gate's `empty`), each id decoded
    alone: about a second for a 150k vocabulary, once per tokenizer."""
    key = id(tokenizer)
    if key not in _BLANK:
        n = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
        _BLANK[key] = [i for i, text in enumerate(texts) if text and not text.strip()]
    return _BLANK[key]
