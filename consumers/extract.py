"""The worker's step in the stage that extracts hidden states (`RunConfig.stage =
"hidden_states"`, `tokencap/extraction.py`): one row's ids to the extraction server, its file
checked and kept, every byte of it written once.

The file is named by the row (`foundation.outputs.states_file` of `Pending.row_id`), so a
sample sent twice keeps one file: a worker killed after keeping it and before committing
leaves a file the next attempt finds, checks and counts without asking the engine again (a
rerun resumes without redoing a valid file).

The engine's own file (vLLM's connector writes it under its `shared_storage_path`, holding an
exclusive flock on `<path>.lock` until it is whole) is mapped once its lock is free, checked
in place (`foundation.hsfile.check`: shape, dtype, finite, no layer all zeros, `token_ids`
equal to the row's ids; the layer ids where the file says them), and kept (`hsfile.keep_file`):
on the file system of the states folder, fsynced and renamed; elsewhere, one streamed copy.
With `dtype = "fp8_e4m3"` and an engine that writes its model's dtype (vLLM's stock
connector), the worker quantizes it (`hsfile.to_fp8`) and writes the FP8 file, half the
bytes. The row, the engine and the CRC32 of each tensor go into the committed result
(`foundation.states_manifest.StatesFile`), not into the file. Whatever ends an attempt, the
engine's file and its lock are removed; an attempt killed before that leaves them under a
name that carries its row (`request_marker`), which the row's next attempt and the stage's end
remove.

A file that fails a check is asked for again, up to `max_attempts`, then the sample is dead
with reason `bad_hidden_states` and the check's words. A states folder without room for the
row pauses it (`StatesDiskFull`): the worker does not ask the engine, and the sample waits.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from foundation import hsfile, states_manifest
from foundation.config import RunConfig, StatesSpec
from foundation.engine.api import BadStates, InvalidResponse
from foundation.outputs import states_file
from foundation.states_manifest import StatesFile
from foundation.wire import Pending, Result

if TYPE_CHECKING:
    from foundation.engine.api import Generation

log = logging.getLogger(__name__)

# the extraction request: one token, greedy (vLLM's CPU build crashes on a non-greedy
# request to a speculative-decoding server; a model's generation_config would make one
# that omits the temperature non-greedy)
EXTRACT_SAMPLING: dict[str, Any] = {"max_new_tokens": 1, "temperature": 0.0}
# the room a row needs beyond its own bytes (the header), and what a pause waits at most
ROOM_SLACK_BYTES = 1 << 20


class StatesDiskFull(Exception):
    """The states folder has no room for the row: the sample waits, the engine is not
    asked."""

    def __init__(self, folder: Path, need: int, free: int) -> None:
        self.folder = folder
        super().__init__(f"{folder} has {free / 1e9:,.2f} GB free, a row of "
                         f"{need / 1e9:,.3f} GB needs more: the stage pauses until there is "
                         "room (free space, or point hidden_states.output_dir at a larger "
                         "disk)")


def row_file(cfg: RunConfig, category: str, p: Pending) -> Path:
    """Where the states of the row `p` extracts are kept (its `row_id`: the stage's rows
    file names every row)."""
    if p.row_id is None:
        raise InvalidResponse(f"{category}/{p.sample_id}: a hidden-state sample without the "
                              "row it extracts (its rows file line has no `id`)")
    return states_file(cfg.output_dir, category, p.row_id)


def request_marker(cfg: RunConfig, path: Path) -> str:
    """What the request id of every attempt at the row kept at `path` starts with
    (`hsfile.row_marker`): an attempt killed mid-way leaves an engine's file found by it."""
    return hsfile.row_marker(cfg.run, path)


def room_for(path: Path, tokens: int, spec: StatesSpec) -> None:
    """`StatesDiskFull` unless the states folder of `path` (or its nearest existing parent)
    has room for a row of `tokens` (its file and a margin)."""
    need = tokens * spec.bytes_per_token + ROOM_SLACK_BYTES
    free = _free_space(path.parent)
    if free < need:
        raise StatesDiskFull(path.parent, need, free)


def _free_space(folder: Path) -> int:
    """The free bytes where `folder` is (or will be: its nearest existing parent)."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def kept(path: Path, spec: StatesSpec, ids: list[int], output_dir: str, row_id: str
         ) -> StatesFile | None:
    """The file's description when `path` already holds the states of `ids` (a rerun, or an
    attempt that died before its commit), else None (absent, torn or wrong: redone)."""
    if not path.is_file():
        return None
    try:
        data = hsfile.map_engine_file(path)
        tensors, meta = hsfile.decode(data, path)
        layers = _check(path, tensors, meta, ids, spec, engine_file=False)
    except (hsfile.BadFile, OSError) as exc:
        log.warning("%s: redone (%s)", path, exc)
        return None
    hsfile.remove_temps(path)  # an earlier attempt killed while writing it
    desc = _description(path, spec, ids, tensors, data, layers, path.stat().st_size,
                        output_dir, row_id, "")
    del tensors, data  # the map released, so that its pages can be dropped
    hsfile.drop_cache(path)
    return desc


def _check(path: Path, tensors: dict[str, hsfile.Tensor], meta: dict[str, str],
           ids: list[int], spec: StatesSpec, engine_file: bool = True) -> hsfile.Layers:
    return hsfile.check_row_file(path, tensors, meta, ids, spec.layers, spec.hidden_size,
                                 hsfile.DTYPE_NAMES[spec.dtype], engine_file)


def _description(path: Path, spec: StatesSpec, ids: list[int],
                 tensors: dict[str, hsfile.Tensor], data: bytes | mmap.mmap,
                 layers: hsfile.Layers, size: int,
                 output_dir: str, row_id: str, engine: str) -> StatesFile:
    """What the result row (and then the manifest) says of a kept file (`data`: its bytes,
    for the header's CRC32)."""
    hs = tensors["hidden_states"]
    return msgspec.convert({
        "file": os.path.relpath(path, output_dir), "tokens": len(ids), "bytes": size,
        "dtype": hs.dtype, "hidden_size": hs.shape[2], "layers": list(layers.ids),
        "final_norm": list(layers.final_norm), "row": row_id,
        "crc32": states_manifest.crc32s(tensors),
        "header_crc32": states_manifest.header_crc32(memoryview(data)),
        "layers_from": layers.read_from, "engine": engine}, StatesFile)


def take(gen: Generation, path: Path, spec: StatesSpec, ids: list[int], row_id: str,
         output_dir: str, marker: str = "") -> StatesFile:
    """The engine's file for `gen`, checked in place and kept at `path` (module docstring);
    the engine's file and lock removed whatever happens, and with `marker` those an earlier
    attempt at the row left. Raises `BadStates` (sent again) when it fails a check,
    `StatesDiskFull` when the states folder is full."""
    if not gen.hidden_states_path:
        raise InvalidResponse(f"engine {gen.engine} gave no kv_transfer_params."
                              "hidden_states_path: not a vLLM server with extract_hidden_states "
                              "and its KV connector (docs/HIDDEN_STATES.md)")
    src = Path(gen.hidden_states_path)
    try:
        desc = _keep(src, gen, path, spec, ids, row_id, output_dir)
        hsfile.drop_cache(path)  # once `_keep`'s map of it is gone
        return desc
    finally:
        hsfile.remove_engine_file(src)
        if marker:
            for left in hsfile.engine_files(src.parent, marker):
                hsfile.remove_engine_file(left)


def _keep(src: Path, gen: Generation, path: Path, spec: StatesSpec, ids: list[int],
          row_id: str, output_dir: str) -> StatesFile:
    try:
        data = hsfile.map_engine_file(src)
    except OSError as exc:
        _disk_full_instead(src, len(ids), spec)
        raise BadStates(f"cannot read the engine's file {src}: {exc.strerror or exc} (the "
                        "workers must see the engine's shared_storage_path)") from None
    try:
        tensors, meta = hsfile.decode(data, src)
        layers = _check(src, tensors, meta, ids, spec)
    except hsfile.BadFile as exc:
        if exc.reason == "torn":
            _disk_full_instead(src, len(ids), spec)
        raise BadStates(f"{exc} [{exc.reason}]") from None
    try:
        if spec.dtype == "fp8_e4m3" and tensors["hidden_states"].dtype != hsfile.FP8:
            q, scales = hsfile.to_fp8(tensors["hidden_states"])
            tensors = {"hidden_states": q, hsfile.SCALES: scales,
                       "token_ids": tensors["token_ids"]}
            data = hsfile.encode(tensors, meta)
            done = hsfile.keep_bytes(path, data)
        else:
            done = hsfile.keep_file(src, path)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StatesDiskFull(path.parent, len(ids) * spec.bytes_per_token,
                                 _free_space(path.parent)) from None
        raise
    if done.how == "existed":  # another attempt kept the row first: its file is the row's
        found = kept(path, spec, ids, output_dir, row_id)
        if found is not None:
            return found
        raise BadStates(f"{path}: another attempt's file is there and fails its check")
    # (a temporary an attempt killed mid-copy left is removed at the stage's end: looking
    # for one here would read the whole states folder for every row)
    log.debug("%s: %s (%d bytes)", path, done.how, done.bytes)
    return _description(path, spec, ids, tensors, data, layers, done.bytes, output_dir,
                        row_id, gen.engine)


def _disk_full_instead(src: Path, tokens: int, spec: StatesSpec) -> None:
    """An engine's file that is missing or cut short where its folder has no room for it:
    the engine's disk is full (`StatesDiskFull`), not the file bad."""
    folder = src.parent
    if folder.is_dir():
        free = _free_space(folder)
        need = tokens * spec.bytes_per_token
        if free < need + ROOM_SLACK_BYTES:
            raise StatesDiskFull(folder, need, free)


def result(p: Pending, cfg: RunConfig, category: str, desc: StatesFile,
           gen: Generation | None, sent_at_ms: int) -> Result:
    """The committed sample: the file's description; counted = the row's tokens (a byte
    budget is a token budget at the run's bytes per token)."""
    ids = p.prompt_ids
    return Result(
        id=p.sample_id, category=category, prompt_ids=[], output_ids=[],
        prompt_tokens=len(ids), completion_tokens=0, finish_reason="stop", text="",
        sampling=p.sampling, counted_tokens=len(ids), ordinal=p.ordinal,
        source_id=p.source_id, where=p.where, engine=gen.engine if gen else "",
        latency_s=round(gen.latency_s, 4) if gen else 0.0, fed_at_ms=p.fed_at_ms,
        sent_at_ms=sent_at_ms, model=gen.model if gen else "",
        engine_version=gen.engine_version if gen else "",
        simulated=gen.simulated if gen else False, made_by=cfg.made_by,
        hidden_states=msgspec.to_builtins(desc))
