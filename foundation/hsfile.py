"""Hidden-state files: the safetensors format read and written without torch (the workers
and the export run without it), and the checks a file passes before it counts.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor
(`dtype`, `shape`, `data_offsets` into the buffer that follows) and optional `__metadata__`
strings, then the buffer. vLLM's `extract_hidden_states` writes `hidden_states` [tokens,
layers, hidden] in the model's dtype and `token_ids` (int64); so does tokencap, byte for byte
what the engine gave (bf16 stays bf16: numpy has no bf16, so it is carried as uint16 and
widened to float32 only to be checked).

Writes are whole or absent: a temporary name in the same folder, fsync, rename, fsync of the
folder. A row's file is the engine's own, checked in place and renamed (`keep_file`): each
byte of states is written once. A file is checked (`check`) before it counts: its shape,
dtype, every value finite, no layer all zeros (vLLM once returned zeros for some models: vLLM
PR #46301), and `token_ids` equal to the row's ids.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import mmap
import os
import shutil
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from foundation.errors import TokencapError

if TYPE_CHECKING:
    import numpy as np

# safetensors dtype name -> (numpy dtype name, bytes per element); FP8 is carried as its bytes
DTYPES = {"F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("uint16", 2),
          "F8_E4M3": ("uint8", 1), "I64": ("int64", 8), "I32": ("int32", 4)}
FLOATS = ("F32", "F16", "BF16")  # what an engine writes states in
FP8 = "F8_E4M3"
# the config's names
DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "fp8_e4m3": FP8}
HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own bound on the JSON header
# speculators' FP8 layout (hs-connectors' fp8_utils): `hidden_states` float8_e4m3fn [T, L, H]
# and one float32 scale per token, [T, 1, 1]: amax over the token's layers and dimensions
# / 448 (at least 1e-12); states = fp8 * scale
SCALES = "hidden_states_scales"
FP8_MAX = 448.0
FP8_CHUNK_VALUES = 1 << 19  # values to_fp8 and check take at a time (2 MB of float32)
FP8_MIN_SCALE = 1e-12
# what tokencap's connector (`tokencap/engine_side/vllm_connector.py`) says in a file's
# metadata: the layer ids of its slots, and for each whether it was taken before or after
# the model's final norm (vLLM takes every id before it)
META_LAYERS = "tokencap.layers"
META_FINAL_NORM = "tokencap.final_norm"


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
        """As numpy (BF16 and FP8 widened to float32; FP8 not scaled)."""
        import numpy as np

        raw = np.frombuffer(self.data, dtype=DTYPES[self.dtype][0]).reshape(self.shape)
        if self.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if self.dtype == FP8:
            import ml_dtypes

            wide: np.ndarray = raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            return wide
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


def decode(data: bytes | mmap.mmap, p: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
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
    `hidden_states` [len(ids), layers, hidden] of `dtype` (None: any float an engine writes),
    every value finite, no layer all zeros; `token_ids` equal to `ids`. An FP8 file
    (speculators' layout) also has a finite, positive scale per token."""
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
    if hs.dtype not in (*FLOATS, FP8) or (dtype and hs.dtype != dtype) or (
            not dtype and hs.dtype == FP8):
        raise BadFile(path, "dtype", f"hidden_states dtype {hs.dtype}, want {dtype or 'a float'}")
    if hs.dtype == FP8:
        _check_scales(path, tensors.get(SCALES), len(ids))
    # on the raw bits (no widening), per layer the largest magnitude (the sign cleared): not
    # finite = the exponent all ones, so a magnitude at least `exp` (FP8 e4m3fn: no inf, NaN
    # = all but the sign set); a layer all zeros = its largest magnitude 0. One AND and one
    # reduction a value: 5x the rate of testing each apart on a row of 4 x 128 states
    exp, mag, kind = {"BF16": (0x7F80, 0x7FFF, np.uint16), "F16": (0x7C00, 0x7FFF, np.uint16),
                      "F32": (0x7F800000, 0x7FFFFFFF, np.uint32),
                      FP8: (0x7F, 0x7F, np.uint8)}[hs.dtype]
    bits = np.frombuffer(hs.data, dtype=kind).reshape(hs.shape)
    # a chunk of tokens at a time (its temporaries stay in a core's cache: 3x the rate of
    # the whole row at Kimi-K2.5's size)
    step = max(1, FP8_CHUNK_VALUES // max(1, math.prod(hs.shape[1:])))
    seen = np.zeros(layers, dtype=bool)
    for a in range(0, hs.shape[0], step):
        chunk = bits[a:a + step]
        top = (chunk & kind(mag)).max(axis=(0, 2))
        if (top >= exp).any():
            where = np.argwhere((chunk & kind(exp)) == exp)[0].tolist()
            where[0] += a
            raise BadFile(path, "not_finite",
                          f"a value is not finite at [token, layer, i] = {where}")
        seen |= top != 0
    zero = [k for k in range(layers) if not seen[k]]
    if zero:
        raise BadFile(path, "zero_layer", f"layer slot(s) {zero} all zeros (the engine gave "
                      "no states: vLLM PR #46301)")


class Layers(NamedTuple):
    """The layer ids a file holds, for each "pre" or "post" the final norm, and where they
    were read: the file's metadata (tokencap's connector) or, where it does not say, the
    config (vLLM takes every id before the final norm)."""

    ids: tuple[int, ...]
    final_norm: tuple[str, ...]
    read_from: str  # "file" or "config"


def check_row_file(path: str | Path, tensors: dict[str, Tensor], meta: dict[str, str],
                   ids: list[int], layers: tuple[int, ...], hidden: int, dtype: str,
                   engine_file: bool) -> Layers:
    """`check` of a row's file for a stage that keeps `layers` of `hidden` in `dtype` (a
    safetensors name), and its layer ids: those the file says (`BadFile` "layers" when not
    `layers`), else `layers`. An engine's file (`engine_file`) for an FP8 stage may hold
    any float an engine writes: the worker quantizes it."""
    said = file_layers(meta)
    if said is not None and said[0] != tuple(layers):
        raise BadFile(path, "layers", f"the file holds layers {list(said[0])}, the config "
                      f"asks for {list(layers)} (hidden_states.layers): the extraction "
                      "server was started with other eagle_aux_hidden_state_layer_ids")
    has = tensors["hidden_states"].dtype if "hidden_states" in tensors else dtype
    want = None if (dtype == FP8 and engine_file and has != FP8) else dtype
    check(path, tensors, ids, len(layers), hidden, want)
    if said is None:
        return Layers(tuple(layers), ("pre",) * len(layers), "config")
    return Layers(said[0], said[1], "file")


def _check_scales(path: str | Path, scales: Tensor | None, tokens: int) -> None:
    import numpy as np

    if scales is None or scales.dtype != "F32" or scales.shape != (tokens, 1, 1):
        raise BadFile(path, "shape", f"an FP8 file needs {SCALES} F32 [{tokens}, 1, 1]"
                      + (f", has {scales.dtype} {list(scales.shape)}" if scales else ""))
    values = np.frombuffer(scales.data, dtype=np.float32)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise BadFile(path, "not_finite", f"a scale of {SCALES} is not finite and positive")


def file_layers(meta: dict[str, str]) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """The layer ids a file's slots hold and, for each, "pre" or "post" (the model's final
    norm), where tokencap's connector wrote them; None for a file that does not say (vLLM's
    stock connector)."""
    raw = meta.get(META_LAYERS)
    if raw is None:
        return None
    try:
        ids = tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        return None
    norm = tuple(x.strip() for x in meta.get(META_FINAL_NORM, "").split(",") if x.strip())
    return ids, norm if len(norm) == len(ids) else ("pre",) * len(ids)


def to_fp8(hs: Tensor, chunk_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """`hidden_states` as speculators stores them in FP8 (hs-connectors' `fp8_utils`): per
    token, scale = max(amax / 448, 1e-12) over its layers and dimensions, in float32, and
    float8_e4m3fn(states / scale) rounded to nearest even (ml_dtypes' cast, equal to torch's
    for every value it can be given here: |states / scale| <= 448.00003). Returns the FP8
    states and the scales [T, 1, 1]; `chunk_tokens` at a time (default: about
    FP8_CHUNK_VALUES values, which stay in a core's cache: 3x the rate of 256 Kimi-K2.5
    tokens at a time), so a long row costs a bounded float32 copy."""
    import ml_dtypes
    import numpy as np

    tokens = hs.shape[0]
    q = np.empty(hs.shape, dtype=np.uint8)
    scales = np.empty((tokens, 1, 1), dtype=np.float32)
    per = len(hs.data) // tokens if tokens else 0
    width = max(1, math.prod(hs.shape[1:]))
    chunk_tokens = chunk_tokens or max(1, FP8_CHUNK_VALUES // width)
    for a in range(0, tokens, chunk_tokens):
        b = min(tokens, a + chunk_tokens)
        x = Tensor(hs.dtype, (b - a, *hs.shape[1:]), hs.data[a * per:b * per]).array()
        x = x.astype(np.float32, copy=False)
        amax = np.abs(x).max(axis=(1, 2), keepdims=True)
        scale = np.maximum(amax / np.float32(FP8_MAX), np.float32(FP8_MIN_SCALE))
        q[a:b] = (x / scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        scales[a:b] = scale
    return (Tensor(FP8, hs.shape, q.tobytes()),
            Tensor("F32", scales.shape, scales.tobytes()))


def from_fp8(hs: Tensor, scales: Tensor) -> np.ndarray:
    """FP8 states and their scales as speculators' trainer reads them (`fp8.to(bf16) *
    scale.to(bf16)`, the product in bfloat16): bfloat16 bit patterns (uint16) [T, L, H]."""

    prod = bf16_round(hs.array()) * bf16_round(scales.array())
    return to_bf16_bits(prod)


def bf16_round(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    import numpy as np

    return (to_bf16_bits(values).astype(np.uint32) << 16).view(np.float32)


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays
    a NaN."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(
        np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def map_engine_file(path: str | Path) -> mmap.mmap | bytes:
    """The file vLLM's hidden-state connector wrote, mapped read-only once it is whole: a
    shared flock on `<path>.lock` waits for its writer, which holds it exclusively until the
    file is written (no lock file: done). Checked in place, nothing copied. `OSError` when it
    cannot be read; an empty file is b""."""
    import fcntl

    p = Path(path)
    try:
        lock = os.open(p.with_name(p.name + ".lock"), os.O_RDONLY)
    except FileNotFoundError:
        lock = -1
    try:
        if lock >= 0:
            fcntl.flock(lock, fcntl.LOCK_SH)
        fd = os.open(p, os.O_RDONLY)
    finally:
        if lock >= 0:
            os.close(lock)
    try:
        if os.fstat(fd).st_size == 0:
            return b""
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


class Kept(NamedTuple):
    """How `keep_file` or `keep_bytes` kept a row's file: `moved` (the engine's own file,
    renamed: nothing written), `copied` (one streamed copy, across file systems), `written`
    (bytes of our own: FP8 made by the worker), or `existed` (another attempt kept the row
    first: its file stays, this one is dropped); and the kept file's size."""

    how: str
    bytes: int


def keep_file(src: str | Path, dst: str | Path) -> Kept:
    """The checked engine's file `src` kept at `dst`, every byte written once: on one file
    system its data fsynced and the file renamed; across file systems one streamed copy
    (the kernel's) under a temporary name beside `dst`, fsynced, then named. Never over an
    existing `dst` (another attempt's: `existed`). The folder is fsynced; `src` is left for
    the caller to remove."""
    s, d = Path(src), Path(dst)
    d.parent.mkdir(parents=True, exist_ok=True)
    if os.stat(s).st_dev == os.stat(d.parent).st_dev:
        _fsync(s)
        how = "moved" if _name_new(s, d) else "existed"
    else:
        tmp = d.with_name(f"{_temp_prefix(d)}{os.getpid()}.tmp")
        try:
            shutil.copyfile(s, tmp)
            _fsync(tmp)
            how = "copied" if _name_new(tmp, d) else "existed"
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    _fsync(d.parent)
    if how != "existed":
        _readable(d)
    return Kept(how, d.stat().st_size)


def keep_bytes(dst: str | Path, data: bytes) -> Kept:
    """`data` kept at `dst` as `keep_file` keeps a file (a temporary name, fsync, then named,
    never over an existing `dst`)."""
    d = Path(dst)
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = d.with_name(f"{_temp_prefix(d)}{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        how = "written" if _name_new(tmp, d) else "existed"
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync(d.parent)
    return Kept(how, d.stat().st_size)


def _name_new(src: Path, dst: Path) -> bool:
    """`src` also named `dst` unless `dst` exists (False): a hard link, atomic; where the
    file system has none, a rename once `dst` is seen absent."""
    try:
        os.link(src, dst)
    except FileExistsError:
        return False
    except OSError:
        if dst.exists():
            return False
        os.rename(src, dst)
    return True


def drop_cache(path: str | Path) -> None:
    """Ask the kernel to drop a kept file's pages from its cache (they are on disk: the file
    was fsynced; pages a process still maps stay). States are written once and read much
    later, if at all, by the export: a stage of terabytes would otherwise fill the node's
    page cache with them, pushing out what its processes read, and on a virtual machine
    that hands free memory back to its host (virtio-balloon free page reporting), a cache
    that grows takes fresh memory at 2.3 s a GB where pages dropped and taken again cost
    0.14 s (measured on a 2-core VM). Best effort: where the call fails or the system has
    none, nothing."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _fsync(path: Path) -> None:
    """A file's data, or a folder's entries, made durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_UMASK: int | None = None


def _readable(path: Path) -> None:
    """The mode a file of ours would have: the engine's is 0600 (safetensors writes a
    temporary file), which trainers run as another user cannot read."""
    global _UMASK
    if _UMASK is None:
        _UMASK = os.umask(0)
        os.umask(_UMASK)
    with contextlib.suppress(OSError):  # not the file's owner: left as it is
        os.chmod(path, 0o666 & ~_UMASK)


def run_marker(run: str) -> str:
    """What the request id of every hidden-state request of the run `run` (a stage's run)
    starts with, so the engine's files of its attempts are found by name (vLLM names a file
    `cmpl-<request id>-<i>-<random>.safetensors`)."""
    return f"tc{hashlib.sha256(run.encode()).hexdigest()[:8]}-"


def row_marker(run: str, path: str | Path) -> str:
    """`run_marker` and the row kept at `path` (its file's stem): every attempt at the row."""
    return f"{run_marker(run)}{Path(path).stem}-"


def engine_files(folder: str | Path, marker: str) -> list[Path]:
    """The engine's files (and their locks) in `folder` whose names hold `marker` (a request
    id prefix of tokencap's), e.g. those a killed attempt left."""
    f = Path(folder)
    try:
        with os.scandir(f) as entries:  # names compared as they are: no pattern compiled
            names = [e.name for e in entries]  # for each row's marker (a glob did: 0.6 ms)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [f / n for n in names
            if marker in n and n.endswith((".safetensors", ".safetensors.lock"))]


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
    """What a token costs on disk: its states, its id and, in FP8, its scale (the header
    aside)."""
    name = DTYPE_NAMES.get(dtype, dtype)
    return layers * hidden * DTYPES[name][1] + 8 + (4 if name == FP8 else 0)
