"""Pid files that name a process, not only a number, and the table of a stack's processes
(`Table`: started, found alive, stopped by their pid files).

A pid file holds the pid on its first line and, on its second, the process's identity when
it was started: the machine's boot id and the process's start time (`/proc/<pid>/stat`, or
`ps -o lstart=` where there is no /proc). A process counts as the one recorded only while a
process with that pid runs (a zombie does not: killed, not yet reaped) with that same
identity. So a pid file left by a stack that was SIGKILLed whole (a node that rebooted, ran
out of memory, lost its container) is told from a live process even once its pid belongs to
another one. A pid file with no identity line (written before it had one) is checked by the
command line instead: the process must still be the program it names.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

PROC = Path("/proc")
BOOT_ID = PROC / "sys" / "kernel" / "random" / "boot_id"
# /proc/<pid>/stat after the ")" that ends the command name: state is the first field,
# starttime (clock ticks after boot) the twentieth (man 5 proc: fields 3 and 22)
STAT_STATE, STAT_START = 0, 19
GONE_STATES = ("Z", "X")  # zombie (dead, not reaped), dead
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent dies


class Recorded(NamedTuple):
    """What a pid file says: the pid and its identity at start ("" when not recorded)."""

    pid: int
    identity: str


def identity(pid: int) -> str | None:
    """The identity of the live process `pid` (boot id and start time), None when no live
    process has that pid: none, or a zombie."""
    if PROC.is_dir():
        try:
            stat = (PROC / str(pid) / "stat").read_text()
            boot = BOOT_ID.read_text().strip() if BOOT_ID.exists() else ""
        except OSError:
            return None
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[STAT_STATE] in GONE_STATES:
            return None
        return f"{boot}:{fields[STAT_START]}"
    state = _ps(pid, "stat=")
    return None if not state or state[:1] in GONE_STATES else _ps(pid, "lstart=") or None


def command_line(pid: int) -> str:
    """The command line of `pid` ("" when it is gone or cannot be read)."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return _ps(pid, "command=")


def _ps(pid: int, fields: str) -> str:
    """`ps -o fields -p pid` where there is no /proc ("" when no such process)."""
    try:
        return subprocess.run(["ps", "-o", fields, "-p", str(pid)], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def record(path: Path, pid: int) -> None:
    """Write the pid file of `pid`, which this process just started (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{pid}\n{identity(pid) or ''}\n")
    os.replace(tmp, path)


def read(path: Path) -> Recorded | None:
    """What the pid file `path` says; None when there is none or it holds no pid."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    with contextlib.suppress(ValueError, IndexError):
        return Recorded(int(lines[0]), lines[1].strip() if len(lines) > 1 else "")
    return None


def running(rec: Recorded | None, program: str) -> bool:
    """Whether the process `rec` names still runs: the same pid with the same identity (or,
    with no identity recorded, a live process whose command line names `program`)."""
    if rec is None:
        return False
    now = identity(rec.pid)
    if now is None:
        return False
    if rec.identity:
        return now == rec.identity
    return program in command_line(rec.pid)


def _prctl() -> Any:
    """libc's prctl, looked up once here (not in a forked child, where only the calling
    thread runs and a lookup could wait on a lock another thread held), None without one."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def die_with_parent() -> None:
    """In a child between fork and exec: SIGTERM it when the process that started it dies
    (Linux's parent-death signal), so a supervisor SIGKILLed leaves no child behind. Where
    there is no prctl the child outlives a killed parent."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM))


class Table:
    """The processes of one supervisor: with a state dir, `pids/<name>.pid` and
    `logs/<name>.log` under it, each process started in a session of its own and found again
    by a later process through its pid file (a stack's); without one (`state_dir` None),
    this process's children only, writing to its own output (a pool's). `programs` names
    what a process runs, by name (`default` for the rest), to check a pid file that has no
    identity line."""

    def __init__(self, state_dir: Path | None, programs: Mapping[str, str] | None = None,
                 default: str = "tokencap.cli") -> None:
        self.pids = state_dir / "pids" if state_dir is not None else None
        self.logs = state_dir / "logs" if state_dir is not None else None
        self.programs = programs or {}
        self.default = default
        self.spawned: list[str] = []  # what this process started, by name
        # this process's children: one that exited stays a zombie until it is waited for
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def pidfile(self, name: str) -> Path:
        assert self.pids is not None, "a table without a state dir keeps no pid files"
        return self.pids / f"{name}.pid"

    def names(self, prefix: str = "") -> list[str]:
        """The processes' names that start with `prefix` (pid files, else this process's
        children), in numeric order of their tail (worker-2 before worker-10)."""
        if self.pids is None:
            # a copy first: a stage beside generation starts children from another thread
            found = [n for n in list(self.children) if n.startswith(prefix)]
        elif not self.pids.exists():
            return []
        else:
            found = [p.stem for p in self.pids.glob(f"{prefix}*.pid")]
        return sorted(found, key=lambda n: (len(n), n))

    def spawn(self, name: str, argv: list[str], env: dict[str, str], *,
              with_parent: bool = False) -> int:
        """Start `argv` as `name`; `with_parent`: it dies with this process (`die_with_parent`)."""
        preexec = die_with_parent if with_parent else None
        if self.pids is None or self.logs is None:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, preexec_fn=preexec)
        else:
            self.pids.mkdir(parents=True, exist_ok=True)
            self.logs.mkdir(parents=True, exist_ok=True)
            with (self.logs / f"{name}.log").open("ab") as logf:
                proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env,
                                        start_new_session=True, preexec_fn=preexec)
            record(self.pidfile(name), proc.pid)
        self.spawned.append(name)
        self.children[name] = proc
        return proc.pid

    def exit_code(self, name: str) -> int | None:
        """The exit status of `name` when it is this process's child and ended (reaped here),
        else None."""
        child = self.children.get(name)
        return None if child is None else child.poll()

    def alive(self, name: str) -> bool:
        """Whether the process `name` still runs: this process's child not ended, else the
        process its pid file records (`running`)."""
        child = self.children.get(name)
        if child is not None and child.poll() is not None:
            return False
        if self.pids is None:
            return child is not None
        return running(read(self.pidfile(name)), self.programs.get(name, self.default))

    def stale(self, names: list[str]) -> list[str]:
        """Of the pid files `names`, those that name no live process of the stack any more;
        they are removed (a process started in its place writes its own)."""
        if self.pids is None:
            return []
        found = [n for n in names if read(self.pidfile(n)) is not None and not self.alive(n)]
        for name in found:
            self.pidfile(name).unlink(missing_ok=True)
        return found

    def stop(self, names: list[str], timeout_s: float, poll_s: float) -> list[str]:
        """SIGTERM the process groups of `names` that run, SIGKILL those still running after
        `timeout_s`, remove every pid file; returns the names that ran. A stale pid file is
        only removed: its pid may be another process's now."""
        live = [n for n in names if self.alive(n)]
        for name in live:
            self._signal(name, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in names:
            while self.alive(name) and time.monotonic() < deadline:
                time.sleep(poll_s)
            if self.alive(name):
                self._signal(name, signal.SIGKILL)
                child = self.children.get(name)
                if child is not None:
                    child.wait()
            if self.pids is not None:
                self.pidfile(name).unlink(missing_ok=True)
        return live

    def _signal(self, name: str, sig: signal.Signals) -> None:
        child = self.children.get(name)
        pid = child.pid if child is not None else None
        if pid is None and self.pids is not None:
            rec = read(self.pidfile(name))
            pid = rec.pid if rec is not None else None
        if pid is not None:
            with contextlib.suppress(OSError):
                os.killpg(pid, sig)
