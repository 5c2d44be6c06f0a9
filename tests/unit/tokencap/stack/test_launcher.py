"""The local stack (`tokencap/stack/launcher.py`: `Stack`): `down` stops what its pid files
name (never a process a stale one names), `add-workers` numbers new workers after the stack's
and gives them the run file's settings, the engine of the stack running here is found, and an
`up` that fails before anything is fed leaves the state dir as it found it. A whole `up` is
`tests/pipeline/test_stack.py`'s and `tests/faults/test_node_crash.py`'s."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from foundation.errors import TokencapError
from tests.conftest import write_config
from tokencap.stack import processes
from tokencap.stack.launcher import NothingToStop, Stack

IDLE = "import sys; sys.stdin.read()  # idle child"


def _sleeper() -> subprocess.Popen[bytes]:
    """A live process that does nothing until its stdin closes (or it is killed)."""
    return subprocess.Popen([sys.executable, "-c", IDLE], stdin=subprocess.PIPE)


def test_down_never_signals_a_process_a_stale_pid_file_names(tmp_path: Path, capsys) -> None:
    # Given a stack whose budget service was killed, its pid now another live process's
    state = tmp_path / ".run"
    dead, unrelated = _sleeper(), _sleeper()
    dead.kill()
    dead.wait()
    try:
        processes.record(state / "pids" / "budget.pid", unrelated.pid)
        pidfile = state / "pids" / "budget.pid"
        rec = processes.read(pidfile)
        assert rec is not None
        pidfile.write_text(f"{unrelated.pid}\n{rec.identity}x\n")  # recorded: another start
        (state / "env").write_text("REDIS_URL=redis://127.0.0.1:9/0\n")
        # When the stack is stopped
        Stack(state).down()
        # Then the unrelated process lives on, and the stale pid file is gone
        assert unrelated.poll() is None
        assert not pidfile.exists() and not (state / "env").exists()
        assert "budget was not running (stale pid file removed)" in capsys.readouterr().out
    finally:
        unrelated.kill()
        unrelated.wait()


def test_down_stops_every_process_of_the_stack_redis_last(tmp_path: Path, capsys) -> None:
    state = tmp_path / ".run"
    # each in a session of its own, as the stack starts them (`down` signals its group)
    children = {name: subprocess.Popen([sys.executable, "-c", IDLE], stdin=subprocess.PIPE,
                                       start_new_session=True)
                for name in ("redis", "worker-0", "writer")}
    try:
        for name, child in children.items():
            processes.record(state / "pids" / f"{name}.pid", child.pid)
        Stack(state).down()
        assert all(child.wait(30) is not None for child in children.values())
    finally:
        for child in children.values():
            child.kill()
            child.wait()
    out = capsys.readouterr().out.splitlines()
    assert out == ["[down] stopped writer", "[down] stopped worker-0", "[down] stopped redis"]
    assert list((state / "pids").iterdir()) == []
    with pytest.raises(NothingToStop, match="nothing to stop: no pid file of a stack in "):
        Stack(state).down()


def test_the_engine_of_the_stack_running_here_is_found_while_it_lives(tmp_path: Path) -> None:
    state = tmp_path / ".run"
    assert Stack(state).running_engine() == (None, False)  # no stack here
    state.mkdir()
    (state / "env").write_text("SGLANG_URL=http://127.0.0.1:30000\n")
    assert Stack(state).running_engine() == (None, False)  # its processes are gone
    budget, sim = _sleeper(), _sleeper()
    try:
        processes.record(state / "pids" / "budget.pid", budget.pid)
        assert Stack(state).running_engine() == ("http://127.0.0.1:30000", False)
        processes.record(state / "pids" / "sim.pid", sim.pid)
        assert Stack(state).running_engine() == ("http://127.0.0.1:30000", True)  # up --sim
    finally:
        for child in (budget, sim):
            child.kill()
            child.wait()


def test_added_workers_follow_the_stacks_numbers_and_take_the_run_files_settings(
        tmp_path: Path, redis_url, capsys) -> None:
    state = tmp_path / ".run"
    with pytest.raises(TokencapError, match="no stack is running here"):
        Stack(state).add_workers(1)
    (state / "pids").mkdir(parents=True)
    for n in (0, 1):  # the stack's workers, one of them stopped since
        (state / "pids" / f"worker-{n}.pid").write_text("1\n")
    (state / "env").write_text(f"REDIS_URL={redis_url}\nTOKENCAP_RUN=ghost\n"
                               "SGLANG_URL=http://127.0.0.1:9\nTOKENCAP_TOKEN=secret\n")
    stack = Stack(state)
    stack.add_workers(2)
    assert capsys.readouterr().out == "[up] 2 worker(s) started (4 in all)\n"
    assert stack.procs.spawned == ["worker-2", "worker-3"]
    # each is a `tokencap worker` on the run file's Redis and run: there is no run "ghost"
    # in that Redis, which each says (exit 7) in its log
    for name in stack.procs.spawned:
        assert stack.procs.children[name].wait(120) == 7
        assert "run 'ghost' not found: looked in Redis" in (state / "logs" / f"{name}.log"
                                                              ).read_text()


def test_an_up_that_fails_before_feeding_starts_nothing_and_leaves_the_run_file(
        tmp_path: Path) -> None:
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2]}\n')
    cfg = write_config(tmp_path, f'run = "r"\noutput_dir = "{tmp_path / "out"}"\n'
                       'sampling_defaults = "engine"\n[[category]]\nname = "a"\n'
                       f'source = "{tmp_path / "ids.jsonl"}"\nformat = "input_ids"\n'
                       "sampling = { max_new_tokens = 8 }\n")
    state = tmp_path / ".run"
    state.mkdir()
    before = "REDIS_URL=redis://127.0.0.1:9/0\nTOKENCAP_RUN=earlier\n"
    (state / "env").write_text(before)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(TokencapError, match=f"port {port} is taken"):
            Stack(state).up(cfg, 1, None, "http://127.0.0.1:9", 1.0, budget_port=port)
    assert (state / "env").read_text() == before
    assert not (state / "pids").exists()
