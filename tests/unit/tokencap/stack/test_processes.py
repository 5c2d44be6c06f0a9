"""Pid files that name a process (`tokencap/stack/processes.py`), and whether the one a pid file
names still runs: a killed process not yet reaped (a zombie) does not, nor a pid another
process has now; a pid file written before identities were recorded is checked by its
command line. What `down` does with a stale one is `test_launcher.py`'s."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from testing.harness import wait_until
from tokencap.stack import processes

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



def test_a_table_starts_finds_and_stops_its_processes_by_their_pid_files(
        tmp_path: Path) -> None:
    state = tmp_path / ".run"
    table = processes.Table(state)
    # a child that runs until it is killed
    argv = [sys.executable, "-c", "print('up', flush=True); import signal; signal.pause()"]
    for name in ("worker-10", "worker-2", "writer"):
        table.spawn(name, argv, dict(os.environ))
    try:
        # named in the numeric order of their tails, found by another process's table
        assert table.names("worker-") == ["worker-2", "worker-10"]
        later = processes.Table(state)
        assert later.names() == ["writer", "worker-2", "worker-10"]
        assert all(later.alive(n) for n in later.names())  # by pid and identity
        wait_until(lambda: (state / "logs" / "writer.log").read_text() == "up\n",
                   what="the writer's line in its log")
        table.children["worker-2"].kill()
        table.children["worker-2"].wait()
        assert later.stale(["worker-2", "worker-10"]) == ["worker-2"]  # its pid file removed
        assert later.names() == ["writer", "worker-10"] and not table.alive("worker-2")
        assert later.stop(["writer", "worker-10"], 30.0, 0.05) == ["writer", "worker-10"]
        assert [table.children[n].wait(30) for n in ("writer", "worker-10")] == [-15, -15]
        assert later.names() == []
    finally:
        for child in table.children.values():
            child.kill()
            child.wait()
