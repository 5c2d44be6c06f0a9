"""`Conversation`: a dataset record normalised for the chat template (`to_conversation` in
`producer/formats/turns.py` makes it), and the prompt of each of its turns with the model's
earlier turns in place of the source's."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

__all__ = ["Conversation", "Divergence"]

ARGS_SHOWN = 80  # characters of a call's arguments a divergence message shows


class Divergence(NamedTuple):
    """How a regenerated turn's tool calls depart from the calls the source's next tool
    results answer: `kind` is other_name (a call of another function where the source's
    result answers one), no_call, fewer_calls or more_calls; `message` names both sides."""

    turn: int
    kind: str
    message: str


def _call_of(call: dict) -> tuple[str | None, Any]:
    fn = call.get("function", call) if isinstance(call, dict) else {}
    return fn.get("name"), _arguments(fn.get("arguments"))


def _arguments(args: Any) -> Any:
    """Arguments as an object where they are JSON text (templates write either)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _shown(calls: Sequence[tuple[str | None, Any]]) -> str:
    if not calls:
        return "no call"
    out = []
    for name, args in calls:
        text = json.dumps(args, ensure_ascii=False, sort_keys=True) if args is not None else ""
        text = text if len(text) <= ARGS_SHOWN else text[:ARGS_SHOWN] + "..."
        out.append(f"{name or '?'}({text})")
    return ", ".join(out)


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
            answered = self.answered(point)
            for k, at in enumerate(self._results_after(point, len(out))):
                # a result is never re-keyed to a call of another function (`divergence`
                # stops the conversation before that)
                if k < len(calls) and answered[k][0] in (None, _call_of(calls[k])[0]):
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

    def answered(self, point: int) -> list[tuple[str | None, Any]]:
        """The calls the source's tool results after the assistant turn at `point` answer,
        in order: (function name, arguments), each from the source's call (by its id, else
        by its place) or, without one, the result's own ``name`` (None: not said)."""
        source = self.messages[point] if point < len(self.messages) else {}
        calls = [c for c in source.get("tool_calls") or [] if isinstance(c, dict)]
        by_id = {c.get("id"): c for c in calls if c.get("id")}
        out = []
        for k, at in enumerate(self._results_after(point, len(self.messages))):
            result = self.messages[at]
            call = by_id.get(result.get("tool_call_id")) or (calls[k] if k < len(calls) else None)
            name, args = _call_of(call) if call is not None else (None, None)
            out.append((name or result.get("name"), args))
        return out

    def divergence(self, generated: Sequence[dict]) -> Divergence | None:
        """How the model's last turn (``generated[-1]``) departs from the calls the source's
        results after it answer, or None when they agree in number and names (in order) or
        the turn is the conversation's last (nothing is replayed after it)."""
        turn = len(generated)
        if turn == 0 or turn >= len(self.points):
            return None
        point = self.points[turn - 1]
        source = self.answered(point)
        model = [_call_of(c) for c in generated[-1].get("tool_calls") or []]
        for (want, _), (got, _) in zip(source, model, strict=False):
            if want is not None and want != got:
                kind = "other_name"
                break
        else:
            if len(model) == len(source):
                return None
            kind = ("no_call" if not model else "fewer_calls" if len(model) < len(source)
                    else "more_calls")
        return Divergence(turn, kind, f"turn {turn}: the model made {_shown(model)}; the "
                          f"source's tool results after it answer {_shown(source)}")

    def args_match(self, generated: Sequence[dict]) -> bool | None:
        """Whether every tool result replayed into the history of turn ``len(generated) + 1``
        answers a call of the model with the arguments the source's call had (False: one
        answers a call of the same function with other arguments); None when no result is
        replayed, or the source does not say the arguments."""
        seen = False
        for point, message in zip(self.points, generated, strict=False):
            model = [_call_of(c) for c in message.get("tool_calls") or []]
            for (name, args), (got, got_args) in zip(self.answered(point), model, strict=False):
                if args is None or name != got:
                    continue
                seen = True
                if args != got_args:
                    return False
        return True if seen else None

    def _results_after(self, point: int, end: int) -> list[int]:
        """The indexes of the tool messages right after the assistant turn at `point`."""
        out = []
        at = point + 1
        while at < min(end, len(self.messages)) and self.messages[at]["role"] == "tool":
            out.append(at)
            at += 1
        return out
