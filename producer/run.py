"""Producer start-up and the one "run to the end": lock the run, create or check it in
Redis, reconcile with the output files, index the sources, feed until every category is
done. `tokencap run` and `tokencap up` both call `run_to_end`."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis import Redis
from redis.exceptions import LockError

from budget_service.budget import Budget
from budget_service.keys import Keys
from foundation.config import RunConfig
from foundation.errors import ConfigError, ProducerBusy, SourceError
from foundation.sglang import context_length
from producer.feeder import CategoryFeed, Producer
from producer.readers import SourceIndex
from producer.reconcile import reconcile

log = logging.getLogger(__name__)

LOCK_POLL_S = 0.2


class RunLock:
    """One producer per run: redis-py's `Lock` on the run's lock key (SET NX PX takes it;
    extending and releasing are Lua calls that act only while this token holds it)."""

    def __init__(self, redis: Redis, keys: Keys, ttl_s: float = 15.0) -> None:
        self.redis = redis
        self.key = keys.producer_lock
        self.run = keys.run
        self.ttl_s = ttl_s
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lock = redis.lock(self.key, timeout=ttl_s, sleep=LOCK_POLL_S, thread_local=False)
        self._renewed_at = float("-inf")

    def acquire(self, wait_s: float | None = None) -> None:
        """Take the lock, waiting up to `wait_s` (default: a little over its TTL, so that a
        killed producer's lock has expired); raise `ProducerBusy` if another holds it."""
        wait_s = self.ttl_s * 1.5 if wait_s is None else wait_s
        if self.lock.acquire(blocking=True, blocking_timeout=wait_s, token=self.token):
            self._renewed_at = time.monotonic()
        else:
            raw = self.redis.get(self.key)
            holder = raw.decode() if isinstance(raw, bytes) else raw
            raise ProducerBusy(
                f"another producer is running run {self.run!r} (lock {self.key} held by "
                f"{holder or 'someone'}); stop it first, or wait "
                f"{self.ttl_s:g} s for the lock of a killed one to expire"
            )

    def renew(self) -> None:
        """Extend the lock (at most every third of its TTL); take it again if Redis lost it;
        fail if someone else holds it."""
        now = time.monotonic()
        if now - self._renewed_at < self.ttl_s / 3:
            return
        self._renewed_at = now
        try:
            self.lock.reacquire()
        except LockError:
            if self.lock.acquire(blocking=False, token=self.token):
                log.warning("run lock %s was gone (Redis restarted?); took it again", self.key)
                return
            raise ProducerBusy(f"lost the lock of run {self.run!r} to another producer "
                               "(this one stalled longer than lock_ttl_s?)") from None

    def release(self) -> None:
        try:
            self.lock.release()
        except LockError:
            log.warning("run lock %s was no longer ours at the end", self.key)


def build_producer(
    cfg: RunConfig,
    redis: Redis,
    context_len: int | None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    renderer: Any = None,
) -> Producer:
    """Create/check the run in Redis, reconcile with the output files, index every source."""
    # everything that can be wrong with the config is checked before Redis is touched
    if renderer is None and any(c.format != "input_ids" for c in cfg.category):
        from producer.render import Renderer, TokenizerError

        try:
            renderer = Renderer(cfg.tokenizer or "", cfg.chat_template_kwargs)
        except TokenizerError as exc:
            raise ConfigError("$.tokenizer", str(exc)) from None
    indexes = {}
    for i, cat in enumerate(cfg.category):
        t0 = time.monotonic()
        try:
            indexes[cat.name] = SourceIndex.build([Path(p) for p in cat.paths])
        except SourceError as exc:
            raise ConfigError(f"$.category[{i}].source", str(exc)) from None
        log.info("%s: indexed %d records in %.1f s", cat.name, len(indexes[cat.name]),
                 time.monotonic() - t0)
    keys = Keys(cfg.key_prefix, cfg.run)
    budget = Budget(redis, keys)
    created = budget.init_run(cfg)
    out = Path(cfg.output_dir)
    added = reconcile(budget, out, [c.name for c in cfg.category])
    if created and any(added.values()):
        log.warning("run %s was not in Redis; rebuilt from %s: %s", cfg.run, out, added)
    producer = Producer(cfg, redis, renderer, context_len, on_progress)
    for cat in cfg.category:
        producer.add_feed(CategoryFeed(cfg, cat, indexes[cat.name]))
    return producer


def run_to_end(
    cfg: RunConfig,
    redis: Redis,
    engine_urls: list[str],
    *,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    before_feed: Callable[[Producer], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    progress_s: float = 2.0,
) -> dict[str, Any]:
    """Take the run's lock, build the producer (config, tokenizer and sources checked, run
    created or resumed, counters rebuilt from the files), call `before_feed` (the launcher
    starts its processes there), then feed until every category is closed or exhausted and
    every result is written, or until `should_stop()`. Returns the final status."""
    lock = RunLock(redis, Keys(cfg.key_prefix, cfg.run), cfg.lock_ttl_s)
    lock.acquire()
    try:
        ctx = cfg.context_length or context_length(engine_urls)
        producer = build_producer(cfg, redis, ctx, on_progress)
        if before_feed is not None:
            before_feed(producer)

        def stop() -> bool:
            lock.renew()
            return should_stop()

        return producer.run(progress_s=progress_s, should_stop=stop)
    finally:
        lock.release()
