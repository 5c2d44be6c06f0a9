"""Operating a run: metrics, caps changed live, several engines with one dying, adaptive
concurrency."""

from __future__ import annotations

import json
import statistics

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from budget_service.telemetry import render_metrics
from sglang_sim.testing import SimServer, free_port, start_sim_subprocess
from testing.harness import Pipeline, ledger_state, started, wait_until
from tests.conftest import write_config
from tests.faults.common import Background, two_category_config


def samples_of(text: str, name: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name]


def test_metrics_agree_with_status_and_count_engine_requests(tmp_path, redis_url) -> None:
    cfg = two_category_config(tmp_path, cap_a=3000, cap_b=2000)
    with SimServer(time_scale=500.0) as sim:
        with started(cfg, redis_url, [sim.url], 3) as pipe:
            status = pipe.run()
            wait_until(lambda: pipe.budget.telemetry.workers() == 3, what="3 workers")
            page = render_metrics(pipe.budget.telemetry).decode()
            (workers,) = samples_of(page, "tokencap_workers")
            pipe.kill_workers(15)  # SIGTERM: workers flush their counters on the way out
        sim_requests = sim.stats()["requests_total"]
    assert workers.value == 3 and workers.labels == {"run": cfg.run}
    text = render_metrics(pipe.budget.telemetry).decode()
    used = {s.labels["category"]: s.value for s in samples_of(text, "tokencap_used_tokens")}
    assert used == {c: st["used"] for c, st in status["categories"].items()}
    committed = {s.labels["category"]: s.value for s in samples_of(text, "tokencap_samples_total")
                 if s.labels["outcome"] == "committed"}
    assert committed == {c: st["samples"] for c, st in status["categories"].items()}
    ok = sum(s.value for s in samples_of(text, "tokencap_engine_requests_total")
             if s.labels["outcome"] == "ok")
    assert ok == sim_requests == sum(st["samples"] for st in status["categories"].values())
    (latency,) = samples_of(text, "tokencap_engine_request_duration_seconds_count")
    assert latency.labels == {"run": cfg.run, "engine": sim.url} and latency.value == ok
    every = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert every and all(s.labels.get("run") == cfg.run for s in every)


def test_raising_a_closed_cap_reopens_and_lowering_an_open_one_closes(tmp_path,
                                                                      redis_url) -> None:
    cfg = two_category_config(tmp_path, cap_a=2000, cap_b=6000, max_new=256)
    events: dict = {}
    with SimServer(time_scale=100.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])

        def operator() -> bool:
            st = pipe.budget.telemetry.status()["categories"]
            if "raised" not in events and st["a"]["state"] == "closed":
                # a closed category gets more budget: it must reopen and finish at 5,000
                events["raised"] = pipe.budget.operating.set_cap("a", 5000)
            # b is lowered only once a was raised: lowered first, b closed before a did, and
            # the run could end on both closed before this look saw a closed
            if "raised" in events and "lowered" not in events and st["b"]["used"] >= 2000:
                pipe.budget.operating.set_cap("b", st["b"]["used"])
                # closed, nothing more is admitted: what can still commit is what was final
                # or reserved then, read in one transaction (read apart, and before the cap
                # change, a worker could admit a sample, or commit one, between the reads)
                ck = pipe.keys.cat("b")
                tx = pipe.redis.pipeline(transaction=True)
                tx.hkeys(ck.final)
                tx.hkeys(ck.reserved)
                final, reserved = tx.execute()
                events["lowered"] = ({k.decode() for k in final},
                                     {k.decode() for k in reserved})
            return False

        try:
            pipe.build()
            pipe.start_writer()
            pipe.start_workers(4)
            status = pipe.run(should_stop=operator)
        finally:
            pipe.close()
    pipe.check_invariants(status)
    closed_before, old_cap = events["raised"]
    assert (closed_before, old_cap) == (False, 2000)
    a = status["categories"]["a"]
    assert a["cap"] == 5000 and a["state"] == "closed" and 5000 <= a["used"] < 5000 + 256
    committed, in_flight = events["lowered"]
    b_ids = {r["id"] for r in pipe.records("b")}
    # nothing was sent for b after its cap was lowered: only what was already in flight
    assert b_ids <= committed | in_flight
    assert status["categories"]["b"]["state"] == "closed"


@pytest.mark.slow
def test_two_engines_one_killed_midway_and_back(tmp_path, redis_url) -> None:
    port = free_port()
    args = ["--time-scale", "60"]
    proc_a, url_a = start_sim_subprocess(args, port=port)
    cfg = two_category_config(tmp_path, cap_a=400_000, cap_b=400_000, max_new=256)
    with SimServer(time_scale=60.0) as sim_b:
        pipe = Pipeline(cfg, redis_url, [url_a, sim_b.url])
        try:
            pipe.build()
            pipe.start_writer()
            pipe.start_workers(6)
            bg = Background(pipe).start()
            wait_until(lambda: ledger_state(pipe.budget, "a")["used"] >= 3000, what="progress")
            proc_a.kill()  # engine A dies with requests in flight
            proc_a.wait()
            used_at_kill = ledger_state(pipe.budget, "a")["used"]
            wait_until(lambda: ledger_state(pipe.budget, "a")["used"] >= used_at_kill + 3000,
                       timeout_s=60, what="progress on engine B alone")
            proc_a, _ = start_sim_subprocess(args, port=port)  # A comes back
            wait_until(lambda: requests.get(f"{url_a}/_sim/stats", timeout=5)
                       .json()["finished_total"] >= 3, timeout_s=60,
                       what="engine A to receive work again")
            for c in ("a", "b"):  # end the run now
                pipe.budget.operating.set_cap(c, int(ledger_state(pipe.budget, c)["used"]))
            status = bg.join(120)
        finally:
            pipe.close()
            proc_a.kill()
            proc_a.wait()
    pipe.check_invariants(status)
    assert all(st["failed"] == 0 for st in status["categories"].values())


@pytest.mark.slow
def test_adaptive_concurrency_keeps_the_engine_queue_short(tmp_path, redis_url) -> None:
    workers, batch, bound = 16, 4, 2
    src = tmp_path / "ids.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [700 + i, 1, 2]}) + "\n" for i in range(400)))
    cfg = write_config(tmp_path, f"""
run = "adaptive"
sampling_defaults = "engine"
output_dir = "{tmp_path / 'out'}"
adaptive_max_queue = {bound}
# this measures the gate: no admission margin tapering the small cap (31 outputs)
margin_sigmas = 0
[[category]]
name = "x"
source = "{src}"
format = "input_ids"
cap_tokens = 8000
sampling = {{ max_new_tokens = 256 }}
""")
    queued: list[int] = []
    # requests last ~1 s of wall time, long next to the gate's 0.1 s metric refresh
    with SimServer(time_scale=10.0, max_running_requests=batch) as sim:

        def sample_queue() -> bool:
            queued.append(sim.stats()["queued"])
            return False

        with started(cfg, redis_url, [sim.url], workers) as pipe:  # 4x the engine's batch
            status = pipe.run(should_stop=sample_queue)
            pipe.kill_workers(15)  # SIGTERM: workers flush their counters on the way out
    pipe.check_invariants(status)
    # The gate engaged: workers waited while the engine's queue was at the bound. What it
    # guarantees is a reading below the bound before each request, not a hard ceiling
    # (workers read independently; on a loaded machine a reading ages before its request
    # lands), so the queue is held to well below what ungated workers make of it: all
    # `workers - batch` of them waiting in the engine.
    waits = pipe.budget.telemetry.engine_counts().get(f"{sim.url}|gate_waits", 0)
    assert waits > 0
    assert statistics.median(queued) <= bound and max(queued) < workers - batch
    # (that the gate keeps the engine's batch full is a throughput figure: `make bench`,
    # scenario adaptive, measures it against the best fixed worker count)


@pytest.mark.parametrize("bad", ["x", "-1"])
def test_cap_set_cli_refuses_bad_input(bad) -> None:
    from click.testing import CliRunner

    from tokencap.cli.main import main

    out = CliRunner().invoke(main, ["cap", "set", "a", bad])
    assert out.exit_code == 2


def test_worker_pool_restarts_a_dead_worker_and_stops_on_sigterm(tmp_path, redis_url) -> None:
    import os
    import signal
    import subprocess
    import sys

    from rq import Queue, Worker

    from tests.conftest import ROOT

    cfg = two_category_config(tmp_path)
    sim = SimServer(time_scale=1000.0).start()  # a worker starts only on a usable engine
    pipe = Pipeline(cfg, redis_url, [sim.url])
    pipe.budget.feeding.init_run(cfg)
    queue = Queue(pipe.keys.queue_name("a"), connection=pipe.redis)
    pool = subprocess.Popen([sys.executable, "-m", "tokencap.cli", "worker", "--pool", "3"],
                            env=pipe.env(), cwd=ROOT)
    try:
        def alive() -> list[int]:
            return sorted(w.pid for w in Worker.all(connection=pipe.redis, queue=queue)
                          if w.pid and _pid_alive(w.pid))

        first = wait_until(lambda: len(alive()) == 3 and alive(), timeout_s=60,
                           what="3 pool workers")
        os.kill(first[0], signal.SIGKILL)
        wait_until(lambda: len(alive()) == 3 and first[0] not in alive(), timeout_s=60,
                   what="the pool to replace the killed worker")
        pool.send_signal(signal.SIGTERM)
        assert pool.wait(60) == 0
        assert alive() == []
    finally:
        if pool.poll() is None:
            pool.kill()
        sim.stop()


def _pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
