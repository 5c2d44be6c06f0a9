"""Waiting for a condition: poll it to a deadline (the launcher waits for the processes it
starts, the test harness and the bench for what a pipeline reaches). Nothing sleeps a fixed
time to let something happen."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.02


def wait_until(cond: Callable[[], T], timeout_s: float, what: str, interval_s: float = POLL_S,
               error: Callable[[str], Exception] = TimeoutError) -> T:
    """Poll `cond` until it returns something true, and return that; past `timeout_s`, raise
    `error("timed out after <timeout_s> s waiting for <what>")`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)
