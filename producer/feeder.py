"""The producer's tick: feed each open category, reap lost jobs, unpark, mark the used up.

Per tick and category:
1. reap: ledger entries whose lease expired and whose job is not in the queue are
   re-enqueued (a worker died, or a retry is due); a sample lost `max_attempts` times is
   dead-lettered;
2. unpark samples that admission deferred, once they fit (a closed category holds them);
3. feed, while the category is open, `used + reserved < cap` and fewer than `high_water`
   samples wait: first the next turns of conversations whose last turn was written
   (`turns = "all"`), then new samples from the seeded shuffled order;
4. mark the category exhausted when its source is used up, nothing is pending, no
   conversation waits for a turn and everything is written; a closed category reports the
   conversations it holds back (cut records).
The run ends when every category is closed (holding back only what a raised cap would send)
or exhausted, and the writer has written every result (`Producer.finished`, on the rule of
`budget_service.ledger.run_ended`); `producer.loop` ticks until then.

A run's sources are opened when it starts, or, for a run given `arriving` (a hidden-state
stage beside generation), as they arrive: each tick first opens the categories whose source
arrived or grew since the last (`Arriving.arrived`), and the run cannot end before no source
will arrive or grow any more (`Arriving.settled`). Opening a source tells the ledger its
number of records (`FeedingLedger.source_size`): a grown source is walked again from the
top of its new order, the feed skipping what is final or pending.

The repairs (reap, a Redis restart, the end's registry cleanup) are `producer.recovery`; a
feed Redis lost is fed again from Redis's cursor (`Producer.resync`). The category states it
steers on are `Ledger.states` (typed, the same fields `tokencap status --json` shows).

Every change to the ledger is one `Budget` call (one Lua script) made before the RQ job that
carries it is enqueued: a producer killed between the two leaves a sample pending with a
lease, which the reaper enqueues again once the lease has passed.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec
from redis import Redis

from budget_service import jobs
from budget_service.budget import Budget
from budget_service.estimator import LengthModel, admission
from budget_service.keys import Keys
from budget_service.ledger import CategoryState, now_ms, run_ended
from foundation.config import Category, RunConfig
from foundation.errors import ConfigError, SourceError
from foundation.modes import most_new_tokens
from foundation.wire import Pending
from producer.affinity import SharedKeys
from producer.followups import FollowUps
from producer.intake import Intake, Screened
from producer.readers.index import Sample, SourceIndex
from producer.recovery import Recovery
from producer.source import CategorySource

if TYPE_CHECKING:
    from producer.render import Renderer

log = logging.getLogger(__name__)

FEED_CHUNK = 64  # new samples read and rendered per category per tick, at most
UNPARK_BATCH = 1024
WORKER_COUNT_REFRESH_S = 2.0
IDLE_TICK_S = 0.05


class CategoryFeed:
    """Feeding state of one category: its source and the cursor into its shuffled order,
    the producer's copy of Redis's (the feed script's compare-and-set keeps the two equal).
    Only its own methods move the cursor, and only the `Producer` calls them."""

    def __init__(self, source: CategorySource) -> None:
        self.source = source
        self._cursor = 0

    @property
    def cursor(self) -> int:
        return self._cursor

    def advance(self, to: int) -> None:
        """The records up to `to` of the order are fed."""
        self._cursor = to

    def resync(self, redis_cursor: int) -> int:
        """Take Redis's cursor as the truth (at start, and after Redis lost feeds or the
        run); returns the cursor held before."""
        ours, self._cursor = self._cursor, redis_cursor
        return ours

    @property
    def cat(self) -> Category:
        return self.source.cat

    @property
    def exhausted(self) -> bool:
        return self.cursor >= len(self.source.order)


def index_source(cfg: RunConfig, cat: Category) -> SourceIndex:
    """The category's source indexed (`ConfigError` naming its field when it cannot be)."""
    t0 = time.monotonic()
    try:
        index = SourceIndex.build([Path(p) for p in cat.paths])
    except SourceError as exc:
        raise ConfigError(f"$.category[{cfg.table_index(cat)}].source", str(exc)) from None
    log.info("%s: indexed %d records in %.1f s", cat.name, len(index), time.monotonic() - t0)
    return index


class Arriving(Protocol):
    """Sources that arrive while the run goes on (a hidden-state stage beside generation:
    a category's rows file once its generation ended, grown when it ends again after a
    raised cap)."""

    def arrived(self) -> list[str]:
        """The categories whose source arrived or grew since the last call (cheap when
        nothing did: the producer asks at every tick)."""
        ...

    def settled(self) -> bool:
        """Every category's source arrived, and none will arrive or grow any more."""
        ...


class Producer:
    """Feeds one run, a tick at a time (`producer.loop.FeedLoop` ticks it to the run's end).
    `renderer` is None when every category is pre-tokenized; `context_len` the engines'
    context (None: unknown); `arriving`: the run's sources arrive while it goes on (module
    docstring), else they are opened before it starts (`open_category`)."""

    def __init__(self, cfg: RunConfig, redis: Redis, renderer: Renderer | None,
                 context_len: int | None = None, arriving: Arriving | None = None) -> None:
        self.cfg = cfg
        self.redis = redis
        self.renderer = renderer
        self.context_len = context_len
        self.arriving = arriving
        self._to_open: dict[str, None] = {}  # arrived, not opened yet (in arrival order)
        self.keys = Keys(cfg.key_prefix, cfg.run)
        self.budget = Budget(redis, self.keys)
        self.feeds: dict[str, CategoryFeed] = {}
        self.queues = {c.name: jobs.queue(redis, self.keys, c.name) for c in cfg.category}
        self.recovery = Recovery(cfg, redis, self.budget, self.queues, self._enqueue)
        self.lease_ms = cfg.lease_ms
        self._workers = 0
        self._workers_at = 0.0
        # the category states the last tick steered on
        self.last_states: dict[str, CategoryState] | None = None
        self._unpark_mark: dict[str, tuple[int | None, ...]] = {}
        self._feedable = len(cfg.category)  # categories that can be fed, as of the last tick
        self._affinity = SharedKeys() if cfg.affinity else None  # `producer.affinity`
        self.followups = FollowUps(cfg, self.budget, renderer, self._enqueue,
                                           self._affinity)
        # near-duplicates and benchmark contamination, refused at intake (its index rebuilt
        # from the ledger before the first feed: `producer.run` does, else the first screen)
        self.intake = Intake(cfg, self._source_of)

    def _source_of(self, name: str) -> CategorySource | None:
        feed = self.feeds.get(name)
        return feed.source if feed else None

    # -- setup -------------------------------------------------------------------------
    def open_category(self, name: str, index: SourceIndex | None = None) -> None:
        """Open the category's source (indexed here unless `index` is given) and feed it
        from where the ledger's cursor is; one opened again (it grew) replaces the old."""
        cat = next(c for c in self.cfg.category if c.name == name)
        source = CategorySource(self.cfg, cat, index or index_source(self.cfg, cat),
                                self.renderer, self.context_len)
        old = self.feeds.get(name)
        self.add_feed(CategoryFeed(source))
        if old is not None:
            old.source.close()

    def add_feed(self, feed: CategoryFeed) -> None:
        """Feed `feed` from the ledger's cursor, once the ledger knows its source's size (a
        grown source is walked again from the top: `FeedingLedger.source_size`)."""
        name = feed.cat.name
        if self.budget.feeding.source_size(name, len(feed.source)):
            log.info("%s: its source holds %d records, not the number its cursor walked: fed "
                     "again from the top of its order, what is done skipped", name,
                     len(feed.source))
        self.feeds[name] = feed
        feed.resync(self.budget.feeding.cursor(name))

    def arrive(self) -> int:
        """Open the sources that arrived or grew since the last look (`arriving`); returns
        how many. One not opened (Redis went away meanwhile) is opened at the next tick."""
        if self.arriving is None:
            return 0
        self._to_open.update(dict.fromkeys(self.arriving.arrived()))
        opened = 0
        for name in list(self._to_open):
            self.open_category(name)
            del self._to_open[name]
            opened += 1
        return opened

    def resync(self, feed: CategoryFeed) -> None:
        """Redis's cursor is not ours: it lost our last feeds (a restart from an AOF without
        its last second). Feed again from where Redis is."""
        name = feed.cat.name
        ours = feed.resync(self.budget.feeding.cursor(name))
        log.warning("%s: Redis's cursor is %d, not %d (Redis lost the last feeds?); feeding "
                    "again from there", name, feed.cursor, ours)

    def resync_all(self) -> None:
        """Take Redis's cursor of every category (the run was created again: from 0)."""
        for feed in self.feeds.values():
            feed.resync(self.budget.feeding.cursor(feed.cat.name))
        self.intake = Intake(self.cfg, self._source_of)

    # -- the tick ----------------------------------------------------------------------
    def tick(self) -> int:
        """One pass over every category. Returns how much work was done (0 = idle)."""
        work = self.arrive()
        status = self.budget.states(list(self.feeds))
        self.last_states = status
        self._feedable = sum(1 for name, st in status.items() if self._can_feed(name, st))
        reap = self.recovery.reap_due()
        for name, feed in self.feeds.items():
            st = status[name]
            reaped = self.recovery.reap(name) if reap else 0
            done = reaped + self.unpark(feed, st)
            if st.state == "open":
                # next turns of conversations; in other categories, samples sent again
                followed = self.followups.follow(feed.source, st,
                                                     self._room(st, follow=True))
                st = msgspec.structs.replace(st, pending=st.pending + followed)
                done += followed
                done += self.feed(feed, st)
                if (feed.exhausted and st.pending == 0 and st.followups == 0
                        and st.unwritten == 0 and done == 0):
                    if self.budget.feeding.mark_exhausted(name, feed.cursor):
                        log.info("%s: source exhausted (%d samples committed)", name,
                                 st.samples)
                    elif self.budget.feeding.cursor(name) != feed.cursor:
                        self.resync(feed)
            elif st.state == "closed" and feed.source.turns:
                self.followups.report_cut(feed.source, st)
            work += done
        return work

    def finished(self) -> bool:
        """The run's end (`run_ended`) as of the last tick: every category closed (what it
        still holds is held back by its cap) or exhausted with nothing pending; and every
        result written by the writer, as of now. A run whose sources arrive has not ended
        before they all did and none will grow (`Arriving.settled`)."""
        if self.arriving is not None and (self._to_open or not self.arriving.settled()):
            return False
        states = self.last_states or self.budget.states(list(self.feeds))
        return run_ended(states, self.writer_lag())

    def writer_lag(self) -> int:
        return self.budget.feeding.unwritten(self.feeds)

    # -- pieces ------------------------------------------------------------------------
    def _can_feed(self, name: str, st: CategoryState) -> bool:
        """Whether the category may still be fed: open, with samples left to read or turns
        to follow, and room under its cap."""
        if st.state != "open" or (self.feeds[name].exhausted and not st.followups):
            return False
        return st.cap is None or st.used + st.reserved < st.cap

    def high_water(self) -> int:
        """How many samples each category keeps waiting: the config's `high_water`, raised
        to 2 x workers shared by the categories that can still be fed (closed, capped-out
        and used-up ones need no share: their workers serve the others)."""
        now = time.monotonic()
        if now - self._workers_at > WORKER_COUNT_REFRESH_S:
            self._workers = jobs.worker_count(self.redis, self.keys, next(iter(self.queues)))
            self._workers_at = now
        return max(self.cfg.high_water, math.ceil(2 * self._workers / max(1, self._feedable)))

    def _room(self, st: CategoryState, follow: bool = False) -> int:
        """How many samples may be fed now: none while the cap's worth is used or reserved,
        or while more than half the high-water mark waits (feed in batches, not one job per
        tick), at most FEED_CHUNK (a tick that renders long prompts must not hold up the
        next turns). Next turns (`follow`) are not held back by what waits: they go to the
        queue's front, while their engine's prefix cache holds the turn before; their number
        is bounded by the conversations in flight."""
        cap = st.cap
        if cap is not None and st.used + st.reserved >= cap:
            return 0
        high = self.high_water()
        if follow:
            return max(high, st.followups)
        waiting = st.pending - st.in_flight
        return 0 if waiting > high // 2 else min(FEED_CHUNK, high - waiting)

    def feed(self, feed: CategoryFeed, st: CategoryState) -> int:
        room = self._room(st)
        if room <= 0 or feed.exhausted:
            return 0
        name = feed.cat.name
        fed = 0
        while room > 0 and not feed.exhausted:
            start = feed.cursor
            positions = list(feed.source.order[start : start + room])
            # one mode's budget of a `share = "tokens"` category: the records drawn to it
            mine = [p for p in positions if feed.source.feeds(p)]
            samples, rejected = feed.source.read_many(mine)
            known = self.budget.feeding.known(name, [feed.source.first_id(s) for s in samples])
            samples = [s for s, k in zip(samples, known, strict=True) if not k]  # resume
            prepared, too_long = feed.source.prepare(samples, None, self._affinity)
            # a prompt another category fed already is not generated twice
            others = [c for c in self.feeds if c != name]
            screened = self._screen(name, samples, prepared, others)
            prepared = screened.samples
            ids = self.budget.feeding.feed(name, start, start + len(positions),
                                           now_ms() + self.lease_ms, prepared,
                                           rejected + too_long + screened.refused, others,
                                           screened.near, screened.seen)
            if ids is None:
                self.resync(feed)
                return fed
            feed.advance(start + len(positions))
            recorded = set(ids)
            self._enqueue(name, [(p.sample_id, 0, len(p.prompt_ids)) for p in prepared
                                 if p.sample_id in recorded])
            fed += len(positions)
            room -= max(1, len(ids))
        return fed

    def _screen(self, name: str, samples: list[Sample], prepared: list[Pending],
                others: list[str]) -> Screened:
        """The intake screens on a batch (`producer.intake`); exact copies of a prompt fed
        before are left to the feed script. Each prompt's digest and who fed it first are
        asked once, for the screens and the feed (`Screened.seen`: the other categories
        first, whose copies the feed refuses)."""
        seen = self.budget.feeding.seen([*others, name], prepared)
        if not self.intake.active:
            return Screened(prepared, [], [], seen)
        if not self.intake.loaded:
            self.intake.load(self.budget)
        return self.intake.screen(name, samples, prepared, seen)

    def _enqueue(self, category: str, samples: list[tuple[str, int, int]],
                 at_front: bool = False) -> None:
        """Enqueue one job per (sample id, seq, prompt tokens), in one round trip, at the
        queue's end (or its front). The ledger already holds each sample with a lease: a job
        lost here is enqueued again by the reaper."""
        jobs.enqueue(self.queues[category], self.keys, self.cfg.run, category, samples,
                     self.cfg.job_timeout_s(), at_front)

    def unpark(self, feed: CategoryFeed, st: CategoryState) -> int:
        """Re-enqueue deferred samples that now fit, reserved for as the worker's admit would
        (`estimator.admission`, one call for the whole batch); a closed category holds them
        back (a raised cap reopens it)."""
        if not st.parked or st.state == "closed":
            return 0
        name = feed.cat.name
        # only when something changed since the last try (else admission answers as before:
        # measured 20 RQ jobs per committed sample in a tapering category when every parked
        # sample was tried again each tick)
        behind = 0 < self.cfg.max_unwritten <= st.unwritten
        mark = (st.used, st.reserved, st.worst, st.var, st.in_flight,
                st.cap, st.parked, behind)
        if self._unpark_mark.get(name) == mark:
            return 0
        self._unpark_mark[name] = mark
        model = LengthModel(self.budget.hist(name), self.cfg.expected_for(feed.cat),
                            most_new_tokens(feed.cat))
        ask = admission(self.cfg, feed.cat, model)
        got = self.budget.feeding.unpark(name, ask.estimate, ask.variance, ask.max_add,
                                         ask.sigmas, now_ms() + self.lease_ms, UNPARK_BATCH,
                                         ask.max_unwritten)
        self._enqueue(name, [(sid, seq, n) for (sid, seq), n in zip(got.leased, got.prompts,
                                                                  strict=True)])
        return len(got.leased)

