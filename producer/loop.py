"""The producer's loop: tick the `Producer` until the run's end, through Redis outages.

Every `progress_s` it tells what it sees: the engines' watch checks the states the last tick
steered on (`producer.engine_watch`), `on_progress` gets the run's typed status
(`budget_service.telemetry.RunStatus`: the progress lines, a test's probe), and the cap
changes another shell made are logged. The end is `Producer.finished` (the rule is
`budget_service.ledger.run_ended`); then the recovery's end-of-run cleanup runs and the loop
returns the final status.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from budget_service.telemetry import RunStatus
from foundation.backoff import REDIS_DOWN, Backoff
from producer.feeder import IDLE_TICK_S, Producer

if TYPE_CHECKING:
    from producer.engine_watch import EngineWatch

log = logging.getLogger(__name__)

PROGRESS_S = 2.0


class FeedLoop:
    """Ticks `producer` until the run's end (`run`); `on_progress` and `watch` (whether the
    engines answer, recorded for status) are told every `progress_s`."""

    def __init__(self, producer: Producer,
                 on_progress: Callable[[RunStatus], None] | None = None,
                 watch: EngineWatch | None = None) -> None:
        self.producer = producer
        self.on_progress = on_progress
        self.watch = watch
        self._events_after: dict[str, str] | None = None  # the event log read so far

    def run(self, poll_s: float = IDLE_TICK_S, progress_s: float = PROGRESS_S,
            should_stop: Callable[[], bool] = lambda: False) -> RunStatus:
        """Feed until the run is finished or `should_stop()`; survive Redis outages.

        While Redis cannot be reached nothing is fed (the budget fails closed); the loop
        retries with backoff and, if Redis came back without the run (restarted empty),
        rebuilds it from the output files before feeding again.
        """
        producer = self.producer
        telemetry = producer.budget.telemetry
        last = 0.0
        backoff = Backoff()
        redis_down_at: float | None = None
        while True:
            try:
                if should_stop():
                    break
                if producer.recovery.ensure_run(list(producer.feeds)):
                    producer.resync_all()
                work = producer.tick()
                now = time.monotonic()
                if now - last >= progress_s:
                    last = now
                    self.tell()
                if work == 0:
                    if producer.finished():
                        producer.recovery.finalize()
                        break
                    time.sleep(poll_s)
                backoff.reset()
                if redis_down_at is not None:
                    log.warning("Redis answers again, after %.0f s",
                                time.monotonic() - redis_down_at)
                    redis_down_at = None
            except REDIS_DOWN as exc:
                if redis_down_at is None:  # one line per outage, not one per retry
                    redis_down_at = time.monotonic()
                    log.error("Redis unavailable (%s): nothing is fed (fail closed) until it "
                              "answers; retrying", exc)
                backoff.wait()
                producer.recovery.redis_was_down()
        return telemetry.snapshot(list(producer.feeds))

    def tell(self) -> None:
        """What the loop tells every `progress_s`: the engines' watch, `on_progress` and the
        event log."""
        producer = self.producer
        if self.watch is not None and producer.last_states is not None:
            self.watch.check(producer.last_states)
        if self.on_progress:
            self.on_progress(producer.budget.telemetry.snapshot(list(producer.feeds)))
            self.log_events()

    def log_events(self) -> None:
        """Log the event log's entries (cap changes) written since the last call, so the
        shell running the run sees a cap another shell changed (none on the first call)."""
        feeds = list(self.producer.feeds)
        events = self.producer.budget.operating.events(feeds, self._events_after)
        if self._events_after is not None:
            for ev in events:
                log.warning("%s: cap changed from %s to %s by %s (%s tokens used)",
                            ev["category"], ev.get("old"), ev.get("new"), ev.get("by"),
                            ev.get("used"))
        after = dict(self._events_after or {})
        after.update({ev["category"]: ev["id"] for ev in events})
        self._events_after = after
