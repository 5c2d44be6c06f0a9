"""Producer SIGKILL and restart; a chaos run mixing worker kills, a Redis restart and 503
bursts; Redis latency and cut connections through a TCP proxy."""

from __future__ import annotations

import random
import signal
import subprocess
import sys

import pytest

from sglang_sim.testing import SimServer
from testing.harness import Pipeline, RedisServer, ledger_state, started, wait_until
from tests.conftest import ROOT
from tests.faults.common import Background, two_category_config
from tests.faults.proxy import Proxy

pytestmark = pytest.mark.slow


def used_total(pipe: Pipeline) -> int:
    return sum(ledger_state(pipe.budget, c)["used"] for c in ("a", "b"))


def test_producer_sigkill_and_restart(tmp_path, redis_url) -> None:
    cfg = two_category_config(tmp_path, cap_a=12000, cap_b=8000)
    cfg_path = tmp_path / "run.toml"
    argv = [sys.executable, "-m", "tokencap.cli", "run", str(cfg_path), "--redis-url", redis_url]
    with SimServer(time_scale=60.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])
        try:
            pipe.start_writer()
            pipe.start_workers(4)
            first = subprocess.Popen(argv + ["--sglang-url", sim.url], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_until(lambda: used_total(pipe) >= 5000, timeout_s=60, what="progress")
            first.send_signal(signal.SIGKILL)
            assert first.wait(30) == -signal.SIGKILL
            # restart at once: it waits for the dead producer's lock, then resumes
            second = subprocess.run(argv + ["--sglang-url", sim.url], cwd=ROOT,
                                    capture_output=True, text=True, timeout=180)
            assert second.returncode == 0, second.stderr[-2000:]
            pipe.build()  # to read the shuffled order and cursor for the gap check
            status = pipe.budget.telemetry.status()
        finally:
            pipe.close()
    pipe.check_invariants(status)
    assert {st["state"] for st in status["categories"].values()} == {"closed"}


def test_chaos_worker_kills_redis_restart_and_503_bursts(tmp_path) -> None:
    rng = random.Random(42)
    server = RedisServer(tmp_path / "redis", aof=True).start()
    cfg = two_category_config(tmp_path, cap_a=24000, cap_b=16000)
    try:
        with SimServer(time_scale=80.0) as sim:
            with started(cfg, server.url, [sim.url], 6) as pipe:
                bg = Background(pipe).start()
                for step in range(1, 9):
                    wait_until(lambda s=step: used_total(pipe) >= s * 3500, timeout_s=90,
                               what=f"progress to step {step}")
                    if step % 2:
                        busy = pipe.busy_worker_pids()
                        if busy:
                            pipe.kill_worker(rng.choice(busy))
                            pipe.start_workers(1)
                    if step in (2, 6):
                        sim.set_faults(error_burst={503: 12})
                    if step == 4:
                        server.kill()
                        server = RedisServer(server.data_dir, aof=True, port=server.port).start()
                status = bg.join(240)
        pipe.check_invariants(status)
        for c in ("a", "b"):
            st = status["categories"][c]
            assert st["state"] == "closed" and st["failed"] == 0
            assert st["overshoot"] < 512
    finally:
        server.kill()


def test_redis_latency_and_cut_connections_through_a_proxy(tmp_path, redis_server) -> None:
    proxy = Proxy("127.0.0.1", redis_server.port).start()
    url = f"redis://{proxy.url_host_port}/0"
    from redis import Redis

    Redis.from_url(redis_server.url).flushdb()
    cfg = two_category_config(tmp_path, cap_a=6000, cap_b=4000)
    try:
        with SimServer(time_scale=100.0) as sim:
            with started(cfg, url, [sim.url], 3) as pipe:
                proxy.latency_s = 0.02  # every Redis round trip is slow
                bg = Background(pipe).start()
                wait_until(lambda: used_total(pipe) >= 3000, timeout_s=90, what="progress")
                assert proxy.cut() > 0  # every client loses its connection at once
                proxy.latency_s = 0.0
                status = bg.join(180)
        pipe.check_invariants(status)
        assert {st["state"] for st in status["categories"].values()} == {"closed"}
    finally:
        proxy.stop()
