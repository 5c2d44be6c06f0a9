"""Rates and ETAs of a run: tokens per second over a recent window, and the time left to
each cap at that rate. The live board (`tokencap.reports.watch`), the progress lines
(`tokencap.reports.progress`) and the report's charts (`tokencap.reports.report`) all count
tok/s with `tok_s`; the live page (`budget_service/web/index.html`) does the same in its own JS."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from budget_service.telemetry import RunStatus, SeriesPoint

RATE_WINDOW_S = 60.0
NO_VALUE = "-"


def tok_s(used0: float, t0_s: float, used1: float, t1_s: float) -> float:
    """Tokens per second from (`t0_s`, `used0`) to (`t1_s`, `used1`): 0.0 when no time passed
    or `used` went down (a correction is not a negative rate)."""
    if t1_s <= t0_s or used1 < used0:
        return 0.0
    return (used1 - used0) / (t1_s - t0_s)


class CategoryRate(NamedTuple):
    """Tokens per second over the last window, and seconds until `used` reaches the cap."""

    tok_s: float
    eta_s: float | None


class RateTracker:
    """Keeps `(time, used)` per category over the last `window_s` seconds.

    `clock` returns seconds (monotonic by default; tests pass their own). The rate is the
    growth of `used` between the oldest and newest point in the window, divided by the time
    between them; with a single point it is 0. If `used` goes down (a Redis reset), the
    category's history restarts.
    """

    def __init__(self, window_s: float = RATE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._points: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, name: str, used: int, now: float | None = None) -> None:
        """Record `used` for category `name` at `now` (default: the clock)."""
        now = self.clock() if now is None else now
        points = self._points.setdefault(name, deque())
        if points and used < points[-1][1]:
            points.clear()
        points.append((now, used))
        while len(points) > 1 and points[0][0] < now - self.window_s:
            points.popleft()

    def tok_s(self, name: str) -> float:
        """Tokens per second of `name` over the window (0.0 without two points)."""
        points = self._points.get(name)
        if not points or len(points) < 2:
            return 0.0
        (t0, u0), (t1, u1) = points[0], points[-1]
        return tok_s(u0, t0, u1, t1)

    def rate(self, name: str, cap: int | None, used: int, state: str) -> CategoryRate:
        """Tok/s and ETA = (cap - used) / tok/s; the ETA is None unless the category is open,
        capped, below its cap and growing."""
        tok_s = self.tok_s(name)
        if state != "open" or tok_s <= 0 or cap is None or used >= cap:
            return CategoryRate(tok_s, None)
        return CategoryRate(tok_s, (cap - used) / tok_s)

    def update(self, status: RunStatus) -> dict[str, CategoryRate]:
        """Observe every category of a status now; return their rates.

        Categories no longer in the status are forgotten.
        """
        now = self.clock()
        cats = status.categories
        for gone in set(self._points) - set(cats):
            del self._points[gone]
        rates: dict[str, CategoryRate] = {}
        for name, st in cats.items():
            self.observe(name, st.used, now)
            rates[name] = self.rate(name, st.cap, st.used, st.state)
        return rates


def format_eta(eta_s: float | None) -> str:
    """`h:mm:ss`, or "-" when there is no ETA."""
    if eta_s is None or not math.isfinite(eta_s):
        return NO_VALUE
    total = round(eta_s)
    hours, rest = divmod(total, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


def series_rates(points: Sequence[SeriesPoint], status: RunStatus,
                 now_s: float, window_s: float = RATE_WINDOW_S) -> dict[str, CategoryRate]:
    """Rates over the last `window_s` of the run's time series (the budget service's points,
    `at` in ms) ending with `status` at `now_s`: the same from any shell, however long it
    has been watching."""
    tracker = RateTracker(window_s, clock=lambda: now_s)
    for p in points:
        if p.at / 1000 < now_s:
            for name, c in p.categories.items():
                tracker.observe(name, c.used, p.at / 1000)
    return tracker.update(status)
