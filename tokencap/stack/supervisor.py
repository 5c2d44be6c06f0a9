"""The one supervisor of the processes tokencap starts: the stack's (`tokencap up`), a stage's
workers and writer (`tokencap/stack/stage.py`), a pool (`tokencap worker --pool N`, `tokencap
writer --supervise`).

- `tokencap_argv`: how a child runs tokencap (`python -m tokencap.cli ...`), built here only.
- `Supervisor`: named children of one `processes.Table` (pid files for the stack's, this
  process's children for a pool's). A child that dies is started again by `tend`, after a
  delay that doubles while it keeps dying soon after its start (RESTART_MIN_S up to
  RESTART_MAX_S) and is back at its floor once one ran for STABLE_S: a worker that cannot
  reach Redis is retried every half minute, not seven times in eight seconds. Each restart
  is logged with the exit status and what it means (`exit_meaning`). `stop` sends SIGTERM,
  then SIGKILL to what still runs after a timeout.
- `run_pool`: N copies of one command, tended until SIGTERM/SIGINT, which is passed to each
  (it finishes what it is doing and exits); the pool then returns.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from typing import NamedTuple

from foundation.errors import exit_codes
from foundation.stopping import StopFlag, on_stop_signals
from tokencap.stack import processes

log = logging.getLogger(__name__)

POLL_S = 0.5
RESTART_MIN_S = 1.0
RESTART_MAX_S = 30.0
STABLE_S = 30.0
STOP_TIMEOUT_S = 60.0  # a worker finishes the sample it holds before it exits
MEANING = exit_codes()


def tokencap_argv(*args: str) -> list[str]:
    """The command line of a tokencap child process: `python -m tokencap.cli ARGS`."""
    return [sys.executable, "-m", "tokencap.cli", *args]


def exit_meaning(code: int | None) -> str:
    """An exit status in words: the signal that killed it, or what tokencap's code means."""
    if code is None:
        return "ended (not a child of this process: its status is unknown)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return MEANING.get(code, "exited")


class Spec(NamedTuple):
    """How to start a child again."""

    argv: list[str]
    env: dict[str, str]
    with_parent: bool  # it dies with this process (a stage's, a pool's)


class _Restarts:
    """When to start a child again: soon after a long life, later and later after short ones."""

    def __init__(self) -> None:
        self.delay_s = RESTART_MIN_S
        self.started_at = time.monotonic()
        self.due_at: float | None = None
        self.deaths = 0

    def started(self) -> None:
        self.started_at = time.monotonic()
        self.due_at = None

    def died(self) -> float:
        """Schedule the next start; returns its delay."""
        self.deaths += 1
        now = time.monotonic()
        if now - self.started_at >= STABLE_S:
            self.delay_s = RESTART_MIN_S
        delay, self.due_at = self.delay_s, now + self.delay_s
        self.delay_s = min(self.delay_s * 2, RESTART_MAX_S)
        return delay


class Supervisor:
    """Children by name, each started again after it dies (module docstring)."""

    def __init__(self, table: processes.Table) -> None:
        self.table = table
        self.specs: dict[str, Spec] = {}
        self._restarts: dict[str, _Restarts] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str], *,
              with_parent: bool = False) -> None:
        """Start `name` now and keep it running."""
        self.watch(name, argv, env, with_parent=with_parent)
        self.table.spawn(name, argv, env, with_parent=with_parent)

    def watch(self, name: str, argv: list[str], env: dict[str, str], *,
              with_parent: bool = False) -> None:
        """Keep `name` running from now on (one already running: found by its pid file)."""
        self.specs[name] = Spec(argv, env, with_parent)
        self._restarts[name] = _Restarts()

    def forget(self, name: str) -> None:
        """Stop keeping `name` running (it is not stopped)."""
        self.specs.pop(name, None)
        self._restarts.pop(name, None)

    def alive(self, name: str) -> bool:
        return self.table.alive(name)

    def tend(self, names: list[str] | None = None, *, at_once: bool = False,
             what: str = "") -> list[str]:
        """Start again each kept child (of `names`, default all) that died and whose delay
        has passed; returns their names. A death is logged once, with its exit status and
        what it means. `at_once`: one found dead that never died under this supervisor (a
        stale pid file: killed before this process watched it) starts now, not after a
        delay."""
        started = []
        now = time.monotonic()
        for name in list(self.specs) if names is None else names:
            spec = self.specs.get(name)
            if spec is None or self.table.alive(name):
                continue
            r = self._restarts[name]
            if r.due_at is None:
                code = self.table.exit_code(name)
                if at_once and r.deaths == 0:
                    r.due_at = now
                else:
                    delay = r.died()
                    child = self.table.children.get(name)
                    log.warning("%s pid %s %s (exit status %s); starting another in %.0f s",
                                what or name, child.pid if child else "?", exit_meaning(code),
                                code, delay)
            if r.due_at is not None and now >= r.due_at:
                self.table.stale([name])  # its pid file: the new process writes its own
                self.table.spawn(name, spec.argv, spec.env, with_parent=spec.with_parent)
                r.started()
                started.append(name)
        return started

    def stop(self, names: list[str] | None = None, timeout_s: float = STOP_TIMEOUT_S,
             poll_s: float = 0.1) -> list[str]:
        """SIGTERM `names` (default: every child this supervisor keeps), SIGKILL what still
        runs after `timeout_s`; they are no longer kept. Returns those that ran."""
        names = list(self.specs) if names is None else names
        for name in names:
            self.forget(name)
        return self.table.stop(names, timeout_s, poll_s)


def run_pool(argv: list[str], env: dict[str, str], n: int, *, restart: bool = True,
             what: str = "worker") -> int:
    """N copies of `argv`, children of this process, each started again when it dies
    (unless `restart` is off: a burst pool ends when they all have), until SIGTERM/SIGINT,
    which is passed on to each. Returns 0 when they all exited 0, else 1."""
    table = processes.Table(None)
    sup = Supervisor(table)
    names = [f"{what}-{i}" for i in range(n)]
    stop = StopFlag()

    def on_signal(signum: int) -> None:
        stop.signalled(signum)
        for name in names:
            child = table.children.get(name)
            if child is not None and child.poll() is None:
                child.send_signal(signum)

    with on_stop_signals(on_signal):
        for name in names:
            if restart:
                sup.start(name, argv, env, with_parent=True)
            else:
                table.spawn(name, argv, env, with_parent=True)
        log.info("%s pool: %d started", what, n)
        while not stop:
            if restart:
                sup.tend(what=what)
            elif all(table.exit_code(name) is not None for name in names):
                break
            stop.wait(POLL_S)
        codes = [table.children[name].wait() for name in names]
    return 1 if any(codes) else 0


