"""SGLang faults through the whole pipeline: 503/429 storms, one poisoned sample that
always gets 500, a 500 storm's dead samples sent again (`tokencap retry`), stalls past the
read timeout, connection resets, token counts that disagree with output_ids; an engine
that stops answering shown in status with since when."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from sglang_sim.testing import SimServer
from testing.harness import started, wait_until
from tests.conftest import ROOT, write_config
from tests.faults.common import Background, two_category_config

pytestmark = pytest.mark.slow

POISON = 151_000


def run_with(tmp_path, redis_url, faults: dict, *, workers: int = 4, cap_a: int = 6000,
             cap_b: int = 4000, time_scale: float = 200.0, during=None,
             flavor: str = "sglang"):
    cfg = two_category_config(tmp_path, cap_a=cap_a, cap_b=cap_b)
    with SimServer(time_scale=time_scale, flavor=flavor) as sim:
        sim.set_faults(**faults)
        with started(cfg, redis_url, [sim.url], workers) as pipe:
            if during is None:
                status = pipe.run()
            else:
                bg = Background(pipe).start()
                during(sim, pipe)
                status = bg.join(180)
            stats = sim.stats()
    pipe.check_invariants(status)
    return pipe, status, stats


@pytest.mark.parametrize(("status_code", "flavor"), [(503, "sglang"), (429, "sglang"),
                                                     (503, "vllm")])
def test_overload_storm_is_ridden_out(tmp_path, redis_url, status_code, flavor) -> None:
    # 40% of requests refused, for the whole run (SGLang's /generate or vLLM's completions)
    pipe, status, stats = run_with(tmp_path, redis_url, {"error_rates": {status_code: 0.4}},
                                   flavor=flavor)
    assert stats["faults_injected"].get(str(status_code), 0) > 10
    for c in ("a", "b"):
        assert status["categories"][c]["state"] == "closed"
        assert status["categories"][c]["failed"] == 0


def test_poisoned_sample_is_dead_lettered_and_the_rest_goes_on(tmp_path, redis_url) -> None:
    src = tmp_path / "p.jsonl"
    rows = [{"input_ids": [400 + i, 5, 6]} for i in range(60)]
    rows[7] = {"input_ids": [POISON, 5, 6]}
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(tmp_path, f"""
run = "poison"
sampling_defaults = "engine"
output_dir = "{tmp_path / 'out'}"
lease_s = 1.0
max_attempts = 3
http_retries = 1
backoff_max_s = 0.05
[[category]]
name = "p"
source = "{src}"
format = "input_ids"
cap_tokens = 100000000
sampling = {{ max_new_tokens = 64 }}
""")
    with SimServer(time_scale=1000.0) as sim:
        sim.set_faults(poison_token_id=POISON)
        with started(cfg, redis_url, [sim.url], 3) as pipe:
            status = pipe.run()
    pipe.check_invariants(status)
    st = status["categories"]["p"]
    assert st["state"] == "exhausted" and st["samples"] == 59 and st["failed"] == 1
    (dead,) = pipe.dead_letters("p")
    assert dead["id"] == "p:8" and dead["reason"] == "server_error"
    assert dead["attempts"] == 3 and dead["outcome"] == "dead"


def test_dead_samples_of_a_500_storm_are_retried_and_committed_once(tmp_path,
                                                                   redis_url) -> None:
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [400 + i, 5, 6]}) + "\n" for i in range(60)))
    cfg = write_config(tmp_path, f"""
run = "storm"
sampling_defaults = "engine"
output_dir = "{tmp_path / 'out'}"
max_attempts = 1
http_retries = 0
[[category]]
name = "p"
source = "{src}"
format = "input_ids"
cap_tokens = "none"
sampling = {{ max_new_tokens = 64 }}
""")
    with SimServer(time_scale=1000.0) as sim:
        # Given a run through an engine answering 500 to 40% of the requests
        sim.set_faults(error_rates={500: 0.4})
        with started(cfg, redis_url, [sim.url], 3) as first:
            storm = first.run()
        first.check_invariants(storm)
        dead = {d["id"] for d in first.dead_letters("p")}
        assert storm["categories"]["p"]["failed"] == len(dead) > 0
        assert storm["categories"]["p"]["state"] == "exhausted"
        # When the engine is well again and its dead samples are sent again
        sim.set_faults(error_rates={})
        env = {**os.environ, "REDIS_URL": redis_url, "TOKENCAP_RUN": "storm"}
        done = subprocess.run([sys.executable, "-m", "tokencap.cli", "retry", "--reason",
                               "server_error"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"p: {len(dead)} dead sample(s) sent again" in done.stdout
        assert "no producer runs this run" in done.stdout
        # and the run is started again
        with started(cfg, redis_url, [sim.url], 3) as second:
            status = second.run()
    # Then every sample is committed once, the dead letters stay as history
    second.check_invariants(status)
    st = status["categories"]["p"]
    new = [d for d in second.dead_letters("p") if d["id"] not in dead]
    assert (st["samples"], st["failed"], st["state"], new) == (60, 0, "exhausted", [])
    rows = second.records("p")
    assert len(rows) == len({r["id"] for r in rows}) == 60 and dead <= {r["id"] for r in rows}
    assert {d["id"] for d in second.dead_letters("p")} == dead


def test_stall_past_read_timeout_then_recovery(tmp_path, redis_url) -> None:
    def during(sim, pipe):
        # the engine stalls past the 5 s read timeout for a while, then recovers
        sim.set_faults(stall_s=6.0)
        wait_until(lambda: sim.stats()["faults_injected"].get("stall", 0) >= 4, timeout_s=60,
                   what="stalled requests")
        sim.set_faults(stall_s=0.0)

    pipe, status, stats = run_with(tmp_path, redis_url, {}, during=during)
    assert stats["faults_injected"]["stall"] >= 4
    for c in ("a", "b"):
        assert status["categories"][c]["state"] == "closed"


def test_connection_resets_are_retried(tmp_path, redis_url) -> None:
    pipe, status, stats = run_with(tmp_path, redis_url, {"reset_rate": 0.2})
    assert stats["faults_injected"].get("reset", 0) > 3
    assert all(status["categories"][c]["state"] == "closed" for c in ("a", "b"))


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
def test_token_counts_that_disagree_are_never_counted(tmp_path, redis_url, flavor) -> None:
    pipe, status, stats = run_with(tmp_path, redis_url, {"bad_counts_rate": 0.3}, flavor=flavor)
    assert stats["faults_injected"].get("bad_counts", 0) > 3
    for c in ("a", "b"):
        for rec in pipe.records(c):
            assert rec["completion_tokens"] == len(rec["output_ids"])


def test_an_engine_that_stops_answering_is_in_status_with_since_when_until_it_answers(
        tmp_path, redis_url) -> None:
    from foundation.engine.api import engine_specs
    from producer.engine_watch import EngineWatch
    from producer.loop import FeedLoop
    from tests.faults.proxy import Proxy

    cfg = two_category_config(tmp_path, cap_a=400_000, cap_b=400_000)
    with SimServer(time_scale=20.0) as sim:
        proxy = Proxy("127.0.0.1", sim.port).start()
        url = f"http://{proxy.url_host_port}"
        stop = {"now": False}
        bg = None
        try:
            with started(cfg, redis_url, [url], 2) as pipe:
                loop = FeedLoop(pipe.build(), watch=EngineWatch(
                    pipe.budget.telemetry, engine_specs([url]), stall_s=1.0))
                bg = threading.Thread(target=loop.run, daemon=True, kwargs={
                    "poll_s": 0.05, "progress_s": 0.2, "should_stop": lambda: stop["now"]})
                bg.start()
                telemetry = pipe.budget.telemetry
                wait_until(lambda: telemetry.status()["categories"]["a"]["used"] > 0,
                           what="a first commit")
                assert telemetry.status()["engine_trouble"] == {}
                # Given the engine goes away while samples are in flight
                proxy.refuse = True
                proxy.cut()
                wait_until(lambda: url in telemetry.status()["engine_trouble"], timeout_s=60,
                           what="the engine recorded as not answering")
                # Then status says so, with since when (the reason is the last probe's: a
                # refused connection reads as reset or as closed unanswered, by timing)
                trouble = telemetry.status()["engine_trouble"][url]
                assert trouble["why"] and trouble["since_ms"] <= int(time.time() * 1000)
                since = time.strftime("%H:%M:%S", time.localtime(trouble["since_ms"] / 1000))
                env = {**os.environ, "REDIS_URL": redis_url, "TOKENCAP_RUN": cfg.run}
                shown = subprocess.run([sys.executable, "-m", "tokencap.cli", "status"],
                                       cwd=ROOT, env=env, capture_output=True, text=True,
                                       timeout=60)
                line = next((x for x in shown.stdout.splitlines()
                             if x.startswith(f"engine {url}: ")), "")
                assert f"(since {since})" in line, shown.stdout
                # and when it answers again, the trouble is gone
                proxy.refuse = False
                wait_until(lambda: telemetry.status()["engine_trouble"] == {}, timeout_s=60,
                           what="the trouble cleared")
                stop["now"] = True
                bg.join(60)
        finally:
            # the producer thread stops whatever happened: left running, it would feed the
            # next test's run of the same name in the session's Redis
            stop["now"] = True
            if bg is not None:
                bg.join(60)
            proxy.stop()
