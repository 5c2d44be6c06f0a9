"""The producer loop: feed each open category, reap lost jobs, unpark, detect the end.

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
or exhausted, and the writer has written every result.

The repairs (reap, a Redis restart, lost feeds, the end's registry cleanup) are
`producer.recovery`; the category states it steers on are `Budget.states` (typed, the same
fields `tokencap status --json` shows).

Every change to the ledger is one `Budget` call (one Lua script) made before the RQ job that
carries it is enqueued: a producer killed between the two leaves a sample pending with a
lease, which the reaper enqueues again once the lease has passed.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import msgspec
from redis import Redis

from budget_service import jobs
from budget_service.budget import Budget, CategoryState, now_ms
from budget_service.estimator import LengthModel
from budget_service.keys import Keys
from foundation.backoff import REDIS_DOWN, Backoff
from foundation.config import Category, RunConfig
from foundation.wire import (
    DeadLetter,
    Outcome,
    Pending,
    split_turn_id,
    turn_id,
)
from producer.formats import Rejected
from producer.readers import Sample, SourceIndex, read_sample, sample_id, shuffled_order
from producer.recovery import Recovery
from producer.replies import ReplyParser, Unparsed, reply_parser

log = logging.getLogger(__name__)

FEED_CHUNK = 64  # new samples read and rendered per category per tick, at most
UNPARK_BATCH = 1024
WORKER_COUNT_REFRESH_S = 2.0
IDLE_TICK_S = 0.05
# No tokenizer packs more characters than this into one token: longer prompts are rejected
# before tokenizing (a 50 MB line must not stall the producer).
MAX_CHARS_PER_TOKEN = 32
# Prompts whose first AFFINITY_PREFIX_TOKENS ids agree share an affinity key: the engines send
# them to one engine, whose prefix cache then holds that prefix once (a tool schema, a long
# system prompt). A shorter shared prefix is cheap for every engine to hold.
AFFINITY_PREFIX_TOKENS = 256
# A prompt gets its key only once another prompt had it (a unique prompt has nothing to share:
# it goes to the least loaded engine as without affinity); the keys seen, the last ones kept.
AFFINITY_KEYS_KEPT = 1 << 16
CONTEXT_UNKNOWN_TOKENS = 1 << 20


class CategoryFeed:
    """Feeding state of one category: its source index, shuffled order and cursor."""

    def __init__(self, cfg: RunConfig, cat: Category, index: SourceIndex) -> None:
        self.cfg = cfg
        self.cat = cat
        self.index = index
        self.order: array = shuffled_order(len(index), cfg.seed)
        self.cursor = 0
        self.kwargs = {**cfg.chat_template_kwargs, **cat.chat_template_kwargs}
        self.turns = cat.turns == "all"
        self.stop_ids = set(cat.sampling.stop_token_ids or [])
        self._cut_mark: tuple[int, int] | None = None
        self.opened: bool | None = None  # the generation prompt opens a reasoning block

    @property
    def exhausted(self) -> bool:
        return self.cursor >= len(self.order)

    def read(self, pos: int) -> Sample:
        """Record `pos` of the source, normalised (raises `Rejected`)."""
        cat = self.cat
        return read_sample(self.index, pos, cat.format, cat.turns, cat.system_prompt,
                           cat.field_map or None, cat.role_map or None)

    def first_id(self, sample: Sample) -> str:
        """The sample id of what is fed first: the record, or its conversation's turn 1."""
        return turn_id(sample.sample_id, 1) if self.turns else sample.sample_id


class Producer:
    """Feeds one run. `renderer` is None when every category is pre-tokenized."""

    def __init__(
        self,
        cfg: RunConfig,
        redis: Redis,
        renderer: Any,
        context_length: int | None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.redis = redis
        self.keys = Keys(cfg.key_prefix, cfg.run)
        self.budget = Budget(redis, self.keys)
        self.renderer = renderer
        self.context_length = context_length
        self.on_progress = on_progress
        self.feeds: dict[str, CategoryFeed] = {}
        self.queues = {c.name: jobs.queue(redis, self.keys, c.name) for c in cfg.category}
        self.recovery = Recovery(cfg, redis, self.budget, self.queues, self._enqueue)
        self.lease_ms = int(cfg.lease_s * 1000)
        self._workers = 0
        self._workers_at = 0.0
        self._last_status: dict[str, CategoryState] | None = None
        self._unpark_mark: dict[str, tuple[int | None, ...]] = {}
        self._events_after: dict[str, str] | None = None  # the event log read so far
        self._replies: ReplyParser | None = None
        self._feedable = len(cfg.category)  # categories that can be fed, as of the last tick
        self._keys_seen: OrderedDict[str, None] = OrderedDict()  # affinity keys, last first

    @property
    def replies(self) -> ReplyParser:
        """How generated turns enter the next turn's history (`turns = "all"`)."""
        if self._replies is None:
            self._replies = reply_parser(self.cfg, self.renderer)
        return self._replies

    # -- setup -------------------------------------------------------------------------
    def add_feed(self, feed: CategoryFeed) -> None:
        self.feeds[feed.cat.name] = feed
        feed.cursor = self.budget.cursor(feed.cat.name)

    # -- the loop ----------------------------------------------------------------------
    def tick(self) -> int:
        """One pass over every category. Returns how much work was done (0 = idle)."""
        work = 0
        status = self.budget.states(list(self.feeds))
        self._last_status = status
        self._feedable = sum(1 for name, st in status.items() if self._can_feed(name, st))
        reap = self.recovery.reap_due()
        for name, feed in self.feeds.items():
            st = status[name]
            reaped = self.recovery.reap(name) if reap else 0
            done = reaped + self.unpark(feed, st)
            if st.state == "open":
                # next turns of conversations; in other categories, samples sent again
                followed = self.follow(feed, st)
                st = msgspec.structs.replace(st, pending=st.pending + followed)
                done += followed
                done += self.feed(feed, st)
                if (feed.exhausted and st.pending == 0 and st.followups == 0
                        and st.unwritten == 0 and done == 0):
                    if self.budget.mark_exhausted(name, feed.cursor):
                        log.info("%s: source exhausted (%d samples committed)", name,
                                 st.samples)
                    elif self.budget.cursor(name) != feed.cursor:
                        self.recovery.lost_feeds(feed)
            elif st.state == "closed" and feed.turns:
                self.report_cut(feed, st)
            work += done
        return work

    def finished(self) -> bool:
        """Every category closed (what it still holds is held back by its cap: parked, or a
        conversation's next turn) or exhausted with nothing pending, as of the last tick, and
        every result written by the writer."""
        status = self._last_status or self.budget.states(list(self.feeds))
        done = all(
            (st.state == "closed" and st.pending == st.parked)
            or (st.state == "exhausted" and st.pending == 0)
            for st in status.values()
        )
        return done and self.writer_lag() == 0

    def writer_lag(self) -> int:
        return self.budget.unwritten(self.feeds)

    def run(self, poll_s: float = IDLE_TICK_S, progress_s: float = 2.0,
            should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Feed until the run is finished or `should_stop()`; survive Redis outages.

        While Redis cannot be reached nothing is fed (the budget fails closed); the loop
        retries with backoff and, if Redis came back without the run (restarted empty),
        rebuilds it from the output files before feeding again.
        """
        last = 0.0
        backoff = Backoff()
        while True:
            try:
                if should_stop():
                    break
                self.recovery.ensure_run(self.feeds)
                work = self.tick()
                now = time.monotonic()
                if self.on_progress and now - last >= progress_s:
                    last = now
                    self.on_progress(self.budget.status(list(self.feeds)))
                    self.log_events()
                if work == 0:
                    if self.finished():
                        self.recovery.finalize()
                        break
                    time.sleep(poll_s)
                backoff.reset()
            except REDIS_DOWN as exc:
                log.error("Redis unavailable (%s): nothing is fed (fail closed); retry in %.1f s",
                          exc, backoff.delay_s)
                backoff.wait()
                self.recovery.redis_was_down()
        return self.budget.status(list(self.feeds))

    def log_events(self) -> None:
        """Log the event log's entries (cap changes) written since the last call, so the
        shell running the run sees a cap another shell changed (none on the first call)."""
        events = self.budget.events(list(self.feeds), self._events_after)
        if self._events_after is not None:
            for ev in events:
                log.warning("%s: cap changed from %s to %s by %s (%s tokens used)",
                            ev["category"], ev.get("old"), ev.get("new"), ev.get("by"),
                            ev.get("used"))
        after = dict(self._events_after or {})
        after.update({ev["category"]: ev["id"] for ev in events})
        self._events_after = after

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
            positions = list(feed.order[start : start + room])
            samples, rejected = self._read(feed, positions)
            known = self.budget.known(name, [feed.first_id(s) for s in samples])
            samples = [s for s, k in zip(samples, known, strict=True) if not k]  # resume
            prepared, too_long = self._render(feed, samples)
            ids = self.budget.feed(name, start, start + len(positions),
                                   now_ms() + self.lease_ms, prepared, rejected + too_long)
            if ids is None:
                self.recovery.lost_feeds(feed)
                return fed
            feed.cursor = start + len(positions)
            recorded = set(ids)
            self._enqueue(name, [(p.sample_id, 0, len(p.prompt_ids)) for p in prepared
                                 if p.sample_id in recorded])
            fed += len(positions)
            room -= max(1, len(ids))
        return fed

    def _read(self, feed: CategoryFeed, positions: list[int]
              ) -> tuple[list[Sample], list[DeadLetter]]:
        samples: list[Sample] = []
        rejected: list[DeadLetter] = []
        cat = feed.cat
        for pos in positions:
            try:
                samples.append(feed.read(pos))
            except Rejected as exc:
                where = getattr(exc, "where", None) or feed.index.where(pos)
                sid = sample_id(feed.index, pos)
                log.warning("%s: skipped record at %s: %s", cat.name, where, exc)
                turn: dict[str, Any] = {"conversation_id": sid, "turn": 1} if feed.turns else {}
                rejected.append(DeadLetter(id=turn_id(sid, 1) if feed.turns else sid,
                                           category=cat.name, outcome=Outcome.REJECTED,
                                           reason=exc.reason, message=str(exc), where=where,
                                           **turn))
        return samples, rejected

    def _opened(self, feed: CategoryFeed) -> bool:
        """Whether the category's generation prompt opens a reasoning block (`replies`)."""
        if feed.opened is None:
            parser = self.replies.reasoning
            feed.opened = parser is not None and self.renderer.opens_reasoning(
                parser.start, feed.kwargs or None)
        return feed.opened

    def _render(self, feed: CategoryFeed, samples: list[Sample],
                turns: list[NextTurn] | None = None
                ) -> tuple[list[Pending], list[DeadLetter]]:
        """Render and check each sample's prompt: its first, or with `turns` (each sample's
        next turn) the given one, checked against the turn before it (`_prefix`). Returns
        what is to be fed, and what is rejected (the template refused it, or it cannot fit
        the context)."""
        cat = feed.cat
        limit_chars = (self.context_length or CONTEXT_UNKNOWN_TOKENS) * MAX_CHARS_PER_TOKEN
        prompts: list[list[dict] | list[int]] = [t.messages for t in turns] if turns else [
            s.prompt for s in samples]
        numbers = [t.turn for t in turns] if turns else [1] * len(samples)
        ids_of = [turn_id(s.sample_id, j) if feed.turns else s.sample_id
                  for s, j in zip(samples, numbers, strict=True)]
        chat = [k for k, p in enumerate(prompts) if p and isinstance(p[0], dict)]
        huge = {k for k in chat if sum(len(_text_of(cast(dict, m))) for m in prompts[k])
                > limit_chars}
        chat = [k for k in chat if k not in huge]
        rendered: dict[int, Any] = {}
        before: dict[int, Any] = {}
        if chat:
            outs = self.renderer.render_many([prompts[k] for k in chat], feed.kwargs or None,
                                             [samples[k].tools for k in chat])
            rendered = dict(zip(chat, outs, strict=True))
            if turns:  # the prompts of the turns before, to check each against its own
                prev = self.renderer.render_many([turns[k].previous for k in chat],
                                                 feed.kwargs or None,
                                                 [samples[k].tools for k in chat])
                before = dict(zip(chat, prev, strict=True))
        sampling = msgspec.to_builtins(cat.sampling)
        max_new = cat.sampling.max_new_tokens
        fed_at = now_ms()
        prepared: list[Pending] = []
        rejected: list[DeadLetter] = []
        for k, s in enumerate(samples):
            conv = s.conversation if feed.turns else None
            fields: dict[str, Any] = {} if conv is None else {
                "conversation_id": s.sample_id, "turn": numbers[k], "turns_total": conv.turns}

            def reject(reason: str, message: str, k: int = k, s: Sample = s,
                       fields: dict[str, Any] = fields) -> None:
                rejected.append(DeadLetter(id=ids_of[k], category=cat.name,
                                           outcome=Outcome.REJECTED, reason=reason,
                                           message=message, where=s.where, **fields))

            if k in huge:
                reject("prompt_too_long",
                       f"prompt text over {limit_chars} characters cannot fit the context")
                continue
            out = rendered.get(k)
            if isinstance(out, Rejected):
                log.warning("%s: skipped record at %s: %s", cat.name, s.where, out)
                reject(out.reason, str(out))
                continue
            ids: list[int] = list(out[1]) if out is not None else list(prompts[k])  # type: ignore[arg-type]
            ctx = self.context_length
            if not ids or (ctx is not None and len(ids) + max_new > ctx):
                if not ids:
                    reject("empty_prompt", "prompt has no tokens")
                else:
                    reject("prompt_too_long", f"prompt has {len(ids)} tokens; with "
                           f"max_new_tokens={max_new} it exceeds the engine context of {ctx} "
                           "tokens")
                continue
            if turns and out is not None and k in before \
                    and not isinstance(before[k], Rejected):
                consistent, notes, shared = _prefix(turns[k], before[k][1], out[1], out[0])
                fields = {**fields, "prefix_consistent": consistent,
                          "history_notes": notes + turns[k].notes, "reusable_tokens": shared}
            if self.cfg.affinity:
                fields["affinity"] = self._shared_key(ids)
                if turns:
                    fields["prefer_engine"] = turns[k].engine
            prepared.append(Pending(sample_id=ids_of[k], ordinal=s.ordinal, prompt_ids=ids,
                                    sampling=sampling, where=s.where, source_id=s.source_id,
                                    fed_at_ms=fed_at, **fields))
        return prepared, rejected

    def _shared_key(self, ids: list[int]) -> str:
        """The prompt's affinity key if an earlier prompt had it ("" otherwise, and for a
        prompt too short to have one)."""
        key = affinity_key(ids)
        if not key:
            return ""
        seen = self._keys_seen
        if key in seen:
            seen.move_to_end(key)
            return key
        seen[key] = None
        if len(seen) > AFFINITY_KEYS_KEPT:
            seen.popitem(last=False)
        return ""

    # -- conversations (turns = "all") ---------------------------------------------------
    def follow(self, feed: CategoryFeed, st: CategoryState) -> int:
        """Feed the next turns of conversations whose last turn the writer wrote: each
        prompt is the source up to that turn with the model's own earlier turns (decoded
        from their output ids into assistant messages, `producer.replies`). In a category
        of single samples, what waits there are dead samples sent again (`tokencap retry`)."""
        room = self._room(st, follow=True)
        if room <= 0 or not st.followups:
            return 0
        name = feed.cat.name
        waiting = self.budget.followups(name, room)
        if not feed.turns:
            return self._feed_retried(feed, [f.sample_id for f in waiting])
        samples: list[Sample] = []
        turns: list[NextTurn] = []
        rejected: list[DeadLetter] = []
        for f in waiting:
            conv_id, turn = split_turn_id(f.sample_id) or (f.sample_id, 1)
            try:
                s = feed.read(f.ordinal)
            except Rejected as exc:
                s = None
                why = f"the record cannot be read any more: {exc}"
            else:
                why = "the source changed: the record at its position is another one"
            if s is None or s.sample_id != conv_id or s.conversation is None \
                    or turn > s.conversation.turns or any(o is None for o in f.outputs):
                if s is not None and any(o is None for o in f.outputs):
                    why = "the outputs of its earlier turns are gone from Redis"
                log.error("%s/%s: conversation cut: %s", name, f.sample_id, why)
                rejected.append(DeadLetter(
                    id=f.sample_id, category=name, outcome=Outcome.REJECTED,
                    reason="source_changed",
                    message=why, where=feed.index.where(f.ordinal) if f.ordinal < len(
                        feed.index) else "", conversation_id=conv_id, turn=turn))
                continue
            conv = s.conversation
            try:
                generated = self.replies.messages(f.outputs, conv.tools, conv_id, feed.stop_ids,
                                                  self._opened(feed))
            except Unparsed as exc:
                # the turn stays as generated; there is no call to answer and no content
                log.warning("%s/%s: conversation stops: a reply does not parse (%s)", name,
                            f.sample_id, exc)
                rejected.append(DeadLetter(
                    id=f.sample_id, category=name, outcome=Outcome.REJECTED,
                    reason="unparsed_reply",
                    message=f"the reply of {exc}; kept as generated, the conversation cannot "
                            "go on from it", where=s.where, conversation_id=conv_id, turn=turn,
                    turns_total=conv.turns))
                continue
            samples.append(s)
            ids = self.replies.result_ids(conv_id)
            turns.append(NextTurn(conv.prompt(generated, ids), turn,
                                  conv.prompt(generated[:-1], ids), list(f.outputs[-1] or []),
                                  generated[-1], conv.replay_notes(generated), f.engine))
        prepared, bad = self._render(feed, samples, turns)
        ids = self.budget.feed_follow(name, now_ms() + self.lease_ms, prepared, rejected + bad)
        recorded = set(ids)
        # ahead of the new samples waiting: the engine that served the turn before still
        # holds its prefix
        self._enqueue(name, [(p.sample_id, 0, len(p.prompt_ids)) for p in prepared
                             if p.sample_id in recorded], at_front=True)
        return len(waiting)

    def _feed_retried(self, feed: CategoryFeed, ids: list[str]) -> int:
        """Feed again the dead samples `tokencap retry` sent back, found by their ids."""
        name = feed.cat.name
        samples: list[Sample] = []
        rejected: list[DeadLetter] = []
        for sid in ids:
            pos = feed.index.locate(sid)
            try:
                if pos is None:
                    raise Rejected("source_changed", "no record has this id any more")
                samples.append(feed.read(pos))
            except Rejected as exc:
                log.error("%s/%s: cannot be sent again: %s", name, sid, exc)
                rejected.append(DeadLetter(id=sid, category=name, outcome=Outcome.REJECTED,
                                           reason=exc.reason, message=str(exc)))
        prepared, bad = self._render(feed, samples)
        ids_fed = set(self.budget.feed_follow(name, now_ms() + self.lease_ms, prepared,
                                              rejected + bad))
        self._enqueue(name, [(p.sample_id, 0, len(p.prompt_ids)) for p in prepared
                             if p.sample_id in ids_fed])
        if ids_fed:
            log.info("%s: %d dead sample(s) sent again", name, len(ids_fed))
        return len(ids)

    def report_cut(self, feed: CategoryFeed, st: CategoryState) -> int:
        """A closed category holds back conversations' next turns: write one cut record for
        each (once), so the files say why those conversations stopped."""
        mark = (st.followups, st.parked)
        if mark == feed._cut_mark or not any(mark):
            return 0
        feed._cut_mark = mark
        name = feed.cat.name
        turns = [(sid, ordinal, split) for sid, ordinal in self.budget.held(name)
                 if (split := split_turn_id(sid)) is not None and split[1] >= 2]
        parked = self.budget.entries(name, [sid for sid, ordinal, _ in turns if ordinal is None])
        pending = {e.pending.sample_id: e.pending for e in parked if e.pending is not None}
        letters = []
        for sid, ordinal, (conv, turn) in turns:  # turn 1 held: not a conversation yet
            p = pending.get(sid)
            where, total = (p.where, p.turns_total) if p is not None else ("", 0)
            if ordinal is not None and ordinal < len(feed.index):
                where = feed.index.where(ordinal)
                try:
                    conversation = feed.read(ordinal).conversation
                    total = conversation.turns if conversation else 0
                except Rejected:
                    pass
            letters.append(DeadLetter(
                id=sid, category=name, outcome=Outcome.CUT, reason="cap", where=where,
                message="the category closed (its cap) before this turn was sent; a raised "
                        "cap sends it", conversation_id=conv, turn=turn, turns_total=total))
        return self.budget.cut(name, letters)

    def _enqueue(self, category: str, samples: list[tuple[str, int, int]],
                 at_front: bool = False) -> None:
        """Enqueue one job per (sample id, seq, prompt tokens), in one round trip, at the
        queue's end (or its front). The ledger already holds each sample with a lease: a job
        lost here is enqueued again by the reaper."""
        jobs.enqueue(self.queues[category], self.keys, self.cfg.run, category, samples,
                     self.cfg.job_timeout_s(), at_front)

    def unpark(self, feed: CategoryFeed, st: CategoryState) -> int:
        """Re-enqueue deferred samples that now fit; a closed category holds them back (a
        raised cap reopens it)."""
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
                            feed.cat.sampling.max_new_tokens)
        est, var = model.moments(0)
        max_add = feed.cat.sampling.max_new_tokens if self.cfg.hard_cap else 0
        got = self.budget.unpark(name, est, var, max_add, self.cfg.margin_sigmas,
                                 now_ms() + self.lease_ms, UNPARK_BATCH, self.cfg.max_unwritten)
        prompts = [0] * len(got.leased)
        if self.cfg.count == "total":  # the worker reserves for the prompt too
            prompts = [len(e.pending.prompt_ids) if e.pending else 0
                       for e in (self.budget.entry(name, sid) for sid, _seq in got.leased)]
        self._enqueue(name, [(sid, seq, n) for (sid, seq), n in zip(got.leased, prompts,
                                                                  strict=True)])
        return len(got.leased)


class NextTurn(NamedTuple):
    """A conversation's next turn: its messages and number, the messages of the turn before
    it, that turn's output ids and assistant message, and what the replayed tool results do
    not match (`Conversation.replay_notes`)."""

    messages: list[dict]
    turn: int
    previous: list[dict]
    previous_output: list[int]
    previous_message: dict
    notes: list[str]
    engine: str = ""  # the engine that served the turn before


def _prefix(nxt: NextTurn, previous_ids: list[int], ids: list[int], text: str
            ) -> tuple[bool, list[str], int]:
    """Whether turn j+1's prompt ids start with turn j's prompt ids and output ids (what a
    drafter trains on is then one sequence), and if not, where and why it departs; and how
    many of its ids it shares with them (what the engine that served turn j may have cached)."""
    expected = list(previous_ids) + nxt.previous_output
    if ids[:len(expected)] == expected:
        return True, [], len(expected)
    at = next((i for i, (a, b) in enumerate(zip(ids, expected, strict=False)) if a != b),
              min(len(ids), len(expected)))
    reasoning = (nxt.previous_message.get("reasoning_content") or "").strip()
    if reasoning and reasoning not in text:
        why = "the template dropped its reasoning"
    elif at >= len(previous_ids):
        why = "the template renders the generated turn other than the model wrote it"
    else:
        why = "the template rewrote the history before it"
    return False, [f"turn {nxt.turn - 1}: not a prefix of this prompt: {why} (from token "
                   f"{at} of {len(expected)})"], at


def affinity_key(ids: list[int]) -> str:
    """The affinity key of a prompt: a digest of its first AFFINITY_PREFIX_TOKENS ids ("" for
    a shorter prompt: nothing long to share)."""
    if len(ids) <= AFFINITY_PREFIX_TOKENS:
        return ""
    head = array("i", ids[:AFFINITY_PREFIX_TOKENS]).tobytes()
    return hashlib.blake2b(head, digest_size=8).hexdigest()


def _text_of(message: dict) -> str:
    """The text a message brings to the template (content, reasoning, tool calls)."""
    parts = [message.get("content") or "", message.get("reasoning_content") or ""]
    for call in message.get("tool_calls") or ():
        parts.append(str(call))
    return "".join(p if isinstance(p, str) else str(p) for p in parts)
