"""Whether the run's engines answer, said where the user looks: the producer's engine watch
is the one owner of the run's engine trouble in Redis (`TelemetryLedger.record_engine_trouble`),
which `up`'s progress lines, `tokencap status`, the live page and `/metrics` read.

The engines are not asked while tokens are counted: a run that moves has engines that
answer. When no token was counted for `STALL_S` while samples wait on the engines (queued, at
an engine, or released after a failed attempt and waiting to be tried again; not those a
closed category holds back), each engine is asked (GET /health,
`foundation.engine.info.trouble`); one that does not answer is recorded with its reason and
since when, and asked again at each check until it answers, when its trouble is cleared and
its outage logged once with how long it lasted.

Samples at an engine alone would not do: an engine that refuses connections fails each
attempt at once, so its samples spend the outage waiting for their retry, not in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from budget_service.ledger import CategoryState, now_ms
from budget_service.telemetry import TelemetryLedger
from foundation.engine.api import EngineSpec

log = logging.getLogger(__name__)

# no token counted for this long while samples are in flight: the engines are asked
STALL_S = 10.0


def engine_trouble(spec: EngineSpec) -> str:
    from foundation.engine.info import trouble

    return trouble(spec)


class EngineWatch:
    """Call `check` with the categories' states now and then (the producer does, every
    progress tick); it asks the engines only when the run stalls, or while one is in
    trouble."""

    def __init__(self, telemetry: TelemetryLedger, engines: Sequence[EngineSpec],
                 probe: Callable[[EngineSpec], str] = engine_trouble,
                 clock: Callable[[], float] = time.monotonic,
                 wall_ms: Callable[[], int] = now_ms, stall_s: float = STALL_S) -> None:
        self.telemetry = telemetry
        self.stall_s = stall_s
        self.engines = list(engines)
        self.probe = probe
        self.clock = clock
        self.wall_ms = wall_ms
        self._used: dict[str, int] = {}
        self._moved_at = clock()
        self._down: set[str] | None = None  # what is recorded: read at the first check

    def check(self, states: Mapping[str, CategoryState]) -> None:
        if self._down is None:  # trouble an earlier producer recorded is this one's to clear
            self._down = set(self.telemetry.engine_trouble())
            ours = {spec.url for spec in self.engines}
            for url in self._down - ours:  # an engine this run no longer uses
                self.telemetry.record_engine_trouble(url, None, self.wall_ms())
            self._down &= ours
        now = self.clock()
        used = {name: st.used for name, st in states.items()}
        if used != self._used:
            self._used = used
            self._moved_at = now
        awaiting_engines = sum(st.pending - st.parked for st in states.values())
        stalled = awaiting_engines > 0 and now - self._moved_at >= self.stall_s
        if not (stalled or self._down):
            return
        for spec in self.engines:
            why = self.probe(spec)
            at = self.wall_ms()
            if why:
                since = self.telemetry.record_engine_trouble(spec.url, why, at)
                if spec.url not in self._down:
                    self._down.add(spec.url)
                    log.error("engine %s does not answer: %s (since %s)", spec.url, why,
                              time.strftime("%H:%M:%S", time.localtime(since / 1000)))
            elif spec.url in self._down or stalled:
                lasted = self.telemetry.record_engine_trouble(spec.url, None, at)
                self._down.discard(spec.url)
                if lasted >= 0:
                    log.warning("engine %s answers again, after %.0f s", spec.url,
                                lasted / 1000)
