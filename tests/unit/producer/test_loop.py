"""The producer's loop: what it tells while it ticks (the engines' watch, progress, the cap
changes another shell made)."""

from __future__ import annotations

from budget_service.telemetry import RunStatus
from producer.loop import FeedLoop
from testing.harness import Pipeline
from tests.faults.common import two_category_config


def test_the_producer_logs_a_cap_another_shell_changed(tmp_path, redis_url, caplog) -> None:
    pipe = Pipeline(two_category_config(tmp_path), redis_url, ["http://127.0.0.1:9"])
    loop = FeedLoop(pipe.build())
    pipe.budget.operating.set_cap("a", 4000, by="before the start")
    loop.log_events()  # what was there before it started is not news
    assert "cap changed" not in caplog.text
    pipe.budget.operating.set_cap("b", 9000, by="tokencap cap set (ann)")
    loop.log_events()
    loop.log_events()  # each change once
    assert caplog.text.count("cap changed") == 1
    assert "b: cap changed from 12000 to 9000 by tokencap cap set (ann)" in caplog.text


def test_the_loop_tells_the_typed_status_and_ends_on_the_run_s_end(tmp_path, redis_url) -> None:
    """Both caps closed before a sample is fed: nothing pending, nothing to write, so the
    run's end comes at the first idle tick; the status told and returned is typed and says
    so (`RunStatus.ended`: `tokencap up` exits 0 on it)."""
    pipe = Pipeline(two_category_config(tmp_path), redis_url, ["http://127.0.0.1:9"])
    producer = pipe.build()
    for name in ("a", "b"):
        pipe.budget.operating.set_cap(name, 0)
    told: list[RunStatus] = []
    final = FeedLoop(producer, told.append).run(poll_s=0.01, progress_s=0.0)
    assert told and all(isinstance(st, RunStatus) for st in told)
    assert final.ended and producer.finished()
    assert {st.state for st in final.categories.values()} == {"closed"}
