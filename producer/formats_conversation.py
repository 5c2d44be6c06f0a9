"""`Conversation`: a dataset record normalised for the chat template (`to_conversation` in
`producer/formats_turns.py` makes it), and the prompt of each of its turns with the model's
earlier turns in place of the source's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

__all__ = ["Conversation"]


class Conversation(NamedTuple):
    """A record normalised for the chat template.

    `messages` are chat messages (``role``, ``content`` and, where the source has them,
    ``tool_calls``, ``tool_call_id``, ``name``, ``reasoning_content``); `tools` the tool
    schemas for ``apply_chat_template(tools=...)`` (None: no tools); `points` the generation
    points, as indexes into `messages`: the model answers ``messages[:point]`` there (a point
    equal to ``len(messages)`` follows a trailing user or tool turn). With turns "first" or
    "last" there is one point, ``len(messages)``.
    """

    messages: list[dict]
    tools: list[dict] | None
    points: tuple[int, ...]

    @property
    def turns(self) -> int:
        """How many generations the conversation asks for."""
        return len(self.points)

    def prompt(self, generated: Sequence[dict] = (),
               call_id: Callable[[str, int, int], str] | None = None) -> list[dict]:
        """The messages of turn ``len(generated) + 1``: the source up to that generation
        point, with the assistant message of each earlier point replaced by the model's
        (`generated`, in order), and the tool results the source recorded after it re-keyed
        to the model's calls in order (the k-th result answers the k-th regenerated call:
        its ``tool_call_id``, and its ``name`` where the source gave one). A result no
        regenerated call asked for keeps the source's id, or without one gets
        ``call_id(name, index, turn)``: the id the source's call would have in the model's
        format (index: its place among the conversation's calls so far)."""
        j = len(generated)
        if j >= len(self.points):
            raise ValueError(f"turn {j + 1} of a conversation of {len(self.points)} turns")
        out = list(self.messages[: self.points[j]])
        before = 0
        for turn, (point, message) in enumerate(zip(self.points, generated, strict=False), 1):
            source_calls = self.messages[point].get("tool_calls") or [] \
                if point < len(self.messages) else []
            out[point] = message
            calls = message.get("tool_calls") or []
            for k, at in enumerate(self._results_after(point, len(out))):
                if k < len(calls):
                    result = {**out[at], "tool_call_id": calls[k].get("id")}
                    if "name" in result:
                        result["name"] = calls[k]["function"]["name"]
                    out[at] = result
                elif call_id is not None and not out[at].get("tool_call_id"):
                    name = out[at].get("name") or (source_calls[k]["function"]["name"]
                                                   if k < len(source_calls) else "")
                    out[at] = {**out[at], "tool_call_id": call_id(name, before + k, turn)}
            before += len(calls)
        return out

    def replay_notes(self, generated: Sequence[dict]) -> list[str]:
        """What the replayed tool results of the source do not match in the model's turns
        1..len(generated): results no regenerated call asked for, calls no result answers."""
        notes = []
        for turn, (point, message) in enumerate(zip(self.points, generated, strict=False), 1):
            results = len(self._results_after(point, len(self.messages)))
            calls = len(message.get("tool_calls") or [])
            if results > calls:
                notes.append(f"turn {turn}: {results - calls} tool result(s) of the source "
                             f"answer no call (the model made {calls})")
            elif calls > results and turn < len(self.points):
                notes.append(f"turn {turn}: {calls - results} call(s) of the model have no "
                             f"recorded result (the source has {results})")
        return notes

    def _results_after(self, point: int, end: int) -> list[int]:
        """The indexes of the tool messages right after the assistant turn at `point`."""
        out = []
        at = point + 1
        while at < min(end, len(self.messages)) and self.messages[at]["role"] == "tool":
            out.append(at)
            at += 1
        return out
