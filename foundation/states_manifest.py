"""The proof of a category's hidden-state files: a manifest written last, and the check that
rereads the files against it.

When a category's hidden-state stage ends, `write` puts `<states out>/<category>/manifest.json`
beside its `states/` folder (temporary name, fsync, rename, fsync of the folder): for every
kept row its file, tokens, bytes, dtype, the CRC32 of each tensor (zlib's, as speculators'
Mooncake backend keeps them), the layer ids the file holds and, for each, whether it is taken
before or after the model's final norm. The CRC32s are computed when the worker checks the
file (`StatesFile`, the `hidden_states` of the stage's result row), so the manifest costs no
second read.

`verify` rereads every file against it and names every missing, extra, torn or changed file
(a file holding another row's states is named with that row): what a partial rsync, bit rot or
a file replaced by hand leaves. `tokencap verify STATES_DIR` runs it.
"""

from __future__ import annotations

import datetime
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec

from foundation import hsfile
from foundation.outputs import STATES_DIR

MANIFEST_FILE = "manifest.json"
FORMAT = "tokencap-states-manifest/1"
Norm = Literal["pre", "post"]  # a layer's states taken before or after the final norm


class StatesFile(msgspec.Struct, frozen=True, kw_only=True):
    """One kept row's file, as the worker that checked it describes it (the `hidden_states`
    of the stage's result row; rows of earlier versions lack `row` and `crc32`)."""

    file: str  # relative to the states' output folder
    tokens: int
    bytes: int
    dtype: str  # safetensors' name of `hidden_states`: BF16, F16, F32, F8_E4M3
    hidden_size: int
    layers: list[int]
    final_norm: list[Norm] = []  # per layer; [] where unknown
    row: str = ""  # the training row's id
    crc32: dict[str, int] = {}  # per tensor name
    layers_from: Literal["file", "config"] = "config"  # where `layers` was read
    engine: str = ""


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format: str = FORMAT
    category: str
    run: str
    written_at: str
    files: list[StatesFile]


def crc32s(tensors: dict[str, hsfile.Tensor]) -> dict[str, int]:
    """zlib's CRC32 of each tensor's bytes."""
    return {name: zlib.crc32(t.data) for name, t in tensors.items()}


def manifest_path(states_out: str | Path, category: str) -> Path:
    return Path(states_out) / category / MANIFEST_FILE


def write(states_out: str | Path, category: str, run: str, files: Iterable[StatesFile]) -> Path:
    """The category's manifest, whole or not at all, one entry per file (the last one a row
    was committed with wins: a row is kept once). Returns its path."""
    by_file = {f.file: f for f in files}
    doc = Manifest(category=category, run=run, files=sorted(by_file.values(),
                                                            key=lambda f: f.file),
                   written_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    path = manifest_path(states_out, category)
    hsfile.write_whole(path, msgspec.json.format(msgspec.json.encode(doc), indent=1))
    return path


class ManifestError(Exception):
    """A manifest that cannot be read."""


def read(path: str | Path) -> Manifest:
    p = Path(path)
    try:
        return msgspec.json.decode(p.read_bytes(), type=Manifest)
    except FileNotFoundError:
        raise ManifestError(f"{p}: no manifest (the category's stage has not ended: run "
                            "`tokencap hidden-states CONFIG` to its end)") from None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ManifestError(f"{p}: not a states manifest ({exc})") from None


class Problem(NamedTuple):
    kind: Literal["missing", "extra", "torn", "changed", "swapped"]
    file: str  # relative to the states' output folder
    detail: str

    def line(self) -> str:
        return f"{self.kind}: {self.file}: {self.detail}"


class Verified(NamedTuple):
    category: str
    files: int  # in the manifest
    bytes: int  # read
    problems: list[Problem]


def check_file(root: Path, entry: StatesFile) -> Problem | None:
    """`entry`'s file against its manifest entry: present, whole, the same bytes (None: it
    is). A file holding other bytes is `changed` (`swapped` is `verify`'s, which knows the
    other entries)."""
    path = root / entry.file
    try:
        tensors = hsfile.read(path)[0]
    except hsfile.BadFile as exc:
        if not path.exists():
            return Problem("missing", entry.file, f"row {entry.row or '?'}: no such file")
        return Problem("torn", entry.file, f"{exc.reason}: {exc}")
    size = path.stat().st_size
    if size != entry.bytes:
        return Problem("changed", entry.file, f"{size:,} bytes, the manifest says "
                       f"{entry.bytes:,}")
    got = crc32s(tensors)
    diff = [name for name in sorted(set(got) | set(entry.crc32))
            if got.get(name) != entry.crc32.get(name)]
    if diff:
        return Problem("changed", entry.file, f"CRC32 of {', '.join(diff)} differs from the "
                       "manifest's")
    return None


def verify(states_out: str | Path, category: str,
           on_file: Callable[[int, int], None] | None = None) -> Verified:
    """Every file of the category's manifest reread against it, and every file of its
    `states/` folder that the manifest does not name (`extra`). `on_file(done, bytes)` after
    each (progress). Raises `ManifestError` when there is no readable manifest."""
    root = Path(states_out)
    doc = read(manifest_path(root, category))
    problems: list[Problem] = []
    crc_owner = {_key(f.crc32): f for f in doc.files if f.crc32}
    done = read_bytes = 0
    for entry in doc.files:
        problem = check_file(root, entry)
        if problem is not None and problem.kind == "changed":
            problem = _swapped(root, entry, crc_owner) or problem
        if problem is not None:
            problems.append(problem)
        done += 1
        read_bytes += entry.bytes
        if on_file is not None:
            on_file(done, read_bytes)
    named = {os.path.normpath(f.file) for f in doc.files}
    for path in sorted(_state_files(root, category)):
        rel = os.path.relpath(path, root)
        if rel not in named:
            problems.append(Problem("extra", rel, "in the folder, not in the manifest"))
    return Verified(category, len(doc.files), read_bytes, problems)


def _key(crc: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(crc.items()))


def _swapped(root: Path, entry: StatesFile, owner: dict[tuple[tuple[str, int], ...],
                                                        StatesFile]) -> Problem | None:
    """A changed file whose bytes are another row's (their CRC32s match that row's entry)."""
    try:
        got = crc32s(hsfile.read(root / entry.file)[0])
    except hsfile.BadFile:
        return None
    other = owner.get(_key(got))
    if other is None or other.file == entry.file:
        return None
    return Problem("swapped", entry.file, f"holds the states of row {other.row or '?'} "
                   f"({other.file}), not of row {entry.row or '?'}")


def _state_files(root: Path, category: str) -> Iterator[Path]:
    folder = root / category / STATES_DIR
    if folder.is_dir():
        yield from (p for p in folder.glob("*.safetensors") if p.is_file())


def categories(states_out: str | Path) -> list[str]:
    """The categories under a states' output folder: those with a `states/` folder or a
    manifest."""
    root = Path(states_out)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if (p / STATES_DIR).is_dir() or (p / MANIFEST_FILE).is_file())
