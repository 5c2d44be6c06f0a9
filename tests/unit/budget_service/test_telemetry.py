"""The run's typed status and its one JSON face: the run's end (`RunStatus.ended`, on
`budget_service.ledger.run_ended`), a hidden-state stage's bytes in the status document, and
the time series' points stored and read back typed."""

from __future__ import annotations

import msgspec
import pytest

from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.telemetry import (
    PointCategory,
    PointEngine,
    SeriesPoint,
    WriterState,
    status_document,
)
from tests.helpers import category_state, make_cfg, run_status


@pytest.fixture
def budget(redis) -> Budget:
    b = Budget(redis, Keys("tokencap", "t"))
    b.feeding.init_run(make_cfg())
    return b


@pytest.mark.parametrize(("states", "unwritten", "ended"), [
    ({"a": {"state": "exhausted"}, "b": {"state": "closed"}}, 0, True),
    # a closed category may hold parked samples back (a raised cap sends them)
    ({"a": {"state": "closed", "pending": 3, "parked": 3}}, 0, True),
    ({"a": {"state": "closed", "pending": 3, "parked": 2}}, 0, False),  # one still in flight
    ({"a": {"state": "exhausted", "pending": 1}}, 0, False),
    ({"a": {"state": "open"}, "b": {"state": "exhausted"}}, 0, False),
    ({"a": {"state": "exhausted"}}, 2, False),  # the writer has not written everything
])
def test_the_run_ends_when_every_category_ended_and_everything_is_written(
        states: dict, unwritten: int, ended: bool) -> None:
    status = run_status({n: category_state(**f) for n, f in states.items()},
                        writer=WriterState("h", None, unwritten))
    assert status.ended is ended


def test_a_hidden_state_stage_s_document_says_its_bytes_and_a_generation_s_does_not() -> None:
    cats = {"a": category_state(used=10, cap=100), "b": category_state(used=3, cap=None)}
    stage = status_document(run_status(cats, bytes_per_token=7))
    assert {n: (c["bytes_used"], c["bytes_cap"]) for n, c in stage["categories"].items()} == {
        "a": (70, 700), "b": (21, None)}
    assert list(stage["categories"]["a"])[-2:] == ["bytes_used", "bytes_cap"]
    assert "bytes_per_token" not in stage
    plain = status_document(run_status(cats))
    assert all("bytes_used" not in c for c in plain["categories"].values())


def test_a_point_is_stored_as_it_was_and_read_back_typed_with_its_id(budget: Budget) -> None:
    point = SeriesPoint(at=5, categories={"code": PointCategory(40, 1, 1000, "open")},
                        engines={"http://a": PointEngine(2.0, None), "http://b": PointEngine()},
                        workers=3, unwritten=1)
    budget.telemetry.record_point(point)
    (stored,) = budget.redis.xrange(budget.keys.series)
    assert msgspec.json.decode(stored[1][b"p"]) == {
        "at": 5, "categories": {"code": {"used": 40, "samples": 1, "cap": 1000,
                                         "state": "open"}},
        "engines": {"http://a": {"running": 2.0, "queued": None}, "http://b": {}},
        "workers": 3, "unwritten": 1}
    (back,) = budget.telemetry.series()
    assert back == msgspec.structs.replace(point, id=stored[0].decode())
