"""From one dataset record to its `Conversation` (`to_conversation`), whose first turn is
the record's prompt: the record's turns read in its format (or its `field_map`), kept by the
turn policy ("first", "last", "all") and made chat messages. The formats and the checks of
each field are `producer/formats/records.py`."""

from __future__ import annotations

from foundation.config import FORMATS, TURN_POLICIES
from producer.formats.conversation import Conversation
from producer.formats.records import (
    ALPACA_SEPARATOR,
    CONTEXT_KEYS,
    ROLE_ALIASES,
    SINGLE_TURN_KEYS,
    Rejected,
    SourceTurn,
    add_system,
    detect_format,
    input_ids_field,
    kind_name,
    text_field,
    tool_schemas,
    turn_message,
    typed_field,
)

__all__ = ["to_conversation"]


def to_conversation(
    record: dict,
    fmt: str,
    turns: str = "first",
    system_prompt: str | None = None,
    field_map: dict[str, str] | None = None,
    role_map: dict[str, str] | None = None,
) -> Conversation | list[int]:
    """Normalise `record` into a `Conversation` (or, for format input_ids, a list of ids).

    `fmt` is one of `FORMATS`; "auto" calls `detect_format`. `turns` picks the generation
    points: "first" keeps the conversation up to and including its first user turn, "last"
    up to and including its last one (what follows is dropped); "all" keeps it whole, every
    assistant turn and a trailing user or tool turn being a point. Turns other than system
    turns before the first user turn (a greeting by the assistant) are dropped.
    `system_prompt`, when not None, replaces every system turn and becomes the first message
    (an empty string gives an empty system turn, which suppresses a template's default system
    prompt). Only kept turns must be well formed, and an unknown role rejects the record
    only when its turn is kept.

    `field_map` reads other shapes and overrides `fmt`:
    ``{"prompt": KEY}`` takes the user text of a single-turn prompt from ``record[KEY]``;
    ``{"messages": KEY, "role": R, "content": C}`` reads turns from the list
    ``record[KEY]``, each turn's role from key R (default "role", aliases as for ShareGPT)
    and its text from key C (default "content"). Either may add ``"system": KEY`` for a
    top-level system text and ``"tools": KEY`` for the tool schemas. `role_map` maps source
    role names (case-insensitive) onto the roles above before the aliases apply.

    Format input_ids returns ``record["input_ids"]`` checked to be non-negative ints;
    `turns` and `system_prompt` do not apply to it.

    Raises `Rejected` for records that cannot be normalised and `ValueError` for an
    unknown `fmt` or `turns`.
    """
    if turns not in TURN_POLICIES:
        raise ValueError(f"turns must be one of {TURN_POLICIES}, got {turns!r}")
    roles = {**ROLE_ALIASES, **{k.lower(): v for k, v in (role_map or {}).items()}}
    if field_map:
        raw = _mapped_turns(record, field_map, roles)
    else:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
        if fmt == "auto":
            fmt = detect_format(record)
        if fmt == "input_ids":
            return input_ids_field(record)
        raw = _chat_turns(record, fmt, roles)
    kept = _apply_policy(raw, turns, system_prompt)
    messages = [turn_message(t) for t in kept]
    _check_tool_results(kept, messages)
    messages = add_system(messages, record, system_prompt, field_map)
    tools = tool_schemas(record, (field_map or {}).get("tools", "tools"))
    if turns == "all":
        points = tuple(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if messages[-1]["role"] != "assistant":
            points += (len(messages),)
    else:
        points = (len(messages),)
    return Conversation(messages, tools, points)


def _chat_turns(record: dict, fmt: str, roles: dict[str, str]) -> list[SourceTurn]:
    if fmt == "messages":
        return _turns(record, "messages", "role", "content", roles)
    if fmt == "sharegpt":
        return _turns(record, "conversations", "from", "value", roles)
    if fmt in ("alpaca", "instruction_response"):
        text = _with_context(record, text_field(record, "instruction"), CONTEXT_KEYS)
        return [SourceTurn("user", {"content": text}, "instruction", "role", "content")]
    key = SINGLE_TURN_KEYS[fmt]
    return [SourceTurn("user", {"content": text_field(record, key)}, key, "role", "content")]


def _with_context(record: dict, text: str, keys: tuple[str, ...]) -> str:
    """`text` with the first non-empty of `keys` after it (an instruction's input or
    passage, as Alpaca renders `input`), else `text` alone."""
    for key in keys:
        extra = record.get(key)
        if extra is not None and not isinstance(extra, str):
            raise Rejected("wrong_type", f"expected a string, got {kind_name(extra)}", key)
        if extra and extra.strip():
            return text + ALPACA_SEPARATOR + extra
    return text


def _mapped_turns(record: dict, field_map: dict[str, str], roles: dict[str, str]
                  ) -> list[SourceTurn]:
    if "prompt" in field_map:
        key = field_map["prompt"]
        context = (field_map["context"],) if "context" in field_map else ()
        text = _with_context(record, text_field(record, key), context)
        return [SourceTurn("user", {"content": text}, key, "role", "content")]
    if "messages" in field_map:
        return _turns(
            record,
            field_map["messages"],
            field_map.get("role", "role"),
            field_map.get("content", "content"),
            roles,
        )
    raise ValueError(f"field_map needs a 'prompt' or a 'messages' key, got {sorted(field_map)}")


def _turns(record: dict, key: str, role_key: str, content_key: str, roles: dict[str, str]
           ) -> list[SourceTurn]:
    """Read a list of turn objects; ShareGPT turns written as role/content are accepted."""
    raw = typed_field(record, key, list)
    if not raw:
        raise Rejected("empty_conversation", "the conversation has no turns", key)
    out: list[SourceTurn] = []
    for i, turn in enumerate(raw):
        at = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise Rejected("wrong_type", f"expected an object, got {kind_name(turn)}", at)
        rk, ck = role_key, content_key
        if rk not in turn and "role" in turn:  # SpecForge writes conversations[{role,content}]
            rk, ck = "role", "content"
        role = turn.get(rk)
        if role is None:
            raise Rejected("missing_field", f"turn has no {rk!r}", f"{at}.{rk}")
        name = roles.get(role.lower()) if isinstance(role, str) else None
        out.append(SourceTurn(name, turn, at, rk, ck))
    return out


def _apply_policy(turns_in: list[SourceTurn], turns: str, system_prompt: str | None
                  ) -> list[SourceTurn]:
    users = [i for i, t in enumerate(turns_in) if t.role == "user"]
    if not users:
        _check_roles(turns_in)
        raise Rejected("no_user_turn", "the conversation has no user turn")
    for t in turns_in[: users[0]]:  # dropped, but a result there answers no call at all
        if t.role == "tool":
            raise Rejected("orphan_tool_result", "a tool result before the first user turn "
                           "answers no call", t.at)
    end = {"first": users[0], "last": users[-1]}.get(turns, len(turns_in) - 1)
    kept = [t for i, t in enumerate(turns_in[: end + 1])
            if i >= users[0] or t.role in ("system", "developer")]
    _check_roles(kept)
    if system_prompt is not None:
        kept = [t for t in kept if t.role != "system"]
    return kept


def _check_tool_results(kept: list[SourceTurn], messages: list[dict]) -> None:
    """Refuse a record with a tool result that answers no call (`orphan_tool_result`): one
    before any assistant turn, more results than the assistant turn before them made calls,
    or an id none of its calls has. An assistant turn that writes its calls in its text
    (no structured ``tool_calls``) is not counted: what its results answer cannot be told."""
    calls: list[dict] | None = None  # the structured calls of the last assistant turn
    answered = 0
    for t, msg in zip(kept, messages, strict=True):
        if msg["role"] == "assistant":
            calls, answered = msg.get("tool_calls") or [], 0
            continue
        if msg["role"] != "tool":
            continue
        if calls is None:
            raise Rejected("orphan_tool_result", "a tool result before any assistant turn "
                           "answers no call", t.at)
        if not calls:
            continue
        answered += 1
        if answered > len(calls):
            raise Rejected("orphan_tool_result", f"tool result {answered} after an assistant "
                           f"turn that made {len(calls)} call(s) answers no call", t.at)
        ids = [c["id"] for c in calls if c.get("id")]
        rid = msg.get("tool_call_id")
        if rid and ids and rid not in ids:
            raise Rejected("orphan_tool_result", f"tool_call_id {rid!r} is no call's id "
                           f"(the calls: {', '.join(ids)})", f"{t.at}.tool_call_id")


def _check_roles(turns: list[SourceTurn]) -> None:
    for t in turns:
        if t.role is None:
            role = t.raw[t.role_key]
            raise Rejected("unknown_role", f"unknown role {role!r} (map it with role_map)",
                           f"{t.at}.{t.role_key}")
