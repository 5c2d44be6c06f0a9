"""Adaptive concurrency: the engine's queue stays short while throughput matches the best
fixed worker count.

One simulator with a running batch of BATCH. Fixed settings run FIXED worker counts with no
gate; the adaptive run starts 4 x BATCH workers with `adaptive_max_queue = MAX_QUEUE`.
Throughput = simulator-generated tokens between two /_sim/stats snapshots (WARMUP_S after the
load starts, WINDOW_S apart) per wall second; the queue is sampled every SAMPLE_S meanwhile.
Target: adaptive throughput within 3% of the best fixed setting, queue <= a set bound. The
queue's max comes from the start: the 32 workers read an empty queue at once and all pass
(no shared state tells one worker what the others just sent), and that herd drains at the
engine's pace; the second half of the window shows the gate's steady state.
"""

from __future__ import annotations

from typing import Any

from bench.context import Bench, log, row
from bench.measure import Pipeline, measure_window
from bench.sim import Sim, SimSettings, window_figures
from bench.sources import Cat, config_toml, load_run_config

NAME = "adaptive"
BATCH = 8
FIXED = (8, 16)
ADAPTIVE_WORKERS = 4 * BATCH
MAX_QUEUE = 2
QUEUE_BOUND = MAX_QUEUE + BATCH  # the gate's bound plus workers racing between metric reads
TIME_SCALE = 10.0  # a 500-token output lasts ~2 s of wall time at batch 8
WARMUP_S = 3.0
WINDOW_S = 6.0
SAMPLE_S = 0.1
CATS = [Cat("chat", 500, 0.8, 2048, prompts=2000, cap=10**9)]


def measure(bench: Bench, sim: Sim, sources: dict, workers: int,
            max_queue: int | None) -> dict[str, Any]:
    bench.fresh_redis()
    tag = f"adapt-{workers}-{max_queue}"
    d = bench.run_dir(tag)
    top: dict[str, Any] = {"seed": 5, "context_length": 32768}
    if max_queue is not None:
        top["adaptive_max_queue"] = max_queue
    cfg = load_run_config(d / "run.toml", config_toml(tag.replace("-", "_"), d / "out", CATS,
                                                      sources, **top))
    pipe = Pipeline(cfg, bench.redis.url, sim.url, d / "workers.log")
    try:
        pipe.start(workers, sim)
        a, b, wall, samples, _ = measure_window(pipe, sim.stats, WARMUP_S, WINDOW_S,
                                                sample=lambda: sim.stats()["queued"],
                                                sample_s=SAMPLE_S)
        out = window_figures(a, b, wall)
        queued = [v for _t, v in samples]
        out["queue_max"] = max(queued) if queued else None
        out["queue_mean"] = sum(queued) / len(queued) if queued else None
        # the window's second half: what is left of the start (every worker reads an empty
        # queue at once and passes) has drained by then
        late = queued[len(queued) // 2:]
        out["queue_max_late"] = max(late) if late else None
    finally:
        pipe.close()
    sim.wait_idle()
    return out


def run(bench: Bench) -> dict[str, Any]:
    sources = bench.sources("adapt", CATS, 200, 1000)
    settings = SimSettings(time_scale=TIME_SCALE, max_running_requests=BATCH,
                           lengths={c.name: (c.mean, c.sigma) for c in CATS})
    figures: dict[str, Any] = {}
    with Sim(bench.dir, "adaptive", settings) as sim:
        for n in FIXED:
            log(f"{NAME}: {n} workers, no gate")
            figures[f"fixed_{n}"] = measure(bench, sim, sources, n, None)
        log(f"{NAME}: {ADAPTIVE_WORKERS} workers, adaptive_max_queue={MAX_QUEUE}")
        figures["adaptive"] = measure(bench, sim, sources, ADAPTIVE_WORKERS, MAX_QUEUE)
    best_key = max((k for k in figures if k.startswith("fixed_")),
                   key=lambda k: figures[k]["tok_s"])
    best, adapt = figures[best_key], figures["adaptive"]
    ratio = adapt["tok_s"] / best["tok_s"]
    rows = [
        row(NAME, f"tok/s adaptive x{ADAPTIVE_WORKERS} workers vs best fixed ({best_key})",
            adapt["tok_s"], best["tok_s"], "tok/s", ">= 0.97", ratio >= 0.97),
        row(NAME, "engine queue max, adaptive (vs the same with no gate at 16 workers)",
            adapt["queue_max"], figures["fixed_16"]["queue_max"], "req",
            f"<= {QUEUE_BOUND}", adapt["queue_max"] is not None
            and adapt["queue_max"] <= QUEUE_BOUND),
        row(NAME, "engine queue max in the window's second half (the start drained)",
            adapt["queue_max_late"], figures["fixed_16"]["queue_max_late"], "req"),
        row(NAME, "engine queue mean, adaptive vs no gate at 16 workers", adapt["queue_mean"],
            figures["fixed_16"]["queue_mean"], "req"),
    ]
    return {"figures": figures, "rows": rows,
            "settings": {"batch": BATCH, "fixed": FIXED, "adaptive_workers": ADAPTIVE_WORKERS,
                         "adaptive_max_queue": MAX_QUEUE, "time_scale": TIME_SCALE,
                         "warmup_s": WARMUP_S, "window_s": WINDOW_S}}
