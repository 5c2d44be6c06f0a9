"""Footprint: consumer RSS/PSS idle and busy, producer RSS as its source grows from 100k to
1M prompts, Redis memory per queued job and per committed sample.

- Consumers: two `tokencap worker` processes, measured registered and idle, then sampled
  every 0.1 s while each holds a long /generate request in flight (max kept). Baseline: a
  plain RQ SimpleWorker process (bench.noop), idle, the floor of any RQ worker.
- Producer: `tokencap run CONFIG` (the real CLI, its own process) over a generated chat
  JSONL of 100k and of 1M prompts (Qwen2.5 fixture tokenizer), 4 consumers, an instant
  engine, a cap that closes after ~FEED_SAMPLES samples; RSS sampled every 0.1 s.
- Redis: MEMORY USAGE summed over every key (and INFO used_memory, which adds allocator
  and client-buffer overhead) before and after feeding JOBS samples with no consumer
  (queued) and after they were all committed and written (committed), per sample; prompts of
  100 and 1,000 tokens. Baseline: the prompt's own JSON size.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench import noop
from bench.context import PY, Bench, log, row, wait_for
from bench.measure import Pipeline, mem_mb
from bench.sim import Sim, SimSettings
from bench.sources import QWEN, Cat, config_toml, load_run_config
from testing.harness import child_env

NAME = "footprint"
TARGET_MB = 50.0
SOURCE_SIZES = (100_000, 1_000_000)
FEED_SAMPLES = 1000
JOBS = 1000
PROMPT_SIZES = (100, 1000)
PRODUCER_TIMEOUT_S = 120.0


# -- consumers -----------------------------------------------------------------------------
def consumers(bench: Bench) -> dict[str, Any]:
    bench.fresh_redis()
    d = bench.run_dir("fp-workers")
    cat = Cat("long", 4000, 0.2, 8192, prompts=40)
    sources = bench.sources("fp-workers", [cat], 500, 500)
    settings = SimSettings(time_scale=40, lengths={cat.name: (cat.mean, cat.sigma)})
    with Sim(bench.dir, "fp-workers", settings) as sim:
        cfg = load_run_config(d / "run.toml", config_toml("fpw", d / "out", [cat], sources,
                                                           context_length=32768))
        pipe = Pipeline(cfg, bench.redis.url, sim.url, d / "workers.log")
        stop = threading.Event()
        try:
            pipe.start(2)
            time.sleep(1.0)
            idle = [mem_mb(p.pid) for p in pipe.workers]
            thread = threading.Thread(target=pipe.run, kwargs={"should_stop": stop.is_set},
                                      daemon=True)
            thread.start()
            wait_for(lambda: sim.stats()["running"] >= 2, "two requests in flight")
            busy: list[dict[str, float]] = []
            t_end = time.monotonic() + 4.0
            while time.monotonic() < t_end:
                busy += [mem_mb(p.pid) for p in pipe.workers]
                time.sleep(0.1)
            stop.set()
            thread.join(30)
        finally:
            pipe.close()
    log_path = bench.dir / "noop-workers.log"
    logf = log_path.open("ab")
    rq = subprocess.Popen([PY, "-m", "bench.noop", bench.redis.url, "idle"], env=child_env(),
                          stdout=logf, stderr=subprocess.STDOUT)
    try:
        time.sleep(1.5)
        rq_idle = mem_mb(rq.pid)
    finally:
        if noop.stop([rq]):  # its size is measured: one that outlives its stop is killed
            log(f"{NAME}: the plain RQ worker outlived its stop by {noop.STOP_GRACE_S:g} s "
                "(RQ's pubsub thread, bench/noop.py): killed")

    def peak(ms: list[dict[str, float]], k: str) -> float:
        return max(m[k] for m in ms)

    return {"idle": {k: peak(idle, k) for k in idle[0]}, "busy": {k: peak(busy, k)
                                                                    for k in busy[0]},
            "plain_rq_idle": rq_idle}


# -- producer ------------------------------------------------------------------------------
def _chat_source(path: Path, n: int) -> None:
    topics = ("sorting", "graphs", "proofs", "recipes", "history", "physics", "poetry")
    with path.open("w") as f:
        for i in range(n):
            f.write(f'{{"messages":[{{"role":"user","content":"Question {i}: explain '
                    f'{topics[i % 7]} in detail, step by step, with an example."}}]}}\n')


def producer(bench: Bench, sim: Sim, n: int) -> dict[str, Any]:
    bench.fresh_redis()
    d = bench.run_dir(f"fp-prod-{n}")
    src = d / f"chat-{n}.jsonl"
    _chat_source(src, n)
    cfg_path = d / "run.toml"
    cfg_path.write_text(
        f'run = "fp{n}"\noutput_dir = "{d / "out"}"\ntokenizer = "{QWEN}"\n'
        f"context_length = 32768\n[[category]]\nname = \"chat\"\nsource = \"{src}\"\n"
        f'format = "messages"\ncap_tokens = {2 * FEED_SAMPLES}\n'
        "sampling = { max_new_tokens = 4 }\n")
    cfg = load_run_config(cfg_path, cfg_path.read_text())
    pipe = Pipeline(cfg, bench.redis.url, sim.url, d / "workers.log")
    logf = (d / "producer.log").open("ab")
    proc = None
    try:
        pipe.start_writer()
        pipe.start_workers(4)
        proc = subprocess.Popen([PY, "-m", "tokencap.cli", "run", str(cfg_path)],
                                env=pipe.env(), stdout=logf, stderr=subprocess.STDOUT)
        samples: list[tuple[float, float, int]] = []
        t0 = time.monotonic()
        state = pipe.keys.cat("chat").state
        while proc.poll() is None and time.monotonic() - t0 < PRODUCER_TIMEOUT_S:
            try:
                rss = mem_mb(proc.pid)["rss_mb"]
            except Exception:  # exited between poll() and the read
                break
            samples.append((time.monotonic() - t0, rss,
                            int(pipe.redis.hget(state, "samples") or 0)))
            time.sleep(0.1)
        proc.terminate()
        proc.wait(60)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        pipe.close()
    feeding = [rss for _, rss, done in samples if done > 0]
    return {"source_prompts": n, "source_bytes": src.stat().st_size,
            "rss_mb_peak": max(rss for _, rss, _ in samples),
            "rss_mb_feeding_median": sorted(feeding)[len(feeding) // 2] if feeding else None,
            "committed": samples[-1][2] if samples else 0, "exit_code": proc.returncode}


# -- Redis ---------------------------------------------------------------------------------
def _key_group(key: bytes) -> str:
    k = key.decode()
    if "}:" in k:
        return "tokencap " + k.rsplit("}:", 1)[1]
    if k.startswith("rq:job:"):
        return "rq:job:*"
    if k.startswith("rq:queue:"):
        return "rq:queue:*"
    return "other"


def key_bytes(redis: Any) -> dict[str, int]:
    """MEMORY USAGE of every key, summed per key group."""
    out: dict[str, int] = {}
    for k in redis.scan_iter(count=1000):
        g = _key_group(k)
        out[g] = out.get(g, 0) + int(redis.memory_usage(k, samples=0) or 0)
    return out


def redis_memory(bench: Bench, sim: Sim, prompt_tokens: int) -> dict[str, Any]:
    redis = bench.fresh_redis()
    d = bench.run_dir(f"fp-redis-{prompt_tokens}")
    cat = Cat("mem", 2, 0.0, 4, prompts=JOBS)
    sources = bench.sources(f"fp-redis-{prompt_tokens}", [cat], prompt_tokens, prompt_tokens)
    cfg = load_run_config(d / "run.toml", config_toml(
        "fpr", d / "out", [cat], sources, context_length=32768, high_water=JOBS))
    pipe = Pipeline(cfg, bench.redis.url, sim.url, d / "workers.log")
    try:
        producer = pipe.build()
        base, base_keys = redis.info("memory")["used_memory"], key_bytes(redis)
        while producer.tick():
            pass
        queued, queued_keys = redis.info("memory")["used_memory"], key_bytes(redis)
        fed = pipe.status()["mem"]["pending"]
        pipe.start_writer()
        pipe.start_workers(4)
        pipe.run()
        committed, committed_keys = redis.info("memory")["used_memory"], key_bytes(redis)
        n = pipe.status()["mem"]["samples"]
    finally:
        pipe.close()
    line = sources[cat.name].read_bytes().splitlines()[0]

    def per(keys: dict[str, int], count: int) -> dict[str, float]:
        return {g: round((v - base_keys.get(g, 0)) / count, 1) for g, v in keys.items()
                if v != base_keys.get(g, 0)}

    return {"prompt_tokens": prompt_tokens, "jobs": fed, "committed": n,
            "bytes_per_queued_job": sum(queued_keys.values()) / fed - sum(
                base_keys.values()) / fed,
            "bytes_per_committed_sample": (sum(committed_keys.values()) - sum(
                base_keys.values())) / n,
            "used_memory_per_queued_job": (queued - base) / fed,
            "used_memory_per_committed_sample": (committed - base) / n,
            "queued_bytes_by_key": per(queued_keys, fed),
            "committed_bytes_by_key": per(committed_keys, n),
            "prompt_json_bytes": len(line)}



def run(bench: Bench) -> dict[str, Any]:
    log(f"{NAME}: consumer processes, idle and busy")
    cons = consumers(bench)
    settings = SimSettings(time_scale=1e6, default=(2.0, 0.0), max_running_requests=256)
    with Sim(bench.dir, "fp-instant", settings) as sim:
        prods = {}
        for n in SOURCE_SIZES:
            log(f"{NAME}: producer over a {n:,}-prompt chat source")
            prods[n] = producer(bench, sim, n)
        mems = {}
        for p in PROMPT_SIZES:
            log(f"{NAME}: Redis memory, {JOBS} samples of {p} prompt tokens")
            mems[p] = redis_memory(bench, sim, p)
    small, big = (prods[n] for n in SOURCE_SIZES)
    grow = (big["rss_mb_peak"] - small["rss_mb_peak"]) * 1024 * 1024 / (
        big["source_prompts"] - small["source_prompts"])
    rows = [
        row(NAME, "consumer RSS idle (tokencap vs plain RQ worker)", cons["idle"]["rss_mb"],
            cons["plain_rq_idle"]["rss_mb"], "MB", f"<= {TARGET_MB:g}",
            cons["idle"]["rss_mb"] <= TARGET_MB),
        row(NAME, "consumer RSS busy (tokencap vs plain RQ worker)", cons["busy"]["rss_mb"],
            cons["plain_rq_idle"]["rss_mb"], "MB", f"<= {TARGET_MB:g}",
            cons["busy"]["rss_mb"] <= TARGET_MB),
        row(NAME, "consumer PSS idle", cons["idle"]["pss_mb"], None, "MB",
            f"<= {TARGET_MB:g}", cons["idle"]["pss_mb"] <= TARGET_MB),
        row(NAME, "consumer PSS busy", cons["busy"]["pss_mb"], None, "MB",
            f"<= {TARGET_MB:g}", cons["busy"]["pss_mb"] <= TARGET_MB),
        row(NAME, "producer RSS feeding, 1M vs 100k prompts", big["rss_mb_feeding_median"],
            small["rss_mb_feeding_median"], "MB"),
        row(NAME, "producer RSS growth per extra source prompt", grow, None, "B",
            "flat (index only)"),
        row(NAME, "producer RSS growth vs source file growth",
            big["rss_mb_peak"] - small["rss_mb_peak"],
            (big["source_bytes"] - small["source_bytes"]) / 2**20, "MB"),
    ]
    for p, m in mems.items():
        rows.append(row(NAME, f"Redis bytes per queued job ({p}-token prompt) vs prompt JSON",
                        m["bytes_per_queued_job"], m["prompt_json_bytes"], "B"))
    m = mems[PROMPT_SIZES[0]]
    rows.append(row(NAME, "Redis bytes per committed sample (after write)",
                    m["bytes_per_committed_sample"], None, "B"))
    return {"figures": {"consumers": cons, "producer": prods, "redis": mems,
                        "producer_rss_bytes_per_prompt": grow, "target_mb": TARGET_MB},
            "rows": rows}
