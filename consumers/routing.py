"""Choosing an engine: affinity (a conversation's next turn to the engine that served the
turn before, samples sharing a long prompt prefix to one engine), else the least loaded of
two random picks; health checks; an optional adaptive gate that keeps each engine's waiting
queue short.

Affinity keeps prefill in the engines' prefix caches (SGLang's radix cache, vLLM's prefix
caching): a follow-up turn's prompt is the turn before's prompt and output plus a little,
and prompts that start alike (a tool schema) need it once per engine that serves them. The
preferred engine is the one that served the turn before (`prefer`), else for an affinity key
the healthy engine ranked first for that key by rendezvous hashing (every worker ranks alike,
with no coordination; an engine down moves only its own keys). It is passed over for the
least loaded of two random picks when it is down, when more requests wait in its queue than
in another engine's picked at random (a full batch: a cache hit is not worth a wait for a
slot), or when it is loaded well above that engine (`AFFINITY_SLACK` requests, or
`AFFINITY_SLACK_FRAC` of that engine's load). A router (sglang-router, cache-aware) is one
engine here: it routes on the `input_ids` itself.

Load is what the engines report (running + queued requests): SGLang's `/v1/loads` (0.5.9
and later, `foundation.engine.load.parse_loads`), else the Prometheus `/metrics` page
(`parse_metrics`), read at most every `LOAD_REFRESH_S` per process; an engine with neither
(SGLang before 0.5.9 started without `--enable-metrics`, or a router, which has no `/metrics`
on its serving port) counts as equally loaded: no load balancing then. An engine
that refuses connections is taken out for `DOWN_S`, then put back as soon as its `/health`
answers 200 (SGLang's `/health` runs a one-token generation: the probe waits for it).
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from dataclasses import dataclass, field

import requests

from foundation.engine.api import HEALTH_TIMEOUT_S
from foundation.engine.load import NO_LOAD_READINGS, LoadReader

log = logging.getLogger(__name__)

LOAD_REFRESH_S = 1.0
AFFINITY_SLACK = 4  # requests: the preferred engine may be this much busier than another
AFFINITY_SLACK_FRAC = 0.125  # ... or this share of that one's load, whichever is more
GATE_REFRESH_S = 0.1
GATE_WAIT_S = 0.2
# a worker that has sent nothing for this long (idle, or just started) reads the
# engine's queue after a random part of GATE_WAIT_S: workers that wake together (a start, a
# burst of jobs after a lull) then read one after another, each seeing the requests of those
# before it, instead of all reading the same empty queue and all passing
GATE_IDLE_S = 1.0
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


def _rank(key: str, url: str) -> int:
    """Rendezvous hashing: the engine with the highest rank for a key is the key's engine."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest(),
                          "big")


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
        self._free_at = float("-inf")  # when this worker's last request ended

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

    def order(self, prefer: str = "", affinity: str = "") -> list[str]:
        """Engines to try, best first: the preferred one (`prefer`, else `affinity`'s: the
        module docstring) unless it is down or loaded well above another random pick, else
        of two random healthy picks the less loaded one; then the rest, least loaded first.
        Engines due for a health check are probed first."""
        healthy = []
        for e in self.engines:
            if e.down_until and e.down_until <= time.monotonic():
                self._probe(e)
            if e.down_until <= time.monotonic():
                healthy.append(e)
        down = [e.url for e in self.engines if e not in healthy]
        if len(healthy) <= 1:
            return [e.url for e in healthy] + down
        first = self._preferred(healthy, prefer, affinity)
        if first is None:
            a, b = self._rng.sample(healthy, 2)
            for e in (a, b):
                self._refresh(e, LOAD_REFRESH_S)
            first = a if a.load <= b.load else b
        rest = sorted((e for e in healthy if e is not first), key=lambda e: e.load)
        return [first.url] + [e.url for e in rest] + down

    def _preferred(self, healthy: list[EngineState], prefer: str, affinity: str
                   ) -> EngineState | None:
        """The engine affinity picks among `healthy`, if it is not loaded well above another
        random pick (None: no affinity, or it is)."""
        target = next((e for e in healthy if e.url == prefer), None) if prefer else None
        if target is None and affinity:
            target = max(healthy, key=lambda e: _rank(affinity, e.url))
        if target is None:
            return None
        other = self._rng.choice([e for e in healthy if e is not target])
        for e in (target, other):
            self._refresh(e, LOAD_REFRESH_S)
        if target.queued > other.queued and target.load > other.load:
            return None  # requests wait there for a batch slot, and fewer elsewhere
        slack = max(AFFINITY_SLACK, AFFINITY_SLACK_FRAC * other.load)
        return target if target.load <= other.load + slack else None

    def done(self) -> None:
        """This worker's request ended (answered or not): it is not idle."""
        self._free_at = time.monotonic()

    def gate(self, url: str) -> int:
        """Adaptive concurrency: wait while the engine's waiting queue is at its bound.

        What it guarantees: a request passes only on a reading of the engine's queue (at
        most GATE_REFRESH_S old) below the bound, counting the requests this worker passed
        since that reading. Workers read independently, so several may pass on readings
        taken before each other's requests arrive; to thin that race, a reading of `queued`
        below the bound `m` lets a worker pass with probability (m - queued) / m (all pass on
        an empty queue, fewer as it fills: the waiting workers that read one freed slot do
        not all take it), and a worker back from idle reads after a random delay
        (`GATE_IDLE_S`). Returns how many times it waited."""
        if self.adaptive_max_queue is None:
            return 0
        e = next(x for x in self.engines if x.url == url)
        waits = 0
        if time.monotonic() - self._free_at > GATE_IDLE_S:
            time.sleep(GATE_WAIT_S * self._rng.random())
            e.load_at = float("-inf")  # read after the delay
        while True:
            self._refresh(e, GATE_REFRESH_S)
            bound = self.adaptive_max_queue
            if not e.has_metrics or (e.queued < bound and
                                     self._rng.random() * bound < bound - e.queued):
                e.queued += 1  # count ourselves until the next refresh
                return waits
            waits += 1
            time.sleep(GATE_WAIT_S * (0.5 + self._rng.random()))
