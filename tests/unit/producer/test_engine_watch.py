"""The producer's engine watch: asks the engines only when the run stalls with samples waiting
on them (queued, in flight or waiting to retry; or while one is in trouble), records an engine
that does not answer with since when in Redis (status, `/metrics`, the live page read it),
clears it when it answers again, and clears what an earlier producer left of engines the run
no longer uses."""

from __future__ import annotations

import logging

import msgspec
import pytest

from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.ledger import CategoryState
from foundation.engine.api import engine_spec
from producer import engine_watch
from producer.engine_watch import EngineWatch
from tests.helpers import make_cfg

BASE: list[CategoryState] = []


def state(used: int, in_flight: int, pending: int | None = None, parked: int = 0
          ) -> CategoryState:
    """A category's state as the ledger gives it, with these counts (pending: in flight and
    parked unless said)."""
    pending = in_flight + parked if pending is None else pending
    return msgspec.structs.replace(BASE[0], used=used, in_flight=in_flight, pending=pending,
                                   parked=parked)


@pytest.fixture
def budget(redis) -> Budget:
    b = Budget(redis, Keys("tokencap", "t"))
    b.feeding.init_run(make_cfg())
    BASE[:] = [next(iter(b.states([c.name for c in make_cfg().category]).values()))]
    return b


def test_an_engine_that_stops_answering_while_the_run_stalls_is_recorded_until_it_answers(
        budget, caplog) -> None:
    clock = {"t": 100.0, "ms": 1_700_000_000_000}
    answers = {"now": False}
    asked: list[str] = []

    def probe(spec) -> str:
        asked.append(spec.url)
        return "" if answers["now"] else "connection refused"

    def tick(seconds: float) -> None:
        clock["t"] += seconds
        clock["ms"] += int(seconds * 1000)

    watch = EngineWatch(budget.telemetry, [engine_spec("http://gpu:30000")], probe,
                        clock=lambda: clock["t"], wall_ms=lambda: clock["ms"])
    caplog.set_level(logging.INFO, logger="producer.engine_watch")
    watch.check({"a": state(100, 4)})
    tick(engine_watch.STALL_S / 2)
    watch.check({"a": state(100, 4)})
    assert asked == []  # not stalled long enough to ask
    tick(engine_watch.STALL_S)
    since = clock["ms"]
    watch.check({"a": state(100, 4)})
    trouble = budget.telemetry.status()["engine_trouble"]
    assert trouble == {"http://gpu:30000": {"why": "connection refused", "since_ms": since}}
    tick(5)
    watch.check({"a": state(100, 4)})  # still away: asked again, the start kept
    assert len(asked) == 2
    assert budget.telemetry.status()["engine_trouble"]["http://gpu:30000"]["since_ms"] == since
    answers["now"] = True
    tick(5)
    watch.check({"a": state(140, 4)})
    assert budget.telemetry.status()["engine_trouble"] == {}
    said = [r.getMessage() for r in caplog.records]
    assert sum("does not answer" in m for m in said) == 1  # one line per outage
    assert any("answers again, after 10 s" in m for m in said)
    # a moving run, or a quiet one with nothing waiting on the engines (what a closed
    # category holds back, parked, waits on its cap), is not an engine's fault
    asked.clear()
    tick(100)
    watch.check({"a": state(140, 0)})
    watch.check({"a": state(140, 0, parked=6)})
    watch.check({"a": state(150, 4)})
    assert asked == []


def test_samples_waiting_to_retry_count_as_waiting_on_the_engines(budget) -> None:
    """An engine that refuses connections fails each attempt at once: its samples spend the
    outage released, waiting for their retry, with none in flight at any check. The CI
    failure of the fault test: such an engine was never asked, so never reported."""
    clock = {"t": 100.0}
    watch = EngineWatch(budget.telemetry, [engine_spec("http://gpu:30000")],
                        lambda spec: "connection refused", clock=lambda: clock["t"])
    watch.check({"a": state(100, 0, pending=12)})
    clock["t"] += engine_watch.STALL_S
    watch.check({"a": state(100, 0, pending=12)})
    assert budget.telemetry.engine_trouble()["http://gpu:30000"].why == "connection refused"


def test_trouble_an_earlier_producer_left_is_cleared(budget) -> None:
    budget.telemetry.record_engine_trouble("http://gone:1", "connection refused", 1_000)
    budget.telemetry.record_engine_trouble("http://gpu:30000", "HTTP 503", 2_000)
    watch = EngineWatch(budget.telemetry, [engine_spec("http://gpu:30000")], lambda s: "")
    watch.check({"a": state(10, 1)})  # the run moves: only what this watch owns is asked
    assert budget.telemetry.engine_trouble() == {}
