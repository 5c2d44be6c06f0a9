"""The RQ job: admit -> `/generate` with `input_ids` -> validate -> commit.

`process` is the only function a tokencap worker runs. Its argument is a `JobRef` (msgspec
JSON); the prompt comes from the category ledger in the same Lua call that admits it.
Per-process state (Redis client, engine client, length models) lives in a `Context` set up
by the worker at start, or from the environment at first call, never at import.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from typing import Any, NamedTuple

import msgspec

from budget_service.estimator import (
    LengthModel,
    admission,
    counted_prompt,
    counted_tokens,
    waste_tokens,
)
from budget_service.keys import Keys
from budget_service.ledger import now_ms
from budget_service.samples import SampleLedger
from consumers import extract
from consumers.client import EngineClient, EngineError, Generation
from foundation import gate
from foundation.config import DEFAULT_KEY_PREFIX, Category, RunConfig
from foundation.engine.api import BACKOFF_FACTOR_S, BACKOFF_JITTER_S, parse_urls
from foundation.errors import RunNotFound
from foundation.modes import most_new_tokens
from foundation.redisconn import DEFAULT_REDIS_URL, connect
from foundation.wire import DeadLetter, JobRef, Outcome, Pending, Result

log = logging.getLogger(__name__)
MODEL_REFRESH_S = 5.0
DEFAULT_DECODE_TOK_S = 20.0  # per-request decode rate assumed before any commit
RETRY_DELAY_S = 2.0
IDLE_WAKE_S = 2.0  # the heartbeat thread's wake-up while no sample is in flight


class RunContext:
    """What a worker process caches for one run."""

    def __init__(self, ledger: SampleLedger, cfg: RunConfig, engines: list[str]) -> None:
        self.ledger = ledger
        self.cfg = cfg
        self.client = EngineClient(
            engines,
            connect_timeout_s=cfg.connect_timeout_s,
            read_timeout_s=cfg.read_timeout(),
            retries=cfg.http_retries,
            backoff_max_s=cfg.backoff_max_s,
            adaptive_max_queue=cfg.adaptive_max_queue,
        )
        self._models: dict[str, tuple[float, LengthModel, float]] = {}
        self.beat_s = min(cfg.heartbeat_s, cfg.lease_s / 3)

    def model(self, cat: Category) -> tuple[LengthModel, float]:
        """(length model, per-request decode tok/s), refreshed every MODEL_REFRESH_S."""
        hit = self._models.get(cat.name)
        now = time.monotonic()
        if hit is None or now - hit[0] > MODEL_REFRESH_S:
            keys = self.ledger.keys.cat(cat.name)
            pipe = self.ledger.redis.pipeline(transaction=False)
            pipe.hgetall(keys.hist)
            pipe.hget(keys.state, "rate")
            raw, rate = pipe.execute()
            model = LengthModel.from_redis(
                raw, self.cfg.expected_for(cat), most_new_tokens(cat)
            )
            hit = (now, model, float(rate) if rate else DEFAULT_DECODE_TOK_S)
            self._models[cat.name] = hit
        return hit[1], hit[2]


class Context:
    """Per-process: one Redis connection, engine URLs, and a RunContext per run."""

    def __init__(self, redis_url: str, engines: list[str],
                 prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.redis_url = redis_url
        self.engines = engines
        self.redis = connect(redis_url)
        self._runs: dict[tuple[str, str], RunContext] = {}
        self.prefix = prefix

    def run(self, run: str) -> RunContext:
        key = (self.prefix, run)
        if key not in self._runs:
            ledger = SampleLedger(self.redis, Keys(self.prefix, run))
            cfg = ledger.load_config()
            if cfg is None:
                raise RunNotFound(f"run {run!r} not found in Redis (prefix {self.prefix!r})")
            self._runs[key] = RunContext(ledger, cfg, self.engines)
        return self._runs[key]


_ctx: Context | None = None


def configure(redis_url: str, engines: list[str], prefix: str = DEFAULT_KEY_PREFIX) -> Context:
    """Set this process's context (the worker calls it once at start)."""
    global _ctx
    _ctx = Context(redis_url, engines, prefix)
    return _ctx


def flush_stats() -> None:
    """Write this process's remaining engine counters (on the way out)."""
    if _ctx is None:
        return
    for rc in _ctx._runs.values():
        try:
            rc.client.stats.flush(rc.ledger, force=True)
        except Exception as exc:  # exiting anyway: the counters are best effort
            log.warning("could not flush engine counters: %s", exc)


def _context() -> Context:
    if _ctx is None:
        return configure(os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                         parse_urls(os.environ.get("SGLANG_URL")),
                         os.environ.get("TOKENCAP_PREFIX", DEFAULT_KEY_PREFIX))
    return _ctx


class _Beat(NamedTuple):
    rc: RunContext
    cat: Category
    sample_id: str
    extra: int
    t0: float


class _Heartbeat:
    """One daemon thread per process. Every `heartbeat_s` (at most a third of `lease_s`) it
    extends the lease of the sample in flight and moves its reservation to E[L | L > g],
    g = (elapsed + heartbeat_s) x per-request decode rate: its progress by the next beat.
    Started once and reused by every job (a thread per job costs more than the job's own
    Redis calls)."""

    def __init__(self) -> None:
        self._current: _Beat | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = -1

    def track(self, beat: _Beat | None) -> None:
        self._current = beat
        if beat is not None and (self._thread is None or self._pid != os.getpid()
                                 or not self._thread.is_alive()):
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")
            self._thread.start()

    def _run(self) -> None:
        while True:
            beat = self._current
            self._wake.wait(IDLE_WAKE_S if beat is None else beat.rc.beat_s)
            beat = self._current
            if beat is None:
                continue
            try:
                self.send(beat)
            except Exception as exc:  # a missed beat only shortens the lease
                log.warning("heartbeat failed for %s/%s: %s", beat.cat.name, beat.sample_id,
                            exc)

    @staticmethod
    def send(beat: _Beat) -> None:
        """One beat: extend the lease, move the reservation to E[L | L > g] and its variance,
        g = the sample's progress by the next beat. Until then the reservation cannot move,
        and E[L | L > g] only grows with g: a sample still running at the next beat is not
        under-reserved in between (one that finishes first releases its reservation)."""
        model, rate = beat.rc.model(beat.cat)
        progressed = (time.monotonic() - beat.t0 + beat.rc.beat_s) * rate
        est, var = model.moments(progressed)
        beat.rc.ledger.heartbeat(beat.cat.name, beat.sample_id, est + beat.extra,
                                 beat.rc.cfg.lease_ms, var)


_heartbeat = _Heartbeat()


def admit(ledger: SampleLedger, cfg: RunConfig, cat: Category, model: LengthModel,
          job: JobRef) -> tuple[str, Pending | None]:
    """Admission of the job's sample: the ask the producer's unpark makes too
    (`estimator.admission`), plus the prompt tokens the sample counts."""
    ask = admission(cfg, cat, model)
    return ledger.admit(cat.name, job.sample_id, ask.estimate, cfg.lease_ms,
                        ask.max_add, ask.variance, ask.sigmas, job.seq, ask.max_unwritten,
                        counted_prompt(cfg, job.prompt_tokens))


def process(ref: dict[str, Any]) -> str:
    """Run one sample. Returns the outcome: committed, dup, done, closed, wait, stale,
    released, rejected, dead or unknown."""
    job = msgspec.convert(ref, JobRef)
    rc = _context().run(job.run)
    cat = rc.cfg.by_name(job.category)
    ledger = rc.ledger
    extra = counted_prompt(rc.cfg, job.prompt_tokens)
    model, rate = rc.model(cat)
    status, pending = admit(ledger, rc.cfg, cat, model, job)
    if status != "ok":
        log.debug("%s/%s not sent: %s", cat.name, job.sample_id, status)
        return status
    assert pending is not None
    _heartbeat.track(_Beat(rc, cat, job.sample_id, extra, time.monotonic()))
    sent_at_ms = now_ms()
    if rc.cfg.stage == "hidden_states":
        return _extract(rc, cat, pending, rate, sent_at_ms)
    try:
        gen = rc.client.generate(pending.prompt_ids, pending.sampling, cat.name, rate,
                                 prefer=pending.prefer_engine, affinity=pending.affinity)
    except EngineError as exc:
        return _failed(rc, cat, pending, exc)
    finally:
        _heartbeat.track(None)
        rc.client.stats.flush(ledger)
    return _commit(rc, cat, pending, gen, sent_at_ms)


def _extract(rc: RunContext, cat: Category, p: Pending, rate: float, sent_at_ms: int) -> str:
    """The hidden-state stage's step (`consumers/extract.py`): a valid file already kept for
    the row counts as it is; else, where the states folder has room, the engine extracts
    it; where it has none, the sample waits (`_pause`)."""
    spec = rc.cfg.states()
    gen = None
    try:
        path = extract.row_file(rc.cfg, cat.name, p)
        row = str(p.row_id)
        desc = extract.kept(path, spec, p.prompt_ids, rc.cfg.output_dir, row)
        if desc is None:
            extract.room_for(path, len(p.prompt_ids), spec)
            marker = extract.request_marker(rc.cfg, path)
            gen = rc.client.generate(p.prompt_ids, extract.EXTRACT_SAMPLING, cat.name, rate,
                                     prefer=p.prefer_engine, affinity=p.affinity,
                                     rid_prefix=marker)
            desc = extract.take(gen, path, spec, p.prompt_ids, row, rc.cfg.output_dir,
                                marker)
    except extract.StatesDiskFull as exc:
        return _pause(rc, cat, p, exc)
    except EngineError as exc:
        return _failed(rc, cat, p, exc)
    finally:
        _heartbeat.track(None)
        rc.client.stats.flush(rc.ledger)
    if gen is not None:  # a file kept: its folder has room, whoever saw it full
        _room_again(rc, str(path.parent))
    status, used = rc.ledger.commit(extract.result(p, rc.cfg, cat.name, desc, gen, sent_at_ms),
                                    0, 0.0)
    log.debug("%s/%s %s: states of %d tokens, used %d", cat.name, p.sample_id, status,
              len(p.prompt_ids), used)
    return "committed" if status == "ok" else status


# the runs whose states folder this worker found full (said once a pause)
_disk_pauses: set[str] = set()
# per states folder, when this worker last cleared its disk trouble (monotonic s)
_trouble_cleared: dict[str, float] = {}
TROUBLE_CLEAR_S = 2.0


def _room_again(rc: RunContext, folder: str) -> None:
    """A file kept in `folder`: its disk trouble cleared (`record_disk_trouble`), at once by
    a worker that saw the pause, else at most every TROUBLE_CLEAR_S (a pause another worker
    saw shows in status that much longer): a call for every row cost a round trip as long
    as the commit's."""
    now = time.monotonic()
    if rc.cfg.run in _disk_pauses or now - _trouble_cleared.get(folder, -math.inf) \
            >= TROUBLE_CLEAR_S:
        rc.ledger.record_disk_trouble(folder, None, now_ms())
        _trouble_cleared[folder] = now
        _disk_pauses.discard(rc.cfg.run)


DISK_PAUSE_MAX_S = 60.0


def disk_pause_s(age_s: float, jitter: float | None = None) -> float:
    """How long a sample waits when the states folder has been full for `age_s` (the pause's
    age, shared by every worker through its record in Redis): half that age, at least
    BACKOFF_FACTOR_S x 2 and at most DISK_PAUSE_MAX_S, plus the client's jitter: the
    longer the disk stays full, the more seldom it is tried."""
    extra = random.random() * BACKOFF_JITTER_S if jitter is None else jitter
    return min(DISK_PAUSE_MAX_S, max(2 * BACKOFF_FACTOR_S, age_s / 2)) + extra


def _pause(rc: RunContext, cat: Category, p: Pending, exc: extract.StatesDiskFull) -> str:
    """A full states folder: the sample goes back, not counted as a failed attempt, to be
    taken again after `disk_pause_s`, and the pause is recorded where status and the stage's
    lines read it (`SampleLedger.record_disk_trouble`)."""
    at = now_ms()
    since = rc.ledger.record_disk_trouble(str(exc.folder), str(exc), at)
    wait_s = disk_pause_s((at - since) / 1000)
    if rc.cfg.run not in _disk_pauses:
        log.warning("%s/%s: the hidden-state stage pauses: %s", cat.name, p.sample_id, exc)
    _disk_pauses.add(rc.cfg.run)
    log.info("%s/%s waits %.1f s for room", cat.name, p.sample_id, wait_s)
    rc.ledger.release(cat.name, p, at + int(wait_s * 1000))
    return "released"


def _failed(rc: RunContext, cat: Category, p: Pending, exc: EngineError) -> str:
    failures = p.failures + 1
    if not exc.retryable or failures >= rc.cfg.max_attempts:
        outcome = Outcome.DEAD if exc.retryable else Outcome.REJECTED
        log.warning("%s/%s %s after %d attempt(s): %s", cat.name, p.sample_id, outcome,
                    failures, exc)
        rc.ledger.fail(DeadLetter.of(p, cat.name, outcome, exc.kind.value, str(exc), failures))
        return outcome
    log.info("%s/%s attempt %d failed (%s), will retry: %s", cat.name, p.sample_id, failures,
             exc.kind.value, exc)
    retry_at = now_ms() + int(RETRY_DELAY_S * 1000 * failures)
    rc.ledger.release(cat.name, msgspec.structs.replace(p, failures=failures), retry_at)
    return "released"


def _out_of_vocab(ids: list[int], cfg: RunConfig) -> int:
    """How many of `ids` lie past the tokenizer's vocabulary (`vocab_size`, which the producer
    stores from the tokenizer; unknown: none counted)."""
    if cfg.vocab_size is None:
        return 0
    return sum(1 for t in ids if t >= cfg.vocab_size)


def gate_of(cfg: RunConfig, p: Pending, gen: Generation) -> str:
    """Why the reply gate keeps `gen` out of training ("" when it is a training row); with
    the gate off, nothing is (`reply_gate = false`: every reply a row, as before the gate)."""
    if not cfg.reply_gate:
        return ""
    return gate.check(gen.output_ids, gen.finish_reason, cfg.reply_markers, p.prompt_ids) or ""


def _commit(rc: RunContext, cat: Category, p: Pending, gen: Generation, sent_at_ms: int) -> str:
    reason = gate_of(rc.cfg, p, gen)
    counted = counted_tokens(rc.cfg, gen.completion_tokens, gen.prompt_tokens, reason,
                             gen.finish_reason)
    waste = waste_tokens(gen.completion_tokens, reason, gen.finish_reason)
    result = Result(
        id=p.sample_id, category=cat.name, prompt_ids=p.prompt_ids, output_ids=gen.output_ids,
        prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
        finish_reason=gen.finish_reason, text=gen.text, sampling=p.sampling,
        counted_tokens=counted, ordinal=p.ordinal, source_id=p.source_id, where=p.where,
        finish=gen.finish, engine=gen.engine, latency_s=round(gen.latency_s, 4),
        fed_at_ms=p.fed_at_ms, sent_at_ms=sent_at_ms,
        conversation_id=p.conversation_id, turn=p.turn, turns_total=p.turns_total,
        model=gen.model, engine_version=gen.engine_version, simulated=gen.simulated,
        prefix_consistent=p.prefix_consistent, history_notes=p.history_notes,
        cached_tokens=gen.cached_tokens, reusable_tokens=p.reusable_tokens,
        out_of_vocab=_out_of_vocab(gen.output_ids, rc.cfg), gate=reason,
        tool_args_match=p.tool_args_match, made_by=rc.cfg.made_by, mode=p.mode,
        chat_template_kwargs=p.chat_template_kwargs,
    )
    rate = gen.completion_tokens / gen.latency_s if gen.latency_s > 0 else 0.0
    status, used = rc.ledger.commit(result, waste, rate)
    log.debug("%s/%s %s: %d tokens, used %d", cat.name, p.sample_id, status, counted, used)
    return "committed" if status == "ok" else status
