"""The run's typed status and its one JSON face: the run's end (`RunStatus.ended`, on
`budget_service.ledger.run_ended`), a hidden-state stage's bytes in the status document, a
run's stage beside it in its document, and the time series' points stored and read back
typed. The telemetry's Lua scripts called directly through its methods (`engine_info`,
`engine_trouble`, `series`), named `test_<script>_...`
(`test_scripts.py::test_every_script_has_a_direct_test`)."""

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
from foundation.engine.info import EngineInfo
from tests.helpers import category_state, make_cfg, run_status


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


def test_a_run_s_hidden_state_stage_is_in_its_status_document_when_it_exists(
        budget: Budget) -> None:
    assert budget.telemetry.stage() is None and "hidden_states" not in budget.telemetry.status()
    stage = Budget(budget.redis, Keys(budget.keys.prefix, "t.hs"))
    stage.feeding.init_run(msgspec.structs.replace(make_cfg(), run="t.hs"))
    found = budget.telemetry.stage()
    assert found is not None and found.keys.run == "t.hs"
    doc = budget.telemetry.status()
    assert doc["run"] == "t" and doc["hidden_states"]["run"] == "t.hs"
    assert list(doc["hidden_states"]["categories"]) == ["code"]
    assert stage.telemetry.stage() is None  # a stage has none of its own
    assert "hidden_states" not in stage.telemetry.status()


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


def test_engine_info_replaces_what_the_preflight_found(budget: Budget) -> None:
    a = EngineInfo(url="http://a:30000", api="sglang", model="Qwen/Qwen3-8B", version="0.5.23",
                   context_length=40960)
    b = EngineInfo(url="http://b:8000", api="openai", model="Qwen/Qwen3-8B", version="0.11.0")
    budget.telemetry.record_engines([a, b])
    assert budget.samples.engines_seen() == {a.url: a, b.url: b}
    sim = EngineInfo(url="http://a:30000", api="sglang", model="tokencap-sglang-sim",
                     simulated=True)
    budget.telemetry.record_engines([sim])  # a later preflight: engines no longer used are dropped
    assert budget.samples.engines_seen() == {sim.url: sim}
    assert budget.telemetry.status()["simulated"] is True



def test_engine_trouble_keeps_when_it_began_and_says_how_long_it_lasted(budget: Budget) -> None:
    t = budget.telemetry
    assert t.record_engine_trouble("http://a:30000", None, 1_000) == -1  # none to clear
    assert t.record_engine_trouble("http://a:30000", "connection refused", 5_000) == 5_000
    # asked again later with another reason: the reason is the latest, the start the first
    assert t.record_engine_trouble("http://a:30000", "HTTP 503", 9_000) == 5_000
    assert t.record_engine_trouble("http://b:30000", "read timeout", 7_000) == 7_000
    doc = t.status()["engine_trouble"]
    assert doc == {"http://a:30000": {"why": "HTTP 503", "since_ms": 5_000},
                   "http://b:30000": {"why": "read timeout", "since_ms": 7_000}}
    assert t.record_engine_trouble("http://a:30000", None, 12_500) == 7_500
    assert set(t.engine_trouble()) == {"http://b:30000"}
    from budget_service.telemetry import render_metrics

    page = render_metrics(t).decode()
    assert 'tokencap_engine_down{engine="http://b:30000",run="t"} 1.0' in page
    assert 'tokencap_engine_down_since_seconds{engine="http://b:30000",run="t"} 7.0' in page
    assert 'tokencap_engine_down{engine="http://a:30000"' not in page



def test_series_keeps_the_last_points_and_serves_those_after_an_id(budget: Budget) -> None:
    from budget_service.server import take_point

    for _ in range(3):
        budget.telemetry.record_point(take_point(budget))
    points = budget.telemetry.series()
    assert len(points) == 3 and points[0].categories["code"].used == 0
    assert points[0].at <= points[-1].at and points[-1].workers == 0
    assert budget.telemetry.series(points[0].id) == points[1:]
    assert budget.telemetry.series(count=1) == points[-1:]
    # bounded: the last `keep` stay, and at most one stream node (100 entries) more
    point = take_point(budget)
    for _ in range(400):
        budget.telemetry.record_point(point, keep=10)
    assert 10 <= len(budget.telemetry.series()) <= 110


def test_status_and_metrics_show_each_mode_against_its_weight(redis) -> None:
    from budget_service.telemetry import render_metrics
    from tests.helpers import modes_budget

    # Given a category of two modes by conversation, and one of share = "tokens" (its two
    # budgets `tok.think`, `tok.fast`), with rows of each mode committed
    budget = modes_budget(redis, "m")
    # Then the status document counts them per mode, beside the weights
    doc = budget.telemetry.status()
    assert doc["modes"]["conv"]["think"] == {"rows": 2, "tokens": 60, "share_rows": 2 / 3,
                                             "share_tokens": 0.6, "weight": 0.75}
    assert doc["modes"]["conv"]["fast"]["weight"] == 0.25
    # the budgets of a share = "tokens" category add up under its own name
    assert doc["modes"]["tok"]["think"] == {"rows": 1, "tokens": 60, "share_rows": 0.5,
                                            "share_tokens": 0.75, "weight": 0.75}
    assert doc["categories"]["tok.think"]["cap"] == 750
    # and /metrics has the same counters and the weights
    page = render_metrics(budget.telemetry).decode()
    assert 'tokencap_mode_rows_total{category="conv",mode="think",run="m"} 2.0' in page
    assert 'tokencap_mode_tokens_total{category="tok.fast",mode="fast",run="m"} 20.0' in page
    assert 'tokencap_mode_weight{category="tok",mode="think",run="m"} 0.75' in page
