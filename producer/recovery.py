"""What the producer does about what was lost: a Redis that restarted (empty, or from an AOF
without its last second: `ensure_run`), samples whose lease ran out because a worker died with
them (`reap`), and what RQ's registries still hold of killed workers at the end (`finalize`).
Feeds Redis lost are found by the cursor's compare-and-set; the feeder, the cursor's owner,
feeds again from Redis's (`Producer.resync`).

Every repair is one `Budget` call (one Lua script) made before the RQ job that carries it is
enqueued, as in the feeder: a producer killed between the two leaves the sample pending
with a lease, found again by the next reap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import msgspec
from redis import Redis
from rq import Queue

from budget_service import jobs
from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.ledger import now_ms
from foundation.config import RunConfig
from foundation.wire import DeadLetter, ErrorKind, Outcome
from producer.reconcile import reconcile

log = logging.getLogger(__name__)

REAP_BATCH = 256
# Leases are checked for expiry at most this often (and at least 4 times per lease), not
# every tick: a tick is 20 per second when idle, and each check is a round trip per category.
REAP_EVERY_S = 0.5
RUN_ID_CHECK_S = 1.0
# (category, [(sample id, seq, prompt tokens)]): how a repaired sample is enqueued again
Enqueue = Callable[[str, list[tuple[str, int, int]]], None]


class Recovery:
    """The producer's repairs of one run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, redis: Redis, budget: Budget,
                 queues: Mapping[str, Queue], enqueue: Enqueue) -> None:
        self.cfg = cfg
        self.redis = redis
        self.budget = budget
        self.keys: Keys = budget.keys
        self.queues = queues
        self.enqueue = enqueue
        self.lease_ms = cfg.lease_ms
        self.reap_every_s = min(REAP_EVERY_S, cfg.lease_s / 4)
        self.reaped_at = float("-inf")
        self._run_id: str | None = None
        self._run_id_at = 0.0

    def redis_was_down(self) -> None:
        """Redis could not be reached: look for a restart as soon as it answers."""
        self._run_id_at = float("-inf")

    def ensure_run(self, feeds: Sequence[str]) -> bool:
        """Rebuild from the output files what a Redis restart lost; True when the run was
        created again.

        Restarted empty: the run is created again, counters and done-marks come back from
        the files, and feeding restarts from the top of the order (the cursors are 0 again;
        final samples are skipped). Restarted from AOF (`appendfsync everysec` may lose the
        last second), or a replica promoted: samples on disk but not final in Redis are
        marked final so they are not redone. Feeds Redis lost are found by the cursor's
        compare-and-set (`Producer.resync`).
        """
        if not self.budget.has_run():
            log.error("run %s is gone from Redis (restarted without its data?); rebuilding "
                      "counters from %s before feeding again", self.cfg.run,
                      self.cfg.output_dir)
            self.budget.feeding.init_run(self.cfg)
            added = reconcile(self.budget, Path(self.cfg.output_dir), list(feeds))
            log.warning("rebuilt from output files: %s", added)
            self._run_id = None
            rebuilt = True
        else:
            rebuilt = False
        now = time.monotonic()
        if self._run_id is None or now - self._run_id_at >= RUN_ID_CHECK_S:
            self._run_id_at = now
            run_id = self.redis.info("server").get("run_id")
            if self._run_id is not None and run_id != self._run_id:
                log.warning("Redis restarted (run_id changed); reconciling with output files")
                added = reconcile(self.budget, Path(self.cfg.output_dir), list(feeds))
                log.warning("after the restart, from output files: %s", added)
            self._run_id = run_id
        return rebuilt

    def reap_due(self) -> bool:
        """Whether this tick looks for expired leases (every `reap_every_s`)."""
        now = time.monotonic()
        if now - self.reaped_at < self.reap_every_s:
            return False
        self.reaped_at = now
        return True

    def reap(self, name: str) -> int:
        """Re-enqueue samples whose lease expired and whose job is not waiting in the queue
        (a worker died with it, or its retry is due); dead-letter one lost too often. When
        some were, the next tick looks again (more may have expired) whatever the interval."""
        again = self._requeue_expired(name)
        if again:
            self.reaped_at = float("-inf")
        return again

    def _requeue_expired(self, name: str) -> int:
        expired = self.budget.feeding.expired(name, now_ms(), REAP_BATCH)
        if not expired:
            return 0
        entries = self.budget.entries(name, expired)
        waiting = jobs.waiting(self.redis, self.queues[name], self.keys, name,
                               [(sid, entry.seq) for sid, entry in zip(expired, entries,
                                                                       strict=True)])
        again: list[tuple[str, int, int]] = []
        for sid, entry, in_queue in zip(expired, entries, waiting, strict=True):
            deadline = now_ms() + self.lease_ms
            p = entry.pending
            if p is None or in_queue:
                # still waiting in its queue: keep the lease (a stray entry is dropped)
                self.budget.feeding.keep_lease(name, sid, deadline)
                continue
            failures = p.failures + (1 if entry.in_flight else 0)
            if failures >= self.cfg.max_attempts:
                self.budget.samples.fail(DeadLetter.of(
                    p, name, Outcome.DEAD, ErrorKind.LOST.value,
                    "worker lost the sample too often", failures))
                continue
            if entry.in_flight:
                log.warning("%s/%s: lease expired in flight, re-enqueueing", name, sid)
            seq = self.budget.feeding.requeue(name, msgspec.structs.replace(p, failures=failures),
                                      entry.seq, deadline)
            if seq >= 0:  # else it moved meanwhile (a worker extended its lease, or it ended)
                again.append((sid, seq, len(p.prompt_ids)))
        self.enqueue(name, again)
        return len(again)

    def finalize(self) -> None:
        """At the end of a run no job may still be running: drop what RQ's started
        registries and intermediate lists still hold from killed workers."""
        for name, queue in self.queues.items():
            stale = jobs.clear_started(self.redis, queue)
            if stale:
                log.info("%s: cleared %d stale entries of killed workers", name, stale)
