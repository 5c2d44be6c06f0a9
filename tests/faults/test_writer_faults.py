"""The writer under faults, with real writer processes (`tokencap writer`), real workers and
the real producer: two writers at once, a writer stopped past its lease, a writer killed
under its supervisor, a full disk, `up` run again from another folder mid-run. Each run ends
with no id written twice and `used` equal to what the files hold (`check_invariants`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from foundation.config import RunConfig
from sglang_sim.testing import SimServer
from testing.harness import Pipeline, ledger_state, wait_until
from tests.conftest import ROOT, write_config
from tests.faults.common import Background, small_tmpfs, two_category_config

pytestmark = pytest.mark.slow

WRITER = [sys.executable, "-m", "tokencap.cli", "writer"]


def start_writer(pipe: Pipeline, *extra: str, log: Path | None = None
                 ) -> subprocess.Popen[bytes]:
    out = log.open("ab") if log else subprocess.DEVNULL
    return subprocess.Popen([*WRITER, *extra], env=pipe.env(), cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def unwritten(pipe: Pipeline) -> int:
    return int(pipe.budget.telemetry.status()["writer"]["unwritten"])


def used_total(pipe: Pipeline) -> int:
    return sum(int(ledger_state(pipe.budget, c.name)["used"]) for c in pipe.cfg.category)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_two_writers_started_at_once_one_writes_the_other_exits_8(tmp_path, redis_url) -> None:
    cfg = two_category_config(tmp_path, cap_a=8000, cap_b=6000)  # lock_ttl_s = 2
    with SimServer(time_scale=100.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])
        pipe.budget.feeding.init_run(cfg)
        logs = [tmp_path / "w0.log", tmp_path / "w1.log"]
        writers = [start_writer(pipe, log=log) for log in logs]
        try:
            # one of them gives up with exit 8, naming the other; the other keeps the run
            done = wait_until(lambda: [w for w in writers if w.poll() is not None],
                              timeout_s=60, what="one writer to give up")
            assert len(done) == 1 and done[0].returncode == 8
            (loser,) = done
            text = logs[writers.index(loser)].read_text()
            assert "another writer is running run 'faults'" in text and "Traceback" not in text
            pipe.build()
            pipe.start_workers(3)
            status = pipe.run()
        finally:
            pipe.close()
            for w in writers:
                stop(w)
    pipe.check_invariants(status)


def test_a_writer_stopped_past_its_lease_then_resumed_writes_no_id_twice(tmp_path,
                                                                         redis_url) -> None:
    cfg = two_category_config(tmp_path, cap_a=12000, cap_b=8000)  # lock_ttl_s = 2
    with SimServer(time_scale=60.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])
        pipe.budget.feeding.init_run(cfg)
        first = start_writer(pipe, log=tmp_path / "first.log")
        second: subprocess.Popen[bytes] | None = None
        try:
            pipe.build()
            pipe.start_workers(3)
            bg = Background(pipe).start()
            wait_until(lambda: used_total(pipe) >= 3000 and pipe.budget.writing.writer_holder(),
                       timeout_s=60, what="progress")
            # Given the writer stopped (SIGSTOP) until its lease has passed, and a second
            # writer started meanwhile (it takes the lease and waits for the folder)
            os.killpg(first.pid, signal.SIGSTOP)
            held_by = pipe.budget.writing.writer_holder()
            wait_until(lambda: pipe.budget.writing.writer_holder() != held_by, timeout_s=30,
                       what="the stopped writer's lease to pass")
            second = start_writer(pipe, log=tmp_path / "second.log")
            wait_until(lambda: pipe.budget.writing.writer_holder() not in (None, held_by),
                       timeout_s=30, what="the second writer to take the lease")
            # When the first goes on: it finds its lease gone and stops (exit 8) before it
            # appends, then the second one writes
            os.killpg(first.pid, signal.SIGCONT)
            assert first.wait(60) == 8
            status = bg.join(180)
        finally:
            pipe.close()
            stop(first)
            if second is not None:
                stop(second)
    pipe.check_invariants(status)  # no id twice, used == what the files hold
    assert "lost the writer lease" in (tmp_path / "first.log").read_text()


def test_a_writer_killed_under_its_supervisor_is_started_again(tmp_path, redis_url) -> None:
    cfg = two_category_config(tmp_path, cap_a=12000, cap_b=8000)
    with SimServer(time_scale=60.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])
        pipe.budget.feeding.init_run(cfg)
        supervisor = start_writer(pipe, "--supervise", log=tmp_path / "supervisor.log")
        try:
            pipe.build()
            pipe.start_workers(3)
            bg = Background(pipe).start()
            wait_until(lambda: used_total(pipe) >= 3000 and pipe.budget.writing.writer_holder(),
                       timeout_s=60, what="progress")
            child = int(pipe.budget.writing.writer_holder().split(":")[1])  # host:pid:...
            os.kill(child, signal.SIGKILL)
            # the lag shows while nothing writes (the new writer waits out the lease)
            wait_until(lambda: unwritten(pipe) > 0, timeout_s=30, what="a lag to show")
            status = bg.join(180)
            assert supervisor.poll() is None  # the supervisor itself goes on
        finally:
            pipe.close()
            supervisor.send_signal(signal.SIGTERM)
            supervisor.wait(30)
    pipe.check_invariants(status)
    text = (tmp_path / "supervisor.log").read_text()
    assert f"writer pid {child} killed by SIGKILL" in text


@pytest.fixture
def small_disk(tmp_path):
    """A 128 KiB tmpfs (root only: it is mounted and unmounted by the test)."""
    yield from small_tmpfs(tmp_path, "128k")


def test_a_full_disk_pauses_the_run_and_it_resumes_when_space_returns(tmp_path, redis_url,
                                                                      small_disk) -> None:
    src = tmp_path / "ids.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [900 + i, 5, 6, 7]}) + "\n"
                           for i in range(300)))
    cfg: RunConfig = write_config(tmp_path, f"""
run = "disk"
sampling_defaults = "engine"
output_dir = "{small_disk / 'out'}"
lock_ttl_s = 2.0
max_unwritten = 8
[[category]]
name = "a"
source = "{src}"
format = "input_ids"
cap_tokens = 400000
sampling = {{ max_new_tokens = 512 }}
""")
    with SimServer(time_scale=100.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])
        pipe.budget.feeding.init_run(cfg)
        writer = start_writer(pipe, log=tmp_path / "writer.log")
        try:
            pipe.build()
            pipe.start_workers(3)
            bg = Background(pipe).start()
            # Given a disk that fills up: the writer says so, and the run stops sending
            error = wait_until(lambda: pipe.budget.telemetry.status()["writer"]["error"],
                               timeout_s=90, what="the writer to report the full disk")
            assert "No space left on device" in error and "bytes free" in error
            def paused() -> Any:
                s = pipe.budget.telemetry.status()["categories"]["a"]
                return s["in_flight"] == 0 and s["unwritten"] >= cfg.max_unwritten and s

            st = wait_until(paused, timeout_s=60, what="admission to pause")
            assert st["state"] == "open"
            # When space returns, the run goes on to its end, nothing lost
            subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
            status = bg.join(180)
            assert pipe.budget.telemetry.status()["writer"]["error"] is None
        finally:
            pipe.close()
            stop(writer)
    pipe.check_invariants(status)
    assert status["categories"]["a"]["state"] == "exhausted"
    assert "No space left on device" in (tmp_path / "writer.log").read_text()


@pytest.mark.starts_stack
def test_up_run_again_from_another_folder_takes_over_with_one_writer(tmp_path,
                                                                     redis_url) -> None:
    cfg = two_category_config(tmp_path, cap_a=16000, cap_b=12000)
    config = tmp_path / "run.toml"
    with SimServer(time_scale=40.0) as sim:
        env = {**os.environ, "REDIS_URL": redis_url, "SGLANG_URL": sim.url,
               "PYTHONPATH": str(ROOT), "TOKENCAP_LOG_LEVEL": "WARNING"}
        env.pop("TOKENCAP_STATE_DIR", None)  # each folder's own .run/, as in a user's shell
        here, there = tmp_path / "here", tmp_path / "there"
        here.mkdir()
        there.mkdir()
        up = [sys.executable, "-m", "tokencap.cli", "up", str(config), "--workers", "3"]
        first = subprocess.Popen(up, cwd=here, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=False)
        pipe = Pipeline(cfg, redis_url, [sim.url])
        try:
            wait_until(lambda: pipe.budget.has_run() and used_total(pipe) >= 3000,
                       timeout_s=90, what="the first stack to make progress")
            holder = pipe.budget.writing.writer_holder()
            first.kill()  # the first `up` (its producer) dies; its writer and workers live
            first.wait(30)
            # `up` again, from another folder: it waits out the dead producer's lease, finds
            # the writer and the workers in Redis, and feeds the run to its end
            second = subprocess.run(up, cwd=there, env=env, capture_output=True, text=True,
                                    timeout=240)
            assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
            assert "the run's writer lease is held" in second.stdout
            assert "worker(s) already on run faults" in second.stdout
            assert pipe.budget.writing.writer_holder() == holder  # still the first one's writer
            pipe.build()  # to read the order and cursor for the invariants
            status = pipe.budget.telemetry.status()
        finally:
            for folder in (here, there):
                subprocess.run([sys.executable, "-m", "tokencap.cli", "down"], cwd=folder,
                               env=env, capture_output=True, timeout=60)
    pipe.check_invariants(status)
