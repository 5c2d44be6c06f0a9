"""Producer start-up: lock the run, create or check it, reconcile, index sources, feed."""

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

from budget_service.budget import Budget
from budget_service.keys import Keys
from producer.feeder import CategoryFeed, Producer
from producer.readers import SourceIndex
from producer.reconcile import reconcile
from tokencap.config import RunConfig
from tokencap.errors import ConfigError, TokencapError

log = logging.getLogger(__name__)

LOCK_POLL_S = 0.2


class ProducerBusy(TokencapError):
    exit_code = 6


class RunLock:
    """One producer per run: a Redis key with a TTL, renewed while the producer lives."""

    def __init__(self, redis: Redis, keys: Keys, ttl_s: float = 15.0) -> None:
        self.redis = redis
        self.key = f"{keys.base}:producer"
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.ttl_ms = int(ttl_s * 1000)

    def acquire(self, wait_s: float | None = None) -> None:
        """Take the lock, waiting up to `wait_s` (default: a little over its TTL, so a
        killed producer's lock has expired)."""
        wait_s = self.ttl_ms / 1000 * 1.5 if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        while not self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms):
            holder = self.redis.get(self.key)
            if time.monotonic() > deadline:
                raise ProducerBusy(
                    f"another producer holds run lock {self.key} ({holder!r}); "
                    "stop it first, or wait for its lock to expire"
                )
            time.sleep(LOCK_POLL_S)

    def renew(self) -> None:
        """Extend the lock; take it again if Redis lost it; fail if someone else holds it."""
        if self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms):
            log.warning("run lock %s was gone (Redis restarted?); took it again", self.key)
            return
        if self.redis.get(self.key) != self.token.encode():
            raise ProducerBusy("lost the run lock to another producer")
        self.redis.pexpire(self.key, self.ttl_ms)

    def release(self) -> None:
        if self.redis.get(self.key) == self.token.encode():
            self.redis.delete(self.key)


def build_producer(
    cfg: RunConfig,
    redis: Redis,
    context_length: int | None,
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
    for cat in cfg.category:
        t0 = time.monotonic()
        try:
            indexes[cat.name] = SourceIndex.build([Path(p) for p in cat.paths])
        except (OSError, ValueError) as exc:
            raise ConfigError(f"$.category[{cat.name}].source", str(exc)) from None
        log.info("%s: indexed %d records in %.1f s", cat.name, len(indexes[cat.name]),
                 time.monotonic() - t0)
    keys = Keys(cfg.key_prefix, cfg.run)
    budget = Budget(redis, keys)
    created = budget.init_run(cfg)
    out = Path(cfg.output_dir)
    added = reconcile(budget, out, [c.name for c in cfg.category])
    if created and any(added.values()):
        log.warning("run %s was not in Redis; rebuilt from %s: %s", cfg.run, out, added)
    producer = Producer(cfg, redis, renderer, context_length, on_progress)
    for cat in cfg.category:
        producer.add_feed(CategoryFeed(cfg, cat, indexes[cat.name]))
    return producer
