"""vLLM's hidden-state extraction, simulated: deterministic states, a safetensors writer.

vLLM 0.32 with ``--speculative-config {"method": "extract_hidden_states", ...,
"eagle_aux_hidden_state_layer_ids": [...]}`` and the ``ExampleHiddenStatesConnector`` KV
connector writes, for every request, a safetensors file under the connector's
``shared_storage_path`` (named by the request id) holding ``hidden_states`` [tokens, layers,
hidden] in the model dtype and ``token_ids`` (int64), and answers with
``"kv_transfer_params": {"hidden_states_path": PATH}``. The writer holds an exclusive
``fcntl.flock`` on ``PATH.lock`` while it writes; readers take a shared one.

Here the states are a pure function of the ids (:func:`states`), so a test can recompute
what a file must hold. Faults (``FaultConfig.hs_*_rate``) damage one file: a layer slot all
zeros, one value NaN, one token id changed, or the file cut short (a torn write, still
answered). numpy is imported inside the functions: the rest of the simulator runs without it.

Two choices a benchmark at a large model's size needs (``SimConfig.hs_states``,
``hs_metadata``): ``"table"`` states, each token's a copy of one of ``TABLE_SMALL`` rows
encoded once (the engine's own cost is a copy, not the sines of :func:`states`), and
tokencap's connector's files (``tokencap.engine_side.vllm_connector``): the layer ids and
their final-norm side in the file's metadata, and ``hs_dtype = "fp8_e4m3"``, speculators'
FP8 layout (``hidden_states`` float8_e4m3fn, ``hidden_states_scales`` float32 [T, 1, 1]:
per token, amax over layers and dimensions / 448, at least 1e-12).
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

_BF16_NAN = 0x7FC0
HS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "fp8_e4m3": "F8_E4M3"}  # -> safetensors'
HS_SCALES = "hidden_states_scales"  # an FP8 file's per-token scales
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_MIN_SCALE = 1e-12
# tokencap's connector's metadata names (tokencap.engine_side.vllm_connector)
META_LAYERS = "tokencap.layers"
META_FINAL_NORM = "tokencap.final_norm"
TABLE_SMALL = 64  # the "table" states' rows: token id modulo this
_NAN = {"float32": 0x7FC00000, "bfloat16": _BF16_NAN, "fp8_e4m3": 0x7F}
HS_SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"


TABLE_ROWS = 4096  # the states of an id repeat every this many ids (a gather, not sines)
_tables: dict[tuple[tuple[int, ...], int, int], np.ndarray] = {}


def _table(layer_ids: list[int], hidden: int, count: int = TABLE_ROWS) -> np.ndarray:
    """sin of (row, layer, dimension) for `count` rows, made once per shape."""
    import numpy as np

    key = (tuple(layer_ids), hidden, count)
    if key not in _tables:
        rows = np.arange(count, dtype=np.float64).reshape(-1, 1, 1)
        layers = np.asarray(layer_ids, dtype=np.float64).reshape(1, -1, 1)
        dims = np.arange(1, hidden + 1, dtype=np.float64).reshape(1, 1, -1)
        _tables[key] = np.sin(0.001 * rows * dims + 0.1 * layers).astype(np.float32)
    return _tables[key]


def states(token_ids: list[int], layer_ids: list[int], hidden: int,
           table_rows: int = TABLE_ROWS) -> np.ndarray:
    """The hidden states of ``token_ids`` at ``layer_ids``: float32 [T, L, H].

    Each value depends on the token, its position, the layer id and the dimension, and on
    the previous token (causal-ish: a token's states change with what precedes it). Every
    value lies in [0.25, 1.25]: finite and never zero, so no layer slot is ever all zeros.
    A gather from a table of sines, so that a long prompt costs the simulator little.
    """
    import numpy as np

    table = _table(layer_ids, hidden, table_rows)
    ids = np.asarray(token_ids, dtype=np.int64)
    prev = np.concatenate([np.asarray([-1], dtype=np.int64), ids[:-1]]) + 1
    pos = (np.arange(len(token_ids), dtype=np.float32) * 0.01).reshape(-1, 1, 1)
    own = table[ids % table_rows]
    before = table[(prev * 7 + 3) % table_rows]
    return (0.75 + 0.25 * own + 0.2 * before * np.float32(0.5) + 0.04 * np.sin(pos)
            ).astype(np.float32)


def to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (uint16): the upper 16 bits, rounded to
    nearest even; NaN stays a (quiet) NaN."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    # uint32 arithmetic: only a NaN's bits can wrap, and a NaN is set below
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    out = rounded.astype(np.uint16)
    out[np.isnan(values)] = _BF16_NAN
    return out


def from_bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) widened to float32."""
    import numpy as np

    return (np.asarray(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def encode(tensors: dict[str, tuple[str, tuple[int, ...], bytes]],
           metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file's bytes: ``tensors`` maps a name to (dtype name, shape, raw
    little-endian data), written in that order; ``metadata`` its ``__metadata__``."""
    return b"".join(encode_parts(tensors, metadata))


def encode_parts(tensors: dict[str, tuple[str, tuple[int, ...], Any]],
                 metadata: dict[str, str] | None = None) -> list[Any]:
    """:func:`encode`'s file as the buffers written one after the other (the header, then
    each tensor's data, not copied)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + memoryview(data).nbytes]}
        offset += memoryview(data).nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    return [struct.pack("<Q", len(head)) + head, *(d for _, _, d in tensors.values())]


@dataclass(frozen=True)
class Damage:
    """The faults one file gets (each drawn on its own)."""

    zero_layer: bool = False
    nan: bool = False
    wrong_ids: bool = False
    truncate: bool = False


def file_bytes(token_ids: list[int], layer_ids: list[int], hidden: int, dtype: str,
               damage: Damage | None = None, vocab_size: int = 1 << 31,
               table: bool = False, metadata: bool = False) -> bytes:
    """The file vLLM writes for ``token_ids`` (config dtype name "float32", "bfloat16" or
    "fp8_e4m3"), with ``damage`` done to it. The damaged slot is the middle one (layer,
    token, id). ``table``: each token's states a copy of its table row (:func:`_encoded`);
    ``metadata``: the layer ids and their final-norm side in the file, as tokencap's
    connector writes them (vLLM stores the ids rising)."""
    return b"".join(file_parts(token_ids, layer_ids, hidden, dtype, damage, vocab_size,
                               table, metadata))


def file_parts(token_ids: list[int], layer_ids: list[int], hidden: int, dtype: str,
               damage: Damage | None = None, vocab_size: int = 1 << 31,
               table: bool = False, metadata: bool = False) -> list[Any]:
    """:func:`file_bytes` as the buffers to write one after the other (no copy joins them)."""
    import numpy as np

    damage = damage or Damage()
    if metadata:  # the slots in the order the metadata says them: vLLM's, rising
        layer_ids = sorted(set(layer_ids))
    ids = np.asarray(token_ids, dtype="<i8")
    if table:
        rows, row_scales = _encoded(layer_ids, hidden, dtype)
        pick = ids % TABLE_SMALL
        raw = rows[pick]
        scales = None if row_scales is None else row_scales[pick]
    else:
        raw, scales = _encode_values(states(token_ids, layer_ids, hidden), dtype)
    if damage.zero_layer or damage.nan:
        raw = np.array(raw, copy=True)
        bits = raw.view(f"<u{raw.dtype.itemsize}")  # the NaN set as its bit pattern
        if damage.zero_layer:
            bits[:, len(layer_ids) // 2, :] = 0
        if damage.nan:
            bits[len(token_ids) // 2, len(layer_ids) // 2, hidden // 2] = _NAN[dtype]
    if damage.wrong_ids:
        middle = len(token_ids) // 2
        ids[middle] = (int(ids[middle]) + 1) % vocab_size
    tensors: dict[str, tuple[str, tuple[int, ...], Any]] = {
        "hidden_states": (HS_DTYPES[dtype], raw.shape, raw.data.cast("B"))}
    if scales is not None:
        tensors[HS_SCALES] = ("F32", scales.shape, scales.data.cast("B"))
    tensors["token_ids"] = ("I64", ids.shape, ids.data.cast("B"))
    meta = None
    if metadata:
        meta = {META_LAYERS: ",".join(map(str, layer_ids)),
                META_FINAL_NORM: ",".join("pre" for _ in layer_ids)}
    parts = encode_parts(tensors, meta)
    if damage.truncate:  # a torn write: the header whole, the data cut short
        data = b"".join(parts)
        (head,) = struct.unpack("<Q", data[:8])
        return [data[:8 + head + (len(data) - 8 - head) // 2]]
    return parts


def _encode_values(values: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 states [T, L, H] as the file stores them: raw little-endian values (bf16 bit
    patterns, float32, or FP8 bytes), and for FP8 the per-token scales [T, 1, 1]."""
    import numpy as np

    if dtype == "bfloat16":
        return to_bf16(values).astype("<u2"), None
    if dtype == "float32":
        return values.astype("<f4"), None
    import ml_dtypes

    amax = np.abs(values).max(axis=(1, 2), keepdims=True).astype(np.float32)
    scales = np.maximum(amax / np.float32(FP8_MAX), np.float32(FP8_MIN_SCALE))
    raw = (values / scales).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return raw, scales.astype("<f4")


_encoded_tables: dict[tuple[tuple[int, ...], int, str],
                      tuple[np.ndarray, np.ndarray | None]] = {}


def _encoded(layer_ids: list[int], hidden: int, dtype: str
             ) -> tuple[np.ndarray, np.ndarray | None]:
    """The "table" states: :func:`states` of the ids 0 .. TABLE_SMALL - 1, encoded once per
    shape and dtype (and their FP8 scales)."""
    key = (tuple(layer_ids), hidden, dtype)
    if key not in _encoded_tables:
        _encoded_tables[key] = _encode_values(
            states(list(range(TABLE_SMALL)), layer_ids, hidden, TABLE_SMALL), dtype)
    return _encoded_tables[key]


def path_for(storage: str, request_id: str) -> Path:
    """Where a request's file goes: named by its request id, as vLLM does."""
    return Path(storage) / f"{request_id}{HS_SUFFIX}"


def write_locked(path: Path, data: bytes | list[Any]) -> None:
    """Write ``data`` (bytes, or buffers one after the other) at ``path`` holding an
    exclusive flock on ``PATH.lock`` (created beside it), as the connector does; the lock
    file stays."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}{LOCK_SUFFIX}", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            with path.open("wb") as f:
                for part in [data] if isinstance(data, bytes) else data:
                    f.write(part)
                f.flush()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read_locked(path: str | Path) -> bytes:
    """A file's bytes read under a shared flock on ``PATH.lock``, as a reader does."""
    fd = os.open(f"{path}{LOCK_SUFFIX}", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            return Path(path).read_bytes()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
