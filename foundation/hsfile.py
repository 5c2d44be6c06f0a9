"""Hidden-state files: the safetensors format read and written without torch (the workers
and the export run without it), and the checks a file passes before it counts.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor
(`dtype`, `shape`, `data_offsets` into the buffer that follows) and optional `__metadata__`
strings, then the buffer. vLLM's `extract_hidden_states` writes `hidden_states` [tokens,
layers, hidden] in the model's dtype and `token_ids` (int64); so does tokencap, byte for byte
what the engine gave (bf16 stays bf16: numpy has no bf16, so it is carried as uint16 and
widened to float32 only to be checked).

Writes are whole or absent: a temporary name in the same folder, fsync, rename, fsync of the
folder. A file is checked (`check`) before it counts: its shape, dtype, every value finite, no
layer all zeros (vLLM once returned zeros for some models: vLLM PR #46301), and `token_ids`
equal to the row's ids.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from foundation.errors import TokencapError

if TYPE_CHECKING:
    import numpy as np

# safetensors dtype name -> (numpy dtype name, bytes per element)
DTYPES = {"F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("uint16", 2),
          "I64": ("int64", 8), "I32": ("int32", 4)}
# the config's names
DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own bound on the JSON header


class BadFile(TokencapError):
    """A hidden-state file that cannot count: torn, foreign, or failing a check."""

    def __init__(self, path: str | Path, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{path}: {message}")


class Tensor(NamedTuple):
    dtype: str  # safetensors name: F32, BF16, ...
    shape: tuple[int, ...]
    data: bytes | memoryview

    def array(self) -> np.ndarray:
        """As numpy (BF16 widened to float32)."""
        import numpy as np

        raw = np.frombuffer(self.data, dtype=DTYPES[self.dtype][0]).reshape(self.shape)
        if self.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw


def read(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors of a safetensors file, and its metadata; `BadFile` (reason `torn`) when
    it is not one, or is cut short."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise BadFile(p, "unreadable", f"cannot read: {exc.strerror or exc}") from None
    return decode(data, p)


def decode(data: bytes, p: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """`read` of bytes already read (`p` names them in errors)."""
    if len(data) < 8:
        raise BadFile(p, "torn", "shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > HEADER_LIMIT or 8 + n > len(data):
        raise BadFile(p, "torn", "header past the end of the file (cut short?)")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError:
        raise BadFile(p, "torn", "header is not JSON") from None
    body = memoryview(data)[8 + n:]
    meta = header.pop("__metadata__", None) or {}
    out: dict[str, Tensor] = {}
    for name, spec in header.items():
        dtype, shape = spec.get("dtype"), tuple(spec.get("shape", ()))
        start, end = spec.get("data_offsets", (0, -1))
        if dtype not in DTYPES:
            raise BadFile(p, "dtype", f"tensor {name}: dtype {dtype} not read here")
        size = DTYPES[dtype][1]
        for dim in shape:
            size *= dim
        if end - start != size or end > len(body):
            raise BadFile(p, "torn", f"tensor {name}: {end - start} bytes for shape {shape} "
                          f"{dtype}, or past the end (cut short?)")
        out[name] = Tensor(dtype, shape, body[start:end])
    return out, dict(meta)


def header(path: str | Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header (tensor name -> dtype, shape, data_offsets) and where
    its buffer starts, read without the buffer (a model shard of gigabytes costs nothing)."""
    with Path(path).open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise BadFile(path, "torn", "shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > HEADER_LIMIT:
            raise BadFile(path, "torn", "header too large")
        doc = json.loads(f.read(n))
    doc.pop("__metadata__", None)
    return doc, 8 + n


def read_tensor(path: str | Path, name: str) -> Tensor | None:
    """One tensor of a (possibly large, sharded) safetensors file, read by seeking to it;
    None when the file has no such tensor."""
    doc, base = header(path)
    spec = doc.get(name)
    if spec is None:
        return None
    start, end = spec["data_offsets"]
    with Path(path).open("rb") as f:
        f.seek(base + start)
        return Tensor(spec["dtype"], tuple(spec["shape"]), f.read(end - start))


def encode(tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file's bytes."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        size = len(t.data)
        header[name] = {"dtype": t.dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the buffer starts 8-byte aligned
    return struct.pack("<Q", len(head)) + head + b"".join(bytes(t.data) for t in tensors.values())


def _temp_prefix(p: Path) -> str:
    return f".{p.name}."


def remove_temps(path: str | Path) -> int:
    """Remove the temporary files `write_whole` left beside `path` (an attempt killed while
    writing it); call it once `path` holds its final content. A writer still working on one
    loses it and fails (os.replace finds no file), which leaves `path` as it is. Returns how
    many were removed."""
    p = Path(path)
    removed = 0
    for tmp in p.parent.glob(f"{glob.escape(_temp_prefix(p))}*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed += 1
    return removed


def remove_folder_temps(folder: str | Path) -> int:
    """Remove every temporary `write_whole` left in `folder`: call it only when no writer
    works there (the stage's end). Returns how many were removed."""
    removed = 0
    for tmp in Path(folder).glob(".*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed += 1
    return removed


def write_whole(path: str | Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all: a temporary name beside it, fsync, rename, and
    the folder fsynced (a crash leaves the old file or the new one, never a torn one)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f"{_temp_prefix(p)}{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    fd = os.open(p.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check(path: str | Path, tensors: dict[str, Tensor], ids: list[int], layers: int,
          hidden: int | None, dtype: str | None) -> None:
    """Raise `BadFile` (with its reason) unless `tensors` hold the states of `ids`:
    `hidden_states` [len(ids), layers, hidden] of `dtype` (None: any float), every value
    finite, no layer all zeros; `token_ids` equal to `ids`."""
    import numpy as np

    hs, tok = tensors.get("hidden_states"), tensors.get("token_ids")
    if hs is None or tok is None:
        raise BadFile(path, "foreign", "no hidden_states or token_ids tensor")
    got = tok.array().reshape(-1).tolist()
    if got != list(ids):
        first = next((i for i, (a, b) in enumerate(zip(got, ids, strict=False)) if a != b),
                     min(len(got), len(ids)))
        raise BadFile(path, "token_ids", f"token_ids differ from the row's ids at position "
                      f"{first} ({len(got)} ids, the row has {len(ids)})")
    want = (len(ids), layers) + ((hidden,) if hidden else hs.shape[2:3])
    if len(hs.shape) != 3 or hs.shape != want:
        raise BadFile(path, "shape", f"hidden_states shape {list(hs.shape)}, want {list(want)}")
    if hs.dtype not in ("F32", "F16", "BF16") or (dtype and hs.dtype != dtype):
        raise BadFile(path, "dtype", f"hidden_states dtype {hs.dtype}, want {dtype or 'a float'}")
    # on the raw bits (no widening): not finite = exponent all ones; zero = all but the sign
    exp, mag, kind = {"BF16": (0x7F80, 0x7FFF, np.uint16), "F16": (0x7C00, 0x7FFF, np.uint16),
                      "F32": (0x7F800000, 0x7FFFFFFF, np.uint32)}[hs.dtype]
    bits = np.frombuffer(hs.data, dtype=kind).reshape(hs.shape)
    bad = (bits & exp) == exp
    if bad.any():
        where = np.argwhere(bad)[0].tolist()
        raise BadFile(path, "not_finite", f"a value is not finite at [token, layer, i] = {where}")
    zero = [k for k in range(layers) if not ((bits[:, k, :] & mag) != 0).any()]
    if zero:
        raise BadFile(path, "zero_layer", f"layer slot(s) {zero} all zeros (the engine gave "
                      "no states: vLLM PR #46301)")


def read_engine_file(path: str | Path) -> bytes:
    """The bytes of a file vLLM's hidden-state connector wrote, read under a shared flock on
    `<path>.lock` (its writer holds it exclusively while writing; no lock file: done)."""
    import fcntl

    p = Path(path)
    try:
        fd = os.open(p.with_name(p.name + ".lock"), os.O_RDONLY)
    except FileNotFoundError:
        return p.read_bytes()
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        return p.read_bytes()
    finally:
        os.close(fd)


def remove_engine_file(path: str | Path) -> None:
    """The engine's file and its lock removed (nothing in vLLM deletes them)."""
    p = Path(path)
    for f in (p, p.with_name(p.name + ".lock")):
        try:
            f.unlink()
        except OSError:
            pass


def bytes_per_token(layers: int, hidden: int, dtype: str) -> int:
    """What a token costs on disk: its states and its id (the header aside)."""
    return layers * hidden * DTYPES[DTYPE_NAMES.get(dtype, dtype)][1] + 8
