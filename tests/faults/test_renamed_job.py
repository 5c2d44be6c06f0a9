"""A job enqueued by another version of tokencap, under a job function path that is not this
version's (a rename, an upgrade mid-run), is not lost: the worker refuses it whole with a
reason a user reads, and the reaper sends its sample again under the right function once its
lease runs out; the sample is committed once."""

from __future__ import annotations

import msgspec
import pytest
from rq import Queue

from budget_service.jobs import JOB_FUNC, MsgspecSerializer
from sglang_sim.testing import SimServer
from testing.harness import Pipeline
from tests.faults.common import two_category_config

pytestmark = pytest.mark.slow

OLD_FUNC = "tokencap.consumers.job.process"  # what a renamed job function would be called


def test_a_job_under_another_function_path_is_refused_and_its_sample_sent_again(
        tmp_path, redis_url) -> None:
    # every sample must be sent: the categories end exhausted, not closed by a cap
    cfg = two_category_config(tmp_path, cap_a=10**9, cap_b=10**9, prompts=24)
    with SimServer(time_scale=200.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])
        try:
            pipe.build()
            pipe.start_writer()
            pipe.producer.tick()  # the first jobs are queued
            q = Queue(pipe.keys.queue_name("a"), connection=pipe.redis,
                      serializer=MsgspecSerializer)
            # Given one sample whose job names the function by another path
            [job] = q.jobs[:1]
            ref = job.args[0]
            job.delete()
            forged = q.enqueue_call(OLD_FUNC, args=(ref,), job_id=job.id, at_front=True)
            # When workers run the queue
            pipe.start_workers(2)
            status = pipe.run()
        finally:
            pipe.close()
    # Then the job was refused once, with a reason naming both paths
    refused = [msgspec.json.decode(f[b"r"]) for _id, f in pipe.redis.xrange(pipe.keys.refused)]
    assert [r["job_id"] for r in refused] == [forged.id]
    assert OLD_FUNC in refused[0]["reason"] and JOB_FUNC in refused[0]["reason"]
    # and its sample was sent again and committed once, like every other
    pipe.check_invariants(status)
    rows = pipe.committed("a")
    assert [r.id for r in rows].count(ref["sample_id"]) == 1
    assert status["categories"]["a"]["failed"] == 0
    assert status["categories"]["a"]["state"] == "exhausted" and len(rows) == 24
