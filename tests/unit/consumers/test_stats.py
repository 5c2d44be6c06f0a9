"""`consumers/stats.py`: a worker's engine counters (requests by outcome, a cumulative latency
histogram, the latency sum, gate waits) and their flush into the run's totals in a real
Redis, every `FLUSH_EVERY_S` or when forced."""

from __future__ import annotations

from budget_service.budget import Budget
from budget_service.keys import Keys
from consumers import stats
from consumers.stats import EngineStats
from tests.helpers import make_cfg


def test_a_request_counts_by_outcome_in_every_bucket_it_fits() -> None:
    s = EngineStats()
    s.record("http://e", "ok", 0.4)
    s.record("http://e", "ok", 2.0)  # a bucket's bound is in it
    s.record("http://e", "timeout", 4000.0)
    s.gate_waits("http://e", 3)
    s.gate_waits("http://e", 0)
    c = s.counts
    assert (c["http://e|requests|ok"], c["http://e|requests|timeout"]) == (2, 1)
    assert [c[f"http://e|latency_le|{b}"] for b in ("0.1", "0.5", "1", "2", "5", "1800", "inf")
            ] == [0, 1, 1, 2, 2, 2, 3]
    assert c["http://e|latency_sum_ms"] == 400 + 2000 + 4_000_000
    assert c["http://e|gate_waits"] == 3


def test_the_counts_go_to_the_run_s_totals_when_due_or_forced(redis, monkeypatch) -> None:
    budget = Budget(redis, Keys("tokencap", "t"))
    budget.feeding.init_run(make_cfg())
    monkeypatch.setattr(stats, "FLUSH_EVERY_S", 3600.0)
    a, b = EngineStats(), EngineStats()  # two workers
    a.record("http://e", "ok", 0.2)
    a.flush(budget.samples)  # not due yet: kept
    assert budget.telemetry.engine_counts() == {} and a.counts
    a.flush(budget.samples, force=True)  # a worker's end
    assert not a.counts
    b.record("http://e", "ok", 1.0)
    b.record("http://f", "overload", 0.05)
    monkeypatch.setattr(stats, "FLUSH_EVERY_S", 0.0)  # due
    b.flush(budget.samples)
    totals = budget.telemetry.engine_counts()
    assert totals["http://e|requests|ok"] == 2 and totals["http://f|requests|overload"] == 1
    assert totals["http://e|latency_sum_ms"] == 1200 and totals["http://e|latency_le|0.5"] == 1
    b.flush(budget.samples, force=True)  # nothing new: nothing sent
    assert budget.telemetry.engine_counts() == totals
