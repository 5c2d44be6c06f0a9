"""The whole node crashes: every process of a stack `tokencap up` started (Redis with its
AOF, the simulator, the budget service, the writer and its supervisor, the workers, `up`
itself) is SIGKILLed at once, as when a GPU node reboots, runs out of memory or loses its
container. Then the same command: it finds every pid file stale (a killed process not yet
reaped is a zombie; a pid may be another process's now), starts Redis again on its port from
its AOF and everything else again, and the run finishes with no id twice and no gap.

And the same `up` tends the stack while it feeds: workers, writer and budget service killed
mid-run are started again; `up` again on the healthy stack starts nothing.

Bounds the mechanism gives, stated here: the rerun makes progress (a new row on disk) within
PROGRESS_BOUND_S of its start, and ends within FINISH_BOUND_S."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foundation.config import RunConfig
from foundation.outputs import read_committed
from foundation.wire import Result
from testing.harness import Pipeline, wait_until
from tests.conftest import DATASETS, QWEN, ROOT, write_config
from tests.faults.common import FAULT_KNOBS, ids_source
from tokencap.stack import launcher, processes
from tokencap.stack.runfile import run_file

pytestmark = [pytest.mark.slow, pytest.mark.starts_stack]

ROWS_BEFORE_CRASH = 20
WORKERS = [f"worker-{i}" for i in range(4)]
# up's own wait for a process to answer (Redis from its AOF, the simulator) + the producer's
# and the writer's lease waits (a killed holder's lease runs out: 1.5 x lock_ttl_s = 3 s
# each) + worker start-up on two busy cores; the bug this guards against made no progress
# at all
PROGRESS_BOUND_S = launcher.START_TIMEOUT_S + 2 * 1.5 * 2.0 + 25.0
FINISH_BOUND_S = 240.0


def _ids_config(tmp: Path) -> RunConfig:
    src, src_b = ids_source(tmp, 400), ids_source(tmp, 400, "ids-b.jsonl", base=700)
    return write_config(tmp, f"""
run = "crash"
output_dir = "{tmp / 'out'}"
{FAULT_KNOBS}
[[category]]
name = "a"
source = "{src}"
format = "input_ids"
cap_tokens = 6000
sampling = {{ max_new_tokens = 256 }}
[[category]]
name = "b"
source = "{src_b}"
format = "input_ids"
cap_tokens = 3000
sampling = {{ max_new_tokens = 256 }}
""")


def _conversation_config(tmp: Path) -> RunConfig:
    agent = tmp / "agent.json"
    agent.write_text(json.dumps(json.loads(
        (DATASETS / "agent" / "glaive_toolcall_en_demo.json").read_text())[:40]))
    return write_config(tmp, f"""
run = "crashconv"
output_dir = "{tmp / 'out'}"
tokenizer = "{QWEN}"
{FAULT_KNOBS}
[[category]]
name = "agent"
source = "{agent}"
turns = "all"
cap_tokens = 4000
sampling = {{ max_new_tokens = 128 }}
""")


def _rows(cfg: RunConfig) -> list[Result]:
    """Every committed sample on disk: training rows and replies the gate kept out."""
    return [r for cat in cfg.category
            for r in read_committed(Path(cfg.output_dir) / cat.name)
            if isinstance(r, Result)]


def _up(tmp: Path, workers: int, scale: str) -> list[str]:
    return [sys.executable, "-m", "tokencap.cli", "up", str(tmp / "run.toml"), "--sim",
            "--workers", str(workers), "--budget-port", "0", "--sim-time-scale", scale]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "SGLANG_URL", "TOKENCAP_STATE_DIR", "BUDGET_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), "TOKENCAP_LOG_LEVEL": "WARNING"}


def _kill_the_node(up: subprocess.Popen[bytes], pids: Path) -> list[int]:
    """SIGKILL `up` and every process group the stack's pid files name, at once; returns
    the pids killed (each dead or a zombie when this returns)."""
    recorded = [rec.pid for rec in map(processes.read, sorted(pids.glob("*.pid"))) if rec]
    for pid in [up.pid, *recorded]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    up.wait(30)
    wait_until(lambda: all(processes.identity(p) is None for p in recorded), timeout_s=30,
               what="every process of the stack dead (or a zombie)")
    return recorded


def _crash_and_rerun(tmp: Path, cfg: RunConfig, *, workers: int, scale: str, crash_when,
                     before_rerun=lambda state: None, once_it_writes=lambda state: None,
                     again: bool = False) -> str:
    """Start the stack, SIGKILL all of it once `crash_when(rows)`, call `before_rerun`, then
    the same command again (and `once_it_writes` when it wrote its first row); check the
    run's invariants (no id twice, no gap, used == the files, nothing left in flight); with
    `again`, the command once more on the healthy stack, which must start nothing. Returns
    the rerun's output."""
    state = tmp / ".run"
    cmd = _up(tmp, workers, scale)
    first = subprocess.Popen(cmd, cwd=tmp, env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: crash_when(_rows(cfg)), timeout_s=120,
                   what="rows on disk before the crash")
        saved = run_file(state)
        _kill_the_node(first, state / "pids")
        before_rerun(state)
        rows_at_crash = len(_rows(cfg))
        started = time.monotonic()
        second = subprocess.Popen(cmd, cwd=tmp, env=_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        wait_until(lambda: len(_rows(cfg)) > rows_at_crash or second.poll() is not None,
                   timeout_s=PROGRESS_BOUND_S, what="the rerun to write a new row")
        assert len(_rows(cfg)) > rows_at_crash, "the rerun ended without writing a row"
        progress_s = time.monotonic() - started
        once_it_writes(state)
        out, _ = second.communicate(timeout=FINISH_BOUND_S)
        assert second.returncode == 0, out[-3000:]
        assert progress_s <= PROGRESS_BOUND_S
        # Redis came back where the run file says it is, from its AOF
        assert run_file(state)["REDIS_URL"] == saved["REDIS_URL"]
        assert "stale pid file(s) replaced" in out and "Traceback" not in out
        pipe = Pipeline(cfg, saved["REDIS_URL"], [saved["SGLANG_URL"]])
        pipe.build()  # the seeded order and the cursor, for the no-gap check
        pipe.check_invariants(pipe.budget.telemetry.status())
        if any(c.turns == "all" for c in cfg.category):
            assert any(r.turn > 1 for c in cfg.category for r in pipe.committed(c.name))
        if again:
            healthy = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True,
                                     timeout=FINISH_BOUND_S)
            assert healthy.returncode == 0, healthy.stdout[-2000:]
            assert "started" not in healthy.stdout and "stale" not in healthy.stdout
        return out
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        subprocess.run([sys.executable, "-m", "tokencap.cli", "down"], cwd=tmp, env=_env(),
                       capture_output=True, timeout=60)


def test_the_whole_stack_killed_at_once_the_same_command_finishes_the_run(tmp_path) -> None:
    cfg = _ids_config(tmp_path)
    out = _crash_and_rerun(tmp_path, cfg, workers=4, scale="12",
                           crash_when=lambda rows: len(rows) >= ROWS_BEFORE_CRASH, again=True)
    assert "started redis-server" in out and "the simulator" in out
    assert "4 of this stack's 4 worker(s) were gone: started again" in out


def _kill(state: Path, names: list[str]) -> None:
    for name in names:
        rec = processes.read(state / "pids" / f"{name}.pid")
        assert rec is not None
        os.killpg(rec.pid, signal.SIGKILL)


def test_the_redis_pid_file_names_an_unrelated_live_process(tmp_path) -> None:
    cfg = _ids_config(tmp_path)
    unrelated = subprocess.Popen(["sleep", "600"])
    try:
        def reuse_pid(state: Path) -> None:
            # the pid Redis had now belongs to another process (a reboot reuses pids)
            pidfile = state / "pids" / "redis.pid"
            rec = processes.read(pidfile)
            assert rec is not None
            pidfile.write_text(f"{unrelated.pid}\n{rec.identity}\n")

        # and while the rerun feeds, its workers, writer and budget service die (`up` tends
        # the stack: it starts each again, the writer once the killed one's lease ran out)
        out = _crash_and_rerun(
            tmp_path, cfg, workers=4, scale="12",
            crash_when=lambda rows: len(rows) >= ROWS_BEFORE_CRASH, before_rerun=reuse_pid,
            once_it_writes=lambda state: _kill(state, ["writer", "budget", *WORKERS]))
        assert "started redis-server" in out
        assert out.count("4 of this stack's 4 worker(s) were gone: started again") == 2
        assert "the budget service was gone: started again" in out
        assert unrelated.poll() is None  # neither `up` nor `down` touched it
    finally:
        unrelated.kill()
        unrelated.wait()


def test_the_whole_stack_killed_with_conversations_in_flight(tmp_path) -> None:
    cfg = _conversation_config(tmp_path)

    def later_turns_written(rows: list[Result]) -> bool:
        return sum(1 for r in rows if r.turn > 1) >= 3

    out = _crash_and_rerun(tmp_path, cfg, workers=3, scale="30",
                           crash_when=later_turns_written)  # no turn twice, no gap
    assert "3 of this stack's 3 worker(s) were gone: started again" in out

