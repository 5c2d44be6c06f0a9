"""The tokencap worker: an RQ `SimpleWorker` that runs only tokencap's job function and
reads only msgspec JSON payloads.

A job is refused whole unless every field of it that RQ could act on is what the producer
sets (`budget_service.jobs.refusal`): the function and its one `JobRef` argument, no
callbacks, no webhooks, no dependencies, no retries or repeats, tokencap's result and
failure TTLs. A refused job runs
nothing: no callback, no webhook, no retry; it is recorded once in the run's refused stream
(with the field at fault) and deleted.

RQ's command channel (`rq.command`: shutdown, stop a job) is listened to by a thread of our
own (`_Commands`), not redis-py's `run_in_thread`: from redis-py 8.2 its `stop()` waits for
the thread, which RQ's 60 s poll leaves asleep after the unsubscribe, so that every worker's
end (SIGTERM, a burst worker out of work) took up to 60 s. Ours ends on the unsubscribe's
reply, whatever the redis-py version.

A stop is noted by the worker itself (`stop_asked`), through RQ's public methods: its SIGINT
and SIGTERM handler (`request_stop`) and the check at the top of each turn of its work loop
(`check_for_suspension`, which may end the loop with `StopRequested`). That
`BaseWorker.work` installs `request_stop` only after `bootstrap` and calls
`check_for_suspension` first in each turn is RQ 3.0's work loop, not a documented promise:
pyproject.toml keeps rq below 3.1, and tests/unit/consumers/test_worker.py checks both.

`SimpleWorker` keeps one process (and one HTTP keep-alive session) across jobs. It beats its
RQ key only between jobs; a thread beats it during one (`_JobBeats`), so that the key of a
worker killed at any moment expires `jobs.WORKER_TTL_S` after its last beat and `up`,
`status` and the live page count only live workers. The sample in flight is covered by
tokencap's own lease, extended by the job's heartbeat thread, and by the producer's reaper.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from redis import Redis
from redis.client import PubSub
from redis.exceptions import RedisError
from rq import Queue
from rq.exceptions import StopRequested
from rq.job import Job
from rq.worker import DequeueStrategy, SimpleWorker

from budget_service import jobs
from budget_service.keys import Keys
from budget_service.samples import SampleLedger
from foundation.backoff import Backoff
from foundation.errors import TokencapError
from foundation.stopping import on_stop_signals

log = logging.getLogger(__name__)

RESTART_BACKOFF_MIN_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
# RQ beats the worker key three times per job loop (before and after the dequeue, after the
# job), three round trips each, on top of the beat it pipelines into its suspension check.
# A beat that only repeats one sent less than this long ago (same TTL) is skipped: the key's
# expiry moves by at most this much out of its ~480 s.
WORKER_BEAT_MIN_S = 1.0
# how long a worker's end waits for its command listener once unsubscribed (the reply ends it
# at once; only a Redis gone mid-unsubscribe leaves it to its own retry loop, a daemon thread)
COMMANDS_JOIN_S = 5.0
COMMANDS_RETRY_S = 2.0  # RQ's own wait before listening again after Redis was lost


class _RedisLostFilter(logging.Filter):
    """RQ's own log lines about an exception: when the exception is Redis going away (a
    fault the worker recovers from by itself: the supervisor starts it again and the
    sample's lease brings it back), one line without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, RedisError):
            record.msg = f"{record.getMessage()} (Redis: {type(exc).__name__}: {exc})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


_REDIS_LOST = _RedisLostFilter()


class TokencapWorker(SimpleWorker):
    """Runs a job only if `jobs.refusal` finds nothing in it; refuses the rest whole."""

    keys: Keys  # the run's keys (set by make_worker): refusals are recorded under them
    # a stop (SIGINT, SIGTERM, RQ's shutdown command) reached the worker: RQ keeps its own
    # record of one in private attributes only, so the worker keeps this one
    stop_asked = False
    _beat_sent_at = float("-inf")
    _commands: _Commands | None = None

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's worker heartbeat, in one round trip instead of three, and not repeated
        within WORKER_BEAT_MIN_S (`rq info` still shows a beat at most that old). The key
        lives at most `worker_ttl` (RQ asks worker_ttl + 60 s, or a job's timeout + 60)."""
        repeat = timeout is None and time.monotonic() - self._beat_sent_at < WORKER_BEAT_MIN_S
        ttl = min(timeout or self.worker_ttl, self.worker_ttl)
        if pipeline is not None:
            super().heartbeat(ttl, pipeline=pipeline)
            self._beat_sent_at = time.monotonic()
            return
        if repeat:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            super().heartbeat(ttl, pipeline=pipe)
            pipe.execute()
        self._beat_sent_at = time.monotonic()

    def bootstrap(self, *args: Any, **kwargs: Any) -> None:
        """RQ's bootstrap (register, subscribe to the command channel), during which a stop
        (SIGINT, SIGTERM) is noted and ends the worker before its first job. RQ installs its
        own handlers only after the bootstrap, and its shutdown command is a SIGINT the
        worker sends itself: one sent as soon as the worker listened met Python's default
        handler, a KeyboardInterrupt traceback (and RQ's handler, raising StopRequested
        outside the work loop, would be one too)."""
        old = {sig: signal.signal(sig, self._stop_at_start)
               for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            super().bootstrap(*args, **kwargs)
        except BaseException:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            raise

    def _stop_at_start(self, signum: int, frame: Any) -> None:
        """A stop asked for during the bootstrap: the work loop's first turn ends it
        (`check_for_suspension`)."""
        log.info("worker %s: stop asked for while starting (signal %d)", self.name, signum)
        self.stop_asked = True

    def request_stop(self, signum: int, frame: Any) -> None:
        """RQ's handler of SIGINT and SIGTERM once the work loop runs (a warm stop: the job
        in hand is finished first), the stop noted in `stop_asked` first."""
        self.stop_asked = True
        super().request_stop(signum, frame)

    def check_for_suspension(self, burst: bool) -> None:
        """RQ's check at the top of each turn of the work loop. A stop noted during the
        bootstrap ends the loop here, as RQ ends a suspended burst worker: `StopRequested`,
        which the loop takes for a stop (and then tears the worker down)."""
        if self.stop_asked:
            raise StopRequested
        super().check_for_suspension(burst)

    def subscribe(self) -> None:
        """Listen to RQ's command channel (shutdown, stop a job) in `_Commands`."""
        pubsub = self.connection.pubsub()
        pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub = pubsub
        self._commands = _Commands(self.name, pubsub)
        self._commands.start()

    def unsubscribe(self) -> None:
        """Unsubscribe: the reply ends the listener's `listen()`, which is waited for."""
        listener, pubsub = self._commands, self.pubsub
        if listener is None or pubsub is None:
            return
        self._commands = None
        listener.stopping.set()
        try:
            pubsub.unsubscribe()
        except RedisError as exc:  # Redis gone: the listener sees it too, and ends
            log.warning("worker %s: unsubscribe failed: %s", self.name, exc)
        listener.join(COMMANDS_JOIN_S)
        if listener.is_alive():
            log.warning("worker %s: its command listener did not end within %.0f s",
                        self.name, COMMANDS_JOIN_S)
        pubsub.close()

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        """A job that failed because Redis went away is one line, not a traceback: its
        lease runs out and the producer sends the sample again."""
        exc = exc_info[1] if len(exc_info) > 1 else None
        if isinstance(exc, RedisError):
            log.warning("job %s: Redis went away mid-job (%s: %s); the sample is sent again "
                        "once its lease runs out", job.id, type(exc).__name__, exc)
            return
        super().handle_exception(job, *exc_info)

    def execute_job(self, job: Job, queue: Queue) -> None:
        reason = jobs.refusal(job)
        if reason is not None:
            self._refuse(job, queue, reason)
            return
        with _job_beats.during(self):
            super().execute_job(job, queue)

    def _refuse(self, job: Job, queue: Queue, reason: str) -> None:
        """Record the job once and delete it: none of RQ's failure handling runs (it would
        call the job's failure callback, post its webhooks, or retry it)."""
        log.error("refused job %s from queue %s: %s", job.id, queue.name, reason)
        record = {"job_id": job.id, "queue": queue.name, "reason": reason, "ts": time.time()}
        SampleLedger(self.connection, self.keys).refuse(record)
        jobs.drop(self.connection, queue, job)


class _Commands(threading.Thread):
    """RQ's command listener for one worker: `listen()` runs the worker's handler for each
    command and ends once the channel is unsubscribed (`TokencapWorker.unsubscribe`). Redis
    lost meanwhile: one line per outage, and it listens again every COMMANDS_RETRY_S
    (redis-py subscribes again on the new connection) until the worker ends."""

    def __init__(self, name: str, pubsub: PubSub) -> None:
        super().__init__(daemon=True, name=f"rq-commands-{name}")
        self.worker_name = name
        self.pubsub = pubsub
        self.stopping = threading.Event()

    def run(self) -> None:
        said = False
        while not self.stopping.is_set():
            try:
                for _message in self.pubsub.listen():  # the handler runs inside
                    said = False  # (the subscription's own replies come this way too)
                return
            except RedisError as exc:
                if self.stopping.is_set():
                    return
                if not said:
                    log.warning("worker %s: command channel lost (%s: %s); listening again "
                                "once Redis answers", self.worker_name, type(exc).__name__,
                                exc)
                    said = True
                self.stopping.wait(COMMANDS_RETRY_S)


class _JobBeats:
    """One daemon thread per process: every `jobs.WORKER_BEAT_S` it beats the RQ key of the
    worker that runs a job (a `SimpleWorker` beats only between jobs). The lock makes sure
    no beat is sent once the job is over (one after RQ deleted the key at the worker's end
    would leave a key with only its beat in it)."""

    def __init__(self) -> None:
        self._worker: TokencapWorker | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = -1

    @contextlib.contextmanager
    def during(self, worker: TokencapWorker) -> Iterator[None]:
        with self._lock:
            self._worker = worker
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, daemon=True, name="rq-beat")
            self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._worker = None

    def _run(self) -> None:
        while True:
            time.sleep(jobs.WORKER_BEAT_S)
            with self._lock:
                if self._worker is None:
                    continue
                try:
                    self._worker.heartbeat(self._worker.worker_ttl)
                except RedisError as exc:  # a missed beat: the next one comes in time
                    log.warning("worker %s: heartbeat failed: %s", self._worker.name, exc)


_job_beats = _JobBeats()


def make_worker(redis: Redis, keys: Keys, categories: list[str], name: str | None = None,
                worker_class: type[TokencapWorker] = TokencapWorker) -> TokencapWorker:
    """A worker on the run's category queues (round robin), its key alive WORKER_TTL_S
    after its last beat."""
    worker = worker_class(jobs.queues(redis, keys, categories), connection=redis,
                          serializer=jobs.MsgspecSerializer, name=name,
                          worker_ttl=jobs.WORKER_TTL_S)
    worker.keys = keys
    return worker


def run_worker(worker: TokencapWorker, *, burst: bool = False) -> bool:
    if _REDIS_LOST not in worker.log.filters:
        worker.log.addFilter(_REDIS_LOST)
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
    said = ""  # the trouble already logged: one line per outage, not one per retry
    while True:
        worker: TokencapWorker | None = None
        try:
            worker = make_worker(connect(), keys, categories,
                                 f"{name}-{attempt}" if name and attempt else name)
            if said:
                log.warning("worker runs again (after: %s)", said)
                said = ""
            run_worker(worker, burst=burst)
            if burst or worker.stop_asked:
                return 0
            log.error("worker %s quit unexpectedly; starting it again in %.1f s", worker.name,
                      backoff.delay_s)
        except (RedisError, TokencapError) as exc:
            if worker is not None and worker.stop_asked:
                return 0  # asked to stop, then Redis went away (while starting or ending)
            trouble = f"{type(exc).__name__}: {exc}"
            if trouble != said:
                log.error("worker cannot run (%s); retrying with backoff, said once until it "
                          "runs again", exc)
                said = trouble
            else:
                log.debug("worker cannot run (%s); retrying in %.1f s", exc, backoff.delay_s)
        attempt += 1
        with on_stop_signals(lambda _signum: backoff.stop.set()):
            stopped = backoff.wait()
        if stopped:
            return 0
