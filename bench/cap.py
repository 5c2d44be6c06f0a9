"""Cap precision: overshoot per category as a fraction of its cap, for the pipeline's
admission policy and for stop-after-passing (the old tool: count after each response, stop
feeding a category once past its cap, everything in flight still counts).

Eight categories with long-tailed outputs (lognormal sigma 1.0, means 300..2000 tokens,
max_new_tokens 2048..8192, so some outputs are cut at the maximum) and caps CAPS x scale,
64 in flight. At the default scale the caps are 244..306 x max_new_tokens (500k..2.5M
tokens), the ratio of a real run (a 10M cap is 305 x a 32,768-token max_new_tokens):
overshoot is at best a fraction of one output, so it scales with max_new_tokens, not the cap.
Both policies run on the same prompts in the same (the producer's seeded) order and draw
the same output lengths (the simulator derives a length from the prompt); the baseline's
simulator runs BASELINE_SPEEDUP times faster (its counting does not depend on time). The
pipeline's simulator runs at TIME_SCALE; its workers' heartbeat (`heartbeat_s`) re-estimates
reservations every HEARTBEAT_SIM_S simulated seconds (a real worker's 2 s is ~30-100 tokens
of one request; 15 simulated s here is ~225), with a LEASE_S wall-second lease.

The pipeline run also keeps a timeline of /_sim/stats for the tail scenario.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

from bench.context import Bench, log, row
from bench.direct import Feed, stop_after_passing
from bench.measure import Pipeline, Sampler
from bench.sim import Sim, SimSettings
from bench.sources import Cat, config_toml, load_run_config, ordered_prompts
from sglang_sim.testing import time_fraction_below

NAME = "cap"
SEED = 23
N = 64
SIGMA = 1.0
# (name, mean output tokens, max_new_tokens, cap at scale 1)
MIX = [
    ("chat", 300, 2048, 200_000), ("qa", 500, 2048, 314_000),
    ("code", 700, 4096, 429_000), ("instruct", 900, 4096, 543_000),
    ("math", 1200, 8192, 657_000), ("agent", 1500, 8192, 771_000),
    ("proofs", 1800, 8192, 886_000), ("reasoning", 2000, 8192, 1_000_000),
]
# BENCH_CAP_SCALE=1.25 (or 0.5) runs the smaller caps of earlier reports.
DEFAULT_SCALE = 2.5
TIME_SCALE = 60.0
BASELINE_SPEEDUP = 4.0
HEARTBEAT_SIM_S = 15.0
HEARTBEAT_S = round(HEARTBEAT_SIM_S / TIME_SCALE, 3)
LEASE_S = 3.0
PROMPT_TOKENS = (200, 1500)
TIMELINE_S = 0.2
# Wall-clock limits that keep the whole benchmark under 10 minutes; a run stopped by one is
# reported as stopped_early (its figures then cover what ran).
RUN_DEADLINE_S = 300.0
SEQUENTIAL_DEADLINE_S = 25.0
TARGET_FRAC = 0.005


def cats(scale: float | None = None) -> list[Cat]:
    if scale is None:
        scale = float(os.environ.get("BENCH_CAP_SCALE", DEFAULT_SCALE))
    out = []
    for name, mean, max_new, cap in MIX:
        c = int(cap * scale)
        out.append(Cat(name, mean, SIGMA, max_new, cap=c, prompts=int(2.5 * c / mean) + 300))
    return out


def sim_settings(mix: list[Cat], speedup: float = 1.0) -> SimSettings:
    return SimSettings(time_scale=TIME_SCALE * speedup,
                       lengths={c.name: (c.mean, c.sigma) for c in mix})


class _Count(logging.Handler):
    """Counts the producer's 'lease expired in flight' warnings (false reaps distort)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "lease expired in flight" in record.getMessage():
            self.n += 1


class _Calls:
    """Wraps one producer's feed, unpark and reap (on the instance, for measurement only):
    calls, what they returned (samples) and the seconds they took."""

    def __init__(self, producer: Any) -> None:
        self.stats: dict[str, float] = {}
        for owner, name in ((producer, "feed"), (producer, "unpark"),
                            (producer.recovery, "reap")):
            setattr(owner, name, self._wrap(name, getattr(owner, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def wrapped(*args: Any) -> int:
            t0 = time.perf_counter()
            out = fn(*args)
            s = self.stats
            s[f"{name}_s"] = s.get(f"{name}_s", 0.0) + time.perf_counter() - t0
            s[f"{name}_calls"] = s.get(f"{name}_calls", 0) + 1
            # samples each returned (feed: positions read; unpark: given back or skipped;
            # reap: enqueued again)
            s[f"{name}_samples"] = s.get(f"{name}_samples", 0) + out
            return out

        return wrapped


def run_pipeline(bench: Bench, sim: Sim, mix: list[Cat], *, sequential: bool) -> dict[str, Any]:
    """The whole pipeline to every cap, interleaved or one category after another, with a
    /_sim/stats timeline. Returns status, wall seconds, final stats and the timeline."""
    bench.fresh_redis()
    tag = "seq" if sequential else "int"
    d = bench.run_dir(f"cap-{tag}")
    sources = bench.sources("cap", mix, *PROMPT_TOKENS)
    cfg = load_run_config(d / "run.toml", config_toml(
        f"cap{tag}", d / "out", mix, sources, seed=SEED, lease_s=LEASE_S,
        heartbeat_s=HEARTBEAT_S,
        context_length=32768))
    pipe = Pipeline(cfg, bench.redis.url, sim.url, d / "workers.log")
    counter = _Count()
    logging.getLogger("producer").addHandler(counter)
    try:
        producer = pipe.start(N, sim)
        calls = _Calls(producer)
        sim.reset()
        sampler = Sampler(lambda: (sim.stats(), pipe.status()), TIMELINE_S)
        t0 = time.monotonic()
        deadline = t0 + (SEQUENTIAL_DEADLINE_S if sequential else RUN_DEADLINE_S)
        past = lambda: time.monotonic() > deadline  # noqa: E731
        sampler.start()
        if sequential:
            feeds = dict(producer.feeds)
            for name, feed in feeds.items():
                producer.feeds = {name: feed}
                pipe.run(should_stop=past)
            producer.feeds = feeds
        else:
            pipe.run(should_stop=past)
        wall = time.monotonic() - t0
        stopped_early = past()
        if stopped_early:
            log(f"{NAME}: {tag} run stopped at its {deadline - t0:.0f} s deadline")
            pipe.close()
        sim.wait_idle()
        time.sleep(2 * TIMELINE_S)
        timeline = sampler.stop()
        status = pipe.status()
        sources_left = {name: not f.exhausted for name, f in producer.feeds.items()}
    finally:
        logging.getLogger("producer").removeHandler(counter)
        pipe.close()
    final = timeline[-1][1][0]
    committed = sum(st["samples"] for st in status.values())
    jobs = sum(calls.stats.get(f"{k}_samples", 0) for k in ("feed", "unpark", "reap"))
    return {"status": status, "wall_s": wall, "final": final, "timeline": timeline,
            "reaped_in_flight": counter.n, "source_left": sources_left,
            "engine_requests": final["requests_total"], "producer_calls": calls.stats,
            "stopped_early": stopped_early,
            "rq_jobs_per_committed": jobs / committed if committed else 0.0}


def baseline(bench: Bench, mix: list[Cat]) -> dict[str, Any]:
    """The stop-after-passing client on its own (faster) simulator, once per bench run
    (shared with the tail scenario: it never holds a sample back, so the time its batch
    spends below 90% is the final drain any policy that stops at caps has)."""
    key = f"cap:baseline:{[c.cap for c in mix]}"
    if key in bench.cache:
        return bench.cache[key]
    sources = bench.sources("cap", mix, *PROMPT_TOKENS)
    with Sim(bench.dir, "cap-base", sim_settings(mix, BASELINE_SPEEDUP)) as sim:
        log(f"{NAME}: stop-after-passing client, {N} in flight")
        feeds = [Feed(c, ordered_prompts(sources[c.name], SEED)) for c in mix]
        sim.reset()
        wall = stop_after_passing(sim.url, feeds, N)
        stats = sim.stats()
    out = {"wall_s": wall, "counted": {f.cat.name: f.counted for f in feeds},
           "samples": {f.cat.name: f.samples for f in feeds},
           "source_left": {f.cat.name: f.pos < len(f.prompts) for f in feeds},
           "frac_below_90": time_fraction_below(stats, threshold(N), include_idle=True),
           "sim_s": stats["sim_time_s"]}
    bench.cache[key] = out
    return out


def interleaved(bench: Bench, sim: Sim, mix: list[Cat]) -> dict[str, Any]:
    """The interleaved pipeline run, shared with the tail scenario within one bench run."""
    key = f"cap:interleaved:{[c.cap for c in mix]}"
    if key not in bench.cache:
        bench.cache[key] = run_pipeline(bench, sim, mix, sequential=False)
    return bench.cache[key]


def run(bench: Bench) -> dict[str, Any]:
    mix = cats()
    with Sim(bench.dir, "cap", sim_settings(mix)) as sim:
        log(f"{NAME}: pipeline, {N} consumers, caps {mix[0].cap:,}..{mix[-1].cap:,}")
        pipe = interleaved(bench, sim, mix)
    base = baseline(bench, mix)
    per_cat, rows = {}, []
    below = 0
    for c in mix:
        st = pipe["status"][c.name]
        p_over = (st["used"] - c.cap) / c.cap
        b_over = (base["counted"][c.name] - c.cap) / c.cap
        closed_below = st["used"] < c.cap and pipe["source_left"][c.name]
        below += int(closed_below)
        per_cat[c.name] = {"cap": c.cap, "mean_tokens": c.mean, "max_new_tokens": c.max_new,
                           "pipeline_used": st["used"], "pipeline_overshoot_frac": p_over,
                           "pipeline_samples": st["samples"], "pipeline_state": st["state"],
                           "pipeline_skipped": st["skipped"], "closed_below_cap": closed_below,
                           "stop_after_passing_counted": base["counted"][c.name],
                           "stop_after_passing_overshoot_frac": b_over,
                           "stop_after_passing_samples": base["samples"][c.name]}
        rows.append(row(NAME, f"overshoot/cap {c.name} ({c.cap // 1000}k, mean {c.mean:g})",
                        100 * p_over, 100 * b_over, "%", f"<= {100 * TARGET_FRAC:g}%",
                        p_over <= TARGET_FRAC and not closed_below))
    worst_p = max(v["pipeline_overshoot_frac"] for v in per_cat.values())
    worst_b = max(v["stop_after_passing_overshoot_frac"] for v in per_cat.values())
    rows.append(row(NAME, "worst overshoot/cap (pipeline vs stop-after-passing)",
                    100 * worst_p, 100 * worst_b, "%", f"<= {100 * TARGET_FRAC:g}%",
                    worst_p <= TARGET_FRAC))
    rows.append(row(NAME, "categories closed below cap with source left", below, None, "",
                    "0", below == 0))
    sent = pipe["engine_requests"]
    committed = sum(st["samples"] for st in pipe["status"].values())
    rows.append(row(NAME, "engine requests per committed sample (pipeline)", sent / committed,
                    None, "", "1.0 (no re-sends)"))
    rows.append(row(NAME, "RQ jobs run per committed sample (fed+unparked+reaped)",
                    pipe["rq_jobs_per_committed"], None, ""))
    return {
        "figures": {"per_category": per_cat, "worst_pipeline": worst_p,
                    "worst_stop_after_passing": worst_b, "closed_below_cap": below,
                    "pipeline_wall_s": pipe["wall_s"], "baseline_wall_s": base["wall_s"],
                    "pipeline_reaped_in_flight": pipe["reaped_in_flight"],
                    "pipeline_engine_requests": sent, "pipeline_committed": committed,
                    "pipeline_producer_calls": pipe["producer_calls"],
                    "pipeline_rq_jobs_per_committed": pipe["rq_jobs_per_committed"]},
        "settings": {"consumers": N, "time_scale": TIME_SCALE,
                     "baseline_time_scale": TIME_SCALE * BASELINE_SPEEDUP, "lease_s": LEASE_S,
                     "heartbeat_s": HEARTBEAT_S,
                     "heartbeat_sim_s": HEARTBEAT_SIM_S, "sigma": SIGMA, "seed": SEED,
                     "prompt_tokens": PROMPT_TOKENS, "cap_scale": mix[0].cap / MIX[0][3],
                     "target": f"overshoot <= {TARGET_FRAC:.1%} of cap"},
        "rows": rows,
    }


def threshold(n: int, frac: float = 0.9) -> int:
    """Smallest batch size that is not below `frac` of `n`."""
    return math.ceil(frac * n)
