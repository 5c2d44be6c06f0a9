"""Worker faults: SIGKILL mid-request (repeated), SIGKILL between dequeue and start,
SIGTERM of a busy worker. Invariants are checked by Pipeline.check_invariants."""

from __future__ import annotations

import signal
import subprocess
import sys

import msgspec
import pytest
from rq import Callback, Queue, Retry
from rq.webhook import Webhook

from budget_service.jobs import MsgspecSerializer
from sglang_sim.testing import SimServer
from testing.harness import Pipeline, started, wait_until
from tests.conftest import ROOT
from tests.faults.common import Background, two_category_config, worker_killer

pytestmark = pytest.mark.slow

KILLS = 6


def test_sigkill_random_busy_workers_repeatedly(tmp_path, redis_url) -> None:
    cfg = two_category_config(tmp_path)
    with SimServer(time_scale=60.0) as sim:
        kills: list[int] = []
        with started(cfg, redis_url, [sim.url], 6) as pipe:
            # every ~1,500 committed tokens, SIGKILL a worker in the middle of a request
            status = pipe.run(should_stop=worker_killer(pipe, kills, KILLS, 1500))
    assert len(kills) == KILLS
    pipe.check_invariants(status)
    assert all(status["categories"][c]["state"] == "closed" for c in ("a", "b"))
    assert all(status["categories"][c]["failed"] == 0 for c in ("a", "b"))


def test_sigkill_between_dequeue_and_start(tmp_path, redis_url) -> None:
    cfg = two_category_config(tmp_path, cap_a=3000, cap_b=3000)
    with SimServer(time_scale=200.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])
        try:
            pipe.build()
            pipe.start_writer()
            # Given jobs queued and a worker that dies right after dequeueing one
            pipe.producer.tick()
            queue_key = Queue(pipe.keys.queue_name("a"), connection=pipe.redis).key
            queued = pipe.redis.llen(queue_key)
            killer = subprocess.run(
                [sys.executable, "-m", "tests.faults.dequeue_killer", redis_url,
                 cfg.key_prefix, cfg.run, "a"], cwd=ROOT, timeout=60)
            assert killer.returncode == -signal.SIGKILL
            # the job left the queue and nothing records it in RQ (multi-queue BLPOP path)
            assert pipe.redis.llen(queue_key) == queued - 1
            # When normal workers run, the reaper re-enqueues the lost sample
            pipe.start_workers(3)
            status = pipe.run()
        finally:
            pipe.close()
    pipe.check_invariants(status)
    assert status["categories"]["a"]["failed"] == 0


def test_sigterm_busy_worker_finishes_its_sample(tmp_path, redis_url) -> None:
    cfg = two_category_config(tmp_path, cap_a=4000, cap_b=2000)
    with SimServer(time_scale=20.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])
        try:
            pipe.build()
            pipe.start_writer()
            bg = Background(pipe).start()
            (worker,) = pipe.start_workers(1)
            # When the only worker is asked to stop while it waits on the engine
            wait_until(lambda: pipe.busy_worker_pids(), what="the worker to be busy")

            def in_flight() -> tuple[str, str] | None:
                for c in ("a", "b"):
                    keys = pipe.redis.hkeys(pipe.keys.cat(c).reserved)
                    if keys:
                        return c, keys[0].decode()
                return None

            cat, sample = wait_until(in_flight, what="a reservation")
            worker.send_signal(signal.SIGTERM)
            # Then it finishes that sample, commits it, and exits cleanly
            assert worker.wait(60) == 0
            assert pipe.redis.hget(pipe.keys.cat(cat).final, sample).startswith(b"c:")
            pipe.workers.remove(worker)
            pipe.start_workers(3)
            status = bg.join()
        finally:
            pipe.close()
    pipe.check_invariants(status)


def test_a_worker_process_refuses_forged_jobs_whole(redis, redis_url, tmp_path) -> None:
    """Jobs for the allowed function with a foreign callback, a retry or a webhook, and one
    naming os.system, on a real run's queue, and a real `tokencap worker --burst` process:
    nothing is called (a marker file), nothing posted (a local HTTP listener), each job is
    refused once and deleted (tests/unit/budget_service/test_jobs.py has the same for each field,
    in-process)."""
    import os

    from budget_service.budget import Budget
    from budget_service.keys import Keys
    from tests.helpers import Listener, make_cfg, producers_job

    keys = Keys("tokencap", "t")
    Budget(redis, keys).feeding.init_run(make_cfg())
    q = Queue(keys.queue_name("code"), connection=redis, serializer=MsgspecSerializer)
    marker = tmp_path / "called"
    listener = Listener()
    try:
        forged = [
            producers_job(q, on_success=Callback("tests.hooks.mark")),
            producers_job(q, on_failure=Callback("tests.hooks.mark")),
            producers_job(q, retry=Retry(max=3)),
            producers_job(q, webhooks=[Webhook(listener.url, "failed", method="POST")]),
            q.enqueue("os.system", f"touch {marker}"),
        ]
        with SimServer(time_scale=1000.0) as sim:  # a worker starts only on a usable engine
            env = {**os.environ, "REDIS_URL": redis_url, "SGLANG_URL": sim.url,
                   "TOKENCAP_RUN": "t", "TOKENCAP_TEST_MARKER": str(marker),
                   "PYTHONPATH": str(ROOT)}
            done = subprocess.run([sys.executable, "-m", "tokencap.cli", "worker", "--burst"],
                                  cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert not marker.exists() and listener.requests == []
        records = [msgspec.json.decode(f[b"r"]) for _id, f in redis.xrange(keys.refused)]
        assert sorted(r["job_id"] for r in records) == sorted(j.id for j in forged)
        assert q.count == 0 and not any(redis.exists(j.key) for j in forged)
    finally:
        listener.close()
