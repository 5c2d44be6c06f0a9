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
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec

from foundation.errors import TokencapError
from foundation.outputs import (
    PART_GLOB,
    BadLine,
    categories_on_disk,
    read_results,
)
from producer.manifest import manifest_path
from tokencap.export.conversations import (
    ConversationSink,
    Decoder,
    SourceMessages,
)
from tokencap.export.sinks import (
    TRUNCATED,
    CategoryStats,
    JsonlSink,
    ParquetSink,
    specforge_row,
)

log = logging.getLogger(__name__)

FORMATS = ("specforge", "conversations", "parquet")
FILE_NAMES = {
    "specforge": "specforge.jsonl",
    "conversations": "conversations.jsonl",
    "parquet": "specforge.parquet",
}
MAX_BAD_REPORTED = 20  # bad lines listed per category; the rest are only counted


class ExportError(TokencapError):
    """The export cannot start: no output folder, no categories, unknown format."""


def find_categories(out_dir: Path) -> list[str]:
    """Names of the folders of `out_dir` that hold at least one part file, sorted."""
    if not out_dir.is_dir():
        raise ExportError(f"output folder {out_dir}: no such directory")
    return categories_on_disk(out_dir)


def make_sinks(
    folder: Path, formats: list[str], tokenizer: Decoder | None,
    messages_for: SourceMessages | None, loss_mask: str = "generated",
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


def copy_manifests(out_dir: Path, dest: Path, made_by: list[str]) -> list[Path]:
    """Copy the manifests the exported rows name beside the export (one named by a row but
    missing from `out_dir` is logged, not fatal: an older run's rows name none)."""
    copied = []
    for name in made_by:
        src = manifest_path(out_dir, name)
        if not src.is_file():
            log.warning("rows name %s, whose manifest %s is missing", name, src)
            continue
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / src.name
        shutil.copyfile(src, target)
        copied.append(target)
    return copied


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
    exact_tool_args: bool = False,
) -> CategoryStats:
    """Stream one category's part files into `sinks`; return its counts. The rule for
    truncated output is one for every format: a sample or turn cut at max_new_tokens is
    dropped, and with it every later turn of its conversation (they go on from a reply the
    model did not finish), unless `keep_truncated`. `consistent_only` also drops the turns
    whose prompt does not extend the previous turn's prompt and output (`prefix_consistent`
    false), and the conversations holding one; `exact_tool_args` the turns whose history
    replays a tool result for a call of the same function with other arguments
    (`tool_args_match` false). The replies the gate kept out of training are in no part
    file: no export holds them."""
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
        if exact_tool_args and item.tool_args_match is False:
            stats.dropped_tool_args += 1
            continue
        if item.made_by and item.made_by not in stats.made_by:
            stats.made_by.append(item.made_by)
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
    messages_for: SourceMessages | None = None,
    allow_simulated: bool = False,
    loss_mask: str = "generated",
    consistent_only: bool = False,
    exact_tool_args: bool = False,
) -> dict[str, Any]:
    """Export `categories` (default: every folder of `out_dir` with part files).

    Returns the summary: ``{"out_dir", "dest", "formats", "merged", "keep_truncated",
    "files": [path, ...], "categories": {name: counts}, "total": counts}`` where counts are
    the fields of `CategoryStats` (``bad`` lists up to 20 ``{"where", "error"}``), and
    ``"manifests"``: the run manifests the rows name, copied beside them (`producer.manifest`).
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
                                                f"{name}/", allow_simulated, consistent_only,
                                                exact_tool_args)
        else:
            for name in names:
                sinks = make_sinks(dest / name, formats, tokenizer, messages_for, loss_mask)
                all_sinks.extend(sinks)
                per_cat[name] = export_category(out_dir / name, sinks, keep_truncated,
                                                allow_simulated=allow_simulated,
                                                consistent_only=consistent_only,
                                                exact_tool_args=exact_tool_args)
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
    manifests = copy_manifests(out_dir, dest, total.made_by)
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
        "manifests": [str(p) for p in manifests],
        "categories": {name: asdict(stats) for name, stats in per_cat.items()},
        "total": total_dict,
        "missing": missing,
    }

