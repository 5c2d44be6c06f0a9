"""RQ's contract, in one place: the one job function, its TTLs and serializer, the queues,
how the producer enqueues, what a worker refuses and how it drops a refused job, the
started-registry cleanup at the end of a run, and the workers alive on the run's queues.

The producer (`producer.feeder`) and the workers (`consumers.worker`) call this; no other
module names RQ's keys or builds a job. A job carries only a `JobRef` (msgspec JSON, never
pickle): the prompt lives in the category's ledger, so the reaper can enqueue it again and the
queue stays small.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
from redis import Redis
from rq import Queue
from rq.job import Job
from rq.worker_registration import clean_worker_registry, get_keys

from budget_service.keys import Keys
from foundation.errors import PayloadRefused
from foundation.wire import JobRef

# The one function a tokencap worker runs (consumers/job.py); the producer names it in
# every job it enqueues, the worker refuses any other.
JOB_FUNC = "consumers.job.process"
# RQ keeps a finished job this long (tokencap keeps outcomes in its ledger; a short TTL spares
# RQ its delete path), a failed one this long. The worker refuses a job that asks for others.
JOB_RESULT_TTL_S = 60
JOB_FAILURE_TTL_S = 7 * 24 * 3600
# A worker's RQ key lives WORKER_TTL_S after its last beat, and a worker beats every
# WORKER_BEAT_S, idle (RQ's blocking dequeue waits worker_ttl - 15 s between beats) or in a
# job (consumers.worker beats from a thread): a killed worker stops counting as alive within
# WORKER_TTL_S, not RQ's default 480 s (or a job's timeout + 60 s).
WORKER_TTL_S = 20
WORKER_BEAT_S = WORKER_TTL_S - 15
_encoder = msgspec.json.Encoder()


class MsgspecSerializer:
    """RQ serializer: msgspec JSON only. Loading anything else (pickle included) raises."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return _encoder.encode(obj)

    @staticmethod
    def loads(data: bytes) -> Any:
        try:
            return msgspec.json.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise PayloadRefused(f"job payload is not msgspec JSON: {exc}") from None


def queue(redis: Redis, keys: Keys, category: str) -> Queue:
    """The RQ queue of a category."""
    return Queue(keys.queue_name(category), connection=redis, serializer=MsgspecSerializer)


def queues(redis: Redis, keys: Keys, categories: Iterable[str]) -> list[Queue]:
    return [queue(redis, keys, c) for c in categories]


def enqueue(q: Queue, keys: Keys, run: str, category: str,
            samples: Sequence[tuple[str, int, int]], timeout_s: int,
            at_front: bool = False) -> None:
    """One job per (sample id, seq, prompt tokens), in one round trip, at the queue's end (or
    its front). Its id is the sample's and the seq's: a job of an earlier enqueue is told apart
    (admit answers it `stale`)."""
    if not samples:
        return
    q.enqueue_many([
        Queue.prepare_data(
            JOB_FUNC,
            args=(msgspec.to_builtins(JobRef(run=run, category=category, sample_id=sid,
                                             seq=seq, prompt_tokens=n_prompt)),),
            job_id=keys.job_id(category, sid, seq),
            timeout=timeout_s,
            result_ttl=JOB_RESULT_TTL_S,
            failure_ttl=JOB_FAILURE_TTL_S,
            description=f"{category}/{sid}#{seq}",
            at_front=at_front,
        )
        for sid, seq, n_prompt in samples
    ])


def waiting(redis: Redis, q: Queue, keys: Keys, category: str,
            samples: Sequence[tuple[str, int]]) -> list[bool]:
    """Whether the job of each (sample id, seq) still waits in the queue (one round trip)."""
    pipe = redis.pipeline(transaction=False)
    for sid, seq in samples:
        pipe.lpos(q.key, keys.job_id(category, sid, seq))
    return [pos is not None for pos in pipe.execute()]


def clear_started(redis: Redis, q: Queue) -> int:
    """Drop what RQ's started registry and intermediate list of `q` still hold from killed
    workers (at the end of a run no job may still be running). Returns the entries dropped."""
    registry = q.started_job_registry
    stale = redis.zrange(registry.key, 0, -1)
    jids = [jid for jid, _eid in registry.get_job_and_execution_ids(cleanup=False)]
    if jids:
        redis.delete(*(Job.key_for(jid) for jid in jids))
    if stale:
        redis.zrem(registry.key, *stale)
    redis.delete(q.intermediate_queue_key)
    return len(stale)


def worker_count(redis: Redis, keys: Keys, category: str) -> int:
    """Workers alive on the run's queues: registered in RQ's registry, and with a worker key
    that has not expired (a worker renews it every WORKER_BEAT_S, job or not; a killed one's
    is gone WORKER_TTL_S after its last beat). Every worker of a run listens on every
    category's queue, so one queue tells."""
    names = sorted(get_keys(queue=queue(redis, keys, category)))
    if not names:
        return 0
    return int(redis.exists(*names))


def clean_workers(redis: Redis, keys: Keys, categories: Iterable[str]) -> None:
    """Drop from RQ's registries the workers whose key expired (killed without a word):
    RQ's own cleanup, which its workers run only every ten minutes."""
    for q in queues(redis, keys, categories):
        clean_worker_registry(q)


def refusal(job: Job) -> str | None:
    """Why `job` must not run (the field at fault), or None when it is exactly a job
    `enqueue` makes."""
    try:
        name, args, kwargs = job.func_name, job.args, job.kwargs
    except Exception as exc:  # undecodable payload: pickle, garbage
        cause = exc.__cause__ or exc.__context__ or exc
        return f"payload refused: {cause}"
    if name != JOB_FUNC:
        return (f"function {name!r} is not a tokencap job (this version runs {JOB_FUNC!r}; "
                "a job of another version's path is dropped, and its sample sent again when "
                "its lease runs out)")
    if kwargs or len(args) != 1:
        return "arguments: a tokencap job takes one JobRef and no keyword arguments"
    try:
        msgspec.convert(args[0], JobRef)
    except msgspec.ValidationError as exc:
        return f"arguments: not a JobRef: {exc}"
    # RQ's private fields, read on purpose (and rq pinned below 3.1 in pyproject.toml): the
    # public `Job.success_callback` (failure, stopped likewise) imports the function the job
    # names, which a refusal must never do, and `Job.dependency_ids` reads the dependencies'
    # Redis set, not the dependencies the job's own hash asks for
    checks = (
        ("on_success callback", job._success_callback_name),
        ("on_failure callback", job._failure_callback_name),
        ("on_stopped callback", job._stopped_callback_name),
        ("webhooks", job.webhooks),
        ("dependencies", job._dependency_ids),
        ("retry", job.retries_left or job.retry_intervals),
        ("repeat", job.repeats_left or job.repeat_intervals),
    )
    for field, value in checks:
        if value:
            return f"{field} set: {value!r}"[:300]
    if (job.result_ttl, job.failure_ttl) != (JOB_RESULT_TTL_S, JOB_FAILURE_TTL_S):
        return (f"result/failure TTL {job.result_ttl}/{job.failure_ttl}, not tokencap's "
                f"{JOB_RESULT_TTL_S}/{JOB_FAILURE_TTL_S}")
    return None


def drop(redis: Redis, q: Queue, job: Job) -> None:
    """Delete a refused job wherever RQ holds it, in one transaction: none of RQ's failure
    handling runs (it would call the job's failure callback, post its webhooks, retry it)."""
    with redis.pipeline() as pipe:
        pipe.lrem(q.intermediate_queue_key, 1, job.id)  # single-queue dequeues
        pipe.lrem(q.key, 0, job.id)
        pipe.delete(job.key)
        pipe.execute()
