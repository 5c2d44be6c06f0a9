"""The producer loop's pacing: leases are checked on an interval, not on every tick."""

from __future__ import annotations

from producer import feeder
from tests.faults.common import two_category_config
from tokencap.harness import Pipeline


def test_leases_are_checked_on_an_interval_and_again_while_some_expired(tmp_path,
                                                                        redis_url) -> None:
    cfg = two_category_config(tmp_path)  # lease_s = 1.0
    pipe = Pipeline(cfg, redis_url, ["http://127.0.0.1:9"])
    producer = pipe.build()
    assert producer.reap_every_s == min(feeder.REAP_EVERY_S, cfg.lease_s / 4)
    producer.reap_every_s = 3600.0  # only the "found something" rule can bring it back
    found = {"a": [1, 0], "b": [0, 0]}  # category a finds one expired lease on its first look
    calls: list[str] = []

    def reap(feed) -> int:
        calls.append(feed.cat.name)
        left = found[feed.cat.name]
        return left.pop(0) if left else 0

    producer.reap = reap
    producer.tick()
    assert calls == ["a", "b"]  # the first tick looks
    producer.tick()
    assert calls == ["a", "b", "a", "b"]  # something had expired: look again at once
    producer.tick()
    producer.tick()
    assert calls == ["a", "b", "a", "b"]  # nothing found: wait for the interval
