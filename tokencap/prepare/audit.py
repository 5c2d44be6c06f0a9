"""`tokencap audit ROWS`: the reply gate and the tool checks, on rows already written.

The same code the run uses, on rows made by this version, an earlier one, or another tool:

- **tokencap rows** (`Result` lines: `part-*.jsonl`, `rejected-replies.jsonl`, or a folder
  of them): each reply through `foundation.gate.check` with the family's markers
  (`ReplyParser.markers`; the block open when the row's prompt ends in it), and the rows
  whose history replays a tool result for a call with other arguments
  (`tool_args_match` false).
- **regenerated conversations** as SpecForge's and speculators' regeneration write them
  (`{"id", "conversations": [{"role", "content", ...}]}` JSONL, OpenAI roles or ShareGPT's):
  each assistant message, its reasoning in the family's block, encoded and gated (its
  finish reason is not known: `length` cannot be told; structured calls are an answer); its
  calls (structured `tool_calls`, or parsed from its text with the family's tool-call
  parser) against the tool results after it: a result whose `name` is another function's
  (`tool_mismatch`), fewer results or more than calls (`tool_divergence`), a result that
  answers no call (`orphan_tool_result`, `producer.formats.turns`'s check).

Counts per reason, and the first examples of each (id and file:line).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from foundation.errors import TokencapError
from foundation.gate import GateReason, check
from foundation.outputs import PART_GLOB, REJECTED_FILE
from foundation.wire import Result
from producer.formats.records import Rejected
from producer.formats.turns import to_conversation
from producer.reply_parser import ReplyParser, Unparsed

EXAMPLES = 3  # examples shown per reason
SNIPPET_CHARS = 120
_RESULT = msgspec.json.Decoder(Result)


class Audit:
    """Counts per reason over the rows read, with examples."""

    def __init__(self, replies: ReplyParser) -> None:
        self.replies = replies
        self.markers = replies.markers()
        self.rows = 0
        self.replies_seen = 0
        self.reasons: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}

    def flag(self, reason: str, where: str, row_id: str, text: str = "") -> None:
        self.reasons[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES:
            tail = text[-SNIPPET_CHARS:].replace("\n", "\\n")
            shown.append(f"{where} {row_id}" + (f": ...{tail}" if tail else ""))

    # -- tokencap rows -------------------------------------------------------------------
    def result(self, row: Result, where: str) -> None:
        self.rows += 1
        self.replies_seen += 1
        reason = check(row.output_ids, row.finish_reason, self.markers, row.prompt_ids)
        if reason is not None:
            self.flag(str(reason), where, row.id, row.text)
        if row.tool_args_match is False:
            self.flag("tool_args_mismatch", where, row.id)

    # -- regenerated conversations ------------------------------------------------------
    def conversation(self, record: dict[str, Any], where: str) -> None:
        self.rows += 1
        row_id = str(record.get("id", ""))
        turns = record.get("conversations") or record.get("messages") or []
        tools = record.get("tools")
        messages: list[dict[str, Any]] = []
        for turn in turns if isinstance(turns, list) else []:
            if not isinstance(turn, dict):
                continue
            role = turn.get("role") or {"human": "user", "gpt": "assistant",
                                         "tool": "tool", "system": "system"}.get(
                str(turn.get("from")), str(turn.get("from")))
            content = turn.get("content", turn.get("value", ""))
            message = {**turn, "role": role, "content": content if isinstance(content, str)
                       else json.dumps(content)}
            if role == "assistant":
                message = self._reply(message, tools, where, row_id)
            messages.append(message)
        self._tools(messages, where, row_id)

    def _reply(self, message: dict[str, Any], tools: Any, where: str, row_id: str
               ) -> dict[str, Any]:
        """Gate one assistant message; its calls parsed from its text when not structured."""
        self.replies_seen += 1
        text = self._written(message)
        tok = self.replies.tokenizer
        ids = [int(t) for t in tok.encode(text, add_special_tokens=False)]
        end = sorted(self.markers.end_ids)[:1]
        reason = check([*ids, *end], "stop", self.markers)
        if reason is not None and not (reason == GateReason.EMPTY and message.get("tool_calls")):
            self.flag(str(reason), where, row_id, text)
        if message.get("tool_calls") or self.replies.tools is None:
            return message
        try:
            parsed = self.replies.message(ids, tools if isinstance(tools, list) else None)
        except Unparsed as exc:
            self.flag("unparsed_reply", where, row_id, str(exc))
            return message
        calls = parsed.get("tool_calls")
        return {**message, "tool_calls": calls} if calls else message

    def _written(self, message: dict[str, Any]) -> str:
        """The message's text as the model wrote it: its reasoning in the family's block,
        then its content."""
        r = self.replies.reasoning
        reasoning = message.get("reasoning_content")
        text = f"{r.start}{reasoning}{r.end}" if r is not None and reasoning else ""
        return text + str(message.get("content") or "")

    def _tools(self, messages: list[dict[str, Any]], where: str, row_id: str) -> None:
        try:  # the run's own check of results that answer no call
            to_conversation({"messages": messages}, "messages", "all")
        except Rejected as exc:
            if exc.reason == "orphan_tool_result":
                self.flag(exc.reason, where, row_id, str(exc))
            return
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            calls = [c.get("function", c) for c in m.get("tool_calls") or []
                     if isinstance(c, dict)]
            results = []
            for later in messages[k + 1:]:
                if later["role"] != "tool":
                    break
                results.append(later)
            names = [c.get("name") for c in calls]
            said = [r.get("name") for r in results]
            if any(n and s and n != s for n, s in zip(names, said, strict=False)):
                self.flag("tool_mismatch", where, row_id, f"calls {names}, results {said}")
            elif calls and len(results) != len(calls) and k < len(messages) - 1:
                self.flag("tool_divergence", where, row_id,
                          f"{len(calls)} call(s), {len(results)} result(s)")

    def report(self) -> dict[str, Any]:
        return {"rows": self.rows, "replies": self.replies_seen,
                "reasons": dict(self.reasons.most_common()), "examples": self.examples}


def row_files(paths: Sequence[Path]) -> list[Path]:
    """The JSONL files of `paths`: files as given, folders searched for tokencap's row files
    (`part-*.jsonl`, `rejected-replies.jsonl`) at any depth."""
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out += sorted(p for p in path.rglob("*.jsonl")
                          if p.match(PART_GLOB) or p.name == REJECTED_FILE)
        else:
            out.append(path)
    return out


def lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as f:
        for no, line in enumerate(f, 1):
            if line.strip():
                yield no, line


EXPORT_KEYS = {"input_ids", "loss_mask"}  # a SpecForge row of `tokencap export`
EXPORT_MANIFEST = "export-manifest.json"


class NotRows(TokencapError):
    """What was given to audit is an export of rows, not the rows: nothing there to check."""

    exit_code = 2


def _export_instead(path: Path, what: str) -> NotRows:
    return NotRows(f"{path} is {what} of `tokencap export` (ids and a loss mask: no reply "
                   "text, no finish reason to check): audit the rows it was made from, the "
                   "run's output folder (its config's output_dir, e.g. `tokencap audit out/ "
                   "--config run.toml`) or its part-*.jsonl")


def audit(paths: Sequence[Path], replies: ReplyParser) -> dict[str, Any]:
    """Audit every row of `paths` (module docstring): a line that is neither layout is
    counted as `unreadable`; an export of `tokencap export` given instead of rows (a
    SpecForge file, or a folder with its manifest and no rows) is refused (`NotRows`)."""
    for path in paths:
        if path.is_dir() and not row_files([path]) and any(path.rglob(EXPORT_MANIFEST)):
            raise _export_instead(path, "a folder")
    a = Audit(replies)
    for path in row_files(paths):
        for no, raw in lines(path):
            where = f"{path}:{no}"
            try:
                doc = json.loads(raw)
            except ValueError:
                a.flag("unreadable", where, "")
                continue
            if isinstance(doc, dict) and EXPORT_KEYS <= set(doc) and "output_ids" not in doc:
                raise _export_instead(path, "a file")
            if isinstance(doc, dict) and "output_ids" in doc:
                try:
                    a.result(_RESULT.decode(raw), where)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    a.flag("unreadable", where, str(doc.get("id", "")))
            elif isinstance(doc, dict) and ("conversations" in doc or "messages" in doc):
                a.conversation(doc, where)
            else:
                a.flag("unreadable", where, "")
    return a.report()
