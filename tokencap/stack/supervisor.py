"""A supervisor of N processes: `tokencap worker --pool N` and `tokencap writer --supervise`.

A process that dies is started again (unless the pool is stopping or runs in burst mode),
after a delay that doubles while it keeps dying soon after its start (from RESTART_MIN_S up
to RESTART_MAX_S) and is back at its floor once one ran for STABLE_S: a worker that cannot
reach Redis is retried every half minute, not seven times in eight seconds. Each restart is
logged with the exit status and what it means. SIGTERM/SIGINT is passed to every process,
which finishes what it is doing and exits; the pool then returns.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time

from foundation.errors import exit_codes

log = logging.getLogger(__name__)

POLL_S = 0.5
RESTART_MIN_S = 1.0
RESTART_MAX_S = 30.0
STABLE_S = 30.0
MEANING = exit_codes()


def exit_meaning(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return MEANING.get(code, "exited")


class _Slot:
    """One process of the pool, and when to start it again once it died."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv, self.env = argv, env
        self.delay_s = RESTART_MIN_S
        self.restart_at: float | None = None
        self.proc = self.start()

    def start(self) -> subprocess.Popen[bytes]:
        self.started_at = time.monotonic()
        self.restart_at = None
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL)
        return self.proc

    def died(self, code: int, what: str) -> None:
        """Schedule the next start: soon after a long life, later and later after short ones."""
        now = time.monotonic()
        if now - self.started_at >= STABLE_S:
            self.delay_s = RESTART_MIN_S
        log.warning("%s pid %d %s (exit status %s); starting another in %.0f s", what,
                    self.proc.pid, exit_meaning(code), code, self.delay_s)
        self.restart_at = now + self.delay_s
        self.delay_s = min(self.delay_s * 2, RESTART_MAX_S)


def run_pool(argv: list[str], env: dict[str, str], n: int, *, restart: bool = True,
             what: str = "worker") -> int:
    stopping = threading.Event()
    slots: list[_Slot] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.set()
        for s in slots:
            if s.proc.poll() is None:
                s.proc.send_signal(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    slots.extend(_Slot(argv, env) for _ in range(n))
    log.info("%s pool: %d started", what, n)
    while not stopping.is_set():
        for s in slots:
            code = s.proc.poll()
            if code is None or not restart:
                continue
            if s.restart_at is None:
                s.died(code, what)
            elif time.monotonic() >= s.restart_at and not stopping.is_set():
                s.start()
        if not restart and all(s.proc.poll() is not None for s in slots):
            break
        stopping.wait(POLL_S)
    return max((s.proc.wait() for s in slots), default=0) and 1
