"""Producer start-up and the one "run to the end": take the run's producer lease, create or
check the run in Redis, reconcile with the output files, index the sources, feed until every
category is done. `tokencap run` and `tokencap up` both call `run_to_end`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.lease import producer_lease
from foundation.config import RunConfig
from foundation.errors import ConfigError, SourceError
from producer.feeder import CategoryFeed, Producer
from producer.preflight import preflight
from producer.readers import SourceIndex
from producer.reconcile import reconcile

log = logging.getLogger(__name__)

def build_producer(
    cfg: RunConfig,
    redis: Redis,
    context_len: int | None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    renderer: Any = None,
) -> Producer:
    """Create/check the run in Redis, reconcile with the output files, index every source."""
    # everything that can be wrong with the config is checked before Redis is touched
    if renderer is None:
        renderer = load_renderer(cfg)
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


def load_renderer(cfg: RunConfig) -> Any:
    """The run's tokenizer (None when every category is pre-tokenized and none is named)."""
    if cfg.tokenizer is None and all(c.format == "input_ids" for c in cfg.category):
        return None
    from producer.render import Renderer, TokenizerError

    try:
        return Renderer(cfg.tokenizer or "", cfg.chat_template_kwargs)
    except TokenizerError as exc:
        raise ConfigError("$.tokenizer", str(exc)) from None


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
    """Check the engines (`producer.preflight`: nothing is fed to an engine that is
    unreachable, too old or serves another model than the tokenizer's), take the run's lock,
    build the producer (config, tokenizer and sources checked, run created or resumed,
    counters rebuilt from the files), call `before_feed` (the launcher starts its processes
    there), then feed until every category is closed or exhausted and every result is
    written, or until `should_stop()`. Returns the final status."""
    renderer = load_renderer(cfg)
    infos = preflight(cfg, engine_urls, renderer)
    lock = producer_lease(redis, Keys(cfg.key_prefix, cfg.run), cfg.lock_ttl_s)
    lock.acquire()
    try:
        known = [i.context_length for i in infos if i.context_length]
        ctx = cfg.context_length or (min(known) if known else None)
        producer = build_producer(cfg, redis, ctx, on_progress, renderer)
        producer.budget.record_engines(infos)
        if before_feed is not None:
            before_feed(producer)

        def stop() -> bool:
            lock.renew()
            return should_stop()

        return producer.run(progress_s=progress_s, should_stop=stop)
    finally:
        lock.release()
