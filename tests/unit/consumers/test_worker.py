"""The tokencap worker's RQ bookkeeping: the worker heartbeat in one round trip, not
repeated within WORKER_BEAT_MIN_S, the worker key kept alive WORKER_TTL_S after a beat
(beaten during a job too), and only workers whose key lives counted."""

from __future__ import annotations

from rq import Queue
from rq.worker import SimpleWorker

from budget_service import jobs
from budget_service.jobs import MsgspecSerializer
from budget_service.keys import Keys
from consumers import worker as worker_mod
from consumers.worker import TokencapWorker, _job_beats, make_worker, run_worker
from testing.harness import wait_until

KEYS = Keys("tokencap", "hb")


def _calls(redis, command: str) -> int:
    return int(redis.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_repeated_heartbeat_is_one_round_trip_then_skipped(redis) -> None:
    w = make_worker(redis, KEYS, ["q"])
    w.register_birth()
    redis.config_resetstat()
    w.heartbeat()
    w.heartbeat()  # within WORKER_BEAT_MIN_S of the first: skipped
    assert _calls(redis, "hset") == 1
    assert _calls(redis, "expire") == 2  # worker key and executions key, once
    ttl = redis.ttl(w.key)
    assert w.worker_ttl == jobs.WORKER_TTL_S
    assert w.worker_ttl - 2 < ttl <= w.worker_ttl  # not RQ's worker_ttl + 60
    w._beat_sent_at -= worker_mod.WORKER_BEAT_MIN_S  # the last beat is now old enough
    w.heartbeat()
    assert _calls(redis, "hset") == 2


def test_heartbeat_with_its_own_ttl_is_never_skipped(redis) -> None:
    w = make_worker(redis, KEYS, ["q"])
    w.register_birth()
    w.heartbeat()
    w.heartbeat(timeout=7)
    assert 0 < redis.ttl(w.key) <= 7


class _RQBeat(TokencapWorker):
    """The same worker with RQ's own heartbeat (three round trips, never skipped)."""

    heartbeat = SimpleWorker.heartbeat


def _burst(redis, worker_class: type[TokencapWorker], queue: str, jobs: int) -> dict[str, int]:
    q = Queue(KEYS.queue_name(queue), connection=redis, serializer=MsgspecSerializer)
    for i in range(jobs):  # refused (not tokencap's function): still one loop per job
        q.enqueue("builtins.len", [i])
    w = make_worker(redis, KEYS, [queue], worker_class=worker_class)
    redis.config_resetstat()
    run_worker(w, burst=True)
    assert q.count == 0
    return {c: _calls(redis, c) for c in ("expire", "hset")}


def test_burst_worker_beats_with_fewer_commands_than_rq(redis) -> None:
    jobs = 20
    ours = _burst(redis, TokencapWorker, "hb.ours", jobs)
    rq = _burst(redis, _RQBeat, "hb.rq", jobs)
    # RQ's beats before and after each dequeue and after each job: 2 EXPIREs each, skipped
    # here while the one pipelined into the suspension check is under a second old
    assert rq["expire"] - ours["expire"] >= 4 * jobs
    assert rq["hset"] - ours["hset"] >= 2 * jobs


def test_a_worker_in_a_job_beats_its_key_from_a_thread(redis, monkeypatch) -> None:
    monkeypatch.setattr(jobs, "WORKER_BEAT_S", 0.05)
    w = make_worker(redis, KEYS, ["q"])
    w.register_birth()
    w.heartbeat(timeout=jobs.WORKER_TTL_S * 100)  # what RQ asks before a job: cut to the TTL
    assert 0 < redis.ttl(w.key) <= jobs.WORKER_TTL_S
    redis.hset(w.key, "last_heartbeat", "before")
    with _job_beats.during(w):  # as while SimpleWorker runs a job (no beat of its own)
        wait_until(lambda: redis.hget(w.key, "last_heartbeat") != b"before",
                   what="a beat during the job")
    assert 0 < redis.ttl(w.key) <= jobs.WORKER_TTL_S


def test_only_workers_whose_key_lives_count_and_rq_cleans_the_rest(redis) -> None:
    live, killed = make_worker(redis, KEYS, ["count"]), make_worker(redis, KEYS, ["count"])
    for w in (live, killed):
        w.register_birth()
        w.heartbeat()
    registry = f"rq:workers:{KEYS.queue_name('count')}"
    assert jobs.worker_count(redis, KEYS, "count") == 2
    redis.delete(killed.key)  # its last beat is WORKER_TTL_S old: the key expired
    assert jobs.worker_count(redis, KEYS, "count") == 1
    assert redis.scard(registry) == 2  # still registered
    jobs.clean_workers(redis, KEYS, ["count"])
    assert redis.smembers(registry) == {live.key.encode()}
