"""The worker's step in the stage that extracts hidden states (`RunConfig.stage =
"hidden_states"`): one row's ids to the extraction server, its file checked and kept.

The file is named by the row (`states_file`), so a sample sent twice writes one file: a
worker killed after writing it and before committing leaves a file the next attempt finds,
checks and counts without asking the engine again (a rerun resumes without redoing a valid
file). The engine's own file is read under a shared flock on `<path>.lock` (its writer holds
it exclusively while writing), checked (`foundation.hsfile.check`: shape, dtype, finite, no
layer all zeros, `token_ids` equal to the row's ids), written whole under our name
(temporary name, fsync, rename; a temporary an attempt killed mid-write left is removed once
the file is in place), then removed with its lock. A file that fails a check is
asked for again, up to `max_attempts`, then the sample is dead with reason
`bad_hidden_states` and the check's words.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foundation import hsfile
from foundation.config import HiddenStates, RunConfig
from foundation.engine.api import BadStates, InvalidResponse
from foundation.wire import Pending, Result

if TYPE_CHECKING:
    from foundation.engine.api import Generation

log = logging.getLogger(__name__)

# the extraction request: one token, greedy (vLLM's CPU build crashes on a non-greedy
# request to a speculative-decoding server; a model's generation_config would make one
# that omits the temperature non-greedy)
EXTRACT_SAMPLING: dict[str, Any] = {"max_new_tokens": 1, "temperature": 0.0}
STATES_DIR = "states"


def states_dir(out_dir: str | Path, category: str) -> Path:
    """The folder of a category's states files."""
    return Path(out_dir) / category / STATES_DIR


def states_file(out_dir: str | Path, category: str, row_id: str) -> Path:
    """Where a row's states are kept: named by the row, so a row has one file however often
    it is sent."""
    digest = hashlib.sha256(row_id.encode()).hexdigest()[:24]
    return states_dir(out_dir, category) / f"{digest}.safetensors"


def spec(cfg: RunConfig) -> HiddenStates:
    hs = cfg.hidden_states
    assert hs is not None and hs.layers is not None, "a hidden-state run without its spec"
    return hs


def kept(path: Path, cfg: RunConfig, ids: list[int]) -> dict[str, Any] | None:
    """The file's description when `path` already holds the states of `ids` (a rerun, or an
    attempt that died before its commit), else None (absent, torn or wrong: redone)."""
    if not path.is_file():
        return None
    try:
        desc = describe(path, cfg, ids, hsfile.read(path)[0])
    except hsfile.BadFile as exc:
        log.warning("%s: redone (%s)", path, exc)
        return None
    hsfile.remove_temps(path)  # an earlier attempt killed while writing it
    return desc


def describe(path: Path, cfg: RunConfig, ids: list[int],
             tensors: dict[str, hsfile.Tensor]) -> dict[str, Any]:
    """Check `tensors` as the states of `ids`; what a result row says of the file."""
    hs = spec(cfg)
    layers = list(hs.layers or ())
    hsfile.check(path, tensors, ids, len(layers), hs.hidden_size,
                 hsfile.DTYPE_NAMES[hs.dtype or "bfloat16"])
    return _description(path, cfg, ids, tensors, path.stat().st_size)


def _description(path: Path, cfg: RunConfig, ids: list[int],
                 tensors: dict[str, hsfile.Tensor], size: int) -> dict[str, Any]:
    """What a result row says of a checked file."""
    return {"file": os.path.relpath(path, cfg.output_dir), "tokens": len(ids),
            "layers": list(spec(cfg).layers or ()),
            "hidden_size": tensors["hidden_states"].shape[2],
            "dtype": tensors["hidden_states"].dtype, "bytes": size}


def take(gen: Generation, path: Path, cfg: RunConfig, ids: list[int], row_id: str
         ) -> dict[str, Any]:
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
    hs = spec(cfg)
    try:
        tensors, _ = hsfile.decode(data, src)
        hsfile.check(src, tensors, ids, len(hs.layers or ()), hs.hidden_size,
                     hsfile.DTYPE_NAMES[hs.dtype or "bfloat16"])
    except hsfile.BadFile as exc:
        hsfile.remove_engine_file(src)
        raise BadStates(f"{exc} [{exc.reason}]") from None
    data = hsfile.encode(tensors, {"row": row_id, "engine": gen.engine})
    hsfile.write_whole(path, data)
    hsfile.remove_temps(path)  # an earlier attempt killed while writing it
    hsfile.remove_engine_file(src)
    return _description(path, cfg, ids, tensors, len(data))


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

