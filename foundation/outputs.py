"""The output files of a run: their layout, and the one reader of their lines.

```
<out>/<category>/part-00000.jsonl        training rows: committed samples the reply gate kept,
<out>/<category>/part-00001.jsonl        one `wire.Result` a line (a new part after
                                         PART_MAX_BYTES)
<out>/<category>/rejected-replies.jsonl  committed samples the reply gate kept out of training
                                         (`Result.gate`: loop, length, unclosed_reasoning,
                                         empty), whole
<out>/<category>/failed.jsonl            samples never generated: input refused (a bad record,
                                         too long, a duplicate prompt, an orphan tool result)
                                         or the engine failed on every try (`wire.DeadLetter`)
<out>/<category>/stopped.jsonl           conversations' turns not generated: held back by the
                                         category's cap (a raised cap sends them), or stopped by
                                         policy (tool_divergence, unparsed_reply, ...)

<states out>/<category>/rows.jsonl       a hidden-state stage's source: the category's training
                                         rows, one `StatesRow` a line (append-only)
<states out>/<category>/states/<h>.safetensors  a row's checked hidden states, named by the
                                         row (`states_file`; `foundation/hsfile.py` the format)
```

Which committed replies are training rows is decided here once (`row_verdicts`,
`training_rows`): the export and the hidden-state stage both ask it.

`dead-letter.jsonl` (what earlier versions wrote for both of the last two) is still read,
never written. The writer (writer/writer.py) is the only one that appends; reconcile,
export, plan and the test harness read through `read_results` (training rows),
`read_committed` (every committed sample) and `read_dead_letters`, which yield each line
decoded or a `BadLine` naming `file:line` (line numbers count every physical line).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, TypeVar

import msgspec

from foundation.wire import DeadLetter, Outcome, Result

PART_GLOB = "part-*.jsonl"
REJECTED_FILE = "rejected-replies.jsonl"
FAILED_FILE = "failed.jsonl"
STOPPED_FILE = "stopped.jsonl"
LEGACY_DEAD_FILE = "dead-letter.jsonl"  # read, never written
STATES_DIR = "states"  # a category's hidden-state files, under the states' output folder
ROWS_FILE = "rows.jsonl"  # a hidden-state stage's source, beside them
PART_MAX_BYTES = 256 * 1024 * 1024
_TAIL_CHUNK_BYTES = 65536

T = TypeVar("T")


class BadLine(msgspec.Struct, frozen=True):
    """A line of an output file that is not what it should be."""

    where: str
    error: str


# SGLang's (and vLLM's) finish_reason for an output cut at max_new_tokens
TRUNCATED = "length"


def category_dir(out_dir: Path, category: str) -> Path:
    return out_dir / category


def part_path(cat_dir: Path, number: int) -> Path:
    return cat_dir / f"part-{number:05d}.jsonl"


def part_files(cat_dir: Path) -> list[Path]:
    """The category's result files in write order."""
    return sorted(cat_dir.glob(PART_GLOB))


def relative_where(where: str, out_dir: Path) -> str:
    """A source record's ``path:line`` as the output files say it: the path relative to
    the output folder, so that a row says where it came from on any host."""
    path, sep, line = where.rpartition(":")
    if not sep or not path:
        return where
    return f"{os.path.relpath(path, out_dir)}:{line}"


def rejected_path(cat_dir: Path) -> Path:
    return cat_dir / REJECTED_FILE


def letter_path(cat_dir: Path, outcome: Outcome) -> Path:
    """The file of a dead letter: a turn cut or stopped goes to `stopped.jsonl`, a sample
    rejected or dead to `failed.jsonl`."""
    stopped = outcome in (Outcome.CUT, Outcome.STOPPED)
    return cat_dir / (STOPPED_FILE if stopped else FAILED_FILE)


def letter_files(cat_dir: Path) -> list[Path]:
    """The category's dead-letter files that exist (the legacy one first)."""
    names = (LEGACY_DEAD_FILE, FAILED_FILE, STOPPED_FILE)
    return [cat_dir / n for n in names if (cat_dir / n).exists()]


def written_files(cat_dir: Path) -> list[Path]:
    """Every file of the category the writer appends to, that exists."""
    rejected = rejected_path(cat_dir)
    return [*part_files(cat_dir), *([rejected] if rejected.exists() else []),
            *letter_files(cat_dir)]


def categories_on_disk(out_dir: Path) -> list[str]:
    """Names of the folders of `out_dir` that hold at least one part file, sorted."""
    return sorted(p.name for p in out_dir.iterdir() if p.is_dir() and part_files(p))


def read_lines(paths: list[Path], kind: type[T]) -> Iterator[T | BadLine]:
    """Decode every non-blank line of `paths` in order as `kind`; a line that is not one
    is yielded as a `BadLine` instead."""
    decoder = msgspec.json.Decoder(kind)
    for path in paths:
        with path.open("rb") as f:
            for no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    yield BadLine(f"{path}:{no}", str(exc))


def read_results(cat_dir: Path) -> Iterator[Result | BadLine]:
    """The training rows on disk for one category, in write order."""
    return read_lines(part_files(cat_dir), Result)


def read_rejected(cat_dir: Path) -> Iterator[Result | BadLine]:
    """The replies the gate kept out of training, for one category."""
    path = rejected_path(cat_dir)
    return read_lines([path] if path.exists() else [], Result)


def committed_files(cat_dir: Path) -> list[Path]:
    """The files of a category's committed samples: its part files, then the replies the
    gate kept out (where there are any)."""
    path = rejected_path(cat_dir)
    return [*part_files(cat_dir), *([path] if path.exists() else [])]


def read_committed(cat_dir: Path) -> Iterator[Result | BadLine]:
    """Every committed sample on disk for one category: its training rows, then the
    replies the gate kept out."""
    return read_lines(committed_files(cat_dir), Result)


def count_committed(cat_dir: Path) -> int:
    """How many committed samples a category has on disk (`read_committed`'s items, a bad
    line included), counted without decoding one."""
    n = 0
    for path in committed_files(cat_dir):
        with path.open("rb") as f:
            n += sum(1 for line in f if line.strip())
    return n


class _TurnEnd(msgspec.Struct):
    """What `truncated_turns` reads of a result line: a `Result`'s fields, the large ones
    (ids, text, sampling) only found there (`Raw`: parsed past, never built), so that a line
    that is no result (a field of one missing, or of another type) says nothing of its turn
    here either, as `read_results` calls it bad; only the large fields' types go unchecked."""

    id: str
    category: str
    prompt_ids: msgspec.Raw
    output_ids: msgspec.Raw
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    text: msgspec.Raw
    sampling: msgspec.Raw
    counted_tokens: int
    conversation_id: str | None = None
    turn: int = 0


def truncated_turns(cat_dir: Path) -> dict[str, int]:
    """conversation id -> its first turn cut at max_new_tokens: that turn and every later one
    are no training row (they go on from a reply the model did not finish). The one rule the
    export and the hidden-state stage both apply."""
    first: dict[str, int] = {}
    for item in read_lines(part_files(cat_dir), _TurnEnd):
        if not isinstance(item, BadLine) and item.conversation_id is not None \
                and item.finish_reason == TRUNCATED:
            first[item.conversation_id] = min(item.turn, first.get(item.conversation_id,
                                                                   item.turn))
    return first


def after_truncation(item: Result, cut: dict[str, int]) -> bool:
    """Whether `item` is a later turn of a conversation cut before it (`truncated_turns`)."""
    return item.conversation_id is not None and item.turn > cut.get(item.conversation_id,
                                                                    item.turn)


class RowRule(NamedTuple):
    """Which committed replies are training rows, past the reply gate: a reply cut at
    max_new_tokens (and the later turns of its conversation) is none unless
    `keep_truncated`; `consistent_only` also leaves out a turn whose prompt does not extend
    the turn before (`prefix_consistent` false), `exact_tool_args` one whose history replays
    a tool result for a call with other arguments (`tool_args_match` false)."""

    keep_truncated: bool = False
    consistent_only: bool = False
    exact_tool_args: bool = False


DEFAULT_RULE = RowRule()


class Verdict(NamedTuple):
    """A committed reply (or a bad line) and why it is no training row: "" when it is one,
    else the reason, named as the export counts it (`dropped_truncated`, ...,
    `duplicates`, `bad_lines`). `gated`: it lies in rejected-replies.jsonl (the gate kept it
    out for its `length` reason)."""

    item: Result | BadLine
    left_out: str
    gated: bool = False


def row_verdicts(cat_dir: Path, rule: RowRule = DEFAULT_RULE) -> Iterator[Verdict]:
    """Every committed reply of a category with its verdict (`Verdict`), in write order:
    the part files, then the replies the gate kept out for `length` only (on a gated run
    the cut replies lie there; the gate\'s other reasons are never training rows). The one
    owner of "is this a training row?": `export` and the hidden-state stage ask it."""
    cut = {} if rule.keep_truncated else truncated_turns(cat_dir)
    seen: set[str] = set()
    gated = (r for r in read_rejected(cat_dir)
             if isinstance(r, BadLine) or r.gate == TRUNCATED)
    for is_gated, items in ((False, read_results(cat_dir)), (True, gated)):
        for item in items:
            if isinstance(item, BadLine):
                yield Verdict(item, "bad_lines", is_gated)
                continue
            if item.id in seen:
                yield Verdict(item, "duplicates", is_gated)
                continue
            seen.add(item.id)
            yield Verdict(item, _left_out(item, rule, cut), is_gated)


def _left_out(item: Result, rule: RowRule, cut: dict[str, int]) -> str:
    if item.finish_reason == TRUNCATED and not rule.keep_truncated:
        return "dropped_truncated"
    if after_truncation(item, cut):
        return "dropped_after_truncated"
    if rule.consistent_only and item.prefix_consistent is False:
        return "dropped_inconsistent"
    if rule.exact_tool_args and item.tool_args_match is False:
        return "dropped_tool_args"
    return ""


def training_rows(cat_dir: Path, rule: RowRule = DEFAULT_RULE) -> Iterator[Result]:
    """The category's training rows (`row_verdicts` with nothing to say), in write order."""
    for v in row_verdicts(cat_dir, rule):
        if not v.left_out:
            assert isinstance(v.item, Result)
            yield v.item


class StatesRow(msgspec.Struct, frozen=True):
    """A line of a hidden-state stage's rows file: the training row (`id`, the row's own id:
    the stage's sample carries it as `Pending.row_id`) and its ids, prompt then output."""

    id: str
    input_ids: list[int]


def states_dir(states_out: str | Path, category: str) -> Path:
    """The folder of a category's hidden-state files."""
    return Path(states_out) / category / STATES_DIR


def states_file(states_out: str | Path, category: str, row_id: str) -> Path:
    """Where a row's hidden states are kept: named by the row, so a row has one file however
    often it is sent."""
    digest = hashlib.sha256(row_id.encode()).hexdigest()[:24]
    return states_dir(states_out, category) / f"{digest}.safetensors"


def rows_file(states_out: str | Path, category: str) -> Path:
    """A hidden-state stage's source for one category (`StatesRow` lines)."""
    return Path(states_out) / category / ROWS_FILE


def read_dead_letters(cat_dir: Path) -> Iterator[DeadLetter | BadLine]:
    """Every sample of one category not generated on disk: failed, cut or stopped."""
    return read_lines(letter_files(cat_dir), DeadLetter)


def repair_tail(path: Path) -> int:
    """Cut a partial last line (no trailing newline, from a crash mid-write). Returns the
    bytes removed."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with path.open("rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        pos, keep = size, 0
        while pos > 0:
            start = max(0, pos - _TAIL_CHUNK_BYTES)
            f.seek(start)
            nl = f.read(pos - start).rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        f.truncate(keep)
        os.fsync(f.fileno())
        return size - keep
