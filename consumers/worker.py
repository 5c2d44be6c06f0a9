"""The tokencap worker: an RQ `SimpleWorker` that runs only tokencap's job function and
reads only msgspec JSON payloads.

A job is refused whole unless every field of it that RQ could act on is what the producer
sets (`budget_service.jobs.refusal`): the function and its one `JobRef` argument, no
callbacks, no webhooks, no dependencies, no retries or repeats, tokencap's result and
failure TTLs. A refused job runs
nothing: no callback, no webhook, no retry; it is recorded once in the run's refused stream
(with the field at fault) and deleted.

`SimpleWorker` keeps one process (and one HTTP keep-alive session) across jobs; its lack of
RQ heartbeats during a job is covered by tokencap's own lease, extended by the job's
heartbeat thread, and by the producer's reaper.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from redis import Redis
from redis.exceptions import RedisError
from rq import Queue
from rq.job import Job
from rq.worker import DequeueStrategy, SimpleWorker

from budget_service import jobs
from budget_service.keys import Keys
from budget_service.samples import SampleLedger
from foundation.backoff import Backoff
from foundation.errors import TokencapError

log = logging.getLogger(__name__)

RESTART_BACKOFF_MIN_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
# RQ beats the worker key three times per job loop (before and after the dequeue, after the
# job), three round trips each, on top of the beat it pipelines into its suspension check.
# A beat that only repeats one sent less than this long ago (same TTL) is skipped: the key's
# expiry moves by at most this much out of its ~480 s.
WORKER_BEAT_MIN_S = 1.0


class TokencapWorker(SimpleWorker):
    """Runs a job only if `jobs.refusal` finds nothing in it; refuses the rest whole."""

    keys: Keys  # the run's keys (set by make_worker): refusals are recorded under them
    _beat_sent_at = float("-inf")

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's worker heartbeat, in one round trip instead of three, and not repeated
        within WORKER_BEAT_MIN_S (`rq info` still shows a beat at most that old)."""
        if pipeline is not None:
            super().heartbeat(timeout, pipeline=pipeline)
            self._beat_sent_at = time.monotonic()
            return
        if timeout is None and time.monotonic() - self._beat_sent_at < WORKER_BEAT_MIN_S:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            super().heartbeat(timeout, pipeline=pipe)
            pipe.execute()
        self._beat_sent_at = time.monotonic()

    def execute_job(self, job: Job, queue: Queue) -> None:
        reason = jobs.refusal(job)
        if reason is None:
            super().execute_job(job, queue)
        else:
            self._refuse(job, queue, reason)

    def _refuse(self, job: Job, queue: Queue, reason: str) -> None:
        """Record the job once and delete it: none of RQ's failure handling runs (it would
        call the job's failure callback, post its webhooks, or retry it)."""
        log.error("refused job %s from queue %s: %s", job.id, queue.name, reason)
        record = {"job_id": job.id, "queue": queue.name, "reason": reason, "ts": time.time()}
        SampleLedger(self.connection, self.keys).refuse(record)
        jobs.drop(self.connection, queue, job)


def make_worker(redis: Redis, keys: Keys, categories: list[str], name: str | None = None,
                worker_class: type[TokencapWorker] = TokencapWorker) -> TokencapWorker:
    """A worker on the run's category queues (round robin)."""
    worker = worker_class(jobs.queues(redis, keys, categories), connection=redis,
                          serializer=jobs.MsgspecSerializer, name=name)
    worker.keys = keys
    return worker


def run_worker(worker: TokencapWorker, *, burst: bool = False) -> bool:
    return bool(worker.work(
        burst=burst, dequeue_strategy=DequeueStrategy.ROUND_ROBIN, with_scheduler=False,
        logging_level="WARNING",
    ))


def supervise(connect: Callable[[], Redis], keys: Keys, categories: list[str],
              name: str | None = None, *, burst: bool = False) -> int:
    """Run a worker and start it again whenever it quits on its own (Redis lost mid-job,
    Redis restarted, a timeout): the built-in equivalent of `Restart=always`. Returns when
    the worker was asked to stop (SIGTERM/SIGINT: the current sample is finished first) or
    when a burst worker ran out of work."""
    backoff = Backoff(RESTART_BACKOFF_MIN_S, RESTART_BACKOFF_MAX_S)
    attempt = 0
    while True:
        try:
            worker = make_worker(connect(), keys, categories,
                                 f"{name}-{attempt}" if name and attempt else name)
            run_worker(worker, burst=burst)
            # rq records a warm-shutdown request (SIGTERM/SIGINT) in both the idle and the
            # busy case only through this date
            if burst or worker._stop_requested or worker._shutdown_requested_date:
                return 0
            log.error("worker %s quit unexpectedly; starting it again in %.1f s", worker.name,
                      backoff.delay_s)
        except (RedisError, TokencapError) as exc:
            log.error("worker cannot run (%s); retrying in %.1f s", exc, backoff.delay_s)
        attempt += 1
        old = {s: signal.signal(s, lambda *_: backoff.stop.set())
               for s in (signal.SIGTERM, signal.SIGINT)}
        stopped = backoff.wait()
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if stopped:
            return 0
