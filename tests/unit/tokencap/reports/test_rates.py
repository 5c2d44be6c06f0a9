"""Rates and ETAs (`tokencap/reports/rates.py`): tokens per second over the last minute, the
time left to each cap at that rate, the same from the run's time series."""

from __future__ import annotations

import pytest

from budget_service.ledger import CategoryState
from budget_service.telemetry import PointCategory, RunStatus, SeriesPoint
from tests.helpers import category_state, run_status
from tokencap.reports.rates import CategoryRate, RateTracker, format_eta, series_rates, tok_s


def cat(used: int, cap: int | None = 1000, state: str = "open") -> CategoryState:
    return category_state(cap=cap, used=used, samples=used // 10, state=state)


def doc(categories: dict[str, CategoryState]) -> RunStatus:
    return run_status(categories, "t")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rate_tracker_uses_the_last_minute() -> None:
    clock = FakeClock()
    tracker = RateTracker(window_s=60.0, clock=clock)

    def at(used: int) -> RunStatus:
        return doc({"code": cat(used, cap=10_000)})

    assert tracker.update(at(0))["code"] == CategoryRate(0.0, None)  # one point: no rate yet
    clock.now = 10.0
    assert tracker.update(at(1_000))["code"] == CategoryRate(100.0, 90.0)  # 9,000 left at 100/s
    # 70 s in: the point at t=0 left the window; from t=10 (1,000) to t=70 (7,000).
    clock.now = 70.0
    rate = tracker.update(at(7_000))["code"]
    assert rate.tok_s == pytest.approx(100.0) and rate.eta_s == pytest.approx(30.0)
    # Nothing new for a full minute: the rate falls to 0 and the ETA is unknown.
    clock.now = 131.0
    tracker.update(at(7_000))
    clock.now = 140.0
    assert tracker.update(at(7_000))["code"] == CategoryRate(0.0, None)


def test_rate_tracker_eta_none_when_closed_and_history_restarts_on_decrease() -> None:
    clock = FakeClock()
    tracker = RateTracker(clock=clock)
    tracker.update(doc({"a": cat(0), "b": cat(500)}))
    clock.now = 2.0
    rates = tracker.update(doc({"a": cat(100, state="closed"), "b": cat(400)}))
    assert rates["a"] == CategoryRate(50.0, None)  # closed: no ETA even with a rate
    assert rates["b"] == CategoryRate(0.0, None)  # used went down: history restarted
    clock.now = 4.0
    assert tracker.update(doc({"b": cat(600)}))["b"] == CategoryRate(100.0, 4.0)
    assert tracker.tok_s("a") == 0.0  # a category that left the document is forgotten


def test_tok_s_is_the_rate_between_two_readings_and_never_negative() -> None:
    assert tok_s(1_000, 10.0, 1_600, 13.0) == 200.0
    assert tok_s(1_000, 10.0, 1_600, 10.0) == 0.0  # no time passed
    assert tok_s(1_600, 10.0, 1_000, 13.0) == 0.0  # a correction lowered `used`


def test_format_eta() -> None:
    assert format_eta(None) == "-"
    assert format_eta(59.6) == "0:01:00"
    assert format_eta(3 * 3600 + 2 * 60 + 1) == "3:02:01"


def test_board_rates_come_from_the_runs_time_series_from_the_first_board() -> None:
    # the budget service recorded a point every 5 s: 100 tok/s for the last two minutes
    now = 1_800_000_000.0
    points = [SeriesPoint(at=int((now - 120 + 5 * k) * 1000),
                          categories={"code": PointCategory(500 * k, 50 * k, 42_000, "open")},
                          engines={}, workers=1, unwritten=0) for k in range(24)]
    status = doc({"code": cat(12_000, cap=42_000)})
    rates = series_rates(points, status, now)  # a board started this very moment
    assert rates["code"].tok_s == pytest.approx(100.0, rel=0.05)
    assert rates["code"].eta_s == pytest.approx(300.0, rel=0.05)
    assert series_rates([], status, now)["code"].tok_s == 0.0  # nothing recorded yet
