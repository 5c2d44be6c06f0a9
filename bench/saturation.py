"""Saturation: output tok/s of the whole pipeline over a direct asyncio client, at N = 16, 64.

Both drive one simulator process with the same settings and length profiles, send the same
prompts (each category's input_ids in the producer's seeded order; the simulator derives a
request's output length from its prompt ids, so equal prompts give equal outputs), round
robin over the same four categories, N requests in flight (N consumer processes for the
pipeline). Throughput = simulator-generated tokens between two /_sim/stats snapshots taken
WARMUP_S after the load starts and WINDOW_S apart, divided by the window's wall seconds.
The direct client at each N also documents the engine's own ceiling at that batch.
"""

from __future__ import annotations

from statistics import mean
from typing import Any

from bench.context import Bench, log, row
from bench.direct import Feed, saturate
from bench.measure import Pipeline, measure_window, mem_mb
from bench.sim import Sim, SimSettings, window_figures
from bench.sources import Cat, config_toml, load_run_config, ordered_prompts

NAME = "saturation"
SEED = 11
# Realistic per-category mixes: means 300..2000 tokens, max_new_tokens 2048..8192.
CATS = [
    Cat("chat", 300, 0.8, 2048, prompts=1200),
    Cat("code", 700, 0.8, 4096, prompts=1200),
    Cat("math", 1200, 0.9, 8192, prompts=1200),
    Cat("reasoning", 2000, 0.9, 8192, prompts=1200),
]
PROMPT_TOKENS = (200, 2000)
# x25: a 1,000-token output lasts 68 simulated s at batch 64, i.e. 2.7 s of wall time.
TIME_SCALE = 25.0
NS = (16, 64)
WARMUP_S = 4.0
WINDOW_S = 10.0
TARGET = 0.97


def _snapshot(sim: Sim) -> dict[str, Any]:
    stats = sim.stats()
    stats["_sim_cpu_s"] = sim.cpu_s()
    return stats


def _figures(a: dict, b: dict, wall_s: float) -> dict[str, float]:
    out = window_figures(a, b, wall_s)
    out["sim_cpu_frac"] = (b["_sim_cpu_s"] - a["_sim_cpu_s"]) / wall_s
    return out


def direct(sim: Sim, sources: dict, n: int) -> dict[str, float]:
    feeds = [Feed(c, ordered_prompts(sources[c.name], SEED)) for c in CATS]
    a, b, wall = saturate(sim.url, feeds, n, WARMUP_S, WINDOW_S, lambda: _snapshot(sim))
    sim.wait_idle()
    return _figures(a, b, wall)


def pipeline(bench: Bench, sim: Sim, sources: dict, n: int) -> dict[str, Any]:
    bench.fresh_redis()
    d = bench.run_dir(f"sat-{n}")
    cfg = load_run_config(d / "run.toml", config_toml(
        f"sat{n}", d / "out", CATS, sources, seed=SEED, context_length=32768))
    pipe = Pipeline(cfg, bench.redis.url, sim.url, d / "workers.log")
    try:
        pipe.start(n, sim)
        a, b, wall, _samples, mems = measure_window(
            pipe, lambda: _snapshot(sim), WARMUP_S, WINDOW_S,
            at_end=lambda: [mem_mb(p.pid) for p in pipe.workers])
        out: dict[str, Any] = _figures(a, b, wall)
        out["worker_rss_mb_max"] = max(m["rss_mb"] for m in mems)
        out["worker_pss_mb_mean"] = mean(m["pss_mb"] for m in mems)
        out["committed"] = sum(st["samples"] for st in pipe.status().values())
    finally:
        pipe.close()
    sim.wait_idle()
    return out


def run(bench: Bench) -> dict[str, Any]:
    sources = bench.sources("sat", CATS, *PROMPT_TOKENS)
    settings = SimSettings(time_scale=TIME_SCALE,
                           lengths={c.name: (c.mean, c.sigma) for c in CATS})
    rows, figures = [], {}
    with Sim(bench.dir, "saturation", settings) as sim:
        for n in NS:
            log(f"{NAME}: direct client, N={n}")
            base = direct(sim, sources, n)
            log(f"{NAME}: pipeline, N={n} consumers")
            pipe = pipeline(bench, sim, sources, n)
            ratio = pipe["tok_s"] / base["tok_s"]
            limit = settings.engine_tok_s(n)
            figures[f"N={n}"] = {"pipeline": pipe, "direct": base, "ratio": ratio,
                                 "engine_model_tok_s": limit, "target": f">= {TARGET}"}
            rows.append(row(NAME, f"tok/s N={n} (pipeline vs direct)", pipe["tok_s"],
                            base["tok_s"], "tok/s", f">= {TARGET}", ratio >= TARGET))
            rows.append(row(NAME, f"mean batch N={n} (pipeline vs direct)", pipe["mean_batch"],
                            base["mean_batch"], "req"))
            rows.append(row(NAME, f"engine ceiling N={n} (direct vs model)", base["tok_s"],
                            limit, "tok/s"))
    return {
        "figures": figures,
        "settings": {"time_scale": TIME_SCALE, "warmup_s": WARMUP_S, "window_s": WINDOW_S,
                     "prompt_tokens": PROMPT_TOKENS, "seed": SEED,
                     "categories": [c.__dict__ for c in CATS],
                     "window": "sim generated_tokens_total between two /_sim/stats snapshots "
                               f"{WARMUP_S:g} s after the load starts, {WINDOW_S:g} s apart"},
        "rows": rows,
    }
