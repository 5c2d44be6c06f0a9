"""The worker's step in the stage that extracts hidden states (`RunConfig.stage =
"hidden_states"`, `tokencap/extraction.py`): one row's ids to the extraction server, its file
checked and kept.

The file is named by the row (`foundation.outputs.states_file` of `Pending.row_id`), so a
sample sent twice writes one file: a worker killed after writing it and before committing
leaves a file the next attempt finds, checks and counts without asking the engine again (a
rerun resumes without redoing a valid file). The engine's own file is read under a shared
flock on `<path>.lock` (its writer holds it exclusively while writing), checked
(`foundation.hsfile.check`: shape, dtype, finite, no layer all zeros, `token_ids` equal to the
row's ids), written whole under our name (temporary name, fsync, rename; a temporary an
attempt killed mid-write left is removed once the file is in place), then removed with its
lock. A file that fails a check is asked for again, up to `max_attempts`, then the sample is
dead with reason `bad_hidden_states` and the check's words.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foundation import hsfile
from foundation.config import RunConfig, StatesSpec
from foundation.engine.api import BadStates, InvalidResponse
from foundation.outputs import states_file
from foundation.wire import Pending, Result

if TYPE_CHECKING:
    from foundation.engine.api import Generation

log = logging.getLogger(__name__)

# the extraction request: one token, greedy (vLLM's CPU build crashes on a non-greedy
# request to a speculative-decoding server; a model's generation_config would make one
# that omits the temperature non-greedy)
EXTRACT_SAMPLING: dict[str, Any] = {"max_new_tokens": 1, "temperature": 0.0}


def row_file(cfg: RunConfig, category: str, p: Pending) -> Path:
    """Where the states of the row `p` extracts are kept (its `row_id`: the stage's rows
    file names every row)."""
    if p.row_id is None:
        raise InvalidResponse(f"{category}/{p.sample_id}: a hidden-state sample without the "
                              "row it extracts (its rows file line has no `id`)")
    return states_file(cfg.output_dir, category, p.row_id)


def kept(path: Path, spec: StatesSpec, ids: list[int], output_dir: str) -> dict[str, Any] | None:
    """The file's description when `path` already holds the states of `ids` (a rerun, or an
    attempt that died before its commit), else None (absent, torn or wrong: redone)."""
    if not path.is_file():
        return None
    try:
        tensors = hsfile.read(path)[0]
        _check(path, tensors, ids, spec)
    except hsfile.BadFile as exc:
        log.warning("%s: redone (%s)", path, exc)
        return None
    hsfile.remove_temps(path)  # an earlier attempt killed while writing it
    return _description(path, spec, ids, tensors, path.stat().st_size, output_dir)


def _check(path: str | Path, tensors: dict[str, hsfile.Tensor], ids: list[int],
           spec: StatesSpec) -> None:
    hsfile.check(path, tensors, ids, len(spec.layers), spec.hidden_size,
                 hsfile.DTYPE_NAMES[spec.dtype])


def _description(path: Path, spec: StatesSpec, ids: list[int],
                 tensors: dict[str, hsfile.Tensor], size: int, output_dir: str
                 ) -> dict[str, Any]:
    """What a result row says of a checked file."""
    return {"file": os.path.relpath(path, output_dir), "tokens": len(ids),
            "layers": list(spec.layers), "hidden_size": tensors["hidden_states"].shape[2],
            "dtype": tensors["hidden_states"].dtype, "bytes": size}


def take(gen: Generation, path: Path, spec: StatesSpec, ids: list[int], row_id: str,
         output_dir: str) -> dict[str, Any]:
    """The engine's file for `gen`, checked, kept at `path`, the engine's copy removed.
    Raises `BadStates` (sent again) when it fails a check."""
    if not gen.hidden_states_path:
        raise InvalidResponse(f"engine {gen.engine} gave no kv_transfer_params."
                              "hidden_states_path: not a vLLM server with extract_hidden_states "
                              "and its KV connector (docs/HIDDEN_STATES.md)")
    src = Path(gen.hidden_states_path)
    try:
        data = hsfile.read_engine_file(src)
    except OSError as exc:
        raise BadStates(f"cannot read the engine's file {src}: {exc.strerror or exc} (the "
                        "workers must see the engine's shared_storage_path)") from None
    try:
        tensors, _ = hsfile.decode(data, src)
        _check(src, tensors, ids, spec)
    except hsfile.BadFile as exc:
        hsfile.remove_engine_file(src)
        raise BadStates(f"{exc} [{exc.reason}]") from None
    data = hsfile.encode(tensors, {"row": row_id, "engine": gen.engine})
    hsfile.write_whole(path, data)
    hsfile.remove_temps(path)  # an earlier attempt killed while writing it
    hsfile.remove_engine_file(src)
    return _description(path, spec, ids, tensors, len(data), output_dir)


def result(p: Pending, cfg: RunConfig, category: str, desc: dict[str, Any],
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
        simulated=gen.simulated if gen else False, made_by=cfg.made_by, hidden_states=desc)
