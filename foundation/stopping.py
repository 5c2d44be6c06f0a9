"""Being told to stop: SIGTERM (a pool, systemd, `tokencap down`) and SIGINT (Ctrl-C) caught
the one way every long-running command of tokencap catches them, so that what it is doing
ends cleanly (a sample finished, a line written) instead of a traceback."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


@contextlib.contextmanager
def on_stop_signals(handler: Callable[[int], None]) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT call `handler(signum)`; the handlers before are put
    back on the way out (only the main thread may install them: elsewhere, nothing is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def call(signum: int, _frame: FrameType | None) -> None:
        handler(signum)

    old = {sig: signal.signal(sig, call) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


class StopFlag:
    """Set by the first stop signal (`catch`) or by `set`; says by what (`by`: "Ctrl-C",
    "SIGTERM", or the reason given)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.by = ""

    def set(self, by: str) -> None:
        if not self.event.is_set():
            self.by = by
            self.event.set()

    def signalled(self, signum: int) -> None:
        self.set(SIGNAL_NAMES.get(signal.Signals(signum), signal.Signals(signum).name))

    def __bool__(self) -> bool:
        return self.event.is_set()

    def catch(self) -> contextlib.AbstractContextManager[None]:
        """`on_stop_signals` that sets this flag."""
        return on_stop_signals(self.signalled)

    def wait(self, timeout_s: float) -> bool:
        return self.event.wait(timeout_s)
