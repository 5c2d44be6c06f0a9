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

HS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}  # the config's name -> safetensors'
HS_SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
_BF16_NAN = 0x7FC0


TABLE_ROWS = 4096  # the states of an id repeat every this many ids (a gather, not sines)
_tables: dict[tuple[tuple[int, ...], int], np.ndarray] = {}


def _table(layer_ids: list[int], hidden: int) -> np.ndarray:
    """sin of (row, layer, dimension) for TABLE_ROWS rows, made once per shape."""
    import numpy as np

    key = (tuple(layer_ids), hidden)
    if key not in _tables:
        rows = np.arange(TABLE_ROWS, dtype=np.float64).reshape(-1, 1, 1)
        layers = np.asarray(layer_ids, dtype=np.float64).reshape(1, -1, 1)
        dims = np.arange(1, hidden + 1, dtype=np.float64).reshape(1, 1, -1)
        _tables[key] = np.sin(0.001 * rows * dims + 0.1 * layers).astype(np.float32)
    return _tables[key]


def states(token_ids: list[int], layer_ids: list[int], hidden: int) -> np.ndarray:
    """The hidden states of ``token_ids`` at ``layer_ids``: float32 [T, L, H].

    Each value depends on the token, its position, the layer id and the dimension, and on
    the previous token (causal-ish: a token's states change with what precedes it). Every
    value lies in [0.25, 1.25]: finite and never zero, so no layer slot is ever all zeros.
    A gather from a table of sines, so that a long prompt costs the simulator little.
    """
    import numpy as np

    table = _table(layer_ids, hidden)
    ids = np.asarray(token_ids, dtype=np.int64)
    prev = np.concatenate([np.asarray([-1], dtype=np.int64), ids[:-1]]) + 1
    pos = (np.arange(len(token_ids), dtype=np.float32) * 0.01).reshape(-1, 1, 1)
    own = table[ids % TABLE_ROWS]
    before = table[(prev * 7 + 3) % TABLE_ROWS]
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


def encode(tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> bytes:
    """A safetensors file's bytes: ``tensors`` maps a name to (dtype name, shape, raw
    little-endian data), written in that order."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(head)) + head + b"".join(d for _, _, d in tensors.values())


@dataclass(frozen=True)
class Damage:
    """The faults one file gets (each drawn on its own)."""

    zero_layer: bool = False
    nan: bool = False
    wrong_ids: bool = False
    truncate: bool = False


def file_bytes(token_ids: list[int], layer_ids: list[int], hidden: int, dtype: str,
               damage: Damage | None = None, vocab_size: int = 1 << 31) -> bytes:
    """The file vLLM writes for ``token_ids`` (config dtype name "float32" or "bfloat16"),
    with ``damage`` done to it. The damaged slot is the middle one (layer, token, id)."""
    import numpy as np

    damage = damage or Damage()
    values = states(token_ids, layer_ids, hidden)
    ids = np.asarray(token_ids, dtype="<i8")
    if damage.zero_layer:
        values[:, len(layer_ids) // 2, :] = 0.0
    if damage.nan:
        values[len(token_ids) // 2, len(layer_ids) // 2, hidden // 2] = np.nan
    if damage.wrong_ids:
        middle = len(token_ids) // 2
        ids[middle] = (int(ids[middle]) + 1) % vocab_size
    if dtype == "bfloat16":
        raw = to_bf16(values).astype("<u2").tobytes()
    else:
        raw = values.astype("<f4").tobytes()
    data = encode({
        "hidden_states": (HS_DTYPES[dtype], values.shape, raw),
        "token_ids": ("I64", ids.shape, ids.tobytes()),
    })
    if damage.truncate:  # a torn write: the header whole, the data cut short
        (head,) = struct.unpack("<Q", data[:8])
        data = data[:8 + head + (len(data) - 8 - head) // 2]
    return data


def path_for(storage: str, request_id: str) -> Path:
    """Where a request's file goes: named by its request id, as vLLM does."""
    return Path(storage) / f"{request_id}{HS_SUFFIX}"


def write_locked(path: Path, data: bytes) -> None:
    """Write ``data`` at ``path`` holding an exclusive flock on ``PATH.lock`` (created
    beside it), as the connector does; the lock file stays."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}{LOCK_SUFFIX}", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            with path.open("wb") as f:
                f.write(data)
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
