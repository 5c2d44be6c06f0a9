"""`foundation/stopping.py`: SIGTERM and SIGINT call the handler while inside
`on_stop_signals`, the handlers before are put back on the way out (outside the main thread
nothing is installed), and `StopFlag` says what stopped it first. The signals are real: the
test sends them to its own process."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import pytest

from foundation.stopping import STOP_SIGNALS, StopFlag, on_stop_signals

WAIT_S = 10.0  # an upper bound only: the handler runs as soon as the signal is delivered


@pytest.fixture
def known_handlers():
    """A handler of the test's own on both signals before, the original ones put back after."""
    original = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    seen: list[int] = []

    def before(signum: int, _frame: FrameType | None) -> None:
        seen.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, before)
    yield before, seen
    for sig, handler in original.items():
        signal.signal(sig, handler)


def test_a_stop_signal_calls_the_handler_and_the_old_handlers_come_back(known_handlers) -> None:
    assert threading.current_thread() is threading.main_thread()
    before, seen_before = known_handlers
    got: list[int] = []
    called = threading.Event()

    def handler(signum: int) -> None:
        got.append(signum)
        called.set()

    with on_stop_signals(handler):
        assert all(signal.getsignal(sig) is not before for sig in STOP_SIGNALS)
        os.kill(os.getpid(), signal.SIGTERM)
        assert called.wait(WAIT_S)
        called.clear()
        os.kill(os.getpid(), signal.SIGINT)
        assert called.wait(WAIT_S)
    assert got == [signal.SIGTERM, signal.SIGINT] and seen_before == []
    assert all(signal.getsignal(sig) is before for sig in STOP_SIGNALS)


def test_the_old_handlers_come_back_when_the_block_raises(known_handlers) -> None:
    before, _ = known_handlers
    with pytest.raises(RuntimeError), on_stop_signals(lambda signum: None):
        raise RuntimeError("the work failed")
    assert all(signal.getsignal(sig) is before for sig in STOP_SIGNALS)


def test_outside_the_main_thread_nothing_is_installed(known_handlers) -> None:
    before, _ = known_handlers
    inside: list[object] = []

    def work() -> None:
        with on_stop_signals(lambda signum: None):
            inside.extend(signal.getsignal(sig) for sig in STOP_SIGNALS)

    t = threading.Thread(target=work)
    t.start()
    t.join(WAIT_S)
    assert inside == [before, before]


def test_a_stop_flag_says_what_stopped_it_first(known_handlers) -> None:
    flag = StopFlag()
    assert not flag and not flag.wait(0)
    with flag.catch():
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.wait(WAIT_S)
    flag.signalled(signal.SIGINT)  # a second signal does not rename it
    assert flag and flag.by == "SIGTERM"
    ctrl_c = StopFlag()
    ctrl_c.signalled(signal.SIGINT)
    ctrl_c.set("the run ended")
    assert ctrl_c.by == "Ctrl-C"
    told = StopFlag()
    told.set("the run ended")
    assert told and told.by == "the run ended"
