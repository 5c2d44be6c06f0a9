"""Normalise one dataset record into a chat prompt (or a pre-tokenized prompt).

A record is one decoded JSON object (or Parquet row). `to_prompt` turns it into the
messages a chat template renders, ending with the user turn the model must answer:
original assistant answers are never the last message. Records that cannot be turned
into a prompt raise `Rejected` with a short snake_case reason code and the field at fault,
so the producer can count and log them and carry on with the next record.

Formats (the keys that `detect_format` looks for, in this order):

=====================  ==========================================  =========================
format                 keys                                        user text
=====================  ==========================================  =========================
input_ids              ``input_ids`` (list of int)                 already tokenized
messages               ``messages[{role, content}]``               the conversation
sharegpt               ``conversations[{from, value}]``            the conversation
instruction_response   ``instruction``, ``response``               instruction
alpaca                 ``instruction`` [, ``input``, ``output``]   instruction + input
question_answer        ``question``                                question
problem_solution       ``problem``                                 problem
input_output           ``input``                                   input
=====================  ==========================================  =========================

Any chat format also honours a non-empty top-level string ``system`` field (OpenThoughts,
LLaMA-Factory alpaca) when the conversation has no system turn of its own.
"""

from __future__ import annotations

from typing import Any

from foundation.config import FORMATS, TURN_POLICIES

__all__ = ["FORMATS", "TURN_POLICIES", "Rejected", "detect_format", "to_prompt"]

# ShareGPT `from` values (and `messages` roles) -> chat roles.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
# Single-turn formats: format -> key holding the user text.
SINGLE_TURN_KEYS = {
    "question_answer": "question",
    "problem_solution": "problem",
    "instruction_response": "instruction",
    "input_output": "input",
}
ALPACA_SEPARATOR = "\n\n"  # between an alpaca instruction and its non-empty input
TEXT_PART_SEPARATOR = "\n"  # between the text parts of list content, as vLLM joins them


class Rejected(Exception):
    """A record that cannot become a prompt.

    Attributes: `reason` (snake_case code, e.g. ``missing_field``), `field` (the path of the
    field at fault such as ``messages[2].content``, or None), `message` (for humans),
    `where` (``path:line`` once the reader knows it) and `sample_id` (likewise).
    ``str()`` gives ``reason (field): message``; `where` is left to the caller.
    """

    def __init__(
        self,
        reason: str,
        message: str = "",
        field: str | None = None,
        where: str | None = None,
        sample_id: str | None = None,
    ) -> None:
        super().__init__(reason, message, field)
        self.reason = reason
        self.message = message or reason.replace("_", " ")
        self.field = field
        self.where = where
        self.sample_id = sample_id

    def __str__(self) -> str:
        at = f" ({self.field})" if self.field else ""
        return f"{self.reason}{at}: {self.message}"


def detect_format(record: dict) -> str:
    """Return the format name implied by the record's keys (see the module table)."""
    if "input_ids" in record:
        return "input_ids"
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record:
        return "instruction_response" if "response" in record else "alpaca"
    for fmt in ("question_answer", "problem_solution", "input_output"):
        if SINGLE_TURN_KEYS[fmt] in record:
            return fmt
    keys = ", ".join(sorted(map(str, record))[:20]) or "none"
    raise Rejected("unknown_format", f"cannot tell the format from the keys: {keys}")


def to_prompt(
    record: dict,
    fmt: str,
    turns: str = "first",
    system_prompt: str | None = None,
    field_map: dict[str, str] | None = None,
) -> list[dict] | list[int]:
    """Normalise `record` into chat messages ending with a user turn, or a list of ids.

    `fmt` is one of `FORMATS`; "auto" calls `detect_format`. `turns` picks the user turn
    the prompt ends with: "first" keeps the conversation up to and including its first
    user turn, "last" up to and including its last one; what follows is dropped. Turns
    other than system turns before the first user turn (a greeting by the assistant) are
    dropped. `system_prompt`, when not None, replaces every system turn and becomes the
    first message (an empty string gives an empty system turn, which suppresses a
    template's default system prompt). Only kept turns must have non-empty text.

    `field_map` reads other shapes and overrides `fmt`:
    ``{"prompt": KEY}`` takes the user text of a single-turn prompt from ``record[KEY]``;
    ``{"messages": KEY, "role": R, "content": C}`` reads turns from the list
    ``record[KEY]``, each turn's role from key R (default "role", aliases as for ShareGPT)
    and its text from key C (default "content"). Either may add ``"system": KEY`` for a
    top-level system text.

    Format input_ids returns ``record["input_ids"]`` checked to be non-negative ints;
    `turns` and `system_prompt` do not apply to it.

    Raises `Rejected` for records that cannot be normalised and `ValueError` for an
    unknown `fmt` or `turns`.
    """
    if turns not in TURN_POLICIES:
        raise ValueError(f"turns must be one of {TURN_POLICIES}, got {turns!r}")
    if field_map:
        messages = _mapped_messages(record, field_map)
    else:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
        if fmt == "auto":
            fmt = detect_format(record)
        if fmt == "input_ids":
            return _input_ids(record)
        messages = _chat_messages(record, fmt)
    prompt = _apply_policy(messages, turns, system_prompt)
    return _add_system(prompt, record, system_prompt, field_map)


# A turn before the policy: (role, content, content field path). Content is checked later,
# only if the turn is kept.
_Turn = tuple[str, Any, str]


def _chat_messages(record: dict, fmt: str) -> list[_Turn]:
    if fmt == "messages":
        return _turns(record, "messages", "role", "content")
    if fmt == "sharegpt":
        return _turns(record, "conversations", "from", "value")
    if fmt == "alpaca":
        instruction = _text(record, "instruction")
        extra = record.get("input")
        if extra is not None and not isinstance(extra, str):
            raise Rejected("wrong_type", f"expected a string, got {_kind(extra)}", "input")
        if extra and extra.strip():
            instruction = instruction + ALPACA_SEPARATOR + extra
        return [("user", instruction, "instruction")]
    key = SINGLE_TURN_KEYS[fmt]
    return [("user", _text(record, key), key)]


def _mapped_messages(record: dict, field_map: dict[str, str]) -> list[_Turn]:
    if "prompt" in field_map:
        key = field_map["prompt"]
        return [("user", _text(record, key), key)]
    if "messages" in field_map:
        return _turns(
            record,
            field_map["messages"],
            field_map.get("role", "role"),
            field_map.get("content", "content"),
        )
    raise ValueError(f"field_map needs a 'prompt' or a 'messages' key, got {sorted(field_map)}")


def _turns(record: dict, key: str, role_key: str, content_key: str) -> list[_Turn]:
    """Read a list of turn objects; ShareGPT turns written as role/content are accepted."""
    raw = _field(record, key, list)
    if not raw:
        raise Rejected("empty_conversation", "the conversation has no turns", key)
    out: list[_Turn] = []
    for i, turn in enumerate(raw):
        at = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise Rejected("wrong_type", f"expected an object, got {_kind(turn)}", at)
        rk, ck = role_key, content_key
        if rk not in turn and "role" in turn:  # SpecForge writes conversations[{role,content}]
            rk, ck = "role", "content"
        role = turn.get(rk)
        if role is None:
            raise Rejected("missing_field", f"turn has no {rk!r}", f"{at}.{rk}")
        role_name = ROLE_ALIASES.get(role.lower()) if isinstance(role, str) else None
        if role_name is None:
            raise Rejected("unknown_role", f"unknown role {role!r}", f"{at}.{rk}")
        out.append((role_name, turn.get(ck), f"{at}.{ck}"))
    return out


def _apply_policy(turns_in: list[_Turn], turns: str, system_prompt: str | None) -> list[dict]:
    users = [i for i, (role, _, _) in enumerate(turns_in) if role == "user"]
    if not users:
        raise Rejected("no_user_turn", "the conversation has no user turn")
    end = users[0] if turns == "first" else users[-1]
    kept = [t for i, t in enumerate(turns_in[: end + 1]) if i >= users[0] or t[0] == "system"]
    if system_prompt is not None:
        kept = [t for t in kept if t[0] != "system"]
    return [{"role": role, "content": _content(value, at)} for role, value, at in kept]


def _add_system(
    messages: list[dict], record: dict, system_prompt: str | None, field_map: dict | None
) -> list[dict]:
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    elif not any(m["role"] == "system" for m in messages):
        top_system = _top_system(record, field_map)
        if top_system:
            messages.insert(0, {"role": "system", "content": top_system})
    return messages


def _top_system(record: dict, field_map: dict[str, str] | None) -> str | None:
    key = (field_map or {}).get("system", "system")
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise Rejected("wrong_type", f"expected a string, got {_kind(value)}", key)
    return value if value.strip() else None


def _content(value: Any, at: str) -> str:
    """Check one kept turn's content; list content of text parts is joined."""
    if value is None:
        raise Rejected("missing_field", "turn has no text", at)
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise Rejected("wrong_type", "only text parts are supported", f"{at}[{j}]")
            parts.append(_content(part.get("text"), f"{at}[{j}].text"))
        value = TEXT_PART_SEPARATOR.join(parts)
    if not isinstance(value, str):
        raise Rejected("wrong_type", f"expected a string, got {_kind(value)}", at)
    if not value.strip():
        raise Rejected("empty_turn", "the turn's text is empty", at)
    return value


def _text(record: dict, key: str) -> str:
    return _content(_field(record, key, str), key)


def _field(record: dict, key: str, kind: type) -> Any:
    value = record.get(key)
    if value is None:
        raise Rejected("missing_field", f"the record has no {key!r}", key)
    if not isinstance(value, kind):
        raise Rejected("wrong_type", f"expected {kind.__name__}, got {_kind(value)}", key)
    return value


def _input_ids(record: dict) -> list[int]:
    ids = _field(record, "input_ids", list)
    if not ids:
        raise Rejected("empty_conversation", "input_ids is empty", "input_ids")
    for j, tok in enumerate(ids):
        if type(tok) is not int or tok < 0:
            raise Rejected("wrong_type", f"expected a token id, got {tok!r}", f"input_ids[{j}]")
    return ids


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
