"""Producer start-up and the one "run to the end": take the run's producer lease, create or
check the run in Redis, reconcile with the output files, index the sources, feed until every
category is done (`producer.loop`). `tokencap run` and `tokencap up` both call `run_to_end`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.lease import producer_lease
from budget_service.telemetry import RunStatus
from foundation.config import RunConfig, with_stop_ids
from foundation.engine.api import engine_specs
from foundation.engine.info import EngineInfo
from foundation.errors import ConfigError
from producer.engine_watch import EngineWatch
from producer.feeder import Arriving, Producer, index_source
from producer.loop import PROGRESS_S, FeedLoop
from producer.manifest import write_manifest
from producer.preflight import preflight
from producer.reconcile import reconcile
from producer.reply_parser import reply_parser

if TYPE_CHECKING:
    from producer.render import Renderer

log = logging.getLogger(__name__)

def build_producer(
    cfg: RunConfig,
    redis: Redis,
    context_len: int | None,
    renderer: Renderer | None = None,
    engines: Sequence[EngineInfo] = (),
    arriving: Arriving | None = None,
) -> Producer:
    """Create/check the run in Redis, reconcile with the output files, index every source
    (with `arriving`, none: they are opened as they arrive, `producer.feeder`); write the
    run's manifest (`producer.manifest`: what made its rows) beside them."""
    # everything that can be wrong with the config is checked before Redis is touched
    if renderer is None:
        renderer = load_renderer(cfg)
    if renderer is not None:  # the model's end-of-turn ids are sent as its stop ids
        replies = reply_parser(cfg, renderer)
        if any(c.turns == "all" for c in cfg.category):
            log.info("generated turns enter the next prompt with the %s", replies.describe())
        cfg = with_stop_ids(cfg, set(replies.end_of_turn_ids))
        if cfg.reply_gate:  # the workers' reply gate reads the family's markers as ids
            cfg = msgspec.structs.replace(cfg, reply_markers=replies.markers())
        if cfg.vocab_size is None:  # workers flag output ids past it
            cfg = msgspec.structs.replace(cfg, vocab_size=int(renderer.vocab_size))
    indexes = {} if arriving is not None else {
        cat.name: index_source(cfg, cat) for cat in cfg.category}
    made_by, path = write_manifest(cfg, renderer, engines)
    cfg = msgspec.structs.replace(cfg, made_by=made_by)
    log.info("rows name %s (%s)", made_by, path)
    keys = Keys(cfg.key_prefix, cfg.run)
    budget = Budget(redis, keys)
    created = budget.feeding.init_run(cfg)
    out = Path(cfg.output_dir)
    added = reconcile(budget, out, [c.name for c in cfg.category])
    if created and any(added.values()):
        log.warning("run %s was not in Redis; rebuilt from %s: %s", cfg.run, out, added)
    producer = Producer(cfg, redis, renderer, context_len, arriving)
    for name, index in indexes.items():
        producer.open_category(name, index)
    return producer


def load_renderer(cfg: RunConfig) -> Renderer | None:
    """The run's tokenizer (None when every category is pre-tokenized and none is named),
    its template checked against the config: every chat-template kwarg must be one the
    template reads (Kimi's thinking switch is `thinking`, Qwen's and GLM's
    `enable_thinking`), and "auto" parsers must resolve."""
    if cfg.tokenizer is None and all(c.format == "input_ids" for c in cfg.category):
        return None
    from producer.render import Renderer, TokenizerError

    try:
        renderer = Renderer(cfg.tokenizer or "", cfg.chat_template_kwargs,
                            trust_remote_code=cfg.trust_remote_code)
    except TokenizerError as exc:
        raise ConfigError("$.tokenizer", str(exc)) from None
    places = [("$.chat_template_kwargs", cfg.chat_template_kwargs)]
    for c in cfg.category:
        if c.only_mode is not None and c.only_mode != c.modes[0].name:
            continue  # a `share = "tokens"` category's budgets are one table: once
        i = cfg.table_index(c)
        places.append((f"$.category[{i}].chat_template_kwargs", c.chat_template_kwargs))
        places += [(f"$.category[{i}].modes[{j}].chat_template_kwargs", m.chat_template_kwargs)
                   for j, m in enumerate(c.modes)]
    for where, kwargs in places:
        unread = renderer.unread_kwargs(kwargs)
        if unread:
            reads = ", ".join(sorted(renderer.template_variables)) or "none"
            raise ConfigError(f"{where}.{unread[0]}", f"the chat template of {cfg.tokenizer} "
                              f"never reads `{unread[0]}`; the names it reads besides the "
                              f"messages and tools: {reads}")
    return renderer


def run_to_end(
    cfg: RunConfig,
    redis: Redis,
    engine_urls: list[str],
    *,
    on_progress: Callable[[RunStatus], None] | None = None,
    before_feed: Callable[[Producer], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    progress_s: float = PROGRESS_S,
    arriving: Arriving | None = None,
) -> RunStatus:
    """Check the engines (`producer.preflight`: nothing is fed to an engine that is
    unreachable, too old or serves another model than the tokenizer's), take the run's lock,
    build the producer (config, tokenizer and sources checked, run created or resumed,
    counters rebuilt from the files), call `before_feed` (the launcher starts its processes
    there), then feed until every category is closed or exhausted and every result is
    written, or until `should_stop()`. With `arriving`, the sources are opened as they
    arrive (`producer.feeder.Arriving`: a hidden-state stage beside generation), and the
    run ends only once they all have. Returns the final status."""
    renderer = load_renderer(cfg)
    infos = preflight(cfg, engine_urls, renderer)
    lock = producer_lease(redis, Keys(cfg.key_prefix, cfg.run), cfg.lock_ttl_s)
    lock.acquire()
    try:
        known = [i.context_length for i in infos if i.context_length]
        ctx = cfg.context_length or (min(known) if known else None)
        producer = build_producer(cfg, redis, ctx, renderer, infos, arriving)
        producer.budget.telemetry.record_engines(infos)
        watch = EngineWatch(producer.budget.telemetry, engine_specs(engine_urls))
        if before_feed is not None:
            before_feed(producer)
        producer.intake.load(producer.budget, lock.renew)  # before the first feed

        def stop() -> bool:
            lock.renew()
            return should_stop()

        loop = FeedLoop(producer, on_progress, watch)
        return loop.run(progress_s=progress_s, should_stop=stop)
    finally:
        lock.release()
