"""The producer loop's pacing: leases are checked on an interval, not on every tick. Sources
that arrive while the run goes on (`Arriving`): opened at the tick that hears of them (again,
with the ledger told their size, when they grew), one not opened for Redis's sake opened at
the next, the run not finished before they settled."""

from __future__ import annotations

import pytest

from producer import recovery
from sglang_sim.testing import SimServer
from testing.harness import Pipeline
from tests.faults.common import two_category_config


def test_leases_are_checked_on_an_interval_and_again_while_some_expired(tmp_path,
                                                                        redis_url) -> None:
    cfg = two_category_config(tmp_path)  # lease_s = 1.0
    pipe = Pipeline(cfg, redis_url, ["http://127.0.0.1:9"])
    producer = pipe.build()
    assert producer.recovery.reap_every_s == min(recovery.REAP_EVERY_S, cfg.lease_s / 4)
    producer.recovery.reap_every_s = 3600.0  # only the "found something" rule can bring it back
    found = {"a": [1, 0], "b": [0, 0]}  # category a finds one expired lease on its first look
    calls: list[str] = []

    def requeue_expired(name: str) -> int:
        calls.append(name)
        left = found[name]
        return left.pop(0) if left else 0

    producer.recovery._requeue_expired = requeue_expired  # type: ignore[method-assign]
    producer.tick()
    assert calls == ["a", "b"]  # the first tick looks
    producer.tick()
    assert calls == ["a", "b", "a", "b"]  # something had expired: look again at once
    producer.tick()
    producer.tick()
    assert calls == ["a", "b", "a", "b"]  # nothing found: wait for the interval


class Arrivals:
    """An `Arriving` a test steers: the names it says next, and whether it settled."""

    def __init__(self) -> None:
        self.next: list[str] = []
        self.done = False

    def arrived(self) -> list[str]:
        out, self.next = self.next, []
        return out

    def settled(self) -> bool:
        return self.done


def test_sources_that_arrive_are_opened_as_they_do_and_the_run_waits_for_them(
        tmp_path, redis_url) -> None:
    from redis.exceptions import ConnectionError as RedisDown

    from producer.feeder import Producer

    cfg = two_category_config(tmp_path, prompts=8)
    pipe = Pipeline(cfg, redis_url, ["http://127.0.0.1:9"])
    pipe.budget.feeding.init_run(cfg)
    arriving = Arrivals()
    producer = Producer(cfg, pipe.redis, None, arriving=arriving)
    producer.tick()
    assert producer.feeds == {} and not producer.finished()  # nothing arrived: nothing fed
    arriving.next = ["b"]
    producer.tick()
    assert list(producer.feeds) == ["b"] and producer.feeds["b"].cursor > 0
    # a arrives while Redis is away: not lost, opened at the next tick
    size = producer.budget.feeding.source_size
    gone = {"once": True}

    def away(name: str, records: int) -> bool:
        if gone.pop("once", False):
            raise RedisDown("away")
        return size(name, records)

    producer.budget.feeding.source_size = away  # type: ignore[method-assign]
    arriving.next = ["a"]
    with pytest.raises(RedisDown):
        producer.tick()
    assert "a" not in producer.feeds
    producer.tick()
    assert list(producer.feeds) == ["b", "a"]
    assert not producer.finished()  # not settled: more may come


def snapshot(redis) -> dict:
    return {k: (redis.dump(k), max(0, redis.pttl(k))) for k in redis.keys("*")}


def restore(redis, snap: dict) -> None:
    redis.flushdb()
    for key, (data, ttl_ms) in snap.items():
        redis.restore(key, ttl_ms, data)


@pytest.mark.parametrize("prompts", [200, 8])
def test_feeds_redis_lost_are_fed_again(tmp_path, redis, redis_url, prompts: int) -> None:
    """Redis restarted from an AOF that misses the last feeds (appendfsync everysec) while the
    producer kept its cursor: the cursor's compare-and-set finds it, the samples are fed
    again, none is left without a terminal state (the chaos test's failure, root-caused).
    With 8 prompts the lost feed used the source up: the producer must not mark the
    category exhausted on its own cursor."""
    cfg = two_category_config(tmp_path, cap_a=10**9, cap_b=10**9, extra="high_water = 8",
                              prompts=prompts)
    with SimServer(time_scale=1000.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])
        try:
            producer = pipe.build()
            before = snapshot(redis)
            producer.tick()  # Given feeds of 8 samples per category...
            assert [producer.feeds[c].cursor for c in ("a", "b")] == [8, 8]
            restore(redis, before)  # ... that Redis lost, the producer not knowing
            producer.tick()  # When the producer goes on (feeds, or ends a used-up source)
            assert [producer.feeds[c].cursor for c in ("a", "b")] == [0, 0]
            assert pipe.budget.telemetry.status()["categories"]["a"]["state"] == "open"
            assert pipe.budget.feeding.cursor("a") == 0
            # nothing was written from the stale cursor
            assert pipe.budget.telemetry.status()["categories"]["a"]["pending"] == 0
            pipe.start_writer()
            pipe.start_workers(2)
            status = pipe.run()
        finally:
            pipe.close()
    # Then the run ends with every fed sample final, the lost feeds included
    pipe.check_invariants(status)
    assert status["categories"]["a"]["samples"] == status["categories"]["b"]["samples"] \
        == prompts


def test_feeding_depth_is_shared_by_the_categories_that_can_still_be_fed(
        tmp_path, redis_url) -> None:
    pipe = Pipeline(two_category_config(tmp_path), redis_url, ["http://127.0.0.1:9"])
    producer = pipe.build()
    producer._workers, producer._workers_at = 72, float("inf")  # 72 workers registered
    producer.tick()
    assert producer.high_water() == 72  # 2 x 72 over two open categories
    pipe.budget.operating.set_cap("b", 0)  # closes it
    producer.tick()
    assert producer.high_water() == 144  # b closed: a gets every worker's share
