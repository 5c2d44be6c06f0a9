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
speculators     ``speculators/``         speculators' prepared dataset (`SpeculatorsSink`):
                                         the specforge rows, in order, with ``seq_len``
==============  =======================  ===================================================

With an eval fraction, each file has an eval twin beside it (``specforge.eval.jsonl``...),
rows split by conversation (`tokencap.export.split`); the token formats hold each row within
the length limit (`tokencap.export.length`); the draft vocabulary is written beside them
(`tokencap.export.vocab`), and ``export-manifest.json`` says what was written and why rows
were left out.

Rows of ``turns = "all"`` runs are turns (``<conversation>#t<j>``): specforge and parquet give
one row per turn, its loss mask over that turn's output only (`loss_mask` "generated"; or
"shifted" one position left, for a trainer that does not shift the mask with its targets:
`specforge_row`).
One rule for truncated output in every format: a sample or turn cut at max_new_tokens
(``finish_reason == "length"``) is dropped, and every later turn of its conversation with it
(the conversations export ends the conversation there, ``stopped: "truncated"``), unless
`keep_truncated`, which keeps them, and on a gated run the replies the reply gate kept out
for `length` too (read from ``rejected-replies.jsonl``); the rule is
`foundation.outputs.row_verdicts`, which the hidden-state stage asks too. `consistent_only`
drops the turns whose prompt does not extend the previous turn's prompt and output ids
(``prefix_consistent`` false) and the conversations that hold one.
Rows a simulator generated (``simulated``: synthetic outputs) stop the export unless
`allow_simulated`: they are not training data.
Every file is written to a temporary name beside it, fsynced, and renamed over the final
name only once every file of the export is complete, so a failed export replaces nothing.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from foundation.outputs import (
    PART_GLOB,
    BadLine,
    RowRule,
    categories_on_disk,
    read_dead_letters,
    row_verdicts,
    truncated_turns,
)
from foundation.wire import NEAR_DUPLICATE, contaminated_by
from producer.manifest import manifest_path
from tokencap.export import length
from tokencap.export.conversations import (
    ConversationSink,
    Decoder,
    SourceMessages,
)
from tokencap.export.length import Limits
from tokencap.export.sinks import (
    CategoryStats,
    ExportError,
    ParquetSink,
    SpecforgeSink,
    SpeculatorsSink,
    TrainingRow,
    specforge_row,
)
from tokencap.export.split import Side, side

if TYPE_CHECKING:  # numpy, imported when a vocabulary is counted (not by every command)
    from foundation.config import StatesSpec
    from tokencap.export.state_layouts import KeptStates
    from tokencap.export.vocab import TokenCounts

log = logging.getLogger(__name__)

FORMATS = ("specforge", "conversations", "parquet", "speculators")
FILE_NAMES = {
    "specforge": "specforge.jsonl",
    "conversations": "conversations.jsonl",
    "parquet": "specforge.parquet",
    "speculators": "speculators",
}
EXPORT_MANIFEST = "export-manifest.json"
DEFAULT_SEED = 42  # SpecForge's
DEFAULT_DRAFT_VOCAB = 32_000  # the draft vocabulary most EAGLE-3 drafters use
NO_LIMITS = Limits()
MAX_BAD_REPORTED = 20  # bad lines listed per category; the rest are only counted


def find_categories(out_dir: Path) -> list[str]:
    """Names of the folders of `out_dir` that hold at least one part file, sorted."""
    if not out_dir.is_dir():
        raise ExportError(f"output folder {out_dir}: no such directory")
    return categories_on_disk(out_dir)


def make_sinks(
    folder: Path, formats: list[str], tokenizer: Decoder | None,
    messages_for: SourceMessages | None, side: Side = "train",
    states: StatesSpec | None = None, kept: KeptStates | None = None,
) -> list[Any]:
    """One sink per format, writing under `folder`; an eval side's files are named
    ``<name>.eval<suffix>`` beside the train side's. With `states`, speculators' folder
    holds each row's hs_<i> file and SpecForge's offline files are written too
    (`tokencap.export.state_layouts`), from the files `kept` checked."""
    sinks: list[Any] = []
    try:
        for fmt in formats:
            path = folder / side_name(FILE_NAMES[fmt], side)
            if fmt == "specforge":
                sinks.append(SpecforgeSink(path))
                if states is not None:
                    from tokencap.export.state_layouts import (
                        SPECFORGE_OFFLINE,
                        SpecforgeOfflineSink,
                    )

                    sinks.append(SpecforgeOfflineSink(
                        folder / side_name(SPECFORGE_OFFLINE, side), states, kept))
            elif fmt == "conversations":
                if tokenizer is None:
                    raise ExportError("format conversations needs a tokenizer")
                sinks.append(ConversationSink(path, tokenizer, messages_for))
            elif fmt == "speculators":
                if states is not None:
                    from tokencap.export.state_layouts import SpeculatorsStates

                    sinks.append(SpeculatorsSink(path, SpeculatorsStates(states, kept)))
                else:
                    sinks.append(SpeculatorsSink(path))
            else:
                sinks.append(ParquetSink(path))
    except BaseException:
        for sink in sinks:
            sink.discard()
        raise
    return sinks


def side_name(name: str, side: Side) -> str:
    """A file's name on `side`: the train side keeps it, eval inserts ``.eval`` before the
    extension (``specforge.eval.jsonl``; a folder: ``speculators.eval``)."""
    if side == "train":
        return name
    stem, dot, ext = name.partition(".")
    return f"{stem}.eval{dot}{ext}"


class Shaping(NamedTuple):
    """How results become training rows (see the module docstring)."""

    keep_truncated: bool = False
    allow_simulated: bool = False
    consistent_only: bool = False
    exact_tool_args: bool = False
    loss_mask: str = "generated"
    eval_fraction: float = 0.0
    seed: int = DEFAULT_SEED
    limits: Limits = NO_LIMITS
    mode: str | None = None  # keep the rows of this decode mode only (`--mode`)


def refused_at_intake(cat_dir: Path) -> dict[str, Any]:
    """A category's prompts refused at intake, from its dead letters: near-duplicates, and
    contaminated ones by benchmark."""
    near = 0
    by_bench: dict[str, int] = {}
    for d in read_dead_letters(cat_dir):
        if isinstance(d, BadLine):
            continue
        bench = contaminated_by(d)
        if bench is not None:
            by_bench[bench] = by_bench.get(bench, 0) + 1
        elif d.reason == NEAR_DUPLICATE:
            near += 1
    return {"near_duplicate": near, "contaminated": dict(sorted(by_bench.items()))}


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


def export_category(
    cat_dir: Path, sides: dict[Side, list[Any]], shaping: Shaping, id_prefix: str = "",
    counts: TokenCounts | None = None, kept: KeptStates | None = None,
) -> CategoryStats:
    """Stream one category's training rows into the sinks of each side; return its counts.

    Which committed replies are training rows is `foundation.outputs.row_verdicts`' rule, the
    same for every format and for the hidden-state stage: a sample or turn cut at
    max_new_tokens is dropped, and with it every later turn of its conversation (they go on
    from a reply the model did not finish), unless `keep_truncated` (which also keeps the
    replies a gated run's gate kept out for `length`: they lie in rejected-replies.jsonl).
    `consistent_only` also drops the turns whose prompt does not extend the previous turn's
    prompt and output (`prefix_consistent` false), and the conversations holding one;
    `exact_tool_args` the turns whose history replays a tool result for a call of the same
    function with other arguments (`tool_args_match` false). A row's side is its
    conversation's (`tokencap.export.split`); the token formats get it within the length
    limit (`tokencap.export.length`), and `counts` (the draft vocabulary's) adds the
    loss-masked tokens of the train side's. The replies the gate kept out for its other
    reasons (loop, unclosed_reasoning, empty) are never training rows. With `kept` (an
    export of hidden states), a row's states are taken only as the category's manifest
    proves them (`KeptStates`: `dropped_no_states`, `dropped_bad_states`, or refused)."""
    stats = CategoryStats()
    cut = {} if shaping.keep_truncated else truncated_turns(cat_dir)
    for sinks in sides.values():
        for sink in sinks:
            if isinstance(sink, ConversationSink):
                sink.truncated_at = dict(cut)
                sink.consistent_only = shaping.consistent_only
    rule = RowRule(shaping.keep_truncated, shaping.consistent_only, shaping.exact_tool_args)
    if kept is not None:
        from tokencap.export.state_layouts import reads_file
    for item, why, gated in row_verdicts(cat_dir, rule):
        if not isinstance(item, BadLine) and item.simulated and not shaping.allow_simulated:
            raise ExportError(f"{cat_dir}: rows were generated by a simulator ({item.model}): "
                              "synthetic outputs, not training data; --allow-simulated "
                              "exports them anyway")
        if isinstance(item, BadLine):
            stats.bad_lines += 1
            if len(stats.bad) < MAX_BAD_REPORTED:
                stats.bad.append(msgspec.structs.asdict(item))
            log.debug("%s: bad line skipped: %s", item.where, item.error)
            continue
        if why == "duplicates":
            stats.duplicates += 1
            continue
        if shaping.mode is not None and item.mode != shaping.mode:
            stats.other_modes += 1  # (a conversation's turns share its mode: whole ones)
            continue
        where = side(item.conversation_id or item.id, shaping.eval_fraction, shaping.seed)
        sinks = sides[where]
        # a conversation keeps its truncated turns (a turn the gate kept out only when kept)
        if item.conversation_id is not None and not (gated and why):
            for sink in sinks:
                if isinstance(sink, ConversationSink):
                    sink.add_turn(item)
        if not why and kept is not None:
            # none kept: the trainer would fail on it, or skip it; one the manifest does not
            # prove: refused, or left out
            why = kept.check(item.category, item.id, len(item.prompt_ids) + len(item.output_ids))
        if why:
            setattr(stats, why, getattr(stats, why) + 1)
            continue
        row_id = id_prefix + item.id
        sf = specforge_row(item, row_id, shaping.loss_mask)
        ids, mask, over = length.apply(sf.input_ids, sf.loss_mask, shaping.limits)
        if kept is not None and not over and reads_file(sinks, len(ids), len(sf.input_ids)):
            why = kept.load(item.category, item.id)  # its CRC32s, where its bytes are read
            if why:
                setattr(stats, why, getattr(stats, why) + 1)
                continue
        if item.made_by and item.made_by not in stats.made_by:
            stats.made_by.append(item.made_by)
        if over:  # the token formats leave it out; a conversation row keeps its text
            setattr(stats, f"dropped_{over}", getattr(stats, f"dropped_{over}") + 1)
        elif len(ids) < len(sf.input_ids):
            stats.truncated_to_limit += 1
        row = TrainingRow(row_id, ids, mask, item)
        for sink in sinks:
            if isinstance(sink, ConversationSink):
                if item.conversation_id is None:
                    sink.write(item, row_id)
            elif not over:
                sink.write_row(row)
        if over:
            continue
        stats.rows += 1
        stats.tokens += len(ids)
        stats.output_tokens += len(item.output_ids)
        if item.mode:
            stats.count_mode(item.mode, len(ids), len(item.output_ids))
        stats.loss_tokens += sum(mask)
        if where == "eval":
            stats.eval_rows += 1
            stats.eval_tokens += len(ids)
        elif counts is not None:
            counts.add(ids, mask, f"{cat_dir.name}/{item.id}")
    for sinks in sides.values():
        for sink in sinks:
            if isinstance(sink, ConversationSink):
                sink.flush_conversations(cat_dir, id_prefix, stats)
    return stats


class Vocab(NamedTuple):
    """The draft vocabulary to write (`tokencap.export.vocab`)."""

    target_size: int  # the target model's vocabulary (t2d's length)
    draft_size: int = DEFAULT_DRAFT_VOCAB
    origin: str = ""  # where target_size came from, for the manifest


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
    eval_fraction: float = 0.0,
    seed: int = DEFAULT_SEED,
    limits: Limits = NO_LIMITS,
    vocab: Vocab | None = None,
    states: StatesSpec | None = None,
    skip_bad_states: bool = False,
    mode: str | None = None,
    weights: dict[str, dict[str, float]] | None = None,
    family_of: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Export `categories` (default: every folder of `out_dir` with part files); with
    `states`, the hidden states of each row as its category's manifest proves them
    (`tokencap.export.state_layouts.KeptStates`: a category whose files disagree is refused,
    `StatesRefused`, unless `skip_bad_states`). With `mode`, only the rows made in that
    decode mode; `weights` (category -> mode -> share, the run config's) go in the
    manifest's ``"modes"`` beside the rows and tokens written per mode, the folders of a
    `share = "tokens"` category's budgets added up under its name (`family_of`: folder ->
    category).

    Returns the summary: ``{"out_dir", "dest", "formats", "merged", "keep_truncated",
    "files": [path, ...], "categories": {name: counts}, "total": counts}`` where counts are
    the fields of `CategoryStats` (``bad`` lists up to 20 ``{"where", "error"}``),
    ``"manifests"``: the run manifests the rows name, copied beside them (`producer.manifest`),
    ``"split"``, ``"limits"`` and, with `vocab`, ``"vocab"`` (sizes, files, coverage per
    category and merged). The same document is written beside the export
    (``export-manifest.json``). Raises `ExportError` when there is nothing to export or a
    format is unknown.
    """
    formats = list(dict.fromkeys(formats))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ExportError(f"unknown format(s) {unknown}; choose from {', '.join(FORMATS)}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ExportError(f"--eval-fraction {eval_fraction}: choose a number in [0, 1)")
    found = find_categories(out_dir)
    names = found if categories is None else [c for c in categories if c in found]
    missing = [] if categories is None else [c for c in categories if c not in found]
    for name in missing:
        log.warning("%s: no part files in %s", name, out_dir / name)
    if not names:
        raise ExportError(f"nothing to export: no <category>/{PART_GLOB} under {out_dir}")
    shaping = Shaping(keep_truncated, allow_simulated, consistent_only, exact_tool_args,
                      loss_mask, eval_fraction, seed, limits, mode)
    side_names: list[Side] = ["train", "eval"] if eval_fraction > 0 else ["train"]
    per_cat: dict[str, CategoryStats] = {}
    counts: dict[str, TokenCounts] = {}
    all_sinks: list[Any] = []
    kept = None
    if states is not None:
        from tokencap.export.state_layouts import KeptStates

        kept = KeptStates(states, skip_bad_states)
        for name in names:  # a category without a manifest: refused before anything is made
            kept.open(name)

    def open_sides(folder: Path) -> dict[Side, list[Any]]:
        sides = {}
        for s in side_names:
            sides[s] = make_sinks(folder, formats, tokenizer, messages_for, s, states, kept)
            all_sinks.extend(sides[s])
        return {"train": [], "eval": [], **sides}

    try:
        shared = open_sides(dest) if merged else None
        for name in names:
            sides = shared if shared is not None else open_sides(dest / name)
            if vocab is not None:
                from tokencap.export.vocab import TokenCounts

                counts[name] = TokenCounts(vocab.target_size)
            per_cat[name] = export_category(out_dir / name, sides, shaping,
                                            f"{name}/" if merged else "", counts.get(name),
                                            kept)
        for sink in all_sinks:
            sink.finish()
        vocab_doc = _write_vocab(dest, names, counts, vocab, all_sinks, merged) \
            if vocab is not None else None
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
    summary = {
        "out_dir": str(out_dir),
        "dest": str(dest),
        "formats": formats,
        "merged": merged,
        "keep_truncated": keep_truncated,
        "loss_mask": loss_mask,
        "consistent_only": consistent_only,
        "split": {"eval_fraction": eval_fraction, "seed": seed, "by": "conversation id",
                  "eval_files": [side_name(FILE_NAMES[f], "eval") for f in formats]
                  if eval_fraction > 0 else []},
        "limits": limits.describe(),
        "hidden_states": None if states is None else _states_doc(states, skip_bad_states),
        "files": [str(sink.path) for sink in all_sinks],
        "manifests": [str(p) for p in manifests],
        "categories": {name: asdict(stats) for name, stats in per_cat.items()},
        # prompts the intake screens refused, per category (docs/MIX.md)
        "refused_at_intake": {name: refused_at_intake(out_dir / name) for name in per_cat},
        "total": total_dict,
        "missing": missing,
        "mode": mode,
        "modes": modes_doc(per_cat, weights or {}, family_of or {}),
    }
    if vocab_doc is not None:
        summary["vocab"] = vocab_doc
    dest.mkdir(parents=True, exist_ok=True)
    (dest / EXPORT_MANIFEST).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def modes_doc(per_cat: dict[str, CategoryStats], weights: dict[str, dict[str, float]],
              family_of: dict[str, str]) -> dict[str, Any]:
    """Per category with modes (a `share = "tokens"` category's budgets, `family_of`,
    added up under its name): each mode's rows and tokens written, their shares of the
    category's, and the mode's weight (its share in the config; None: not known here)."""
    grouped: dict[str, CategoryStats] = {}
    for name, stats in per_cat.items():
        family = family_of.get(name, name)
        if stats.modes or family in weights:
            grouped.setdefault(family, CategoryStats()).add(stats)
    out: dict[str, Any] = {}
    for name, stats in grouped.items():
        rows = sum(v["rows"] for v in stats.modes.values()) or 1
        tokens = sum(v["tokens"] for v in stats.modes.values()) or 1
        mine = weights.get(name, {})
        counts = {**{m: {"rows": 0, "tokens": 0, "output_tokens": 0} for m in mine},
                  **stats.modes}
        out[name] = {m: {**v, "share_rows": round(v["rows"] / rows, 4),
                         "share_tokens": round(v["tokens"] / tokens, 4),
                         "weight": mine.get(m)} for m, v in sorted(counts.items())}
    return out


def _states_doc(states: StatesSpec, skip_bad_states: bool) -> dict[str, Any]:
    """The export manifest's `hidden_states`: where they came from, their layers and dtype,
    and each trainer's flags for them (`state_layouts.trainer_flags`)."""
    from tokencap.export.state_layouts import trainer_flags

    return {"from": states.output_dir, "layers": list(states.layers),
            "hidden_size": states.hidden_size, "dtype": states.dtype,
            "checked": "every row's file against its category's manifest (tokencap verify "
                       "rereads them all)", "skip_bad_states": skip_bad_states,
            "trainers": trainer_flags(states)}


def _write_vocab(dest: Path, names: list[str], counts: dict[str, TokenCounts], vocab: Vocab,
                 sinks: list[Any], merged: bool) -> dict[str, Any]:
    """The draft vocabulary's files: frequencies per category (in its folder) and merged,
    the mapping from the merged ones, beside the export and in every speculators folder
    (its `--data-path`); the coverage table."""
    from tokencap.export import vocab as vocab_files
    from tokencap.export.vocab import TokenCounts

    merged_counts = TokenCounts(vocab.target_size).merged(counts.values())
    files: list[Path] = []
    missing_torch = False
    if not merged:
        for name in names:
            written = vocab_files.write_counts(dest / name, counts[name])
            files += written.files
    # (where it is written now, where it lies once published)
    folders = [(dest, dest), *((s.folder, s.path) for s in sinks
                               if isinstance(s, SpeculatorsSink) and not s.path.name.endswith(
                                   ".eval"))]
    for folder, final in folders:
        for written in (vocab_files.write_counts(folder, merged_counts),
                        vocab_files.write_mapping(folder, merged_counts, vocab.draft_size)):
            files += [final / f.name for f in written.files]
            missing_torch = missing_torch or written.missing_torch
    if missing_torch:
        log.warning(vocab_files.TORCH_HINT)
    return {
        "target_vocab_size": vocab.target_size, "target_vocab_from": vocab.origin,
        "draft_vocab_size": vocab.draft_size,
        "tie_rule": "count descending, then lower id (speculators'); padded with the "
                    "smallest unused ids",
        "counted": "loss-masked tokens of the train side, within the length limit",
        "loss_tokens": {**{n: c.total for n, c in counts.items()},
                        "merged": merged_counts.total},
        "distinct_ids": int((merged_counts.counts > 0).sum()),
        "coverage": {**{n: c.coverage() for n, c in counts.items()},
                     "merged": merged_counts.coverage()},
        "files": [str(f) for f in files],
        "torch": not missing_torch,
    }
