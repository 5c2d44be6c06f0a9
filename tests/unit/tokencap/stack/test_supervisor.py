"""The one supervisor (`tokencap/stack/supervisor.py`): a child that dies is started again
after a delay that doubles while it keeps dying young, each death said with its exit
status's meaning; `stop` ends what runs; a pool ends on SIGTERM."""

from __future__ import annotations

import sys
import time

from tokencap.stack import processes
from tokencap.stack.supervisor import (
    RESTART_MAX_S,
    RESTART_MIN_S,
    STABLE_S,
    Supervisor,
    exit_meaning,
    tokencap_argv,
)

EXITS_3 = [sys.executable, "-c", "raise SystemExit(3)"]
SLEEPS = [sys.executable, "-c", "import signal; signal.pause()"]  # runs until killed


def _died_and_scheduled(sup: Supervisor, name: str) -> float:
    """Wait for `name` to end, let the supervisor see it; the delay it chose."""
    sup.table.children[name].wait(30)
    before = time.monotonic()
    assert sup.tend() == []  # a death is not a start at once
    due = sup._restarts[name].due_at
    assert due is not None
    return due - before


def test_a_crash_looping_child_backs_off_and_says_why(caplog) -> None:
    sup = Supervisor(processes.Table(None))
    sup.start("w", EXITS_3, {})
    delays = []
    for _ in range(7):
        delays.append(round(_died_and_scheduled(sup, "w"), 1))
        sup._restarts["w"].due_at = time.monotonic()  # its delay has passed
        assert sup.tend() == ["w"]
    assert delays == [1, 2, 4, 8, 16, 30, 30]  # doubling, capped at RESTART_MAX_S
    assert max(delays) == RESTART_MAX_S
    assert caplog.text.count("Redis unreachable (exit status 3)") == 7
    sup._restarts["w"].started_at -= STABLE_S  # a process that lived long: a short delay
    assert round(_died_and_scheduled(sup, "w"), 1) == RESTART_MIN_S


def test_a_child_found_dead_at_once_is_started_now_and_stop_ends_what_runs() -> None:
    sup = Supervisor(processes.Table(None))
    sup.start("a", SLEEPS, {})
    sup.watch("b", SLEEPS, {})  # never started: like a stale pid file of a killed stack
    assert sup.tend(at_once=True) == ["b"]
    assert sup.alive("a") and sup.alive("b")
    assert sorted(sup.stop(timeout_s=10)) == ["a", "b"]
    assert not sup.alive("a") and not sup.alive("b") and sup.specs == {}
    assert sup.tend() == []  # nothing kept any more


def test_exit_statuses_are_said_in_words() -> None:
    assert exit_meaning(-9) == "killed by SIGKILL"
    assert exit_meaning(3) == "Redis unreachable"
    assert exit_meaning(10) == "no room on the disk"
    assert exit_meaning(None).startswith("ended")
    assert tokencap_argv("worker")[1:] == ["-m", "tokencap.cli", "worker"]
