"""Normalise one dataset record into a chat prompt (or a pre-tokenized prompt): the formats,
`Rejected`, and the checks of a record's fields and turns. `to_conversation` (the turn
policies) is `producer/formats/turns.py`; `Conversation` (a record normalised, and
the prompt of each of its turns) is `producer/formats/conversation.py`.

A record is one decoded JSON object (or Parquet row). `to_conversation` turns it into the
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
prompt                 ``prompt`` (a string)                       prompt
query                  ``query``                                   query
text                   ``text``                                    text
=====================  ==========================================  =========================

A record none of these fits is refused (``unknown_format``) with the `field_map` that would
read it (``field_map = { prompt = "KEY" }`` for one text, ``{ messages = "KEY", role = ...,
content = ... }`` for a list of turns), from its own keys.

Any chat format also honours a non-empty top-level string ``system`` field (OpenThoughts,
LLaMA-Factory alpaca) when the conversation has no system turn of its own, and a top-level
``tools`` field (a list of tool schemas, or a JSON string of one; LLaMA-Factory and
glaive-style sets) passed to the chat template as ``tools=``.

Roles: ``system``, ``developer``, ``user``, ``assistant`` and ``tool`` (and ShareGPT's
aliases: human, gpt, ...; ``function_call`` is an assistant turn whose value is the JSON of
one call or a list of calls, ``observation`` a tool result). A category's ``role_map`` maps
other names onto these. An assistant turn may carry OpenAI ``tool_calls`` (arguments as an
object or a JSON string, made an object as SGLang and vLLM do before templating), a tool turn
``tool_call_id`` and ``name``. An unknown role rejects the record only when the turn policy
uses that turn.

Turn policies: "first" and "last" give one prompt (the conversation up to its first or last
user turn, the dataset's own assistant turns as history); "all" gives a `Conversation` whose
every assistant turn (and a trailing user or tool turn) is a generation point, the model
regenerating each in order (`Conversation.prompt`).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from foundation.config import FORMATS, TURN_POLICIES
from foundation.errors import TokencapError

__all__ = [
    "FORMATS",
    "TURN_POLICIES",
    "Rejected",
    "detect_format",
]

# ShareGPT `from` values (and `messages` roles) -> chat roles.
ROLE_ALIASES = {
    "system": "system",
    "developer": "developer",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "function_call": "function_call",  # LLaMA-Factory: an assistant turn that is a tool call
    "tool": "tool",
    "observation": "tool",  # LLaMA-Factory: a tool result
    "function": "tool",  # OpenAI's legacy function-result role
    "ipython": "tool",  # Llama 3's tool-result role
}
# Single-turn formats: format -> key holding the user text.
SINGLE_TURN_KEYS = {
    "question_answer": "question",
    "problem_solution": "problem",
    "instruction_response": "instruction",
    "input_output": "input",
    "prompt": "prompt",
    "query": "query",
    "text": "text",
}
ALPACA_SEPARATOR = "\n\n"  # between an instruction and its non-empty input or context
# the keys an instruction format reads after the instruction, the first non-empty one
# appended to it (Alpaca's `input`, databricks-dolly's `context`)
CONTEXT_KEYS = ("input", "context")
# what each format reads of a record (its prompt, its answer, the system prompt and tools):
# a key with text outside these is named by `unread_keys` (its text is never sent)
COMMON_KEYS = ("system", "tools")
READS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", *CONTEXT_KEYS, "output"),
    "instruction_response": ("instruction", *CONTEXT_KEYS, "response"),
    "question_answer": ("question", "answer"),
    "problem_solution": ("problem", "solution", "answer"),
    "input_output": ("input", "output"),
    "prompt": ("prompt", "completion", "response"),
    "query": ("query", "response", "answer"),
    "text": ("text",),
    "input_ids": ("input_ids",),
}
ID_KEYS = ("id", "uuid", "idx", "index")  # a record's name, never text to send
TEXT_PART_SEPARATOR = "\n"  # between the text parts of list content, as vLLM joins them


class Rejected(TokencapError):
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
    for fmt in ("question_answer", "problem_solution", "input_output", "prompt", "query",
                "text"):
        if SINGLE_TURN_KEYS[fmt] in record:
            return fmt
    keys = ", ".join(sorted(map(str, record))[:20]) or "none"
    raise Rejected("unknown_format", f"cannot tell the format from the keys: {keys}"
                   + field_map_hint(record))


def unread_keys(record: dict, fmt: str, field_map: dict[str, str] | None = None) -> list[str]:
    """The keys of `record` holding text that neither its format (`fmt`, "auto" told from
    the record) nor the `field_map` reads: text that is never sent (databricks-dolly's
    `context` read as a bare instruction would be one)."""
    if field_map:
        read = set(field_map.values())
    else:
        if fmt == "auto":
            try:
                fmt = detect_format(record)
            except Rejected:
                return []
        read = set(READS.get(fmt, ()))
    read |= set(COMMON_KEYS) | set(ID_KEYS)
    return sorted(k for k, v in record.items()
                  if k not in read and isinstance(v, str) and v.strip())


def field_map_for(record: dict) -> dict[str, str]:
    """The category `field_map` that would read `record`, from its keys ({} if none would): a
    list of objects is turns (`messages`, `role`, `content`), else a string is the prompt."""
    for key, value in record.items():
        if isinstance(value, list) and value and all(isinstance(t, dict) for t in value):
            turn = value[0]
            role = next((k for k in ("role", "from", "speaker", "author") if k in turn), None)
            text = next((k for k in ("content", "value", "text", "message") if k in turn),
                        None)
            if role and text:
                return {"messages": key, "role": role, "content": text}
    for key, value in record.items():
        if isinstance(value, str) and value.strip():
            return {"prompt": key}
    return {}


def toml_table(table: dict[str, str]) -> str:
    """`{ key = "value", ... }`, an inline TOML table of strings."""
    import json

    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + " }"


def field_map_hint(record: dict) -> str:
    """`field_map_for` said as the line to write ("" if no map would read it)."""
    found = field_map_for(record)
    if not found:
        return ""
    what = " (the key of the user text)" if "prompt" in found else ""
    return f"; to read it set, in the category, field_map = {toml_table(found)}{what}"


class SourceTurn(NamedTuple):
    """A source turn before the policy: its role (None when unknown), the turn object, and
    where it is. Its fields are checked later, only if the turn is kept."""

    role: str | None
    raw: dict
    at: str
    role_key: str
    content_key: str


def turn_message(t: SourceTurn) -> dict:
    """The chat message of one kept turn, its fields checked."""
    value, at = t.raw.get(t.content_key), f"{t.at}.{t.content_key}"
    if t.role == "function_call":  # ShareGPT: the value is the call(s), as JSON
        calls = _json_value(value, at)
        calls = calls if isinstance(calls, list) else [calls]
        return {"role": "assistant", "content": "",
                "tool_calls": [_tool_call(c, f"{at}[{k}]") for k, c in enumerate(calls)]}
    if t.role == "tool":
        msg: dict[str, Any] = {"role": "tool", "content": _tool_content(value, at)}
        for key in ("tool_call_id", "name"):
            if isinstance(t.raw.get(key), str):
                msg[key] = t.raw[key]
        return msg
    if t.role == "assistant":
        calls = t.raw.get("tool_calls")
        msg = {"role": "assistant"}
        if calls:
            if not isinstance(calls, list):
                raise Rejected("wrong_type", f"expected a list, got {kind_name(calls)}",
                               f"{t.at}.tool_calls")
            msg["content"] = "" if value is None or value == "" else _content(value, at)
            msg["tool_calls"] = [_tool_call(c, f"{t.at}.tool_calls[{k}]")
                                 for k, c in enumerate(calls)]
        else:
            msg["content"] = _content(value, at)
        reasoning = t.raw.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            msg["reasoning_content"] = reasoning
        return msg
    assert t.role is not None
    return {"role": t.role, "content": _content(value, at)}


def _tool_call(call: Any, at: str) -> dict:
    """One call in OpenAI's shape, its arguments an object (as SGLang and vLLM hand them to
    the template). A bare ``{name, arguments}`` (ShareGPT function_call) is wrapped."""
    if not isinstance(call, dict):
        raise Rejected("wrong_type", f"expected an object, got {kind_name(call)}", at)
    fn = call.get("function", call)
    if not isinstance(fn, dict):
        raise Rejected("wrong_type", f"expected an object, got {kind_name(fn)}", f"{at}.function")
    where = f"{at}.function" if "function" in call else at
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise Rejected("missing_field", "the tool call has no name", f"{where}.name")
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        args = _json_value(args, f"{where}.arguments") if args.strip() else {}
    if not isinstance(args, dict):
        raise Rejected("wrong_type",
                       f"tool call arguments must be an object, got {kind_name(args)}",
                       f"{where}.arguments")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _tool_content(value: Any, at: str) -> str:
    """A tool result: text (may be empty), text parts, or a JSON value written as JSON."""
    if value is None:
        raise Rejected("missing_field", "the tool result has no content", at)
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       for p in value):
        return TEXT_PART_SEPARATOR.join(_content(p.get("text"), f"{at}[{j}].text")
                                        for j, p in enumerate(value))
    return json.dumps(value, ensure_ascii=False)


def tool_schemas(record: dict, key: str) -> list[dict] | None:
    """The record's tool schemas (a list, or a JSON string of one); bare function schemas
    ``{name, description, parameters}`` are wrapped as ``{"type": "function", ...}``, the
    shape a chat server hands the template."""
    value = record.get(key)
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        value = _json_value(value, key)
    if not isinstance(value, list):
        raise Rejected("wrong_type", f"expected a list of tools, got {kind_name(value)}", key)
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise Rejected("wrong_type", f"expected an object, got {kind_name(tool)}",
                           f"{key}[{i}]")
        if "function" not in tool:
            if not isinstance(tool.get("name"), str):
                raise Rejected("missing_field", "the tool has no name", f"{key}[{i}].name")
            tool = {"type": "function", "function": tool}
        tools.append(tool)
    return tools or None


def _json_value(value: Any, at: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise Rejected("invalid_json", f"not valid JSON: {exc}", at) from None


def add_system(
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
        raise Rejected("wrong_type", f"expected a string, got {kind_name(value)}", key)
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
        raise Rejected("wrong_type", f"expected a string, got {kind_name(value)}", at)
    if not value.strip():
        raise Rejected("empty_turn", "the turn's text is empty", at)
    return value


def text_field(record: dict, key: str) -> str:
    return _content(typed_field(record, key, str), key)


def typed_field(record: dict, key: str, kind: type) -> Any:
    value = record.get(key)
    if value is None:
        raise Rejected("missing_field", f"the record has no {key!r}", key)
    if not isinstance(value, kind):
        raise Rejected("wrong_type", f"expected {kind.__name__}, got {kind_name(value)}", key)
    return value


def input_ids_field(record: dict) -> list[int]:
    ids = typed_field(record, "input_ids", list)
    if not ids:
        raise Rejected("empty_conversation", "input_ids is empty", "input_ids")
    for j, tok in enumerate(ids):
        if type(tok) is not int or tok < 0:
            raise Rejected("wrong_type", f"expected a token id, got {tok!r}", f"input_ids[{j}]")
    return ids


def kind_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__
