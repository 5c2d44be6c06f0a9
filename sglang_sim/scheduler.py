"""Continuous-batching model of an SGLang scheduler, with no HTTP and no GPU.

Model
-----
- A FIFO waiting queue feeds a running batch. The head of the queue is admitted while the
  batch has fewer than ``max_running_requests`` and the KV pool has room for its prompt (plus
  tokens already generated, for a retracted request) plus a headroom: ``min(
  admit_headroom_tokens, tokens it may still generate)``, and at least one token per request
  for the next step. The head blocks the queue: no request overtakes it.
- A running request holds ``prompt_tokens + generated`` KV slots and gains one token per
  decode step. A step takes ``decode_base_s + decode_per_req_s * batch`` simulated seconds.
- Admitting requests costs ``prefill_s_per_token`` per prompt (and re-prefilled) token, paid
  before decoding resumes; a prompt's prefix found in the prefix cache (`prefix_cache`) is not
  prefilled on its first admission.
- When the next step would overflow the KV pool, the most recently admitted request is
  retracted to the front of the queue (it keeps its tokens and is re-prefilled later), as
  SGLang does under memory pressure.
- Aborting a queued request finishes it at once; aborting a running one lets it run one more
  step (SGLang's behaviour), then finishes it with its partial output.

Time is event driven, not ticked. The simulated clock is wall time x ``time_scale``, minus
the time spent paused (:meth:`Engine.pause` lets a benchmark queue a whole load at one
simulated instant). Between events the batch is constant, so the engine computes how many
whole steps remain until the next request finishes (or the KV pool fills), sleeps that long
(scaled) and wakes early on arrival or abort. On every wake-up :meth:`Engine._advance_to`
replays the simulated timeline up to "now" event by event, so the simulated throughput does
not depend on event-loop lag.
All methods must be called from the event loop that runs :meth:`Engine.run`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_sim.config import SimConfig
from sglang_sim.counters import Counters
from sglang_sim.jobs import (
    ABORT_RUNNING,
    ABORT_WAITING,
    Completion,
    DuplicateRidError,
    Job,
    QueueFullError,
)

logger = logging.getLogger(__name__)

# Upper bound of the carried fraction of a decode step (rounding can push it past one).
_MAX_STEP_FRACTION = 1.0


@dataclass
class _Req:
    job: Job
    future: asyncio.Future[Completion]
    arrival_wall_s: float
    arrival_sim_s: float
    generated: int = 0
    stop_at: int = 0
    abort_reason: dict[str, Any] | None = None
    retractions: int = 0

    def kv_tokens(self) -> int:
        return self.job.prompt_tokens + self.generated


class Engine:
    """The continuous-batching simulator. See the module docstring for the model."""

    def __init__(self, config: SimConfig) -> None:
        config.validate()
        self.config = config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wall0_s = 0.0
        self._t = 0.0  # simulated time processed so far, seconds
        self._stats_t0 = 0.0
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._by_rid: dict[str, _Req] = {}
        self._kv_used = 0
        self._pending_prefill_s = 0.0
        self._step_fraction = 0.0
        self._counters = Counters()
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._closed = False
        self._paused_since_s: float | None = None  # wall time the clock was paused at
        self._paused_total_s = 0.0  # wall seconds spent paused before

    # ----- clock -------------------------------------------------------------------------

    def _now_wall(self) -> float:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._wall0_s = self._loop.time()
        return self._loop.time() - self._wall0_s

    def _now_sim(self) -> float:
        wall = self._now_wall() if self._paused_since_s is None else self._paused_since_s
        return (wall - self._paused_total_s) * self.config.time_scale

    def step_s(self, batch: int) -> float:
        """Simulated seconds of one decode step with ``batch`` running requests."""
        return self.config.decode_base_s + self.config.decode_per_req_s * batch

    # ----- public API --------------------------------------------------------------------

    async def run(self) -> None:
        """Drive the simulation until :meth:`close`; run it as a task on the serving loop."""
        self._now_wall()
        while not self._closed:
            self._wake.clear()
            self._advance_to(self._now_sim())
            await self._notify()
            delay_sim_s = None if self.paused else self._time_to_next_event_s()
            timeout_s = None if delay_sim_s is None else delay_sim_s / self.config.time_scale
            try:
                await asyncio.wait_for(self._wake.wait(), timeout_s)
            except TimeoutError:
                pass

    @property
    def paused(self) -> bool:
        return self._paused_since_s is not None

    def pause(self) -> None:
        """Freeze the simulated clock; requests are still accepted (and admitted)."""
        if self._paused_since_s is None:
            self._advance_to(self._now_sim())
            self._paused_since_s = self._now_wall()
            self._wake.set()

    def resume(self) -> None:
        """Restart the simulated clock where :meth:`pause` froze it."""
        if self._paused_since_s is not None:
            self._paused_total_s += self._now_wall() - self._paused_since_s
            self._paused_since_s = None
            self._wake.set()

    def close(self) -> None:
        """Stop the loop and abort everything in flight."""
        self._closed = True
        for req in self._waiting:
            self._finish(req, ABORT_WAITING, aborted=True)
        for req in self._running:
            self._finish(req, ABORT_RUNNING, aborted=True)
        self._waiting.clear()
        self._running.clear()
        self._wake.set()

    async def generate(self, job: Job) -> Completion:
        """Queue ``job`` and wait for it to finish.

        Raises QueueFullError or DuplicateRidError at once. If the awaiting task is
        cancelled (the HTTP client went away), the request is aborted, as in SGLang.
        """
        future = self.submit(job)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self.abort(job.rid, exact=True)
            raise

    def submit(self, job: Job) -> asyncio.Future[Completion]:
        """Queue ``job``; the returned future resolves with its :class:`Completion`."""
        if self._closed:
            raise RuntimeError("engine is closed")
        self._advance_to(self._now_sim())
        if job.rid in self._by_rid:
            raise DuplicateRidError(job.rid)
        limit = self.config.max_queued_requests
        if limit is not None and len(self._waiting) + 1 > limit:
            self._counters.rejected_queue_full_total += 1
            raise QueueFullError(job.rid)
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        req = _Req(job, future, self._now_wall(), self._t, stop_at=job.target_tokens)
        self._by_rid[job.rid] = req
        self._waiting.append(req)
        self._counters.submitted_total += 1
        self._admit()
        self._wake.set()
        return future

    def abort(self, rid: str = "", *, abort_all: bool = False, exact: bool = False) -> int:
        """Abort requests whose rid starts with ``rid`` (or equals it when ``exact``).

        An empty ``rid`` without ``abort_all`` matches nothing (SGLang ignores it). Returns
        how many requests were found.
        """
        if not rid and not abort_all:
            return 0
        self._advance_to(self._now_sim())

        def matches(req: _Req) -> bool:
            if abort_all:
                return True
            return req.job.rid == rid if exact else req.job.rid.startswith(rid)

        found = 0
        for req in [r for r in self._waiting if matches(r)]:
            self._waiting.remove(req)
            self._finish(req, ABORT_WAITING, aborted=True)
            found += 1
        for req in self._running:
            if matches(req) and req.abort_reason is None:
                req.abort_reason = ABORT_RUNNING
                req.stop_at = min(req.stop_at, req.generated + 1)
                found += 1
        self._wake.set()
        return found

    def stats(self) -> dict[str, Any]:
        """Gauges, counters and histograms, brought up to date first; the ``/_sim/stats`` body."""
        if self._loop is not None:
            self._advance_to(self._now_sim())
        return {
            "simulator": True,
            "time_scale": self.config.time_scale,
            "paused": self.paused,
            "running": len(self._running),
            "queued": len(self._waiting),
            "kv_used_tokens": self._kv_used,
            "max_total_tokens": self.config.max_total_tokens,
            "token_usage": self._kv_used / self.config.max_total_tokens,
            "decode_tok_per_sim_s": self.decode_rate_tok_per_sim_s(),
            **self._counters.snapshot(self._t - self._stats_t0),
        }

    def reset_stats(self) -> None:
        """Zero the counters and histograms; requests in flight are untouched."""
        if self._loop is not None:
            self._advance_to(self._now_sim())
        self._counters = Counters()
        self._stats_t0 = self._t

    def decode_rate_tok_per_sim_s(self) -> float:
        """Instantaneous decode throughput of the current batch, tokens per simulated s."""
        batch = len(self._running)
        return batch / self.step_s(batch) if batch else 0.0

    @property
    def closed(self) -> bool:
        return self._closed

    def is_idle(self) -> bool:
        return not self._running and not self._waiting

    def pending_prompt_tokens(self) -> int:
        return sum(r.kv_tokens() for r in self._waiting)

    async def wait_until(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float
    ) -> dict[str, Any]:
        """Wait, without polling, until ``predicate(self.stats())`` holds; return the stats.

        Raises TimeoutError after ``timeout_s`` wall seconds.
        """

        async def _wait() -> dict[str, Any]:
            async with self._changed:
                while True:
                    snapshot = self.stats()
                    if predicate(snapshot):
                        return snapshot
                    await self._changed.wait()

        return await asyncio.wait_for(_wait(), timeout_s)

    # ----- simulation --------------------------------------------------------------------

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _admit(self) -> None:
        cfg = self.config
        while self._waiting and len(self._running) < cfg.max_running_requests:
            req = self._waiting[0]
            may_generate = req.job.max_new_tokens - req.generated
            headroom = min(cfg.admit_headroom_tokens, max(0, may_generate))
            # Also leave room for the next decode step, so admission never forces a retraction.
            headroom = max(headroom, len(self._running) + 1)
            if self._kv_used + req.kv_tokens() + headroom > cfg.max_total_tokens:
                break
            self._waiting.popleft()
            # the prefix cache spares a first admission its cached prefix (not a re-prefill)
            cached = req.job.cached_tokens if req.retractions == 0 else 0
            self._pending_prefill_s += cfg.prefill_s_per_token * (req.kv_tokens() - cached)
            if req.generated >= req.stop_at:  # max_new_tokens == 0: prefill only
                self._finish(req, req.job.finish_reason, aborted=False)
                continue
            self._running.append(req)
            self._kv_used += req.kv_tokens()

    def _make_kv_room(self) -> None:
        """Retract the newest running requests until one more step fits in the KV pool."""
        while len(self._running) > 1 and (
            self._kv_used + len(self._running) > self.config.max_total_tokens
        ):
            req = self._running.pop()
            self._kv_used -= req.kv_tokens()
            req.retractions += 1
            self._counters.retractions_total += 1
            self._waiting.appendleft(req)
            logger.debug("retracted %s at %d tokens (KV pool full)", req.job.rid, req.generated)

    def _steps_to_next_event(self) -> int:
        batch = len(self._running)
        to_finish = min(r.stop_at - r.generated for r in self._running)
        to_full = (self.config.max_total_tokens - self._kv_used) // batch
        return max(1, min(to_finish, to_full))

    def _time_to_next_event_s(self) -> float | None:
        """Simulated seconds until the next finish or KV-full event; None when idle."""
        if not self._running:
            return None
        steps = self._steps_to_next_event()
        step = self.step_s(len(self._running))
        return max(0.0, self._pending_prefill_s + (steps - self._step_fraction) * step)

    def _advance_to(self, t_target: float) -> None:
        """Replay the simulated timeline up to ``t_target``, then admit what fits now."""
        self._replay(t_target)
        self._admit()
        if self._running:
            self._make_kv_room()

    def _replay(self, t_target: float) -> None:
        while self._t < t_target:
            self._admit()
            if not self._running:
                self._counters.batch_sim_s[0] += t_target - self._t
                self._t = t_target
                return
            self._make_kv_room()
            batch = len(self._running)
            step = self.step_s(batch)
            steps = self._steps_to_next_event()
            dt_event = self._pending_prefill_s + (steps - self._step_fraction) * step
            available = t_target - self._t
            if dt_event <= available:
                self._counters.batch_sim_s[batch] += dt_event
                self._t += dt_event
                self._pending_prefill_s = 0.0
                self._step_fraction = 0.0
                self._decode(steps)
                continue
            self._counters.batch_sim_s[batch] += available
            self._t = t_target
            paid = min(self._pending_prefill_s, available)
            self._pending_prefill_s -= paid
            progress = self._step_fraction + (available - paid) / step
            whole = min(int(progress), steps - 1)
            self._step_fraction = min(progress - whole, _MAX_STEP_FRACTION)
            if whole:
                self._decode(whole)
            return

    def _decode(self, steps: int) -> None:
        batch = len(self._running)
        tokens = batch * steps
        self._kv_used += tokens
        self._counters.generated_tokens_total += tokens
        self._counters.decode_steps_total += steps
        self._counters.batch_tokens[batch] += tokens
        still_running: list[_Req] = []
        for req in self._running:
            req.generated += steps
            if req.generated >= req.stop_at:
                self._kv_used -= req.kv_tokens()
                natural = req.generated >= req.job.target_tokens
                reason = req.job.finish_reason if natural else req.abort_reason or ABORT_RUNNING
                self._finish(req, reason, aborted=not natural)
            else:
                still_running.append(req)
        self._running = still_running

    def _finish(self, req: _Req, reason: dict[str, Any], *, aborted: bool) -> None:
        self._by_rid.pop(req.job.rid, None)
        c = self._counters
        c.finished_total += 1
        c.aborted_total += int(aborted)
        c.finished_prompt_tokens_total += req.job.prompt_tokens
        c.finished_completion_tokens_total += req.generated
        if req.future.done():
            return
        req.future.set_result(
            Completion(
                rid=req.job.rid,
                prompt_tokens=req.job.prompt_tokens,
                completion_tokens=req.generated,
                finish_reason=reason,
                e2e_latency_s=self._now_wall() - req.arrival_wall_s,
                sim_latency_s=self._t - req.arrival_sim_s,
                num_retractions=req.retractions,
            )
        )
