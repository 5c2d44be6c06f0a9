"""Workers run only tokencap's job function and read only msgspec JSON payloads."""

from __future__ import annotations

from rq import Queue
from rq.job import Job, JobStatus

from budget_service.keys import Keys
from consumers.worker import make_worker, run_worker
from foundation.wire import JOB_FUNC, MsgspecSerializer

KEYS = Keys("tokencap", "sec")


def test_the_allowed_job_function_is_consumers_job_process() -> None:
    from consumers import job

    module, _, name = JOB_FUNC.rpartition(".")
    assert module == job.__name__ and getattr(job, name) is job.process


def test_job_naming_another_callable_is_refused(redis, tmp_path) -> None:
    marker = tmp_path / "pwned"
    q = Queue(KEYS.queue_name("any"), connection=redis, serializer=MsgspecSerializer)
    job = q.enqueue("os.system", f"touch {marker}", job_id="evil1")
    run_worker(make_worker(redis, KEYS, ["any"]), burst=True)
    assert not marker.exists()
    assert Job.fetch("evil1", connection=redis, serializer=MsgspecSerializer).get_status() \
        == JobStatus.FAILED
    (entry,) = redis.xrange(KEYS.refused)
    assert b"os.system" in entry[1][b"r"]
    assert job.id == "evil1"


def test_pickle_payload_is_refused(redis, tmp_path) -> None:
    marker = tmp_path / "pwned"
    q = Queue(KEYS.queue_name("pickle"), connection=redis, serializer=MsgspecSerializer)
    job = q.enqueue(JOB_FUNC, {"run": "x"}, job_id="evil2")
    # forge the stored payload into a protocol-0 pickle that runs a command when unpickled
    forged = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    redis.hset(job.key, "data", forged)
    run_worker(make_worker(redis, KEYS, ["pickle"]), burst=True)
    assert not marker.exists()
    (entry,) = redis.xrange(KEYS.refused)
    assert b"not msgspec JSON" in entry[1][b"r"]
