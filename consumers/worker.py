"""The tokencap worker: an RQ `SimpleWorker` that runs only tokencap's job function and
reads only msgspec JSON payloads.

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

from budget_service.budget import Budget
from budget_service.keys import Keys
from foundation.backoff import Backoff
from foundation.errors import TokencapError
from foundation.wire import JOB_FUNC, MsgspecSerializer

log = logging.getLogger(__name__)

ALLOWED_FUNCS = frozenset({JOB_FUNC})
RESTART_BACKOFF_MIN_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
# RQ beats the worker key three times per job loop (before and after the dequeue, after the
# job), three round trips each, on top of the beat it pipelines into its suspension check.
# A beat that only repeats one sent less than this long ago (same TTL) is skipped: the key's
# expiry moves by at most this much out of its ~480 s.
WORKER_BEAT_MIN_S = 1.0


class TokencapWorker(SimpleWorker):
    """Refuses (records, fails, never imports) any job that is not `consumers.job.process`."""

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
        try:
            name = job.func_name
        except Exception as exc:  # undecodable payload: pickle, garbage
            cause = exc.__cause__ or exc.__context__ or exc
            self._refuse(job, queue, f"payload refused: {cause}")
            return
        if name not in ALLOWED_FUNCS:
            self._refuse(job, queue, f"function {name!r} is not a tokencap job")
            return
        super().execute_job(job, queue)

    def _refuse(self, job: Job, queue: Queue, reason: str) -> None:
        log.error("refused job %s from queue %s: %s", job.id, queue.name, reason)
        record = {"job_id": job.id, "queue": queue.name, "reason": reason, "ts": time.time()}
        Budget(self.connection, self.keys).refuse(record)
        self.handle_job_failure(job=job, queue=queue, exc_string=f"refused by tokencap: {reason}")


def make_worker(redis: Redis, keys: Keys, categories: list[str], name: str | None = None,
                worker_class: type[TokencapWorker] = TokencapWorker) -> TokencapWorker:
    """A worker on the run's category queues (round robin)."""
    queues = [Queue(q, connection=redis, serializer=MsgspecSerializer)
              for q in keys.queue_names(categories)]
    worker = worker_class(queues, connection=redis, serializer=MsgspecSerializer, name=name)
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
