"""The conversations export: each row's prompt messages re-read from its source
(`SourceMessages`, through `producer.source.CategorySource`), a row per result
(`conversation_row`), and with ``turns = "all"`` one row per ended conversation
(`ConversationSink`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from foundation.errors import SourceError, UnknownCategory
from foundation.outputs import (
    BadLine,
    read_dead_letters,
    read_rejected,
)
from foundation.wire import Outcome, Result
from producer.replay import Replay
from tokencap.export.sinks import (
    CategoryStats,
    JsonlSink,
)

if TYPE_CHECKING:
    from foundation.config import Category, RunConfig
    from producer.formats.conversation import Conversation
    from producer.render import Renderer
    from producer.source import CategorySource

log = logging.getLogger(__name__)


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


MessagesFor = Callable[[Result], list[dict] | None]


class SourceMessages:
    """`MessagesFor` over a run config: re-reads a result's prompt from its source.

    A result's ``ordinal`` is its record's position in the category's source; the record is
    read again and normalised as the producer did (`CategorySource.read`). When the source
    changed (the record's sample id is no longer the result's id) or the record is
    pre-tokenized, there are no messages and `unmatched` counts it.
    """

    def __init__(self, cfg: RunConfig, renderer: Renderer | None = None) -> None:
        self.cfg = cfg
        self.renderer = renderer
        self.unmatched = 0
        self._sources: dict[str, Any] = {}
        self._replay: Replay | None = None

    def __call__(self, row: Result) -> list[dict] | None:
        sample = self._sample(row)
        messages = None
        if sample is not None and sample.sample_id == row.id and sample.prompt \
                and isinstance(sample.prompt[0], dict):
            messages = list(sample.prompt)
        if messages is None:
            self.unmatched += 1
        return messages

    def conversation(self, row: Result) -> Conversation | None:
        """The source `Conversation` of a turn row (None when the source changed)."""
        sample = self._sample(row)
        if sample is None or sample.sample_id != row.conversation_id:
            self.unmatched += 1
            return None
        return sample.conversation

    def replay(self, tokenizer: Any) -> Replay:
        """The run's `Replay` (how its generated turns entered the history), the producer's
        own: with the run's renderer when there is one, else from `tokenizer`."""
        if self._replay is None:
            self._replay = Replay(self.cfg, self.renderer, tokenizer)
        return self._replay

    def category(self, name: str) -> Category | None:
        try:
            return self.cfg.by_name(name)
        except UnknownCategory:
            return None

    def _sample(self, row: Result) -> Any:
        from producer.formats.records import Rejected

        try:
            source = self._source(self.cfg.by_name(row.category))
            if 0 <= row.ordinal < len(source):
                return source.read(row.ordinal)
        except (UnknownCategory, KeyError, OSError, SourceError, Rejected) as exc:
            log.debug("%s/%s: no source messages: %s", row.category, row.id, exc)
        return None

    def _source(self, cat: Category) -> CategorySource:
        """The category's `CategorySource` (KeyError: its files cannot be indexed)."""
        from producer.source import CategorySource

        if cat.name not in self._sources:
            try:
                self._sources[cat.name] = CategorySource.open(self.cfg, cat)
            except SourceError as exc:
                log.warning("%s: cannot index the source, no prompt messages: %s", cat.name, exc)
                self._sources[cat.name] = None
        source = self._sources[cat.name]
        if source is None:
            raise KeyError(cat.name)
        return source

    def close(self) -> None:
        """Close the source files."""
        for source in self._sources.values():
            if source is not None:
                source.close()
        self._sources.clear()


def conversation_row(
    row: Result, row_id: str, tokenizer: Decoder, messages_for: MessagesFor | None = None
) -> dict[str, Any]:
    """The conversations row of one result.

    ``conversations`` is the prompt's messages (``{"role", "content"}``, exactly those the
    chat template rendered, when `messages_for` can re-read them from the source; else
    nothing) followed by ``{"role": "assistant", "content": <output decoded with special
    tokens skipped>}``. ``prompt_text`` and ``completion_text`` decode the prompt and output
    ids with special tokens kept: the rendered prompt and the raw generation (think blocks
    and end-of-turn token included). Decoding is lossy where a tokenizer's special tokens
    eat whitespace (Phi-3); the specforge rows are the exact record.
    """
    prompt = (messages_for(row) if messages_for else None) or []
    answer = tokenizer.decode(row.output_ids, skip_special_tokens=True)
    return {
        "id": row_id,
        "category": row.category,
        "finish_reason": row.finish_reason,
        "conversations": [*prompt, {"role": "assistant", "content": answer}],
        "prompt_text": tokenizer.decode(row.prompt_ids, skip_special_tokens=False),
        "completion_text": tokenizer.decode(row.output_ids, skip_special_tokens=False),
    }


class ConversationSink(JsonlSink):
    """The conversations file: a row per result, and for the turns of conversations
    regenerated turn by turn (``turns = "all"``) one row per conversation, written once it
    ended:

    ``{"id": <conversation id>, "category", "complete", "stopped", "turns", "turns_total",
    "finish_reasons", "tools", "conversations": [...]}`` where ``conversations`` is the source's
    messages up to the last turn written (system, user turns, tool results as given) with
    every assistant turn the model's own: its output decoded into the assistant message that
    entered the next turn's prompt (``content``, and ``reasoning_content`` and ``tool_calls``
    where they were split, `producer.reply_parser`). ``complete`` is true when every turn was
    generated; else ``stopped`` says why it ended: ``rejected:<reason>`` or ``dead:<reason>``
    (a turn that failed, e.g. ``rejected:prompt_too_long`` for a conversation cut by the
    context length) or ``cap`` (its category closed before the next turn was sent). A
    conversation still going on is not written (counted as in progress).
    """

    def __init__(self, path: Path, tokenizer: Decoder, source: SourceMessages | None
                 ) -> None:
        super().__init__(path, lambda r, i: conversation_row(r, i, tokenizer, source))
        self.tokenizer = tokenizer
        self.source = source
        self._turns: dict[str, dict[int, Result]] = {}
        self.replay = source.replay(tokenizer) if source else Replay(None, tokenizer=tokenizer)
        self.truncated_at: dict[str, int] = {}  # conversation -> its first turn dropped
        self.consistent_only = False

    def add_turn(self, row: Result) -> None:
        """Keep a turn row until its category is read (the turns come in any order)."""
        assert row.conversation_id is not None
        self._turns.setdefault(row.conversation_id, {})[row.turn] = row

    def flush_conversations(self, cat_dir: Path, id_prefix: str, stats: CategoryStats) -> None:
        """Write the conversations of one category that ended, from the turns kept and the
        category's dead letters (why a conversation stopped)."""
        ends: dict[str, tuple[int, str]] = {}  # conversation -> (turn that ended it, why)
        for d in read_dead_letters(cat_dir):
            if isinstance(d, BadLine) or not d.conversation_id:
                continue
            why = "cap" if d.outcome == Outcome.CUT else f"{d.outcome}:{d.reason}"
            if d.turn >= ends.get(d.conversation_id, (0, ""))[0]:
                ends[d.conversation_id] = (d.turn, why)
        for r in read_rejected(cat_dir):  # a reply kept out of training ends it there
            if not isinstance(r, BadLine) and r.conversation_id:
                ends[r.conversation_id] = (r.turn, f"rejected_reply:{r.gate}")
        for conv_id, turns in sorted(self._turns.items()):
            rows = [turns[j] for j in sorted(turns)]
            last = rows[-1]
            total = last.turns_total
            complete = last.turn >= total
            end = ends.get(conv_id)
            stopped = None if complete else end[1] if end and end[0] == last.turn + 1 else None
            if not complete and stopped is None:
                stats.conversations_in_progress += 1
                continue
            if self.consistent_only and any(r.prefix_consistent is False for r in rows):
                continue
            cut = self.truncated_at.get(conv_id)
            if cut is not None:  # the rule of both exports: it ends before its cut turn
                rows = [r for r in rows if r.turn < cut]
                complete, stopped = False, "truncated"
                if not rows:
                    continue
            self._write_conversation(id_prefix + conv_id, rows, complete, stopped)
            stats.conversations += 1
            stats.conversations_complete += int(complete)
        self._turns.clear()
        self.truncated_at = {}

    def _write_conversation(self, conv_id: str, rows: list[Result], complete: bool,
                            stopped: str | None) -> None:
        conv: Conversation | None = None
        cat = None
        if self.source is not None:
            conv = self.source.conversation(rows[0])
            cat = self.source.category(rows[0].category)
        stop_ids = (rows[0].sampling or {}).get("stop_token_ids") or []
        mode = next((m for m in cat.modes if m.name == rows[0].mode), None) if cat else None
        messages = self.replay.transcript(conv, [r.output_ids for r in rows],
                                          rows[0].conversation_id or "", stop_ids,
                                          self.replay.opened(cat, mode))
        tools = conv.tools if conv is not None else None
        doc = {"id": conv_id, "category": rows[0].category, "complete": complete,
               "stopped": stopped, "turns": len(rows), "turns_total": rows[-1].turns_total,
               "finish_reasons": [r.finish_reason for r in rows],
               "prefix_consistent": all(r.prefix_consistent is not False for r in rows),
               "tools": tools, "conversations": messages}
        self._write(doc)
