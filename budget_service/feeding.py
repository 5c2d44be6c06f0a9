"""The feeding ledger: what the producer writes (one Lua call each)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, cast

import msgspec

from budget_service.keys import WRITER_GROUP
from budget_service.ledger import (
    FollowUp,
    Ledger,
    TurnEvent,
    Unparked,
    as_str,
    cap_arg,
    now_ms,
    prompt_digest,
)
from foundation.config import RunConfig, config_to_json
from foundation.errors import RunMismatch
from foundation.wire import (
    DeadLetter,
    Outcome,
    Pending,
    encode,
    split_turn_id,
    turn_id,
)


def _draws(cfg: RunConfig) -> dict[str, list[tuple[str, float]]]:
    """What draws each conversation's mode, per category with modes (a `share = "tokens"`
    category under its own name): the modes' names and weights (`foundation.modes.draw`;
    the seed also draws the record order)."""
    return {c.split_of or c.name: [(m.name, m.weight) for m in c.modes]
            for c in cfg.category if c.modes}


class Seen(NamedTuple):
    """A batch's prompts as the ledger knows them, beside the batch: each one's prompt
    digest, and the first sample that fed the same ids ("category/sample id"), or None."""

    digests: list[str]
    owners: list[str | None]

    def keep(self, kept: Sequence[bool]) -> Seen:
        """The entries of the prompts kept (`kept`, beside them)."""
        return Seen([d for d, k in zip(self.digests, kept, strict=True) if k],
                    [o for o, k in zip(self.owners, kept, strict=True) if k])


class FeedingLedger(Ledger):
    """The producer's calls: the run created, samples fed with their leases, next turns, leases
    renewed or given back, parked samples sent, cut records, the source used up or grown."""

    def init_run(self, cfg: RunConfig) -> bool:
        """Create the run's keys where absent. Returns True if the run was created now.

        An existing run must have the same categories; caps already in Redis win (they
        may have been changed live), the rest of the stored config is replaced.
        """
        existing = self.load_config()
        if existing is not None:
            old = sorted(c.name for c in existing.category)
            new = sorted(c.name for c in cfg.category)
            if old != new:
                raise RunMismatch(
                    f"run {cfg.run!r} already exists in Redis with categories {old}; the config "
                    f"has {new}. Use another run name, or `tokencap reset {cfg.run}`."
                )
            if _draws(existing) != _draws(cfg):
                raise RunMismatch(
                    f"run {cfg.run!r} already exists in Redis with modes {_draws(existing)}; "
                    f"the config has {_draws(cfg)}: a resumed run must draw every "
                    "conversation's mode as before (a conversation half made would change "
                    f"mode). Put the modes back, use another run name, or `tokencap reset "
                    f"{cfg.run}`."
                )
        self.scripts.init_run(keys=[self.keys.meta], args=[config_to_json(cfg), cfg.run, now_ms()])
        for cat in cfg.category:
            self.scripts.init_category(keys=self._ck(cat.name),
                                       args=[cap_arg(cfg.cap_for(cat)), WRITER_GROUP])
        return existing is None

    def feed(self, category: str, cursor: int, new_cursor: int, deadline_ms: int,
             samples: Sequence[Pending], rejected: Sequence[DeadLetter],
             others: Sequence[str] = (), near: Sequence[bytes] = (),
             seen: Seen | None = None) -> list[str] | None:
        """Record `samples` (pending, leased until `deadline_ms`) and `rejected` (final) and
        move the cursor from `cursor` to `new_cursor`, in one call. A sample whose prompt ids
        a category of `others` fed already is rejected as duplicate_prompt (read from their
        prompt digests first, `seen`: a script touches one category's slot; `seen`, when the
        caller asked already, is not asked again: an owner in `category` itself is left to
        the script). `near`, beside `samples` (or empty): each one's near-duplicate record
        (`producer.near_dups`, b"" for none), appended to the category's `near` when it is
        fed. Returns the ids recorded now, or None when Redis's cursor is not `cursor`
        (nothing written)."""
        if seen is None:
            seen = self.seen(others, samples)
        args: list[Any] = [cursor, new_cursor, deadline_ms, 0]
        dropped: list[DeadLetter] = []
        records = list(near) or [b""] * len(samples)
        mine = f"{category}/"
        for p, digest, owner, record in zip(samples, seen.digests, seen.owners, records,
                                            strict=True):
            first = None if owner is None or owner.startswith(mine) else owner
            dup = DeadLetter.of(p, category, Outcome.REJECTED, "duplicate_prompt",
                                f"same prompt token ids as {first or 'an earlier sample'}")
            if first is not None:
                dropped.append(dup)
                continue
            args += [p.sample_id, digest, encode(p), encode(dup), record]
        args[3] = len(samples) - len(dropped)
        for d in [*rejected, *dropped]:
            args += [d.id, d.reason, encode(d)]
        out = self.scripts.feed(keys=self._ck(category), args=args)
        if as_str(out[0]) == "stale":
            return None
        return [as_str(v) for v in out[1:]]

    def seen(self, categories: Sequence[str], samples: Sequence[Pending]) -> Seen:
        """The prompt digests of `samples` and, for each, the sample of `categories` that
        fed it first (`fed_elsewhere`): computed once per batch, for the intake screens and
        the feed."""
        digests = [prompt_digest(p.prompt_ids) for p in samples]
        return Seen(digests, self.fed_elsewhere(categories, digests))

    def near_records(self, category: str) -> bytes:
        """The category's near-duplicate records (the `near` string), for the producer to
        rebuild its index at start."""
        return cast(bytes, self.redis.get(self._ck(category).near) or b"")

    def fed_elsewhere(self, categories: Sequence[str], digests: Sequence[str]
                      ) -> list[str | None]:
        """For each prompt digest, the first sample of `categories` (in their order) that
        was fed with it, as "category/sample id", or None (one round trip)."""
        if not categories or not digests:
            return [None] * len(digests)
        pipe = self.redis.pipeline(transaction=False)
        for c in categories:
            pipe.hmget(self._ck(c).prompts, list(digests))
        found = pipe.execute()
        out: list[str | None] = []
        for k in range(len(digests)):
            owner = next(((c, hits[k]) for c, hits in zip(categories, found, strict=True)
                          if hits[k] is not None), None)
            out.append(None if owner is None else f"{owner[0]}/{as_str(owner[1])}")
        return out

    def feed_follow(self, category: str, deadline_ms: int, samples: Sequence[Pending],
                    rejected: Sequence[DeadLetter]) -> list[str]:
        """Feed the next turns of conversations waiting in `follow` (pending, leased until
        `deadline_ms`) and reject those that could not be rendered, in one call. A turn no
        longer waiting is left alone. Returns the ids fed now."""
        args: list[Any] = [deadline_ms, len(samples)]
        for p in samples:
            args += [p.sample_id, encode(p)]
        for d in rejected:
            args += [d.id, d.reason, encode(d)]
        return [as_str(v) for v in self.scripts.feed_follow(keys=self._ck(category), args=args)]

    def followups(self, category: str, limit: int) -> list[FollowUp]:
        """Up to `limit` conversations waiting for their next turn, with their history."""
        ck = self._ck(category)
        waiting = cast(list[tuple[Any, float]],
                       self.redis.zrange(ck.follow, 0, limit - 1, withscores=True))
        if not waiting:
            return []
        earlier: list[list[str]] = []
        pipe = self.redis.pipeline(transaction=False)
        for raw, _ordinal in waiting:
            split = split_turn_id(as_str(raw))
            fields = [turn_id(split[0], j) for j in range(1, split[1])] if split else []
            earlier.append(fields)
            pipe.hmget(ck.history, fields or ["-"])
        pipe.hmget(ck.engine_of, [raw for raw, _ordinal in waiting])
        *histories, engines = pipe.execute()
        out = []
        for (raw, ordinal), fields, outs, engine in zip(waiting, earlier, histories, engines,
                                                        strict=True):
            history = [None if v is None else msgspec.json.decode(v, type=list[int])
                       for v in outs[: len(fields)]]
            out.append(FollowUp(as_str(raw), int(ordinal), history,  # type: ignore[arg-type]
                                as_str(engine) if engine else ""))
        return out

    def restore_followups(self, category: str, events: Sequence[TurnEvent]) -> None:
        """Put back conversations' next turns and histories found on disk (Redis lost them):
        `lua/restore.lua`."""
        args: list[Any] = []
        for ev in events:
            args += ev.args()
        if args:
            self.scripts.restore(keys=self._ck(category), args=args)

    def cut(self, category: str, letters: Sequence[DeadLetter]) -> int:
        """Report turns held back by the closed category, once each (cut records)."""
        args: list[Any] = []
        for d in letters:
            args += [d.id, encode(d)]
        if not args:
            return 0
        return int(self.scripts.cut(keys=self._ck(category), args=args))

    def held(self, category: str, limit: int = 10_000) -> list[tuple[str, int | None]]:
        """Turns and samples a closed category holds back and has not reported cut: those
        waiting in `follow` with their record's position, then the parked ones (None)."""
        ck = self._ck(category)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrange(ck.follow, 0, limit - 1, withscores=True)
        pipe.zrange(ck.parked, 0, limit - 1)
        pipe.hgetall(ck.cut)
        follow, parked, cut = pipe.execute()
        done = {as_str(k) for k in cut}
        out: list[tuple[str, int | None]] = [(as_str(v), int(o)) for v, o in follow]
        out += [(as_str(v), None) for v in parked]
        return [(s, o) for s, o in out if s not in done]

    def requeue(self, category: str, p: Pending, seen_seq: int, deadline_ms: int) -> int:
        """Give a sample whose lease expired back to its queue: returns its new seq (enqueue
        its job with it), or -1 when it changed since it was read (nothing done)."""
        return int(self.scripts.requeue(
            keys=self._ck(category),
            args=[p.sample_id, encode(p), now_ms(), deadline_ms, seen_seq],
        ))

    def keep_lease(self, category: str, sample_id: str, deadline_ms: int) -> bool:
        """Extend the lease of a sample whose job still waits in its queue (False: it is no
        longer pending, and its lease entry is dropped)."""
        return bool(self.scripts.lease(keys=self._ck(category),
                                       args=[sample_id, deadline_ms]))

    def unpark(self, category: str, estimate: int, variance: int, max_add: int,
               sigmas: float, deadline_ms: int, limit: int, max_unwritten: int = 0
               ) -> Unparked:
        """Lease again, with a new seq, and reserve for as many parked samples as admission
        would take now, each asked for as admit asks (`estimate` and `max_add` plus the prompt
        tokens admit kept beside it); none while the category is closed (they are held)."""
        out = self.scripts.unpark(
            keys=self._ck(category),
            args=[deadline_ms, estimate, variance, max_add, sigmas, limit, max_unwritten],
        )
        return Unparked([(as_str(out[i]), int(out[i + 1])) for i in range(0, len(out), 3)],
                        [int(out[i + 2]) for i in range(0, len(out), 3)])

    def reconcile(self, category: str,
                  records: Iterable[tuple[str, str, int, int, int | str, str, int, str]]
                  ) -> int:
        """Add to Redis the final samples read from the files (`producer.reconcile`): (id,
        final value, counted, waste, bucket, gate reason, output tokens, decode mode)
        each."""
        args: list[Any] = []
        for rec in records:
            args.extend(rec)
        if not args:
            return 0
        return int(self.scripts.reconcile(keys=self._ck(category), args=args))

    def mark_exhausted(self, category: str, cursor: int) -> bool:
        """The source is used up at `cursor`, nothing is pending, no conversation waits for
        its next turn and everything is written: the category is done. False (nothing
        marked) otherwise, e.g. when Redis's cursor is not `cursor` (it lost feeds)."""
        return self._close(self.scripts.exhausted, category, cursor)[1]

    def source_size(self, category: str, records: int) -> bool:
        """The category's source has `records` records now (the producer says so whenever it
        opens the source): when that is not the number its cursor walked (the source grew),
        the cursor goes back to 0 (the feed skips what is final or pending) and an exhausted
        category opens again. True when it did."""
        return bool(self.scripts.source_size(keys=self._ck(category), args=[records]))

    def cursor(self, category: str) -> int:
        return int(self.redis.hget(self._ck(category).state, "cursor") or 0)

    def expired(self, category: str, now: int, limit: int) -> list[str]:
        """Samples whose lease ended before `now` (ms), oldest first."""
        raw = self.redis.zrangebyscore(self._ck(category).leases, "-inf", now, start=0,
                                       num=limit)
        return [as_str(v) for v in raw]

    def known(self, category: str, sample_ids: Sequence[str]) -> list[bool]:
        """For each id: is the sample final or pending already?"""
        ck = self._ck(category)
        return [bool(final or pending) for final, pending in self._per_sample(
            sample_ids, lambda p, s: p.hexists(ck.final, s),
            lambda p, s: p.hexists(ck.pending, s))]

