"""Every Redis key and queue name tokencap uses, in one place.

Per-category keys carry a hash tag `{run:category}` so that a Redis Cluster keeps a
category on one slot (each Lua script touches one category only). Every script of a
category gets all of them as KEYS, in `CategoryKeys` order (`lua/_lib.lua` names them).

| key (P = prefix:run) | type   | written by (Budget method)      | read by            | lifetime  |
|----------------------|--------|---------------------------------|--------------------|-----------|
| `P:meta`             | hash   | init_run                        | all                | run       |
| `P:{cat}:state`      | hash   | every category script           | status, producer   | run       |
| `P:{cat}:pending`    | hash   | feed; requeue, release update   | admit, reaper      | to final  |
| `P:{cat}:leases`     | zset   | feed, admit, heartbeat, release,| reaper             | to final  |
|                      |        | requeue, unpark, keep_lease     |                    |           |
| `P:{cat}:parked`     | zset   | admit ("wait", or held: closed);| unpark, cut        | to unpark |
|                      |        | unpark takes                    |                    |           |
| `P:{cat}:reserved`   | hash   | admit, unpark, heartbeat        | status, admit      | in flight |
| `P:{cat}:worst`      | hash   | admit, unpark (hard guard)      | admit              | in flight |
| `P:{cat}:var`        | hash   | admit, unpark, heartbeat        | admit (margin)     | in flight |
| `P:{cat}:extra`      | hash   | admit when it parks (sample ->  | unpark             | to unpark |
|                      |        | its prompt tokens counted under |                    |           |
|                      |        | count = "total")                |                    |           |
| `P:{cat}:seq`        | hash   | requeue, unpark (times enqueued | admit, reaper      | to final  |
|                      |        | again)                          |                    |           |
| `P:{cat}:final`      | hash   | commit, fail, feed and          | all                | run       |
|                      |        | feed_follow (rejects), reconcile|                    |           |
| `P:{cat}:hist`       | hash   | commit, reconcile               | workers, producer  | run       |
| `P:{cat}:results`    | stream | commit; acknowledge deletes     | writer (group)     | to write  |
| `P:{cat}:dead`       | stream | fail, feed, feed_follow, cut;   | writer (group)     | to write  |
|                      |        | acknowledge deletes             |                    |           |
| `P:{cat}:prompts`    | hash   | feed (prompt digest -> sample)  | feed               | run       |
| `P:{cat}:reasons`    | hash   | fail, feed, reconcile (counts)  | status             | run       |
| `P:{cat}:written`    | hash   | acknowledge, mark_written       | the writer         | run       |
|                      |        | (sample -> counted tokens, or d)|                    |           |
| `P:{cat}:follow`     | zset   | acknowledge (a turn written),   | producer           | to fed    |
|                      |        | restore, retry (a               |                    |           |
|                      |        | dead sample, score -1);         |                    |           |
|                      |        | feed_follow takes (next turn id |                    |           |
|                      |        | -> ordinal)                     |                    |           |
| `P:{cat}:history`    | hash   | acknowledge, restore            | producer           | to conv.  |
|                      |        | (turn id -> its output ids)     |                    | end       |
| `P:{cat}:cut`        | hash   | cut (turns reported held back)  | cut                | run       |
| `P:{cat}:events`     | stream | set_cap (cap changes, the       | status --events,   | last 1000 |
|                      |        | last 1,000)                     | producer's log     |           |
| `P:{cat}:retried`    | set    | retry (dead samples sent again: | reconcile (their   | run       |
|                      |        | their dead letter on disk is    | dead letter is not |           |
|                      |        | history, not their end)         | final)             |           |
| `P:{cat}:engine_of`  | hash   | acknowledge, restore (next turn | producer (the next | to final  |
|                      |        | id -> the engine that served the| turn prefers it)   |           |
|                      |        | turn before); final samples drop|                    |           |
|                      |        | it                              |                    |           |
| `P:{cat}:cache`      | hash   | commit (per engine: samples,    | status, `/metrics` | run       |
|                      |        | prompt, cached, reusable tokens;|                    |           |
|                      |        | field `<engine URL> <counter>`) |                    |           |
| `P:{cat}:modes`      | hash   | commit, reconcile (per decode   | status, `/metrics`,| run       |
|                      |        | mode: rows, counted tokens;     | the live page, the |           |
|                      |        | field `<mode> rows` / `<mode>   | report             |           |
|                      |        | tokens`)                        |                    |           |
| `P:{cat}:near`       | string | feed (each fed prompt's near-   | the producer at    | run       |
|                      |        | duplicate record, 132 bytes:    | start (rebuilds its|           |
|                      |        | record position, MinHash;       | index: producer/   |           |
|                      |        | APPEND)                         | near_dups.py)      |           |
| `P:producer`         | string | the producer's lease (lease.py) | producer           | lease TTL |
| `P:writer`           | string | the writer's lease (`lease.py`) | status, `up`       | lease TTL |
| `P:writer:state`     | hash   | set_writer_error (error, at)    | status, `/metrics` | run       |
| `P:engines`          | hash   | add_engine_counts               | `/metrics`         | run       |
| `P:engines:info`     | hash   | record_engines (preflight:      | status, workers'   | run       |
|                      |        | url -> what it serves)          | preflight          |           |
| `P:engines:trouble`  | hash   | record_engine_trouble (the      | status, `/metrics`,| while it  |
|                      |        | producer's engine watch: url -> | the live page,     | lasts     |
|                      |        | why it does not answer, since)  | `up`'s progress    |           |
| `P:states:trouble`   | hash   | record_disk_trouble (a hidden-  | status, the live   | while it  |
|                      |        | state stage's workers: states   | page, `up`'s and   | lasts     |
|                      |        | folder -> why they pause, since)| the stage's lines  |           |
| `P:series`           | stream | record_point (the budget        | `/series`, the web | last 8640 |
|                      |        | service, every few seconds)     | page, the report   |           |
| `prefix:refused`     | stream | refuse                          | operators          | capped    |

A script that ends a sample (commit, fail, a skip, reconcile) also drops what the ledger kept
for it while open: its pending, leases, parked, reserved, worst, var and seq entries
(`forget` in `lua/_lib.lua`).

State hash fields: cap (tokens, or "none"), used, reserved, worst (the most in-flight samples
can still add), var (the variance of what they will add, tokens^2), samples, failed, rejected,
waste, closed (0/1), exhausted (0/1), rate (EWMA of per-request decode tok/s), dup_prompts,
oov (committed samples with output ids past the tokenizer's vocabulary), prompt, cached and
reusable (the committed samples' prompt tokens, those the engine served from its prefix
cache, and those shared with the turn before: what a cache could have served),
cursor (the producer's position in the shuffled order; moved only by feed, compare-and-set,
and back to 0 by source_size), records (the number of source records that order is of:
source_size, when the producer opens the source; another number, a grown source, sends the
cursor back to 0 and opens an exhausted category again).
`final` values: `c:<counted>`, `r:<reason>`, `d:<kind>` (a sample held back by a closed
category is not final: it waits parked, a conversation's next turn in `follow`).
RQ queue names: `P.<category>` (so `rq info` shows one queue per category, under the prefix).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from foundation.config import DEFAULT_KEY_PREFIX

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
    seq: str
    written: str
    follow: str
    history: str
    cut: str
    events: str
    retried: str
    cache: str
    engine_of: str
    extra: str
    modes: str
    near: str


class Keys:
    """Key names for one run under one prefix."""

    def __init__(self, prefix: str, run: str) -> None:
        self.prefix = prefix
        self.run = run
        self.base = f"{prefix}:{run}"

    @property
    def meta(self) -> str:
        return f"{self.base}:meta"

    @property
    def producer_lock(self) -> str:
        return f"{self.base}:producer"

    @property
    def writer_lock(self) -> str:
        return f"{self.base}:writer"

    @property
    def writer_state(self) -> str:
        return f"{self.base}:writer:state"

    @property
    def engines(self) -> str:
        return f"{self.base}:engines"

    @property
    def series(self) -> str:
        return f"{self.base}:series"

    @property
    def engine_info(self) -> str:
        return f"{self.base}:engines:info"

    @property
    def engine_trouble(self) -> str:
        return f"{self.base}:engines:trouble"

    @property
    def disk_trouble(self) -> str:
        return f"{self.base}:states:trouble"

    @property
    def refused(self) -> str:
        return f"{self.prefix}:refused"

    def cat(self, category: str) -> CategoryKeys:
        tag = f"{self.base}:{{{self.run}:{category}}}"
        return CategoryKeys(*(f"{tag}:{name}" for name in CategoryKeys._fields))

    def queue_name(self, category: str) -> str:
        return f"{self.base}.{category}"

    def job_id(self, category: str, sample_id: str, seq: int) -> str:
        """Deterministic RQ job id from (run, category, sample, feed sequence number).

        RQ allows only letters, digits, `_` and `-` in ids, so the triple is hashed."""
        digest = hashlib.sha1(f"{self.run}\0{category}\0{sample_id}".encode()).hexdigest()
        return f"tc-{digest[:24]}-{seq}"

    @staticmethod
    def runs_pattern(prefix: str = DEFAULT_KEY_PREFIX) -> str:
        return f"{prefix}:*:meta"

    @staticmethod
    def run_of_meta(prefix: str, meta_key: str) -> str:
        """The run name in a key matched by `runs_pattern(prefix)`."""
        return meta_key.removeprefix(prefix + ":").removesuffix(":meta")
