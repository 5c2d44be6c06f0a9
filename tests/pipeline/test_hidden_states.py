"""The hidden-state stage through the whole pipeline (`tokencap hidden-states`: producer,
ledger, worker processes, writer) against the simulator playing vLLM's extraction server
(`sglang_sim.hidden`: states a pure function of the ids): every training row's states kept
once, in a checked file equal to what the engine computed, proven by the manifest written at
the stage's end; a byte budget closes a category;
a NaN or all-zero file is never kept (asked again, then dead with its reason; refused at
the preflight when every file is bad); workers killed mid-stage and the stage rerun leave no
file twice and none torn; a finished stage rerun asks the engine for nothing; rows generated
after a stage ran (a raised cap, the run resumed) are said by the plans, appended to the rows
file after its lines, and extracted by the next stage run."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from budget_service.telemetry import status_document
from foundation import hsfile, states_manifest
from foundation.errors import EngineUnusable
from foundation.outputs import read_dead_letters, read_results, rows_file, states_file
from sglang_sim.hidden import states as expected_states
from sglang_sim.testing import SimServer
from testing.harness import started
from tests.faults.common import STATES_HIDDEN, STATES_LAYERS, states_config
from tests.helpers import training_row_ids, worker_processes
from tokencap.stack.stage import run_hidden_states

pytestmark = pytest.mark.slow

LAYERS, HIDDEN = STATES_LAYERS, STATES_HIDDEN
BPT = len(LAYERS) * HIDDEN * 2 + 8  # bf16 states and an int64 id per token


def config(tmp: Path, attempts: int = 4) -> Path:
    """Two categories of token-id prompts, generated on the simulator; their rows' states
    to `<tmp>/hs`."""
    return states_config(tmp, "hs", 30, attempts, lease_s=10.0)


def generate(path: Path, redis_url: str) -> None:
    from foundation.config import load_config

    cfg = load_config(path)
    with SimServer(time_scale=1000.0) as sim, started(cfg, redis_url, [sim.url], 2) as pipe:
        status = pipe.run()
    pipe.check_invariants(status)


@pytest.fixture(scope="module")
def generated(tmp_path_factory, redis_server) -> Path:
    """One generation run on the simulator, its output shared by the module's tests (each
    copies it: the stage writes only under its own folder)."""
    from redis import Redis

    tmp = tmp_path_factory.mktemp("hs-generated")
    generate(config(tmp), redis_server.url)
    Redis.from_url(redis_server.url).flushdb()
    return tmp / "out"


def prepared(tmp: Path, generated: Path, attempts: int = 4) -> Path:
    """A config in `tmp` whose run's output is the shared generation's."""
    shutil.copytree(generated, tmp / "out")
    return config(tmp, attempts)


def extractor(tmp: Path, **faults: float) -> SimServer:
    storage = tmp / "engine-files"
    storage.mkdir(exist_ok=True)
    sim = SimServer(flavor="vllm", time_scale=1000.0, extract_hidden_states=True,
                    hs_layer_ids=LAYERS, hs_hidden_size=HIDDEN, hs_dtype="bfloat16",
                    hs_storage_path=str(storage))
    sim.start()
    if faults:
        sim.set_faults(**faults)
    return sim


def stage_run(path: Path, redis_url: str, sim: SimServer, workers: int = 2,
              should_stop=lambda: False) -> dict:
    """The stage run to its end; its status as JSON (`tokencap status --json`'s)."""
    from foundation.config import load_config

    cfg = load_config(path)
    return status_document(run_hidden_states(cfg, redis_url, workers, extract_url=sim.url,
                                                should_stop=should_stop, progress_s=0.2,
                                                say=lambda line: None))


def kept_rows(tmp: Path, category: str) -> dict[str, list[int]]:
    rows = rows_file(_hs(tmp).output_dir, category).read_text().splitlines()
    return {r["id"]: r["input_ids"] for r in map(json.loads, rows)}


def _hs(tmp: Path):
    from foundation.config import load_config

    return load_config(tmp / "run.toml").hidden_states


def test_every_training_row_s_states_are_kept_once_and_equal_the_engine_s(
        tmp_path, redis_url, generated) -> None:
    path = prepared(tmp_path, generated)
    sim = extractor(tmp_path)
    try:
        status = stage_run(path, redis_url, sim)
        rerun_sim_before = len(sim.requests())
        again = stage_run(path, redis_url, sim)  # finished: nothing asked again
        rerun_asked = len(sim.requests()) - rerun_sim_before
    finally:
        sim.stop()
    # with no server at all, the finished stage's rerun exits 0 having asked nothing
    gone = subprocess.run([sys.executable, "-m", "tokencap.cli", "hidden-states", str(path),
                           "--extract-url", sim.url, "--redis-url", redis_url],
                          capture_output=True, text=True, timeout=120)
    assert gone.returncode == 0, gone.stderr
    assert "nothing to extract" in gone.stdout + gone.stderr
    hs = _hs(tmp_path)
    for name in ("a", "b"):
        st = status["categories"][name]
        rows = kept_rows(tmp_path, name)
        assert st["state"] == "exhausted" and st["samples"] == len(rows) > 20
        assert st["bytes_used"] == sum(len(ids) for ids in rows.values()) * BPT
        results = [r for r in read_results(Path(hs.output_dir) / name)
                   if not isinstance(r, hsfile.BadFile)]
        assert sorted(r.source_id for r in results) == sorted(rows)  # once each
        for r in results:
            ids = rows[r.source_id]
            file = states_file(hs.output_dir, name, r.source_id)
            assert r.hidden_states["file"] == os.path.relpath(file, hs.output_dir)
            tensors, meta = hsfile.read(file)
            hsfile.check(file, tensors, ids, len(LAYERS), HIDDEN, "BF16")
            want = expected_states(ids, LAYERS, HIDDEN)
            got = tensors["hidden_states"].array()
            assert abs(got - want).max() <= 2 ** -7 * abs(want).max()  # bf16's rounding
            assert meta == {}  # the engine's file as it wrote it: the row is the result's
            assert r.hidden_states["row"] == r.source_id
        files = list((Path(hs.output_dir) / name / "states").iterdir())
        assert len(files) == len(rows) and all(f.suffix == ".safetensors" for f in files)
        # the category's manifest, written at the stage's end: every kept file, proven
        doc = states_manifest.read(states_manifest.manifest_path(hs.output_dir, name), name)
        assert sorted(f.row for f in doc.files) == sorted(rows) and doc.run == "hs.hs"
        assert all(f.crc32 and f.header_crc32 is not None for f in doc.files)
        assert states_manifest.verify(hs.output_dir, name).problems == []
    # the engine's own files are gone once copied; the probe's too
    assert list((tmp_path / "engine-files").glob("*.safetensors")) == []
    # a rerun of a finished stage asks nothing, not even a probe
    assert rerun_asked == 0
    assert again["categories"]["a"]["samples"] == status["categories"]["a"]["samples"]


def test_a_byte_budget_closes_a_category(tmp_path, redis_url, generated) -> None:
    path = prepared(tmp_path, generated)
    from foundation.config import load_config

    rows = training_row_ids(load_config(path), "a")
    longest = max(len(ids) for _, ids in rows)
    budget = sum(len(ids) for _, ids in rows) // 3 * BPT  # a third of category a
    path.write_text(path.read_text().replace("[hidden_states]",
                                             f"[hidden_states]\nmax_bytes = {{ a = {budget} }}"))
    sim = extractor(tmp_path)
    try:
        status = stage_run(path, redis_url, sim)
    finally:
        sim.stop()
    a, b = status["categories"]["a"], status["categories"]["b"]
    assert a["state"] == "closed" and a["bytes_cap"] == budget // BPT * BPT
    assert 0 < a["samples"] < len(rows)
    # closed within a few rows of the budget (two workers in flight), past it by less
    assert a["bytes_cap"] - 3 * longest * BPT <= a["bytes_used"] < a["bytes_cap"] + \
        2 * longest * BPT
    assert b["state"] == "exhausted" and b["bytes_cap"] is None
    kept = list((Path(_hs(tmp_path).output_dir) / "a" / "states").iterdir())
    assert len(kept) == a["samples"]
    # closed by its budget is an end too: its manifest names what it kept
    proven = states_manifest.verify(_hs(tmp_path).output_dir, "a")
    assert proven.files == a["samples"] and proven.problems == []


@pytest.mark.parametrize("fault,reason", [("hs_nan_rate", "not_finite"),
                                          ("hs_zero_layer_rate", "zero_layer")])
def test_a_nan_or_all_zero_file_is_never_kept(tmp_path, redis_url, generated, fault,
                                              reason) -> None:
    path = prepared(tmp_path, generated, attempts=2)  # asked twice: a 2 s wait, not 12
    # every file bad: the preflight names the blocker before any row is sent
    sim = extractor(tmp_path, **{fault: 1.0})
    try:
        with pytest.raises(EngineUnusable, match=reason):
            stage_run(path, redis_url, sim)
    finally:
        sim.stop()
    # some files bad: each asked for again; a row whose every attempt is bad is dead, with
    # the check's reason; no bad file is ever kept
    sim = extractor(tmp_path)
    armed = threading.Event()

    def arm() -> bool:
        if not armed.is_set():  # after the preflight's probe
            sim.set_faults(**{fault: 0.5})
            armed.set()
        return False

    try:
        status = stage_run(path, redis_url, sim, should_stop=arm)
    finally:
        sim.stop()
    hs = _hs(tmp_path)
    for name in ("a", "b"):
        st = status["categories"][name]
        dead = [d for d in read_dead_letters(Path(hs.output_dir) / name)
                if not isinstance(d, hsfile.BadFile)]
        assert st["samples"] + len(dead) == len(kept_rows(tmp_path, name))
        assert st["state"] == "exhausted"
        assert all(d.reason == "bad_hidden_states" and reason in d.message for d in dead)
        rows = kept_rows(tmp_path, name)
        row_of = {states_file(hs.output_dir, name, r).name: r for r in rows}
        for f in (Path(hs.output_dir) / name / "states").iterdir():
            tensors, _ = hsfile.read(f)
            hsfile.check(f, tensors, rows[row_of[f.name]], len(LAYERS), HIDDEN, "BF16")
        assert len(list((Path(hs.output_dir) / name / "states").iterdir())) == st["samples"]


def test_workers_killed_mid_stage_and_a_rerun_leave_no_file_twice_and_none_torn(
        tmp_path, redis_url, generated) -> None:
    path = prepared(tmp_path, generated)
    hs = _hs(tmp_path)
    sim = extractor(tmp_path)
    killed = threading.Event()

    def kill_some() -> bool:
        done = sum(1 for _ in (Path(hs.output_dir) / "a" / "states").glob("*.safetensors")) \
            if (Path(hs.output_dir) / "a" / "states").is_dir() else 0
        if done >= 5 and not killed.is_set():
            # every worker of the stage, killed while it works (its process group)
            for pid in worker_processes():
                os.killpg(pid, signal.SIGKILL)
            killed.set()
            return True
        return False

    try:
        stage_run(path, redis_url, sim, should_stop=kill_some)
        assert killed.is_set()
        # stopped before its end: no manifest proves a half-kept category
        assert not states_manifest.manifest_path(hs.output_dir, "a").exists()
        # a kill mid-write leaves a temporary beside the row's name: planted for a row kept
        # and a row not yet done, whatever the kill's timing hit
        done = {r for r in kept_rows(tmp_path, "a")
                if states_file(hs.output_dir, "a", r).is_file()}
        todo = set(kept_rows(tmp_path, "a")) - done
        assert done and todo
        for row in (min(done), min(todo)):
            f = states_file(hs.output_dir, "a", row)
            f.with_name(f".{f.name}.999999.tmp").write_bytes(b"torn")
        status = stage_run(path, redis_url, sim)  # the same command again
    finally:
        sim.stop()
    for name in ("a", "b"):
        rows = kept_rows(tmp_path, name)
        results = [r for r in read_results(Path(hs.output_dir) / name)
                   if not isinstance(r, hsfile.BadFile)]
        assert status["categories"][name]["samples"] == len(rows)
        assert sorted(r.source_id for r in results) == sorted(rows)  # no row twice
        folder = Path(hs.output_dir) / name / "states"
        assert sorted(f.name for f in folder.iterdir()) == sorted(
            states_file(hs.output_dir, name, r).name for r in rows)  # no stray temp file
        row_of = {states_file(hs.output_dir, name, r).name: r for r in rows}
        for f in folder.iterdir():
            tensors, _ = hsfile.read(f)  # none torn
            hsfile.check(f, tensors, rows[row_of[f.name]], len(LAYERS), HIDDEN, "BF16")
        # the stopped run wrote no manifest, the rerun to the end one naming every file
        proven = states_manifest.verify(hs.output_dir, name)
        assert proven.files == len(rows) and proven.problems == []


def test_a_stage_before_any_row_was_generated_extracts_nothing(tmp_path, redis_url) -> None:
    path = config(tmp_path)  # no generation yet: no rows
    sim = extractor(tmp_path)
    try:
        status = stage_run(path, redis_url, sim)
    finally:
        sim.stop()
    assert all(st["samples"] == 0 for st in status["categories"].values())


def test_the_speculators_export_holds_each_row_s_states_by_its_index(
        tmp_path, redis_url, generated) -> None:
    import pyarrow as pa
    from click.testing import CliRunner

    from tokencap.cli.main import main

    path = prepared(tmp_path, generated)
    sim = extractor(tmp_path)
    try:
        status = stage_run(path, redis_url, sim)
    finally:
        sim.stop()
    kept = sum(st["samples"] for st in status["categories"].values())
    # one row of category b the stage kept nothing for (no file, not in the manifest): left
    # out of every format, counted; another whose kept file is lost since: the export stops
    # naming it, or with --skip-bad-states leaves it out, counted
    hs = _hs(tmp_path)
    never, lost = list(kept_rows(tmp_path, "b"))[:2]
    states_file(hs.output_dir, "b", never).unlink()
    doc = states_manifest.read(states_manifest.manifest_path(hs.output_dir, "b"))
    states_manifest.write(hs.output_dir, "b", doc.run, [f for f in doc.files if f.row != never])
    states_file(hs.output_dir, "b", lost).unlink()
    dest = tmp_path / "train"
    args = ["export", str(path), "--dest", str(dest), "--merged", "--hidden-states",
            "--max-length", "40", "--allow-simulated", "--draft-vocab-size", "0", "--json"]
    res = CliRunner().invoke(main, [*args, "--format", "speculators"])
    rel = os.path.relpath(states_file(hs.output_dir, "b", lost), hs.output_dir)
    assert res.exit_code == 2 and f"b: {rel}: missing" in res.output, res.output
    args.append("--skip-bad-states")
    if importlib.util.find_spec("torch") is None:
        # SpecForge's .ckpt files need torch (make test-engine writes them in the trainers'
        # venv): without it, one line saying how to get it, nothing written
        res = CliRunner().invoke(main, [*args, "--format", "specforge"])
        assert res.exit_code != 0 and "need torch" in res.output, res.output
        assert "Traceback" not in res.output and not (dest / "specforge.jsonl").exists()
    res = CliRunner().invoke(main, [*args, "--format", "speculators"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["total"]["dropped_no_states"] == summary["total"]["dropped_bad_states"] == 1
    assert summary["total"]["rows"] == kept - 2
    assert summary["hidden_states"]["trainers"]["speculators"]["args"] == (
        "--target-layer-ids 2 4 5")
    with pa.ipc.open_stream(str(dest / "speculators" / "data-00000-of-00001.arrow")) as r:
        table = r.read_all()
    ids = table.column("input_ids").to_pylist()
    names = table.column("id").to_pylist()
    assert len(ids) == kept - 2 and f"b/{lost}" not in names and f"b/{never}" not in names
    cut = 0
    for i, row_ids in enumerate(ids):
        f = dest / "speculators" / "hidden_states" / f"hs_{i}.safetensors"
        tensors, _ = hsfile.read(f)
        hsfile.check(f, tensors, row_ids, len(LAYERS), HIDDEN, "BF16")  # ids == the row's
        want = expected_states(row_ids, LAYERS, HIDDEN)  # a cut row: its first 40 tokens'
        assert abs(tensors["hidden_states"].array() - want).max() <= 2 ** -7 * 1.25
        cut += len(row_ids) == 40
    assert cut > 0  # some rows were cut at --max-length and their states with them


def test_plan_and_the_stage_s_plan_give_one_figure_for_the_states_bytes(
        tmp_path, generated) -> None:
    """After generation, `tokencap plan` and `hidden-states --plan` price the states on the
    same row tokens (prompt + output of every kept turn): one figure for one question."""
    from click.testing import CliRunner

    from tokencap.cli.main import main

    path = prepared(tmp_path, generated)
    figures = []
    for argv in (["plan", str(path)], ["hidden-states", str(path), "--plan"]):
        res = CliRunner().invoke(main, argv)
        assert res.exit_code == 0, res.output
        [line] = [ln for ln in res.output.splitlines() if ln.strip().startswith("in all:")]
        figures.append(line.strip())
    assert figures[0] == figures[1]
    assert "B in" in figures[0] and not figures[0].startswith("in all: 0 B")
    assert not (tmp_path / "hs" / "a" / "rows.jsonl").exists()  # --plan writes nothing


def test_rows_generated_after_a_stage_ran_are_appended_and_extracted_by_the_next_run(
        tmp_path, redis_url) -> None:
    from click.testing import CliRunner

    from budget_service.budget import Budget
    from budget_service.keys import Keys
    from foundation.config import load_config
    from foundation.redisconn import connect
    from tokencap.cli.main import main

    # Given a run whose category a closed at its cap, and a stage that extracted its rows
    path = states_config(tmp_path, "grow", 30, lease_s=10.0)
    path.write_text(path.read_text().replace('cap_tokens = "none"', "cap_tokens = 2000", 1))
    cfg = load_config(path)
    hs = _hs(tmp_path)
    rows_a = rows_file(hs.output_dir, "a")
    sim, ex = SimServer(time_scale=1000.0), extractor(tmp_path)
    sim.start()
    try:
        with started(cfg, redis_url, [sim.url], 2) as pipe:
            assert pipe.run()["categories"]["a"]["state"] == "closed"
        stage_run(path, redis_url, ex)
        before = rows_a.read_bytes()
        listed = len(before.splitlines())
        assert listed == len(training_row_ids(cfg, "a")) > 0
        # When the cap is raised and the run resumed: a makes more rows
        Budget(connect(redis_url), Keys(cfg.key_prefix, cfg.run)).operating.set_cap(
            "a", None, by="test")
        with started(cfg, redis_url, [sim.url], 2) as pipe:
            pipe.check_invariants(pipe.run())
        total = len(training_row_ids(cfg, "a"))
        assert total > listed
        # Then both plans say the rows not yet in the rows file, and write nothing
        for argv in (["hidden-states", str(path), "--plan"], ["plan", str(path)]):
            res = CliRunner().invoke(main, argv)
            assert res.exit_code == 0, res.output
            assert f"a: {total:,} rows, " in res.output
            assert (f"a: {total - listed:,} of them generated since the stage last ran, not "
                    "in its rows file yet") in res.output
            assert not any(ln.strip().startswith("b: ") and "generated since" in ln
                           for ln in res.output.splitlines())  # b has none
        assert rows_a.read_bytes() == before
        # and the next stage run appends them after the lines there, and extracts them
        status = stage_run(path, redis_url, ex)
    finally:
        sim.stop()
        ex.stop()
    after = rows_a.read_bytes()
    assert after.startswith(before) and len(after.splitlines()) == total
    for name in ("a", "b"):
        rows = kept_rows(tmp_path, name)
        assert sorted(rows) == sorted(r for r, _ in training_row_ids(cfg, name))
        st = status["categories"][name]
        assert st["state"] == "exhausted" and st["samples"] == len(rows)
        results = [r for r in read_results(Path(hs.output_dir) / name)
                   if not isinstance(r, hsfile.BadFile)]
        assert sorted(r.source_id for r in results) == sorted(rows)  # once each
        for row_id, ids in rows.items():
            f = states_file(hs.output_dir, name, row_id)
            hsfile.check(f, hsfile.read(f)[0], ids, len(LAYERS), HIDDEN, "BF16")
        assert len(list((Path(hs.output_dir) / name / "states").iterdir())) == len(rows)

