"""`consumers/extract.py`, the hidden-state stage's step: a row's file already in place is kept
only when it holds the row's states (`kept`), the engine's file is checked, written whole
under the row's name and removed with its lock (`take`), and a file that fails a check is
refused with its reason. The files are made with `foundation.hsfile`, as vLLM's connector
writes them."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from consumers.extract import kept, result, row_file, take
from foundation import hsfile
from foundation.config import StatesSpec
from foundation.engine.api import BadStates, Generation, InvalidResponse
from foundation.outputs import states_file
from foundation.wire import Pending
from tests.helpers import make_cfg

IDS = [11, 12, 13]
LAYERS = (2, 5)
HIDDEN = 4


def spec(out: Path) -> StatesSpec:
    return StatesSpec(engine_url=None, layers=LAYERS, dtype="float32", output_dir=str(out),
                      model_config="config.json", max_bytes=None, hidden_size=HIDDEN,
                      num_layers=6)


def states(ids: list[int] = IDS, value: float = 0.5) -> dict[str, hsfile.Tensor]:
    hs = np.full((len(ids), len(LAYERS), HIDDEN), value, dtype=np.float32)
    hs[0, 0, 0] = 1.0
    return {"hidden_states": hsfile.Tensor("F32", hs.shape, hs.tobytes()),
            "token_ids": hsfile.Tensor("I64", (len(ids),),
                                       np.asarray(ids, dtype=np.int64).tobytes())}


def engine_file(folder: Path, data: bytes) -> Path:
    """A file as vLLM's connector leaves it: the states and an (unlocked) lock file beside."""
    path = folder / "engine" / "req-1.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.with_name(path.name + ".lock").write_bytes(b"")
    return path


def gen(path: Path | None) -> Generation:
    return Generation(output_ids=[1], text="", prompt_tokens=3, completion_tokens=1,
                      finish_reason="length", finish={}, latency_s=0.5, engine="http://e",
                      model="m", engine_version="0.11.0",
                      hidden_states_path=str(path) if path else None)


def test_a_file_holding_the_row_s_states_is_kept_and_a_killed_attempt_s_temporary_removed(
        tmp_path: Path) -> None:
    path = states_file(tmp_path, "code", "r1")
    hsfile.write_whole(path, hsfile.encode(states()))
    stale = path.with_name(f".{path.name}.999.tmp")
    stale.write_bytes(b"torn")
    desc = kept(path, spec(tmp_path), IDS, str(tmp_path))
    assert desc == {"file": "code/states/" + path.name, "tokens": 3, "layers": [2, 5],
                    "hidden_size": HIDDEN, "dtype": "F32", "bytes": path.stat().st_size}
    assert not stale.exists()
    assert kept(tmp_path / "absent.safetensors", spec(tmp_path), IDS, str(tmp_path)) is None


@pytest.mark.parametrize(("data", "why"), [
    (hsfile.encode(states())[:-5], "cut short"),  # torn
    (hsfile.encode(states(value=float("nan"))), "not finite"),
    (hsfile.encode(states([11, 12, 14])), "token_ids differ"),  # another row's
    (hsfile.encode(states(value=0.0)), "all zeros"),
])
def test_a_file_that_fails_a_check_is_redone(tmp_path: Path, caplog, data: bytes,
                                             why: str) -> None:
    path = states_file(tmp_path, "code", "r1")
    hsfile.write_whole(path, data)
    with caplog.at_level(logging.WARNING, "consumers.extract"):
        assert kept(path, spec(tmp_path), IDS, str(tmp_path)) is None
    assert f"{path}: redone" in caplog.text and why in caplog.text


def test_the_engine_s_file_is_checked_kept_under_the_row_s_name_and_removed(
        tmp_path: Path) -> None:
    src = engine_file(tmp_path, hsfile.encode(states()))
    path = states_file(tmp_path / "hs", "code", "r1")
    desc = take(gen(src), path, spec(tmp_path / "hs"), IDS, "r1", str(tmp_path / "hs"))
    assert not src.exists() and not src.with_name(src.name + ".lock").exists()
    tensors, meta = hsfile.read(path)
    assert meta == {"row": "r1", "engine": "http://e"}
    assert bytes(tensors["hidden_states"].data) == bytes(states()["hidden_states"].data)
    assert desc["bytes"] == path.stat().st_size and desc["file"] == f"code/states/{path.name}"
    # a rerun finds it and asks nothing again
    assert kept(path, spec(tmp_path / "hs"), IDS, str(tmp_path / "hs")) == desc


@pytest.mark.parametrize(("data", "reason"), [
    (hsfile.encode(states())[:40], "torn"),
    (hsfile.encode(states(value=float("inf"))), "not_finite"),
    (hsfile.encode(states([1, 2, 3])), "token_ids"),
])
def test_an_engine_file_that_fails_a_check_is_refused_with_its_reason_and_removed(
        tmp_path: Path, data: bytes, reason: str) -> None:
    src = engine_file(tmp_path, data)
    path = states_file(tmp_path / "hs", "code", "r1")
    with pytest.raises(BadStates, match=rf"\[{reason}\]$"):
        take(gen(src), path, spec(tmp_path / "hs"), IDS, "r1", str(tmp_path / "hs"))
    assert not path.exists()
    assert not src.exists() and not src.with_name(src.name + ".lock").exists()


def test_an_engine_that_wrote_no_file_or_one_the_worker_cannot_see(tmp_path: Path) -> None:
    path = states_file(tmp_path, "code", "r1")
    with pytest.raises(InvalidResponse, match="hidden_states_path"):
        take(gen(None), path, spec(tmp_path), IDS, "r1", str(tmp_path))
    with pytest.raises(BadStates, match="cannot read the engine's file"):
        take(gen(tmp_path / "elsewhere.safetensors"), path, spec(tmp_path), IDS, "r1",
             str(tmp_path))


def test_a_sample_names_its_row_s_file_and_commits_the_row_s_tokens() -> None:
    cfg = make_cfg()
    p = Pending(sample_id="s1", ordinal=3, prompt_ids=IDS, sampling={"max_new_tokens": 1},
                where="rows.jsonl:4", fed_at_ms=7, row_id="c#t2")
    assert row_file(cfg, "code", p) == states_file(cfg.output_dir, "code", "c#t2")
    with pytest.raises(InvalidResponse, match="without the row"):
        row_file(cfg, "code", Pending(sample_id="s2", ordinal=0, prompt_ids=IDS, sampling={}))
    desc = {"file": "code/states/x.safetensors", "tokens": 3}
    r = result(p, cfg, "code", desc, gen(None), sent_at_ms=9)
    assert (r.id, r.counted_tokens, r.prompt_tokens, r.output_ids, r.hidden_states) == (
        "s1", 3, 3, [], desc)
    assert (r.engine, r.latency_s, r.fed_at_ms, r.sent_at_ms, r.where) == (
        "http://e", 0.5, 7, 9, "rows.jsonl:4")
    kept_before = result(p, cfg, "code", desc, None, sent_at_ms=9)  # found on disk
    assert (kept_before.engine, kept_before.latency_s) == ("", 0.0)
