"""The output files of a run: their layout, and the one reader of their lines.

```
<out>/<category>/part-00000.jsonl    committed samples, one `wire.Result` a line, appended by
<out>/<category>/part-00001.jsonl    the writer (a new part after PART_MAX_BYTES)
<out>/<category>/dead-letter.jsonl   rejected and dead samples, one `wire.DeadLetter` a line
```

The writer (writer/writer.py) is the only one that appends; reconcile, export, plan and
the test harness read through `read_results` / `read_dead_letters`, which yield each line
decoded or a `BadLine` naming `file:line` (line numbers count every physical line).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import msgspec

from foundation.wire import DeadLetter, Result

PART_GLOB = "part-*.jsonl"
DEAD_FILE = "dead-letter.jsonl"
PART_MAX_BYTES = 256 * 1024 * 1024
_TAIL_CHUNK_BYTES = 65536

T = TypeVar("T")


class BadLine(msgspec.Struct, frozen=True):
    """A line of an output file that is not what it should be."""

    where: str
    error: str


def category_dir(out_dir: Path, category: str) -> Path:
    return out_dir / category


def part_path(cat_dir: Path, number: int) -> Path:
    return cat_dir / f"part-{number:05d}.jsonl"


def part_files(cat_dir: Path) -> list[Path]:
    """The category's result files in write order."""
    return sorted(cat_dir.glob(PART_GLOB))


def dead_letter_path(cat_dir: Path) -> Path:
    return cat_dir / DEAD_FILE


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
    """Every committed sample on disk for one category, in write order."""
    return read_lines(part_files(cat_dir), Result)


def read_dead_letters(cat_dir: Path) -> Iterator[DeadLetter | BadLine]:
    """Every rejected or dead sample on disk for one category."""
    path = dead_letter_path(cat_dir)
    return read_lines([path] if path.exists() else [], DeadLetter)


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
