"""`producer/recovery.py`, against the real ledger (`Budget` on a private Redis) driven
directly as the producer and the workers drive it. An expired lease is reaped: its sample is
leased again with a new seq and its job enqueued (one whose job still waits keeps its lease);
one lost in flight counts a failure, and one lost `max_attempts` times is dead-lettered. After
Redis lost its data the run is created again and rebuilt from the output files; after a
restart from an AOF that lacks the last commits, the files fill them in. At the end, what
killed workers left in RQ's registries is cleared."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from redis import Redis
from rq.executions import Execution

from budget_service import codec, jobs
from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.ledger import now_ms
from foundation.config import RunConfig
from foundation.wire import Result, encode
from producer.recovery import Recovery
from testing.harness import RedisServer, final_marks, ledger_entry
from tests.helpers import LEASE_MS, feed, make_cfg, result
from writer.files import CategorySink

CAT = "code"
JOB_TIMEOUT_S = 60


class Run:
    """A run of one category on `redis`, its `Recovery`, and the jobs it enqueued (for real,
    on the category's RQ queue)."""

    def __init__(self, redis: Redis, out: Path, max_attempts: int = 4) -> None:
        self.cfg: RunConfig = msgspec.structs.replace(make_cfg(), output_dir=str(out),
                                                      max_attempts=max_attempts)
        self.redis = redis
        self.keys = Keys(self.cfg.key_prefix, self.cfg.run)
        self.budget = Budget(redis, self.keys)
        self.budget.feeding.init_run(self.cfg)
        self.queue = jobs.queue(redis, self.keys, CAT)
        self.enqueued: list[tuple[str, int, int]] = []
        self.recovery = Recovery(self.cfg, redis, self.budget, {CAT: self.queue}, self.enqueue)

    def enqueue(self, category: str, samples: list[tuple[str, int, int]]) -> None:
        self.enqueued.extend(samples)
        jobs.enqueue(self.queue, self.keys, self.cfg.run, category, samples, JOB_TIMEOUT_S)

    def expire(self, sid: str) -> None:
        """The sample's lease runs out now (its worker died, or its job never left)."""
        assert self.budget.feeding.keep_lease(CAT, sid, now_ms() - 1)

    def take(self, sid: str) -> None:
        """A worker takes the sample's job from the queue and admits the sample."""
        seq = self.seq(sid)
        self.queue.remove(self.keys.job_id(CAT, sid, seq))
        assert self.budget.samples.admit(CAT, sid, 10, LEASE_MS, seq=seq)[0] == "ok"

    def seq(self, sid: str) -> int:
        return ledger_entry(self.budget, CAT, sid).seq

    def waiting(self, sid: str) -> bool:
        return jobs.waiting(self.redis, self.queue, self.keys, CAT, [(sid, self.seq(sid))])[0]

    def write(self, rows: list[Result]) -> None:
        """Rows on disk, as the writer writes them."""
        sink = CategorySink(Path(self.cfg.output_dir), CAT)
        sink.write([(encode(r), r) for r in rows], [None] * len(rows))
        sink.close()


def test_an_expired_lease_is_reaped_and_its_sample_enqueued_again(tmp_path: Path,
                                                                  redis: Redis) -> None:
    run = Run(redis, tmp_path / "out")
    run.recovery.reap_every_s = 3600.0  # only "something was found" brings a look forward
    assert run.recovery.reap_due() and not run.recovery.reap_due()
    # Given a sample fed, its job never enqueued (the producer died between the two), its
    # lease run out
    feed(run.budget, "s1", (1, 2, 3, 4))
    fed_seq = run.seq("s1")
    run.expire("s1")
    # When the reaper looks
    assert run.recovery.reap(CAT) == 1
    # Then it is leased again with a new seq, and that seq's job waits in the queue
    seq = run.seq("s1")
    assert seq != fed_seq and run.enqueued == [("s1", seq, 4)] and run.waiting("s1")
    assert run.budget.feeding.expired(CAT, now_ms(), 10) == []
    entry = ledger_entry(run.budget, CAT, "s1")
    assert entry.pending is not None and entry.pending.failures == 0  # not lost in flight
    # and something was found: the next tick looks again, whatever the interval
    assert run.recovery.reap_due()
    assert run.recovery.reap(CAT) == 0 and not run.recovery.reap_due()


def test_a_lease_whose_job_still_waits_is_kept_not_enqueued_twice(tmp_path: Path,
                                                                  redis: Redis) -> None:
    run = Run(redis, tmp_path / "out")
    feed(run.budget, "s1")
    run.enqueue(CAT, [("s1", run.seq("s1"), 3)])
    run.expire("s1")  # every worker busy: the job waited longer than the lease
    assert run.recovery.reap(CAT) == 0
    assert run.enqueued == [("s1", 0, 3)] and run.waiting("s1")
    assert run.budget.feeding.expired(CAT, now_ms(), 10) == []  # its lease was extended


def test_a_sample_lost_in_flight_counts_a_failure_and_is_dead_after_max_attempts(
        tmp_path: Path, redis: Redis) -> None:
    run = Run(redis, tmp_path / "out", max_attempts=2)
    feed(run.budget, "s1")
    run.enqueue(CAT, [("s1", run.seq("s1"), 3)])
    # Given a worker that took the sample and died with it
    run.take("s1")
    run.expire("s1")
    # Then the reaper enqueues it again, one failure counted, no longer in flight
    assert run.recovery.reap(CAT) == 1 and run.waiting("s1")
    entry = ledger_entry(run.budget, CAT, "s1")
    assert entry.pending is not None and entry.pending.failures == 1 and not entry.in_flight
    assert run.budget.telemetry.status()["categories"][CAT]["reserved"] == 0
    # When a second worker dies with it: lost max_attempts times, it is dead
    run.take("s1")
    run.expire("s1")
    assert run.recovery.reap(CAT) == 0 and len(run.enqueued) == 2
    assert codec.read_final(final_marks(run.budget, CAT)["s1"]) == (
        codec.FinalKind.DEAD, 0, "lost")
    st = run.budget.telemetry.status()["categories"][CAT]
    assert (st["failed"], st["pending"], st["in_flight"]) == (1, 0, 0)


def test_after_redis_lost_its_data_the_run_is_rebuilt_from_the_files(tmp_path: Path,
                                                                     redis: Redis) -> None:
    run = Run(redis, tmp_path / "out")
    assert run.recovery.ensure_run([CAT]) is False  # the run is there
    # Given two rows on disk, then a Redis restarted empty
    run.write([result("a", 30), result("b", 20)])
    redis.flushdb()
    # When the producer checks before its next tick
    assert run.recovery.ensure_run([CAT]) is True
    # Then the run exists again, counted from the files, feeding from the top of the order
    assert run.budget.has_run()
    assert set(final_marks(run.budget, CAT)) == {"a", "b"}
    st = run.budget.telemetry.status()["categories"][CAT]
    assert (st["used"], st["samples"]) == (50, 2)
    assert run.budget.feeding.cursor(CAT) == 0
    assert run.recovery.ensure_run([CAT]) is False  # once


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, with AOF, which it restarts."""
    server = RedisServer(tmp_path / "redis", aof=True).start()
    yield server
    server.stop()


def test_after_a_restart_from_an_aof_without_the_last_commits_the_files_fill_them_in(
        tmp_path: Path, restartable: RedisServer) -> None:
    client = Redis.from_url(restartable.url)
    run = Run(client, tmp_path / "out")
    assert run.recovery.ensure_run([CAT]) is False  # Redis's run_id noted
    # Given a row on disk whose commit Redis does not have (its last second was lost)
    run.write([result("a", 30)])
    assert run.recovery.ensure_run([CAT]) is False
    assert final_marks(run.budget, CAT) == {}  # the same Redis: nothing to reconcile
    # When Redis restarts from its AOF (its run_id changes) and the producer sees it again
    restartable.stop()
    restartable.start()
    run.recovery.redis_was_down()
    assert run.recovery.ensure_run([CAT]) is False  # the run survived in the AOF
    # Then the sample on disk is final in Redis
    assert final_marks(run.budget, CAT) == {"a": codec.committed(30)}
    assert run.budget.telemetry.status()["categories"][CAT]["used"] == 30
    client.close()


def test_finalize_clears_what_killed_workers_left_in_rqs_registries(tmp_path: Path,
                                                                    redis: Redis) -> None:
    run = Run(redis, tmp_path / "out")
    feed(run.budget, "s1")
    run.enqueue(CAT, [("s1", run.seq("s1"), 3)])
    # Given a worker that took the job and was killed while it ran: RQ still lists it started
    dequeued = run.queue.dequeue_any([run.queue], None, connection=redis)
    assert dequeued is not None
    job = dequeued[0]
    with redis.pipeline() as pipe:
        Execution.create(job, JOB_TIMEOUT_S, pipe)
        pipe.execute()
    registry = run.queue.started_job_registry
    assert redis.zcard(registry.key) == 1
    # When the run ends
    run.recovery.finalize()
    # Then no job is left started, nor its hash, nor RQ's intermediate list
    assert redis.zcard(registry.key) == 0 and not redis.exists(job.key)
    assert not redis.exists(run.queue.intermediate_queue_key)
