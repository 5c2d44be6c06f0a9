"""Choosing an engine: least loaded of two random picks, health checks, and an optional
adaptive gate that keeps each engine's waiting queue short.

Load is what the engines report (running + queued requests): SGLang's `/v1/loads` (0.5.9
and later, `foundation.engine.parse_loads`), else the Prometheus `/metrics` page
(`parse_metrics`), read at most every `LOAD_REFRESH_S` per process; an engine with neither
(SGLang before 0.5.9 started without `--enable-metrics`, or a router, which has no `/metrics`
on its serving port) counts as equally loaded: no load balancing then. An engine
that refuses connections is taken out for `DOWN_S`, then put back as soon as its `/health`
answers 200 (SGLang's `/health` runs a one-token generation: the probe waits for it).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field

import requests

from foundation.engine import HEALTH_TIMEOUT_S, NO_LOAD_READINGS, LoadReader

log = logging.getLogger(__name__)

LOAD_REFRESH_S = 1.0
GATE_REFRESH_S = 0.1
GATE_WAIT_S = 0.2
DOWN_S = 5.0
PROBE_TIMEOUT_S = (1.0, 2.0)


@dataclass
class EngineState:
    url: str
    down_until: float = 0.0
    load: float = 0.0
    queued: float = 0.0
    load_at: float = -1e9
    has_metrics: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)


class EnginePool:
    """Engine choice for one worker process (one request in flight at a time)."""

    def __init__(self, urls: list[str], adaptive_max_queue: int | None = None,
                 session: requests.Session | None = None,
                 headers: dict[str, dict[str, str]] | None = None) -> None:
        self.engines = [EngineState(u.rstrip("/")) for u in urls]
        self.adaptive_max_queue = adaptive_max_queue
        self.http = session or requests.Session()
        self.headers = headers or {}
        self.loads = LoadReader(self.http.get)
        self._rng = random.Random()

    def _refresh(self, e: EngineState, max_age_s: float) -> None:
        now = time.monotonic()
        if not e.has_metrics or now - e.load_at < max_age_s:
            return
        e.load_at = now
        try:
            load, _source = self.loads.read(e.url, self.headers.get(e.url), PROBE_TIMEOUT_S)
        except requests.RequestException:
            return
        if load is None:
            e.has_metrics = False
            log.warning("engine %s: %s", e.url, NO_LOAD_READINGS)
            return
        e.queued = load["queued"] or 0.0
        e.load = (load["running"] or 0.0) + e.queued

    def _probe(self, e: EngineState) -> bool:
        try:
            ok = self.http.get(f"{e.url}/health", timeout=HEALTH_TIMEOUT_S,
                               headers=self.headers.get(e.url)).status_code == 200
        except requests.RequestException:
            ok = False
        if ok:
            if e.down_until:
                log.warning("engine %s is healthy again; sending it work", e.url)
            e.down_until = 0.0
        else:
            e.down_until = time.monotonic() + DOWN_S
        return ok

    def mark_down(self, url: str) -> None:
        for e in self.engines:
            if e.url == url:
                if not e.down_until:
                    log.warning("engine %s taken out for %.0f s", url, DOWN_S)
                e.down_until = time.monotonic() + DOWN_S

    def order(self) -> list[str]:
        """Engines to try, best first: of two random healthy picks the less loaded one,
        then the rest; engines due for a health check are probed first."""
        healthy = []
        for e in self.engines:
            if e.down_until and e.down_until <= time.monotonic():
                self._probe(e)
            if e.down_until <= time.monotonic():
                healthy.append(e)
        down = [e.url for e in self.engines if e not in healthy]
        if len(healthy) <= 1:
            return [e.url for e in healthy] + down
        a, b = self._rng.sample(healthy, 2)
        for e in (a, b):
            self._refresh(e, LOAD_REFRESH_S)
        first = a if a.load <= b.load else b
        rest = sorted((e for e in healthy if e is not first), key=lambda e: e.load)
        return [first.url] + [e.url for e in rest] + down

    def gate(self, url: str) -> int:
        """Adaptive concurrency: wait while the engine's waiting queue is at its bound.

        What it guarantees: a request passes only on a reading of the engine's queue (at
        most GATE_REFRESH_S old) below the bound, counting the requests this worker passed
        since that reading. Workers read independently, so several may pass on readings
        taken before each other's requests arrive. Returns how many times it waited."""
        if self.adaptive_max_queue is None:
            return 0
        e = next(x for x in self.engines if x.url == url)
        waits = 0
        while True:
            self._refresh(e, GATE_REFRESH_S)
            if not e.has_metrics or e.queued < self.adaptive_max_queue:
                e.queued += 1  # count ourselves until the next refresh
                return waits
            waits += 1
            time.sleep(GATE_WAIT_S * (0.5 + self._rng.random()))
