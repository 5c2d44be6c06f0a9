"""Pid files that name a process (`tokencap.stack.processes`), and what the launcher does with one
that names no process of its stack any more: a killed process not yet reaped (a zombie), a
pid another process has now, a pid file written before identities were recorded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from testing.harness import wait_until
from tokencap.stack import processes
from tokencap.stack.launcher import Stack

IDLE = "import sys; sys.stdin.read()  # idle child"


def _sleeper() -> subprocess.Popen[bytes]:
    """A live process that does nothing until its stdin closes (or it is killed)."""
    return subprocess.Popen([sys.executable, "-c", IDLE], stdin=subprocess.PIPE)


def test_a_recorded_process_runs_until_it_is_killed_even_unreaped(tmp_path: Path) -> None:
    child = _sleeper()
    pidfile = tmp_path / "x.pid"
    try:
        processes.record(pidfile, child.pid)
        rec = processes.read(pidfile)
        assert rec is not None and rec.pid == child.pid and rec.identity
        assert processes.running(rec, "python")
        child.kill()
        # not waited for: a zombie, which `kill -0` still finds
        wait_until(lambda: processes.identity(child.pid) is None, what="the child a zombie")
        os.kill(child.pid, 0)  # the pid still "exists"
        assert not processes.running(rec, "python")
    finally:
        child.kill()
        child.wait()
    assert not processes.running(rec, "python")  # reaped: no such pid


def test_a_pid_that_another_process_has_now_is_not_the_recorded_one(tmp_path: Path) -> None:
    gone = _sleeper()
    try:
        pidfile = tmp_path / "redis.pid"
        processes.record(pidfile, gone.pid)
        rec = processes.read(pidfile)
        assert rec is not None
    finally:
        gone.kill()
        gone.wait()
    # the recorded process died; its pid is another live process's now (this one's, which
    # started before it)
    pidfile.write_text(f"{os.getpid()}\n{rec.identity}\n")
    assert processes.identity(os.getpid()) not in (None, rec.identity)
    assert not processes.running(processes.read(pidfile), "python")


def test_a_pid_file_without_identity_is_checked_by_its_command_line(tmp_path: Path) -> None:
    child = _sleeper()
    try:
        pidfile = tmp_path / "old.pid"
        pidfile.write_text(str(child.pid))  # as written before pid files had an identity
        rec = processes.read(pidfile)
        assert rec == processes.Recorded(child.pid, "")
        assert processes.running(rec, "idle child")
        assert not processes.running(rec, "redis-server")
    finally:
        child.kill()
        child.wait()
    assert processes.read(tmp_path / "none.pid") is None
    (tmp_path / "bad.pid").write_text("not a pid\n")
    assert processes.read(tmp_path / "bad.pid") is None


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
