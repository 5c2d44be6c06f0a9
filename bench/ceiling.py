"""Orchestration ceiling: jobs/s through the whole pipeline when the engine answers at once,
over plain RQ SimpleWorkers running a no-op job, same Redis, same number of worker
processes, same job count. Also Redis commands and round trips per job for both.

Pipeline: one category, JOBS pre-tokenized 8-token prompts, a simulator at time_scale 1e6
with 2-token outputs; WORKERS consumers registered and idle before the clock starts; the
clock runs from the producer's start until every sample is committed (the writer keeps
writing alongside). Plain RQ: WORKERS `bench.noop` SimpleWorkers registered and idle, JOBS
no-op jobs enqueued in one pipeline at the start, the clock runs until all are finished.
A third run starts WORKERS burst-mode workers on JOBS queued jobs (worker start-up included).
Done-counts are polled every POLL_S with one Redis command (subtracted from the counts).
Commands are INFO total_commands_processed (commands run inside Lua and MULTI/EXEC
included); round trips are INFO total_writes_processed (one reply write per request or
pipeline).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Any

import psutil
from rq import Queue, Worker
from rq.registry import FinishedJobRegistry

from bench import noop
from bench.context import PY, Bench, log, row, wait_for
from bench.measure import Pipeline, Sampler, commandstats, counters, delta
from bench.sim import Sim, SimSettings
from bench.sources import Cat, config_toml, load_run_config
from testing.harness import child_env

NAME = "ceiling"
JOBS = 1500
WORKERS = 16
POLL_S = 0.02
TARGET = 0.6
CAT = Cat("ping", 2, 0.0, 4, prompts=JOBS)
TOP_COMMANDS = 12
# the seed run's engines: 8 GPUs each, ~0.4-0.5 samples/s (~1,000 output tok/s)
SEED_ENGINE_SAMPLES_S = 0.45
SINGLE_PROCESSES = ("Redis", "producer", "writer")
SINGLE_TARGET_MS = 1.0


def _rate(samples: list[tuple[float, int]], total: int, t0: float) -> dict[str, float]:
    """End-to-end jobs/s (t0 to the first sample with everything done) and the 10-90% rate."""

    def first(frac: float) -> float:
        return next(t for t, n in samples if n >= frac * total)

    t_end = first(1.0)
    return {"jobs_s": total / (t_end - t0), "jobs_s_10_90": 0.8 * total / (first(0.9) -
                                                                        first(0.1)),
            "wall_s": t_end - t0}


def _cpu(pids: dict[str, list[int]], threads: dict[str, int] | None = None
         ) -> dict[str, float]:
    """CPU seconds so far of each group of processes, and of each named thread of this
    process (`threads`: name -> native thread id: the producer, the writer)."""
    out = {}
    for group, members in pids.items():
        total = 0.0
        for pid in members:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        out[group] = total
    if threads:
        times = {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
        for name, tid in threads.items():
            out[name] = times.get(tid, 0.0)
    return out


def _measure(bench: Bench, start: Any, done: Any, pids: dict[str, list[int]] | None = None,
             wait_done: float = 120.0, threads: dict[str, int] | None = None
             ) -> dict[str, Any]:
    """Run `start()`, poll `done()` until JOBS, return rates, Redis and CPU figures per job
    (`threads`: threads of this process timed on their own, also inside its total)."""
    srv = bench.redis
    pids = {"redis": [srv.proc.pid], "bench process": [os.getpid()], **(pids or {})}
    before, cmds0 = counters(srv.client), commandstats(srv.client)
    cpu0 = _cpu(pids, threads)
    sampler = Sampler(done, POLL_S)
    t0 = time.monotonic()
    sampler.start()
    start()
    wait_for(lambda: sampler.samples and sampler.samples[-1][1] >= JOBS, "all jobs done",
             wait_done)
    samples = sampler.stop()
    cpu = delta(_cpu(pids, threads), cpu0)
    d = delta(counters(srv.client), before)
    cmds = {k: v - cmds0.get(k, 0) for k, v in commandstats(srv.client).items()}
    own = sampler.calls  # one command and one round trip per poll
    out = _rate(samples, JOBS, t0)
    out["commands_per_job"] = (d["commands"] - own) / JOBS
    out["round_trips_per_job"] = (d["round_trips"] - own) / JOBS
    out["redis_cpu_ms_per_job"] = d["cpu_s"] * 1000 / JOBS
    top = sorted(cmds.items(), key=lambda kv: -kv[1])[:TOP_COMMANDS]
    out["top_commands_per_job"] = {k: round(v / JOBS, 2) for k, v in top if v > 0}
    out["cpu_ms_per_job"] = {k: round(v * 1000 / JOBS, 3) for k, v in cpu.items()}
    out["cpu_ms_per_job"]["all"] = round(sum(v for k, v in cpu.items()
                                             if k not in (threads or {})) * 1000 / JOBS, 3)
    return out


def pipeline(bench: Bench, sim: Sim) -> dict[str, Any]:
    bench.fresh_redis()
    d = bench.run_dir("ceiling")
    sources = bench.sources("ceiling", [CAT], 8, 8)
    cfg = load_run_config(d / "run.toml", config_toml("ceil", d / "out", [CAT], sources,
                                                       context_length=32768))
    pipe = Pipeline(cfg, bench.redis.url, sim.url, d / "workers.log")
    try:
        pipe.start(WORKERS)
        state = pipe.keys.cat(CAT.name).state
        redis = pipe.redis

        def done() -> int:
            return int(redis.hget(state, "samples") or 0)

        result: dict[str, Any] = {}

        def start() -> None:
            result["status"] = pipe.run()

        writer = pipe._writer_thread
        assert writer is not None and writer.native_id is not None
        out = _measure(bench, start, done, {"workers": [p.pid for p in pipe.workers],
                                            "simulator": [sim.proc.pid]},
                       threads={"producer": threading.get_native_id(),
                                "writer": writer.native_id})
        out["committed"] = done()
    finally:
        pipe.close()
    return out


def scale_model(pipe: dict[str, Any]) -> dict[str, Any]:
    """How far one stack goes: its workers scale out across hosts, its single processes do
    not. The CPU each of those spends per committed sample sets the stack's ceiling (one
    core each); the seed's engines (8 GPUs each) commit SEED_ENGINE_SAMPLES_S samples/s."""
    cpu = pipe["cpu_ms_per_job"]
    per = {"Redis": cpu["redis"], "producer": cpu["producer"], "writer": cpu["writer"]}
    first = max(per, key=lambda k: per[k])
    ceiling = 1000.0 / per[first] if per[first] > 0 else 0.0
    return {"cpu_ms_per_sample": per, "saturates_first": first,
            "ceiling_samples_s": ceiling, "seed_engines": ceiling / SEED_ENGINE_SAMPLES_S,
            "measured_samples_s": pipe["jobs_s"],
            "redis_commands_per_sample": pipe["commands_per_job"],
            "redis_round_trips_per_sample": pipe["round_trips_per_job"]}


def _rq_workers(bench: Bench, queue: str, burst: bool) -> list[subprocess.Popen]:
    logf = (bench.dir / "noop-workers.log").open("ab")
    argv = [PY, "-m", "bench.noop", bench.redis.url, queue] + (["--burst"] if burst else [])
    return [subprocess.Popen(argv, env=child_env(), stdout=logf, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL) for _ in range(WORKERS)]


def _enqueue(q: Queue, func: str = "bench.noop.noop", args: tuple = ()) -> None:
    jobs = [Queue.prepare_data(func, args=args) for _ in range(JOBS)]
    with q.connection.pipeline() as pipe:
        q.enqueue_many(jobs, pipeline=pipe)
        pipe.execute()


def plain_rq(bench: Bench, sim: Sim | None = None) -> dict[str, Any]:
    """Pre-started SimpleWorkers; the no-op job, or with `sim` one /generate call a job."""
    redis = bench.fresh_redis()
    q = Queue("noop", connection=redis)
    procs = _rq_workers(bench, q.name, burst=False)
    if sim is None:
        func, args, pids = "bench.noop.noop", (), {}
    else:
        func, args = "bench.noop.generate", (sim.url, [1000, 7, 8, 9, 10, 11, 12, 13], CAT.max_new)
        pids = {"simulator": [sim.proc.pid]}
    try:
        wait_for(lambda: Worker.count(connection=redis, queue=q) >= WORKERS,
                 "plain RQ workers to register", 120)
        key = FinishedJobRegistry(queue=q).key
        pids["workers"] = [p.pid for p in procs]
        out = _measure(bench, lambda: _enqueue(q, func, args), lambda: int(redis.zcard(key)),
                       pids)
    finally:
        _stop(procs)
    return out


def _stop(procs: list[subprocess.Popen], terminate: bool = True) -> None:
    killed = noop.stop(procs, terminate)
    if killed:
        log(f"{NAME}: {len(killed)} plain RQ worker(s) outlived their stop by "
            f"{noop.STOP_GRACE_S:g} s (RQ's pubsub thread, bench/noop.py): killed")


def plain_rq_burst(bench: Bench) -> dict[str, Any]:
    redis = bench.fresh_redis()
    q = Queue("noop", connection=redis)
    _enqueue(q)
    key = FinishedJobRegistry(queue=q).key
    procs: list[subprocess.Popen] = []

    def start() -> None:
        procs.extend(_rq_workers(bench, q.name, burst=True))

    out = _measure(bench, start, lambda: int(redis.zcard(key)))
    _stop(procs, terminate=False)
    return out


# Redis's cost per job, the pipeline's row beside plain RQ's no-op job: (what, figure, unit)
REDIS_PER_JOB = (("Redis commands per job", "commands_per_job", "cmd"),
                 ("Redis round trips per job", "round_trips_per_job", "rtt"),
                 ("Redis CPU per job", "redis_cpu_ms_per_job", "ms"))


def run(bench: Bench) -> dict[str, Any]:
    settings = SimSettings(time_scale=1e6, default=(CAT.mean, CAT.sigma),
                           max_running_requests=256)
    with Sim(bench.dir, "ceiling", settings) as sim:
        log(f"{NAME}: pipeline, {WORKERS} consumers, {JOBS} jobs, instant engine")
        pipe = pipeline(bench, sim)
        log(f"{NAME}: plain RQ SimpleWorkers, a job that only calls /generate")
        rq_http = plain_rq(bench, sim)
    log(f"{NAME}: plain RQ SimpleWorkers, no-op job")
    rq = plain_rq(bench)
    log(f"{NAME}: plain RQ SimpleWorkers in burst mode")
    burst = plain_rq_burst(bench)
    ratio = pipe["jobs_s"] / rq["jobs_s"]
    scale = scale_model(pipe)
    rows = [
        row(NAME, f"jobs/s, {WORKERS} workers (pipeline vs RQ no-op)", pipe["jobs_s"],
            rq["jobs_s"], "jobs/s", f">= {TARGET}", ratio >= TARGET),
        row(NAME, "jobs/s, 10-90% window (pipeline vs RQ no-op)", pipe["jobs_s_10_90"],
            rq["jobs_s_10_90"], "jobs/s"),
        row(NAME, "jobs/s (pipeline vs RQ burst, start incl.)", pipe["jobs_s"],
            burst["jobs_s"], "jobs/s"),
        row(NAME, "jobs/s (pipeline vs RQ job = one /generate)", pipe["jobs_s"],
            rq_http["jobs_s"], "jobs/s"),
        row(NAME, "CPU ms per job, all processes (pipeline vs RQ)", pipe["cpu_ms_per_job"]["all"],
            rq["cpu_ms_per_job"]["all"], "ms"),
        *(row(NAME, f"{what} (pipeline vs RQ)", pipe[key], rq[key], unit)
          for what, key, unit in REDIS_PER_JOB),
        *(row(NAME, f"scale: {part} CPU per committed sample (one per stack)",
              scale["cpu_ms_per_sample"][part], None, "ms", f"<= {SINGLE_TARGET_MS:g} ms",
              scale["cpu_ms_per_sample"][part] <= SINGLE_TARGET_MS)
          for part in SINGLE_PROCESSES),
        row(NAME, f"scale: samples/s one stack can commit (first to saturate: "
            f"{scale['saturates_first']}) vs measured here", scale["ceiling_samples_s"],
            pipe["jobs_s"], "samples/s"),
        row(NAME, f"scale: seed-sized engines one stack serves ({SEED_ENGINE_SAMPLES_S} "
            "samples/s each)", scale["seed_engines"], None, "engines", ">= 2000",
            scale["seed_engines"] >= 2000),
    ]
    return {"figures": {"pipeline": pipe, "plain_rq": rq, "plain_rq_burst": burst,
                        "plain_rq_generate": rq_http, "scale": scale,
                        "ratio": ratio, "target": f">= {TARGET}"},
            "settings": {"jobs": JOBS, "workers": WORKERS, "poll_s": POLL_S,
                         "sim_time_scale": 1e6, "output_tokens": 2, "prompt_tokens": 8},
            "rows": rows}
