"""Export committed results as training data: SpecForge rows, conversations, Parquet.

Input: a run's output folder, ``<out>/<category>/part-*.jsonl`` (one `wire.Result` a line,
read by `foundation.outputs`).
Each part file is streamed line by line; only the ids already exported are kept (to drop a
duplicate id). A line that is not a result is reported as ``file:line: error`` and skipped.

Output, under `dest`, one file per format: ``<dest>/<category>/<file>`` by category, or
``<dest>/<file>`` with every category in one file (`merged`; ids become
``<category>/<id>`` there, so rows of two categories never share an id):

==============  =======================  ===================================================
format          file                     row
==============  =======================  ===================================================
specforge       ``specforge.jsonl``      ``{"id", "input_ids", "loss_mask"}``:
                                         ``prompt_ids + output_ids`` and ``[0] * prompt +
                                         [1] * output`` (SpecForge's pre-tokenized input)
conversations   ``conversations.jsonl``  ``{"id", "category", "finish_reason",
                                         "conversations", "prompt_text",
                                         "completion_text"}`` (see `conversation_row`);
                                         for ``turns = "all"``, one row per ended
                                         conversation (see `ConversationSink`)
parquet         ``specforge.parquet``    columns id, category, input_ids (list<int32>),
                                         loss_mask (list<int32>), finish_reason,
                                         counted_tokens (int64)
==============  =======================  ===================================================

Rows of ``turns = "all"`` runs are turns (``<conversation>#t<j>``): specforge and parquet give
one row per turn, its loss mask over that turn's output only (`loss_mask` "generated"; or
"shifted" one position left, for a trainer that does not shift the mask with its targets:
`specforge_row`).
One rule for truncated output in every format: a sample or turn cut at max_new_tokens
(``finish_reason == "length"``) is dropped, and every later turn of its conversation with it
(the conversations export ends the conversation there, ``stopped: "truncated"``), unless
`keep_truncated`. `consistent_only` drops the turns whose prompt does not extend the
previous turn's prompt and output ids (``prefix_consistent`` false) and the conversations
that hold one.
Rows a simulator generated (``simulated``: synthetic outputs) stop the export unless
`allow_simulated`: they are not training data.
Every file is written to a temporary name beside it, fsynced, and renamed over the final
name only once every file of the export is complete, so a failed export replaces nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from foundation.errors import SourceError, TokencapError, UnknownCategory
from foundation.outputs import (
    PART_GLOB,
    BadLine,
    categories_on_disk,
    read_dead_letters,
    read_results,
)
from foundation.wire import Outcome, Result
from producer.replies import Unparsed

log = logging.getLogger(__name__)

FORMATS = ("specforge", "conversations", "parquet")
FILE_NAMES = {
    "specforge": "specforge.jsonl",
    "conversations": "conversations.jsonl",
    "parquet": "specforge.parquet",
}
TRUNCATED = "length"  # SGLang's finish_reason for an output cut at max_new_tokens
PARQUET_ROW_GROUP_ROWS = 1024  # rows buffered before a Parquet row group is written
MAX_BAD_REPORTED = 20  # bad lines listed per category; the rest are only counted

class SpecforgeRow(msgspec.Struct):
    """SpecForge's pre-tokenized row: loss on exactly the generated tokens."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


class ExportError(TokencapError):
    """The export cannot start: no output folder, no categories, unknown format."""


@dataclass
class CategoryStats:
    """Per-category counts of one export. `tokens` counts input_ids, `output_tokens` the
    supervised ones (loss_mask 1)."""

    rows: int = 0
    tokens: int = 0
    output_tokens: int = 0
    dropped_truncated: int = 0
    dropped_after_truncated: int = 0
    dropped_inconsistent: int = 0
    duplicates: int = 0
    bad_lines: int = 0
    conversations: int = 0
    conversations_complete: int = 0
    conversations_in_progress: int = 0
    bad: list[dict] = field(default_factory=list)

    def add(self, other: CategoryStats) -> None:
        for name in ("rows", "tokens", "output_tokens", "dropped_truncated",
                     "dropped_after_truncated", "dropped_inconsistent", "duplicates",
                     "bad_lines", "conversations", "conversations_complete",
                     "conversations_in_progress"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def find_categories(out_dir: Path) -> list[str]:
    """Names of the folders of `out_dir` that hold at least one part file, sorted."""
    if not out_dir.is_dir():
        raise ExportError(f"output folder {out_dir}: no such directory")
    return categories_on_disk(out_dir)


class _TmpFile:
    """A file written under a temporary name; `publish` renames it over `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        path.parent.mkdir(parents=True, exist_ok=True)

    def publish(self) -> None:
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


class JsonlSink(_TmpFile):
    """Writes one JSON line per row, made by `make_row(row, row_id)`."""

    def __init__(self, path: Path, make_row: Callable[[Result, str], Any]) -> None:
        super().__init__(path)
        self.make_row = make_row
        self._enc = msgspec.json.Encoder()
        self._f = self.tmp.open("wb")

    def write(self, row: Result, row_id: str) -> None:
        self._f.write(self._enc.encode(self.make_row(row, row_id)) + b"\n")

    def finish(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def discard(self) -> None:
        self._f.close()
        super().discard()


class ParquetSink(_TmpFile):
    """Writes SpecForge rows plus category, finish_reason and counted_tokens to Parquet."""

    def __init__(self, path: Path, loss_mask: str = "generated") -> None:
        super().__init__(path)
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.loss_mask = loss_mask
        self._pa = pa
        self.schema = pa.schema([
            ("id", pa.string()),
            ("category", pa.string()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int32())),
            ("finish_reason", pa.string()),
            ("counted_tokens", pa.int64()),
        ])
        self._writer = pq.ParquetWriter(str(self.tmp), self.schema)
        self._rows: dict[str, list] = {name: [] for name in self.schema.names}

    def write(self, row: Result, row_id: str) -> None:
        sf = specforge_row(row, row_id, self.loss_mask)
        for name, value in (("id", row_id), ("category", row.category),
                            ("input_ids", sf.input_ids), ("loss_mask", sf.loss_mask),
                            ("finish_reason", row.finish_reason),
                            ("counted_tokens", row.counted_tokens)):
            self._rows[name].append(value)
        if len(self._rows["id"]) >= PARQUET_ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._rows["id"]:
            self._writer.write_table(self._pa.table(self._rows, schema=self.schema))
            self._rows = {name: [] for name in self.schema.names}

    def finish(self) -> None:
        self._flush()
        self._writer.close()
        _fsync(self.tmp)

    def discard(self) -> None:
        self._writer.close()
        super().discard()


def specforge_row(row: Result, row_id: str, loss_mask: str = "generated") -> SpecforgeRow:
    """``input_ids = prompt + output``; loss 0 over the prompt, 1 over every generated
    token (reasoning and end-of-turn tokens included): `loss_mask` "generated". "shifted" moves
    that span one position left, for a trainer that shifts the ids and targets by one but not
    the mask (SpecForge at a6b6b02, issue #885): each supervised position then predicts a
    generated token."""
    n_prompt, n_out = len(row.prompt_ids), len(row.output_ids)
    if loss_mask == "shifted" and n_prompt:
        mask = [0] * (n_prompt - 1) + [1] * n_out + [0]
    else:
        mask = [0] * n_prompt + [1] * n_out
    return SpecforgeRow(id=row_id, input_ids=row.prompt_ids + row.output_ids, loss_mask=mask)


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

    def __init__(self, cfg: Any, renderer: Any = None) -> None:
        self.cfg = cfg
        self.renderer = renderer
        self.unmatched = 0
        self._sources: dict[str, Any] = {}
        self._opened: dict[str, bool] = {}

    def __call__(self, row: Result) -> list[dict] | None:
        sample = self._sample(row)
        messages = None
        if sample is not None and sample.sample_id == row.id and sample.prompt \
                and isinstance(sample.prompt[0], dict):
            messages = list(sample.prompt)
        if messages is None:
            self.unmatched += 1
        return messages

    def conversation(self, row: Result) -> Any:
        """The source `Conversation` of a turn row (None when the source changed)."""
        sample = self._sample(row)
        if sample is None or sample.sample_id != row.conversation_id:
            self.unmatched += 1
            return None
        return sample.conversation

    def replies(self, tokenizer: Any) -> Any:
        """The run's `ReplyParser` (how its generated turns entered the history)."""
        from producer.replies import ReplyParser, reply_parser

        if self.renderer is not None:
            return reply_parser(self.cfg, self.renderer)
        template = tokenizer.chat_template
        template = template if isinstance(template, str) else "\n".join(template.values())
        return ReplyParser(tokenizer, template, self.cfg.reasoning_parser,
                           self.cfg.tool_call_parser)

    def opened(self, category: str, replies: Any) -> bool:
        """Whether the category's generation prompt opened a reasoning block (as the
        producer saw it: a reply cut before its end of reasoning is reasoning)."""
        if category not in self._opened:
            opened = False
            if self.renderer is not None and replies.reasoning is not None:
                try:
                    cat = self.cfg.by_name(category)
                except UnknownCategory:
                    cat = None
                from producer.source import template_kwargs

                kwargs = template_kwargs(self.cfg, cat) if cat else self.cfg.chat_template_kwargs
                opened = self.renderer.opens_reasoning(replies.reasoning.start, kwargs or None)
            self._opened[category] = opened
        return self._opened[category]

    def _sample(self, row: Result) -> Any:
        from producer.formats import Rejected

        try:
            source = self._source(self.cfg.by_name(row.category))
            if 0 <= row.ordinal < len(source):
                return source.read(row.ordinal)
        except (UnknownCategory, KeyError, OSError, SourceError, Rejected) as exc:
            log.debug("%s/%s: no source messages: %s", row.category, row.id, exc)
        return None

    def _source(self, cat: Any) -> Any:
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
    where they were split, `producer.replies`). ``complete`` is true when every turn was
    generated; else ``stopped`` says why it ended: ``rejected:<reason>`` or ``dead:<reason>``
    (a turn that failed, e.g. ``rejected:prompt_too_long`` for a conversation cut by the
    context length) or ``cap`` (its category closed before the next turn was sent). A
    conversation still going on is not written (counted as in progress).
    """

    def __init__(self, path: Path, tokenizer: Decoder, messages_for: MessagesFor | None
                 ) -> None:
        super().__init__(path, lambda r, i: conversation_row(r, i, tokenizer, messages_for))
        self.tokenizer = tokenizer
        self.messages_for = messages_for
        self._turns: dict[str, dict[int, Result]] = {}
        self._replies: Any = None
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
        conv = None
        source = getattr(self.messages_for, "conversation", None)
        if source is not None:
            conv = source(rows[0])
        if self._replies is None:
            replies_of = getattr(self.messages_for, "replies", None)
            if replies_of is not None:
                self._replies = replies_of(self.tokenizer)
            else:
                from producer.replies import ReplyParser

                template = getattr(self.tokenizer, "chat_template", "") or ""
                self._replies = ReplyParser(self.tokenizer, str(template))
        tools = conv.tools if conv is not None else None
        stop_ids = set((rows[0].sampling or {}).get("stop_token_ids") or [])
        opened_of = getattr(self.messages_for, "opened", None)
        opened = opened_of(rows[0].category, self._replies) if opened_of else False
        outputs = [r.output_ids for r in rows]
        conv_key = rows[0].conversation_id or ""
        try:
            generated = self._replies.messages(outputs, tools, conv_key, stop_ids, opened)
        except Unparsed as exc:  # the conversation stopped on the turn that does not parse
            generated = self._replies.messages(outputs[:-1], tools, conv_key, stop_ids, opened)
            generated.append({"role": "assistant", "content": self._replies.text(
                outputs[-1], stop_ids), "unparsed": exc.reason})
        if conv is not None and len(rows) <= conv.turns:
            messages = [*conv.prompt(generated[:-1], self._replies.result_ids(conv_key)),
                        generated[-1]]
        else:
            messages = generated
        doc = {"id": conv_id, "category": rows[0].category, "complete": complete,
               "stopped": stopped, "turns": len(rows), "turns_total": rows[-1].turns_total,
               "finish_reasons": [r.finish_reason for r in rows],
               "prefix_consistent": all(r.prefix_consistent is not False for r in rows),
               "tools": tools, "conversations": messages}
        self._f.write(self._enc.encode(doc) + b"\n")


def make_sinks(
    folder: Path, formats: list[str], tokenizer: Decoder | None,
    messages_for: MessagesFor | None, loss_mask: str = "generated",
) -> list[Any]:
    """One sink per format, writing under `folder`."""
    sinks: list[Any] = []
    try:
        for fmt in formats:
            path = folder / FILE_NAMES[fmt]
            if fmt == "specforge":
                sinks.append(JsonlSink(path, lambda r, i: specforge_row(r, i, loss_mask)))
            elif fmt == "conversations":
                if tokenizer is None:
                    raise ExportError("format conversations needs a tokenizer")
                sinks.append(ConversationSink(path, tokenizer, messages_for))
            else:
                sinks.append(ParquetSink(path, loss_mask))
    except BaseException:
        for sink in sinks:
            sink.discard()
        raise
    return sinks


def truncated_turns(cat_dir: Path) -> dict[str, int]:
    """conversation id -> its first turn cut at max_new_tokens."""
    first: dict[str, int] = {}
    for item in read_results(cat_dir):
        if not isinstance(item, BadLine) and item.conversation_id is not None \
                and item.finish_reason == TRUNCATED:
            first[item.conversation_id] = min(item.turn, first.get(item.conversation_id,
                                                                   item.turn))
    return first


def export_category(
    cat_dir: Path, sinks: list[Any], keep_truncated: bool, id_prefix: str = "",
    allow_simulated: bool = False, consistent_only: bool = False,
) -> CategoryStats:
    """Stream one category's part files into `sinks`; return its counts. The rule for
    truncated output is one for every format: a sample or turn cut at max_new_tokens is
    dropped, and with it every later turn of its conversation (they go on from a reply the
    model did not finish), unless `keep_truncated`. `consistent_only` also drops the turns
    whose prompt does not extend the previous turn's prompt and output (`prefix_consistent`
    false), and the conversations holding one."""
    stats = CategoryStats()
    seen: set[str] = set()
    cut = {} if keep_truncated else truncated_turns(cat_dir)
    for sink in sinks:
        if isinstance(sink, ConversationSink):
            sink.truncated_at = dict(cut)
            sink.consistent_only = consistent_only
    for item in read_results(cat_dir):
        if not isinstance(item, BadLine) and item.simulated and not allow_simulated:
            raise ExportError(f"{cat_dir}: rows were generated by a simulator ({item.model}): "
                              "synthetic outputs, not training data; --allow-simulated "
                              "exports them anyway")
        if isinstance(item, BadLine):
            stats.bad_lines += 1
            if len(stats.bad) < MAX_BAD_REPORTED:
                stats.bad.append(msgspec.structs.asdict(item))
            log.debug("%s: bad line skipped: %s", item.where, item.error)
            continue
        if item.id in seen:
            stats.duplicates += 1
            continue
        seen.add(item.id)
        if item.conversation_id is not None:  # a conversation keeps its truncated turns
            for sink in sinks:
                if isinstance(sink, ConversationSink):
                    sink.add_turn(item)
        if item.finish_reason == TRUNCATED and not keep_truncated:
            stats.dropped_truncated += 1
            continue
        if item.conversation_id is not None and item.turn > cut.get(item.conversation_id,
                                                                     item.turn):
            stats.dropped_after_truncated += 1
            continue
        if consistent_only and item.prefix_consistent is False:
            stats.dropped_inconsistent += 1
            continue
        row_id = id_prefix + item.id
        for sink in sinks:
            if item.conversation_id is None or not isinstance(sink, ConversationSink):
                sink.write(item, row_id)
        stats.rows += 1
        stats.tokens += len(item.prompt_ids) + len(item.output_ids)
        stats.output_tokens += len(item.output_ids)
    for sink in sinks:
        if isinstance(sink, ConversationSink):
            sink.flush_conversations(cat_dir, id_prefix, stats)
    return stats


def export(
    out_dir: Path,
    dest: Path,
    formats: list[str],
    categories: list[str] | None = None,
    merged: bool = False,
    keep_truncated: bool = False,
    tokenizer: Decoder | None = None,
    messages_for: MessagesFor | None = None,
    allow_simulated: bool = False,
    loss_mask: str = "generated",
    consistent_only: bool = False,
) -> dict[str, Any]:
    """Export `categories` (default: every folder of `out_dir` with part files).

    Returns the summary: ``{"out_dir", "dest", "formats", "merged", "keep_truncated",
    "files": [path, ...], "categories": {name: counts}, "total": counts}`` where counts are
    the fields of `CategoryStats` (``bad`` lists up to 20 ``{"where", "error"}``).
    Raises `ExportError` when there is nothing to export or a format is unknown.
    """
    formats = list(dict.fromkeys(formats))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ExportError(f"unknown format(s) {unknown}; choose from {', '.join(FORMATS)}")
    found = find_categories(out_dir)
    names = found if categories is None else [c for c in categories if c in found]
    missing = [] if categories is None else [c for c in categories if c not in found]
    for name in missing:
        log.warning("%s: no part files in %s", name, out_dir / name)
    if not names:
        raise ExportError(f"nothing to export: no <category>/{PART_GLOB} under {out_dir}")
    per_cat: dict[str, CategoryStats] = {}
    all_sinks: list[Any] = []
    try:
        if merged:
            all_sinks = make_sinks(dest, formats, tokenizer, messages_for, loss_mask)
            for name in names:
                per_cat[name] = export_category(out_dir / name, all_sinks, keep_truncated,
                                                f"{name}/", allow_simulated, consistent_only)
        else:
            for name in names:
                sinks = make_sinks(dest / name, formats, tokenizer, messages_for, loss_mask)
                all_sinks.extend(sinks)
                per_cat[name] = export_category(out_dir / name, sinks, keep_truncated,
                                                allow_simulated=allow_simulated,
                                                consistent_only=consistent_only)
        for sink in all_sinks:
            sink.finish()
    except BaseException:
        for sink in all_sinks:
            sink.discard()
        raise
    for k, sink in enumerate(all_sinks):
        try:
            sink.publish()
        except OSError:
            for rest in all_sinks[k:]:
                rest.discard()
            raise
    total = CategoryStats()
    for stats in per_cat.values():
        total.add(stats)
    total_dict = asdict(total)
    total_dict.pop("bad")
    return {
        "out_dir": str(out_dir),
        "dest": str(dest),
        "formats": formats,
        "merged": merged,
        "keep_truncated": keep_truncated,
        "loss_mask": loss_mask,
        "consistent_only": consistent_only,
        "files": [str(sink.path) for sink in all_sinks],
        "categories": {name: asdict(stats) for name, stats in per_cat.items()},
        "total": total_dict,
        "missing": missing,
    }

