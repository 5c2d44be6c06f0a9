"""One producer per run: its lease (redis-py `Lock`), and two producers started at once."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from budget_service.keys import Keys
from budget_service.lease import producer_lease
from foundation.errors import ProducerBusy
from sglang_sim.testing import SimServer
from testing.harness import wait_until
from tests.conftest import ROOT
from tests.faults.common import two_category_config

KEYS = Keys("tokencap", "lock")


def test_a_second_lock_is_refused_and_names_the_holder(redis, caplog) -> None:
    first = producer_lease(redis, KEYS, ttl_s=5.0)
    first.acquire(wait_s=0)
    second = producer_lease(redis, KEYS, ttl_s=5.0)
    with pytest.raises(ProducerBusy, match=first.token):
        second.acquire(wait_s=0.3)
    # the wait was said, with whom it waited for (after a crash: the killed producer)
    assert f"held by {first.token}: waiting up to 0.3 s" in caplog.text
    first.release()
    second.acquire(wait_s=0)  # free again
    assert redis.get(KEYS.producer_lock) == second.token.encode()


def test_renew_takes_back_a_lost_lock_and_fails_on_a_stolen_one(redis) -> None:
    lock = producer_lease(redis, KEYS, ttl_s=5.0)
    lock.acquire(wait_s=0)
    redis.delete(KEYS.producer_lock)  # Redis restarted empty
    lock._renewed_at = float("-inf")
    lock.renew()
    assert redis.get(KEYS.producer_lock) == lock.token.encode()
    redis.set(KEYS.producer_lock, "someone-else")  # it expired while we stalled, then taken
    lock._renewed_at = float("-inf")
    with pytest.raises(ProducerBusy, match="lost the producer lease"):
        lock.renew()
    lock.release()  # not ours: left alone
    assert redis.get(KEYS.producer_lock) == b"someone-else"


def test_two_producers_started_at_once_one_runs_the_other_exits_6(tmp_path, redis_url) -> None:
    # Given a run with no workers (the producer that gets the lock keeps feeding)
    cfg = two_category_config(tmp_path)  # lock_ttl_s = 2: the other waits 3 s for it
    sim = SimServer(time_scale=1000.0).start()  # the preflight needs an engine
    argv = [sys.executable, "-m", "tokencap.cli", "run", str(tmp_path / "run.toml"),
            "--redis-url", redis_url, "--sglang-url", sim.url]
    # When two producers start at the same time
    procs = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    try:
        # Then exactly one gives up, with exit code 6 and a message naming the other
        done = wait_until(lambda: [p for p in procs if p.poll() is not None], timeout_s=60,
                          what="one producer to give up")
        assert len(done) == 1
        (loser,) = done
        (winner,) = [p for p in procs if p is not loser]
        out, err = loser.communicate()
        assert loser.returncode == 6, err
        assert "another producer is running run 'faults'" in err and "Traceback" not in err
        # and the other kept running: it feeds, and stops cleanly when asked
        assert winner.poll() is None
        from redis import Redis

        keys = Keys(cfg.key_prefix, cfg.run)
        client = Redis.from_url(redis_url)
        wait_until(lambda: client.hlen(keys.cat("a").pending) > 0, what="the winner to feed")
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(30) == 130
        assert client.get(keys.producer_lock) is None  # released on the way out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        sim.stop()
