"""The proof of a category's hidden-state files: a manifest written last, and the check that
rereads the files against it.

When a category's hidden-state stage ends, `write` puts `<states out>/<category>/manifest.json`
beside its `states/` folder (temporary name, fsync, rename, fsync of the folder): for every
kept row its file, tokens, bytes, dtype, the CRC32 of each tensor (zlib's, as speculators'
Mooncake backend keeps them) and of the file's header (its metadata: a tensor CRC does not
cover it), the layer ids the file holds and, for each, whether it is taken before or after
the model's final norm. The tensors' CRC32s are computed when the worker checks the file
(`StatesFile`, the `hidden_states` of the stage's result row), so the manifest costs no
second read of them; rows of earlier versions name no CRC32, and `complete` reads their files
once when the manifest is written (or takes them from the manifest an earlier end wrote).

`verify` rereads every file against it and names every missing, extra, torn or changed file
(a file holding another row's states is `swapped`, naming that row): what a partial rsync,
bit rot or a file replaced by hand leaves. `tokencap verify STATES_DIR` runs it; the export
asks `Manifest.by_file` before it takes a row's states.
"""

from __future__ import annotations

import datetime
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Literal, NamedTuple

import msgspec

from foundation import hsfile
from foundation.errors import SourceError
from foundation.outputs import STATES_DIR
from foundation.wire import Result

try:  # Intel ISA-L's CRC32 (python-isal): zlib's values at 5x zlib's rate (measured on a
    # Kimi-K2.5 row: 11 ms against 56 ms for 115 MB); zlib's own where no wheel installs
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform isal has no wheel for
    from zlib import crc32

MANIFEST_FILE = "manifest.json"
FORMAT = "tokencap-states-manifest/1"
READ_CHUNK_BYTES = 16 * 1024 * 1024  # a file's tensors are CRC'd this many bytes at a time
Norm = Literal["pre", "post"]  # a layer's states taken before or after the final norm


class StatesFile(msgspec.Struct, frozen=True, kw_only=True):
    """One kept row's file, as the worker that checked it describes it (the `hidden_states`
    of the stage's result row; rows of earlier versions give only file, tokens, layers,
    hidden_size, dtype and bytes: the rest has its default)."""

    file: str  # relative to the states' output folder: <category>/states/<name>.safetensors
    tokens: int
    bytes: int  # the file's size
    dtype: str  # safetensors' name of `hidden_states`: BF16, F16, F32, F8_E4M3
    hidden_size: int
    layers: list[int]
    final_norm: list[Norm] = []  # per layer; [] where unknown
    row: str = ""  # the training row's id
    crc32: dict[str, int] = {}  # per tensor name: zlib.crc32 of its bytes
    header_crc32: int | None = None  # of the file's first 8 + header-length bytes
    layers_from: Literal["file", "config"] = "config"  # where `layers` was read
    engine: str = ""


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format: str = FORMAT
    category: str
    run: str
    written_at: str
    files: list[StatesFile]

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def by_file(self) -> dict[str, StatesFile]:
        """Its entries by file (normalised: as `os.path.relpath` gives a path)."""
        return {os.path.normpath(f.file): f for f in self.files}


class ManifestError(SourceError):
    """A manifest that is not there or cannot be read (exit 2, naming the file)."""


def crc32s(tensors: dict[str, hsfile.Tensor]) -> dict[str, int]:
    """zlib's CRC32 of each tensor's bytes."""
    return {name: crc32(t.data) for name, t in tensors.items()}


def header_crc32(data: bytes | memoryview) -> int:
    """zlib's CRC32 of a safetensors file's header (its length and JSON: dtypes, shapes,
    offsets, metadata), from the file's bytes or at least their start."""
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    return crc32(data[:8 + n])


def manifest_path(states_out: str | Path, category: str) -> Path:
    return Path(states_out) / category / MANIFEST_FILE


def from_result(result: Result) -> StatesFile | None:
    """The manifest entry of one of the stage's result rows (None: it kept no file). A row
    of an earlier version names no row id (its sample's `source_id` is the row) and no
    final-norm side (vLLM takes every layer id before the final norm: "pre"). `ManifestError`
    when its `hidden_states` is not a file's description."""
    desc = result.hidden_states
    if not desc:
        return None
    try:
        entry = msgspec.convert(desc, StatesFile)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"result {result.category}/{result.id}: hidden_states is not a "
                            f"states file's description ({exc})") from None
    if not entry.row and result.source_id:
        entry = msgspec.structs.replace(entry, row=result.source_id)
    if not entry.final_norm:
        entry = msgspec.structs.replace(entry, final_norm=["pre"] * len(entry.layers))
    return entry


class FileRead(NamedTuple):
    """What rereading a states file gives: its tensors' CRC32s, its header's, its size."""

    crc32: dict[str, int]
    header_crc32: int
    size: int


def read_crc32s(path: str | Path, header_only: bool = False) -> FileRead:
    """A states file's CRC32s, streamed (`READ_CHUNK_BYTES` at a time: a file of gigabytes
    costs no more memory than that). `FileNotFoundError` when it is not there, `BadFile`
    (reason `torn`) when it is no whole safetensors file: a header past its end, a tensor
    past its end or not the size of its shape. `header_only`: the header's CRC and the
    checks, no tensor read (`crc32` empty)."""
    p = Path(path)
    with p.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = f.read(8)
        if len(start) < 8:
            raise hsfile.BadFile(p, "torn", "shorter than a safetensors header")
        (n,) = struct.unpack("<Q", start)
        if n > hsfile.HEADER_LIMIT or 8 + n > size:
            raise hsfile.BadFile(p, "torn", "header past the end of the file (cut short?)")
        raw = f.read(n)
        try:
            header = json.loads(raw)
        except ValueError:
            raise hsfile.BadFile(p, "torn", "header is not JSON") from None
        if not isinstance(header, dict):
            raise hsfile.BadFile(p, "torn", "header is not a JSON object")
        header.pop("__metadata__", None)
        spans = []
        for name, spec in header.items():
            try:
                dtype, shape = spec["dtype"], tuple(spec["shape"])
                a, b = (int(x) for x in spec["data_offsets"])
                width = hsfile.DTYPES[dtype][1]
            except (KeyError, TypeError, ValueError):
                raise hsfile.BadFile(p, "torn", f"tensor {name}: not a tensor's header "
                                     "(dtype, shape, data_offsets)") from None
            for dim in shape:
                width *= dim
            if b - a != width or a < 0 or 8 + n + b > size:
                raise hsfile.BadFile(p, "torn", f"tensor {name}: {b - a} bytes for shape "
                                     f"{list(shape)} {dtype}, or past the end (cut short?)")
            spans.append((a, b, name))
        crcs: dict[str, int] = {}
        if not header_only:
            for a, b, name in sorted(spans):
                f.seek(8 + n + a)
                crc, left = 0, b - a
                while left:
                    chunk = f.read(min(left, READ_CHUNK_BYTES))
                    if not chunk:
                        raise hsfile.BadFile(p, "torn", f"tensor {name}: past the end")
                    crc = crc32(chunk, crc)
                    left -= len(chunk)
                crcs[name] = crc
    return FileRead(crcs, crc32(start + raw), size)


def complete(root: str | Path, entry: StatesFile, earlier: StatesFile | None = None
             ) -> StatesFile:
    """`entry` with the CRC32s the worker did not give (rows of earlier versions): those of
    `earlier` (the manifest an earlier end of the stage wrote) where it describes the same
    file of the same size, else read from the file now (its header only, where the tensors'
    are given). Left without them when the file is not there, torn or of another size than
    the row says: `verify` names it."""
    if entry.crc32 and entry.header_crc32 is not None:
        return entry
    if earlier is not None and earlier.file == entry.file and earlier.bytes == entry.bytes \
            and earlier.crc32 and earlier.header_crc32 is not None:
        return msgspec.structs.replace(entry, crc32=entry.crc32 or earlier.crc32,
                                       header_crc32=earlier.header_crc32)
    try:
        got = read_crc32s(Path(root) / entry.file, header_only=bool(entry.crc32))
    except (OSError, hsfile.BadFile):
        return entry
    if got.size != entry.bytes:
        return entry
    return msgspec.structs.replace(entry, crc32=entry.crc32 or got.crc32,
                                   header_crc32=got.header_crc32)


def write(states_out: str | Path, category: str, run: str, files: Iterable[StatesFile]) -> Path:
    """The category's manifest, whole or not at all, one entry per file (the last one a row
    was committed with wins: a row is kept once), in file order. Returns its path."""
    by_file = {f.file: f for f in files}
    doc = Manifest(category=category, run=run, files=sorted(by_file.values(),
                                                            key=lambda f: f.file),
                   written_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    path = manifest_path(states_out, category)
    hsfile.write_whole(path, msgspec.json.format(msgspec.json.encode(doc), indent=1))
    return path


def read(path: str | Path, category: str | None = None) -> Manifest:
    """A manifest, checked: its format, its category (`category`: the folder it lies in), and
    every entry's file a `<category>/states/<name>.safetensors` path. `ManifestError` naming
    the file (and the entry) otherwise, or when there is none."""
    p = Path(path)
    try:
        doc = msgspec.json.decode(p.read_bytes(), type=Manifest)
    except FileNotFoundError:
        raise ManifestError(f"{p}: no manifest (the category's stage has not ended: run "
                            "`tokencap hidden-states CONFIG` to its end)") from None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ManifestError(f"{p}: not a states manifest ({exc})") from None
    if doc.format != FORMAT:
        raise ManifestError(f"{p}: format {doc.format!r}, this version reads {FORMAT!r}")
    if category is not None and doc.category != category:
        raise ManifestError(f"{p}: the manifest of category {doc.category!r}, in the folder "
                            f"of {category!r}")
    for i, entry in enumerate(doc.files):
        parts = PurePosixPath(entry.file).parts
        if len(parts) != 3 or parts[0] != doc.category or parts[1] != STATES_DIR \
                or not parts[2].endswith(".safetensors"):
            raise ManifestError(f"{p}: $.files[{i}].file {entry.file!r} is not "
                                f"{doc.category}/{STATES_DIR}/<name>.safetensors")
    return doc


Kind = Literal["missing", "extra", "torn", "unreadable", "changed", "swapped"]


class Problem(NamedTuple):
    kind: Kind
    file: str  # relative to the states' output folder
    detail: str

    def line(self) -> str:
        return f"{self.kind}: {self.file}: {self.detail}"


class Verified(NamedTuple):
    category: str
    files: int  # in the manifest
    bytes: int  # the manifest's files' bytes
    read: int  # bytes read
    problems: list[Problem]


CrcKey = tuple[tuple[str, int], ...]


def _key(crc: dict[str, int]) -> CrcKey:
    return tuple(sorted(crc.items()))


def check_file(root: str | Path, entry: StatesFile,
               others: dict[CrcKey, StatesFile] | None = None) -> tuple[Problem | None, int]:
    """`entry`'s file reread against its manifest entry: (None: it is as the manifest says,
    else what is wrong; the bytes read). `others` (the manifest's entries by their tensors'
    CRC32s) tells a file holding another row's states (`swapped`) from one changed."""
    row = f"row {entry.row or '?'}"
    path = Path(root) / entry.file
    try:
        got = read_crc32s(path)
    except FileNotFoundError:
        return Problem("missing", entry.file, f"{row}: no such file"), 0
    except hsfile.BadFile as exc:
        return Problem("torn", entry.file, f"{row}: {str(exc).removeprefix(f'{path}: ')}"), 0
    except OSError as exc:
        return Problem("unreadable", entry.file, f"{row}: {exc.strerror or exc}"), 0
    if entry.crc32 and got.crc32 != entry.crc32:
        other = (others or {}).get(_key(got.crc32))
        if other is not None and other.file != entry.file:
            return Problem("swapped", entry.file, f"holds the states of row {other.row or '?'}"
                           f" ({other.file}), not of {row}"), got.size
    if got.size != entry.bytes:
        return Problem("changed", entry.file, f"{row}: {got.size:,} bytes, the manifest says "
                       f"{entry.bytes:,}"), got.size
    if entry.crc32:
        diff = [name for name in sorted(set(got.crc32) | set(entry.crc32))
                if got.crc32.get(name) != entry.crc32.get(name)]
        if diff:
            return Problem("changed", entry.file, f"{row}: the CRC32 of {', '.join(diff)} "
                           "differs from the manifest's"), got.size
    if entry.header_crc32 is not None and got.header_crc32 != entry.header_crc32:
        return Problem("changed", entry.file, f"{row}: the CRC32 of its header (dtypes, shapes, "
                       "metadata) differs from the manifest's"), got.size
    return None, got.size


def verify(states_out: str | Path, category: str,
           on_file: Callable[[int, int], None] | None = None) -> Verified:
    """Every file of the category's manifest reread against it, and every file of its
    `states/` folder that the manifest does not name (`extra`). `on_file(files done, bytes
    read)` after each (progress). Raises `ManifestError` when there is no readable
    manifest."""
    root = Path(states_out)
    doc = read(manifest_path(root, category), category)
    problems: list[Problem] = []
    others = {_key(f.crc32): f for f in doc.files if f.crc32}
    done = read_bytes = 0
    for entry in doc.files:
        problem, size = check_file(root, entry, others)
        if problem is not None:
            problems.append(problem)
        done += 1
        read_bytes += size
        if on_file is not None:
            on_file(done, read_bytes)
    named = doc.by_file()
    for path in sorted(state_files(root, category)):
        rel = os.path.relpath(path, root)
        if rel not in named:
            problems.append(Problem("extra", rel, "in the folder, not in the manifest"))
    return Verified(category, len(doc.files), doc.bytes, read_bytes, problems)


def state_files(root: str | Path, category: str) -> Iterator[Path]:
    """The states files in a category's `states/` folder (not the temporaries)."""
    folder = Path(root) / category / STATES_DIR
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
