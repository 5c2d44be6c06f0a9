"""The budget: every change to a run's Redis state, each one Lua call, plus the reads.

Who calls what:
- the producer: `init_run`, `feed`, `feed_follow`, `requeue`, `keep_lease`, `unpark`,
  `mark_exhausted`, `cut`, `reconcile`, `restore_followups`, `fail` (a sample lost too often);
- workers: `admit`, `heartbeat`, `commit`, `release`, `fail`, `add_engine_counts`, `refuse`;
- the writer: `ensure_groups`, `acknowledge`, `mark_written`, `set_writer_error`;
- operators (CLI, HTTP): `set_cap`, `close`;
- everybody: the reads (`status`, `state`, `hist`, `cursor`, `expired`, `entry`, ...).
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any, NamedTuple, cast

import msgspec
from redis import Redis

from budget_service import codec
from budget_service.estimator import bucket_of
from budget_service.keys import WRITER_GROUP, CategoryKeys, Keys
from budget_service.scripts import Scripts
from foundation.config import RunConfig, config_from_json, config_to_json
from foundation.engine_info import EngineInfo
from foundation.errors import RunMismatch
from foundation.wire import (
    DeadLetter,
    Outcome,
    Pending,
    Result,
    encode,
    split_turn_id,
    turn_id,
)

RATE_EWMA_WEIGHT = 0.1
REFUSED_STREAM_MAXLEN = 10_000
SERIES_POINTS = 8640  # the time series' points kept: a day at one every 10 s
STATE_FIELDS = (
    "cap", "used", "reserved", "samples", "failed", "rejected", "waste",
    "closed", "exhausted", "rate", "dup_prompts", "worst", "var", "oov", "prompt", "cached",
    "reusable",
)  # fmt: skip
UNCAPPED = "none"  # the cap of an uncapped category, in Redis (lua/_lib.lua)
STREAM_PAGE = 512  # entries read per XRANGE call


class _SampleId(msgspec.Struct):
    """The id of a result or dead letter in a stream entry (the rest is not decoded)."""

    id: str


_SAMPLE_ID = msgspec.json.Decoder(_SampleId)


class FollowUp(NamedTuple):
    """A conversation waiting for its next turn: the turn's sample id, the record's position
    in the source, and the output ids of the turns before (in order)."""

    sample_id: str
    ordinal: int
    outputs: list[list[int]]
    engine: str = ""  # the engine that served the turn before ("": unknown)


class TurnEvent(NamedTuple):
    """What a written turn means for its conversation (`Budget.acknowledge`): with `next_id`
    the conversation goes on (`output_ids` kept for the next prompts), else it ended and
    `drop` lists the turn ids whose outputs are no longer needed."""

    turn_id: str
    output_ids: list[int] | None = None
    next_id: str | None = None
    ordinal: int = 0
    drop: tuple[str, ...] = ()
    engine: str = ""  # the engine that served the turn: the next one prefers it

    def args(self) -> list[Any]:
        if self.next_id is not None:
            return ["next", self.turn_id, encode(self.output_ids or []), self.next_id,
                    self.ordinal, self.engine]
        return ["end", len(self.drop), *self.drop]


def turn_event(rec: Result | DeadLetter, output_ids: list[int] | None = None
               ) -> TurnEvent | None:
    """What writing `rec` means for its conversation (None: not a turn, or a cut record):
    a turn before the last hands its output (`output_ids`, default its own) to the next
    turn; the last turn, or a turn rejected or dead, ends the conversation."""
    conv = rec.conversation_id
    if conv is None or rec.turn <= 0:
        return None
    if isinstance(rec, DeadLetter) and rec.outcome == Outcome.CUT:
        return None
    if isinstance(rec, Result) and rec.turn < rec.turns_total:
        return TurnEvent(rec.id, rec.output_ids if output_ids is None else output_ids,
                         turn_id(conv, rec.turn + 1), rec.ordinal, engine=rec.engine)
    return TurnEvent(rec.id, drop=tuple(turn_id(conv, j) for j in range(1, rec.turn)))


def cap_arg(cap: int | None) -> int | str:
    """A cap as Lua gets it: tokens, or "none" (uncapped)."""
    return UNCAPPED if cap is None else cap


def cap_text(cap: int | None) -> str:
    """A cap for people: its tokens, or "uncapped"."""
    return "uncapped" if cap is None else str(cap)


def parse_cap(text: str) -> int | None:
    """A cap typed by people: tokens (>= 0), or "none" for uncapped. Raises ValueError."""
    if text.strip().lower() == UNCAPPED:
        return None
    cap = int(text)
    if cap < 0:
        raise ValueError(f"a cap is >= 0 tokens or \"none\", got {text!r}")
    return cap


CACHE_COUNTERS = {"samples": "samples", "prompt": "prompt_tokens", "cached": "cached_tokens",
                  "reusable": "reusable_tokens"}


def _cache_by_engine(raw: dict[bytes, bytes]) -> dict[str, dict[str, int]]:
    """A category's `cache` hash (fields `<engine URL> <counter>`) as {url: {counter: n}}."""
    out: dict[str, dict[str, int]] = {}
    for k, v in raw.items():
        url, _, counter = _s(k).rpartition(" ")
        row = out.setdefault(url, dict.fromkeys(CACHE_COUNTERS.values(), 0))
        row[CACHE_COUNTERS[counter]] = int(v)
    return dict(sorted(out.items()))


def cap_value(raw: Any) -> int | None:
    """A cap as Redis stores it, back to tokens or None (uncapped)."""
    text = _s(raw) if raw is not None else "0"
    return None if text == UNCAPPED else int(text or 0)


def now_ms() -> int:
    return int(time.time() * 1000)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def prompt_digest(prompt_ids: Sequence[int]) -> str:
    """What two samples with the same prompt token ids share (duplicate_prompt)."""
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=12).hexdigest()


class Entry(NamedTuple):
    """What the ledger holds for one open sample (`Budget.entry`)."""

    pending: Pending | None
    seq: int
    in_flight: bool


class Unparked(NamedTuple):
    """`Budget.unpark`'s answer: samples to enqueue again (id, seq)."""

    leased: list[tuple[str, int]]


class CategoryState(msgspec.Struct, frozen=True):
    """One category's state as the ledger holds it (`Budget.states`), what the producer
    steers on; `tokencap status --json` shows the same fields (`Budget.status`)."""

    cap: int | None  # None: uncapped
    used: int  # tokens counted (committed)
    reserved: int  # tokens reserved by the samples admitted and not yet committed
    worst: int  # the most the admitted samples could still add (hard cap)
    var: int  # variance of the reserved estimates (tokens^2)
    samples: int  # committed
    skipped: int  # fed, not sent because the category closed: sent if its cap is raised
    failed: int
    rejected: int
    waste_tokens: int
    overshoot: int  # used past the cap
    state: str  # open, closed or exhausted
    pending: int  # in the ledger, not final (queued, parked, in flight)
    in_flight: int  # admitted, at an engine
    parked: int  # deferred by admission until they fit
    followups: int  # conversations' next turns waiting to be fed
    duplicate_prompts: int
    reasons: dict[str, int]  # rejections and dead letters by reason
    unwritten: int  # results and dead letters the writer has not yet written
    # samples with output ids past the tokenizer's vocabulary; the prompt tokens committed,
    # and those the engines served from their prefix cache
    out_of_vocab: int
    prompt_tokens: int
    cached_tokens: int
    # the prompt tokens shared with the turn before: what a prefix cache could have served
    # (conversations' later turns)
    reusable_tokens: int


class CloseAction(StrEnum):
    """What `close.lua` is asked to do (ARGV[1]): one entry point of `Budget` each."""

    CAP = "cap"  # set_cap: a new cap; the category closes or reopens by it
    CLOSE = "close"  # close: closed by an operator
    EXHAUSTED = "exhausted"  # mark_exhausted: the source is used up and everything written


class Budget:
    """All reads and writes of one run's budget state."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.scripts = Scripts(redis)

    def _ck(self, category: str) -> CategoryKeys:
        return self.keys.cat(category)

    # -- run lifecycle (producer) -------------------------------------------------------
    def load_config(self) -> RunConfig | None:
        raw = self.redis.hget(self.keys.meta, "config")
        return config_from_json(raw.encode() if isinstance(raw, str) else raw) if raw else None

    def has_run(self) -> bool:
        return bool(self.redis.exists(self.keys.meta))

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
        self.scripts.init_run(keys=[self.keys.meta], args=[config_to_json(cfg), cfg.run, now_ms()])
        for cat in cfg.category:
            self.scripts.init_category(keys=self._ck(cat.name),
                                       args=[cap_arg(cfg.cap_for(cat)), WRITER_GROUP])
        return existing is None

    def ensure_groups(self, category: str) -> None:
        """The writer's consumer group on the category's streams (after Redis lost them)."""
        self.scripts.init_category(keys=self._ck(category), args=["", WRITER_GROUP])

    # -- feeding and reaping (producer) -------------------------------------------------
    def feed(self, category: str, cursor: int, new_cursor: int, deadline_ms: int,
             samples: Sequence[Pending], rejected: Sequence[DeadLetter]) -> list[str] | None:
        """Record `samples` (pending, leased until `deadline_ms`) and `rejected` (final) and
        move the cursor from `cursor` to `new_cursor`, in one call. Returns the ids recorded
        now, or None when Redis's cursor is not `cursor` (nothing written)."""
        args: list[Any] = [cursor, new_cursor, deadline_ms, len(samples)]
        for p in samples:
            dup = DeadLetter(id=p.sample_id, category=category, outcome=Outcome.REJECTED,
                             reason="duplicate_prompt", where=p.where,
                             message="same prompt token ids as an earlier sample",
                             conversation_id=p.conversation_id, turn=p.turn,
                             turns_total=p.turns_total)
            args += [p.sample_id, prompt_digest(p.prompt_ids), encode(p), encode(dup)]
        for d in rejected:
            args += [d.id, d.reason, encode(d)]
        out = self.scripts.feed(keys=self._ck(category), args=args)
        if _s(out[0]) == "stale":
            return None
        return [_s(v) for v in out[1:]]

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
        return [_s(v) for v in self.scripts.feed_follow(keys=self._ck(category), args=args)]

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
            split = split_turn_id(_s(raw))
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
            out.append(FollowUp(_s(raw), int(ordinal), history,  # type: ignore[arg-type]
                                _s(engine) if engine else ""))
        return out

    def restore_followups(self, category: str, events: Sequence[TurnEvent]) -> None:
        """Put back conversations' next turns and histories found on disk (Redis lost them)."""
        args: list[Any] = []
        for ev in events:
            args += ev.args()
        if args:
            self.scripts.acknowledge(keys=self._ck(category),
                                     args=["results", WRITER_GROUP, 0, 0, 0, *args])

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
        done = {_s(k) for k in cut}
        out: list[tuple[str, int | None]] = [(_s(v), int(o)) for v, o in follow]
        out += [(_s(v), None) for v in parked]
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
        """Lease again, with a new seq, as many parked samples as admission would take now
        (each counted with `estimate`); none while the category is closed (they are held)."""
        out = self.scripts.unpark(
            keys=self._ck(category),
            args=[deadline_ms, estimate, variance, max_add, sigmas, limit, max_unwritten],
        )
        return Unparked([(_s(out[i]), int(out[i + 1])) for i in range(0, len(out), 2)])

    def reconcile(self, category: str, records: Iterable[tuple[str, str, int, int, int | str]]
                  ) -> int:
        args: list[Any] = []
        for rec in records:
            args.extend(rec)
        if not args:
            return 0
        return int(self.scripts.reconcile(keys=self._ck(category), args=args))

    # -- caps and states (operators, producer) ------------------------------------------
    def _close(self, category: str, action: CloseAction, *args: Any
               ) -> tuple[bool, bool, int | None]:
        closed, exhausted, old = self.scripts.close(keys=self._ck(category),
                                                    args=[action.value, *args])
        return _s(closed) == "1", _s(exhausted) == "1", cap_value(old)

    def set_cap(self, category: str, cap: int | None, by: str = "") -> tuple[bool, int | None]:
        """Change the cap (None: uncapped): a category below it (re)opens, and what it held
        back is sent; one at or above it closes. The change goes to the category's event
        log with `by` (who asked). Returns (closed, old cap)."""
        closed, _exhausted, old = self._close(category, CloseAction.CAP, cap_arg(cap),
                                            now_ms(), by)
        return closed, old

    def dead_samples(self, category: str, reason: str = "") -> list[str]:
        """Ids of the category's dead-lettered samples (with `reason`, or any), read with
        HSCAN (Redis is not blocked however many there are)."""
        return sorted(_s(k) for k, v in self.redis.hscan_iter(self._ck(category).final)
                      if codec.is_dead(v, reason))

    def retried(self, category: str) -> set[str]:
        """Samples sent again by `retry` (their dead letters on disk are history)."""
        return {_s(v) for v in self.redis.smembers(self._ck(category).retried)}

    def retry(self, category: str, ids: Sequence[str], reason: str = "",
              batch: int = 500) -> int:
        """Send dead samples again (`lua/retry.lua`): each one still dead stops being final
        and waits to be fed by the producer. Returns how many moved."""
        moved = 0
        for k in range(0, len(ids), batch):
            moved += int(self.scripts.retry(keys=self._ck(category),
                                            args=[reason, *ids[k:k + batch]]))
        return moved

    def events(self, categories: Sequence[str], after: Mapping[str, str] | None = None
               ) -> list[dict[str, Any]]:
        """The event log of `categories` (cap changes), oldest first, each with its
        `category` and stream `id`; with `after` (category -> id), only later entries."""
        pipe = self.redis.pipeline(transaction=False)
        for name in categories:
            last = (after or {}).get(name)
            pipe.xrange(self._ck(name).events, min=f"({last}" if last else "-")
        out = []
        for name, entries in zip(categories, pipe.execute(), strict=True):
            for entry_id, fields in entries:
                ev: dict[str, Any] = {_s(k): _s(v) for k, v in fields.items()}
                ev.update(category=name, id=_s(entry_id), at=int(ev.get("at") or 0))
                out.append(ev)
        return sorted(out, key=lambda e: (e["at"], e["id"]))

    def close(self, category: str) -> None:
        self._close(category, CloseAction.CLOSE)

    def mark_exhausted(self, category: str, cursor: int) -> bool:
        """The source is used up at `cursor`, nothing is pending, no conversation waits for
        its next turn and everything is written: the category is done. False (nothing
        marked) otherwise, e.g. when Redis's cursor is not `cursor` (it lost feeds)."""
        return self._close(category, CloseAction.EXHAUSTED, cursor)[1]

    # -- per sample (workers) -----------------------------------------------------------
    def admit(
        self, category: str, sample_id: str, estimate: int, lease_ms: int, max_add: int = 0,
        variance: int = 0, sigmas: float = 0.0, seq: int = 0, max_unwritten: int = 0,
    ) -> tuple[str, Pending | None]:
        """Admit a sample: reserve `estimate` tokens (whose variance is `variance`) while
        used + reserved + estimate + `sigmas` standard deviations of the in-flight total stay
        below the cap; with `max_add` > 0 (the most the sample can add to `used`), also keep
        `used` + what in-flight samples can add below the cap. `seq` is the job's: a job of
        an earlier enqueue of the sample is refused ('stale'). While the category has
        `max_unwritten` (> 0) results the writer has not written, nothing is admitted."""
        now = now_ms()
        out = self.scripts.admit(
            keys=self._ck(category),
            args=[sample_id, estimate, now + lease_ms, now, max_add, variance, sigmas, seq,
                  max_unwritten],
        )
        status = _s(out[0])
        payload = msgspec.json.decode(out[1], type=Pending) if status == "ok" else None
        return status, payload

    def heartbeat(self, category: str, sample_id: str, estimate: int, lease_ms: int,
                  variance: int = 0) -> bool:
        return bool(self.scripts.heartbeat(
            keys=self._ck(category),
            args=[sample_id, estimate, now_ms() + lease_ms, variance],
        ))

    def commit(self, result: Result, waste: int, rate_tok_s: float) -> tuple[str, int]:
        out = self.scripts.commit(
            keys=self._ck(result.category),
            args=[
                result.id, result.counted_tokens, waste, bucket_of(result.completion_tokens),
                f"{rate_tok_s:.6g}", RATE_EWMA_WEIGHT, encode(result), result.out_of_vocab,
                result.prompt_tokens, result.cached_tokens or 0, result.reusable_tokens or 0,
                result.engine,
            ],  # fmt: skip
        )
        return _s(out[0]), int(out[1])

    def release(self, category: str, p: Pending, retry_at_ms: int) -> bool:
        return bool(self.scripts.release(keys=self._ck(category),
                                         args=[p.sample_id, encode(p), retry_at_ms]))

    def fail(self, dead: DeadLetter) -> bool:
        """Record a terminal rejection (`outcome` rejected) or dead letter (`outcome` dead).
        False if the sample was final already."""
        return bool(self.scripts.fail(keys=self._ck(dead.category),
                                      args=[dead.id, dead.outcome, dead.reason, encode(dead)]))

    def add_engine_counts(self, counts: Mapping[str, int]) -> None:
        """Add a worker's per-engine counters (`consumers.stats`) to the run's totals."""
        args: list[Any] = []
        for field, delta in counts.items():
            args += [field, delta]
        if args:
            self.scripts.engine_counts(keys=[self.keys.engines], args=args)

    def record_point(self, point: Mapping[str, Any], keep: int = SERIES_POINTS) -> None:
        """Append one point of the run's time series (the budget service records them)."""
        self.scripts.series(keys=[self.keys.series], args=[keep, encode(point)])

    def series(self, after: str = "", count: int | None = None) -> list[dict[str, Any]]:
        """The time series' points, oldest first, each with its stream `id`: those after
        the point `after` (an id), or with `count` the last ones only."""
        key = self.keys.series
        if count is not None:
            entries = cast(list[Any], self.redis.xrevrange(key, count=count))[::-1]
        else:
            entries = cast(list[Any], self.redis.xrange(key, min=f"({after}" if after else "-"))
        return [{**msgspec.json.decode(fields[b"p"]), "id": _s(eid)} for eid, fields in entries]

    def record_engines(self, infos: Sequence[EngineInfo]) -> None:
        """What the run's engines serve (the producer's preflight), for status and workers."""
        args: list[Any] = []
        for info in infos:
            args += [info.url, encode(info)]
        self.scripts.engine_info(keys=[self.keys.engine_info], args=args)

    def engines_seen(self) -> dict[str, EngineInfo]:
        """What the producer's preflight found each engine serves (url -> info)."""
        raw = self.redis.hgetall(self.keys.engine_info)
        return {_s(k): msgspec.json.decode(v, type=EngineInfo) for k, v in raw.items()}

    def refuse(self, record: Mapping[str, Any]) -> None:
        """Record a job a worker refused to run (capped stream, for operators)."""
        self.redis.xadd(self.keys.refused, {"r": encode(record)},
                        maxlen=REFUSED_STREAM_MAXLEN, approximate=True)

    # -- the writer ---------------------------------------------------------------------
    def acknowledge(self, category: str, dead: bool, entry_ids: Sequence[bytes | str],
                    marks: Mapping[str, int | str], correction: int = 0,
                    events: Sequence[TurnEvent] = ()) -> int:
        """Mark the samples written (`marks`: sample id -> counted tokens, or "d" for a dead
        letter), ack and delete their stream entries, correct `used` by `correction`, and
        carry their conversations on (`events`): one call, so a sample is marked, and its
        conversation's next turn put in `follow`, exactly when its entry leaves the stream."""
        args: list[Any] = ["dead" if dead else "results", WRITER_GROUP, correction,
                           len(entry_ids), *entry_ids, len(marks)]
        for sid, mark in marks.items():
            args += [sid, mark]
        for ev in events:
            args += ev.args()
        return int(self.scripts.acknowledge(keys=self._ck(category), args=args))

    def mark_written(self, category: str, marks: Mapping[str, int | str]) -> None:
        """Mark samples found on disk written (a writer starting on files Redis has not
        seen marked: a commit lost, a Redis restarted empty)."""
        if marks:
            self.acknowledge(category, False, [], marks)

    def written(self, category: str, sample_ids: Sequence[str]) -> list[str | None]:
        """The written mark of each sample: counted tokens (as text), "d", or None."""
        if not sample_ids:
            return []
        raw = self.redis.hmget(self._ck(category).written, list(sample_ids))
        return [None if v is None else _s(v) for v in raw]

    def unacknowledged(self, category: str) -> set[str]:
        """The sample ids of the results and dead letters still in the category's streams:
        committed, not acknowledged by a writer (written or not)."""
        ck = self._ck(category)
        ids: set[str] = set()
        for stream in (ck.results, ck.dead):
            start = "-"
            while True:
                batch = cast(list[tuple[bytes, dict[bytes, bytes]]],
                             self.redis.xrange(stream, start, "+", count=STREAM_PAGE))
                for _eid, fields in batch:
                    if b"r" in fields:
                        ids.add(_SAMPLE_ID.decode(fields[b"r"]).id)
                if len(batch) < STREAM_PAGE:
                    break
                start = "(" + _s(batch[-1][0])
        return ids

    def set_writer_error(self, message: str | None) -> None:
        """The writer's trouble (a full disk, ...) for status and `/metrics`; None clears it."""
        if message is None:
            self.redis.hdel(self.keys.writer_state, "error", "error_at_ms")
        else:
            self.redis.hset(self.keys.writer_state,
                            mapping={"error": message, "error_at_ms": now_ms()})

    # -- reads --------------------------------------------------------------------------
    def state(self, category: str) -> dict[str, int | float | None]:
        """The state hash as numbers (`cap` None when uncapped)."""
        vals = self.redis.hmget(self._ck(category).state, STATE_FIELDS)
        out: dict[str, int | float | None] = {}
        for f, v in zip(STATE_FIELDS, vals, strict=True):
            if f == "cap":
                out[f] = cap_value(v)
            else:
                out[f] = float(v) if f == "rate" and v else int(v or 0)
        return out

    def hist(self, category: str) -> dict[int, int]:
        raw = self.redis.hgetall(self._ck(category).hist)
        return {int(k): int(v) for k, v in raw.items()}

    def cursor(self, category: str) -> int:
        return int(self.redis.hget(self._ck(category).state, "cursor") or 0)

    def expired(self, category: str, now: int, limit: int) -> list[str]:
        """Samples whose lease ended before `now` (ms), oldest first."""
        raw = self.redis.zrangebyscore(self._ck(category).leases, "-inf", now, start=0,
                                       num=limit)
        return [_s(v) for v in raw]

    def entries(self, category: str, sample_ids: Sequence[str]) -> list[Entry]:
        """What the ledger holds for each of `sample_ids`, in one round trip."""
        if not sample_ids:
            return []
        ck = self._ck(category)
        pipe = self.redis.pipeline(transaction=False)
        for sid in sample_ids:
            pipe.hget(ck.pending, sid)
            pipe.hget(ck.seq, sid)
            pipe.hexists(ck.reserved, sid)
        raw = pipe.execute()
        out = []
        for i in range(0, len(raw), 3):
            payload, seq, in_flight = raw[i : i + 3]
            pending = msgspec.json.decode(payload, type=Pending) if payload else None
            out.append(Entry(pending, int(seq or 0), bool(in_flight)))
        return out

    def entry(self, category: str, sample_id: str) -> Entry:
        return self.entries(category, [sample_id])[0]

    def known(self, category: str, sample_ids: Sequence[str]) -> list[bool]:
        """For each id: is the sample final or pending already?"""
        if not sample_ids:
            return []
        ck = self._ck(category)
        pipe = self.redis.pipeline(transaction=False)
        for sid in sample_ids:
            pipe.hexists(ck.final, sid)
            pipe.hexists(ck.pending, sid)
        flags = pipe.execute()
        return [bool(flags[2 * i] or flags[2 * i + 1]) for i in range(len(sample_ids))]

    def final_marks(self, category: str) -> dict[str, str]:
        raw = self.redis.hgetall(self._ck(category).final)
        return {_s(k): _s(v) for k, v in raw.items()}

    def unwritten(self, categories: Iterable[str]) -> int:
        """Stream entries the writer has not written and acknowledged yet, over `categories`."""
        pipe = self.redis.pipeline(transaction=False)
        for name in categories:
            ck = self._ck(name)
            pipe.xlen(ck.results)
            pipe.xlen(ck.dead)
        return int(sum(pipe.execute()))

    def writer_holder(self) -> str | None:
        """Who holds the run's writer lease (host:pid:...), or None."""
        raw = self.redis.get(self.keys.writer_lock)
        return None if raw is None else _s(raw)

    def engine_counts(self) -> dict[str, int]:
        raw = self.redis.hgetall(self.keys.engines)
        return {_s(k): int(v) for k, v in raw.items()}

    def states(self, categories: Sequence[str]) -> dict[str, CategoryState]:
        """Each category's state, typed (what the producer steers on), in one round trip."""
        return self._states(categories, by_engine=False)[0]

    def _states(self, categories: Sequence[str], by_engine: bool
                ) -> tuple[dict[str, CategoryState], list[Any]]:
        """The categories' states, and (with `by_engine`) their raw per-engine cache hashes,
        then the writer lock holder, the writer's state and the engines' info (raw)."""
        pipe = self.redis.pipeline(transaction=False)
        for name in categories:
            ck = self._ck(name)
            pipe.hmget(ck.state, STATE_FIELDS)
            pipe.hlen(ck.pending)
            pipe.hlen(ck.reserved)
            pipe.zcard(ck.parked)
            pipe.hgetall(ck.reasons)
            pipe.xlen(ck.results)
            pipe.xlen(ck.dead)
            pipe.zcard(ck.follow)
            if by_engine:
                pipe.hgetall(ck.cache)
        pipe.get(self.keys.writer_lock)
        pipe.hgetall(self.keys.writer_state)
        pipe.hgetall(self.keys.engine_info)
        *raw, holder, wstate, engines_raw = pipe.execute()
        per = 9 if by_engine else 8
        states: dict[str, CategoryState] = {}
        extra: list[Any] = []
        for i, name in enumerate(categories):
            vals, pending, inflight, parked, reasons, results, dead, follow = \
                raw[per * i : per * i + 8]
            st = {f: (v.decode() if v else "0") for f, v in zip(STATE_FIELDS, vals, strict=True)}
            cap, used = cap_value(st["cap"]), int(st["used"])
            state = "closed" if st["closed"] == "1" else "open"
            if state == "open" and st["exhausted"] == "1":
                state = "exhausted"
            states[name] = CategoryState(
                cap=cap, used=used, reserved=int(st["reserved"]), worst=int(st["worst"]),
                var=int(st["var"]), samples=int(st["samples"]),
                skipped=int(parked) + int(follow) if state == "closed" else 0,
                failed=int(st["failed"]), rejected=int(st["rejected"]),
                waste_tokens=int(st["waste"]),
                overshoot=0 if cap is None else max(0, used - cap), state=state,
                pending=int(pending), in_flight=int(inflight), parked=int(parked),
                followups=int(follow), duplicate_prompts=int(st["dup_prompts"]),
                reasons={_s(k): int(v) for k, v in sorted(reasons.items())},
                unwritten=int(results) + int(dead), out_of_vocab=int(st["oov"]),
                prompt_tokens=int(st["prompt"]), cached_tokens=int(st["cached"]),
                reusable_tokens=int(st["reusable"]))
            if by_engine:
                extra.append(raw[per * i + 8])
        return states, [extra, holder, wstate, engines_raw]

    def status(self, categories: list[str] | None = None,
               by_engine: bool = False) -> dict[str, Any]:
        """The `tokencap status --json` document (each category's `CategoryState` as a dict);
        with `by_engine`, each category's prefix cache counters per engine (`engines`:
        samples, prompt, cached and reusable tokens)."""
        if categories is None:
            cfg = self.load_config()
            categories = [c.name for c in cfg.category] if cfg else []
        states, (caches, holder, wstate, engines_raw) = self._states(categories, by_engine)
        cats: dict[str, Any] = {name: msgspec.structs.asdict(st) for name, st in states.items()}
        if by_engine:
            for name, cache in zip(categories, caches, strict=True):
                cats[name]["engines"] = _cache_by_engine(cache)
        writer = {"holder": None if holder is None else _s(holder),
                  "error": _s(wstate[b"error"]) if b"error" in wstate else None,
                  "unwritten": sum(c["unwritten"] for c in cats.values())}
        engines = {_s(k): msgspec.to_builtins(msgspec.json.decode(v, type=EngineInfo))
                   for k, v in engines_raw.items()}
        return {"run": self.keys.run, "categories": cats, "writer": writer,
                "engines": engines, "simulated": any(e.get("simulated") for e in
                                                     engines.values())}
