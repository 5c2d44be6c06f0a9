"""Every Redis key and queue name tokencap uses, in one place.

Per-category keys carry a hash tag `{run:category}` so that a Redis Cluster keeps a
category on one slot (each Lua script touches one category only).

| key (prefix `P:run`)   | type   | writer                  | reader                  | lifetime  |
|------------------------|--------|-------------------------|-------------------------|-----------|
| `P:run:meta`           | hash   | producer (init)         | all                     | run       |
| `P:run:{cat}:state`    | hash   | admit/commit/fail/close | status, producer        | run       |
| `P:run:{cat}:pending`  | hash   | producer (feed)         | admit, reaper           | to final  |
| `P:run:{cat}:leases`   | zset   | feed, admit, heartbeat  | reaper                  | to final  |
| `P:run:{cat}:parked`   | zset   | admit ("wait")          | producer (unpark)       | to unpark |
| `P:run:{cat}:reserved` | hash   | admit, heartbeat        | commit, fail            | in flight |
| `P:run:{cat}:final`    | hash   | commit, fail, skip      | admit, feed, reconcile  | run       |
| `P:run:{cat}:hist`     | hash   | commit, reconcile       | workers (estimates)     | run       |
| `P:run:{cat}:results`  | stream | commit                  | writer (group `writer`) | to write  |
| `P:run:{cat}:dead`     | stream | fail                    | writer (group `writer`) | to write  |
| `P:run:{cat}:prompts`  | hash   | dedup (digest -> id)    | dedup                   | run       |
| `P:run:{cat}:reasons`  | hash   | fail, dedup (counts)    | status                  | run       |
| `P:run:{cat}:worst`    | hash   | admit                   | admit (hard guard)      | in flight |
| `P:run:{cat}:var`      | hash   | admit, heartbeat        | admit (margin)          | in flight |
| `P:run:producer`       | string | producer (lock, TTL)    | producer                | 15 s TTL  |
| `P:refused`            | stream | worker (refused jobs)   | operators               | capped    |

State hash fields: cap, used, reserved, worst (the most in-flight samples can still add),
var (the variance of what they will add, tokens^2),
samples, skipped, failed, rejected, waste, closed (0/1), exhausted (0/1), rate (EWMA of
per-request decode tok/s), dup_prompts, cursor (producer position in the shuffled order).
`final` values: `c:<counted>`, `s`, `r:<reason>`, `d:<kind>`.
RQ queue names: `<run>.<category>` (so `rq info` shows one queue per category).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import NamedTuple

WRITER_GROUP = "writer"
HIST_BUCKET_TOKENS = 16


class CategoryKeys(NamedTuple):
    state: str
    pending: str
    leases: str
    parked: str
    reserved: str
    final: str
    hist: str
    results: str
    dead: str
    prompts: str
    reasons: str
    worst: str
    var: str


class Keys:
    """Key names for one run under one prefix."""

    def __init__(self, prefix: str, run: str) -> None:
        self.prefix = prefix
        self.run = run
        self.base = f"{prefix}:{run}"

    @property
    def meta(self) -> str:
        return f"{self.base}:meta"

    def cat(self, category: str) -> CategoryKeys:
        tag = f"{self.base}:{{{self.run}:{category}}}"
        return CategoryKeys(*(f"{tag}:{name}" for name in CategoryKeys._fields))

    def queue_name(self, category: str) -> str:
        return f"{self.run}.{category}"

    def queue_names(self, categories: Iterable[str]) -> list[str]:
        return [self.queue_name(c) for c in categories]

    def job_id(self, category: str, sample_id: str, seq: int) -> str:
        """Deterministic RQ job id from (run, category, sample, feed sequence number).

        RQ allows only letters, digits, `_` and `-` in ids, so the triple is hashed."""
        digest = hashlib.sha1(f"{self.run}\0{category}\0{sample_id}".encode()).hexdigest()
        return f"tc-{digest[:24]}-{seq}"

    @staticmethod
    def runs_pattern(prefix: str) -> str:
        return f"{prefix}:*:meta"
