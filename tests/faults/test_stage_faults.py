"""The hidden-state stage's own processes killed while it runs: its workers and its writer
SIGKILLed, all at once and one at a time. The one stage runner (`tokencap/stack/stage.py`)
starts each again (the writer once the killed one's lease ran out), and the stage finishes
with every training row's states kept once, each file checked against its row. Also: workers
killed between a file's check and its keep (no file twice, none torn, no engine file or lock
left, the rerun asks only for rows without a kept file), and a states disk that fills
mid-stage (the stage pauses without asking, says so in its status, and ends once there is
room)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.telemetry import status_document
from foundation import hsfile
from foundation.config import RunConfig, load_config
from foundation.outputs import BadLine, read_results, states_dir, states_file
from sglang_sim.testing import SimServer
from testing.harness import started
from tests.faults.common import STATES_HIDDEN, STATES_LAYERS, small_tmpfs, states_config
from tests.helpers import training_row_ids
from tokencap import extraction
from tokencap.stack import processes
from tokencap.stack.stage import run_hidden_states
from tokencap.stack.supervisor import Supervisor

pytestmark = pytest.mark.slow

LAYERS, HIDDEN = STATES_LAYERS, STATES_HIDDEN
ROWS = 80  # per category
STALL_S = 0.1  # each extraction takes this long: the stage runs for seconds, not ms
WORKERS = 3


def _kept(cfg_path: Path) -> int:
    spec = load_config(cfg_path).states()
    return sum(len(list(states_dir(spec.output_dir, c).glob("*.safetensors")))
               for c in ("a", "b"))


@pytest.mark.parametrize("how", ["all at once", "one at a time"])
def test_stage_workers_and_writer_killed_are_replaced_and_every_row_kept_once(
        tmp_path, redis_url, how) -> None:
    # Given a finished generation run and an extraction server that takes its time
    path, cfg, rows, storage = generated(tmp_path, redis_url, "stagefaults", ROWS)
    sup = Supervisor(processes.Table(None))
    names = [extraction.STATES_PREFIX + n for n in
             ("writer", *(f"worker-{i}" for i in range(WORKERS)))]
    # kill points: files kept before each kill; what each kill takes
    plan = ([(10, names)] if how == "all at once"
            else [(8 + 12 * k, [name]) for k, name in enumerate(names)])
    killed: list[tuple[str, int]] = []

    def kill_at_points() -> bool:
        while plan and _kept(path) >= plan[0][0]:
            for name in plan.pop(0)[1]:
                child = sup.table.children[name]
                os.kill(child.pid, signal.SIGKILL)
                killed.append((name, child.pid))
        return False

    # When the stage runs and its processes are SIGKILLed
    with SimServer(flavor="vllm", time_scale=1000.0, extract_hidden_states=True,
                   hs_layer_ids=LAYERS, hs_hidden_size=HIDDEN, hs_dtype="bfloat16",
                   hs_storage_path=str(storage), stall_s=STALL_S) as ex:
        status = run_hidden_states(cfg, redis_url, WORKERS, extract_url=ex.url,
                                sup=sup, should_stop=kill_at_points, progress_s=0.2,
                                say=lambda line: None)

    # Then every kill happened and each killed process was started again
    assert not plan, f"the stage ended before every kill point: {plan}, {_kept(path)} kept"
    assert sorted(n for n, _ in killed) == sorted(names)
    for name, pid in killed:
        assert sup.table.spawned.count(name) >= 2, f"{name} was not started again"
        assert sup.table.children.get(name) is None or sup.table.children[name].pid != pid
    assert all(child.poll() is not None for child in sup.table.children.values())
    # and the stage finished with every row's states kept once, each checked against its row
    spec = cfg.states()
    for c in ("a", "b"):
        assert status.categories[c].state == "exhausted"
        assert status.categories[c].samples == len(rows[c]) > 0
        results = [r for r in read_results(Path(spec.output_dir) / c)
                   if not isinstance(r, BadLine)]
        assert sorted(r.source_id for r in results) == sorted(rows[c])  # once each
        files = sorted(states_dir(spec.output_dir, c).iterdir())
        assert len(files) == len(rows[c])  # no stray or temporary file
        for row_id, ids in rows[c].items():
            f = states_file(spec.output_dir, c, row_id)
            hsfile.check(f, hsfile.read(f)[0], ids, len(LAYERS), HIDDEN, "BF16")


def _holding_engine_file(pid: int, storage: Path) -> bool:
    """Whether process `pid` has an engine's file of `storage` mapped under its engine name:
    it checked or is checking the file and has not kept it yet (a kept file's mapping reads
    under its new name)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return any(str(storage) in line and line.endswith(".safetensors")
               for line in maps.splitlines())


def generated(tmp_path: Path, redis_url: str, run: str, rows: int, **config: Any
              ) -> tuple[Path, RunConfig, dict[str, dict[str, list[int]]], Path]:
    """A finished generation run of `rows` rows a category (`states_config`), its training
    rows by category, and an empty folder for the extraction server's files."""
    path = states_config(tmp_path, run, rows, **config)
    cfg = load_config(path)
    with SimServer(time_scale=1000.0) as sim, started(cfg, redis_url, [sim.url], 2) as pipe:
        pipe.check_invariants(pipe.run())
    storage = tmp_path / "engine-files"
    storage.mkdir()
    return Path(path), cfg, {c: dict(training_row_ids(cfg, c)) for c in ("a", "b")}, storage


def test_workers_killed_between_the_check_and_the_keep_leave_no_file_twice_nor_engine_file(
        tmp_path, redis_url) -> None:
    """A worker SIGKILLed while it holds the engine's file mapped (checked or being checked,
    not yet renamed to the row's name): found by stopping them (SIGSTOP) and reading their
    memory maps. The engine's files they held stay behind; the stage's rerun asks only for
    the rows without a kept file, and ends with every row's file once, none torn, and no
    engine file or lock left."""
    # MBs a row: a long check
    path, cfg, rows, storage = generated(tmp_path, redis_url, "keepkill", 40, hidden=2048)
    sup = Supervisor(processes.Table(None))
    killed: list[int] = []
    stop_hunt = threading.Event()

    def hunt() -> None:  # stop every worker, kill those holding a file, let the rest go on
        while not stop_hunt.is_set() and not killed:
            pids = [c.pid for n, c in list(sup.table.children.items())
                    if "worker" in n and c.poll() is None and c.pid not in killed]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            for pid in pids:
                if _holding_engine_file(pid, storage):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            stop_hunt.wait(0.002)

    with SimServer(flavor="vllm", time_scale=1000.0, extract_hidden_states=True,
                   hs_layer_ids=LAYERS, hs_hidden_size=2048, hs_dtype="bfloat16",
                   hs_storage_path=str(storage)) as ex:
        hunter = threading.Thread(target=hunt, daemon=True)
        hunter.start()
        try:
            first = run_hidden_states(cfg, redis_url, WORKERS, extract_url=ex.url, sup=sup,
                                      should_stop=lambda: bool(killed), progress_s=0.2,
                                      say=lambda line: None)
        finally:
            stop_hunt.set()
            hunter.join(10)
        assert killed, "no worker was caught holding an engine's file"
        left = [p for p in storage.glob("*.safetensors")]
        assert left, "the killed workers' engine files should still be there"
        asked_before = len(ex.requests())
        status = run_hidden_states(cfg, redis_url, WORKERS, extract_url=ex.url,
                                   progress_s=0.2, say=lambda line: None)
        asked = len(ex.requests()) - asked_before
    spec = cfg.states()
    kept_first = sum(first.categories[c].samples for c in ("a", "b"))
    # the rerun asked for the rows without a kept file (and its probe), no more
    assert asked <= sum(len(r) for r in rows.values()) - kept_first + 1
    for c in ("a", "b"):
        assert status.categories[c].samples == len(rows[c])
        results = [r for r in read_results(Path(spec.output_dir) / c)
                   if not isinstance(r, BadLine)]
        assert sorted(r.source_id for r in results) == sorted(rows[c])  # once each
        files = sorted(states_dir(spec.output_dir, c).iterdir())
        assert len(files) == len(rows[c])  # no file twice, no temporary
        for row_id, ids in rows[c].items():
            f = states_file(spec.output_dir, c, row_id)
            hsfile.check(f, hsfile.read(f)[0], ids, len(LAYERS), 2048, "BF16")
    assert list(storage.iterdir()) == []  # no engine file, no lock


def test_a_full_states_disk_pauses_the_stage_without_asking_and_it_ends_once_there_is_room(
        tmp_path, redis_url, small_disk) -> None:
    """The states folder on a small tmpfs, the engine's on the usual disk (one copy per
    row). The disk fills mid-stage (another file takes its room): the stage pauses, says so
    in its status, asks the engine for no row it cannot keep and spends no attempt; once the
    room is back it ends with every row once and no engine file or lock left, the pause
    cleared."""
    path, cfg, rows, storage = generated(tmp_path, redis_url, "diskfull", 30, hidden=128,
                                          states_out=small_disk / "hs")
    budget = Budget(Redis.from_url(redis_url), Keys(cfg.key_prefix, cfg.run + ".hs"))
    filler = small_disk / "filler"
    seen: dict[str, object] = {}

    def fill_then_free() -> bool:
        if "filled" not in seen and _kept(path) >= 5:  # the disk fills mid-stage
            with filler.open("wb", buffering=0) as f:
                with contextlib.suppress(OSError):  # up to the last byte
                    while True:
                        f.write(b"\0" * 65536)
            seen["filled"] = True
        if "filled" in seen and "trouble" not in seen:
            snap = budget.telemetry.snapshot()
            if snap.disk_trouble:
                seen["trouble"] = dict(snap.disk_trouble)
                seen["status"] = status_document(snap)
                filler.unlink()  # the room is back
        return False

    with SimServer(flavor="vllm", time_scale=1000.0, extract_hidden_states=True,
                   hs_layer_ids=LAYERS, hs_hidden_size=128, hs_dtype="bfloat16",
                   hs_storage_path=str(storage)) as ex:
        status = run_hidden_states(cfg, redis_url, WORKERS, extract_url=ex.url,
                                   should_stop=fill_then_free, progress_s=0.2,
                                   say=lambda line: None)
        asked = len(ex.requests())
    assert "trouble" in seen, "the stage never paused on the full disk"
    for folder, trouble in seen["trouble"].items():  # type: ignore[attr-defined]
        assert folder.startswith(str(small_disk)) and "GB free" in trouble.why
    assert seen["status"]["disk_trouble"]  # type: ignore[index]
    spec = cfg.states()
    total = sum(len(r) for r in rows.values())
    # no row spent an attempt on the full disk, and no request storm: each row asked once,
    # plus the probe and at most one in flight per worker when the disk filled
    assert asked <= total + 1 + WORKERS
    for c in ("a", "b"):
        st = status.categories[c]
        assert (st.samples, st.failed) == (len(rows[c]), 0)
        files = sorted(states_dir(spec.output_dir, c).iterdir())
        assert len(files) == len(rows[c])
    assert list(storage.iterdir()) == []  # no engine file, no lock
    assert budget.telemetry.snapshot().disk_trouble == {}  # the pause is over


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs (root only: it is mounted and unmounted by the test)."""
    yield from small_tmpfs(tmp_path, "48m")
