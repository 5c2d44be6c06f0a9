"""`tokencap worker --pool N`: N worker processes under one supervisor.

A worker that dies is started again (unless the pool is stopping or runs in burst mode);
SIGTERM/SIGINT is passed to every worker, which finishes its current sample and exits.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading

log = logging.getLogger(__name__)

POLL_S = 0.5
RESTART_DELAY_S = 1.0


def run_pool(argv: list[str], env: dict[str, str], n: int, *, restart: bool = True) -> int:
    stopping = threading.Event()
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)

    def on_signal(signum: int, _frame: object) -> None:
        stopping.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    procs.extend(start() for _ in range(n))
    log.info("worker pool: %d workers started", n)
    while not stopping.is_set():
        for i, p in enumerate(procs):
            code = p.poll()
            if code is None:
                continue
            if not restart:
                continue
            log.warning("worker pid %d exited with %s; starting another", p.pid, code)
            stopping.wait(RESTART_DELAY_S)
            if not stopping.is_set():
                procs[i] = start()
        if not restart and all(p.poll() is not None for p in procs):
            break
        stopping.wait(POLL_S)
    return max((p.wait() for p in procs), default=0) and 1
