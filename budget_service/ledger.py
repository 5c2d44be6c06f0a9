"""The ledger's common ground: one run's keys and scripts, the value types, the shared reads.

The ledger is split by role, each role one class over the same `Keys` and `Scripts`, and
every change one Lua call (`budget_service/lua/`):
- `budget_service.feeding.FeedingLedger`: the producer;
- `budget_service.samples.SampleLedger`: workers;
- `budget_service.writing.WritingLedger`: the writer;
- `budget_service.operating.OperatorLedger`: operators (CLI, HTTP);
- `budget_service.telemetry.TelemetryLedger`: status, `/metrics`, the live page.
`budget_service.budget.Budget` holds all five for code that plays several roles (the
producer, the launcher, the CLI, tests); workers and the writer hold their role's alone.
Each role reads what every role may read (`Ledger`: the typed category states, the length
histogram, samples' entries). The ledger's value encodings are
`budget_service.codec`.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
from redis import Redis
from redis.client import Pipeline
from redis.commands.core import Script

from budget_service.keys import CategoryKeys, Keys
from budget_service.scripts import Scripts

# the cap of an uncapped category, in the config and in Redis (lua/_lib.lua)
from foundation.config import UNCAPPED, RunConfig, config_from_json
from foundation.gate import GateReason
from foundation.units import parse_count
from foundation.wire import (
    DeadLetter,
    Outcome,
    Pending,
    Result,
    encode,
    turn_id,
)

RATE_EWMA_WEIGHT = 0.1
REFUSED_STREAM_MAXLEN = 10_000
SERIES_POINTS = 8640  # the time series' points kept: a day at one every 10 s
# the reply gate's reasons (`foundation.gate.GateReason`): state fields `gated:<reason>`
# (output tokens) and `gated_n:<reason>` (replies) of the replies it kept out of training
GATE_REASONS = tuple(r.value for r in GateReason)
STATE_FIELDS = (
    "cap", "used", "reserved", "samples", "failed", "rejected", "waste",
    "closed", "exhausted", "rate", "dup_prompts", "worst", "var", "oov", "prompt", "cached",
    "reusable", "kept", *(f"gated:{r}" for r in GATE_REASONS),
    *(f"gated_n:{r}" for r in GATE_REASONS),
)  # fmt: skip
STREAM_PAGE = 512  # entries read per XRANGE call


class _SampleId(msgspec.Struct):
    """The id of a result or dead letter in a stream entry (the rest is not decoded)."""

    id: str


SAMPLE_ID = msgspec.json.Decoder(_SampleId)


class FollowUp(NamedTuple):
    """A conversation waiting for its next turn: the turn's sample id, the record's position
    in the source, and the output ids of the turns before (in order)."""

    sample_id: str
    ordinal: int
    outputs: list[list[int]]
    engine: str = ""  # the engine that served the turn before ("": unknown)


class TurnEvent(NamedTuple):
    """What a written turn means for its conversation (`WritingLedger.acknowledge`): with `next_id`
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
    turn; the last turn, a turn the reply gate kept out of training (its reply loops, is
    empty, cut or never closes its reasoning: nothing to go on from), or a turn rejected,
    dead or stopped, ends the conversation."""
    conv = rec.conversation_id
    if conv is None or rec.turn <= 0:
        return None
    if isinstance(rec, DeadLetter) and rec.outcome == Outcome.CUT:
        return None
    if isinstance(rec, Result) and rec.turn < rec.turns_total and not rec.gate:
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
    """A cap typed by people: tokens as people write them (`10M`, `500K`, `10_000_000`:
    `foundation.units.parse_count`), or "none" for uncapped. Raises ValueError."""
    if text.strip().lower() == UNCAPPED:
        return None
    return parse_count(text)


CACHE_COUNTERS = {"samples": "samples", "prompt": "prompt_tokens", "cached": "cached_tokens",
                  "reusable": "reusable_tokens"}


def cache_by_engine(raw: dict[bytes, bytes]) -> dict[str, dict[str, int]]:
    """A category's `cache` hash (fields `<engine URL> <counter>`) as {url: {counter: n}}."""
    out: dict[str, dict[str, int]] = {}
    for k, v in raw.items():
        url, _, counter = as_str(k).rpartition(" ")
        row = out.setdefault(url, dict.fromkeys(CACHE_COUNTERS.values(), 0))
        row[CACHE_COUNTERS[counter]] = int(v)
    return dict(sorted(out.items()))


def cap_value(raw: Any) -> int | None:
    """A cap as Redis stores it, back to tokens or None (uncapped)."""
    text = as_str(raw) if raw is not None else "0"
    return None if text == UNCAPPED else int(text or 0)


def now_ms() -> int:
    return int(time.time() * 1000)


def as_str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def prompt_digest(prompt_ids: Sequence[int]) -> str:
    """What two samples with the same prompt token ids share (duplicate_prompt)."""
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=12).hexdigest()


class Entry(NamedTuple):
    """What the ledger holds for one open sample (`Ledger.entries`)."""

    pending: Pending | None
    seq: int
    in_flight: bool


class Unparked(NamedTuple):
    """`FeedingLedger.unpark`'s answer: samples to enqueue again (id, seq), and the prompt
    tokens each counts (count = "total"; 0 otherwise), which its job carries."""

    leased: list[tuple[str, int]]
    prompts: list[int]


class CategoryState(msgspec.Struct, frozen=True):
    """One category's state as the ledger holds it (`Ledger.states`), what the producer
    steers on; `tokencap status --json` shows the same fields (`TelemetryLedger.status`)."""

    cap: int | None  # None: uncapped
    used: int  # tokens counted (committed)
    reserved: int  # tokens reserved by the samples admitted and not yet committed
    worst: int  # the most the admitted samples could still add (hard cap)
    var: int  # variance of the reserved estimates (tokens^2)
    samples: int  # committed
    skipped: int  # fed, not sent because the category closed: sent if its cap is raised
    failed: int
    rejected: int
    waste_tokens: int  # output tokens of the replies kept out of training
    # output tokens of the training rows, and of the replies the reply gate kept out, by
    # reason (with their number): what a trainer can use beside what was counted
    kept_tokens: int
    rejected_tokens: dict[str, int]
    rejected_replies: dict[str, int]
    overshoot: int  # used past the cap
    state: str  # open, closed or exhausted
    pending: int  # in the ledger, not final (queued, parked, in flight)
    in_flight: int  # admitted (at an engine), or unparked and on its way
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
    # per decode mode (`foundation.modes`): committed rows and counted tokens
    modes: dict[str, dict[str, int]] = {}

    @property
    def ended(self) -> bool:
        """At its end: closed, holding back only what its cap holds (parked samples: a
        raised cap sends them), or exhausted with nothing pending."""
        return ((self.state == "closed" and self.pending == self.parked)
                or (self.state == "exhausted" and self.pending == 0))


def mode_counts(raw: Mapping[Any, Any]) -> dict[str, dict[str, int]]:
    """A category's `modes` hash (`<mode> rows`, `<mode> tokens`) as {mode: {rows, tokens}}."""
    out: dict[str, dict[str, int]] = {}
    for field, value in raw.items():
        mode, _, counter = as_str(field).rpartition(" ")
        out.setdefault(mode, {"rows": 0, "tokens": 0})[counter] = int(value)
    return dict(sorted(out.items()))


def run_ended(states: Mapping[str, CategoryState], unwritten: int) -> bool:
    """The run's end, decided here only: every category ended (`CategoryState.ended`) and
    nothing left for the writer (`unwritten`: results and dead letters not on disk). The
    producer stops feeding on it; `tokencap up` exits 0 on it (`RunStatus.ended`)."""
    return all(st.ended for st in states.values()) and unwritten == 0


class Ledger:
    """One run's keys and scripts, and the reads every role shares."""

    def __init__(self, redis: Redis, keys: Keys, scripts: Scripts | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.scripts = scripts or Scripts(redis)

    def _ck(self, category: str) -> CategoryKeys:
        return self.keys.cat(category)

    def _close(self, script: Script, category: str, *args: Any
               ) -> tuple[bool, bool, int | None]:
        """Run one of the scripts that set `closed` / `exhausted` (`set_cap.lua`,
        `exhausted.lua`): (closed, exhausted, the cap before)."""
        closed, exhausted, old = script(keys=self._ck(category), args=list(args))
        return as_str(closed) == "1", as_str(exhausted) == "1", cap_value(old)

    def load_config(self) -> RunConfig | None:
        raw = self.redis.hget(self.keys.meta, "config")
        return config_from_json(raw.encode() if isinstance(raw, str) else raw) if raw else None

    def has_run(self) -> bool:
        return bool(self.redis.exists(self.keys.meta))

    def states(self, categories: Sequence[str]) -> dict[str, CategoryState]:
        """Each category's state, typed (what the producer steers on), in one round trip."""
        return self._states(categories, by_engine=False, run=False)[0]

    def _states(self, categories: Sequence[str], by_engine: bool, run: bool = True
                ) -> tuple[dict[str, CategoryState], list[Any]]:
        """The categories' states, and (with `by_engine`) their raw per-engine cache hashes,
        then (with `run`; else None each) the writer lock holder, the writer's state, the
        engines' info, their trouble and a hidden-state stage's disk trouble (raw): the
        producer's tick needs none of those."""
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
            pipe.hgetall(ck.modes)
            if by_engine:
                pipe.hgetall(ck.cache)
        if run:
            pipe.get(self.keys.writer_lock)
            pipe.hgetall(self.keys.writer_state)
            pipe.hgetall(self.keys.engine_info)
            pipe.hgetall(self.keys.engine_trouble)
            pipe.hgetall(self.keys.disk_trouble)
        raw = pipe.execute()
        holder = wstate = engines_raw = trouble_raw = disk_raw = None
        if run:
            *raw, holder, wstate, engines_raw, trouble_raw, disk_raw = raw
        per = 10 if by_engine else 9
        states: dict[str, CategoryState] = {}
        extra: list[Any] = []
        for i, name in enumerate(categories):
            vals, pending, inflight, parked, reasons, results, dead, follow, modes = \
                raw[per * i : per * i + 9]
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
                waste_tokens=int(st["waste"]), kept_tokens=int(st["kept"]),
                rejected_tokens={r: int(st[f"gated:{r}"]) for r in GATE_REASONS
                                 if st[f"gated_n:{r}"] != "0"},
                rejected_replies={r: int(st[f"gated_n:{r}"]) for r in GATE_REASONS
                                  if st[f"gated_n:{r}"] != "0"},
                overshoot=0 if cap is None else max(0, used - cap), state=state,
                pending=int(pending), in_flight=int(inflight), parked=int(parked),
                followups=int(follow), duplicate_prompts=int(st["dup_prompts"]),
                reasons={as_str(k): int(v) for k, v in sorted(reasons.items())},
                unwritten=int(results) + int(dead), out_of_vocab=int(st["oov"]),
                prompt_tokens=int(st["prompt"]), cached_tokens=int(st["cached"]),
                reusable_tokens=int(st["reusable"]), modes=mode_counts(modes))
            if by_engine:
                extra.append(raw[per * i + 9])
        return states, [extra, holder, wstate, engines_raw, trouble_raw, disk_raw]

    def hist(self, category: str) -> dict[int, int]:
        raw = self.redis.hgetall(self._ck(category).hist)
        return {int(k): int(v) for k, v in raw.items()}

    def _per_sample(self, sample_ids: Sequence[str],
                    *reads: Callable[[Pipeline, str], object]) -> list[list[Any]]:
        """For each of `sample_ids`, what each of `reads` (a command on one sample, queued on
        a pipeline) answers; all in one round trip."""
        if not sample_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for sid in sample_ids:
            for read in reads:
                read(pipe, sid)
        raw = pipe.execute()
        return [raw[i : i + len(reads)] for i in range(0, len(raw), len(reads))]

    def entries(self, category: str, sample_ids: Sequence[str]) -> list[Entry]:
        """What the ledger holds for each of `sample_ids`, in one round trip."""
        ck = self._ck(category)
        answers = self._per_sample(sample_ids, lambda p, s: p.hget(ck.pending, s),
                                   lambda p, s: p.hget(ck.seq, s),
                                   lambda p, s: p.hexists(ck.reserved, s))
        return [Entry(msgspec.json.decode(payload, type=Pending) if payload else None,
                      int(seq or 0), bool(in_flight)) for payload, seq, in_flight in answers]

    def retried(self, category: str) -> set[str]:
        """Samples sent again by `retry` (their dead letters on disk are history)."""
        return {as_str(v) for v in self.redis.smembers(self._ck(category).retried)}

    def unwritten(self, categories: Iterable[str]) -> int:
        """Stream entries the writer has not written and acknowledged yet, over `categories`."""
        pipe = self.redis.pipeline(transaction=False)
        for name in categories:
            ck = self._ck(name)
            pipe.xlen(ck.results)
            pipe.xlen(ck.dead)
        return int(sum(pipe.execute()))
