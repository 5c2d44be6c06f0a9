"""Workers run only tokencap's job, exactly as the producer enqueues it, and read only msgspec
JSON payloads. Anything else is refused whole: nothing of it runs (no function, callback,
webhook or retry), it is recorded once with the field at fault, and it leaves the queue.

The hooks a forged job names (`tests.hooks`) leave a marker file when called; a local HTTP
listener records any webhook request.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from rq import Callback, Queue, Retry
from rq.job import Job
from rq.webhook import Webhook

from budget_service.jobs import (
    JOB_FAILURE_TTL_S,
    JOB_FUNC,
    JOB_RESULT_TTL_S,
    MsgspecSerializer,
    refusal,
)
from budget_service.keys import Keys
from consumers.worker import make_worker, run_worker
from tests.helpers import FORGED_REF, Listener, producers_job

KEYS = Keys("tokencap", "sec")


def test_the_allowed_job_function_is_consumers_job_process() -> None:
    from consumers import job

    module, _, name = JOB_FUNC.rpartition(".")
    assert module == job.__name__ and getattr(job, name) is job.process


def queue(redis) -> Queue:
    return Queue(KEYS.queue_name("q"), connection=redis, serializer=MsgspecSerializer)


def refused(redis) -> list[dict]:
    return [msgspec.json.decode(f[b"r"]) for _id, f in redis.xrange(KEYS.refused)]


def work(redis) -> None:
    run_worker(make_worker(redis, KEYS, ["q"]), burst=True)


def test_a_job_as_the_producer_makes_it_is_not_refused(redis) -> None:
    job = producers_job(queue(redis))
    assert refusal(Job.fetch(job.id, connection=redis, serializer=MsgspecSerializer)) is None


def test_job_naming_another_callable_is_refused(redis, tmp_path) -> None:
    marker = tmp_path / "pwned"
    q = queue(redis)
    q.enqueue("os.system", f"touch {marker}", job_id="evil1")
    work(redis)
    assert not marker.exists()
    (entry,) = refused(redis)
    assert entry["job_id"] == "evil1" and "os.system" in entry["reason"]
    assert not redis.exists(Job.key_for("evil1")) and q.count == 0


def test_pickle_payload_is_refused(redis, tmp_path) -> None:
    marker = tmp_path / "pwned"
    job = producers_job(queue(redis))
    # forge the stored payload into a protocol-0 pickle that runs a command when unpickled
    forged = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    redis.hset(job.key, "data", forged)
    work(redis)
    assert not marker.exists()
    (entry,) = refused(redis)
    assert "not msgspec JSON" in entry["reason"]


@pytest.mark.parametrize(("option", "field"), [
    ({"on_success": Callback("tests.hooks.mark")}, "on_success callback"),
    ({"on_failure": Callback("tests.hooks.mark")}, "on_failure callback"),
    ({"on_stopped": Callback("tests.hooks.mark")}, "on_stopped callback"),
    ({"retry": Retry(max=3)}, "retry"),
])
def test_the_allowed_function_with_a_foreign_hook_is_refused_whole(redis, tmp_path, monkeypatch,
                                                                  option, field) -> None:
    marker = tmp_path / "called"
    monkeypatch.setenv("TOKENCAP_TEST_MARKER", str(marker))
    q = queue(redis)
    job = producers_job(q, **option)
    work(redis)
    assert not marker.exists()  # no callback ran, and the job function did not run either
    (entry,) = refused(redis)  # recorded once: a retry would have come back and been counted
    assert entry["job_id"] == job.id and entry["reason"].startswith(field)
    assert q.count == 0 and not redis.exists(job.key)


def test_a_dependency_or_foreign_ttls_are_refused(redis) -> None:
    q = queue(redis)
    first = producers_job(q)
    dependent = q.enqueue(JOB_FUNC, FORGED_REF, job_id="dep", depends_on=first,
                          result_ttl=JOB_RESULT_TTL_S, failure_ttl=JOB_FAILURE_TTL_S)
    assert "dependencies" in (refusal(dependent) or "")
    kept = q.enqueue(JOB_FUNC, FORGED_REF, job_id="ttl", result_ttl=-1,
                     failure_ttl=JOB_FAILURE_TTL_S)
    assert "TTL" in (refusal(kept) or "")
    extra = q.enqueue(JOB_FUNC, FORGED_REF, "more", job_id="args", result_ttl=JOB_RESULT_TTL_S,
                      failure_ttl=JOB_FAILURE_TTL_S)
    assert "arguments" in (refusal(extra) or "")


def test_a_refused_job_posts_no_webhook(redis, tmp_path: Path) -> None:
    listener = Listener()
    try:
        q = queue(redis)
        hooks = [Webhook(listener.url, "failed", method="POST"),
                 Webhook(listener.url, "finished", method="POST")]
        q.enqueue("os.system", "true", job_id="evil-hook", webhooks=hooks)
        producers_job(q, webhooks=hooks)
        work(redis)
        # a webhook is sent synchronously and the listener records it before it answers:
        # one the worker sent would be here already
        assert listener.requests == []
        reasons = [e["reason"] for e in refused(redis)]
        assert len(reasons) == 2 and any(r.startswith("webhooks") for r in reasons)
        # and a webhook does reach the listener when something really sends one
        from urllib.request import urlopen

        urlopen(listener.url, timeout=5).close()
        assert listener.requests == ["GET /hook"]
    finally:
        listener.close()
