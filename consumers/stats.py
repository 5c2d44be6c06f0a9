"""Per-engine request counters and latency histograms, kept per worker process and added
to the run's totals every `FLUSH_EVERY_S` (`SampleLedger.add_engine_counts`, one Lua call), for
`/metrics`.

Fields: `<engine>|requests|<outcome>` counts, `<engine>|latency_le|<bucket>` cumulative
histogram counts, `<engine>|latency_sum_ms`, `<engine>|gate_waits` (times a worker waited at
the adaptive gate before sending).
"""

from __future__ import annotations

import time
from collections import Counter

from budget_service.samples import SampleLedger

LATENCY_BUCKETS_S = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, float("inf"))
FLUSH_EVERY_S = 5.0


class EngineStats:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._flushed_at = time.monotonic()

    def record(self, engine: str, outcome: str, latency_s: float) -> None:
        self.counts[f"{engine}|requests|{outcome}"] += 1
        for b in LATENCY_BUCKETS_S:
            if latency_s <= b:
                self.counts[f"{engine}|latency_le|{b:g}"] += 1
        self.counts[f"{engine}|latency_sum_ms"] += int(latency_s * 1000)

    def gate_waits(self, engine: str, waits: int) -> None:
        self.counts[f"{engine}|gate_waits"] += waits

    def flush(self, budget: SampleLedger, force: bool = False) -> None:
        if not self.counts or (not force and time.monotonic() - self._flushed_at
                               < FLUSH_EVERY_S):
            return
        budget.add_engine_counts(self.counts)
        self.counts.clear()
        self._flushed_at = time.monotonic()
